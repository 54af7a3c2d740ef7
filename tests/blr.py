"""Bayesian linear regression: the exact answer the engines are tested against.

A ``BNN`` made of one ``nn.Linear(d, 1)`` with a ``Normal(0, prior_scale)`` prior on the weight and
the bias and Gaussian noise of known scale ``s`` is Bayesian linear regression. With the design
``X1 = [X, 1]`` (weight columns first, then the bias) its posterior is Gaussian with

    precision  L = X1^T X1 / s^2 + I / prior_scale^2,   covariance  C = L^-1,   mean  m = C X1^T y / s^2.

The mean-field (KL(q || p)) optimum of a Gaussian posterior keeps the mean ``m`` and has variances
``1 / diag(L)``, which under-disperse ``diag(C)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import arviz as az
import torch

import bnn_pyro as bp


@dataclass
class BLR:
    x: torch.Tensor
    y: torch.Tensor
    noise: float
    prior_scale: float

    @property
    def design(self) -> torch.Tensor:
        return torch.cat([self.x, torch.ones(len(self.x), 1)], dim=1).double()

    @property
    def precision(self) -> torch.Tensor:
        X1 = self.design
        return X1.T @ X1 / self.noise**2 + torch.eye(X1.shape[1], dtype=torch.double) / self.prior_scale**2

    @property
    def cov(self) -> torch.Tensor:
        return torch.linalg.inv(self.precision)

    @property
    def mean(self) -> torch.Tensor:
        return self.cov @ self.design.T @ self.y.double() / self.noise**2

    def model(self) -> bp.BNN:
        net = torch.nn.Linear(self.x.shape[1], 1)
        return bp.BNN(
            net, prior=bp.priors.Normal(0.0, self.prior_scale), likelihood=bp.likelihoods.Gaussian(scale=self.noise)
        )


def make_blr(
    n: int = 20, d: int = 2, noise: float = 1.0, prior_scale: float = 1.0, seed: int = 0, correlation: float = 0.9
) -> BLR:
    """Data whose input columns have the given correlation, so that the posterior is correlated
    and the mean-field answer differs visibly from the exact one."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 1, generator=g)
    x = correlation * z + (1 - correlation**2) ** 0.5 * torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    y = x @ w + 0.3 + noise * torch.randn(n, generator=g)
    return BLR(x=x, y=y, noise=noise, prior_scale=prior_scale)


def flat_draws(samples: dict[str, torch.Tensor]) -> torch.Tensor:
    """Draws as a ``(chains * draws, d + 1)`` matrix in the design's order (weights, then bias)."""
    w, b = samples["weight"], samples["bias"]
    return torch.cat([w.reshape(-1, w.shape[-1]), b.reshape(-1, 1)], dim=1).double()


def exact_mean_field_loss(q, blr: BLR) -> tuple[float, torch.Tensor]:
    """Exact negative ELBO of a mean-field guide ``q`` (a set-up ``AutoNormal``) on Bayesian linear regression,
    and its gradient with respect to ``q``'s parameters (sorted by name, flattened): with ``q(w) = N(m, S^2)``
    the expected data term is ``sum_n log N(y_n | x_n m, s) - (x_n^2 S^2) / (2 s^2)``, the KL is Gaussian."""
    mw, sw = q._get_loc_and_scale("weight")
    mb, sb = q._get_loc_and_scale("bias")
    x, y, s, p = blr.x, blr.y, blr.noise, blr.prior_scale
    mean = x @ mw[0] + mb[0]
    var = (x**2) @ (sw[0] ** 2) + sb[0] ** 2
    data = (-0.5 * math.log(2 * math.pi * s**2) - ((y - mean) ** 2 + var) / (2 * s**2)).sum()
    m, sd = torch.cat([mw.reshape(-1), mb]), torch.cat([sw.reshape(-1), sb])
    kl = (math.log(p) - sd.log() + (sd**2 + m**2) / (2 * p**2) - 0.5).sum()
    neg_elbo = -(data - kl)
    params = [p for _, p in sorted(q.named_parameters())]
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(neg_elbo, params)])
    return neg_elbo.item(), grad.double()


