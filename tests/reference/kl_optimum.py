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


def _base(p: int, num: int, seed: int) -> torch.Tensor:
    """``2 num`` standard normal points in ``p`` dimensions: scrambled Sobol, with antithetic pairs."""
    base = torch.quasirandom.SobolEngine(p, scramble=True, seed=seed).draw(num, dtype=torch.float64)
    e = torch.distributions.Normal(0.0, 1.0).icdf(base.clamp(1e-12, 1 - 1e-12))
    return torch.cat([e, -e])


def _maximize(params, objective) -> None:
    opt = torch.optim.LBFGS(
        params, lr=1.0, max_iter=5000, tolerance_grad=1e-10, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def loss():
        opt.zero_grad()
        out = -objective()
        out.backward()
        return out

    opt.step(loss)


def kl_optimum(ref: ReferencePosterior, *, family: str = "full_rank", num: int = 2**13, seed: int = 0) -> dict:
    """The KL-optimal Gaussian of a guide family (module docstring) in the unconstrained coordinates: ``"full_rank"``
    (any covariance; searched in the Laplace approximation's whitened coordinates, ``m = mode + C a``, ``L = C T``),
    ``"mean_field"`` (diagonal) or ``"low_rank"`` (``diag(d^2) + W W'``, ``W`` of Pyro's default rank
    ``round(sqrt(P))``; both searched in coordinates scaled by the Laplace sds, which keeps either family). Returns
    ``z`` (its mean error in exact sds), ``ratio`` (its sd over the exact sd) and ``kurt`` (the reported parameter's
    fourth central moment over sd^4 under it: 3, or the log-normal's), per reported parameter."""
    p = len(ref.names)
    mode, chol = laplace(ref)
    if family == "full_rank":
        e = _base(p, num, seed)
        a = torch.zeros(p, dtype=torch.float64, requires_grad=True)
        raw = torch.zeros(p, p, dtype=torch.float64, requires_grad=True)

        def factor():
            return chol @ (torch.tril(raw, -1) + torch.diag(torch.exp(torch.diagonal(raw))))

        _maximize([a, raw], lambda: log_joint(ref, mode + chol @ a + e @ factor().T).mean() + torch.diagonal(raw).sum())
        with torch.no_grad():
            mu, s = (mode + chol @ a).numpy(), torch.sqrt((factor() ** 2).sum(1)).numpy()
    elif family in ("mean_field", "low_rank"):
        k = round(math.sqrt(p)) if family == "low_rank" else 0
        e = _base(p + k, num, seed)
        scale = torch.sqrt((chol**2).sum(1))
        a = torch.zeros(p, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(p, dtype=torch.float64, requires_grad=True)
        w = (
            0.1 * torch.randn(p, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        ).requires_grad_()

        def entropy():  # log det of diag(d^2) + W W', up to a constant: the matrix determinant lemma
            d2 = torch.exp(2 * b)
            inner = torch.eye(k, dtype=torch.float64) + (w / d2[:, None]).T @ w
            return 0.5 * (2 * b.sum() + torch.logdet(inner))

        def objective():
            z = mode + scale * (a + torch.exp(b) * e[:, :p] + e[:, p:] @ w.T)
            return log_joint(ref, z).mean() + entropy()

        _maximize([a, b, w], objective)
        with torch.no_grad():
            mu = (mode + scale * a).numpy()
            s = (scale * torch.sqrt(torch.exp(2 * b) + (w**2).sum(1))).numpy()
    else:
        raise ValueError(f"family: expected 'full_rank', 'mean_field' or 'low_rank', got {family!r}")
    return reported(ref, mu, s)


def reported(ref: ReferencePosterior, mu: np.ndarray, s: np.ndarray) -> dict:
    """The reported parameters' moments under independent-per-coordinate marginals ``N(mu, s^2)`` in the
    unconstrained coordinates, against the exact ones: ``z`` (mean error in exact sds), ``ratio`` (sd over the exact
    sd) and ``kurt`` (fourth central moment over sd^4: 3, or the log-normal's ``e^{4s^2} + 2 e^{3s^2} + 3 e^{2s^2} - 3``
    for a positive parameter, whose mean and sd are ``e^{mu + s^2/2}`` and that times ``sqrt(e^{s^2} - 1)``)."""
    pos = positive(ref)
    v = np.expm1(s**2)
    mean = np.where(pos, np.exp(mu + s**2 / 2), mu)
    sd = np.where(pos, mean * np.sqrt(v), s)
    kurt = np.where(pos, (v + 1) ** 4 + 2 * (v + 1) ** 3 + 3 * (v + 1) ** 2 - 3, 3.0)
    return dict(z=(mean - ref.mean) / ref.sd, ratio=sd / ref.sd, kurt=kurt)


def laplace_moments(ref: ReferencePosterior, *, mean_field: bool = False) -> dict:
    """:func:`reported` for the Laplace approximation at the exact mode of :func:`log_joint` (the inverse Hessian's
    diagonal; ``mean_field``: ``1 / diag(H)``, what a mean-field guide started from it holds)."""
    mode, chol = laplace(ref)
    if mean_field:
        precision = torch.cholesky_inverse(chol)
        s = 1 / torch.sqrt(torch.diagonal(precision))
    else:
        s = torch.sqrt((chol**2).sum(1))
    return reported(ref, mode.numpy(), s.numpy())
