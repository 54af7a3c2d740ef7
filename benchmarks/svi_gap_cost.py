"""The Newton gap's cost (``bnn_pyro/infer/svi_gap.py``): its gradients at 1,000 guide draws in one batched pass
(``torch.func.vmap``) against the same gradients one traced Pyro call at a time (the code before the batched pass, which
is still the fallback where vmap fails), side by side in one process.

Part 1, per reference of ``tests/reference`` (full-rank guide, seed 0, a short fit of ``--steps`` steps: the gap is
taken where that fit stopped): both ways on the same guide, the same draws; the largest difference of the gap and of
its standard error (guide sds: float rounding only) and the seconds of each. Part 2, the per-fit cost on the regression
of ``tests/infer/test_svi_gap.py`` (500 steps, 2 chains, 10 draws, the defaults otherwise): the fit with the batched
gap, with the row-by-row gap and with no gap, in alternating rounds, as ratios to the fit with no gap.

Usage: ``python benchmarks/svi_gap_cost.py [--steps 1000] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pyro
import pyro.distributions as dist
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import svi_gap  # noqa: E402

_NEWTON_GAP = svi_gap.newton_gap
_VMAP = torch.func.vmap


def _no_vmap(*args, **kwargs):
    raise RuntimeError("row by row (benchmark)")


def _way(batched: bool) -> None:
    """Make ``svi_gap`` take its batched pass (``batched``) or its row-by-row fallback."""
    torch.func.vmap = _VMAP if batched else _no_vmap


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def reference_row(name: str, steps: int, rounds: int) -> dict:
    ref = ALL[name]()
    calls = []
    svi_gap.newton_gap = lambda *a, **k: calls.append(a) or _NEWTON_GAP(*a, **k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bp.fit(ref.model, ref.x, ref.y, method="svi", guide="full_rank", num_steps=steps, seed=0, progress=False)
    svi_gap.newton_gap = _NEWTON_GAP
    seconds = {True: [], False: []}
    results = {}
    for _ in range(rounds):
        for batched in (True, False):
            _way(batched)
            results[batched], s = _timed(_NEWTON_GAP, *calls[0])
            seconds[batched].append(s)
    _way(True)
    new, old = results[True], results[False]
    return dict(
        reference=name,
        coordinates=len(new.labels),
        max_abs_gap_sd=round(float(new.gap.abs().max()), 3),
        max_se_sd=round(float(new.se.max()), 4),
        gap_diff=f"{float((new.gap - old.gap).abs().max()):.1e}",
        se_diff=f"{float((new.se - old.se).abs().max()):.1e}",
        batched_s=round(min(seconds[True]), 3),
        row_by_row_s=round(min(seconds[False]), 3),
        ratio=round(min(seconds[False]) / min(seconds[True]), 1),
    )


def _regression(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(b[0] + b[1] * x, 1.0), obs=y)


def fit_rows(rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, generator=g) + 3.0
    y = 1.0 + 0.5 * x + torch.randn(30, generator=g)
    ways = {"batched gap": (True, _NEWTON_GAP), "row-by-row gap": (False, _NEWTON_GAP), "no gap": (True, None)}
    seconds = {k: [] for k in ways}
    for _ in range(rounds):
        for label, (batched, fn) in ways.items():
            _way(batched)
            svi_gap.newton_gap = fn if fn is not None else (lambda *a, **k: None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, s = _timed(
                    bp.fit,
                    _regression,
                    x,
                    y,
                    method="svi",
                    num_steps=500,
                    num_samples=10,
                    num_chains=2,
                    seed=0,
                    progress=False,
                )
            seconds[label].append(s)
    _way(True)
    svi_gap.newton_gap = _NEWTON_GAP
    base = min(seconds["no gap"])
    return [
        dict(
            fit=label, seconds=" / ".join(f"{s:.2f}" for s in v), best_s=round(min(v), 2), ratio=round(min(v) / base, 2)
        )
        for label, v in seconds.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--refs", default="eight_schools,kidiq,logistic")
    parser.add_argument("--out", default=None, help="write here instead of benchmarks/results/svi_convergence/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _NEWTON_GAP(*_warmup())  # vmap's one-time set-up in a process, outside the timings
    refs = pd.DataFrame([reference_row(n, args.steps, args.rounds) for n in args.refs.split(",")])
    print(refs, flush=True)
    fits = pd.DataFrame(fit_rows(args.rounds))
    print(fits, flush=True)
    folder = results_dir("svi_convergence", args.out)
    write_result(
        folder / "gap_cost.md",
        f"`benchmarks/svi_gap_cost.py --steps {args.steps} --rounds {args.rounds}`, one torch thread. The gap's 1,000 "
        "gradients in one vmap pass against one traced Pyro call per draw (the code before), the same guide and "
        "draws (seconds: the best of the rounds; gap_diff, se_diff: the largest difference, guide sds):\n\n"
        + markdown(refs)
        + "\nThe per-fit cost on the regression of `tests/infer/test_svi_gap.py` (500 steps, 2 chains; seconds of "
        "each round, ratio of the best to the best fit with no gap):\n\n" + markdown(fits),
    )


def _warmup():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, generator=g)
    y = x + torch.randn(30, generator=g)
    from pyro.infer import autoguide

    from bnn_pyro.infer.training_data import Data

    with pyro.get_param_store().scope():
        guide = autoguide.AutoMultivariateNormal(_regression)
        guide(x, y)
        return guide, _regression, Data(x, y)


if __name__ == "__main__":
    main()
