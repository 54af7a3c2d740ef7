"""The density of an approximate posterior ``q`` at its own draws, recorded by the engines that have one.

:func:`bnn_pyro.posterior.psis.psis` (Pareto-smoothed importance sampling, Yao et al. 2018) needs ``log q(z)`` of
every draw. Each engine whose approximation is a distribution with a density records it, at the time
it draws, as ``post.sample_stats["log_q"]`` ``(chains, draws)``: the log density in the UNCONSTRAINED
coordinates ``z = T^-1(w)`` of the latent sites (``T = biject_to(support)``, Pyro's convention, in which
every guide, the Laplace Gaussian and SWAG's Gaussian live). Chain ``c``'s draws come from chain
``c``'s own ``q``. Only the coordinates that ``q`` moves count: sites held at one value in every draw
(Laplace's ``structure="last_layer"`` outside the last layer) add the same constant to every draw.

- SVI with an ``AutoNormal`` or an ``AutoContinuous`` guide (``"mean_field"``, ``"low_rank"``,
  ``"full_rank"``): the guide's auxiliary (unconstrained) sites, :func:`autoguide`.
- Laplace: ``N(m, H^-1)`` on the covered coordinates, :func:`laplace`.
- SWAG: ``N(z_SWA, scale (Sigma_diag + D^T D / (K - 1)) / 2)``, :func:`swag`.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.infer import autoguide as _autoguide

from bnn_pyro.likelihoods import HALF_LOG_2PI

__all__ = ["autoguide", "laplace", "swag"]


def autoguide(guide, trace, num_samples: int) -> torch.Tensor | None:
    """``log q(z)`` of ``num_samples`` draws traced from ``guide`` under a vectorizing plate, or ``None``
    for a guide without a density (``AutoDelta``, hand-written guides: their sites cannot be told apart
    from auxiliary variables of a richer family)."""
    if not isinstance(guide, (_autoguide.AutoNormal, _autoguide.AutoContinuous)):
        return None
    total = None  # float64 on the device of the draws
    for site in trace.nodes.values():
        if site["type"] == "sample" and site["infer"].get("is_auxiliary"):
            lp = site["fn"].log_prob(site["value"]).detach().double().reshape(num_samples, -1).sum(-1)
            total = lp if total is None else total + lp
    return torch.zeros(num_samples, dtype=torch.float64) if total is None else total.cpu()  # a sample stat: CPU


def laplace(approx, draws: dict[str, torch.Tensor]) -> torch.Tensor:
    """``log N(z_a; m_a, H^-1)`` of Laplace draws (site values on their supports) over the covered
    coordinates ``a`` of a :class:`~bnn_pyro.infer.laplace.LaplaceApproximation`."""
    pot = approx.potential
    z = pot.flatten(pot.unconstrain(draws)).double()[:, approx.active]
    r = z - approx.mean.double()[approx.active]
    h = approx.precision
    if hasattr(h, "quad"):  # a Kronecker-factored precision (structure="kron", laplace/kron.py)
        quad, logdet = h.quad(r), h.logdet()
    elif h.dim() == 1:
        quad, logdet = (r * r * h.double()).sum(-1), h.double().log().sum()
    else:
        chol = approx.cholesky().double()  # the fit's own factor of H (a float64 H: the same tensor)
        quad, logdet = ((r @ chol) ** 2).sum(-1), 2.0 * chol.diagonal().log().sum()
    return (0.5 * (logdet - quad) - r.shape[-1] * HALF_LOG_2PI).cpu()  # a sample stat: on the CPU


def swag(moments, flat: torch.Tensor, scale: float) -> torch.Tensor | None:
    """``log q(z)`` of SWAG's flat unconstrained draws (the Gaussian of :class:`~bnn_pyro.infer.swag.SWAGMoments`),
    or ``None`` when a coordinate never moved (zero variance: ``q`` is degenerate, no density)."""
    var = moments.variance
    k = moments.deviations.shape[0]
    if not bool((var > 0).all()) or k < 2:
        return None
    q = dist.LowRankMultivariateNormal(
        moments.mean,
        moments.deviations.T * math.sqrt(scale / (2.0 * (k - 1))),
        var * (scale / 2.0),
        validate_args=False,
    )
    return q.log_prob(flat.double().to(moments.mean.device)).cpu()
