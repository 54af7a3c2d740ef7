"""A mean-field guide's scale step past the dense bounds (``bnn_pyro/infer/svi_refine_scale.py``): which estimator of
``diag(E_q[-hess log p])``, and what the step costs and does in a default fit.

The regression of ``benchmarks/svi_gap_cg_cost.py`` (``dim`` coefficients, ``N(0, 1)`` priors, correlated covariates,
known noise 1, ``rows`` rows): its posterior is Gaussian with precision ``H = X^T X + I``, so the mean-field optimum has
``s_i = 1 / sqrt(H_ii)`` exactly.

``--table estimators``: at a mean-field guide with those sds, the three estimators of ``H_ii`` on the module's 10
Hessian draws or the mean step's 1,000 draws, against the exact ``H_ii``: the columns (:func:`svi_refine_scale.diagonal`,
``dim`` products per draw), Hutchinson's ``mean_k v_k * H v_k`` with as many Rademacher probes as coordinates (the same
products) and with a tenth of them, and Stein's ``-mean(e_i d log p / dz_i) / s_i`` from the gradients at 1,000
antithetic draws (no products). Columns: products, seconds (best of ``--repeats``), the largest and the mean relative
error of ``H_ii``, and the largest relative error of the sd it gives.

``--table fits``: default fits (5,000 steps from the Laplace start, mean-field): the seconds of the whole fit and of
the scale step, the mean's step and the gap inside it, the scale step's share of the rest of the fit (``scale_ratio``,
its seconds over the fit's without the three), what the step did, and how far the sds were from ``1 / sqrt(H_ii)``
before and after it (largest and mean relative distance).

``--table passes``: the scale step's cost in the units of :func:`svi_gap_cg.choose_path`'s model, at a guide with
sds 1.5 times ``1 / sqrt(H_ii)`` (the step is taken): seconds (best of ``--repeats``) of its diagonal
(:func:`svi_refine_scale.diagonal`, ``dim`` columns at the 10 Hessian draws), of one conjugate-gradient iteration's
products (the gap's ``BATCHES`` columns and the mean step's ``STEP_SOLVES`` single columns at the same draws: the
model's ``_PER_ITERATION`` passes), of one evaluation of the 1,000 draws (values and gradients: the model's
``svi_refine.DRAWS`` passes) and of the whole step (:func:`svi_refine_scale.refine_scale`); the diagonal and the step
in passes by each yardstick (seconds over the iteration's times its passes; over the evaluation's times its passes),
against the model's :func:`svi_gap_cg.scale_passes` (the most the step may take) and the passes the step recorded.

Run from the repository root: ``python benchmarks/svi_refine_scale_cost.py --pairs 150x1000,500x1000,1000x1000``;
writes ``benchmarks/results/svi_convergence/<name>.md`` and ``.csv`` (``scale_estimators`` and ``scale_fits`` by
default). One torch thread.
"""

from __future__ import annotations

import argparse
import time
import warnings

import pandas as pd
import pyro
import torch
from _common import save_table, size_pairs, time_calls
from pyro.infer import autoguide
from svi_gap_cg_cost import _model
from torch.distributions import transform_to

import bnn_pyro as bp
from bnn_pyro.infer import svi_gap, svi_gap_cg, svi_refine, svi_refine_cg, svi_refine_scale
from bnn_pyro.infer.guide_density import derivatives, guide_target
from bnn_pyro.infer.training_data import Data


