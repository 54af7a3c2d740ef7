"""SWAG on a small plain Pyro function (:mod:`bnn_pyro.infer.swag_function`): whitened, randomized full-data steps from
the mode, checked against Bayesian linear regression's closed form.

The model: ``beta ~ N(0, I_3)``, ``y ~ N([x, 1] beta, 1)`` on ``tests/blr.py``'s correlated rows (``n = 500``, input
correlation 0.9), written as a Pyro function; its posterior is ``N(m, S)``, ``S^{-1} = L L^T`` (``BLR.precision``).
Every comparison is made in the whitened coordinates ``w = L^T (beta - m)``, where the exact law is ``N(0, I)``.

Where the collection's covariance is not ``I`` exactly: the weighted likelihood bootstrap's noise covariance is the
scores' empirical covariance ``C = n / (n + 1) sum_i (s_i - s_bar)(s_i - s_bar)^T + I`` (``s_i = x_i r_i``, ``r_i`` the
residuals at the mode; the anchor adds the prior's ``I``), so its stationary covariance is ``T = L^{-1} C L^{-T}``, the
posterior's to first order in ``1 / sqrt(n)`` (the sandwich form). ``T`` is computed from the data below, and the
tolerances add ``|T - I|`` to the Monte Carlo error, never more.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from blr import make_blr  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import swag  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

N = 500


def _model(x, y=None):
    beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    f = torch.cat([x, torch.ones(len(x), 1)], 1) @ beta
    with pyro.plate("data", len(x)):
        return pyro.sample("obs", dist.Normal(f, 1.0), obs=y)


@pytest.fixture(scope="module")
def blr():
    return make_blr(n=N, d=2, noise=1.0, prior_scale=1.0, seed=0, correlation=0.9)


def _whitened(blr, beta: torch.Tensor) -> torch.Tensor:
    return (beta.reshape(-1, 3).double() - blr.mean) @ torch.linalg.cholesky(blr.precision)


def _bootstrap_target(blr) -> torch.Tensor:
    """``T = L^{-1} C L^{-T}`` (module docstring): the collection's stationary covariance in whitened coordinates."""
    design, y = blr.design, blr.y.double()
    scores = design * (design @ blr.mean - y)[:, None]
    centred = scores - scores.mean(0)
    c = N / (N + 1) * centred.T @ centred + torch.eye(3, dtype=torch.float64)
    inv = torch.linalg.inv(torch.linalg.cholesky(blr.precision))
    return inv @ c @ inv.T


