"""HMC's and NUTS's trajectories on a classification split against the posterior's longest scale (issue 26).

On ``benchmarks/classification.py``'s model and split (``Linear(D, 50) - ReLU - Linear(50, K)``, ``Normal(0, 1)``
prior, ``Categorical`` likelihood; ``bp.fit(..., seed=split)`` at the engine's defaults, ``--option key=value`` for
experiments), per chain: the adapted step size ``h``, the mean leapfrog steps per draw ``L`` (NUTS: and its tree
depth), the trajectory length ``T = L h`` in the adapted metric, the range of the adapted (diagonal) inverse mass
matrix, and the posterior's longest scale in that metric: ``sd_max``, the square root of the largest eigenvalue of
the covariance of the chain's draws whitened by its own metric (``z / sqrt(M^-1)``). Every coordinate's marginal sd
is ~1 in that metric, and on a Gaussian a trajectory of length ``T`` turns the direction of sd ``s`` by ``T / s``
radians: ``T`` near pi is half a period (an antithetic draw), ``T << 1`` a random walk of short steps (strongly
autocorrelated draws). ``sd_max`` is an upper estimate, and a poor one where a chain has fewer effective draws
``n`` than coordinates ``D``: independent draws of unit sd already give about ``1 + sqrt(D / n)`` (Marchenko-Pastur),
and autocorrelated ones more; read ``T`` against 1 first. ``ess_top``: the bulk ESS (ArviZ, over chains) of the
draws' projection on chain 0's direction of ``sd_max`` (the slowest-looking direction). With them the fit's
function-space checks (``classification.chain_scores``: R-hat and bulk ESS of ``f`` at the training and test inputs)
and its fit time.

``--dataset gaussian``: the exact Gaussian posterior of ``tests/infer/test_mcmc.py``'s HMC mixing test (Bayesian linear
regression, ``tests/blr.py``'s ``make_blr(n=200, d=5, noise=1.0, seed=0)``: 5 correlated inputs, known noise), one
chain of 500 draws per seed (``--splits`` are the seeds there), as in that test: per seed the step size, the steps per
draw, the smallest bulk ESS over the 6 coordinates and the fit time (what a longer default trajectory would cost where
the default already mixes).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/hmc_trajectory.py --splits 2 --method hmc
    OMP_NUM_THREADS=1 python benchmarks/hmc_trajectory.py --splits 2 --method hmc --option num_leapfrog=128 --tag L128

appends one row per chain to ``trajectory_<dataset>.csv`` in ``--out`` (default
``benchmarks/results/hmc_trajectory/``) and rewrites ``trajectory_<dataset>.md`` (headed by the run's provenance)
from it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import arviz as az
import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import results_dir, write_result  # noqa: E402
from classification import chain_scores, load_dataset, make_model, make_split  # noqa: E402
from uci import parse_options  # noqa: E402

TESTS = Path(__file__).resolve().parents[1] / "tests"  # tests/blr.py: the exact Gaussian posterior of the HMC test


def longest_scale(draws: torch.Tensor, inverse_mass: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``(sd_max, top)``: the largest sd of ``draws`` (``(n, D)``, unconstrained) whitened by the diagonal
    ``inverse_mass`` (``(D,)``), and its unit direction (in whitened coordinates)."""
    w = (draws.double() / inverse_mass.double().sqrt()).numpy()
    eig, vec = np.linalg.eigh(np.cov(w, rowvar=False))
    return float(math.sqrt(eig[-1])), torch.from_numpy(vec[:, -1])