def _data(dim: int, rows: int):
    """``svi_gap_cg_cost.one``'s data, and the exact ``H_ii``."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=g) + 0.3 * torch.randn(rows, 1, generator=g)
    y = x @ torch.randn(dim, generator=g) * 0.3 + torch.randn(rows, generator=g)
    return x, y, (x.double() ** 2).sum(0) + 1


def _best(run, repeats: int):
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - start)
    return out, min(seconds)


def estimators(dim: int, rows: int, repeats: int) -> list[dict]:
    x, y, exact = _data(dim, rows)
    data = Data(x, y)
    with pyro.get_param_store().scope():
        guide = autoguide.AutoNormal(_model)
        guide(x, y)
        with torch.no_grad():
            guide.scales.b_unconstrained.copy_(transform_to(guide.scale_constraint).inv(exact.rsqrt().float()))
        target = guide_target(guide, _model, data, factored=True)
    sd = target.diag.sqrt()
    generator = torch.Generator().manual_seed(0)
    pairs = svi_refine.DRAWS // 2
    half = svi_gap_cg.antithetic_half(target, pairs, generator)
    chosen = svi_gap_cg.hessian_pairs(pairs, svi_gap_cg.BATCHES)
    at = torch.cat([half[chosen], -half[chosen]])

    def hutchinson(probes: int):
        signs = torch.randint(0, 2, (dim, probes), generator=torch.Generator().manual_seed(1)).double() * 2 - 1
        apply = svi_gap_cg.curvature(target, target.loc + at, rows=rows, width=min(svi_refine_scale.BLOCK, probes))
        total = torch.zeros(dim, dtype=torch.float64)
        for start in range(0, probes, svi_refine_scale.BLOCK):
            block = signs[:, start : start + svi_refine_scale.BLOCK]
            total += (block * apply(block)).sum(1)
        return total / probes

    def stein():
        noise = torch.cat([half, -half])
        grads = derivatives(target.pot, target.order, (target.loc + noise).to(target.dtype)).grads.double()
        return -((noise / sd) * grads).mean(0) / sd

    rows_out = []
    for name, products, run in (
        ("columns", len(at) * dim, lambda: svi_refine_scale.diagonal(target, at, rows=rows)),
        ("hutchinson, dim probes", len(at) * dim, lambda: hutchinson(dim)),
        ("hutchinson, dim/10 probes", len(at) * max(1, dim // 10), lambda: hutchinson(max(1, dim // 10))),
        ("stein, 1,000 gradients", 0, stein),
    ):
        estimate, seconds = _best(run, repeats)
        error = (estimate / exact - 1).abs()
        sd_error = (estimate.clamp(min=1e-12).rsqrt() / exact.rsqrt() - 1).abs()
        rows_out.append(
            dict(
                dim=dim,
                rows=rows,
                estimator=name,
                products=products,
                seconds=round(seconds, 3),
                max_rel_error_H_ii=f"{float(error.max()):.1e}",
                mean_rel_error_H_ii=f"{float(error.mean()):.1e}",
                max_rel_error_sd=f"{float(sd_error.max()):.1e}",
                nonpositive=int((estimate <= 0).sum()),
            )
        )
        print(rows_out[-1], flush=True)
    return rows_out


_SECONDS: dict[str, list] = {"refine_scale": [], "refine_mean": [], "newton_gap": []}
_SDS: list = []


def _capture_sds(inner):
    """``refine_scale`` that keeps the guide's sds before and after it (in ``_SDS``)."""

    def captured(guide, *args, **kwargs):
        before = guide.scales.b.detach().double().clone()
        try:
            return inner(guide, *args, **kwargs)
        finally:
            _SDS.append((before, guide.scales.b.detach().double().clone()))

    return captured


def fit(dim: int, rows: int) -> dict:
    x, y, exact = _data(dim, rows)
    optimum = exact.rsqrt()
    for seconds in _SECONDS.values():
        seconds.clear()
    _SDS.clear()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_model, x, y, method="svi", guide="mean_field", num_samples=100, seed=0, progress=False)
    fit_s = time.perf_counter() - start
    scale_s, step_s, gap_s = (sum(_SECONDS[name]) for name in ("refine_scale", "refine_mean", "newton_gap"))
    scale = post.config["guide_refinement"][0].get("scale", {})
    ((before, after),) = _SDS
    before, after = (before / optimum - 1).abs(), (after / optimum - 1).abs()
    return dict(
        dim=dim,
        rows=rows,
        fit_s=round(fit_s, 2),
        scale_s=round(scale_s, 3),
        scale_ratio=round(scale_s / (fit_s - scale_s - step_s - gap_s), 4),
        mean_step_s=round(step_s, 2),
        gap_s=round(gap_s, 2),
        gap_iterations=post.config["guide_gap"][0].get("iterations"),
        scale_stopped=scale.get("stopped"),
        scale_elbo_change=round(scale.get("elbo_change", float("nan")), 4),
        before_max=f"{float(before.max()):.1e}",
        before_mean=f"{float(before.mean()):.1e}",
        after_max=f"{float(after.max()):.1e}",
        after_mean=f"{float(after.mean()):.1e}",
    )


