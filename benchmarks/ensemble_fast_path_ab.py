"""Does the ensemble's fast path change its answer? A paired A/B over seeds at the ensemble's defaults.

The tutorial's gap regression (zoo ``mlp_regression``: 1-50-1 tanh, Normal(0, 1) prior, learned noise under
HalfNormal(0.5), 80 rows) fitted with ``method="ensemble"`` at its defaults, once with ``fast_path=True`` (the
analytic potential) and once with ``fast_path=False`` (Pyro's traced potential), for seeds 0, 5, 10, ... (the
members use ``seed + k``, k < 5, so no member is shared between seeds). Per fit: the epistemic sd of ``f`` in the
gap and on the data (each member once, no resampling), their ratio, test RMSE and NLL (``Entry.evaluate``), the
training loss reached (``U_c`` on the full data at each member's end, mean over members) and the members' noise
sd. The summary gives, per metric, the mean of each path and the mean paired difference (fast - pyro) with its
standard error over seeds.

``trajectory()`` (run with the A/B, or alone with ``--trajectory``) follows one member (seed 0) with Adam at the
ensemble's defaults on each path from the same start, and at some steps evaluates both paths' loss ``U_c`` and
gradient at the fast path's weights, in float32 and (on a float64 copy of the model) in float64; as a control, a
second fast-path trajectory starts one float32 ulp away in one bias.

Usage: ``python benchmarks/ensemble_fast_path_ab.py [--seeds 12] [--out DIR]`` writes, in
``benchmarks/results/ensemble_fast_path_ab/``, ``results.csv`` (one row per seed and path, appended as fits finish)
and ``results.md`` (headed by the run's provenance);
``--summarize`` only rewrites the Markdown from an existing CSV (and the trajectory table).
"""

from __future__ import annotations

import argparse
import copy
import time

import pandas as pd
import torch
from _common import markdown, results_dir, write_result

import bnn_pyro as bp
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._init import chain_start
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.map_fit import energy

METRICS = ["gap_sd", "data_sd", "gap_data_ratio", "rmse", "test_nll", "train_loss", "sigma"]


def one(reg, seed: int, fast_path: bool) -> dict:
    grid = torch.linspace(-2.5, 2.5, 200)[:, None]
    in_gap, on_data = grid[:, 0].abs() < 0.5, (grid[:, 0].abs() > 0.5) & (grid[:, 0].abs() < 2)
    start = time.perf_counter()
    post = bp.fit(reg.model, reg.x, reg.y, method="ensemble", seed=seed, progress=False, fast_path=fast_path)
    wall = time.perf_counter() - start
    sd = post.predict(grid).epistemic_std  # each member once
    scores = reg.evaluate(post, num_samples=None)
    gap, data = float(sd[in_gap].mean()), float(sd[on_data].mean())
    return dict(
        seed=seed,
        fast_path=fast_path,
        potential=post.config["potential"],
        gap_sd=gap,
        data_sd=data,
        gap_data_ratio=gap / data,
        rmse=scores["rmse"],
        test_nll=-scores["test_log_likelihood"],
        train_loss=float(-post.sample_stats["lp"].mean()),
        sigma=float(post.samples["sigma"].median()),
        wall_s=wall,
    )


