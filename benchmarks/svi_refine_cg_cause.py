"""Why the conjugate-gradient mean step (``bnn_pyro/infer/svi_refine_cg.py``) of a full-rank guide stopped short on
the logistic regressions of ``benchmarks/svi_full_rank_cg.py`` (``--case logistic``): each suspect varied alone, from
the same guide and the same 1,000 draws.

One default fit per size (5,000 steps, seed 0, the library as it is); the guide is saved where the engine hands it to
the step, and the step's loop is rerun from there with one setting changed at a time: the evaluations (5, the
library's ``MAX_EVALUATIONS`` then, now ``CHARGED_EVALUATIONS``: since ``fullcg_budget.md`` more as the fit's share
pays, against 10, 20, 50), the draws its ``H`` is averaged over (10, ``HESSIAN_DRAWS``,
against 50, 200 and all 1,000), the conjugate-gradient iteration cap (300 against 1,000), the halving (off: every
candidate kept), and the library's rule since this benchmark (10 draws, then after a rejected candidate the draws
that ``svi_gap_cg.choose_path`` gives, ``esc``; 166 and 40 are what 500 and 2,000 rows would get). The loop is the
library's (:func:`bnn_pyro.infer.svi_refine_cg.refine_mean`: same draws, same ``H`` draws, same solver and
tolerances), written out here with those knobs. Columns: ``gap``, the engine's gap after the step (``S`` times the
mean gradient on the step's draws, in guide sds: what the check judges, its tolerance 0.05); ``miss``, the largest
distance in guide sds to the reference optimum (the mean's optimum with the covariance as trained on 20,000
antithetic draws of another seed, by exact Newton with the closed-form expected Hessian of the logistic likelihood,
float64, to a gradient under 1e-10): its floor is the step's own Monte Carlo error (1,000 draws; the reference of a
second seed moved by 0.03 / 0.015); ``log``, each candidate's fate (``k`` kept, ``r`` rejected, at its rate; ``+H``:
solved again with that many draws); ``cg_iters``, each solve's iterations; ``seconds``, the loop's.

``--set budget`` (``BUDGET_VARIANTS``): the evaluations and the escalated draws against what the fit's share pays for,
on a few thousand rows: the library's rule before the step's account (5 evaluations; ``esc``: ``choose_path``'s
``step_hessian_draws``), with the account (``account``: a copy of the library's rule since ``fullcg_budget.md``, in
this loop: evaluations up to ``svi_refine.MAX_EVALUATIONS`` while the passes spent leave the share room, each solve
past the charged ones capped at what is left), and fixed counts of evaluations and escalated draws. Two more columns:
``passes``, the loop's passes over the rows (one per draw of each evaluation, two per Hessian draw of each solve's
iterations), and ``share_passes``, what ``FIT_SHARE`` of the fit pays for less the gap's gradients (the step's share:
within it where ``passes`` is at most this).

Run from the repository root: ``python benchmarks/svi_refine_cg_cause.py --pairs 110x100,300x100``; writes
``benchmarks/results/svi_convergence/fullcg_cause.md`` and ``.csv``; ``--set budget --pairs
110x2000,200x2000,300x2000,400x2000 --name fullcg_budget``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import pandas as pd
import torch
from _common import save_table, size_pairs
from svi_full_rank_cg import _data, _model, logistic_optimum

import bnn_pyro as bp
from bnn_pyro.infer import svi_gap_cg, svi_refine, svi_refine_cg
from bnn_pyro.infer.guide_density import derivatives, guide_target

VARIANTS = [
    dict(),
    dict(max_evals=10),
    dict(max_evals=20),
    dict(max_evals=50),
    dict(max_iter=1000),
    dict(halving=False, max_evals=10),
    dict(hessian_draws=50),
    dict(hessian_draws=200),
    dict(hessian_draws=1000),
    dict(escalate="rule"),
    dict(escalate=166),
    dict(escalate=40),
]
BUDGET_VARIANTS = [  # --set budget: the evaluations and the escalated draws against what the fit's share leaves
    dict(escalate="rule"),
    dict(escalate="rule", account=True),
    dict(escalate="rule", max_evals=10),
    dict(max_evals=20),
    dict(escalate=200, max_evals=10),
    dict(escalate=1000, max_evals=10),
]


def _saved_fit(dim: int, rows: int):
    """The default fit, and the guide's state, model and data where the engine called the mean's step."""
    x, y = _data("logistic", dim, rows)
    model = _model("logistic", dim)
    saved = {}
    inner = svi_refine_cg.refine_mean

    def keep(guide, model_, data, **kwargs):
        state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
        saved.update(guide=guide, model=model_, data=data, kwargs=kwargs, state=state)
        return inner(guide, model_, data, **kwargs)

    svi_refine_cg.refine_mean = keep
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bp.fit(model, x, y, method="svi", num_samples=5, seed=0, progress=False)
    finally:
        svi_refine_cg.refine_mean = inner
    saved["guide"].load_state_dict(saved["state"])
    return x, y, saved


def one_size(dim: int, rows: int, variants: list[dict] = VARIANTS) -> list[dict]:
    torch.set_num_threads(1)
    x, y, saved = _saved_fit(dim, rows)
    kwargs, data = saved["kwargs"], saved["data"]
    target = guide_target(saved["guide"], saved["model"], data, factored=True)
    tril = target.factor
    cov = tril @ tril.T
    sd = cov.diagonal().sqrt()
    reference = logistic_optimum(x, y, target.loc, tril, seed=1)
    other = logistic_optimum(x, y, target.loc, tril, seed=2)
    rule = svi_gap_cg.choose_path(dim, rows, fit_passes=kwargs["fit_passes"], full_rank=True).step_hessian_draws
    # what FIT_SHARE of the fit pays for in passes over the rows, less the gap's gradients (the dense gap after it)
    share = svi_gap_cg.FIT_SHARE * kwargs["fit_passes"] * (rows + svi_gap_cg.STEP_ROWS) / rows - svi_refine.DRAWS
    pairs = kwargs["num_draws"] // 2
    half = svi_gap_cg.antithetic_half(target, pairs, torch.Generator().manual_seed(kwargs["seed"]))
    deviations = torch.cat([half, -half])
    inverse_diag = 1 / svi_gap_cg.precision_diagonal(target.diag, target.factor)

    def evaluate(loc):
        d = derivatives(target.pot, target.order, (loc + deviations).to(target.dtype))
        grads = d.grads.double()
        return (
            loc,
            float(d.values.double().mean()),
            grads.mean(0),
            svi_gap_cg.rounding(grads, inverse_diag, target.dtype),
        )

    def hessian_at(draws: int):
        if draws == svi_gap_cg.HESSIAN_DRAWS:  # the library's: the gap's pairs
            chosen = svi_gap_cg.hessian_pairs(pairs, min(svi_gap_cg.BATCHES, pairs))
        else:  # spread over the pairs, as refine_mean's escalation
            chosen = torch.arange(min(pairs, draws // 2)) * pairs // min(pairs, draws // 2)
        return torch.cat([half[chosen], -half[chosen]])

    def run(max_evals=5, hessian_draws=10, max_iter=300, halving=True, escalate=None, account=False):
        escalate = rule if escalate == "rule" else escalate
        at, iterations, log = hessian_at(hessian_draws), [], []
        if account:  # evaluations up to svi_refine's, while the share pays for them and their solves
            max_evals = svi_refine.MAX_EVALUATIONS

        def spent():
            return evaluations * svi_refine.DRAWS + sum(passes)

        def newton(point):
            apply = svi_gap_cg.curvature(target, point[0] + at, rows=rows, width=1)
            cap = min(max_iter, int((share - spent()) // (2 * len(at)))) if account else max_iter
            if cap < 1:
                iterations.append(0)
                return None
            step, its, residual = svi_gap_cg.conjugate_gradients(
                apply, point[2][:, None], inverse_diag, tol=svi_gap_cg.TOL, max_iterations=cap, floor=point[3]
            )
            iterations.append(its)
            return step[:, 0] if residual <= svi_gap_cg.TOL else None

        start = time.perf_counter()
        point = first = evaluate(target.loc)
        evaluations, passes = 1, []
        step, rate, kept, stopped, escalated = newton(point), 1.0, 0, "evaluation limit", False
        passes.append(2 * len(at) * iterations[-1])  # each solve's Hessian-vector products: two passes per draw
        while evaluations < max_evals:
            if step is None:
                stopped = "no solve"
                break
            if float((step / sd).abs().max()) < svi_refine.TOL:
                stopped = "fixed point"
                break
            if account and spent() + svi_refine.DRAWS > share:
                stopped = "share spent"
                break
            new = evaluate(point[0] + rate * step)
            evaluations += 1
            if new[1] >= point[1] or not halving:
                log.append(f"k{rate:g}")
                point, kept, rate = new, kept + 1, 1.0
                step = newton(point)
                passes.append(2 * len(at) * iterations[-1])
            elif escalate and not escalated:
                log.append(f"r{rate:g}+H{escalate}")
                at, escalated, rate = hessian_at(escalate), True, 1.0
                step = newton(point)
                passes.append(2 * len(at) * iterations[-1])
            elif rate / 2 < svi_refine.MIN_RATE:
                log.append(f"r{rate:g}")
                stopped = "no better step"
                break
            else:
                log.append(f"r{rate:g}")
                rate /= 2
        gap = (cov @ point[2]) / sd
        return dict(
            evaluations=evaluations,
            kept=kept,
            stopped=stopped,
            gap=round(float(gap.abs().max()), 4),
            miss=round(float(((point[0] - reference) / sd).abs().max()), 4),
            elbo_change=round(point[1] - first[1], 3),
            cg_iters=" ".join(map(str, iterations)),
            log=" ".join(log),
            seconds=round(time.perf_counter() - start, 2),
            passes=evaluations * svi_refine.DRAWS + sum(passes),
            share_passes=round(share),
        )

    out = []
    for variant in variants:
        settings = {
            **dict(max_evals=5, hessian_draws=10, max_iter=300, halving=True, escalate=None, account=False),
            **variant,
        }
        if settings["escalate"] == "rule":
            settings["escalate"] = f"rule ({rule})"
        result = run(**{**variant})
        out.append(dict(dim=dim, rows=rows, **settings, **result))
        print(out[-1], flush=True)
    out[0]["reference_seeds_differ"] = round(float(((reference - other) / sd).abs().max()), 4)
    out[0]["start_miss"] = round(float(((target.loc - reference) / sd).abs().max()), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="110x100,300x100")
    parser.add_argument("--name", default="fullcg_cause")
    parser.add_argument(
        "--set", choices=["cause", "budget"], default="cause", help="the variants: VARIANTS or BUDGET_VARIANTS"
    )
    args = parser.parse_args()
    variants = VARIANTS if args.set == "cause" else BUDGET_VARIANTS
    rows_out = [row for dim, rows in size_pairs(args.pairs) for row in one_size(dim, rows, variants)]
    header = (
        "The full-rank guide's conjugate-gradient mean step on a few thousand rows against the fit's share: from the "
        "guide where a default fit (5,000 steps, seed 0) hands it to the step, the step's loop rerun on the same 1,000 "
        "draws with the evaluations and the escalated Hessian draws varied (benchmarks/svi_refine_cg_cause.py's "
        "docstring, --set budget: the columns, the reference). First row of each size: the library's step before the "
        "account (5 evaluations, 'rule (N)': choose_path's step_hessian_draws after a rejection); account True: a "
        "copy of the library's rule since, written out in this loop (evaluations up to 30 while the passes spent "
        "leave the share room; a solve cut by the account and failing reads 'no solve' here, 'share spent' in the "
        "library). passes: the loop's "
        "passes over the rows; share_passes: what svi_gap_cg.FIT_SHARE of the fit pays for, less the gap's gradients. "
        "reference_seeds_differ: the 20,000-draw reference at two seeds; start_miss: the guide before the step. One "
        f"torch thread. Command: python benchmarks/svi_refine_cg_cause.py {' '.join(sys.argv[1:])}"
    )
    save_table(
        pd.DataFrame(rows_out),
        "svi_convergence",
        args.name,
        header
        if args.set == "budget"
        else "Why the full-rank guide's conjugate-gradient mean step stopped short on the logistic regressions of "
        "benchmarks/svi_full_rank_cg.py: from the guide where a default fit (5,000 steps, seed 0) hands it to the "
        "step, the step's loop rerun on the same 1,000 draws with one knob changed (benchmarks/svi_refine_cg_cause.py's "
        "docstring: the columns, the reference). First row of each size: the library's step before this change "
        "(5 evaluations, H from 10 draws); escalate 'rule (N)': the library's rule after it. reference_seeds_differ: "
        "the 20,000-draw reference at two seeds; start_miss: the guide before the step. One torch thread. Command: "
        f"python benchmarks/svi_refine_cg_cause.py {' '.join(sys.argv[1:])}",
    )


if __name__ == "__main__":
    main()