def chain_rows(post: bp.Posterior) -> list[dict]:
    """One row per chain: step size, steps per draw, trajectory length, metric range and whitened scales."""
    names = sorted(post.samples)
    flat = torch.cat([post.samples[n].reshape(post.num_chains, post.num_draws, -1) for n in names], -1)
    mass = post.history["inverse_mass_matrix"]
    stats, rows, projections = post.sample_stats, [], []
    for c in range(post.num_chains):
        inv = mass[c] if mass[c].dim() == 1 else mass[c].diagonal()
        sd_max, top = longest_scale(flat[c], inv)
        step = float(stats["step_size"][c].double().mean())
        steps = float(stats["n_steps"][c].double().mean())
        rows.append(
            dict(
                chain=c,
                step_size=step,
                n_steps_mean=steps,
                tree_depth_mean=float(stats["tree_depth"][c].double().mean()) if "tree_depth" in stats else math.nan,
                trajectory=step * steps,
                inv_mass_min=float(inv.min()),
                inv_mass_max=float(inv.max()),
                sd_max=sd_max,
                turn_top=step * steps / sd_max,
                accept=float(stats["acceptance_rate"][c].double().mean()),
                diverging=int(stats["diverging"][c].sum()) if "diverging" in stats else 0,
            )
        )
        projections.append(top)
    # every chain's draws projected on chain 0's slowest direction (whitened by chain 0's metric): its bulk ESS
    inv0 = mass[0] if mass[0].dim() == 1 else mass[0].diagonal()
    proj = (flat.double() / inv0.double().sqrt()) @ projections[0]
    ess_top = float(az.ess(proj.numpy()))
    for row in rows:
        row["ess_top"] = ess_top
    return rows


def run_gaussian(seed: int, method: str, options: dict, tag: str) -> list[dict]:
    """One row: ``method`` on the exact Gaussian posterior of the HMC mixing test (module docstring)."""
    sys.path.insert(0, str(TESTS))
    try:
        from blr import make_blr
    finally:
        sys.path.remove(str(TESTS))
    blr = make_blr(n=200, d=5, noise=1.0, seed=0)
    settings = dict(dict(num_samples=500, num_chains=1), **options)
    start = time.perf_counter()
    post = bp.fit(blr.model(), blr.x, blr.y, method=method, seed=seed, progress=False, **settings)
    seconds = time.perf_counter() - start
    draws = torch.cat([post.samples[n].reshape(post.num_chains, post.num_draws, -1) for n in sorted(post.samples)], -1)
    ess = [float(az.ess(draws[..., i].double().numpy())) for i in range(draws.shape[-1])]
    stats = post.sample_stats
    step, steps = float(stats["step_size"].double().mean()), float(stats["n_steps"].double().mean())
    return [
        dict(
            dataset="gaussian",
            split=seed,
            method=method,
            tag=tag,
            options=repr(options),
            time_s=seconds,
            draws=post.num_chains * post.num_draws,
            chain=0,
            step_size=step,
            n_steps_mean=steps,
            trajectory=step * steps,
            accept=float(stats["acceptance_rate"].double().mean()),
            ess_min=min(ess),
        )
    ]


def run(dataset: str, split: int, method: str, options: dict, tag: str) -> list[dict]:
    if dataset == "gaussian":
        return run_gaussian(split, method, options, tag)
    x, y = load_dataset(dataset)
    s = make_split(x, y, split)
    num_classes = int(y.max()) + 1
    model = make_model(s["x_train"].shape[1], num_classes, split)
    start = time.perf_counter()
    post = bp.fit(model, s["x_train"], s["y_train"], method=method, seed=split, progress=False, **options)
    seconds = time.perf_counter() - start
    checks = chain_scores(post, s["x_test"], s["y_test"])
    keep = ("rhat_f_max", "ess_f_min", "rhat_f_test_max", "ess_f_test_min", "nll_chain_se")
    common = dict(dataset=dataset, split=split, method=method, tag=tag, options=repr(options), time_s=seconds)
    common.update({k: checks[k] for k in keep})
    common["draws"] = post.num_chains * post.num_draws
    return [dict(common, **row) for row in chain_rows(post)]


