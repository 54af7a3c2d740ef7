"""How far a fitted Gaussian guide's mean is from the ELBO's optimum: one Newton step, with the guide's own covariance
(a low-rank guide's: the inverse of the expected Hessian).

For a Gaussian guide ``q = N(m, S)`` in the unconstrained coordinates ``z`` the autoguides work in, the ELBO's
gradient in the mean is ``E_q[grad log p(z)]`` (the entropy does not depend on ``m``), which is zero at the optimum;
near it ``E_q[grad log p] ~ -E_q[-hess log p] (m - m*)``, and at the optimum of a full-rank guide ``S^-1 =
E_q[-hess log p]`` (Opper & Archambeau 2009, eq. 9-10). So ``S E_q[grad log p(z)]`` is the Newton step that takes the
guide's mean to the optimum of its family; divided by the guide's sd it says, per coordinate, how many of the guide's
own sds the fit stopped short. The SVI engine takes it for the full-rank and low-rank guides, and for a mean-field
guide past the refinement's bounds (below). Never with a mean-field guide's own ``S``: its diagonal is not the inverse
curvature wherever the posterior correlates (there ``diag(S) E_q[grad log p]`` misstates the distance: on a correlated
Gaussian posterior it read 0.15 guide sds at a mean-field fit whose mean is the optimum's up to Adam's noise). A
low-rank guide's ``S = D + W W^T`` is not the inverse curvature at its
optimum either (with ``S`` in its place the statistic was no Newton step and the control variate did not cancel the
noise: on a correlated 9-coordinate Gaussian posterior its standard error was ~20 times the full-rank guide's), so for
it the step takes the expected Hessian ``H = E_q[-hess log p]`` from the same draws' exact Hessians: ``H^-1 E_q[grad
log p]``, still in the guide's sds, with the control variate ``H (z - m)``, whose Hessians cost ``dim`` gradient passes
per draw (hence only up to :data:`~bnn_pyro.infer.svi_refine.MAX_DIM` coordinates). :func:`newton_gap` estimates it
from :data:`GAP_DRAWS` draws of the guide with the control variate ``S^-1 (z - m)`` (``H (z - m)`` for a low-rank
guide; zero mean under ``q``, the whole gradient where ``log p`` is quadratic), so on a near-Gaussian posterior its
Monte Carlo error is a small part of the one-particle ELBO gradient's noise. The gradients at the draws are one batched
pass over the flat log density, or one draw at a time where the model cannot be batched (a low-rank guide's Hessians
are not: no verdict there; :mod:`bnn_pyro.infer.guide_density`, shared with the refinement of
:mod:`bnn_pyro.infer.svi_refine`).

Past :mod:`bnn_pyro.infer.svi_refine`'s bounds (:data:`~bnn_pyro.infer.svi_refine.MAX_DIM` coordinates,
:data:`~bnn_pyro.infer.svi_refine.MAX_WORK` coordinates x rows, counted in the guide's unconstrained coordinates:
:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`), where no refinement runs and the
dense Hessians cost too much, a mean-field or low-rank guide's gap is the same Newton step ``H^-1 E_q[grad log p]``
without a dense ``H``: conjugate gradients on Hessian-vector products of the expected Hessian, the standard error by
batch means over antithetic draws (:mod:`bnn_pyro.infer.svi_gap_cg`, up to its
:data:`~bnn_pyro.infer.svi_gap_cg.MAX_WORK` and a share of the fit's cost; :class:`Gap`'s ``record`` says how it
went, on either path). A full-rank guide there needs no Hessian: where the cost rule leaves room for the mean's step
before the gap (:mod:`bnn_pyro.infer.svi_refine_cg`), its gap is this module's dense statistic ``S E_q[grad log p]``
on that step's own draws (the same seed, the same ``L v`` antithetic pairs and the mean the step ended at), its
standard error from the pair means, each pair one sample (its deviations cancel), and the record gives ``pairs`` (500)
for the check's Student's t. Why not the conjugate-gradient gap there: its 20 batch means gave a standard error about
three times the pairs' (0.09 against 0.03 guide sds on a logistic regression of 110 coefficients x 100 rows whose
step stopped 0.2 sds short), on 19 degrees of freedom, and that fit went unwarned; and the dense statistic costs only
the draws' gradients. Why on the step's draws: on draws of its own it would also measure the step's Monte Carlo error,
which its standard error does not count (:func:`~bnn_pyro.infer.svi_refine_cg.refine_mean`). Where the cost rule
leaves no room for the step, the dense gap runs alone on draws of its own, as within the bounds. Its cost bound (one
gradient pass per draw, :func:`~bnn_pyro.infer.svi_gap_cg.dense_passes`) is always within the step's, so past the
bounds the conjugate-gradient gap no longer serves a full-rank guide. That step is valid for a
mean-field guide at any size (the full ``H``, not ``diag(S)``), but within the bounds, where the refinement takes the
guide to its optimum first, a mean-field guide is still not checked: what the check would add there is not measured.

A diagnostic must not fail a finished fit: the potential is built at the guide's own median, and where the gap cannot
be evaluated (the log density raises, whatever it raises, or is not finite at some draw) :func:`newton_gap` returns no
verdict with the reason (the SVI engine records it in ``post.config["guide_gap"]``).

Why not the ELBO trace or the guide's iterates: under the cosine schedule the rate falls to 1% of ``lr`` at the end, so
the parameters freeze wherever they are; the ELBO's window means and the iterate average of the last two windows then
agree to well within their noise although the mean is still short of the optimum (eight schools, full-rank, seed 0:
``tau``'s mean 0.24 exact sds off the optimum's after 5,000 steps, silently; ``benchmarks/results/svi_convergence/``).
The gradient at the end does not freeze: it says where the optimum is.

Example
-------
>>> result = newton_gap(guide, model, data)   # None where not covered
>>> result.gap, result.se, result.reason       # (dim,) each in the guide's sds on the CPU; or None and why
>>> result.record                              # method "dense" or "cg", reason, draws (cg: iterations, residual)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from pyro.infer import autoguide

from bnn_pyro.infer import svi_gap_cg, svi_refine
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.guide_density import (
    VMAP_CHUNK,
    NoDensity,
    NotBatchable,
    derivatives,
    guide_gaussian,
    guide_target,
)

__all__ = ["GAP_DRAWS", "Gap", "guide_gaussian", "newton_gap", "gap_statistic"]

GAP_DRAWS = 1000
"""Guide draws for :func:`newton_gap`: with the control variate the gap's standard error is ~0.005 guide sds on the
regression references and 0.02-0.08 on eight schools' funnel (``tau``; 0.005-0.015 on its other coordinates), against
0.01-0.07 with 200 draws (full-rank guides; ``benchmarks/results/svi_convergence/``)."""


@dataclass(frozen=True)
class Gap:
    """:func:`newton_gap`'s answer: ``gap`` and ``se`` (``(dim,)``, float64 on the CPU, in the guide's sds), or both
    ``None`` with ``reason`` saying why there is no verdict; ``labels`` names the unconstrained coordinates."""

    gap: torch.Tensor | None
    se: torch.Tensor | None
    labels: list[str] = field(default_factory=list)
    reason: str | None = None
    record: dict = field(default_factory=dict)
    """How it went, the shape of every entry of ``post.config["guide_gap"]``: ``method`` (``"dense"``, ``"cg"``, or
    ``None`` where it failed before a path was taken, or the engine took none: its record names the bound), ``reason``
    (why no verdict, or ``None``), ``draws`` (the draws of a pass that completed: 0 where none did, a path's pass
    having raised or no path taken, so that no draw gave a verdict); the conjugate-gradient path's
    (:mod:`bnn_pyro.infer.svi_gap_cg`) adds batches, Hessian draws, iterations and residual; a full-rank guide's dense
    gap on the mean step's own draws adds ``pairs`` (the antithetic pairs its standard errors are from)."""