def trajectory(reg, steps=(0, 10, 50, 100, 200, 300, 500, 700, 1000)) -> pd.DataFrame:
    """Both paths' loss and gradient at the same weights along one member's Adam trajectory (module docstring)."""

    def potentials(model, x, y):
        init = chain_start(model, "reset", 0)
        return [Potential(model, Data(x=x, y=y), init=init, fast_path=fast) for fast in (True, False)]

    def value_grad(pot, z, batch):
        z = {k: v.detach().clone().requires_grad_() for k, v in z.items()}
        u = energy(pot, z, batch)
        return float(u), torch.cat([g.reshape(-1) for g in torch.autograd.grad(u, list(z.values()))])

    x, y = reg.x, reg.y
    fast, pyro = potentials(copy.deepcopy(reg.model), x, y)
    fast64, pyro64 = potentials(copy.deepcopy(reg.model).double(), x.double(), y.double())
    start = fast.init
    nudged = {k: torch.nextafter(v, v + 1) if k == "2.bias" else v for k, v in start.items()}
    runs = {
        name: ({k: v.clone().requires_grad_() for k, v in z.items()}, pot)
        for name, z, pot in (("fast", start, fast), ("pyro", start, pyro), ("nudged", nudged, fast))
    }
    opts = {name: torch.optim.Adam(list(z.values()), lr=1e-2) for name, (z, _) in runs.items()}
    rows = []
    for step in range(max(steps) + 1):
        if step in steps:
            z = runs["fast"][0]
            (uf, gf), (up, gp) = value_grad(fast, z, (x, y)), value_grad(pyro, z, (x, y))
            z64 = {k: v.detach().double() for k, v in z.items()}
            (u64, g64), (u64p, g64p) = (
                value_grad(fast64, z64, (x.double(), y.double())),
                value_grad(pyro64, z64, (x.double(), y.double())),
            )
            dist = {
                n: max(float((runs["fast"][0][k] - runs[n][0][k]).detach().abs().max()) for k in z)
                for n in ("pyro", "nudged")
            }
            rows.append(
                {
                    "step": step,
                    "U": round(uf, 3),
                    "dU f32": abs(uf - up),
                    "max dgrad f32": float((gf - gp).abs().max()),
                    "max grad": float(gp.abs().max()),
                    "dU f64": abs(u64 - u64p),
                    "max dgrad f64": float((g64 - g64p).abs().max()),
                    "f32 grad err vs f64 (fast / pyro)": f"{float((gf.double() - g64).abs().max()):.1e} / "
                    f"{float((gp.double() - g64).abs().max()):.1e}",
                    "max dz fast-pyro": dist["pyro"],
                    "max dz fast-nudged": dist["nudged"],
                }
            )
        for name, (z, pot) in runs.items():
            opts[name].zero_grad()
            energy(pot, z, (x, y)).backward()
            opts[name].step()
    return pd.DataFrame(rows)


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    fast = rows[rows.fast_path].set_index("seed")[METRICS]
    slow = rows[~rows.fast_path].set_index("seed")[METRICS]
    seeds = fast.index.intersection(slow.index)
    diff = fast.loc[seeds] - slow.loc[seeds]
    n = len(seeds)
    return pd.DataFrame(
        {
            "metric": METRICS,
            "fast (mean)": fast.loc[seeds].mean(),
            "pyro (mean)": slow.loc[seeds].mean(),
            "fast - pyro": diff.mean(),
            "SE": diff.std(ddof=1) / n**0.5,
            "z": diff.mean() / (diff.std(ddof=1) / n**0.5),
        }
    ).round(4)


def main(args) -> None:
    torch.set_num_threads(1)
    out = results_dir("ensemble_fast_path_ab", args.out)
    csv = out / "results.csv"
    reg = bp.zoo.load("mlp_regression")
    traj = trajectory(reg)
    print(traj.to_string())
    if args.trajectory:
        return
    if args.summarize:
        rows = pd.read_csv(csv)
    else:
        found = []
        for seed in range(0, 5 * args.seeds, 5):
            for fast_path in (True, False):
                found.append(one(reg, seed, fast_path))
                pd.DataFrame(found).to_csv(csv, index=False)
                print(found[-1], flush=True)
        rows = pd.DataFrame(found)
    table = summary(rows)
    seeds = rows.seed.nunique()
    write_result(
        out / "results.md",
        f"# Ensemble at its defaults, fast path vs Pyro's path, paired over {seeds} seeds\n\n"
        f"`python benchmarks/ensemble_fast_path_ab.py --seeds {seeds}` (one thread; zoo mlp_regression). Per metric: "
        "each path's mean over seeds, the mean paired difference and its standard error. Within a path the "
        f"gap/data ratio ranges {rows.gap_data_ratio.min():.1f}-{rows.gap_data_ratio.max():.1f} over seeds (sd "
        f"{rows.groupby('fast_path').gap_data_ratio.std().mean():.2f}).\n\n"
        + markdown(table)
        + "\nOne member's Adam trajectory (seed 0; `trajectory()`): both paths' loss and gradient at the same "
        "weights, and how far apart the trajectories drift (fast vs Pyro; fast vs fast started one ulp away).\n\n"
        + markdown(traj.astype(object).map(lambda v: f"{v:.2e}" if isinstance(v, float) else v)),
    )
    print(table.to_string())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--summarize", action="store_true")
    parser.add_argument("--trajectory", action="store_true")
    parser.add_argument(
        "--out", default=None, help="the folder written (default benchmarks/results/ensemble_fast_path_ab/)"
    )
    main(parser.parse_args())
