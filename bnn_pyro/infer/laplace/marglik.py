"""The Laplace evidence (marginal likelihood) and the prior precision that maximizes it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bnn_pyro.infer.laplace.curvature import Terms
from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.infer.laplace.priors import NormalSites
from bnn_pyro.infer.laplace.structure import Layout
from bnn_pyro.likelihoods import HALF_LOG_2PI
from bnn_pyro.utils.user_warnings import warn

LOG_DELTA_MAX = math.log(1e8)  # prior precisions are searched in [1e-8, 1e8]


def log_evidence(value, g: torch.Tensor, hess: torch.Tensor, *, chol: torch.Tensor | None = None) -> torch.Tensor:
    """``-U + g^T H^-1 g / 2 - log det H / 2 + k log(2 pi) / 2``: the evidence of the quadratic model of ``U``.
    ``chol``: the lower Cholesky factor of a dense ``H`` where the caller has it (the fit does: :func:`.checked`), so
    that ``H`` is not factorized again; ``None``: factorized here."""
    if isinstance(hess, Kron):
        quad, logdet = hess.quad(g), hess.logdet()
    elif hess.dim() == 1:
        quad, logdet = (g**2 / hess).sum(), hess.log().sum()
    else:
        chol = torch.linalg.cholesky(hess) if chol is None else chol
        quad = (torch.linalg.solve_triangular(chol, g[:, None], upper=False) ** 2).sum()
        logdet = 2 * chol.diagonal().log().sum()
    return -value + 0.5 * quad - 0.5 * logdet + g.numel() * HALF_LOG_2PI


@dataclass(frozen=True)
class NoiseTerms:
    """A learned homoscedastic Gaussian noise searched along with ``delta`` (Immer et al. 2021; laplace-torch's
    ``sigma_noise``): at the current ``sigma0`` the likelihood part is ``rss / (2 sigma^2) + count log sigma +
    count log(2 pi) / 2``, its gradient in the weights scales as ``sigma^-2`` and its curvature as
    ``sigma^-power`` (GGN: 2; empirical Fisher, residuals fixed: 4). ``prior`` is the noise site's own prior
    (of ``sigma``, or of the precision ``sigma^-2`` for a ``"precision"`` site), kept as a hyperprior."""

    sigma0: float
    rss: float
    count: int
    power: int
    prior: object
    precision: bool


def optimize_precision(
    lik: Terms,
    prior1: Terms,
    normal: NormalSites,
    z,
    layout: Layout,
    start: dict[str, float],
    noise: NoiseTerms | None = None,
):
    """``(delta, sigma)``: ``delta`` per group (and, with ``noise``, the noise sd ``sigma``; else ``None``)
    maximizing the evidence (L-BFGS on ``log delta``, ``log sigma``, float64). ``prior1`` is the prior part at
    ``delta = 1``; ``U_delta`` differs from it by ``sum_g (delta_g - 1) |w_g - loc_g|^2 / 2 - n_g log(delta_g) / 2``,
    its gradient by ``(delta - 1)(w - loc)`` and its Hessian by ``(delta - 1) I``."""
    names = list(start)
    on = dict(dtype=torch.float64, device=layout.device)  # float64 on the model's device, as the curvature
    group = torch.full((len(layout.active),), -1, dtype=torch.long, device=layout.device)
    dev = torch.zeros(len(layout.active), **on)
    for site, loc in normal.locs.items():
        pos = layout.where[layout.coords[site]]
        group[pos] = names.index(normal.group(site, start))
        dev[pos] = (z[layout.coords[site]] - loc.reshape(-1)).double()
    covered = group >= 0
    squares = torch.zeros(len(names), **on).index_add(0, group[covered], dev[covered] ** 2)
    counts = torch.zeros(len(names), **on).index_add(0, group[covered], torch.ones_like(dev[covered]))
    log_delta = torch.tensor([math.log(start[g]) for g in names], **on, requires_grad=True)
    log_sigma = torch.tensor(math.log(noise.sigma0) if noise else 0.0, **on, requires_grad=True)

    def likelihood_part():
        if noise is None:
            return lik.value, lik.grad, lik.hess
        sigma = log_sigma.exp()
        ratio = (noise.sigma0 / sigma) ** 2
        hyper = noise.prior.log_prob(sigma**-2 if noise.precision else sigma).double()
        value = noise.rss / (2 * sigma**2) + noise.count * (log_sigma + HALF_LOG_2PI) - hyper
        return value, lik.grad * ratio, lik.hess * ratio ** (noise.power / 2)  # (a Kron * a tensor is a Kron)

    def closure():
        opt.zero_grad()
        delta = log_delta.exp()
        shift = torch.where(covered, delta[group.clamp(min=0)] - 1.0, torch.zeros_like(dev))
        lik_value, lik_grad, lik_hess = likelihood_part()
        hess0 = lik_hess + prior1.hess
        hess = hess0 + shift if isinstance(hess0, Kron) or hess0.dim() == 1 else hess0 + torch.diag(shift)
        value = lik_value + prior1.value + ((delta - 1.0) * squares / 2 - counts * log_delta / 2).sum()
        loss = -log_evidence(value, lik_grad + prior1.grad + shift * dev, hess)
        loss.backward()
        return loss

    opt = torch.optim.LBFGS(
        [log_delta] + ([log_sigma] if noise else []),
        lr=1.0,
        max_iter=200,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
    )
    opt.step(closure)
    if not torch.isfinite(log_delta).all():
        raise FloatingPointError(
            "prior_precision: the evidence search failed (non-finite delta). Set a number, e.g. "
            "prior_precision=1.0, or use prior_precision='model'."
        )
    bounded = log_delta.detach().clamp(-LOG_DELTA_MAX, LOG_DELTA_MAX)
    if (bounded != log_delta).any():
        warn(
            f"prior_precision: the evidence keeps growing as delta goes to 0 or infinity for group(s) "
            f"{[g for g, b, v in zip(names, bounded, log_delta) if b != v]}; delta is clipped to "
            f"[1e-8, 1e8]. A delta at 1e8 switches those weights off: the data prefer them at the prior "
            "location."
        )
    if noise is not None and not torch.isfinite(log_sigma):
        raise FloatingPointError(
            "noise: the evidence search failed (non-finite sigma). Use validation= (noise on "
            "held-out rows) or a known noise, Gaussian(scale=...)."
        )
    return {g: float(v) for g, v in zip(names, bounded.exp())}, (float(log_sigma.detach().exp()) if noise else None)