def gap_statistic(gradients: torch.Tensor, deviations: torch.Tensor, cov: torch.Tensor, sd: torch.Tensor | None = None):
    """The Newton step to the optimum in guide sds and its standard error, per coordinate, from ``n`` guide draws:
    ``gradients`` (``(n, dim)``, ``grad log p`` at each draw), ``deviations`` (``(n, dim)``, ``z - m``) and the inverse
    curvature ``cov`` (a full-rank guide's own covariance; a low-rank guide's ``E_q[-hess log p]^-1``): the mean over
    draws of ``(cov g + (z - m)) / sd`` (module docstring) and its standard error; ``sd`` the guide's sds (default
    ``cov``'s)."""
    sd = cov.diagonal().sqrt() if sd is None else sd
    steps = (gradients @ cov + deviations) / sd
    n = steps.shape[0]
    return steps.mean(0), steps.std(0) / math.sqrt(n)


def newton_gap(
    guide,
    model,
    data: Data,
    *,
    num_draws: int = GAP_DRAWS,
    seed: int = 0,
    fit_passes: int | None = None,
    spent_passes: int = 0,
) -> Gap | None:
    """:func:`gap_statistic` for a fitted Gaussian autoguide of ``model`` on ``data`` (full batch), from ``num_draws``
    draws of the guide from a generator of its own seeded with ``seed`` on the guide's device (the caller's random
    state is left as it was): a :class:`Gap`, or ``None`` where the guide is not covered (a mean-field or low-rank
    guide: by :func:`~bnn_pyro.infer.svi_gap_cg.choose_path` on its unconstrained coordinates, the rows and the fit's
    ``fit_passes``, less ``spent_passes`` that a step before it took from the check's share, nothing by default, as the
    engine decides; after the mean's step, the same ``seed`` and ``num_draws`` measure on the step's own draws,
    :func:`~bnn_pyro.infer.svi_refine_cg.refine_mean`: by conjugate gradients for a mean-field or low-rank guide, by
    the dense statistic over the antithetic pairs for a full-rank one, module docstring). It never raises: where the
    potential cannot be built at the guide's median, the log density or its gradient is not finite at some draw
    (dropping those draws would bias the mean toward the guide's centre), a low-rank guide's model cannot be batched
    for its Hessians, or anything else raises, the :class:`Gap` has no verdict and says why."""
    device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a model drawing on its own
        try:
            result = _newton_gap(guide, model, data, num_draws, generator, fit_passes, spent_passes)
        except Exception as error:  # a diagnostic must not fail a finished fit (module docstring)
            reason = f"{type(error).__name__}: {error}"
            return Gap(None, None, reason=reason, record=dict(method=None, draws=0, reason=reason))
    if result is None or result.record:
        return result
    return replace(result, record=dict(method="dense", draws=num_draws, reason=result.reason))


