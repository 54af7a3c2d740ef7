"""The parts of ``U`` at the MAP on the covered coordinates: value, gradient and curvature of the
likelihood (by the backend of ``hessian=``: :mod:`.ggn`, :mod:`.fisher` or :mod:`.exact`; the diagonal GGN of a net
on the analytic potential in one pass, :mod:`bnn_pyro.infer._analytic_ggn`) and of the prior (exact: in closed form
for factorized Normal priors, :mod:`.factorized`, else by Hessian-vector products)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bnn_pyro.infer._analytic_ggn import likelihood_diagonal
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.approximation import CHUNK, Hessian, Settings, Structure
from bnn_pyro.infer.laplace.exact import exact
from bnn_pyro.infer.laplace.fisher import fisher, fisher_traced
from bnn_pyro.infer.laplace.functional import epoch
from bnn_pyro.infer.laplace.ggn import ggn
from bnn_pyro.infer.laplace.kfac import kfac
from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.infer.laplace.priors import PriorPart
from bnn_pyro.infer.laplace.structure import Layout
from bnn_pyro.model import BNN
from bnn_pyro.predictive_draws import evaluating


@dataclass
class Terms:
    """A part of ``U`` at ``z*`` on the covered coordinates: value, gradient, Hessian (float64)."""

    value: float
    grad: torch.Tensor
    hess: torch.Tensor


def terms(model, pots: tuple[Potential, PriorPart], z, data: Data, layout: Layout, s: Settings) -> tuple[Terms, Terms]:
    return likelihood_terms(model, pots, z, data, layout, s), prior_terms(pots[1], z, layout, s, data)


def prior_terms(prior: PriorPart, z, layout: Layout, s: Settings, data: Data) -> Terms:
    """Value, gradient and exact Hessian (or its diagonal) of the prior part of ``U`` (log-Jacobians included): in
    closed form for a factorized Normal prior (:mod:`.factorized`), else by Hessian-vector products."""
    diag = s.structure in (Structure.DIAG, Structure.KRON)
    if prior.closed is not None:
        value, grad, hess = prior.closed.terms(z, layout.active)
        return Terms(value, grad, hess if diag else torch.diag(hess))
    x0, y0 = data.first()
    pot_prior, active = prior.pot, layout.active
    # derivatives in the covered coordinates only: sites without a covered coordinate enter as constants, so the
    # Hessian-vector products below run through the covered sites' densities, not the whole prior
    zr = z[active].detach().clone().requires_grad_()
    values = pot_prior.unflatten(z.detach())
    for name, coords in layout.coords.items():
        pos = layout.where[coords]
        if bool((pos >= 0).all()):
            values[name] = zr[pos].reshape(values[name].shape)
        elif bool((pos >= 0).any()):
            keep = pos >= 0
            values[name] = (
                z.detach()[coords].index_copy(0, keep.nonzero()[:, 0], zr[pos[keep]]).reshape(values[name].shape)
            )
    u = pot_prior(values, (x0[:1], y0[:1]))
    (g,) = torch.autograd.grad(u, zr, create_graph=True, allow_unused=True)
    g = torch.zeros_like(zr) if g is None else g
    k = dim = zr.numel()
    active = torch.arange(k, device=zr.device)  # positions in zr

    def hvp(v):
        if not g.requires_grad:  # a prior linear in z
            return torch.zeros_like(v)
        try:
            return torch.autograd.grad(g, zr, grad_outputs=v, is_grads_batched=True, retain_graph=True)[0]
        except RuntimeError:  # an operation without a batching rule: one vector at a time
            return torch.stack([torch.autograd.grad(g, zr, grad_outputs=r, retain_graph=True)[0] for r in v])

    # a factorized prior has a diagonal Hessian, and then H 1 is that diagonal. Checked with a Gaussian vector v:
    # H v = (H 1) v holds for every v when H is diagonal, and otherwise only on the null space of H - diag(H 1),
    # which a Gaussian draw misses with probability 1 (a vector of random signs can sit in it: [[0, 1], [1, 0]])
    v = torch.randn(dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(zr)  # CPU draw, moved
    h1, hv = hvp(torch.stack([torch.ones_like(zr), v]))
    if torch.allclose(hv, h1 * v, rtol=1e-5, atol=1e-6 * (1.0 + float(h1.abs().max()))):
        h1 = h1.detach().double()
        return Terms(u.item(), g.detach().double(), h1 if diag else torch.diag(h1))
    hess = torch.zeros((k,) if diag else (k, k), dtype=torch.float64, device=zr.device)
    step = max(1, CHUNK // dim)
    for i in range(0, k, step):
        cols = active[i : i + step]
        basis = zr.new_zeros(len(cols), dim)
        basis[torch.arange(len(cols), device=zr.device), cols] = 1.0
        rows = hvp(basis).detach().double()
        hess[i : i + len(cols)] = rows[torch.arange(len(cols), device=zr.device), cols] if diag else rows[:, active]
    return Terms(u.item(), g.detach().double(), hess if diag else (hess + hess.T) / 2)


def likelihood_terms(model, pots, z, data: Data, layout: Layout, s: Settings) -> Terms:
    """Value and gradient of ``-log p(y | z)`` (the potential minus its prior part, on any model) and its
    GGN or empirical Fisher; the diagonal GGN on the analytic potential in one pass (:func:`analytic_diagonal`).
    The net runs in eval mode throughout (dropout off, BatchNorm on its running statistics): the curvature is that of
    the deterministic net at the MAP, and so are the value and gradient."""
    with evaluating(model):
        return _likelihood_terms(model, pots, z, data, layout, s)


def _likelihood_terms(model, pots, z, data: Data, layout: Layout, s: Settings) -> Terms:
    pot, prior = pots
    fused = analytic_diagonal(pot, z, data, layout, s)
    if fused is not None:
        return fused
    x0, y0 = data.first()
    zr = z.detach().clone().requires_grad_()
    za = z.detach()[layout.active].requires_grad_()  # gradients in the covered coordinates only (the last layer's
    if prior.closed is not None:  # backward pass stops at that layer)
        up, gp = prior.closed.terms(z, layout.active)[:2]
    else:
        zc = z.detach().index_copy(0, layout.active, za)
        up = prior.pot(prior.pot.unflatten(zc), (x0[:1], y0[:1]))
        (gp,) = torch.autograd.grad(up, za)
        up = up.item()
    value, gradient = 0.0, torch.zeros(za.numel(), dtype=torch.float64, device=za.device)
    for xb, yb in epoch(data, data.batch_size or data.size):
        zc = z.detach().index_copy(0, layout.active, za)
        u = pot(pot.unflatten(zc), (xb, yb))
        (gu,) = torch.autograd.grad(u, za)
        scale = xb.shape[0] / data.size  # U(batch) = U_prior + (N / B) (-log p(y_batch | z))
        value += scale * (u.item() - up)
        gradient += scale * (gu.double() - gp.double())
    diag = s.structure is Structure.DIAG
    if s.structure is Structure.KRON:
        hess = kfac(
            model,
            pot,
            z.detach(),
            data,
            layout.coords,
            layout.where,
            len(layout.active),
            fisher=s.hessian is Hessian.FISHER,
        )
    elif s.hessian is Hessian.EXACT:
        hess = exact(pot, prior, z, data, layout, diag)
    elif not isinstance(model, BNN):
        hess = fisher_traced(pot, zr, gp, data, layout, diag)
    else:
        hess = (ggn if s.hessian is Hessian.GGN else fisher)(model, pot, z.detach(), data, layout, diag)
    return Terms(value, gradient, hess)


def analytic_diagonal(pot: Potential, z, data: Data, layout: Layout, s: Settings) -> Terms | None:
    """The likelihood's value, gradient and diagonal GGN from one forward and one backward pass per output
    (:func:`~bnn_pyro.infer._analytic_ggn.likelihood_diagonal`), where ``U`` is on the analytic path (a Linear stack,
    Normal priors, a Gaussian likelihood), ``structure="diag"``, ``hessian="ggn"`` and every covered coordinate is a
    weight (a learned noise, if any, held fixed); else ``None``."""
    stack = pot.stack
    if stack is None or s.structure is not Structure.DIAG or s.hessian is not Hessian.GGN:
        return None
    weights = [n for n in stack._order if stack._noise is None or n != stack._noise[0]]
    if not torch.equal(layout.active, torch.cat([layout.coords[n] for n in weights])):
        return None
    value, gradient = 0.0, torch.zeros(pot.dim, dtype=torch.float64, device=z.device)
    hess = torch.zeros(pot.dim, dtype=torch.float64, device=z.device)
    rows = max(1, CHUNK // max(1, sum(stack._slots[n][2][:1].numel() for n in weights)))  # the layers' widths per row
    for xb, yb in epoch(data, rows):
        u, g, h = likelihood_diagonal(stack, z.detach(), xb, yb)
        value += u
        gradient += g
        hess += h
    return Terms(value, gradient[layout.active], hess[layout.active])


def solve(hess, g: torch.Tensor) -> torch.Tensor:
    """``H^-1 g`` for a dense, diagonal or Kronecker-factored ``H``."""
    if isinstance(hess, Kron):
        return hess.solve(g)
    return g / hess if hess.dim() == 1 else torch.cholesky_solve(g[:, None], torch.linalg.cholesky(hess))[:, 0]


def checked(hess, s: Settings) -> tuple[object, torch.Tensor | None]:
    """``(H, L)``: the posterior precision ``H`` once it is known to be positive definite, and for a dense ``H`` its
    lower Cholesky factor ``L`` (``H = L L^T``; ``None`` for a diagonal or Kronecker-factored ``H``), else a
    ``ValueError`` naming the likely cause and what to try. The factorization that proves a dense ``H`` positive
    definite is the one the fit goes on with (Newton step, ``gamma``, evidence, draws, density), so a fit factorizes
    ``H`` once."""
    chol = None
    if isinstance(hess, Kron):
        bad = not hess.is_positive_definite()
    elif hess.dim() == 1:
        bad = bool((hess <= 0).any())
    else:
        chol, info = torch.linalg.cholesky_ex(hess)
        bad = bool(info > 0)
    if bad and s.hessian is Hessian.EXACT:
        raise ValueError(
            "laplace: the exact Hessian (hessian='exact', the default for a Pyro function model) at the end of the "
            "MAP search is not positive definite, so no Gaussian fits there: the search ended short of a mode, at a "
            "saddle, or along a flat direction (a network's symmetries make them common). Pass hessian='fisher' (the "
            "empirical Fisher: positive semi-definite by construction, the Hessian only in expectation over the "
            "data; the fit then says whether the posterior is far from its Gaussian), raise num_steps or "
            "polish_steps, or use method='nuts'."
            + (
                " A start drawn from a wide prior can be too far from the mode to reach: start at init='median' (the "
                "default for a Pyro function) or at a fitted Posterior."
                if s.init == "prior"
                else ""
            )
        )
    if bad:
        raise ValueError(
            "laplace: the curvature at the MAP is not positive definite, so no Gaussian fits there. The MAP search "
            "may not have converged (raise num_steps or polish_steps), or the prior has zero or negative curvature "
            "(Laplace, StudentT tails, hierarchical scales). Try structure='last_layer' or 'diag', or a Normal prior "
            "(prior_precision='marglik' then tunes its scale)"
            + (", or hessian='ggn'." if s.hessian is Hessian.FISHER else ".")
        )
    return hess, chol
