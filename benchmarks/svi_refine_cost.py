"""The cost of the SVI refinement (``bnn_pyro/infer/svi_refine.py``) against its fit's, by dimension and rows: the
basis of ``svi_refine.MAX_DIM`` and ``svi_refine.MAX_WORK``.

A Bayesian linear regression written as a Pyro function with ``dim - 1`` coefficients and a learned noise scale (``dim``
unconstrained coordinates) on ``rows`` rows, fitted by SVI (full-rank guide by default, the default guide for such a
model) for ``--steps`` steps: the seconds of the whole fit, of the refinement inside it (and its evaluations of the
draws), and their ratio. One evaluation takes ``dim`` gradient passes over every row per draw, so its share grows with
``dim`` and, past the fit's fixed per-step cost, with ``dim x rows``. ``--max-dim`` and ``--max-work`` lift the caps for
the run (to measure past them).

``ratio`` is the refinement's seconds over the rest of its own fit's. Where ``--steps`` is below the default 5,000 (a
short sweep), ``ratio_default`` puts the refinement against a default fit: a second fit of one step with the refinement
off gives the fit's fixed seconds (start, draws, gap check), and ``fixed + 5,000 x`` the first fit's seconds per step
is the default fit's, extrapolated.

Run from the repository root: ``python benchmarks/svi_refine_cost.py --dims 10,25,50,100,200 --steps 5000`` (by
dimension, 200 rows: ``refine_cost.md``) or ``--pairs 10x200,10x5000,50x200,50x5000 --steps 500 --name
refine_cost_rows`` (by rows); writes ``benchmarks/results/svi_convergence/<name>.md`` and ``.csv``. One torch thread.
"""

from __future__ import annotations

import argparse
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from _common import default_fit_seconds, run_sizes, save_table, size_pairs, switched_off, time_calls

import bnn_pyro as bp
from bnn_pyro.infer import svi, svi_refine

_SECONDS: list = []
_EVALUATIONS: list = []


def _model(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("data", size=x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ b, s), obs=y)


def _fit(x, y, guide: str, steps: int):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_steps=steps, num_samples=100, seed=0, progress=False)
    return post, time.perf_counter() - start


def one(dim: int, rows: int, steps: int, guide: str) -> dict:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim - 1, generator=g)
    y = x @ torch.randn(dim - 1, generator=g) * 0.3 + 0.5 * torch.randn(rows, generator=g)
    _SECONDS.clear()
    _EVALUATIONS.clear()
    post, fit_s = _fit(x, y, guide, steps)
    refined = post.config.get("guide_refinement", [{}])[0]
    refine_s = sum(_SECONDS)
    row = dict(
        dim=dim,
        rows=rows,
        guide=guide,
        steps=steps,
        fit_s=round(fit_s, 2),
        refine_s=round(refine_s, 2),
        evaluations=len(_EVALUATIONS),
        ratio=round(refine_s / (fit_s - refine_s), 4),
    )
    if steps < svi.DEFAULT_STEPS:
        with switched_off((svi_refine, "refine")):
            _, fixed_s = _fit(x, y, guide, 1)
        default = default_fit_seconds(fit_s, refine_s, fixed_s, steps, svi.DEFAULT_STEPS)
        row.update(ratio_default=round(refine_s / default.pop("default_s"), 4), **default)
    return {**row, "accepted": refined.get("accepted", "-"), "stopped": refined.get("stopped", "-")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="10,25,50,100,200")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--pairs", default=None, help="dim x rows points, e.g. 10x200,50x5000 (in place of --dims)")
    parser.add_argument("--steps", type=int, default=svi.DEFAULT_STEPS)
    parser.add_argument("--guide", default="full_rank")
    parser.add_argument("--max-dim", type=int, default=None)
    parser.add_argument("--max-work", type=int, default=None)
    parser.add_argument("--name", default="refine_cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.max_dim is not None:
        svi_refine.MAX_DIM = args.max_dim
    if args.max_work is not None:
        svi_refine.MAX_WORK = args.max_work
    time_calls(svi_refine, "refine", _SECONDS)
    time_calls(svi_refine, "derivatives", _EVALUATIONS)  # one entry per evaluation of the draws
    if args.pairs is None:
        pairs = [(int(d), args.rows) for d in args.dims.split(",")]
    else:
        pairs = size_pairs(args.pairs)
    one(3, 20, 5, args.guide)  # untimed: first-call costs (imports, Pyro's first traces) out of the first row
    frame = run_sizes(one, pairs, [args.guide], args.steps)
    save_table(
        frame,
        "svi_convergence",
        args.name,
        f"The {args.guide} refinement's seconds against its fit's: a linear regression with a learned noise scale, "
        f"{args.steps} steps (`ratio`: over the rest of this fit; `ratio_default`, where there are fewer steps than "
        f"the default {svi.DEFAULT_STEPS:,}: over a default fit extrapolated from this one's seconds per step and "
        f"a one-step fit's fixed seconds; `evaluations`: of the refinement's draws; caps lifted to MAX_DIM "
        f"{svi_refine.MAX_DIM}, MAX_WORK {svi_refine.MAX_WORK:,}).",
    )


if __name__ == "__main__":
    main()