def _newton_gap(
    guide, model, data: Data, num_draws: int, generator: torch.Generator, fit_passes: int | None, spent_passes: int
) -> Gap | None:
    low_rank = isinstance(guide, autoguide.AutoLowRankMultivariateNormal)
    full_rank = isinstance(guide, autoguide.AutoMultivariateNormal)
    factored = low_rank or full_rank or isinstance(guide, autoguide.AutoNormal)
    try:
        target = guide_target(guide, model, data, factored=factored)
    except NoDensity as error:
        return Gap(None, None, reason=str(error), record=dict(method=None, draws=0, reason=str(error)))
    if target is None:
        return None
    if factored:
        path = svi_gap_cg.choose_path(
            target.loc.numel(), data.size, fit_passes=fit_passes, full_rank=full_rank, spent_passes=spent_passes
        )
        # a full-rank guide past svi_refine's bounds: the dense statistic on the mean step's own antithetic draws, its
        # standard error from their pair means (module docstring); the conjugate-gradient gap for the other families
        pairs = max(1, num_draws // 2) if full_rank and path.kind == "cg" else None
        if path.kind != "dense" and pairs is None:
            return (
                _cg(target, data, num_draws, generator, path.max_iterations, spent_passes)
                if path.kind == "cg"
                else None
            )
        if not (low_rank or full_rank):  # within the refinement's bounds a mean-field guide is not checked (module
            return None  # docstring)
        if full_rank:  # its covariance as the guide gives it, as before this path read it as factors
            target = replace(target, cov=guide_gaussian(guide, target.order, target.pot.shapes)[1])
        else:
            target = replace(target, cov=torch.diag(target.diag) + target.factor @ target.factor.T)
    loc, cov = target.loc, target.cov
    root, info = torch.linalg.cholesky_ex(cov)
    if info != 0:  # its own reason: no draw can be taken, and the log density is not to blame (review 17)
        return _before_any_draw(
            target.labels,
            f"the guide's covariance has no Cholesky factor: it is not finite or not positive definite (in float64, "
            f"at its leading minor of order {int(info)})",
        )
    try:
        if pairs is None:
            deviations = (
                torch.randn(num_draws, loc.numel(), dtype=torch.float64, device=loc.device, generator=generator)
                @ root.T
            )
        else:  # the step's draws: the same generator calls as svi_refine_cg.refine_mean's (L v, L the factor)
            half = svi_gap_cg.antithetic_half(target, pairs, generator)
            deviations = torch.cat([half, -half])
        energies, grads, hess = derivatives(
            target.pot,
            target.order,
            (loc + deviations).to(target.dtype),
            hessians=low_rank,
            chunk_size=svi_refine.hessian_chunk(loc.numel(), data.size) if low_rank else VMAP_CHUNK,
        )
    except NotBatchable as error:  # a low-rank guide's Hessians (guide_density: too slow one draw at a time)
        return _before_any_draw(target.labels, f"{error}, and its Hessians one draw at a time cost too much")
    except Exception as error:  # the model's own (a low-rank guide's: from the batched Hessian pass)
        what = "Hessian" if low_rank else "gradient"
        return _before_any_draw(
            target.labels, f"the log density's {what} could not be evaluated ({type(error).__name__}: {error})"
        )
    bad = int((~torch.isfinite(energies) | ~torch.isfinite(grads).all(-1)).sum())
    if bad:
        return Gap(
            None,
            None,
            target.labels,
            reason=f"the log density or its gradient is not finite at {bad} of {len(deviations)} guide draws",
        )
    if low_rank:  # the Newton step with the expected Hessian, which a low-rank guide's S is not (module docstring)
        if not bool(torch.isfinite(hess).all()):
            return Gap(None, None, target.labels, reason="the log density's Hessian is not finite at some guide draw")
        precision = -hess.double().mean(0)
        factor, info = torch.linalg.cholesky_ex((precision + precision.T) / 2)
        if info != 0:
            return Gap(
                None, None, target.labels, reason="the expected Hessian of -log p is not positive definite at the guide"
            )
        gap, se = gap_statistic(grads.double(), deviations, torch.cholesky_inverse(factor), cov.diagonal().sqrt())
    elif pairs is not None:  # a pair's mean is one sample (its deviations cancel): the standard error from the pairs
        grads = grads.double()
        gap, se = gap_statistic((grads[:pairs] + grads[pairs:]) / 2, (deviations[:pairs] + deviations[pairs:]) / 2, cov)
        record = dict(method="dense", draws=2 * pairs, pairs=pairs, reason=None)
        return Gap(gap.cpu(), se.cpu(), target.labels, record=record)
    else:
        gap, se = gap_statistic(grads.double(), deviations, cov)
    return Gap(gap.cpu(), se.cpu(), target.labels)


def _before_any_draw(labels: list[str], reason: str) -> Gap:
    """No verdict from a failure before any draw's value was known (the guide's covariance has no Cholesky factor, or
    the batched pass raised): recorded with ``draws`` 0, not the draws it would have taken (review 15). A chunked pass
    that raised after some chunks is recorded so too: ``draws`` counts the draws of a pass that completed, and none of
    its chunks' draws gives a verdict."""
    return Gap(None, None, labels, reason, dict(method="dense", draws=0, reason=reason))


def _cg(target, data: Data, num_draws: int, generator: torch.Generator, max_iterations: int, spent_passes: int) -> Gap:
    """The conjugate-gradient gap (:mod:`bnn_pyro.infer.svi_gap_cg`) as a :class:`Gap`; the model's own errors give no
    verdict with the reason."""
    try:
        out = svi_gap_cg.cg_gap(
            target,
            rows=data.size,
            num_draws=num_draws,
            generator=generator,
            max_iterations=max_iterations,
            spent_passes=spent_passes,
        )
    except Exception as error:  # the model's own (gradients or products): recorded, the fit goes on
        reason = f"the log density's derivatives could not be evaluated ({type(error).__name__}: {error})"
        return Gap(None, None, target.labels, reason, dict(method="cg", draws=0, reason=reason))
    return Gap(out.gap, out.se, target.labels, out.reason, out.record)
