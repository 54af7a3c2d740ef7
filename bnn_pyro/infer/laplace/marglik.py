"""The Laplace evidence (marginal likelihood) and the prior precision that maximizes it."""

from __future__ import annotations

import math
import warnings

import torch

from bnn_pyro.infer.laplace.curvature import Terms
from bnn_pyro.infer.laplace.priors import NormalSites
from bnn_pyro.infer.laplace.structure import Layout

LOG_DELTA_MAX = math.log(1e8)  # prior precisions are searched in [1e-8, 1e8]


def log_evidence(value, g: torch.Tensor, hess: torch.Tensor) -> torch.Tensor:
    """``-U + g^T H^-1 g / 2 - log det H / 2 + k log(2 pi) / 2``: the evidence of the quadratic model of ``U``."""
    if hess.dim() == 1:
        quad, logdet = (g**2 / hess).sum(), hess.log().sum()
    else:
        chol = torch.linalg.cholesky(hess)
        quad = (torch.linalg.solve_triangular(chol, g[:, None], upper=False) ** 2).sum()
        logdet = 2 * chol.diagonal().log().sum()
    return -value + 0.5 * quad - 0.5 * logdet + 0.5 * g.numel() * math.log(2 * math.pi)


def optimize_precision(lik: Terms, prior1: Terms, normal: NormalSites, z, layout: Layout,
                        start: dict[str, float]) -> dict[str, float]:
    """``delta`` per group maximizing the evidence (L-BFGS on ``log delta``, float64). ``prior1`` is the
    prior part at ``delta = 1``; ``U_delta`` differs from it by ``sum_g (delta_g - 1) |w_g - loc_g|^2 / 2 -
    n_g log(delta_g) / 2``, its gradient by ``(delta - 1)(w - loc)`` and its Hessian by ``(delta - 1) I``."""
    names = list(start)
    group = torch.full((len(layout.active),), -1, dtype=torch.long)
    dev = torch.zeros(len(layout.active), dtype=torch.float64)
    for site, loc in normal.locs.items():
        pos = layout.where[layout.coords[site]]
        group[pos] = names.index(normal.group(site, start))
        dev[pos] = (z[layout.coords[site]] - loc.reshape(-1)).double()
    on = group >= 0
    squares = torch.zeros(len(names), dtype=torch.float64).index_add(0, group[on], dev[on] ** 2)
    counts = torch.zeros(len(names), dtype=torch.float64).index_add(0, group[on], torch.ones_like(dev[on]))
    log_delta = torch.tensor([math.log(start[g]) for g in names], dtype=torch.float64, requires_grad=True)
    hess0, grad0, value0 = lik.hess + prior1.hess, lik.grad + prior1.grad, lik.value + prior1.value

    def closure():
        opt.zero_grad()
        delta = log_delta.exp()
        shift = torch.where(on, delta[group.clamp(min=0)] - 1.0, torch.zeros_like(dev))
        hess = hess0 + shift if hess0.dim() == 1 else hess0 + torch.diag(shift)
        value = value0 + ((delta - 1.0) * squares / 2 - counts * log_delta / 2).sum()
        loss = -log_evidence(value, grad0 + shift * dev, hess)
        loss.backward()
        return loss

    opt = torch.optim.LBFGS([log_delta], lr=1.0, max_iter=200, line_search_fn="strong_wolfe", tolerance_grad=1e-12,
                            tolerance_change=1e-15)
    opt.step(closure)
    if not torch.isfinite(log_delta).all():
        raise FloatingPointError("prior_precision: the evidence search failed (non-finite delta). Set a number, e.g. "
                                 "prior_precision=1.0, or use prior_precision='model'.")
    bounded = log_delta.detach().clamp(-LOG_DELTA_MAX, LOG_DELTA_MAX)
    if (bounded != log_delta).any():
        warnings.warn(f"prior_precision: the evidence keeps growing as delta goes to 0 or infinity for group(s) "
                      f"{[g for g, b, v in zip(names, bounded, log_delta) if b != v]}; delta is clipped to "
                      f"[1e-8, 1e8]. A delta at 1e8 switches those weights off: the data prefer them at the prior "
                      "location.", stacklevel=5)
    return {g: float(v) for g, v in zip(names, bounded.exp())}

