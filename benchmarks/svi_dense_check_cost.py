"""The dense check's cost (the refinement of ``bnn_pyro/infer/svi_refine.py`` and the gap of ``svi_gap.py``) against
its fit's, and against the cost model of ``svi_gap_cg.choose_path``: the basis of ``svi_gap_cg.DENSE_PASSES``.

A Bayesian linear regression written as a Pyro function (``benchmarks/svi_refine_cost.py``'s: ``dim - 1``
coefficients and a learned noise scale) on ``rows`` rows, fitted by SVI for ``--steps`` steps with a full-rank or
low-rank guide: the seconds of the whole fit and of its check (refinement and gap), the refinement's evaluations, and
two ratios of the check to the fit's steps: ``measured`` (the check's seconds over the steps' own, ``steps_s``: the
Laplace start, the draws and setup are in neither, review 17) and ``modeled`` (``choose_path``'s gradient passes over
the rows for what ran, :func:`~bnn_pyro.infer.svi_gap_cg.dense_passes`, over the fit's ``steps x (rows +
STEP_ROWS)``). The model is conservative where ``modeled >= measured``. ``--unbounded`` lifts the dense path's
cost bound for the run (``FIT_SHARE`` infinite), to measure the check where the bound would skip it.

Run from the repository root: ``python benchmarks/svi_dense_check_cost.py --pairs 10x200,10x1000,50x200,100x100
--steps 300 --unbounded``; writes ``benchmarks/results/svi_convergence/<name>.md`` and ``.csv``. One torch thread.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from _common import run_sizes, save_table, size_pairs, time_calls

import bnn_pyro as bp
from bnn_pyro.infer import svi, svi_gap, svi_gap_cg, svi_refine

_REFINE: list = []
_GAP: list = []
_EVALUATIONS: list = []
_STEPS: list = []  # each SVI step's seconds: the fit's steps alone, the denominator of ``measured``


def _model(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("data", size=x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ b, s), obs=y)


def one(dim: int, rows: int, steps: int, guide: str) -> dict:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim - 1, generator=g)
    y = x @ torch.randn(dim - 1, generator=g) * 0.3 + 0.5 * torch.randn(rows, generator=g)
    _REFINE.clear()
    _GAP.clear()
    _EVALUATIONS.clear()
    _STEPS.clear()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_steps=steps, num_samples=10, seed=0, progress=False)
    fit_s = time.perf_counter() - start
    refine_s, gap_s, steps_s = sum(_REFINE), sum(_GAP), sum(_STEPS)
    check_s = refine_s + gap_s
    evaluations = len(_EVALUATIONS)
    refined = post.config.get("guide_refinement", [{}])[0]
    gap_taken = (post.config.get("guide_gap") or [{}])[0].get("method") == "dense"
    gap_passes = svi_gap_cg.dense_passes(dim, 0, hessian_gap=guide == "low_rank") if gap_taken else 0
    passes = svi_refine.DRAWS * svi_gap_cg.DENSE_PASSES * dim * evaluations + gap_passes  # what ran
    modeled = passes * rows / (steps * (rows + svi_gap_cg.STEP_ROWS))
    return dict(
        dim=dim,
        rows=rows,
        guide=guide,
        steps=steps,
        fit_s=round(fit_s, 2),
        steps_s=round(steps_s, 2),
        check_s=round(check_s, 2),
        refine_s=round(refine_s, 3),
        gap_s=round(gap_s, 3),
        evaluations=evaluations,
        measured=round(check_s / steps_s, 4),
        modeled=round(modeled, 4),
        stopped=refined.get("stopped", "-"),
        gap=(post.config.get("guide_gap") or [{}])[0].get("method", "-"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="10x200,10x1000,50x200,100x100", help="dim x rows points")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--guides", default="full_rank,low_rank")
    parser.add_argument("--unbounded", action="store_true", help="lift the dense path's cost bound for the run")
    parser.add_argument("--name", default="dense_check_cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.unbounded:
        svi_gap_cg.FIT_SHARE = math.inf
    time_calls(svi_refine, "refine", _REFINE)
    time_calls(svi_gap, "newton_gap", _GAP)
    time_calls(svi_refine, "derivatives", _EVALUATIONS)  # one entry per evaluation of the refinement's draws
    time_calls(svi, "_step", _STEPS)
    one(3, 20, 5, "full_rank")  # untimed: first-call costs (imports, Pyro's first traces) out of the first row
    frame = run_sizes(one, size_pairs(args.pairs), args.guides.split(","), args.steps)
    save_table(
        frame,
        "svi_convergence",
        args.name,
        f"The dense check's seconds (refinement and gap) against its fit's steps alone (`measured`: check_s / "
        f"steps_s), and the same ratio in choose_path's modeled gradient passes over the rows (`modeled`: DENSE_PASSES "
        f"{svi_gap_cg.DENSE_PASSES} x dim per draw and evaluation, {svi_refine.DRAWS:,} draws; the fit's steps x "
        f"(rows + STEP_ROWS {svi_gap_cg.STEP_ROWS:,})): a linear regression with a learned noise scale, "
        f"{args.steps} steps" + (" (cost bound lifted: FIT_SHARE infinite)" if args.unbounded else "") + ".",
    )


if __name__ == "__main__":
    main()
