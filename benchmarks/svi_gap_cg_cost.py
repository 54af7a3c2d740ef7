"""The cost of the conjugate-gradient Newton gap (``bnn_pyro/infer/svi_gap_cg.py``) against its fit's, by coordinates
and rows: the basis of ``svi_gap_cg.MAX_WORK``.

A Bayesian linear regression with known noise written as a Pyro function (``dim`` coefficients, ``N(0, 1)`` priors,
correlated covariates) on ``rows`` rows, fitted by SVI with a mean-field or low-rank guide (past
``svi_refine.MAX_DIM`` or ``MAX_WORK``, so not refined, and checked by conjugate gradients) for ``--steps`` steps from
the default Laplace start: the seconds of the whole fit and of the gap inside it, the solver's iterations and residual,
the largest gap and its standard error (guide sds; on this Gaussian posterior the gap is exact, so it is how far Adam
left the guide's mean), and whether the check warned; since ``bnn_pyro/infer/svi_refine_cg.py``, also the seconds of
the mean's Newton steps before the gap (``mean_step_s``, what they did: ``accepted``, ``stopped``), so the gap then
measures what is left after them. ``ratio`` (``mean_step_ratio``) is the gap's (the steps') seconds over the rest of
its own fit's;
where ``--steps`` is below the default 5,000, ``ratio_default`` puts it against a default fit, extrapolated as in
``benchmarks/svi_refine_cost.py`` (a one-step fit with the gap off gives the fixed seconds, the first fit the seconds
per step).

Run from the repository root: ``python benchmarks/svi_gap_cg_cost.py --pairs 150x1000,500x1000 --steps 500``; writes
``benchmarks/results/svi_convergence/<name>.md`` and ``.csv``. One torch thread.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from _common import default_fit_seconds, run_sizes, save_table, size_pairs, switched_off, time_calls

import bnn_pyro as bp
from bnn_pyro.infer import svi, svi_gap, svi_gap_cg, svi_refine_cg
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

_SECONDS: list = []
_STEP_SECONDS: list = []


def _model(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def _fit(x, y, guide: str, steps: int):
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_steps=steps, num_samples=100, seed=0, progress=False)
    warned = any("stopped short" in str(w.message) for w in caught)
    return post, time.perf_counter() - start, warned


def one(dim: int, rows: int, steps: int, guide: str) -> dict:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=g) + 0.3 * torch.randn(rows, 1, generator=g)
    y = x @ torch.randn(dim, generator=g) * 0.3 + torch.randn(rows, generator=g)
    _SECONDS.clear()
    _STEP_SECONDS.clear()
    post, fit_s, warned = _fit(x, y, guide, steps)
    gap_s = sum(_SECONDS)
    step_s = sum(_STEP_SECONDS)
    refined = post.config.get("guide_refinement", [{}])[0]
    record = post.config.get("guide_gap")
    record = record[0] if isinstance(record, list) else {"reason": record}
    gap = post.history.get("guide_gap")
    row = dict(
        dim=dim,
        rows=rows,
        guide=guide,
        steps=steps,
        fit_s=round(fit_s, 2),
        gap_s=round(gap_s, 2),
        ratio=round(gap_s / (fit_s - gap_s - step_s), 4),
        mean_step_s=round(step_s, 2),
        mean_step_ratio=round(step_s / (fit_s - gap_s - step_s), 4),
        accepted=refined.get("accepted", "-"),
        stopped=refined.get("stopped", "-"),
        iterations=record.get("iterations", "-"),
        residual=f"{record['residual']:.1e}" if record.get("residual") is not None else "-",
        max_abs_gap_sd=round(float(gap.abs().max()), 3) if gap is not None else "-",
        max_se_sd=f"{float(post.history['guide_gap_se'].max()):.1e}" if gap is not None else "-",
        warned=warned,
        reason=record.get("reason") or "-",
    )
    if steps < svi.DEFAULT_STEPS:
        with switched_off((svi_gap, "newton_gap"), (svi_refine_cg, "refine_mean")):
            _, fixed_s, _ = _fit(x, y, guide, 1)
        default = default_fit_seconds(fit_s, gap_s + step_s, fixed_s, steps, svi.DEFAULT_STEPS)
        default_s = default.pop("default_s")
        row.update(
            **default,
            ratio_default=round(gap_s / default_s, 4),
            mean_step_ratio_default=round(step_s / default_s, 4),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="150x1000,500x1000", help="dim x rows points, e.g. 150x1000,1000x1000")
    parser.add_argument("--steps", type=int, default=svi.DEFAULT_STEPS)
    parser.add_argument("--guides", default="mean_field,low_rank")
    parser.add_argument("--max-work", type=int, default=None, help="lift svi_gap_cg.MAX_WORK for the run")
    parser.add_argument("--name", default="gap_cg_cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.max_work is not None:
        svi_gap_cg.MAX_WORK = args.max_work
    # its fits are short (extrapolated to the default 5,000 steps): the bound on the fit's own cost would skip some
    svi_gap_cg.FIT_SHARE = math.inf
    time_calls(svi_gap, "newton_gap", _SECONDS)
    time_calls(svi_refine_cg, "refine_mean", _STEP_SECONDS)
    one(120, 100, 5, "mean_field")  # untimed: first-call costs (imports, vmap's set-up) out of the first row
    frame = run_sizes(one, size_pairs(args.pairs), args.guides.split(","), args.steps)
    save_table(
        frame,
        "svi_convergence",
        args.name,
        f"The conjugate-gradient gap's seconds against its fit's: a linear regression with known noise, {args.steps} "
        f"steps from the Laplace start (`ratio`: over the rest of this fit; `ratio_default`, where there are fewer "
        f"steps than the default {svi.DEFAULT_STEPS:,}: over a default fit extrapolated from this one's seconds per "
        f"step and a one-step fit's fixed seconds; svi_gap_cg.MAX_WORK {svi_gap_cg.MAX_WORK:,} for the run; "
        f"{svi_gap.GAP_DRAWS:,} draws in {svi_gap_cg.BATCHES} batches, {svi_gap_cg.HESSIAN_DRAWS} Hessian draws, "
        f"TOL {svi_gap_cg.TOL:g}).",
    )


if __name__ == "__main__":
    main()
