"""How far a fitted Gaussian guide's mean is from the ELBO's optimum: one Newton step, with the guide's own covariance.

For a Gaussian guide ``q = N(m, S)`` in the unconstrained coordinates ``z`` the autoguides work in, the ELBO's
gradient in the mean is ``E_q[grad log p(z)]`` (the entropy does not depend on ``m``), which is zero at the optimum;
near it ``E_q[grad log p] ~ -E_q[-hess log p] (m - m*)``, and at the optimum of a full-rank guide ``S^-1 =
E_q[-hess log p]`` (Opper & Archambeau 2009, eq. 9-10). So ``S E_q[grad log p(z)]`` is the Newton step that takes the
guide's mean to the optimum of its family; divided by the guide's sd it says, per coordinate, how many of the guide's
own sds the fit stopped short. The SVI engine takes it for the guides with a covariance factor (``"full_rank"``,
``"low_rank"``); not for a mean-field guide, whose diagonal ``S`` is not the inverse curvature wherever the posterior
correlates (there ``diag(S) E_q[grad log p]`` misstates the distance: on a correlated Gaussian posterior it read 0.15
guide sds at a mean-field fit whose mean is the optimum's up to Adam's noise). :func:`newton_gap` estimates it from :data:`GAP_DRAWS` draws of the guide with the control variate
``S^-1 (z - m)`` (zero mean under ``q``, the whole gradient where ``log p`` is quadratic), so on a near-Gaussian
posterior its Monte Carlo error is a small part of the one-particle ELBO gradient's noise.

Why not the ELBO trace or the guide's iterates: under the cosine schedule the rate falls to 1% of ``lr`` at the end, so
the parameters freeze wherever they are; the ELBO's window means and the iterate average of the last two windows then
agree to well within their noise although the mean is still short of the optimum (eight schools, full-rank, seed 0:
``tau``'s mean 0.24 exact sds off the optimum's after 5,000 steps, silently; ``benchmarks/results/svi_convergence/``).
The gradient at the end does not freeze: it says where the optimum is.

Example
-------
>>> gap, se = newton_gap(guide, model, data)      # (dim,) each, in the guide's sds; None where not covered
"""

from __future__ import annotations

import math

import torch
from pyro.infer import autoguide

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential

__all__ = ["GAP_DRAWS", "guide_gaussian", "newton_gap", "gap_statistic"]

GAP_DRAWS = 1000
"""Guide draws for :func:`newton_gap`: with the control variate the gap's standard error is ~0.005 guide sds on the
regression references and 0.02-0.08 on eight schools' funnel (``tau``; 0.005-0.015 on its other coordinates), against
0.01-0.07 with 200 draws. One gradient of the log density per draw (``benchmarks/results/svi_convergence/``)."""


def guide_gaussian(guide, order: list[str], shapes: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The guide's mean and covariance over the flat unconstrained coordinates of the sites ``order`` (each of
    ``shapes[site]``), or ``None`` for a guide that is not a Gaussian autoguide (``AutoNormal``,
    ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``)."""
    with torch.no_grad():
        if isinstance(guide, (autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal)):
            q = guide.get_posterior()
            return q.loc.detach().double(), q.covariance_matrix.detach().double()
        if isinstance(guide, autoguide.AutoNormal):
            locs = [getattr(guide.locs, site).detach().reshape(-1) for site in order]
            scales = [getattr(guide.scales, site).detach().reshape(-1) for site in order]
            if sum(v.numel() for v in locs) != sum(math.prod(shapes[s]) for s in order):
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


def newton_gap(guide, model, data: Data, *, num_draws: int = GAP_DRAWS, seed: int = 0):
    """:func:`gap_statistic` for a fitted Gaussian autoguide of ``model`` on ``data`` (full batch), from ``num_draws``
    draws of the guide under ``seed`` (apart from the caller's random state); ``(gap, se, labels)``, or ``None`` where
    the guide is not covered. Where the log density is not finite at some draw the gap is NaN (no verdict)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pot = Potential(model, data, init="median", fast_path=False)
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
        chol = torch.linalg.cholesky(cov)
        eps = torch.randn(num_draws, loc.numel(), dtype=torch.float64)
        deviations = eps @ chol.T
        dtype = next(iter(pot.init.values())).dtype
        grads = torch.empty_like(deviations)
        for i in range(num_draws):
            z = (loc + deviations[i]).to(dtype).requires_grad_()
            sites, k = {}, 0
            for name in order:
                n = math.prod(pot.shapes[name])
                sites[name] = z[k : k + n].reshape(pot.shapes[name])
                k += n
            energy = pot(sites)
            if not bool(torch.isfinite(energy)):
                grads[i] = math.nan
                continue
            (grad,) = torch.autograd.grad(energy, z)
            grads[i] = -grad.double()
    labels = []
    for name in order:
        n = math.prod(pot.shapes[name])
        labels += [name] if n == 1 and len(pot.shapes[name]) == 0 else [f"{name}[{j}]" for j in range(n)]
    gap, se = gap_statistic(grads, deviations, cov)
    return gap, se, labels