def test_swag_at_its_defaults_matches_the_closed_form_posterior(blr):
    """``bp.fit(..., method="swag")`` at its defaults: 5 chains of 180 collected iterates, each chain's Gaussian
    ``(diag + D^T D / (K - 1)) / 2`` (``K = 20``), 1,000 draws each.

    Monte Carlo error (whitened, per coordinate, iterates ~ iid ``N(0, 1)`` at ``lr = 1``): the pooled mean's sd is
    ``sqrt(1 / 900 + 1 / 5000) = 0.036``; a chain's variance estimate has variance ``(2 / 180 + 2 / 19) / 4`` (the
    diagonal half from 180 iterates, the low-rank half from 19 degrees of freedom), so the pooled variance's sd is
    ``sqrt(0.029 / 5 + 2 / 5000) = 0.079``; an off-diagonal (low-rank half only) ``sqrt(1 / 19 / 4 / 5 + 1 / 5000) =
    0.053``. Tolerance: 4 of those plus ``|T - I|`` (0.13 at most here; seeds 0-7 came within 2.4 sds of it; with
    the earlier 3 chains and their wider sds, within 2.8). Before (SGD at the mode on 128-row
    minibatches, unwhitened) the whitened variances were ~1e-4 and ``check_narrow`` warned "too narrow"; now nothing
    is said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(_model, blr.x, blr.y, method="swag", seed=0, progress=False)
    assert post.config["collection"]["lr"] == 1.0 and post.config["momentum"] == 0.0
    assert post.config["validation"]["rows"] == 0 and post.config["pretrain_steps"] == 0
    w = _whitened(blr, post.samples["beta"])
    excess = (_bootstrap_target(blr) - torch.eye(3, dtype=torch.float64)).abs()
    assert w.mean(0).abs().max() < 4 * 0.036, w.mean(0)
    cov = torch.cov(w.T)
    eye = torch.eye(3, dtype=torch.float64)
    sd = torch.where(eye.bool(), torch.full_like(eye, 0.079), torch.full_like(eye, 0.053))
    assert ((cov - eye).abs() < 4 * sd + excess).all(), cov
    said = [str(m.message) for m in caught if issubclass(m.category, DiagnosticWarning)]
    assert not said, said


def _autocorrelation_time(momentum: float, *, squared: bool) -> float:
    """``1 + 2 sum_k rho_k`` (``rho_k^2`` for a variance's estimate: Gaussian iterates) of the whitened recursion on a
    quadratic at ``lr = 1 - momentum^2``: ``u' = (1 + momentum - lr) u - momentum u_prev - lr xi``, an AR(2) whose
    autocorrelations follow ``rho_1 = phi_1 / (1 - phi_2)``, ``rho_k = phi_1 rho_{k-1} + phi_2 rho_{k-2}``."""
    phi1, phi2 = 1 + momentum - (1 - momentum**2), -momentum
    rho = [1.0, phi1 / (1 - phi2)]
    for _ in range(200):
        rho.append(phi1 * rho[-1] + phi2 * rho[-2])
    return 1 + 2 * sum(r**2 if squared else r for r in rho[1:])


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_the_collection_rate_gives_the_iterates_the_bootstrap_covariance(blr, momentum):
    """The rule ``lr = 1 - momentum^2`` (the discrete-time heavy-ball recursion's stationary variance equals 1 along
    every whitened direction; the continuous-time ``lr = 2`` of Mandt et al. would diverge, half of it would give
    1/3, and ``lr = 1`` at momentum 0.5 would give 1.5): the collected iterates' moments (whitened by the Hessian at
    the mode, which is ``L`` here) over 3,600 snapshots equal ``T``'s diagonal and 0 within 4 Monte Carlo sds,
    ``sqrt(2 tau_2 T_jj^2 / 3600)`` and ``sqrt(tau T_jj / 3600)`` (``tau``, ``tau_2``: :func:`_autocorrelation_time`;
    1 and 1 without momentum, 1 and 1.89 at 0.5: the mean's ``tau`` is 1 at this rate for any momentum, since the
    recursion's ``1 - phi_1 - phi_2`` is ``lr``)."""
    data = bp.infer.Data(x=blr.x, y=blr.y)
    cfg = swag.SWAGConfig(num_chains=1, num_steps=4000, momentum=momentum, progress=False, seed=1)
    post, (moments,) = swag._run(_model, data, cfg)
    assert post.config["collection"]["lr"] == pytest.approx(1 - momentum**2)
    assert moments.count == 3600
    target = _bootstrap_target(blr).diagonal()
    tau, tau2 = _autocorrelation_time(momentum, squared=False), _autocorrelation_time(momentum, squared=True)
    assert ((moments.variance - target).abs() < 4 * (2 * tau2 / 3600) ** 0.5 * target).all(), (moments.variance, target)
    assert (moments.mean.abs() < 4 * (tau * target / 3600).sqrt()).all(), moments.mean


def test_eight_schools_keeps_the_plain_collection_and_says_why():
    """The non-centered eight schools' Laplace approximation has PSIS ``k_hat`` 1.03 (``tau``'s mode is not where its
    mass is): unit whitened steps left the mode's region within 8 steps (the loss became inf), so the rule is not
    taken there, as the MCMC engines' mode start is not, and ``config["collection"]`` says why."""
    from reference.posteriors import ALL

    ref = ALL["eight_schools"]()
    with pytest.warns(DiagnosticWarning, match="too narrow"):  # the plain collection's warning is kept
        post = bp.fit(
            ref.model,
            ref.x,
            ref.y,
            method="swag",
            seed=0,
            progress=False,
            pretrain_steps=20,
            num_steps=40,
            num_chains=1,
        )
    record = post.config["collection"]
    assert record["k_hat"] > 0.7 and "k_hat" in record["skipped"], record
    assert post.config["momentum"] == 0.9 and post.config["lr"] == "auto"


def test_a_bnn_swag_fit_takes_no_function_collection(tiny_bnn_fit, monkeypatch):
    """A ``bp.BNN`` is never offered the collection: bit-identical with :func:`function_collection` stubbed out,
    momentum still 0.9 and no ``config["collection"]``."""

    def fit():
        return tiny_bnn_fit("swag", pretrain_steps=50, num_steps=50)

    with_paths = fit()
    monkeypatch.setattr(swag, "function_collection", lambda *args, **kwargs: (None, None))
    without = fit()
    assert with_paths.config["momentum"] == 0.9 and "collection" not in with_paths.config
    for name, value in with_paths.samples.items():
        assert torch.equal(value, without.samples[name]), name


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # 54 iterates per chain
def test_a_function_swag_run_resumes_bit_identically(blr, crash_and_resume):
    """The collection's weights and anchors are drawn under seeds from the chain's generator, which a checkpoint
    restores; the metric is recomputed (seeded) on resume."""

    def fit(**extra):
        return bp.fit(_model, blr.x, blr.y, method="swag", seed=0, progress=False, num_steps=60, num_chains=2, **extra)

    crash_and_resume(fit, fit(), crash_at=30, every=10)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # SWA's one point
def test_a_number_lr_keeps_the_plain_collection(blr):
    post = bp.fit(_model, blr.x, blr.y, method="swa", seed=0, progress=False, lr=1e-3, pretrain_steps=20, num_steps=20)
    assert "lr=" in post.config["collection"]["skipped"] and post.config["momentum"] == 0.9


def test_a_given_init_keeps_the_plain_collection_from_that_start(blr):
    """The whitened collection starts at the mode: with ``init=`` given it is skipped (as MCMC skips its Laplace
    start), so the user's start and pre-training run as asked and the record says so (they were overridden)."""
    start = {"beta": torch.full((3,), 5.0)}
    post = bp.fit(
        _model, blr.x, blr.y, method="swa", seed=0, progress=False, init=start, pretrain_steps=7, num_steps=20
    )
    assert "init=" in post.config["collection"]["skipped"]
    assert post.config["pretrain_steps"] == 7 and post.config["momentum"] == 0.9
