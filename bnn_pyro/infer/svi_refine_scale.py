"""Take a mean-field guide's (an ``AutoNormal``'s) sds to their ELBO fixed point past
:mod:`bnn_pyro.infer.svi_refine`'s bounds, without a dense Hessian: the diagonal of the expected Hessian from one
Hessian-vector product per coordinate.

The rule. For ``q = N(m, diag(s^2))`` the ELBO's derivative in ``s_i`` is ``s_i E_q[d2 log p / dz_i^2] + 1 / s_i``
(Price's theorem), so its stationary point in the sds is ``1 / s_i^2 = H_ii``, the diagonal of ``H = E_q[-hess log
p]`` (the dense refinement's mean-field fixed point). The damped step is the dense one's, ``1 / s_new^2 = (1 - r) / s^2
+ r H_ii``; on a Gaussian posterior ``H`` is its precision at every draw, so ``r = 1`` lands on the family's optimum
(``s_i = 1 / sqrt(H_ii)``) in one step.

``H_ii`` without ``H``: the expected Hessian's products with the unit vectors, in blocks of :data:`BLOCK` columns
(:func:`bnn_pyro.infer.svi_gap_cg.curvature`, at the mean step's and the gap's
:data:`~bnn_pyro.infer.svi_gap_cg.HESSIAN_DRAWS` draws: :func:`~bnn_pyro.infer.svi_gap_cg.hessian_pairs`), each column's
own entry kept: ``dim`` products per draw, exact wherever ``H`` is constant. Why not Hutchinson's ``E[v * H v]`` over
random sign vectors ``v``: each probe adds the off-diagonal mass ``sum_j!=i H_ij^2`` to the variance of ``H_ii``, which
on a correlated posterior is many times ``H_ii^2``; on the regressions of
``benchmarks/results/svi_convergence/scale_estimators.md`` (150-1,000 coordinates) as many probes as coordinates, the
columns' products, left some ``H_ii`` 0.31-0.33 off (an sd 0.16-0.22), where the columns were off by float rounding
(5e-7). Nor Stein's ``-E[e_i d log p / dz_i] / s_i`` from the 1,000 gradients the mean step takes anyway (no products):
at the optimum of a Gaussian its relative sd is ``sqrt((2 + sum_j!=i H_ij^2 / (H_ii H_jj)) / 500)`` (the antithetic
pairs cancel the gradient's constant part, not this quadratic one, so they count once), at least 0.063, and there it
left some sd 0.12-0.35 off, more than Adam had (0.06-0.14, ``scale_fits.md``).

Safeguards: a coordinate whose estimate is not positive and finite keeps its sd (no fixed point there: the ELBO rises
with its sd); the new sds are kept only where the ELBO on the draws (``mean log p(m + s e) + sum log s`` on
:data:`~bnn_pyro.infer.svi_refine.DRAWS` fixed antithetic standard-normal draws ``e``, those the mean step and the gap
take after it, from the same seed) does not fall, ``r`` halved otherwise down to
:data:`~bnn_pyro.infer.svi_refine.MIN_RATE` (1/16) within :data:`MAX_EVALUATIONS` evaluations; an undamped step that
moves no sd by :data:`~bnn_pyro.infer.svi_refine.TOL` of itself is not evaluated (``"fixed point"``: below what the
fit reports, and near the float32 rounding of the ELBO estimate). One diagonal only (each costs ``dim`` products per Hessian draw),
so off a Gaussian the step goes towards the fixed point from the trained sds, and it is not iterated. Whatever the model
raises, a model vmap cannot batch, or a non-finite ELBO at the start leaves the guide as it was, with the reason. It
runs where the mean's step does (:func:`bnn_pyro.infer.svi_gap_cg.choose_path`), before it, and only where its cost
leaves the conjugate-gradient solves :data:`~bnn_pyro.infer.svi_gap_cg.SCALE_KEEP` iterations (or all they have
without it, where fewer) within the check's share of the fit (:func:`~bnn_pyro.infer.svi_gap_cg.scale_fits`: a short
fit keeps its mean step and gap, review 16); its record says
what it spent (:class:`ScaleStep`), which the engine charges to the mean's step and the gap after it.

Its bias off a Gaussian. ``E[H_ii]`` over the 10 Hessian draws is unbiased, but the new sd ``1 / sqrt(H_ii)`` is convex
in it, so (Jensen) its estimate is biased upward where ``H`` varies over the guide: review 16 measured the log-scale
sd of a hierarchical model +0.5% to +5% above a 4,000-draw diagonal's at 6 of 6 seeds (the other coordinates within
0.3%), the fresh-draw ELBO still rising at every seed (+0.16 nats). One ``r`` is judged on the summed ELBO, so a
coordinate made slightly worse may ride along with many made better. On a Gaussian posterior there is no bias.

A low-rank guide's covariance is left as trained: its fixed point is the projection of ``H^-1`` onto the family
(:func:`~bnn_pyro.infer.svi_refine.project_low_rank`, which needs the dense ``H``), and its diagonal part alone has no
closed form (``diag(S^-1) = diag(H)`` couples ``D`` and ``W``), so no cheap rule is evidently correct there.

Example
-------
>>> result = refine_scale(guide, model, data)   # a ScaleStep, or None where not covered
>>> result.accepted, result.elbo_change, result.stopped, result.passes
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro.infer import autoguide

from bnn_pyro.infer import svi_gap_cg, svi_refine
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.guide_density import NoDensity, NotBatchable, derivatives, guide_target

__all__ = ["BLOCK", "MAX_EVALUATIONS", "ScaleStep", "diagonal", "refine_scale"]

MAX_EVALUATIONS = svi_gap_cg.SCALE_EVALUATIONS
"""Evaluations of the draws at most, the first included (``svi_gap_cg.SCALE_EVALUATIONS``, counted in its cost rule):
the start and candidates at ``r = 1, 1/2, 1/4, 1/8, 1/16``; a Gaussian posterior needs two."""
BLOCK = 256
"""Unit vectors per batched product pass of :func:`diagonal` at most: fewer where one pass's products (``draws x dim x
BLOCK``) would exceed :data:`~bnn_pyro.infer.svi_refine.CHUNK_ELEMENTS`, the memory rule of the batched Hessian passes,
since a pass of all ``dim`` columns at once would hold ``dim^2`` per draw (80 GB of float64 at 100,000 coordinates)."""


@dataclass(frozen=True)
class ScaleStep(svi_refine.Refinement):
    """What :func:`refine_scale` did (:class:`~bnn_pyro.infer.svi_refine.Refinement`'s fields) and ``passes``, the
    gradient passes over the rows it spent in :func:`~bnn_pyro.infer.svi_gap_cg.choose_path`'s units
    (:data:`~bnn_pyro.infer.svi_gap_cg.SCALE_COLUMN_PASSES` per coordinate for its diagonal,
    one per draw for each evaluation of the draws; 0 where it stopped before either): what the
    engine charges the mean's step and the gap after it, not the most it could have spent."""

    passes: int = 0


class _Spent:
    """The passes spent so far, kept where an error ends the step (:class:`ScaleStep`'s ``passes``)."""

    passes = 0


def refine_scale(
    guide, model, data: Data, *, num_draws: int = svi_refine.DRAWS, seed: int = 0, fit_passes: int | None = None
):
    """One damped fixed-point step for the sds of a fitted ``AutoNormal`` of ``model`` on ``data`` (full batch) past
    the dense bounds (module docstring), in place, from ``num_draws`` draws of a generator of its own seeded with
    ``seed`` (the mean's step and the gap after it, with the same seed, draw the same standard-normal draws): a
    :class:`ScaleStep`, or ``None`` where not covered (another guide, ``AutoDiagonalNormal`` included; not the
    conjugate-gradient path of :func:`~bnn_pyro.infer.svi_gap_cg.choose_path` for its unconstrained coordinates,
    ``data.size`` rows and the fit's ``fit_passes``). Skipped, with the reason naming the bound, where its cost would
    leave the solves fewer iterations than they must keep (:func:`~bnn_pyro.infer.svi_gap_cg.scale_fits`). It never raises."""
    if not isinstance(guide, autoguide.AutoNormal):
        return None
    device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    spent = _Spent()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a model drawing on its own
        try:
            return _refine_scale(guide, model, data, num_draws, generator, fit_passes, spent)
        except Exception as error:  # a finished fit never fails here
            return ScaleStep(0, 0.0, f"skipped: {type(error).__name__}: {error}", spent.passes)


def _refine_scale(
    guide, model, data: Data, num_draws: int, generator: torch.Generator, fit_passes: int | None, spent: _Spent
):
    try:
        target = guide_target(guide, model, data, factored=True)
    except NoDensity as error:
        return ScaleStep(0, 0.0, f"skipped: {error}")
    if target is None:
        return None
    dim = target.loc.numel()
    path = svi_gap_cg.choose_path(dim, data.size, fit_passes=fit_passes)
    if path.kind != "cg":
        return None
    if not svi_gap_cg.scale_fits(dim, data.size, fit_passes=fit_passes):
        return ScaleStep(
            0,
            0.0,
            f"skipped: its up to {svi_gap_cg.scale_passes(dim):,} gradient passes over the {data.size} rows "
            "(svi_gap_cg.scale_passes) would leave the conjugate-gradient solves fewer than the "
            f"{svi_gap_cg.kept_iterations(data.size, fit_passes)} iterations they must keep (svi_gap_cg.SCALE_KEEP, "
            f"{svi_gap_cg.SCALE_KEEP}, or all they have without it) within svi_gap_cg.FIT_SHARE "
            f"({svi_gap_cg.FIT_SHARE:g}) of the fit's {fit_passes:,} gradient passes (svi_gap_cg.scale_fits); "
            "more num_steps would run it",
        )
    pairs = max(1, num_draws // 2)
    sd = target.diag.sqrt()
    half = svi_gap_cg.antithetic_half(target, pairs, generator) / sd  # standard normal: the mean step's, unscaled
    noise = torch.cat([half, -half])
    chosen = svi_gap_cg.hessian_pairs(pairs, min(svi_gap_cg.BATCHES, pairs)).to(half.device)

    def elbo(scale):
        spent.passes += len(noise)  # an evaluation of the draws, one pass each (svi_gap_cg.scale_passes' units)
        values = derivatives(target.pot, target.order, (target.loc + noise * scale).to(target.dtype)).values.double()
        return float(values.mean() + scale.log().sum()) if bool(torch.isfinite(values).all()) else None

    try:  # first, since a model vmap cannot batch is skipped: its gradients one draw at a time would be wasted
        estimate = diagonal(target, torch.cat([half[chosen], -half[chosen]]) * sd, rows=data.size)
    except NotBatchable as error:  # at the first product: nothing spent
        return ScaleStep(0, 0.0, f"skipped: {error}, and its products one draw at a time cost too much")
    except ValueError as error:
        return ScaleStep(0, 0.0, f"skipped: {error}", svi_gap_cg.SCALE_COLUMN_PASSES * dim)
    spent.passes += svi_gap_cg.SCALE_COLUMN_PASSES * dim
    start = elbo(sd)
    if start is None:
        return ScaleStep(0, 0.0, "skipped: the log density is not finite at some draw", spent.passes)
    precision = torch.where(torch.isfinite(estimate) & (estimate > 0), estimate, sd**-2)  # no fixed point: kept
    if float((precision.rsqrt() / sd - 1).abs().max()) < svi_refine.TOL:
        return ScaleStep(0, 0.0, "fixed point", spent.passes)
    rate, evaluations = 1.0, 1
    while evaluations < MAX_EVALUATIONS:
        new = ((1 - rate) * sd**-2 + rate * precision).rsqrt()
        value = elbo(new)
        evaluations += 1
        if value is not None and value >= start:
            svi_refine.write_scale(guide, target.order, target.pot.shapes, new)
            return ScaleStep(1, value - start, "one step", spent.passes)
        if rate / 2 < svi_refine.MIN_RATE:
            break
        rate /= 2
    return ScaleStep(0, 0.0, "no better step", spent.passes)


def diagonal(target, deviations: torch.Tensor, *, rows: int) -> torch.Tensor:
    """``diag(mean_i -hess log p(m + d_i))`` over the rows ``d_i`` of ``deviations`` (``(n, dim)``) from the guide's
    mean ``m`` of ``target`` (a :class:`~bnn_pyro.infer.guide_density.GuideTarget`): float64 ``(dim,)``, one
    Hessian-vector product per coordinate and row, at most :data:`BLOCK` unit vectors per pass. Raises
    what :func:`~bnn_pyro.infer.svi_gap_cg.curvature` raises."""
    dim, device = target.loc.numel(), target.loc.device
    block = max(1, min(BLOCK, dim, svi_refine.CHUNK_ELEMENTS // (dim * len(deviations))))
    apply = svi_gap_cg.curvature(target, target.loc + deviations, rows=rows, width=block)
    out = torch.empty(dim, dtype=torch.float64, device=device)
    for start in range(0, dim, block):
        index = torch.arange(start, min(start + block, dim), device=device)
        cols = torch.arange(len(index), device=device)
        units = torch.zeros(dim, len(index), dtype=torch.float64, device=device)
        units[index, cols] = 1.0
        out[index] = apply(units)[index, cols]
    return out
