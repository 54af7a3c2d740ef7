"""The Newton gap of a mean-field or low-rank guide without dense Hessians: conjugate gradients on Hessian-vector
products, for the guides of :mod:`bnn_pyro.infer.svi_gap` past the dense path's bounds. A full-rank guide there takes
the mean's step by this module's solver (:mod:`bnn_pyro.infer.svi_refine_cg`, read as factors ``D = 0``, ``W = L``:
:func:`~bnn_pyro.infer.guide_density.guide_factors`), but its gap after the step is the dense statistic on the step's
draws, which needs no Hessian (:mod:`bnn_pyro.infer.svi_gap`); :func:`cg_gap` still takes its factors.

The statistic is :mod:`bnn_pyro.infer.svi_gap`'s: ``H^-1 E_q[grad log p]`` in the guide's sds, the Newton step from
the guide's mean to its family's ELBO optimum with the expected Hessian ``H = E_q[-hess log p]`` (the ELBO's curvature
in the mean, whatever the family: for a mean-field guide ``diag(S)`` is not ``H^-1`` wherever the posterior
correlates, for a low-rank one ``S`` is not either). Past :data:`~bnn_pyro.infer.svi_refine.MAX_DIM` coordinates or
:data:`~bnn_pyro.infer.svi_refine.MAX_WORK` coordinates x rows the dense ``H`` costs ``dim`` gradient passes per draw,
so here ``H`` is never formed:

- ``E_q[grad log p]``: the gradients at :data:`~bnn_pyro.infer.svi_gap.GAP_DRAWS` guide draws in antithetic pairs
  (``m + e`` and ``m - e``, ``e = D^1/2 u + W v``: exact draws of ``N(m, diag(D) + W W^T)`` without the dense ``S``),
  split into :data:`BATCHES` batches of whole pairs. The pairs are the control variate: over a batch the deviations
  ``z - m`` cancel exactly, so any control variate linear in them (the full-rank gap's ``S^-1 (z - m)``, the dense
  low-rank gap's ``H (z - m)``) has mean zero there and is built in at no cost; where ``log p`` is quadratic its
  gradient is linear and each batch's mean is the exact ``E_q[grad log p]``.
- ``H v``: the mean over :data:`HESSIAN_DRAWS` of those draws (whole pairs, from batches spread over all of them:
  :func:`hessian_pairs`) of the per-draw Hessian-vector
  products (:func:`bnn_pyro.infer.guide_density.hessian_products`: batched reverse over reverse, vmap's fallback rules:
  a model vmap cannot batch gets no verdict, since one draw at a time the products would cost ``HESSIAN_DRAWS x
  BATCHES`` traced passes per iteration). On a Gaussian posterior ``H`` is its precision at every draw, so a few
  draws give it exactly; elsewhere their Monte Carlo error is a relative error of the step (it scales a gap, it does
  not make one where the gradient's mean is zero).
- ``H x_k = b_k`` for every batch's mean gradient ``b_k`` at once, by conjugate gradients (:func:`conjugate_gradients`,
  one matrix product per iteration for all batches) preconditioned by the guide's own precision diagonal (``1 / D``
  for a mean-field guide, whose optimum has ``1 / D_i = H_ii``; ``diag(S^-1)`` by Woodbury for a low-rank one, by a
  triangular solve for a full-rank one: :func:`precision_diagonal`), to a
  relative residual :data:`TOL` (or below the mean gradient's float rounding, :data:`ROUNDING`) or
  :data:`MAX_ITERATIONS` iterations (no verdict where that is not reached).
- The gap is the mean of the ``x_k`` (``H^-1`` of the mean gradient: ``H`` is linear) over the guide's sds, its
  standard error the spread of the ``x_k`` over ``sqrt(BATCHES)``: batch means, which count the gradients' Monte Carlo
  error (not the Hessian draws', a relative error as above).

Cost, the rule: one iteration takes ``HESSIAN_DRAWS x BATCHES`` Hessian-vector products (each about two gradient
passes) over every row, the gradients :data:`~bnn_pyro.infer.svi_gap.GAP_DRAWS` passes, against a fit's 5,000 steps
of one pass each plus Pyro's fixed per-step cost; the iterations grow with the condition number of ``H`` in the guide's
scales, which is not known before the solve. So the check runs to ``dim x rows <=`` :data:`MAX_WORK` only, and
where its :data:`CHECK_PASSES` over the rows (with the mean's step's) cost at most :data:`FIT_SHARE` of the fit's own
passes (:func:`choose_path`, the one rule for every caller: the SVI engine records ``"not checked: ..."`` past
either), and to :data:`MAX_ITERATIONS`. The dense path (:mod:`bnn_pyro.infer.svi_refine` and the dense gap) has
the same bound from the fit's cost, in the same rule (:func:`dense_passes`: :data:`DENSE_PASSES` passes per coordinate
for each draw's Hessian). The derivatives are taken without an autograd graph (a model's ``pyro.param``
values require grad, and the gap would otherwise keep every iteration's products alive).

Example
-------
>>> out = cg_gap(target, rows=len(y), num_draws=1000, generator=torch.Generator().manual_seed(0))
>>> out.gap, out.se, out.record       # in guide sds (or None with out.reason); method, draws, iterations, residual
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from bnn_pyro.infer import svi_refine
from bnn_pyro.infer.guide_density import GuideTarget, NotBatchable, derivatives, hessian_products

__all__ = [
    "BATCHES",
    "CHECK_PASSES",
    "DENSE_PASSES",
    "FIT_SHARE",
    "HESSIAN_DRAWS",
    "MAX_ITERATIONS",
    "MAX_WORK",
    "ROUNDING",
    "STEP_ROWS",
    "STEP_SOLVES",
    "SCALE_COLUMN_PASSES",
    "SCALE_EVALUATIONS",
    "SCALE_KEEP",
    "TOL",
    "CGGap",
    "GapPath",
    "antithetic_half",
    "cg_gap",
    "choose_path",
    "conjugate_gradients",
    "curvature",
    "dense_passes",
    "hessian_pairs",
    "kept_iterations",
    "precision_diagonal",
    "rounding",
    "scale_fits",
    "scale_passes",
]

BATCHES = 20
"""Batches of the gradient draws (50 draws, 25 antithetic pairs, each of the default 1,000): one solve each, all in one
conjugate-gradient run. The standard error's own error is then ``1 / sqrt(2 (BATCHES - 1))``, 16%, so the check
(:func:`~bnn_pyro.infer._health.check_guide_gap`) judges this path's gap against Student's t on ``BATCHES - 1`` = 19
degrees of freedom at the dense path's chance (:func:`~bnn_pyro.infer._health.gap_thresholds`: the normal's at 4
standard errors, 6.3e-5, for the whole fit, split over its coordinates by Sidak's rule counting the 0.05-sd floor; 5.1
standard errors at one coordinate, where the normal's 4 would have the t's chance 7.6e-4, and 8.5 at 1,000 where no
floor is in reach)."""
HESSIAN_DRAWS = 10
"""Draws (5 antithetic pairs: the first pair of 5 batches spread over the :data:`BATCHES`, :func:`hessian_pairs`)
averaged for each product of the expected Hessian: its Monte Carlo error scales the step by a relative error (none on
a Gaussian posterior, where ``H`` is constant), and every iteration costs ``HESSIAN_DRAWS x BATCHES`` products, so
few. The mean's step starts from these and averages more once a candidate is rejected, as the fit's share allows
(:func:`choose_path`'s ``step_hessian_draws``; :mod:`~bnn_pyro.infer.svi_refine_cg` says why)."""
TOL = 1e-4
"""Conjugate gradients stop when every batch's residual, in the norm of the preconditioner's inverse (the guide's
whitened frame), is at most this fraction of the largest right-hand side's: far below the gap's standard error."""
MAX_ITERATIONS = 300
"""Conjugate-gradient iterations at most; where the residual is still above :data:`TOL` there is no verdict (a badly
conditioned ``H`` in the guide's own scales: the record gives the residual). A regression with as many rows as
coefficients took 148-161 at 1,000 x 1,000 (condition number ~1e5 in the guide's scales) and 57-239 at 2,000 x 2,000;
with three times the rows, 17 (``benchmarks/results/svi_convergence/gap_cg_cost.md``)."""
MAX_WORK = 1_000_000
"""The most ``dim x rows`` the conjugate-gradient gap runs on (module docstring: the cost rule). On linear regressions
(``benchmarks/results/svi_convergence/gap_cg_cost.md``, against a default fit extrapolated from 500 steps) it cost
0.009-0.04 of the fit at 150,000-500,000 and 0.23-0.31 at 1,000,000 with an ill-conditioned ``H`` (148-161
iterations; 0.23-0.40 of the rest of real default fits there, ``gap_cg_defaults.md``); past it, 0.06-0.10 at 3,000,000 and 0.02-0.04 at 10,000,000 where ``H`` was well conditioned (16-24
iterations, and the fit's own steps grew with the rows), but as much as the fit at 4,000,000 with an ill-conditioned
one (2,000 x 2,000, mean-field: 239 iterations). The iterations, which depend on the conditioning, are not known
before the solve, so the cap is at the largest size whose worst measured case stayed well under the fit."""


CHECK_PASSES = 6_000
"""Gradient passes over every row that the mean's step and the gap take at most, besides their Hessian-vector
products: :data:`~bnn_pyro.infer.svi_gap.GAP_DRAWS` draws for the gap and as many for each of the step's
:data:`~bnn_pyro.infer.svi_refine_cg.CHARGED_EVALUATIONS` evaluations (1,000 x (1 + 5); a test keeps it equal)."""
STEP_SOLVES = 5
"""Conjugate-gradient solves the mean's step takes at most, one right-hand side each: one per evaluation,
:data:`~bnn_pyro.infer.svi_refine_cg.CHARGED_EVALUATIONS` (that module imports this one; a test keeps them equal)."""
SCALE_EVALUATIONS = 6
"""Evaluations of the draws that a mean-field guide's scale step takes at most, the first included: the start and the
candidates at ``r = 1, 1/2, 1/4, 1/8, 1/16`` (down to :data:`~bnn_pyro.infer.svi_refine.MIN_RATE`, as the other
refinements; :data:`~bnn_pyro.infer.svi_refine_scale.MAX_EVALUATIONS`, which imports this module)."""
SCALE_KEEP = 200
"""Conjugate-gradient iterations the scale step must leave the solves (or all they have without it, where that is
fewer): :func:`scale_fits`. At least what the solves were measured to need on default fits where the step runs at all
(``benchmarks/results/svi_convergence/gap_cg_defaults_refined.md`` and ``scale_fits.md``: 6-191 iterations at 150-1,000
coordinates x 1,000 rows), while the step still runs on default fits of about 2,000 rows (review 18: keeping all of
:data:`MAX_ITERATIONS`, a worst-case cap, skipped it from 2,000 rows on)."""
SCALE_COLUMN_PASSES = 16
"""Gradient passes over the rows that the scale step's diagonal costs per coordinate, its :data:`HESSIAN_DRAWS` draws
together, in this model's units (a conjugate-gradient iteration's products, ``2 HESSIAN_DRAWS (BATCHES + STEP_SOLVES)``
= 500 passes: :func:`choose_path`). Not the
``2 x HESSIAN_DRAWS`` = 20 of one product per draw counted alone: the diagonal batches up to
:data:`~bnn_pyro.infer.svi_refine_scale.BLOCK` columns at all the draws per pass, so its products cost less each.
Measured (``benchmarks/results/svi_convergence/scale_passes.md``: its seconds over one iteration's, times the
iteration's passes, one torch thread): 1.9-3.7 per coordinate at 400-2,000 rows, 6-13 at 5,000-50,000 (the batch
narrows as the rows grow, :func:`~bnn_pyro.infer.svi_refine.hessian_chunk`); 16 is at least every measured row. A
modelled cost, not a timing, so that the same seed always gives the same path."""
STEP_ROWS = 50_000
"""One SVI step's fixed cost (Pyro's tracing of the model and the guide, the optimizer: what a step costs on small
data), counted in rows of one draw's batched gradient pass. The rule: on a fit whose rows dominate, one draw's
batched pass over the rows costs about one of the fit's steps, and on small data a step's fixed cost is what a pass
over some tens of thousands of rows takes (review 14's reproduction, an 11-coordinate regression on 90,000 rows:
~45,000 rows, counted as 50,000). A modelled cost, not a timing, so that the same seed always gives the same
posterior."""
FIT_SHARE = 1.0
"""The mean's step and the gap run only where their :data:`CHECK_PASSES` over the rows cost at most this share of the
fit's own gradient passes (``num_steps x num_particles``, each over the rows plus :data:`STEP_ROWS`): where the rows
dominate the fit's cost, a batched pass per draw costs about one of its steps, so the two together cost at most about
the fit (review 14 measured 5.6 times a 300-step fit and 1.0 times a default one at 11 coordinates x 90,000 rows: the
first is now skipped, the second kept); where Pyro's per-step cost dominates, as on every benchmark of
``gap_cg_cost.md``, far less (0.01-0.5 of the fit)."""


DENSE_PASSES = 3
"""Gradient passes over the rows that one draw's exact Hessian costs per unconstrained coordinate on the dense path
(:mod:`bnn_pyro.infer.svi_refine`'s evaluations, a low-rank guide's gap): a reverse pass over a reverse pass per
coordinate, 2-3 gradient passes. Why 3, not the 2 of a Hessian-vector product: with 2 the modeled share of the fit
fell below the measured one at 10 coordinates x 200 rows (a low-rank guide's check: 2.1 modeled, 1.7 and 2.5 measured
in two runs), where each batched pass is small; with 3 the model is at least the measured share on every row where a
Hessian ran (``benchmarks/svi_dense_check_cost.py``, ``benchmarks/results/svi_convergence/dense_check_cost.md``). The
rule, not a timing: the same seed always gives the same path."""


def dense_passes(dim: int, evaluations: int, *, hessian_gap: bool = True) -> int:
    """The dense check's gradient passes over the rows for ``dim`` coordinates: ``evaluations`` of the refinement's
    :data:`~bnn_pyro.infer.svi_refine.DRAWS` draws with exact Hessians (:data:`DENSE_PASSES` ``x dim`` each) and the
    gap's as many draws (the same count as :data:`~bnn_pyro.infer.svi_gap.GAP_DRAWS`), with Hessians (a low-rank
    guide's, ``hessian_gap``) or with gradients only (a full-rank guide's: one pass each)."""
    hessian = DENSE_PASSES * dim
    return svi_refine.DRAWS * (hessian * evaluations + (hessian if hessian_gap else 1))


class GapPath(NamedTuple):
    """:func:`choose_path`'s answer: ``kind`` ``"dense"`` (:mod:`bnn_pyro.infer.svi_refine`'s bounds: the dense
    refinement and gap), ``"cg"`` (this module and :mod:`bnn_pyro.infer.svi_refine_cg`) or ``"none"`` (not checked,
    ``reason`` says why); on the dense path ``max_evaluations`` bounds the refinement (below 2, it is skipped for the
    fit's cost, ``reason`` says so, and the gap alone runs); on the conjugate-gradient path ``step_hessian_draws`` is
    what the mean's step averages ``H`` over once a candidate was rejected (:mod:`~bnn_pyro.infer.svi_refine_cg`;
    :data:`HESSIAN_DRAWS` where the fit's share pays for no more), ``step_passes`` the passes over the rows the step may
    spend in all (its evaluations' gradients, its solves' products and its batchability probe's one: ``None`` where the
    fit does not bound it) and ``max_evaluations`` its evaluations at most (``svi_refine.MAX_EVALUATIONS``, the dense
    refinement's: past :data:`~bnn_pyro.infer.svi_refine_cg.CHARGED_EVALUATIONS` only as ``step_passes`` pays)."""

    kind: str
    reason: str | None = None
    max_iterations: int = MAX_ITERATIONS  # the conjugate-gradient solves' share of the fit's cost (choose_path)
    max_evaluations: int = svi_refine.MAX_EVALUATIONS  # the dense refinement's share of the fit's cost (choose_path)
    step_hessian_draws: int = svi_refine.DRAWS  # the mean step's solves after a rejected candidate (choose_path)
    step_passes: float | None = None  # the mean step's account in passes over the rows (choose_path; None: unbounded)


def choose_path(
    dim: int,
    rows: int,
    *,
    fit_passes: int | None = None,
    full_rank: bool = False,
    spent_passes: int = 0,
    gap: bool = True,
) -> GapPath:
    """Which path a Gaussian guide's refinement and gap take for ``dim`` unconstrained coordinates (the guide's, which a
    site such as ``LKJCholesky`` or a simplex has fewer of than constrained elements) on ``rows`` rows, after a fit of
    ``fit_passes`` gradient passes (``num_steps x num_particles``, fewer where the particles are vectorized and pay a
    step's fixed cost once: the SVI engine's ``_fit_passes``; ``None``: not bounded by it). The one rule the SVI
    engine, :func:`~bnn_pyro.infer.svi_gap.newton_gap` and :func:`~bnn_pyro.infer.svi_refine_cg.refine_mean` all
    decide by.

    A mean-field or low-rank guide: dense within ``svi_refine.MAX_DIM`` coordinates and ``svi_refine.MAX_WORK``
    coordinates x rows; past them by conjugate gradients up to :data:`MAX_WORK` and :data:`FIT_SHARE` of the fit's
    passes, the conjugate-gradient iterations bounded by what that share leaves after the :data:`CHECK_PASSES`
    (``max_iterations``: each iteration of the gap's solve takes ``2 HESSIAN_DRAWS BATCHES`` passes, of the step's
    solves ``2 HESSIAN_DRAWS`` each, at most :data:`STEP_SOLVES` of them; a solve that stops there gives no verdict, so
    the check never costs more than that share of the fit: review 15 measured 1.9 times a 150-step fit before);
    otherwise not checked. Where the share pays for all :data:`MAX_ITERATIONS`, what it leaves beyond them pays for
    the step's ``H`` from more draws after a rejected candidate (``step_hessian_draws``, whole pairs up to
    ``svi_refine.DRAWS``: every one of the :data:`STEP_SOLVES` solves charged at that count for ``max_iterations``, so
    the bound holds whichever solves take them); elsewhere the solves keep every pass and the step its
    :data:`HESSIAN_DRAWS`. Those charges are a worst case (every solve at ``max_iterations``), which pays for the
    step's first :data:`STEP_SOLVES` evaluations and solves whatever they take; what they leave unspent pays for more
    (``step_passes``: all of the share but the gap's solve at its cap, :data:`~bnn_pyro.infer.svi_gap.GAP_DRAWS`
    gradients and ``spent_passes``; the step keeps the account of what it spent and goes on to
    ``max_evaluations`` while it pays, each later solve capped at what is left: so the whole check still costs at
    most the share). Why: the solves take far fewer iterations than the cap (14-57 of 300 on the logistic default
    fits of ``benchmarks/results/svi_convergence/fullcg_budget.md``), and a fit whose ``H`` from few draws converges
    linearly (kept full steps, none rejected) needs more evaluations than the charged ones, not more draws.
    A full-rank guide (``full_rank``) takes the dense path within those bounds; past them the
    conjugate-gradient path where it fits as above (the mean's step, :mod:`~bnn_pyro.infer.svi_refine_cg`, then the
    dense gap on the step's draws, :func:`~bnn_pyro.infer.svi_gap.newton_gap`, which takes no solve: only the step's
    solves are charged, review 21), and otherwise the dense gap alone (it needs no Hessian: gradients only), within
    the bound below, ``reason`` then saying why the step was ``"skipped: ..."`` (the engine records it). ``spent_passes``: passes over the rows that a step before the solves
    already took (a mean-field guide's scale step, :mod:`~bnn_pyro.infer.svi_refine_scale`, records what it spent),
    out of that share before their iterations; nothing by default. The scale step runs only where it leaves the solves
    :data:`SCALE_KEEP` iterations, or all they have without it where fewer (:func:`scale_fits`), so in the engine this
    lowers ``max_iterations`` to no fewer than that (the mean step's record gives a cap under ``MAX_ITERATIONS``:
    ``svi.ITERATIONS_CAP``).

    The dense path has the same bound from the fit's cost (:func:`dense_passes`): the gap (a low-rank guide's, with
    exact Hessians; a full-rank guide's, gradients) must fit in :data:`FIT_SHARE` of the fit's passes, or nothing is
    checked; the refinement (within ``svi_refine``'s bounds) gets the evaluations the rest leaves (``max_evaluations``,
    at most ``svi_refine.MAX_EVALUATIONS``), and is skipped below 2 (the start and one step), its reason then naming
    this bound. ``gap`` False (a mean-field guide, whose gap the engine does not take within ``svi_refine``'s bounds):
    on the dense path the refinement alone is charged, and nothing there is "not checked" for the gap's cost (review
    17: a gap that is never taken neither costs the refinement evaluations nor writes a record promising it). The fit's passes are counted as on the conjugate-gradient path: each over the rows plus :data:`STEP_ROWS`."""
    refinable = dim <= svi_refine.MAX_DIM and dim * rows <= svi_refine.MAX_WORK
    budget = None if fit_passes is None else FIT_SHARE * fit_passes * (rows + STEP_ROWS) / rows  # passes over rows
    fit = (
        f"svi_gap_cg.FIT_SHARE ({FIT_SHARE:g}) of the fit's {fit_passes or 0:,} gradient passes (steps x particles, "
        f"vectorized particles sharing a step's fixed cost; each counted as the {rows} rows plus "
        f"svi_gap_cg.STEP_ROWS, {STEP_ROWS:,})"
    )
    if full_rank and not refinable:  # past svi_refine's bounds: the mean's step and the gap by conjugate gradients
        solves = _cg_path(dim, rows, budget, fit_passes, spent_passes, fit, gap_solve=False)  # where they fit, else
        if solves.kind == "cg":  # the dense gap alone (gradients only), the step's skip recorded with its bound
            return solves
        gap_cost = dense_passes(dim, 0, hessian_gap=False) if gap else 0
        if budget is not None and gap_cost > budget:
            return _gap_too_costly(gap_cost, rows, fit)
        skipped = solves.reason.replace("not checked", "skipped", 1)
        return GapPath("dense", skipped.replace("would be checked", "would take the mean's step"))
    if refinable:
        if budget is None:
            return GapPath("dense")
        gap_cost = dense_passes(dim, 0, hessian_gap=not full_rank) if gap else 0
        if gap_cost > budget:
            return _gap_too_costly(gap_cost, rows, fit)
        per_evaluation = svi_refine.DRAWS * DENSE_PASSES * dim
        evaluations = int(min(svi_refine.MAX_EVALUATIONS, (budget - gap_cost) // per_evaluation))
        if evaluations < 2:
            besides = f" besides the gap's {gap_cost:,}" if gap else ""
            return GapPath(
                "dense",
                f"skipped: the refinement's first step takes {2 * per_evaluation:,} gradient passes over the "
                f"{rows} rows (svi_gap_cg.dense_passes){besides}, more than {fit}; more num_steps would refine it",
                max_evaluations=evaluations,
            )
        return GapPath("dense", max_evaluations=evaluations)
    return _cg_path(dim, rows, budget, fit_passes, spent_passes, fit)


def _gap_too_costly(gap_cost: int, rows: int, fit: str) -> GapPath:
    """:func:`choose_path`'s ``"none"`` where the dense gap's ``gap_cost`` passes over the rows exceed the fit's share."""
    return GapPath(
        "none",
        f"not checked: the gap takes {gap_cost:,} gradient passes over the {rows} rows "
        f"(svi_gap_cg.dense_passes), more than {fit}; more num_steps would be checked",
    )


def _cg_path(
    dim: int,
    rows: int,
    budget: float | None,
    fit_passes: int | None,
    spent_passes: int,
    fit: str,
    *,
    gap_solve: bool = True,
) -> GapPath:
    """The conjugate-gradient path's answer past the dense bounds (:func:`choose_path`): ``"cg"`` within
    :data:`MAX_WORK` and the iterations the fit's share pays for, else ``"none"`` with the bound that stopped it.
    ``gap_solve`` False (a full-rank guide, whose gap after the step is the dense statistic): the step's solves alone
    are charged."""
    if dim * rows > MAX_WORK:
        return GapPath(
            "none",
            f"not checked: {dim} coordinates x {rows} rows is over svi_gap_cg.MAX_WORK ({MAX_WORK:,}), the "
            "conjugate-gradient gap's cost bound",
        )
    if budget is None:
        return GapPath("cg")
    gap_per_iteration = 2 * HESSIAN_DRAWS * BATCHES if gap_solve else 0
    spare = _spare(rows, fit_passes) - spent_passes
    iterations = _iterations(spare, gap_per_iteration + _STEP_PER_ITERATION)
    if iterations < 1:
        before = f" besides the {spent_passes:,} that the scale step took" if spent_passes else ""
        return GapPath(
            "none",
            f"not checked: the mean's step and the gap take up to {CHECK_PASSES:,} gradient passes over the {rows} "
            f"rows{before}, more than {fit}, with their conjugate-gradient solves; more num_steps would be checked",
        )
    # the step's account: all the share leaves but the gap's solve at its cap, the charged evaluations' gradients back
    account = spare - iterations * gap_per_iteration + STEP_SOLVES * svi_refine.DRAWS
    if iterations < MAX_ITERATIONS:  # the solves first: more draws only from what their MAX_ITERATIONS leave
        return GapPath("cg", max_iterations=iterations, step_hessian_draws=HESSIAN_DRAWS, step_passes=account)
    draws = min(svi_refine.DRAWS, (spare / iterations - gap_per_iteration) / (2 * STEP_SOLVES))  # FIT_SHARE inf: all
    draws = int(draws) // 2 * 2  # whole antithetic pairs
    return GapPath("cg", max_iterations=iterations, step_hessian_draws=draws, step_passes=account)


_STEP_PER_ITERATION = 2 * HESSIAN_DRAWS * STEP_SOLVES  # passes of one iteration of the step's solves
_PER_ITERATION = 2 * HESSIAN_DRAWS * BATCHES + _STEP_PER_ITERATION  # and of the gap's solve (a factored guide's)


def _iterations(spare: float, per_iteration: int = _PER_ITERATION) -> int:
    """The solves' iterations that ``spare`` passes over the rows pay for at ``per_iteration`` passes each (the gap's
    and the step's solves: :func:`choose_path`), at most :data:`MAX_ITERATIONS`."""
    return int(min(MAX_ITERATIONS, spare / per_iteration))  # FIT_SHARE inf: all


def _spare(rows: int, fit_passes: int) -> float:
    """Passes over the rows that :data:`FIT_SHARE` of a fit of ``fit_passes`` leaves after :data:`CHECK_PASSES`."""
    return FIT_SHARE * fit_passes * (rows + STEP_ROWS) / rows - CHECK_PASSES


def scale_passes(dim: int) -> int:
    """Gradient passes over the rows that a mean-field guide's scale step takes at most for ``dim`` coordinates
    (:mod:`~bnn_pyro.infer.svi_refine_scale`): its diagonal of the expected Hessian, :data:`SCALE_COLUMN_PASSES` per
    coordinate, and :data:`SCALE_EVALUATIONS` evaluations of the draws' gradients (one pass per draw, as
    :data:`CHECK_PASSES` counts the mean step's). What it spent is often less (a Gaussian posterior: two evaluations)
    and is what the solves after it are charged (:func:`choose_path`'s ``spent_passes``)."""
    return SCALE_COLUMN_PASSES * dim + SCALE_EVALUATIONS * svi_refine.DRAWS


def scale_fits(dim: int, rows: int, *, fit_passes: int | None = None) -> bool:
    """Whether a mean-field guide's scale step may run after a fit of ``fit_passes`` passes: where its
    :func:`scale_passes` leave the conjugate-gradient solves :data:`SCALE_KEEP` iterations within :data:`FIT_SHARE`,
    or every iteration they have without it where that is fewer (:func:`kept_iterations`). Why not any iteration
    left: the solves' need grows with the conditioning of ``H`` and is not known before them, and a solve cut short
    gives no mean step and no gap verdict, which the sds do not make up for (review 16: at 150 coordinates x 1,000 rows
    after 300 steps the old rule, one iteration left, cut the solves from 18 iterations to 2, and both were lost).
    Why not all of ``MAX_ITERATIONS``: that cap is a worst case, and keeping it skipped the step on every default fit
    past about 1,500 rows (review 18). Always where ``fit_passes`` is ``None`` (not bounded)."""
    if fit_passes is None:
        return True
    spare = _spare(rows, fit_passes)
    return _iterations(spare - scale_passes(dim)) >= kept_iterations(rows, fit_passes)


def kept_iterations(rows: int, fit_passes: int) -> int:
    """The conjugate-gradient iterations the scale step must leave the solves after a fit of ``fit_passes`` passes
    (:func:`scale_fits`): :data:`SCALE_KEEP`, or all the share pays for without the step where that is fewer."""
    return min(_iterations(_spare(rows, fit_passes)), SCALE_KEEP)


def hessian_pairs(pairs: int, batches: int) -> torch.Tensor:
    """The indices of the antithetic pairs whose draws average the expected Hessian (:data:`HESSIAN_DRAWS`): the first
    pair of batches spread evenly over the ``batches`` batches of ``pairs // batches`` pairs (not all in batch 0,
    whose mean gradient ``H`` would then be correlated with)."""
    kept = min(pairs, max(1, HESSIAN_DRAWS // 2))
    per = pairs // batches
    if kept >= batches:
        return torch.arange(kept)
    return (torch.arange(kept) * batches // kept) * per


class CGGap(NamedTuple):
    """:func:`cg_gap`'s answer: ``gap`` and ``se`` (``(dim,)`` float64 in guide sds, or ``None``), ``record`` (method,
    draws, batches, Hessian draws, iterations, residual, reason) and ``reason`` (why no verdict, or ``None``)."""

    gap: torch.Tensor | None
    se: torch.Tensor | None
    record: dict
    reason: str | None


def conjugate_gradients(
    apply: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    inverse_diag: torch.Tensor,
    *,
    tol: float = TOL,
    max_iterations: int = MAX_ITERATIONS,
    floor: float = 0.0,
) -> tuple[torch.Tensor, int, float]:
    """Solve ``A X = rhs`` (``(dim, k)``, column by column, ``A`` symmetric positive definite, given by ``apply``:
    ``(dim, k) -> (dim, k)``) by conjugate gradients preconditioned by ``diag(inverse_diag) ~ A^-1``: ``(X,
    iterations, residual)``, the residual the largest column's in the norm of ``diag(inverse_diag)``, relative to the
    largest right-hand side's or, where that is smaller, to ``floor / tol`` (``floor``: a residual below which the
    solve is done whatever the right-hand side, the size of its own rounding: a right-hand side that is rounding
    noise, at an optimum, has nothing left to solve). Stops at ``tol`` or ``max_iterations``; a column whose
    residual is exactly zero (a zero right-hand side) is left as solved. Raises ``ValueError`` where ``A`` is not positive along a search direction."""
    x = torch.zeros_like(rhs)
    scale = max(float(((rhs * rhs) * inverse_diag[:, None]).sum(0).sqrt().max()), floor / tol)
    if scale == 0.0 or not math.isfinite(scale):
        return x, 0, 0.0 if scale == 0.0 else math.nan
    r = rhs.clone()
    z = inverse_diag[:, None] * r
    p = z.clone()
    rz = (r * z).sum(0)
    residual, iterations = 1.0, 0
    while iterations < max_iterations:
        iterations += 1
        ap = apply(p)
        curvature = (p * ap).sum(0)
        active = rz > 0  # a column solved exactly (a zero right-hand side) is frozen: its p is 0
        if not bool((curvature[active] > 0).all()):
            raise ValueError("the expected Hessian of -log p is not positive definite at the guide")
        alpha = torch.where(active, rz / torch.where(active, curvature, 1.0), 0.0)
        x = x + alpha * p
        r = r - alpha * ap
        residual = float(((r * r) * inverse_diag[:, None]).sum(0).sqrt().max()) / scale
        if residual <= tol:
            break
        z = inverse_diag[:, None] * r
        rz_new = (r * z).sum(0)
        p = z + torch.where(active, rz_new / torch.where(active, rz, 1.0), 0.0) * p
        rz = rz_new
    return x, iterations, residual


def cg_gap(
    target: GuideTarget,
    *,
    rows: int,
    num_draws: int,
    generator: torch.Generator,
    max_iterations: int = MAX_ITERATIONS,
    spent_passes: int = 0,
) -> CGGap:
    """The Newton gap of the factored guide of ``target`` (:func:`~bnn_pyro.infer.guide_density.guide_target` with
    ``factored=True``) on ``rows`` data rows, from ``num_draws`` draws (rounded down to whole pairs in
    :data:`BATCHES` batches) of ``generator`` (module docstring). The model's errors propagate (the caller records
    them); a model vmap cannot batch for the products, a non-finite gradient, an ``H`` that is not positive definite
    or a solve that does not reach :data:`TOL` in ``max_iterations`` (:func:`choose_path`'s budget) give no verdict
    with the reason (naming the scale step where it took ``spent_passes`` of that budget first)."""
    loc, diag, factor = target.loc, target.diag, target.factor
    dim = loc.numel()
    pairs = max(1, num_draws // 2)
    batches = min(BATCHES, pairs)
    pairs = pairs // batches * batches  # whole pairs in equal batches
    chosen = hessian_pairs(pairs, batches).to(loc.device)
    record = dict(
        method="cg", draws=2 * pairs, batches=batches, hessian_draws=2 * len(chosen), iterations=0, residual=None
    )

    def no_verdict(reason: str) -> CGGap:
        return CGGap(None, None, {**record, "reason": reason}, reason)

    half = antithetic_half(target, pairs, generator)
    deviations = torch.cat([half, -half])
    apply = curvature(target, loc + torch.cat([half[chosen], -half[chosen]]), rows=rows, width=batches)
    try:  # first, since a model vmap cannot batch has no verdict: its gradients one draw at a time would be wasted
        apply(torch.zeros(dim, 1, dtype=torch.float64, device=loc.device))
    except NotBatchable as error:
        return no_verdict(f"{error}, and its Hessian-vector products one draw at a time cost too much")
    grads = derivatives(target.pot, target.order, (loc + deviations).to(target.dtype)).grads.double()
    bad = int((~torch.isfinite(grads).all(-1)).sum())
    if bad:
        return no_verdict(f"the log density or its gradient is not finite at {bad} of {2 * pairs} guide draws")
    plus, minus = grads.split(pairs)
    rhs = (plus.reshape(batches, -1, dim).mean(1) + minus.reshape(batches, -1, dim).mean(1)).T / 2  # (dim, batches)
    inverse_diag = 1 / precision_diagonal(diag, factor)
    try:
        steps, iterations, residual = conjugate_gradients(
            apply,
            rhs,
            inverse_diag,
            tol=TOL,
            max_iterations=max_iterations,
            floor=rounding(grads, inverse_diag, target.dtype),
        )
    except NotBatchable as error:
        return no_verdict(f"{error}, and its Hessian-vector products one draw at a time cost too much")
    except ValueError as error:  # H not positive definite or not finite along a search direction
        return no_verdict(str(error))
    record.update(iterations=iterations, residual=residual)
    if not residual <= TOL:
        after = f", after the {spent_passes:,} gradient passes the scale step took" if spent_passes else ""
        return no_verdict(
            f"conjugate gradients reached a relative residual of {residual:.2g} in {iterations} iterations"
            + (
                f" (the most the fit's cost allows: svi_gap_cg.FIT_SHARE, {FIT_SHARE:g}{after})"
                if max_iterations < MAX_ITERATIONS
                else ""
            )
        )
    sd = (diag + (factor**2).sum(1)).sqrt()
    gaps = steps.T / sd  # (batches, dim)
    se = gaps.std(0) / math.sqrt(batches) if batches > 1 else torch.full_like(sd, math.nan)
    return CGGap(gaps.mean(0).cpu(), se.cpu(), {**record, "reason": None}, None)


ROUNDING = 1
"""A solve is done, whatever its right-hand side, once its residual is below ``ROUNDING`` float epsilons of the
draws' gradients' size (whitened, :func:`rounding`): the float rounding of the mean gradient it solves for, so a
smaller residual would change the answer by less than that rounding already does. Without it a guide at its optimum,
whose mean gradient is rounding noise, had to reduce a residual relative to that noise: on a regression of 1,000
coefficients and rows 300 iterations reached only 2e-3 of it, and there was no verdict (a scratch run of
``benchmarks/svi_gap_cg_cost.py`` before this floor, not committed)."""


def rounding(grads: torch.Tensor, inverse_diag: torch.Tensor, dtype: torch.dtype) -> float:
    """:data:`ROUNDING` epsilons of ``dtype`` times the mean whitened norm of the per-draw gradients ``grads``
    (``(n, dim)``), in the norm :func:`conjugate_gradients` measures residuals in."""
    return ROUNDING * torch.finfo(dtype).eps * float(((grads * grads) * inverse_diag).sum(1).sqrt().mean())


def antithetic_half(target: GuideTarget, pairs: int, generator: torch.Generator) -> torch.Tensor:
    """``pairs`` deviations ``D^1/2 u + W v`` (``u``, ``v`` standard normal from ``generator``, float64 on the guide's
    device) of the factored guide of ``target``: with their negatives, exact antithetic draws of ``N(0, S)`` without
    the dense ``S`` (a full-rank guide's: ``D = 0``, ``W = L``, so ``L v``; ``u`` is drawn all the same, so that every
    guide's draws come from the generator in one order)."""
    options = dict(dtype=torch.float64, device=target.loc.device, generator=generator)
    noise = torch.randn(pairs, target.loc.numel(), **options) * target.diag.sqrt()
    return noise + torch.randn(pairs, target.factor.shape[1], **options) @ target.factor.T


def curvature(target: GuideTarget, at: torch.Tensor, *, rows: int, width: int) -> Callable:
    """``V -> mean_i -hess log p(at_i) V`` (float64) for ``V`` of ``width`` columns: the expected Hessian's products
    at the points ``at`` (:func:`~bnn_pyro.infer.guide_density.hessian_products`, batched over ``at`` as memory allows
    on ``rows`` rows). Raises ``ValueError`` where a product is not finite."""
    points = at.to(target.dtype)
    chunk = svi_refine.hessian_chunk(width, rows)

    def apply(vectors: torch.Tensor) -> torch.Tensor:
        products = -hessian_products(target.pot, target.order, points, vectors.to(target.dtype), chunk_size=chunk)
        if not bool(torch.isfinite(products).all()):
            raise ValueError("the log density's Hessian-vector products are not finite at some guide draw")
        return products.double()

    return apply


def precision_diagonal(diag: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``diag(S^-1)`` of ``S = diag(D) + W W^T`` by Woodbury: ``1 / D - diag(D^-1 W (I + W^T D^-1 W)^-1 W^T D^-1)``,
    ``O(dim rank^2)``; where ``D`` is zero (a full-rank guide's factors, ``W = L`` lower-triangular:
    :func:`~bnn_pyro.infer.guide_density.guide_factors`), Woodbury divides by zero, so ``diag((L L^T)^-1)``, the
    column sums of squares of ``L^-1``, by a triangular solve, ``O(dim^3)``."""
    if not bool((diag > 0).all()):
        eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
        return (torch.linalg.solve_triangular(factor, eye, upper=False) ** 2).sum(0)
    scaled = factor / diag[:, None]
    capacitance = torch.eye(factor.shape[1], dtype=factor.dtype, device=factor.device) + factor.T @ scaled
    half = torch.linalg.solve_triangular(torch.linalg.cholesky(capacitance), scaled.T, upper=False)
    return 1 / diag - (half**2).sum(0)
