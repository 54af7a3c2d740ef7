"""A fixed preconditioner for the cyclical SG-MCMC loop on a small plain Pyro function: the curvature at its mode.

The loop's step (:mod:`bnn_pyro.infer.sgmcmc`) is ``v <- (1 - alpha) v - eta M grad U~(z)``, ``z <- z + v`` with
``M = I`` by default. On a posterior whose Hessian ``H`` has condition number ``kappa`` (a coefficient of a covariate
near 100 beside an intercept: ``kappa`` 5e5 on kidiq, 4e4 on logistic, ``tests/reference``), ``lr="auto"``'s peak
step ``(2 - alpha) / (2 lambda_max)`` takes about ``kappa`` steps per e-fold along the flattest direction, so a
snapshot cycle of 1,000 steps ends where it started in that direction. With ``M = H^{-1}`` (``H = L L^T`` at the
mode, Cholesky) the loop runs in the whitened coordinates ``u = L^T z``, whose Hessian ``L^{-1} H L^{-T}`` is ``I`` at
the mode: every direction's curvature is about 1 and the peak step no longer depends on ``kappa``. A fixed positive
definite ``M`` keeps a gradient method's fixed points (``M grad U = 0`` exactly where ``grad U = 0``; a tilted
objective's likewise), and the Langevin update with noise ``N(0, 2 alpha eta M)`` keeps the target density
(preconditioned Langevin dynamics with a constant metric: Girolami & Calderhead 2011, sec. 5; Ma, Chen & Fox 2015).

:func:`mode_metric` finds the mode (from the prior median: L-BFGS, then damped Newton with the exact Hessian,
:func:`~bnn_pyro.infer.map_fit.converge`) and the Cholesky factor of the Hessian of ``U`` there, damped by the
smallest ``d`` in ``1e-6 m, 1e-5 m, ...`` (``m`` the largest ``|H_ii|``) that makes ``H + d I`` positive definite when
``H`` is not. Only a Pyro function (never a ``BNN``: its fit is unchanged) on tensor data, with no ``pyro.param``
sites and at most :data:`~bnn_pyro.infer.map_fit.CONVERGE_MAX_DIM` latent coordinates (a dense Hessian: one gradient
pass per coordinate). The prior median is estimated from prior draws of the global generator: the SG-MCMC engines
call it once per fit under a seed of their own (:func:`bnn_pyro.infer.sgmcmc.fit_metric`), never from a chain's stream.

sgld and sghmc (the constant-step loop) use the same metric; their chains start at :func:`dispersed_start`, a draw from
``N(mode, DISPERSION^2 H^{-1})``, so that several chains start apart (R-hat) and near the mode (the metric holds).

Example
-------
>>> metric = mode_metric(model, paths, data)          # None where it does not apply
>>> metric.mode, metric.chol                           # flat unconstrained mode, L (float64)
>>> z0 = dispersed_start(metric, seed, like=z)          # a chain's start: N(mode, 4 H^-1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potentials, dense_precision
from bnn_pyro.infer.map_fit import CONVERGE_MAX_DIM, converge, map_state
from bnn_pyro.model import BNN

__all__ = ["Metric", "mode_metric", "whiten", "unwhiten", "dispersed_start", "DISPERSION"]

DAMPING = [
    10.0**k for k in range(-6, 7)
]  # H + d m I, m = max |H_ii|, when H is not positive definite (as damped_newton)


DISPERSION = 2.0
"""sgld's and sghmc's start on a Pyro function: a draw from ``N(mode, DISPERSION^2 H^{-1})``, the Laplace
approximation at the mode widened 2-fold in sd, so that chains start apart and over-dispersed relative to the posterior
(Gelman & Rubin 1992: R-hat detects chains that have not forgotten their start only if the starts are spread wider
than the posterior) while staying where the metric's curvature holds (from a prior draw the whitened run on kidiq
diverged)."""


@dataclass(frozen=True)
class Metric:
    """``mode``: the flat unconstrained mode of ``U``; ``chol``: ``L`` (float64) with ``L L^T = H + damping I``, the
    Hessian of ``U`` there (``M = (L L^T)^{-1}``); ``damping``: 0 where ``H`` is positive definite."""

    mode: torch.Tensor
    chol: torch.Tensor
    damping: float = 0.0


def mode_metric(model, paths: Potentials, data: Data) -> Metric | None:
    """The :class:`Metric` of ``model`` on ``data`` (module docstring), or ``None`` where it does not apply (a
    ``BNN``, a loader, ``pyro.param`` sites, more than ``CONVERGE_MAX_DIM`` coordinates, a Hessian that is not
    finite)."""
    if isinstance(model, BNN) or data.loader is not None:
        return None
    pot = paths(model, data, init="median")
    if sum(v.numel() for v in pot.init.values()) > CONVERGE_MAX_DIM:
        return None
    state = map_state(pot, pot.init, data, model=model, num_steps=1, jacobian=False)
    if len(state.params) > len(state.z):  # pyro.param sites: a joint objective, not U alone
        return None
    converge(state, data)
    mode = pot.flatten({k: v.detach() for k, v in state.z.items()})
    hess, chol = dense_precision(pot.flat_fn((data.x, data.y)), mode)
    if not bool(torch.isfinite(hess).all()):
        return None
    damping = 0.0
    if chol is None:
        scale = float(hess.diagonal().abs().max()) or 1.0
        eye = torch.eye(len(mode), dtype=hess.dtype, device=hess.device)
        for d in DAMPING:
            chol, info = torch.linalg.cholesky_ex(hess + d * scale * eye)
            if int(info) == 0:
                damping = d * scale
                break
        else:
            return None
    return Metric(mode.detach(), chol, damping)


def whiten(chol: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``L^{-1} g``: a gradient (or curvature product) in the whitened coordinates ``u = L^T z``."""
    return torch.linalg.solve_triangular(chol, g.double()[:, None], upper=False)[:, 0].to(g)


def unwhiten(chol: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``L^{-T} v``: a move in the whitened coordinates ``u = L^T z`` as a move of ``z``."""
    return torch.linalg.solve_triangular(chol.T, v.double()[:, None], upper=True)[:, 0].to(v)


def dispersed_start(metric: Metric, seed: int, *, like: torch.Tensor) -> torch.Tensor:
    """``mode + DISPERSION L^{-T} e``, ``e ~ N(0, I)`` from a generator seeded ``seed + 104729`` (apart from the
    chain's noise, ``seed + 7919``, and Pyro's generators): a draw from
    ``N(mode, DISPERSION^2 H^{-1})`` (``L^{-T} L^{-1} = H^{-1}``), in ``like``'s dtype and device. Deterministic in
    ``seed``, so a resumed chain recomputes the same start."""
    gen = torch.Generator().manual_seed(seed + 104729)  # a CPU generator: the same start on every device
    e = torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.device)
    return (metric.mode.double() + DISPERSION * unwhiten(metric.chol, e)).to(like)
