"""SVI at its defaults on the Pyro-function references (``tests/reference``): does the guide reach the KL-optimal
Gaussian of its family, and what do the checks see?

For each (reference, seed): the verdict of ``tests/infer/test_reference_posteriors.py``'s rule (the parameters whose
mean or sd is off the family's optimum by more than the draws' Monte Carlo error, :func:`_optimum_off`), the fit's
``DiagnosticWarning`` messages (the ELBO check's and the Newton-gap check's, :mod:`bnn_pyro.infer.svi_gap`), the
largest Newton gap in guide sds with its standard error and coordinate, the drift of the iterate average of the guide's
mean between the last two tenths of the run and the largest step-to-step move over the last tenth (both in guide sds,
from the guide's ``loc`` recorded at every step: before the refinement), the seconds of the fit and of the gap's estimate,
and what the refinement of a Gaussian guide did (:mod:`bnn_pyro.infer.svi_refine`: steps accepted, the ELBO's change
on its draws, why it stopped, its seconds and their ratio to the rest of the same fit's).

Run from the repository root: ``python benchmarks/svi_convergence.py --refs eight_schools --seeds 0,1,2,3,4
[--guide full_rank] [--name NAME]``; writes ``benchmarks/results/svi_convergence/<name>.md`` and ``.csv``. One torch
thread per fit.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from operator import attrgetter
from pathlib import Path

import pandas as pd
import torch
from _common import markdown, results_dir, write_result
from pyro.infer import autoguide

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "infer")]
from reference.posteriors import ALL  # noqa: E402
from test_reference_posteriors import _optimum, _optimum_off  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import _health, svi, svi_gap, svi_refine  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

_TRACE: list = []
_SD: list = []
_GAP_SECONDS: list = []
_REFINE_SECONDS: list = []


def _recording_engine(engine_type):
    """The SVI engine with an ``after`` hook that records the guide's ``loc`` at every step and its sds (for the
    drift columns)."""

    def make(**kw):
        def after(state, index, info):
            guide = state.guide
            if isinstance(guide, autoguide.AutoNormal):  # per-site locs and scales, flat in the prototype's order
                names = [n for n, site in guide.prototype_trace.iter_stochastic_nodes() if not site["is_observed"]]
                # the public per-site parameters (a dotted site name nests: attrgetter), scales constrained
                _TRACE.append(torch.cat([attrgetter(n)(guide.locs).detach().reshape(-1) for n in names]))
                _SD[:] = [torch.cat([attrgetter(n)(guide.scales).detach().reshape(-1) for n in names])]
                return info
            _TRACE.append(guide.loc.detach().clone())
            _SD[:] = [guide.get_posterior().covariance_matrix.detach().diagonal().sqrt()]
            return info

        return engine_type(**{**kw, "after": after})

    return make


def _timed(fn, seconds: list):
    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    return run


def one(ref, optimum, seed: int, guide: str) -> dict:
    _TRACE.clear()
    _GAP_SECONDS.clear()
    _REFINE_SECONDS.clear()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(ref.model, ref.x, ref.y, method="svi", guide=guide, seed=seed, progress=False)
    fit_s = time.perf_counter() - start
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    off = _optimum_off(ref, post, optimum)
    refined = post.config.get("guide_refinement", [{}])[0]
    refine_s = sum(_REFINE_SECONDS)
    nan = torch.full((1, 1), float("nan"))  # no gap where the guide is not checked (mean-field)
    gap = post.history.get(_health.GAP, nan)[0].double()
    se = post.history.get(_health.GAP_SE, nan)[0].double()
    i = int(gap.nan_to_num(-1.0).abs().argmax())
    locs, sd = torch.stack(_TRACE).double(), _SD[0].double()
    w = locs.shape[0] // 10
    drift = (locs[-w:].mean(0) - locs[-2 * w : -w].mean(0)) / sd
    step = locs[-w:].diff(dim=0).abs().max(0).values / sd
    return dict(
        reference=ref.name,
        guide=guide,
        seed=seed,
        off_optimum=", ".join(b[0] for b in off) or "-",
        max_gap_sd=round(float(gap[i]), 3),
        gap_se=round(float(se[i]), 3),
        gap_at=post.config.get("guide_coordinates", ["-"] * gap.numel())[i],
        gap_warns=any("stopped short" in m for m in messages),
        elbo_warns=any("the ELBO has not converged" in m or "the ELBO got worse" in m for m in messages),
        other_warnings=sum("stopped short" not in m and "the ELBO " not in m for m in messages),
        max_drift_sd=round(float(drift.abs().max()), 4),
        max_step_sd=round(float(step.max()), 4),
        fit_s=round(fit_s, 1),
        gap_s=round(sum(_GAP_SECONDS), 1),
        refine_accepted=refined.get("accepted", "-"),
        refine_elbo_change=round(refined["elbo_change"], 4) if refined else "-",
        refine_stopped=refined.get("stopped", "-"),
        refine_s=round(refine_s, 2),
        refine_ratio=round(refine_s / (fit_s - refine_s), 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", default="eight_schools,kidiq,logistic")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--guide", default="full_rank")
    parser.add_argument("--name", default="results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    svi.Engine = _recording_engine(svi.Engine)
    svi_gap.newton_gap = _timed(svi_gap.newton_gap, _GAP_SECONDS)
    svi_refine.refine = _timed(svi_refine.refine, _REFINE_SECONDS)
    rows = []
    for name in args.refs.split(","):
        ref = ALL[name]()
        optimum = _optimum(ref, args.guide)
        for seed in map(int, args.seeds.split(",")):
            rows.append(one(ref, optimum, seed, args.guide))
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    folder = results_dir("svi_convergence")
    table.to_csv(folder / f"{args.name}.csv", index=False)
    write_result(
        folder / f"{args.name}.md",
        f"SVI (guide={args.guide}) at its defaults, seeds {args.seeds}: off the family's KL optimum by the test's rule "
        "(`off_optimum`), the Newton gap's check and the ELBO check, the iterate average's drift over the last two "
        "tenths and the largest step over the last tenth (guide sds, before the refinement), seconds of the fit and of the gap, "
        "and the refinement (`svi_refine`): steps accepted, the ELBO's change on its draws, why it stopped, its seconds "
        "and their ratio to the rest of the fit's.\n\n" + markdown(table),
    )


if __name__ == "__main__":
    main()