def gaussian_markdown(rows: pd.DataFrame) -> str:
    """Per seed of the exact Gaussian: step size, steps per draw, trajectory, smallest bulk ESS, fit time."""
    lines = [
        "# HMC on the exact Gaussian posterior of tests/infer/test_mcmc.py's mixing test",
        "",
        "One chain of 500 draws per seed (benchmarks/hmc_trajectory.py's docstring); ESS: the smallest bulk ESS over "
        "the 6 coordinates.",
        "",
        "| method | tag | seed | h | L | T | accept | ESS (of draws) | fit s |",
        "|" + "---|" * 9,
    ]
    for _, r in rows.iterrows():
        lines.append(
            f"| {r.method} | {r.tag} | {r.split} | {r.step_size:.3f} | {r.n_steps_mean:.1f} | {r.trajectory:.2f} | "
            f"{r.accept:.2f} | {r.ess_min:.0f} ({r.draws}) | {r.time_s:.1f} |"
        )
    return "\n".join(lines) + "\n"


def markdown(rows: pd.DataFrame) -> str:
    """Per fit (dataset, split, method, tag): the chains' ranges and the function-space checks."""
    if set(rows.dataset) == {"gaussian"}:
        return gaussian_markdown(rows)
    lines = [
        "# HMC's and NUTS's trajectories against the posterior's longest scale",
        "",
        "benchmarks/hmc_trajectory.py's docstring says what each column is; per fit, the range over its chains "
        "(step size h, leapfrog steps per draw L, trajectory T = L h in the adapted metric, the whitened posterior's "
        "largest sd, T / sd_max in radians) and the fit's checks (R-hat and bulk ESS of f at the training inputs; "
        "ESS of the draws' projection on the slowest direction).",
        "",
        "| dataset | split | method | tag | h | L | tree depth | T | sd_max | T / sd_max | inv. mass range | accept | "
        "ESS top dir. | R-hat f | ESS f (of draws) | fit s |",
        "|" + "---|" * 16,
    ]
    span = lambda v, f: f"{v.min():{f}}" if v.min() == v.max() else f"{v.min():{f}}-{v.max():{f}}"  # noqa: E731
    for key, g in rows.groupby(["dataset", "split", "method", "tag"], sort=False):
        first = g.iloc[0]
        lines.append(
            "| "
            + " | ".join(
                [
                    *map(str, key),
                    span(g.step_size, ".4f"),
                    span(g.n_steps_mean, ".0f"),
                    "-" if g.tree_depth_mean.isna().all() else span(g.tree_depth_mean, ".1f"),
                    span(g.trajectory, ".2f"),
                    span(g.sd_max, ".1f"),
                    span(g.turn_top, ".3f"),
                    f"{g.inv_mass_min.min():.2g}-{g.inv_mass_max.max():.2g}",
                    span(g.accept, ".2f"),
                    f"{first.ess_top:.0f}",
                    f"{first.rhat_f_max:.2f}",
                    f"{first.ess_f_min:.0f} ({first.draws})",
                    f"{first.time_s:.0f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="breast_cancer", help="a classification.py set, or gaussian")
    parser.add_argument("--splits", default="2", help="a comma list of split numbers")
    parser.add_argument("--method", default="hmc", help="hmc or nuts")
    parser.add_argument("--option", action="append", default=[], help="key=value, e.g. num_leapfrog=128")
    parser.add_argument("--tag", default="defaults", help="the fit's label in the table")
    parser.add_argument("--note", default="", help="a line added under the table (e.g. the machine's load)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    options = parse_options([f"{args.method}:{o}" for o in args.option]).get(args.method, {})
    out = results_dir("hmc_trajectory", args.out)
    path = out / f"trajectory_{args.dataset}.csv"
    rows = pd.read_csv(path) if path.exists() else pd.DataFrame()
    for split in (int(k) for k in args.splits.split(",")):
        new = pd.DataFrame(run(args.dataset, split, args.method, options, args.tag))
        rows = pd.concat([rows, new], ignore_index=True)
        rows.to_csv(path, index=False)
        print(markdown(new), flush=True)
    write_result(out / f"trajectory_{args.dataset}.md", markdown(rows) + (f"\n{args.note}\n" if args.note else ""))
    return rows


if __name__ == "__main__":
    main()
