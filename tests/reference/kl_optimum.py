"""What a correct full-rank Gaussian guide gives on the Pyro-function references: the Gaussian ``q = N(m, L L')`` in
the unconstrained coordinates the SVI engine's guide lives in (``log tau``, ``log sigma``: Pyro's ``biject_to`` of a
positive support is ``exp``) that minimizes ``KL(q || p)``, the objective the ELBO targets, and the means and sds of
the reported (constrained) parameters under it (closed forms: identity, or the log-normal's for ``exp``).

The log densities are written out here from the models' definitions (``posteriors.py``), independently of the code
under test; :func:`log_joint` is checked against Pyro's trace of the model in the tests. The expectation in the ELBO
is a fixed scrambled-Sobol normal sample with antithetic pairs (quasi-Monte Carlo), maximized by L-BFGS in float64;
:func:`kl_optimum` returns the optimum's error against the exact summaries (mean error in exact sds, sd ratio).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from reference.posteriors import REFERENCE, ReferencePosterior

_LOG_2_OVER_PI = math.log(2 / math.pi)


def _normal(x, scale):
    return -0.5 * (x / scale) ** 2 - torch.log(torch.as_tensor(scale, dtype=x.dtype)) - 0.5 * math.log(2 * math.pi)


def _half_cauchy_log(u, scale):
    """log HalfCauchy(exp(u); scale) + u (the log-Jacobian of exp)."""
    return _LOG_2_OVER_PI - math.log(scale) - torch.log1p((torch.exp(u) / scale) ** 2) + u


def log_joint(ref: ReferencePosterior, u: torch.Tensor) -> torch.Tensor:
    """The log joint density of the unconstrained coordinates ``u`` (``(N, P)``, the reference's parameter order with
    positive ones as logs), Jacobian included, ``(N,)``."""
    x, y = ref.x.double(), ref.y.double()
    if ref.name == "eight_schools":
        sigma = torch.tensor(REFERENCE["eight_schools"]["data"]["sigma"], dtype=u.dtype)
        mu, log_tau, tt = u[:, 0], u[:, 1], u[:, 2:]
        f = mu[:, None] + torch.exp(log_tau)[:, None] * tt
        lik = _normal(y - f, sigma).sum(-1)
        return lik + _normal(mu, 5.0) + _half_cauchy_log(log_tau, 5.0) + _normal(tt, 1.0).sum(-1)
    if ref.name == "kidiq":
        beta, log_sigma = u[:, :3], u[:, 3]
        f = beta[:, :1] + beta[:, 1:] @ x.T
        lik = _normal(y - f, torch.exp(log_sigma)[:, None]).sum(-1)
        return lik + _normal(beta, 100.0).sum(-1) + _half_cauchy_log(log_sigma, 25.0)
    if ref.name == "logistic":
        f = u[:, :1] + u[:, 1:] @ x.T
        lik = (y * f - torch.nn.functional.softplus(f)).sum(-1)
        return lik + _normal(u, torch.tensor([10.0, 2.5, 2.5], dtype=u.dtype)).sum(-1)
    raise ValueError(f"ref: no log joint written for {ref.name!r}")


def positive(ref: ReferencePosterior) -> np.ndarray:
    """Which reported parameters are positive (``exp`` of their unconstrained coordinate)."""
    return np.array([n in ("tau", "sigma") for n in ref.names])


def laplace(ref: ReferencePosterior) -> tuple[torch.Tensor, torch.Tensor]:
    """The mode of :func:`log_joint` (L-BFGS from the exact means, logs for positive parameters) and the Cholesky
    factor of the inverse Hessian there."""
    pos = torch.as_tensor(positive(ref))
    u = torch.as_tensor(ref.mean, dtype=torch.float64)
    u = torch.where(pos, torch.log(u), u)

    def f(v):
        return log_joint(ref, v[None])[0]

    u = u.clone().requires_grad_()
    opt = torch.optim.LBFGS(
        [u], lr=1.0, max_iter=2000, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe"
    )

    def loss():
        opt.zero_grad()
        out = -f(u)
        out.backward()
        return out

    opt.step(loss)
    u = u.detach()
    return u, torch.linalg.cholesky(torch.linalg.inv(-torch.autograd.functional.hessian(f, u)))


def kl_optimum(ref: ReferencePosterior, *, num: int = 2**13, seed: int = 0) -> dict:
    """The KL-optimal full-rank Gaussian (module docstring), searched in the Laplace approximation's whitened
    coordinates (``m = mode + C a``, ``L = C T``, ``C`` the Laplace factor): ``z`` (its mean error in exact sds),
    ``ratio`` (its sd over the exact sd) and ``kurt`` (the reported parameter's fourth central moment over sd^4 under
    it: 3, or the log-normal's), per reported parameter."""
    p = len(ref.names)
    base = torch.quasirandom.SobolEngine(p, scramble=True, seed=seed).draw(num, dtype=torch.float64)
    e = torch.distributions.Normal(0.0, 1.0).icdf(base.clamp(1e-12, 1 - 1e-12))
    e = torch.cat([e, -e])
    mode, chol = laplace(ref)
    a = torch.zeros(p, dtype=torch.float64, requires_grad=True)
    raw = torch.zeros(p, p, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [a, raw], lr=1.0, max_iter=5000, tolerance_grad=1e-10, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def factor():
        return chol @ (torch.tril(raw, -1) + torch.diag(torch.exp(torch.diagonal(raw))))

    def loss():
        opt.zero_grad()
        m, L = mode + chol @ a, factor()
        out = -(log_joint(ref, m + e @ L.T).mean() + torch.diagonal(raw).sum())
        out.backward()
        return out

    opt.step(loss)
    with torch.no_grad():
        mu, s = (mode + chol @ a).numpy(), torch.sqrt((factor() ** 2).sum(1)).numpy()
    pos = positive(ref)
    w = np.expm1(s**2)
    mean = np.where(pos, np.exp(mu + s**2 / 2), mu)
    sd = np.where(pos, mean * np.sqrt(w), s)
    kurt = np.where(pos, (w + 1) ** 4 + 2 * (w + 1) ** 3 + 3 * (w + 1) ** 2 - 3, 3.0)
    return dict(z=(mean - ref.mean) / ref.sd, ratio=sd / ref.sd, kurt=kurt)
