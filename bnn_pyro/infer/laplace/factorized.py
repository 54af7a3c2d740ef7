"""The prior part of ``U`` in closed form where the prior is factorized Normal: its value, gradient and Hessian
without Hessian-vector products.

A latent site whose prior is a ``Normal`` with per-element ``loc`` and ``scale`` (the model's own, or those a
prior precision sets, :func:`.priors.potentials`), on the real line (no transform, no Jacobian), unscaled and
unmasked, adds ``(z - loc)^2 / (2 scale^2) + log scale + log(2 pi) / 2`` per element: gradient
``(z - loc) / scale^2`` and Hessian ``diag(1 / scale^2)``, the same at every ``z`` and built once
(:func:`build`, from one traced run of the prior on one row). A site of one element with another prior (a learned
noise scale, unconstrained by its support's bijection as on Pyro's path) adds its own term
``-log p(t^-1(z)) + log|dt/dx|``, whose value and derivatives autograd gives at each call. Every site's prior must
depend on no other latent site and no trainable parameter (checked on the traced run's graph). Anything else (a
hyperprior, Laplace or StudentT weights, a site's own multivariate prior) makes :func:`build` return ``None``, and
the caller keeps the Hessian-vector products of :func:`.curvature.prior_terms` (tests/infer/test_laplace_prior.py
checks that both agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine

from bnn_pyro.infer._analytic import normal_loc_scale
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._logjoint import is_identity
from bnn_pyro.infer._potential import Potential
from bnn_pyro.likelihoods import HALF_LOG_2PI


@dataclass
class Scalar:
    """A one-element site with a prior other than Normal: its flat index, prior and transform to the real line."""

    index: int
    prior: torch.distributions.Distribution
    transform: torch.distributions.Transform
    shape: torch.Size


@dataclass
class FactorizedNormal:
    """The prior part of ``U`` over the flat unconstrained vector (:meth:`Potential.flatten` order), float64."""

    loc: torch.Tensor  # (dim,): the Normal sites' loc (0 at the scalar sites)
    precision: torch.Tensor  # (dim,): 1 / scale^2 (0 at the scalar sites)
    const: float  # sum of log scale + log(2 pi) / 2 over the Normal elements
    scalars: list[Scalar]

    def terms(self, z: torch.Tensor, active: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        """``(U_prior(z), grad, diag H)``, the gradient and Hessian diagonal on the coordinates ``active`` (float64;
        the Hessian is diagonal)."""
        d = z.detach().double() - self.loc
        grad = d * self.precision
        value = 0.5 * float(d @ grad) + self.const
        hess = self.precision.clone()
        for s in self.scalars:
            u, g, h = _scalar(s, z.detach()[s.index])
            value += u
            grad[s.index], hess[s.index] = g, h
        return value, grad[active], hess[active]


def _scalar(s: Scalar, z: torch.Tensor) -> tuple[float, float, float]:
    """Value, first and second derivative of one scalar site's term of ``U`` (as Pyro's potential computes it)."""
    zr = z.clone().requires_grad_()
    with torch.enable_grad():
        x = s.transform.inv(zr)
        u = -s.prior.log_prob(x.reshape(s.shape)).sum() + s.transform.log_abs_det_jacobian(x, zr).sum()
        (g,) = torch.autograd.grad(u, zr, create_graph=True)
        h = torch.autograd.grad(g, zr)[0] if g.requires_grad else torch.zeros_like(g)
    return float(u.detach()), float(g.detach()), float(h)


def build(run, data_first: tuple, dataset_size: int, pot: Potential, values: dict) -> FactorizedNormal | None:
    """The closed form of the prior part ``pot`` (``run``: its Pyro model ``run(x, y, dataset_size)``, observations
    masked), or ``None`` where the prior is not factorized Normal (module docstring). ``values``: constrained site
    values at which the prior is traced (any point: only the distributions are read)."""
    x0, y0 = data_first
    leaves = {k: v.detach().clone().requires_grad_() for k, v in values.items()}
    try:
        with torch.enable_grad(), pyro.get_param_store().scope():
            trace = poutine.trace(poutine.condition(quiet_model(run, dataset_size), data=leaves)).get_trace(
                x0[:1], None if y0 is None else y0[:1]
            )
    except RuntimeError:  # e.g. a model that writes into a sampled value in place (autograd refuses it on a leaf):
        return None  # the Hessian-vector products need no such trace
    dtype, device = torch.float64, next(iter(values.values())).device
    locs, precs, const, scalars, start = [], [], 0.0, [], 0
    for name, shape in pot.shapes.items():
        node, size = trace.nodes.get(name), math.prod(shape)
        if node is None or node["mask"] is not None or not _unit(node["scale"]) or not _constant(node):
            return None
        params = normal_loc_scale(node["fn"], shape) if is_identity(pot.transforms.get(name)) else None
        if params is not None:
            loc, scale = (p.detach().to(dtype=dtype, device=device).reshape(-1) for p in params)
            locs.append(loc)
            precs.append(scale**-2)
            const += float((scale.log() + HALF_LOG_2PI).sum())
        elif size == 1 and name in pot.transforms:
            scalars.append(Scalar(start, node["fn"], pot.transforms[name], node["fn"].shape()))
            locs.append(torch.zeros(1, dtype=dtype, device=device))
            precs.append(torch.zeros(1, dtype=dtype, device=device))
        else:
            return None
        start += size
    return FactorizedNormal(torch.cat(locs), torch.cat(precs), const, scalars)


def _unit(scale) -> bool:
    return bool(scale == 1.0) if not isinstance(scale, torch.Tensor) else scale.numel() == 1 and bool(scale == 1.0)


def _constant(node) -> bool:
    """Whether the site's prior is constant: its log density at a detached value needs no gradient, so it depends on
    no other latent site (traced as leaves that require one) and on no trainable parameter."""
    return not node["fn"].log_prob(node["value"].detach()).requires_grad
