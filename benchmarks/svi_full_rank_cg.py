"""A full-rank guide past the dense refinement's bounds (``bnn_pyro/infer/svi_refine_cg.py``): what the mean's Newton
step by conjugate gradients does at the defaults, before (a base revision, where such a guide got no refinement) and
after (the working tree), each side in a process of its own (``_common.side_result``); ``--base 13cd18c`` compares
the gap after the step by conjugate gradients (before) with the dense statistic on the step's own draws (after);
``--before`` words what the base revision does in the header (default "no refinement there").

``--case linear``: Bayesian linear regression with known noise (``dim`` coefficients, ``N(0, 1)`` priors, covariates
``N(0, 1)`` plus a shared ``0.3 N(0, 1)``, noise 1, ``rows`` rows): the posterior is Gaussian with precision ``X^T X +
I``, inside the full-rank family, so the guide's mean is compared with the exact posterior mean, in exact posterior
sds. ``--case logistic``: the lead's logistic regression (``x ~ N(0, 4)``, true ``w ~ N(0, 0.09)``, ``N(0, 1)``
priors, Bernoulli, seed 0): no closed form, so the gap (the Newton step to the family's optimum, in guide sds) is the
measure. Columns per side: the guide's largest miss (linear), the gap's largest ``|gap|`` and whether the fit warned
"stopped short", the gap's method, the step's record, and the step's and the gap's seconds over the rest of the fit
(``step_share``, ``gap_share``: ratios within the same fit, one torch thread). After, also the dense gap on draws of its
own (``dense_flagged``: coordinates the health check's rule, :func:`bnn_pyro.infer._health.gap_thresholds`, would flag;
the gap the engine takes is on the step's own draws, this one is not: it sees the step's Monte Carlo error).

Run from the repository root: ``python benchmarks/svi_full_rank_cg.py --case linear --pairs 110x100,200x500
--base d28af86``; writes ``benchmarks/results/svi_convergence/fullcg_<case>.md`` and ``.csv``.
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
from _common import exported, save_table, side_result, size_pairs

REPOSITORY = Path(__file__).resolve().parents[1]


def _data(case: str, dim: int, rows: int):
    g = torch.Generator().manual_seed(0)
    if case == "linear":
        x = torch.randn(rows, dim, generator=g) + 0.3 * torch.randn(rows, 1, generator=g)
        return x, x @ torch.randn(dim, generator=g) + torch.randn(rows, generator=g)
    x = torch.randn(rows, dim, generator=g) * 2.0
    return x, torch.bernoulli(torch.sigmoid(x @ (0.3 * torch.randn(dim, generator=g))), generator=g)


def _model(case: str, dim: int):
    def model(x, y=None):
        b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([dim]).to_event(1))
        with pyro.plate("data", size=len(x)):
            f = x @ b
            return pyro.sample("obs", dist.Normal(f, 1.0) if case == "linear" else dist.Bernoulli(logits=f), obs=y)

    return model


def logistic_optimum(x, y, loc, tril, *, seed: int, pairs: int = 10_000):
    """The optimum of a full-rank guide's mean with its covariance ``tril tril^T`` held (the mean of ``log p`` over
    ``2 pairs`` antithetic draws at its maximum) for the logistic case (``N(0, 1)`` priors): Newton's method with the
    exact expected Hessian ``X^T diag(mean_i p_i (1 - p_i)) X + I`` (float64, to a gradient under 1e-10). The
    reference of ``svi_refine_cg_cause.py`` and of the tests of the step on this case."""
    design, labels, m = x.double(), y.double(), loc.double()
    half = torch.randn(pairs, m.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) @ tril.T
    draws = torch.cat([half, -half])
    for _ in range(50):
        p = torch.sigmoid((m + draws) @ design.T)
        grad = (labels - p).mean(0) @ design - m
        hessian = design.T @ ((p * (1 - p)).mean(0)[:, None] * design) + torch.eye(m.numel(), dtype=torch.float64)
        m = m + torch.linalg.solve(hessian, grad)
        if float(grad.abs().max()) < 1e-10:
            break
    return m


def one(settings: dict) -> dict:
    """One default fit (a child's entry point): ``settings`` case, dim, rows."""
    import bnn_pyro as bp
    from bnn_pyro.infer import _health, svi_gap, svi_gap_cg, svi_refine_cg
    from bnn_pyro.infer.training_data import Data

    torch.set_num_threads(1)
    case, dim, rows = settings["case"], settings["dim"], settings["rows"]
    x, y = _data(case, dim, rows)
    model = _model(case, dim)
    seconds = {"refine_mean": 0.0, "newton_gap": 0.0}
    guides = []

    def timed(module, name):
        inner = getattr(module, name)

        def wrapped(guide, *args, **kwargs):
            if name == "newton_gap":
                guides.append(guide)
            start = time.perf_counter()
            try:
                return inner(guide, *args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        setattr(module, name, wrapped)

    timed(svi_refine_cg, "refine_mean")
    timed(svi_gap, "newton_gap")
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="svi", num_samples=5, seed=0, progress=False)
    fit_s = time.perf_counter() - start
    rest = fit_s - seconds["refine_mean"] - seconds["newton_gap"]
    (guide,) = guides
    gap = post.history.get(_health.GAP)
    out = dict(
        guide=post.config["guide"],
        warned=any("stopped short" in str(w.message) for w in caught),
        max_abs_gap=None if gap is None else round(float(gap.abs().max()), 4),
        gap_method=(post.config.get("guide_gap") or [{}])[0].get("method"),
        step=(post.config.get("guide_refinement") or [None])[0],
        fit_s=round(fit_s, 1),
        step_share=round(seconds["refine_mean"] / rest, 3),
        gap_share=round(seconds["newton_gap"] / rest, 3),
    )
    if case == "linear":
        design = x.double()
        precision = design.T @ design + torch.eye(dim, dtype=torch.float64)
        mean = torch.linalg.solve(precision, design.T @ y.double())
        sd = torch.linalg.inv(precision).diagonal().sqrt()
        out["max_miss_sds"] = float(((guide.loc.detach().double() - mean) / sd).abs().max())
    if settings.get("dense_check"):  # the dense gap on draws of its own, after the step
        dense_path = svi_gap_cg.GapPath("dense")
        original = svi_gap_cg.choose_path
        svi_gap_cg.choose_path = lambda *args, **kwargs: dense_path
        try:
            dense = svi_gap.newton_gap(guide, model, Data(x, y), seed=0)  # the chain's seed: the step's, other draws
        finally:
            svi_gap_cg.choose_path = original
        z = _health.gap_thresholds(dense.gap[None], dense.se[None], [dense.record["draws"]])[0]
        flagged = (dense.gap.abs() > _health.GAP_MAX) & (dense.gap.abs() > z * dense.se)
        out["dense_max_abs_gap"] = round(float(dense.gap.abs().max()), 4)
        out["dense_flagged"] = int(flagged.sum())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["linear", "logistic"], default="linear")
    parser.add_argument("--pairs", default="110x100,200x100,400x100,110x500,200x500,400x500,110x2000,200x2000,400x2000")
    parser.add_argument("--base", default="d28af86", help="the revision before the change")
    parser.add_argument("--name", default=None)
    parser.add_argument("--before", default="no refinement there", help="what the base revision does, for the header")
    args = parser.parse_args()
    rows_out = []
    with exported(args.base) as before:
        for dim, rows in size_pairs(args.pairs):
            settings = dict(case=args.case, dim=dim, rows=rows)
            for side, tree in (("before", before), ("after", REPOSITORY)):
                result = side_result(tree, "svi_full_rank_cg", "one", {**settings, "dense_check": side == "after"})
                rows_out.append(dict(dim=dim, rows=rows, side=side, **result))
                print(rows_out[-1], flush=True)
    frame = pd.DataFrame(rows_out)
    frame["step"] = frame["step"].map(lambda r: None if r is None else f"{r['accepted']} kept, {r['stopped']}")
    save_table(
        frame,
        "svi_convergence",
        args.name or f"fullcg_{args.case}",
        f"A full-rank guide (SVI's default on a Pyro function up to svi_lr.FULL_RANK_MAX_DIM coordinates) past the "
        f"dense refinement's bounds, at the defaults (5,000 steps, Laplace start, seed 0): before (revision "
        f"{args.base}: {args.before}) and after (this commit: the mean's Newton step by conjugate gradients, "
        f"svi_refine_cg). Case {args.case} (benchmarks/svi_full_rank_cg.py's docstring). max_miss_sds: the guide's "
        f"largest |mean - exact posterior mean| in exact posterior sds; max_abs_gap and warned: the engine's gap and "
        f"whether the fit warned 'stopped short'; step_share / gap_share: the step's / the gap's seconds over the rest "
        f"of the fit in the same run (one torch thread); dense_*: after the step, the dense gap on draws of its own "
        f"and the coordinates the health check's rule would flag there. Command: python benchmarks/svi_full_rank_cg.py "
        f"{' '.join(sys.argv[1:])}",
    )


if __name__ == "__main__":
    main()
