"""Snapshot ensembles on a plain Pyro function (:mod:`bnn_pyro.infer.sg_metric`): whitened cycles from the mode.

Before, the cycles ran in the raw coordinates at ``lr="auto"``'s peak step ``(2 - alpha) / (2 lambda_max)``, which
on a covariate near 100 (condition number ~1e5) takes ~kappa steps per e-fold along the flat direction: the snapshots
were 1,778 posterior sds off on the logistic reference and 748 on kidiq
(``benchmarks/results/reference_suite/function_snapshot_before.md``). Now a Pyro function's cycles start at its mode
and are preconditioned by the Hessian there (``M = H^{-1}``), so every direction's curvature is about 1."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference.posteriors import ReferencePosterior, biased_off  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer.anchor import bootstrap_sites, bootstrap_weights  # noqa: E402
from bnn_pyro.infer.sgmcmc_step import SGMCMC, Plan, largest_curvature  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

PRIOR_SD, NOISE, ROWS, CYCLES = 10.0, 1.0, 60, 5


def _regression():
    """``y = b0 + b1 x1 + b2 x2 + N(0, 1)`` with an indicator and a covariate near 100 (sd 15), as kidiq's; fixed
    noise and Normal(0, 10) priors: a conjugate posterior, exact in closed form."""
    g = torch.Generator().manual_seed(3)
    x = torch.stack([(torch.rand(ROWS, generator=g) < 0.6).float(), 100 + 15 * torch.randn(ROWS, generator=g)], 1)
    y = 20 + 5 * x[:, 0] + 0.6 * x[:, 1] + NOISE * torch.randn(ROWS, generator=g)

    def model(x, y=None):
        beta = pyro.sample("beta", dist.Normal(0.0, PRIOR_SD).expand([3]).to_event(1))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(beta[0] + x @ beta[1:], NOISE), obs=y)

    design = torch.cat([torch.ones(ROWS, 1), x], 1).double()
    precision = torch.eye(3, dtype=torch.float64) / PRIOR_SD**2 + design.T @ design / NOISE**2
    cov = torch.linalg.inv(precision)
    mean = cov @ design.T @ y.double() / NOISE**2
    return model, x, y, mean, cov


def test_snapshot_at_its_defaults_on_a_badly_conditioned_pyro_function_matches_the_exact_mean():
    """The mean of the 5 snapshots against the exact posterior mean, in posterior sds. Each snapshot is the mode of
    the potential tilted toward its own prior draw and with its observations weighted by its own bootstrap draw
    (anchored, weighted cycles: :mod:`bnn_pyro.infer.snapshot`, "Pyro functions"), whose covariance is the posterior's
    to first order, ``S (X^T diag(r^2) X / sigma^4 + I / s^2) S`` (residuals ``r`` at the posterior mean), so their mean
    scatters about the exact mean with a fifth of it: allowed 4 of its sds (a two-sided 6e-5 tail) plus 0.01 posterior
    sd for float32 and the cycle's finite end. Main's raw-coordinate cycles missed by hundreds of sds. No warning: the
    snapshots are not too narrow (the anchored-only cycles' were, ``A^-1 Lambda_0 A^-1``, and warned so)."""
    model, x, y, mean, cov = _regression()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="snapshot", seed=0, progress=False)
    assert not [w for w in caught if issubclass(w.category, DiagnosticWarning)], [str(w.message) for w in caught]
    assert post.num_draws == CYCLES
    draws = post.samples["beta"][0].double()
    sd = cov.diagonal().sqrt()
    z = (draws.mean(0) - mean) / sd
    design = torch.cat([torch.ones(ROWS, 1), x], 1).double()
    r = y.double() - design @ mean
    eye = torch.eye(3, dtype=torch.float64)
    first_order = cov @ (design.T @ (r[:, None] ** 2 * design) / NOISE**4 + eye / PRIOR_SD**2) @ cov
    mc = (first_order.diagonal() / CYCLES).sqrt() / sd
    assert bool((z.abs() <= 4 * mc + 0.01).all()), (z, mc)
    assert post.config["init"] == "prior"
    assert post.config["observation_weights"]["sites"] == {"obs": f"[{ROWS}]"}


def test_a_bnn_snapshot_takes_none_of_the_function_paths(tiny_bnn_fit, monkeypatch):
    """The whitened cycles are for Pyro functions only: a ``bp.BNN`` snapshot fit never builds the metric, and its
    draws are those of a fit whose plan has none (the code before it)."""
    import bnn_pyro.infer.sgmcmc as sgmcmc

    def refuse(*args, **kwargs):
        raise AssertionError("mode_metric called on a BNN")

    monkeypatch.setattr(sgmcmc, "mode_metric", refuse)
    post = tiny_bnn_fit("snapshot", num_cycles=2, cycle_length=50)
    assert post.num_draws == 2 and bool(torch.isfinite(post.samples["weight"]).all())


