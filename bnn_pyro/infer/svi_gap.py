"""How far a fitted Gaussian guide's mean is from the ELBO's optimum: one Newton step, with the guide's own covariance.

For a Gaussian guide ``q = N(m, S)`` in the unconstrained coordinates ``z`` the autoguides work in, the ELBO's
gradient in the mean is ``E_q[grad log p(z)]`` (the entropy does not depend on ``m``), which is zero at the optimum;
near it ``E_q[grad log p] ~ -E_q[-hess log p] (m - m*)``, and at the optimum of a full-rank guide ``S^-1 =
E_q[-hess log p]`` (Opper & Archambeau 2009, eq. 9-10). So ``S E_q[grad log p(z)]`` is the Newton step that takes the
guide's mean to the optimum of its family; divided by the guide's sd it says, per coordinate, how many of the guide's
own sds the fit stopped short. The SVI engine takes it for the full-rank guide only. Not for a mean-field guide, whose
diagonal ``S`` is not the inverse curvature wherever the posterior correlates (there ``diag(S) E_q[grad log p]``
misstates the distance: on a correlated Gaussian posterior it read 0.15 guide sds at a mean-field fit whose mean is the
optimum's up to Adam's noise). Not for a low-rank guide (``S = D + W W^T``) either: its optimum does not satisfy ``S^-1
= E_q[-hess log p]``, so the statistic is not the Newton step there, and the control variate no longer cancels
the noise (on a correlated 9-coordinate Gaussian posterior its standard error was ~20 times the full-rank guide's, so a
miss under ~0.25 sd went unseen). :func:`newton_gap` estimates it from :data:`GAP_DRAWS` draws of the guide with the
control variate ``S^-1 (z - m)`` (zero mean under ``q``, the whole gradient where ``log p`` is quadratic), so on a
near-Gaussian posterior its Monte Carlo error is a small part of the one-particle ELBO gradient's noise. The gradients
at the draws are one batched pass (``torch.func.vmap`` over the flat log density); a model that pass cannot batch (a
``float()`` of a latent value, random draws of its own) is evaluated one draw at a time, with the same numbers.

A diagnostic must not fail a finished fit: the potential is built at the guide's own median, and where the gap cannot
be evaluated (the log density raises, or is not finite at some draw) :func:`newton_gap` returns no verdict with the
reason (the SVI engine records it in ``post.config["guide_gap"]``).

Why not the ELBO trace or the guide's iterates: under the cosine schedule the rate falls to 1% of ``lr`` at the end, so
the parameters freeze wherever they are; the ELBO's window means and the iterate average of the last two windows then
agree to well within their noise although the mean is still short of the optimum (eight schools, full-rank, seed 0:
``tau``'s mean 0.24 exact sds off the optimum's after 5,000 steps, silently; ``benchmarks/results/svi_convergence/``).
The gradient at the end does not freeze: it says where the optimum is.

Example
-------
>>> result = newton_gap(guide, model, data)   # None where not covered
>>> result.gap, result.se, result.reason       # (dim,) each in the guide's sds on the CPU; or None and why
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyro
import torch
from pyro.distributions import constraints
from pyro.infer import autoguide

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential

__all__ = ["GAP_DRAWS", "Gap", "guide_gaussian", "newton_gap", "gap_statistic"]

GAP_DRAWS = 1000
"""Guide draws for :func:`newton_gap`: with the control variate the gap's standard error is ~0.005 guide sds on the
regression references and 0.02-0.08 on eight schools' funnel (``tau``; 0.005-0.015 on its other coordinates), against
0.01-0.07 with 200 draws (full-rank guides; ``benchmarks/results/svi_convergence/``)."""

VMAP_CHUNK = 250
"""Draws per batched pass of :func:`newton_gap`: bounds the memory of one pass at ``250 x`` one evaluation's."""


@dataclass(frozen=True)
class Gap:
    """:func:`newton_gap`'s answer: ``gap`` and ``se`` (``(dim,)``, float64 on the CPU, in the guide's sds), or both
    ``None`` with ``reason`` saying why there is no verdict; ``labels`` names the unconstrained coordinates."""

    gap: torch.Tensor | None
    se: torch.Tensor | None
    labels: list[str] = field(default_factory=list)
    reason: str | None = None