def passes(dim: int, rows: int, repeats: int) -> dict:
    x, y, exact = _data(dim, rows)
    data = Data(x, y)
    with pyro.get_param_store().scope():
        guide = autoguide.AutoNormal(_model)
        guide(x, y)
        fitted = transform_to(guide.scale_constraint).inv(1.5 * exact.rsqrt().float())
        with torch.no_grad():
            guide.scales.b_unconstrained.copy_(fitted)
        target = guide_target(guide, _model, data, factored=True)
        pairs = svi_refine.DRAWS // 2
        half = svi_gap_cg.antithetic_half(target, pairs, torch.Generator().manual_seed(0))
        at = target.loc + torch.cat([half[:5], -half[:5]])
        noise = (target.loc + torch.cat([half, -half])).to(target.dtype)
        wide = svi_gap_cg.curvature(target, at, rows=rows, width=svi_gap_cg.BATCHES)
        narrow = svi_gap_cg.curvature(target, at, rows=rows, width=1)
        columns = torch.randn(dim, svi_gap_cg.BATCHES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

        def iteration():
            wide(columns)
            for k in range(svi_gap_cg.STEP_SOLVES):
                narrow(columns[:, k : k + 1])

        def step():
            with torch.no_grad():
                guide.scales.b_unconstrained.copy_(fitted)
            return svi_refine_scale.refine_scale(guide, _model, data)

        _, diag_s = _best(lambda: svi_refine_scale.diagonal(target, at - target.loc, rows=rows), repeats)
        _, iteration_s = _best(iteration, repeats)
        _, evaluation_s = _best(lambda: derivatives(target.pot, target.order, noise), repeats)
        result, step_s = _best(step, repeats)
    per_iteration = 2 * svi_gap_cg.HESSIAN_DRAWS * (svi_gap_cg.BATCHES + svi_gap_cg.STEP_SOLVES)
    by_iteration, by_evaluation = per_iteration / iteration_s, svi_refine.DRAWS / evaluation_s  # passes per second
    return dict(
        dim=dim,
        rows=rows,
        diag_s=round(diag_s, 4),
        iteration_s=round(iteration_s, 4),
        evaluation_s=round(evaluation_s, 4),
        step_s=round(step_s, 4),
        step_stopped=result.stopped,
        diag_passes_old_model=2 * svi_gap_cg.HESSIAN_DRAWS * dim,
        diag_passes_by_iteration=round(diag_s * by_iteration),
        diag_passes_by_evaluation=round(diag_s * by_evaluation),
        step_passes_by_iteration=round(step_s * by_iteration),
        step_passes_by_evaluation=round(step_s * by_evaluation),
        step_passes_recorded=getattr(result, "passes", None),
        scale_passes_model=svi_gap_cg.scale_passes(dim),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="150x1000,500x1000,1000x1000", help="dim x rows points")
    parser.add_argument("--table", choices=["estimators", "fits", "both", "passes"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="scale")
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_iteration = 2 * svi_gap_cg.HESSIAN_DRAWS * (svi_gap_cg.BATCHES + svi_gap_cg.STEP_SOLVES)
    pairs = size_pairs(args.pairs)
    if args.table in ("estimators", "both"):
        frame = pd.DataFrame([row for dim, rows in pairs for row in estimators(dim, rows, args.repeats)])
        save_table(
            frame,
            "svi_convergence",
            f"{args.name}_estimators",
            f"Estimators of the expected Hessian's diagonal H_ii on a Gaussian posterior (the regression of "
            f"svi_gap_cg_cost.py, exact H = X^T X + I), at a mean-field guide with sds 1 / sqrt(H_ii): products "
            f"(Hessian-vector, each about two gradient passes over the rows) at the module's "
            f"{svi_gap_cg.HESSIAN_DRAWS} Hessian draws, seconds (best of {args.repeats}), relative errors of H_ii "
            f"and of the sd 1 / sqrt(estimate) (a non-positive estimate clamped to 1e-12).",
        )
    if args.table == "passes":
        passes(120, 200, 1)  # untimed: first-call costs out of the first row
        frame = pd.DataFrame([passes(dim, rows, args.repeats) for dim, rows in pairs])
        print(frame.to_string(), flush=True)
        save_table(
            frame,
            "svi_convergence",
            f"{args.name}_passes",
            "The mean-field scale step's cost in the units of svi_gap_cg.choose_path's model, on the Gaussian "
            "regression of svi_gap_cg_cost.py at sds 1.5 times the mean-field optimum: seconds (best of "
            f"{args.repeats}) of its diagonal (dim columns at {svi_gap_cg.HESSIAN_DRAWS} Hessian draws), of one "
            f"conjugate-gradient iteration's products ({svi_gap_cg.BATCHES} columns and {svi_gap_cg.STEP_SOLVES} "
            f"single ones at those draws: {per_iteration} passes in the model), of one evaluation of the "
            f"{svi_refine.DRAWS} draws (values and gradients: {svi_refine.DRAWS} passes in the model) and of the "
            "whole step; the diagonal and the step in passes by each yardstick (seconds times the yardstick's "
            "passes per second), against the old model's diagonal (2 x HESSIAN_DRAWS x dim), the passes the step "
            "recorded and svi_gap_cg.scale_passes (the most it may take).",
        )
    if args.table in ("fits", "both"):
        svi_refine_scale.refine_scale = _capture_sds(svi_refine_scale.refine_scale)
        for module, name in (
            (svi_refine_scale, "refine_scale"),
            (svi_refine_cg, "refine_mean"),
            (svi_gap, "newton_gap"),
        ):
            time_calls(module, name, _SECONDS[name])
        fit(120, 200)  # untimed: first-call costs out of the first row
        frame = pd.DataFrame([fit(dim, rows) for dim, rows in pairs])
        print(frame, flush=True)
        save_table(
            frame,
            "svi_convergence",
            f"{args.name}_fits",
            "Default fits (5,000 steps from the Laplace start, mean-field guide, seed 0) of the regression of "
            "svi_gap_cg_cost.py: seconds of the fit and, inside it, of the scale step (svi_refine_scale), the mean's "
            "step and the gap; `scale_ratio`: the scale step's seconds over the rest of the fit (without the three); "
            "the sds' relative distance from the mean-field optimum 1 / sqrt(H_ii) before and after the scale step "
            "(largest, mean).",
        )


if __name__ == "__main__":
    main()
