"""HMC's realized acceptance after warm-up against its ``target_accept`` (issue 26): why it lands at 0.93-0.96 for a
0.8 target, and what a final step aimed at the target would change.

Pyro's ``WarmupAdapter`` (which our flat kernels use too, :class:`bnn_pyro.infer._batched.BatchedChains`) follows Stan:
dual averaging of ``log h`` toward ``target_accept`` (gamma 0.05, t0 10, kappa 0.75), restarted at
``mu = log(10 h)`` after each metric update (the last one 50 iterations before the end of warm-up), and the final
step ``exp(x_bar)``, the weighted average of the iterates ``x_t`` of that last window. The iterates make the
acceptance *averaged over them* ~ the target; the chain then runs at their average. Where the acceptance falls
from ~1 to ~0 over a narrow band of steps (a cliff: the leapfrog's stability limit on a Gaussian, and so on a BNN),
the iterates saw-tooth across it (a rejected draw cuts ``h`` by ~10x, a few accepted ones climb back) and their
log-average lies well below it, where the acceptance is ~0.95 (Jensen's inequality on a concave ``a(log h)``).

Variants of the final step (``--variants``), each applied to the same warm-up (the same random stream: the fits
differ only from the first kept draw on):

- ``defaults``: the library as it is: HMC's flat kernels end warm-up at
  :func:`bnn_pyro.infer._aimed_step.aimed_step`, the step at which a logistic curve ``a = sigmoid(b0 - b1 log h)``,
  fitted to the last window's ``(h_t, a_t)`` pairs (binomial deviance with fractional responses), equals
  ``target_accept``;
- ``xbar``: Pyro's and Stan's ``exp(x_bar)`` (the default before);
- ``last``: the last iterate ``exp(x_t)`` instead of ``exp(x_bar)``.

Per fit: the step, the post-warm-up mean acceptance, divergences, the warnings the fit raised (the one-chain R-hat
note left out: every fit here is one chain), gradient evaluations of the kept draws, and bulk ESS of ``f`` (at the
20 training inputs of ``post.summary(space="function")``, the health check's) and of the weights (smallest and median
over coordinates), also per 1,000 gradient evaluations. Datasets: ``gaussian``, the exact Gaussian posterior of
``tests/infer/test_mcmc.py``'s HMC mixing test (``make_blr(n=200, d=5, noise=1.0, seed=0)``, 500 draws, one chain,
as that test); ``breast_cancer``, ``benchmarks/hmc_trajectory.py``'s setup (``classification.py``'s net, prior and
split ``k``, ``seed=k``) at the defaults but one chain. ``--method nuts`` reports NUTS's realized acceptance beside
(its variant column is ``defaults``).

Usage::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/hmc_acceptance.py --dataset gaussian --seeds 0,1,2,3,4
    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/hmc_acceptance.py --dataset breast_cancer --seeds 0,1,2,3,4

appends one row per fit to ``acceptance.csv`` in ``--out`` (default ``benchmarks/results/hmc_acceptance/``) and
rewrites ``acceptance.md`` (headed by the run's provenance) from it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro.infer import _batched

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import results_dir, write_result  # noqa: E402
from classification import load_dataset, make_model, make_split  # noqa: E402

TESTS = Path(__file__).resolve().parents[1] / "tests"  # tests/blr.py: the exact Gaussian posterior of the HMC test


@contextlib.contextmanager
def final_step(variant: str):
    """Inside the block the flat kernels end warm-up at ``variant``'s step (module docstring)."""
    if variant == "defaults":
        yield
        return
    aimed, base = _batched.aimed_step, _batched.WarmupAdapter

    class LastIterate(base):
        def _end_adaptation(self):
            super()._end_adaptation()
            self.step_size = math.exp(self._step_size_adapt_scheme.get_state()[0])

    _batched.aimed_step = lambda *args, **kwargs: None  # no aimed step: the adapter's own (exp(x_bar))
    _batched.WarmupAdapter = LastIterate if variant == "last" else base
    try:
        yield
    finally:
        _batched.aimed_step, _batched.WarmupAdapter = aimed, base


def _ess(draws: np.ndarray) -> np.ndarray:
    """Bulk ESS of each column of one chain's ``draws`` (n, k)."""
    return np.asarray(az.ess(az.convert_to_dataset(draws[None]), method="bulk")["x"].values).reshape(-1)


def _problem(dataset: str, seed: int):
    """``(model, x, y, settings)``: the fit of the module docstring."""
    if dataset == "gaussian":
        sys.path.insert(0, str(TESTS))
        try:
            from blr import make_blr
        finally:
            sys.path.remove(str(TESTS))
        blr = make_blr(n=200, d=5, noise=1.0, seed=0)
        return blr.model(), blr.x, blr.y, dict(num_samples=500)
    x, y = load_dataset(dataset)
    s = make_split(x, y, seed)
    return make_model(s["x_train"].shape[1], int(y.max()) + 1, seed), s["x_train"], s["y_train"], {}