def guide_gaussian(guide, order: list[str], shapes: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The guide's mean and covariance over the flat unconstrained coordinates of the sites ``order`` (each of
    ``shapes[site]``), or ``None`` for a guide that is not a Gaussian autoguide (``AutoNormal``,
    ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``) or whose coordinates are not exactly those sites'
    (a guide site the potential lacks would shift every slice)."""
    size = sum(math.prod(shapes[s]) for s in order)
    with torch.no_grad():
        if isinstance(guide, (autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal)):
            q = guide.get_posterior()
            if q.loc.numel() != size:
                return None
            return q.loc.detach().double(), q.covariance_matrix.detach().double()
        if isinstance(guide, autoguide.AutoNormal):
            locs = [getattr(guide.locs, site).detach().reshape(-1) for site in order]
            scales = [getattr(guide.scales, site).detach().reshape(-1) for site in order]
            if sum(v.numel() for v in locs) != size:
                return None
            return torch.cat(locs).double(), torch.diag(torch.cat(scales).double() ** 2)
    return None


def gap_statistic(gradients: torch.Tensor, deviations: torch.Tensor, cov: torch.Tensor):
    """The Newton step to the optimum in guide sds and its standard error, per coordinate, from ``n`` guide draws:
    ``gradients`` (``(n, dim)``, ``grad log p`` at each draw), ``deviations`` (``(n, dim)``, ``z - m``) and the guide's
    covariance ``cov``: the mean over draws of ``(S g + (z - m)) / sd`` (module docstring) and its standard error."""
    sd = cov.diagonal().sqrt()
    steps = (gradients @ cov + deviations) / sd
    n = steps.shape[0]
    return steps.mean(0), steps.std(0) / math.sqrt(n)


def newton_gap(guide, model, data: Data, *, num_draws: int = GAP_DRAWS, seed: int = 0) -> Gap | None:
    """:func:`gap_statistic` for a fitted Gaussian autoguide of ``model`` on ``data`` (full batch), from ``num_draws``
    draws of the guide under ``seed`` (apart from the caller's random state, on the guide's device): a :class:`Gap`,
    or ``None`` where the guide is not covered. It never raises on the model: where the potential cannot be built at
    the guide's median, or the log density or its gradient is not finite at some draw, the :class:`Gap` has no verdict
    and says why (dropping those draws would bias the mean toward the guide's centre)."""
    device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return _newton_gap(guide, model, data, num_draws)


def _newton_gap(guide, model, data: Data, num_draws: int) -> Gap | None:
    try:
        pot = Potential(model, data, init=guide.median(*data.first()), fast_path=False)
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        return Gap(None, None, reason=f"the log density could not be evaluated at the guide's median ({error})")
    order = [
        name
        for name, site in guide.prototype_trace.iter_stochastic_nodes()
        if not site["is_observed"] and name in pot.shapes
    ]
    if sorted(order) != sorted(pot.shapes):
        return None
    gaussian = guide_gaussian(guide, order, pot.shapes)
    if gaussian is None:
        return None
    loc, cov = gaussian
    labels = _labels(guide, order, pot.shapes)
    try:
        deviations = (
            torch.randn(num_draws, loc.numel(), dtype=torch.float64, device=loc.device) @ torch.linalg.cholesky(cov).T
        )
        dtype = next(iter(pot.init.values())).dtype
        grads, energies = _gradients(pot, order, (loc + deviations).to(dtype))
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        return Gap(None, None, labels, reason=f"the log density's gradient could not be evaluated ({error})")
    bad = int((~torch.isfinite(energies) | ~torch.isfinite(grads).all(-1)).sum())
    if bad:
        return Gap(
            None,
            None,
            labels,
            reason=f"the log density or its gradient is not finite at {bad} of {num_draws} guide draws",
        )
    gap, se = gap_statistic(grads.double(), deviations, cov)
    return Gap(gap.cpu(), se.cpu(), labels)


def _gradients(pot: Potential, order: list[str], z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad log p`` and ``log p`` at each row of ``z`` (``(n, dim)``, the sites ``order`` flat): one batched pass
    (``torch.func.vmap``, :data:`VMAP_CHUNK` rows at a time), or row by row where the model cannot be batched."""

    def log_density(flat):
        sites, k = {}, 0
        for name in order:
            n = math.prod(pot.shapes[name])
            sites[name] = flat[k : k + n].reshape(pot.shapes[name])
            k += n
        return -pot(sites)

    with pyro.validation_enabled(False):  # validation's data-dependent checks cannot be batched
        try:
            return torch.func.vmap(torch.func.grad_and_value(log_density), chunk_size=VMAP_CHUNK)(z)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            pass
    grads, values = torch.empty_like(z), torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    for i in range(z.shape[0]):
        flat = z[i].detach().requires_grad_()
        value = log_density(flat)
        values[i] = value.detach()
        if bool(torch.isfinite(value)):
            (grads[i],) = torch.autograd.grad(value, flat)
        else:
            grads[i] = math.nan
    return grads, values


def _labels(guide, order: list[str], shapes: dict) -> list[str]:
    """One label per flat coordinate: ``name[j]`` (``name`` for a scalar site); a site the guide transforms to the real
    line (a positive scale: its log; a simplex: stick-breaking coordinates) is marked ``(unconstrained)``, since those
    coordinates are not the constrained values ``post.summary()`` shows."""
    labels = []
    for name in order:
        n = math.prod(shapes[name])
        support = guide.prototype_trace.nodes[name]["fn"].support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        tag = "" if support is constraints.real else " (unconstrained)"
        scalar = n == 1 and len(shapes[name]) == 0
        labels += [f"{name}{tag}"] if scalar else [f"{name}[{j}]{tag}" for j in range(n)]
    return labels
