"""Take a mean-field, low-rank or full-rank guide's mean the rest of the way to its family's ELBO optimum past
:mod:`bnn_pyro.infer.svi_refine`'s bounds: damped Newton steps by conjugate gradients, the covariance not moved here.

The rule. For ``q = N(m, S)`` the ELBO's gradient in ``m`` is ``g = E_q[grad log p]`` and its curvature in ``m`` is
``H = E_q[-hess log p]`` whatever the family, so ``m + H^-1 g`` is the mean's Newton step (on a Gaussian posterior,
where ``H`` is constant, it lands on the optimum's mean in one step). It is the step the gap check measures
(:mod:`bnn_pyro.infer.svi_gap_cg`), taken with the same solver: the gradients at :data:`~svi_refine.DRAWS` fixed
standard-normal draws in antithetic pairs mapped through ``(m, S)`` (common random numbers: every candidate is judged
on the same draws, so the iteration converges to the fixed point of one sample objective, not a noisy one), ``H v``
from :data:`~bnn_pyro.infer.svi_gap_cg.HESSIAN_DRAWS` of them (the gap's: :func:`~bnn_pyro.infer.svi_gap_cg.hessian_pairs`),
conjugate gradients preconditioned by the guide's precision diagonal. Only the mean moves here: a mean-field guide's
sds are taken to their fixed point (``1 / D_i = H_ii``) before, by :mod:`bnn_pyro.infer.svi_refine_scale` (the engine
runs it first, on the same seed, so that this step and the gap after it see the new sds); a low-rank or full-rank
guide's covariance is left as trained (that module says why for low rank; a full-rank guide's fixed point ``S^-1 = H``
needs ``H`` itself, the dense refinement's ``dim`` gradient passes per draw, which is what the bounds exclude). A
full-rank guide is read as factors ``D = 0``, ``W = L`` (:func:`~bnn_pyro.infer.guide_density.guide_factors`): its
draws ``L v`` are exact and its preconditioner ``diag((L L^T)^-1)`` is a triangular solve
(:func:`~bnn_pyro.infer.svi_gap_cg.precision_diagonal`), so the factored guides' code serves it unchanged. The gap after
it is measured on the step's own draws: the conjugate-gradient one for a mean-field or low-rank guide, and for a
full-rank guide the dense statistic ``S E_q[grad log p]`` with its standard error from the 500 antithetic pairs
(:func:`~bnn_pyro.infer.svi_gap.newton_gap`: the conjugate-gradient gap's 20 batch means left a logistic fit whose
step stopped short unwarned). On draws of its own it would also measure the step's Monte Carlo error, which its
standard error does not count (:func:`refine_mean`).

Why. Past :data:`~bnn_pyro.infer.svi_refine.MAX_DIM` coordinates nothing was refined, and Adam under the cosine schedule
leaves the mean wherever its last steps put it: on linear regressions of 150-1,000 coefficients the default fits
ended 0.07-0.13 guide sds from the exact optimum in some coordinate, and 20,000 steps did not remove it
(``benchmarks/results/svi_convergence/gap_cg_defaults.md``, ``gap_cg_steps20000.md``), so the gap check warned on
every such fit. With these steps the same fits end within 0.005 guide sds and none warns
(``gap_cg_defaults_refined.md``). A full-rank guide (a Pyro function's default up to
:data:`~bnn_pyro.infer.svi_lr.FULL_RANK_MAX_DIM` coordinates) got no refinement there either: on linear regressions of
110-400 coefficients x 100-2,000 rows its default fits ended up to 0.096 exact posterior sds from the exact mean, and
within 1e-4 with this step wherever Adam had left more than :data:`~bnn_pyro.infer.svi_refine.TOL`
(``benchmarks/results/svi_convergence/fullcg_linear.md`` and the other ``fullcg_*.md``).

More Hessian draws after a rejected candidate. ``H`` from :data:`~bnn_pyro.infer.svi_gap_cg.HESSIAN_DRAWS` draws is
exact on a Gaussian posterior (``H`` constant), and there no candidate is rejected. Off a Gaussian it is a Monte
Carlo estimate, and an inexact ``H`` misjudges the step: on logistic regressions of 110 and 300 coefficients x 100
rows (nearly separable, so ``p (1 - p)`` varies widely over the draws) the full step was rejected, the halved ones
crept (5 evaluations ended 0.21 and 0.25 guide sds from the optimum and the gap warned; 50 evaluations still 0.08),
while the conjugate-gradient iterations (26-35 of 300) and the halving were not what stopped it: with ``H`` from all
1,000 draws the undamped steps were kept and the step reached its fixed point in 3 evaluations (from 200: at 110
coefficients in 3, at 300 still 0.02 short after 5; ``benchmarks/results/svi_convergence/fullcg_cause.md``). So where a candidate is rejected, the step solves again at
the same mean with ``H`` from more of its draws, once (``choose_path``'s ``step_hessian_draws``: whole pairs, what the
fit's share leaves past the solves' :data:`~bnn_pyro.infer.svi_gap_cg.MAX_ITERATIONS`, up to all of them; none more
where it leaves nothing), then goes on as before; the record gives the count (``escalated_hessian_draws``). A Gaussian
posterior's step and cost are unchanged; the logistic default fits end at their fixed point, silent
(``fullcg3_logistic.md``).

Evaluations as the fit's share pays. The cost rule (:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`) charges the
step a worst case: :data:`CHARGED_EVALUATIONS` evaluations, each solve at its iteration cap. Its solves take far fewer
iterations than that cap, and where ``H`` from few draws misjudges the step by a little every full step is kept but
the iteration converges only linearly: a logistic regression of 300 coefficients x 2,000 rows kept 4 full steps in 5
evaluations and ended 0.15 guide sds from its optimum, 7.4 times the step's standard error (the gap, 0.107, under the
check's threshold at 300 coordinates: silently), where the share paid for 40 Hessian draws after a rejection (none
came) and fourteen times the passes the step spent (``fullcg_budget.md``). So the step keeps
an account (``choose_path``'s ``step_passes``: all the share leaves but the gap's; each evaluation one pass per draw,
each solve two per Hessian draw and iteration, and the batchability probe's one product), checks it before every
evaluation (the charge pays for the charged ones whatever their solves take at ``svi_refine.DRAWS`` draws, the count the
engine passes, but for the probe's 20 passes: they can cost the fifth charged solve one iteration, and only where every
solve before it ran to its cap; a direct call with more ``num_draws`` pays for them from the account too, and stops
sooner: review 24 measured 0.08 and 0.53 times the account past it at 2,000 and 3,000 draws when only the later ones
were checked), and goes on while the account pays for another evaluation, every later solve capped at the iterations
left, up to ``max_evaluations`` (``svi_refine.MAX_EVALUATIONS``, the dense refinement's); it stops with
:data:`SHARE_SPENT` where the account runs out. That case then reached its fixed point in 10 evaluations at about a
fifth of the share (at 400 coefficients, where a candidate rejected at the fifth left the old step with a gap of 0.39
and a warning, in 15 at 0.43);
a Gaussian posterior (two evaluations) and the 100-row logistic fits (four) end within the charged ones, unchanged.

Safeguards (:mod:`bnn_pyro.infer.svi_refine`'s): a step is kept only if the ELBO estimated on the same draws (``mean
log p``: the entropy does not depend on ``m``) does not fall, otherwise solved again with more Hessian draws (once,
above) and then halved down to :data:`~bnn_pyro.infer.svi_refine.MIN_RATE`; the iterations stop where the undamped step moves no coordinate by
:data:`~bnn_pyro.infer.svi_refine.TOL` of its guide sd (``"fixed point"``, the last evaluation's solve
included) or after ``choose_path``'s ``max_evaluations`` evaluations of the draws (:data:`CHARGED_EVALUATIONS` where no fit's passes bound the step:
:func:`refine_mean`), or where its account of the fit's share pays for no more
(:data:`SHARE_SPENT`), or where the solve at a new mean fails (``"no solve at the new mean"``: conjugate gradients
did not reach their tolerance in the iterations allowed, ``svi_gap_cg.MAX_ITERATIONS`` or fewer where the fit's
cost caps them, :func:`~bnn_pyro.infer.svi_gap_cg.choose_path`; ``"no solve with more Hessian draws"`` for the
solve again after a rejection; with ``": <reason>"`` where ``H`` there is not positive definite or its products not
finite), keeping the steps taken;
whatever the model raises, a model vmap cannot batch, a non-finite value or an ``H`` the solver finds not positive
definite at the start leaves the guide as it was, with the reason. It runs where the conjugate-gradient
gap does (:func:`bnn_pyro.infer.svi_gap_cg.choose_path`: past the dense bounds, up to
:data:`~bnn_pyro.infer.svi_gap_cg.MAX_WORK` coordinates x rows and a share of the fit's own cost).

Example
-------
>>> result = refine_mean(guide, model, data)   # a MeanStep, or None where not covered
>>> result.accepted, result.elbo_change, result.stopped
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro.infer import autoguide

from bnn_pyro.infer import svi_gap_cg, svi_refine
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.guide_density import NoDensity, NotBatchable, derivatives, guide_target
from bnn_pyro.utils.user_warnings import warn

__all__ = ["CHARGED_EVALUATIONS", "SHARE_SPENT", "MeanStep", "refine_mean"]

_COVERED = (autoguide.AutoNormal, autoguide.AutoLowRankMultivariateNormal, autoguide.AutoMultivariateNormal)

CHARGED_EVALUATIONS = 5
"""Evaluations of the draws (the first included: one per candidate, each with a conjugate-gradient solve) that the
check's fixed charge pays for whatever their solves take (:data:`~bnn_pyro.infer.svi_gap_cg.CHECK_PASSES`,
:data:`~bnn_pyro.infer.svi_gap_cg.STEP_SOLVES` solves at ``max_iterations``) at ``svi_refine.DRAWS`` draws each (the
engine's; more draws take the rest from the account); past them the step evaluates on, up to
``choose_path``'s ``max_evaluations``, while what it has spent leaves the fit's share room (module docstring). A
Gaussian posterior needs two (the step, then the fixed point), the logistic regressions of ``fullcg_cause.md`` four
with more Hessian draws after the first rejection; on 2,000 rows ten at 300 coefficients and fifteen at 400, most
of their full steps kept (``fullcg_budget.md``). On the default fits of ``gap_cg_defaults_refined.md`` five took 0.008-0.06 of the rest of
the fit up to 500,000 coordinates x rows and 0.32-0.49 at 1,000,000 with an ill-conditioned ``H``."""


def __getattr__(name: str):
    """``MAX_EVALUATIONS``, this module's name for :data:`CHARGED_EVALUATIONS` before the account (h-cgbudget), warns
    and gives it, for one release (DESIGN: a renamed public name keeps its old one that long)."""
    if name == "MAX_EVALUATIONS":
        warn(
            "svi_refine_cg.MAX_EVALUATIONS was renamed svi_refine_cg.CHARGED_EVALUATIONS (the evaluations the check's "
            "charge pays for; past them the step evaluates on as the fit's share pays, up to "
            "svi_refine.MAX_EVALUATIONS); the old name stops working in the next release.",
            DeprecationWarning,
        )
        return CHARGED_EVALUATIONS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SHARE_SPENT = "share spent"
"""The step's ``stopped`` where the fit's share (``choose_path``'s ``step_passes``) paid for no further evaluation past
the :data:`CHARGED_EVALUATIONS`, or for too few iterations of a solve after them: a longer fit pays for more
(:func:`~bnn_pyro.infer._health.check_guide_gap` advises more num_steps)."""


@dataclass(frozen=True)
class MeanStep(svi_refine.Refinement):
    """What :func:`refine_mean` did (:class:`~bnn_pyro.infer.svi_refine.Refinement`'s fields) and
    ``escalated_hessian_draws``: the draws its last solves averaged ``H`` over where a rejected candidate made it take
    more (module docstring), else ``None`` and not recorded (named apart from the gap record's ``hessian_draws``, the
    gap's own count); ``passes``, the gradient passes over the rows it spent in
    :func:`~bnn_pyro.infer.svi_gap_cg.choose_path`'s units (each evaluation one per draw, each solve two per Hessian
    draw and iteration, the batchability probe's product), as the scale step records its own
    (:class:`~bnn_pyro.infer.svi_refine_scale.ScaleStep`): what it took of its account (``step_passes``), not the most
    it could have."""

    escalated_hessian_draws: int | None = None
    passes: int | None = None

    def record(self) -> dict:
        """A plain dict for ``post.config`` (``escalated_hessian_draws`` and ``passes`` only where set)."""
        return {k: v for k, v in super().record().items() if v is not None}


def refine_mean(
    guide,
    model,
    data: Data,
    *,
    num_draws: int = svi_refine.DRAWS,
    seed: int = 0,
    fit_passes: int | None = None,
    spent_passes: int = 0,
):
    """Newton steps for the mean of a fitted ``AutoNormal``, ``AutoLowRankMultivariateNormal`` or
    ``AutoMultivariateNormal`` of ``model`` on
    ``data`` (full batch) past the dense bounds (module docstring), in place, from ``num_draws`` draws of a generator
    of its own seeded with ``seed``: a :class:`MeanStep` (a ``skipped`` one with the ``passes`` it spent; one skipped before it spent any as a plain
    :class:`~bnn_pyro.infer.svi_refine.Refinement`), or ``None`` where the guide is
    not covered (:func:`~bnn_pyro.infer.svi_gap_cg.choose_path` on its unconstrained coordinates, ``data.size`` rows
    and the fit's ``fit_passes``, less ``spent_passes`` that a step before it took from the check's share: the scale
    step's record, :class:`~bnn_pyro.infer.svi_refine_scale.ScaleStep`; nothing by default, as the engine decides). It
    never raises. Without ``fit_passes`` (a direct call: no fit bounds the step, so it keeps no account) it stops after
    :data:`CHARGED_EVALUATIONS` evaluations, its bound before the account. That bounds its evaluations, not its passes:
    with no account its solves take ``H`` from as many Hessian draws as the path allows, so a direct call may spend
    several times a fit's charge in those evaluations and stop short of the fixed point the engine's account reaches
    (review 27); a caller who wants that step passes ``fit_passes`` (and so gets the account).

    The gap check after it (:func:`~bnn_pyro.infer.svi_gap.newton_gap` with the same ``seed`` and draws, as the SVI
    engine calls both, one seed per chain) measures on the step's own draws, as the dense refinement and gap do: on
    other draws it would also measure this step's Monte Carlo error, which its standard error (batch means, or a
    full-rank guide's antithetic pairs) does not count (review 14: a converged non-Gaussian fit of 152 coordinates warned at 4 of 40 step seeds)."""
    if not isinstance(guide, _COVERED):
        return None
    device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    spent = [0]  # the passes _refine_mean has spent, kept where it fails
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a model drawing on its own
        try:
            return _refine_mean(guide, model, data, num_draws, generator, fit_passes, spent_passes, spent)
        except Exception as error:  # a finished fit never fails here
            return MeanStep(0, 0.0, f"skipped: {type(error).__name__}: {error}", None, spent[0] or None)


def _refine_mean(
    guide,
    model,
    data: Data,
    num_draws: int,
    generator: torch.Generator,
    fit_passes: int | None,
    spent_passes: int,
    spent: list[int],
):
    try:
        target = guide_target(guide, model, data, factored=True)
    except NoDensity as error:
        return svi_refine.Refinement(0, 0.0, f"skipped: {error}")
    if target is None:
        return None
    full_rank = isinstance(guide, autoguide.AutoMultivariateNormal)
    path = svi_gap_cg.choose_path(
        target.loc.numel(), data.size, fit_passes=fit_passes, full_rank=full_rank, spent_passes=spent_passes
    )
    if path.kind != "cg":
        return None
    pairs = max(1, num_draws // 2)
    account, limit = path.step_passes, [0]  # passes over the rows allowed (None: no account, and then the old bound
    # on the evaluations, refine_mean); the last solve's iteration cap; ``spent``: what was spent, the caller's list
    max_evaluations = path.max_evaluations if account is not None else min(path.max_evaluations, CHARGED_EVALUATIONS)
    half = svi_gap_cg.antithetic_half(target, pairs, generator)
    deviations = torch.cat([half, -half])
    chosen = svi_gap_cg.hessian_pairs(pairs, min(svi_gap_cg.BATCHES, pairs)).to(half.device)  # the gap's H draws
    hessian_at = torch.cat([half[chosen], -half[chosen]])
    more = min(pairs, path.step_hessian_draws // 2)  # pairs for H once a candidate is rejected (module docstring)
    spread = torch.arange(more, device=half.device) * pairs // more
    sd = (target.diag + (target.factor**2).sum(1)).sqrt()
    inverse_diag = 1 / svi_gap_cg.precision_diagonal(target.diag, target.factor)

    def evaluate(loc):
        spent[0] += len(deviations)
        d = derivatives(target.pot, target.order, (loc + deviations).to(target.dtype))
        values, grads = d.values.double(), d.grads.double()
        if not bool(torch.isfinite(values).all() and torch.isfinite(grads).all()):
            return None
        return loc, float(values.mean()), grads.mean(0), svi_gap_cg.rounding(grads, inverse_diag, target.dtype)

    def pays() -> bool:  # whether the account pays for another evaluation (at num_draws passes, whatever it is)
        return account is None or spent[0] + len(deviations) <= account

    def cap(at) -> int:  # the iterations a solve may take: all max_iterations within the charge, then what is left
        left = path.max_iterations if account is None else (account - spent[0]) / (2 * len(at))
        return int(min(path.max_iterations, left))

    def newton(loc, grad, floor, at):
        limit[0] = cap(at)
        if limit[0] < 1:
            return None
        apply = svi_gap_cg.curvature(target, loc + at, rows=data.size, width=1)
        step, iterations, residual = svi_gap_cg.conjugate_gradients(
            apply,
            grad[:, None],
            inverse_diag,
            tol=svi_gap_cg.TOL,
            max_iterations=limit[0],
            floor=floor,
        )
        spent[0] += 2 * len(at) * iterations  # a Hessian-vector product: two passes per draw
        return step[:, 0] if residual <= svi_gap_cg.TOL else None

    try:  # first, since a model vmap cannot batch is skipped: its gradients one draw at a time would be wasted
        svi_gap_cg.curvature(target, target.loc + hessian_at, rows=data.size, width=1)(inverse_diag[:, None] * 0)
    except NotBatchable as error:
        return svi_refine.Refinement(0, 0.0, f"skipped: {error}, and its products one draw at a time cost too much")
    spent[0] += 2 * len(hessian_at)  # that product, from the account: less than one of a solve's iterations at the
    # cap (choose_path does not reserve it: that would move its caps, e.g. 248 iterations at 150 x 2,000 to 247)
    if not pays():
        return MeanStep(0, 0.0, f"skipped: {SHARE_SPENT} before its first evaluation of the draws", None, int(spent[0]))
    start = evaluate(target.loc)
    if start is None:
        return MeanStep(
            0, 0.0, "skipped: the log density or its gradient is not finite at some draw", None, int(spent[0])
        )
    point, rate, accepted, evaluations, stopped = start, 1.0, 0, 1, "evaluation limit"
    escalated = None  # the Hessian draws after a rejected candidate, once taken
    try:
        step = newton(point[0], point[2], point[3], hessian_at)
    except NotBatchable as error:
        return MeanStep(
            0, 0.0, f"skipped: {error}, and its products one draw at a time cost too much", None, int(spent[0])
        )
    except ValueError as error:
        return MeanStep(0, 0.0, f"skipped: {error}", None, int(spent[0]))
    if step is None:
        return MeanStep(0, 0.0, "skipped: conjugate gradients did not reach their tolerance", None, int(spent[0]))
    while evaluations < max_evaluations:
        if float((step / sd).abs().max()) < svi_refine.TOL:
            stopped = "fixed point"
            break
        if not pays():  # within the charge only where num_draws is above svi_refine.DRAWS (choose_path's unit)
            stopped = SHARE_SPENT
            break
        new = evaluate(point[0] + rate * step)
        evaluations += 1
        if new is not None and new[1] >= point[1]:
            point, accepted, rate = new, accepted + 1, 1.0
            try:
                step = newton(point[0], point[2], point[3], hessian_at)
            except ValueError as error:  # H not positive definite, or its products not finite, at the new mean
                stopped = f"no solve at the new mean: {error}"
                break
            if step is None:  # TOL not reached in max_iterations, a cap the engine records (svi.ITERATIONS_CAP)
                stopped = "no solve at the new mean" if limit[0] >= path.max_iterations else SHARE_SPENT
                break
        elif escalated is None and more > len(chosen):  # H misjudged the step: from more draws, the step undamped
            hessian_at, escalated, rate = torch.cat([half[spread], -half[spread]]), 2 * more, 1.0
            try:
                step = newton(point[0], point[2], point[3], hessian_at)
            except ValueError as error:
                stopped = f"no solve with more Hessian draws: {error}"
                break
            if step is None:
                stopped = "no solve with more Hessian draws" if limit[0] >= path.max_iterations else SHARE_SPENT
                break
        elif rate / 2 < svi_refine.MIN_RATE:
            stopped = "no better step"
            break
        else:
            rate /= 2
    if stopped == "evaluation limit" and float((step / sd).abs().max()) < svi_refine.TOL:  # its last solve's verdict
        stopped = "fixed point"
    if accepted:
        svi_refine.write_mean(guide, target.order, target.pot.shapes, point[0])
    return MeanStep(accepted, point[1] - start[1], stopped, escalated, int(spent[0]))