def run(dataset: str, seed: int, method: str, variant: str, options: dict) -> dict:
    model, x, y, settings = _problem(dataset, seed)
    settings = dict(settings, num_chains=1, **options)
    with warnings.catch_warnings(record=True) as caught, final_step(variant):
        warnings.simplefilter("always")
        start = time.perf_counter()
        post = bp.fit(model, x, y, method=method, seed=seed, progress=False, **settings)
        seconds = time.perf_counter() - start
    notes = sorted({str(w.message)[:110] for w in caught if "R-hat" not in str(w.message) or "ESS" in str(w.message)})
    stats = post.sample_stats
    grads = float(stats["n_steps"].double().sum())
    weights = torch.cat([post.samples[n].reshape(post.num_draws, -1) for n in sorted(post.samples)], -1)
    ess_w = _ess(weights.double().numpy())
    ess_f = float(post.summary(space="function", warn=False)["ess_bulk"].min())
    per = 1000.0 / grads
    return dict(
        dataset=dataset,
        seed=seed,
        method=method,
        variant=variant,
        options=repr(options),
        step_size=float(stats["step_size"][0, -1]),
        accept=float(stats["acceptance_rate"].double().mean()),
        diverging=int(stats["diverging"].sum()) if "diverging" in stats else 0,
        warnings=" | ".join(notes),
        grad_evals=grads,
        ess_f_min=ess_f,
        ess_w_min=float(ess_w.min()),
        ess_w_median=float(np.median(ess_w)),
        ess_f_per_1k=ess_f * per,
        ess_w_min_per_1k=float(ess_w.min()) * per,
        ess_w_median_per_1k=float(np.median(ess_w)) * per,
        draws=post.num_draws,
        time_s=seconds,
    )


def markdown(rows: pd.DataFrame) -> str:
    lines = [
        "# HMC's realized acceptance after warm-up (target 0.8) and the final step",
        "",
        "benchmarks/hmc_acceptance.py's docstring says what each column is. One chain per fit; ESS is bulk ESS (of f: "
        "the smallest over the 20 training inputs the health check reads; of the weights: smallest / median over the "
        "coordinates), then per 1,000 gradient evaluations of the kept draws. Warnings: those the fit raised besides "
        "the one-chain R-hat note.",
        "",
        "| dataset | method | variant | seed | h | accept | div. | grads | ESS f | ESS w min / med | per 1k grads: "
        "f | w min / med | warnings |",
        "|" + "---|" * 13,
    ]
    for _, r in rows.iterrows():
        lines.append(
            f"| {r.dataset} | {r.method} | {r.variant} | {r.seed} | {r.step_size:.4g} | {r.accept:.3f} | "
            f"{r.diverging} | {r.grad_evals:.0f} | {r.ess_f_min:.0f} | {r.ess_w_min:.0f} / {r.ess_w_median:.0f} | "
            f"{r.ess_f_per_1k:.2f} | {r.ess_w_min_per_1k:.2f} / {r.ess_w_median_per_1k:.2f} | "
            f"{r.warnings if isinstance(r.warnings, str) and r.warnings else '-'} |"
        )
    lines += ["", "Means over seeds:", "", "| dataset | method | variant | seeds | h | accept | ESS f / 1k | "
              "ESS w min / 1k | ESS w med / 1k | min seed ESS w min |", "|" + "---|" * 10]  # fmt: skip
    for key, g in rows.groupby(["dataset", "method", "variant"], sort=False):
        lines.append(
            f"| {' | '.join(map(str, key))} | {len(g)} | {g.step_size.mean():.4g} | {g.accept.mean():.3f} | "
            f"{g.ess_f_per_1k.mean():.2f} | {g.ess_w_min_per_1k.mean():.2f} | {g.ess_w_median_per_1k.mean():.2f} | "
            f"{g.ess_w_min.min():.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="gaussian", help="gaussian or a classification.py set")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="a comma list (breast_cancer: the split too)")
    parser.add_argument("--method", default="hmc", help="hmc, or nuts (report its acceptance)")
    parser.add_argument("--variants", default="defaults,xbar,last", help="a comma list of the docstring's variants")
    parser.add_argument("--option", action="append", default=[], help="key=value passed to bp.fit")
    parser.add_argument("--note", default="", help="a line added under the table (e.g. the machine's load)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = eval(value, {})  # noqa: S307 - a benchmark's command line
    out = results_dir("hmc_acceptance", args.out)
    path = out / "acceptance.csv"
    rows = pd.read_csv(path, keep_default_na=False) if path.exists() else pd.DataFrame()
    for seed in (int(k) for k in args.seeds.split(",")):
        for variant in args.variants.split(","):
            row = pd.DataFrame([run(args.dataset, seed, args.method, variant, options)])
            rows = pd.concat([rows, row], ignore_index=True)
            rows.to_csv(path, index=False)
            print(markdown(row).split("\n\nMeans")[0].splitlines()[-1], flush=True)
    write_result(out / "acceptance.md", markdown(rows) + (f"\n{args.note}\n" if args.note else ""))
    return rows


if __name__ == "__main__":
    main()