def mcse_z_scores(w, mean, cov) -> dict[str, float]:
    """z = (estimate - exact) / MCSE for every mean coordinate and covariance entry of draws ``w`` shaped
    ``(chains, draws, dim)`` against the exact ``mean`` and ``cov`` (MCSE from ArviZ's ESS of each quantity)."""
    z = {}
    for i in range(len(mean)):
        ess = az.ess(w[..., i].numpy(), method="mean")
        z[f"mean[{i}]"] = float((w[..., i].mean() - mean[i]) / (cov[i, i].sqrt() / math.sqrt(ess)))
    centered = w - mean
    for i in range(len(mean)):
        for j in range(i, len(mean)):
            prod = centered[..., i] * centered[..., j]
            ess = az.ess(prod.numpy(), method="mean")
            sd = math.sqrt(cov[i, i] * cov[j, j] + cov[i, j] ** 2)
            z[f"cov[{i},{j}]"] = float((prod.mean() - cov[i, j]) / (sd / math.sqrt(ess)))
    return z


HMC_ACCEPTANCE_FIT = dict(
    blr=dict(n=200, d=5, noise=1.0, seed=0), fit=dict(method="hmc", num_samples=500, num_chains=1, progress=False)
)
"""The HMC fits of tests/infer/test_mcmc.py's mixing and acceptance tests and of benchmarks/hmc_acceptance_bias.py
(whose bias.csv is the acceptance test's reference): :func:`make_blr`'s arguments and ``bp.fit``'s besides the seed
(HMC at its defaults, one chain of 500 draws; the tests add ``fast_path``). One constant for both sides, so that
neither changes alone (review 24 finding 7)."""

ACCEPTANCE_CONFIG = (
    "kernel",
    "num_warmup",
    "target_accept",
    "num_leapfrog",
    "leapfrog_jitter",
    "dense_mass",
    "fast_path",
)
"""The keys of an HMC fit's ``post.config`` that its step and acceptance depend on: the benchmark records them beside
bias.csv (``bias_config.json``, with :data:`HMC_ACCEPTANCE_FIT` and the curve's draws), and the acceptance test
checks its own fits' against that record, so that a changed default (warm-up, leapfrog count or jitter, target) makes
the reference stale loudly, not silently."""


def hmc_acceptance_curve(blr: BLR, post, draws: int = 20_000, seed: int = 0):
    """``A(log h)``: the exact expected Metropolis acceptance of one HMC transition as ``post`` ran it (the library's
    ``hmc_transition``, ``post.config``'s ``num_leapfrog`` steps jittered by its ``leapfrog_jitter``) from the
    posterior at step ``h`` in the adapted metric of ``post`` (chain 0; an HMC fit of ``blr.model()`` on the fast
    path), which a chain run at ``h`` realizes on average. Estimated over ``draws`` exact posterior draws as independent
    chains (Monte Carlo se ~0.002 at 20,000), the same random numbers at every ``h`` (a smooth curve in ``h``)."""
    from bnn_pyro.infer._analytic_batched import leapfrog_from
    from bnn_pyro.infer._batched import hmc_transition

    num_steps, jitter = post.config["num_leapfrog"], post.config["leapfrog_jitter"]
    if num_steps is None:
        raise ValueError("post: an HMC fit with a fixed num_leapfrog (not trajectory_length) is what the curve models")
    d = blr.x.shape[1]
    layout = {"weight": list(range(d)), "bias": [d]}
    order = sum((layout[name] for name in sorted(post.samples)), [])  # the flat kernels' layout: sites by name
    precision = blr.precision[order][:, order]
    minv = post.history["inverse_mass_matrix"][0].double().expand(draws, -1)
    start = torch.randn(draws, d + 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    start = start @ torch.linalg.cholesky(torch.linalg.inv(precision)).T  # exact draws (centred: U depends on w - m)

    def potential(z):
        grad = z @ precision
        return 0.5 * torch.linalg.vecdot(z, grad), grad

    leapfrog, (u, g) = leapfrog_from(potential), potential(start)

    def curve(log_h: float) -> float:
        step = torch.full((draws,), math.exp(log_h), dtype=torch.float64)
        stats = hmc_transition(
            start, u, g, step, minv, leapfrog=leapfrog, generator=torch.Generator().manual_seed(seed + 1),
            num_steps=num_steps, jitter=jitter,
        )[3]  # fmt: skip
        return float(stats.accept_prob.mean())

    return curve