def test_whitened_steps_reach_the_minimum_of_a_badly_conditioned_quadratic():
    """``U = (z - m)^T H (z - m) / 2`` with condition number 1e5: with ``metric = chol(H)`` the curvature in the
    whitened coordinates is 1 (power iteration), and one noise-free cosine cycle of 1,000 steps (the default) at the auto step ends
    at ``m`` to 1e-6 in every coordinate; without the metric the flat direction has barely moved."""
    from bnn_pyro.infer.sgmcmc_step import cosine_cycle

    hess = torch.diag(torch.tensor([1e5, 1.0], dtype=torch.float64))
    rot = torch.tensor([[0.8, -0.6], [0.6, 0.8]], dtype=torch.float64)
    hess, m = rot @ hess @ rot.T, torch.tensor([3.0, -2.0], dtype=torch.float64)

    class Quadratic:
        def __call__(self, z, batch):
            d = z["z"] - m
            return d @ hess @ d / 2

        def unflatten(self, z):
            return {"z": z}

    pot, chol = Quadratic(), torch.linalg.cholesky(hess)
    lam, _ = largest_curvature(
        pot, torch.zeros(2, dtype=torch.float64), None, torch.ones(2, dtype=torch.float64), 30, chol
    )
    assert abs(lam - 1.0) < 1e-6

    def run(metric):
        plan = Plan(
            scale=cosine_cycle(1000),
            noisy=torch.zeros(1000, dtype=torch.bool),
            keep=torch.zeros(1000, dtype=torch.bool),
            adapt=torch.arange(1000) == 0,
            friction=0.1,
            fraction=0.95,
        )
        z = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        curvature = lambda at, start, iters: largest_curvature(pot, at, None, start, iters, metric)  # noqa: E731
        opt = SGMCMC([z], plan=plan, lr=None, seed=0, curvature=curvature, metric=metric)
        for _ in range(1000):
            opt.adapt()
            opt.zero_grad()
            pot({"z": z}, None).backward()
            opt.step()
        return z.detach()

    assert bool(((run(chol) - m).abs() < 1e-6).all()), run(chol)
    assert float((run(None) - m).abs().max()) > 0.5


@pytest.mark.slow
def test_csgmcmc_at_its_defaults_on_a_badly_conditioned_pyro_function_matches_the_exact_posterior():
    """cSG-HMC with the whitened cycles (``M = H^{-1}``, noise ``N(0, 2 alpha eta M)``): its 200 draws against the exact
    Gaussian posterior by the SG-MCMC rule of the reference suite (:func:`reference.posteriors.biased_off`: a mean
    within 0.25 sd plus 4 Monte Carlo sds of its ESS, an sd within a factor 1.5 widened by the chi-square quantiles of
    its ESS). Main's raw-coordinate cycles left the flat direction unexplored (2,451 sds off on the logistic
    reference)."""
    model, x, y, mean, cov = _regression()
    ref = ReferencePosterior("regression", model, x, y, ["b0", "b1", "b2"], mean.numpy(), cov.diagonal().sqrt().numpy())
    post = bp.fit(model, x, y, method="csgmcmc", seed=0, progress=False)
    assert biased_off(ref, post) == []


def test_a_whitened_run_resumes_bit_identically(crash_and_resume):
    """The metric and the mode are recomputed (deterministically) when a run resumes; the checkpoint restores the
    position, momentum and step: the resumed run's draws and traces equal an uninterrupted run's."""

    model, x, y, _, cov = _regression()
    config = dict(method="snapshot", num_cycles=2, cycle_length=15, seed=3, progress=False)
    whole = bp.fit(model, x, y, **config)
    # the whitened path: at the mode the curvature in u = L^T z of the first cycle's weighted potential is the largest
    # eigenvalue of A^-1 H_v (A the posterior precision, H_v = X^T V X / sigma^2 + I / s^2), and the first step is
    # (2 - alpha) / 2 over it (the unweighted potential's curvature there is 1: the step was 0.95)
    design = torch.cat([torch.ones(ROWS, 1), x], 1).double()
    v = bootstrap_weights(bootstrap_sites(model, x, y), seed=3, like=design)["obs"]
    weighted = design.T @ (v[:, None] * design) / NOISE**2 + torch.eye(3, dtype=torch.float64) / PRIOR_SD**2
    lam = float(torch.linalg.eigvals(torch.linalg.solve(torch.linalg.inv(cov), weighted)).real.max())
    assert abs(float(whole.history["step_size"][0, 0]) - 0.95 / lam) < 1e-3, lam
    assert "scheme" in whole.config["observation_weights"]
    crash_and_resume(lambda **extra: bp.fit(model, x, y, **extra, **config), whole, crash_at=25, every=5)
