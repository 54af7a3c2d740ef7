"""SGLD and SG-HMC on a plain Pyro function (:mod:`bnn_pyro.infer.sg_metric`): whitened by the Hessian at the mode,
started at an over-dispersed draw from the Laplace approximation there.

Before, both ran in the raw coordinates at ``lr="auto"``'s step ``(2 - alpha) / (4 lambda_max)``: on a covariate near
100 (condition number ~1e5) the flat direction barely moved in 10,000 steps, and on the reference posteriors SGLD was
4.9e3 (kidiq) and 1.2e5 (logistic) posterior sds off, SG-HMC 174 / 3.5 / 4.9e3 on eight schools / kidiq / logistic
(``benchmarks/results/reference_suite/function_sgld_sghmc_before.md``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pyro.poutine as poutine
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference.posteriors import ReferencePosterior, biased_off, exact_off  # noqa: E402
from test_snapshot_function import _regression  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer.sg_metric import DISPERSION, Metric, dispersed_start  # noqa: E402

STATIONARY_WIDENING = math.sqrt(8.0 / 7.0)
"""The sd of the full-batch chain's stationary law over the posterior's, in every direction, at ``lr="auto"`` on a
Gaussian posterior whitened by its exact Hessian: the step is ``eta = (2 - alpha) / 4`` on a curvature of 1, and the
recursion's stationary covariance is ``(A (I - eta A / (2 (2 - alpha))))^{-1}`` = ``8/7 A^{-1}`` for SGLD and SG-HMC
alike (:mod:`bnn_pyro.infer.sgmcmc`)."""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sgld", "sghmc"])
def test_sgld_and_sghmc_at_their_defaults_on_a_badly_conditioned_pyro_function_match_the_exact_posterior(method):
    """The linear regression with an indicator and a covariate near 100 (fixed noise, Normal(0, 10) priors: conjugate,
    exact in closed form), fitted at the defaults (one chain, 500 draws). Two checks: (1) the reference suite's rule
    for SG-MCMC (:func:`reference.posteriors.biased_off`: each mean within 0.25 sd plus 4 Monte Carlo sds of its ESS,
    each sd within a factor 1.5 widened by the chi-square quantiles of its ESS); (2) sharper, the chain's own exact
    stationary law: the exact mean, and the sd times :data:`STATIONARY_WIDENING`, each within 4 Monte Carlo standard
    errors (ArviZ's ESS of the mean, its MCSE of the sd; a two-sided 6e-5 tail per comparison). Main's raw-coordinate
    chains sat hundreds of sds off in the flat direction."""
    model, x, y, mean, cov = _regression()
    names, sd = ["b0", "b1", "b2"], cov.diagonal().sqrt().numpy()
    ref = ReferencePosterior("regression", model, x, y, names, mean.numpy(), sd)
    post = bp.fit(model, x, y, method=method, seed=0, progress=False)
    assert post.num_chains == 1 and post.num_draws == 500  # the defaults
    assert biased_off(ref, post) == []
    law = ReferencePosterior("regression", model, x, y, names, mean.numpy(), sd * STATIONARY_WIDENING)
    assert exact_off(law, post) == []
    # lr="auto" measured the curvature in the whitened coordinates: 1 at the mode of a quadratic
    friction = 1.0 if method == "sgld" else 0.1
    assert abs(float(post.history["step_size"][0, 0]) - (2 - friction) / 4) < 1e-4


def test_the_start_is_a_draw_from_the_laplace_approximation_widened_twofold():
    """:func:`dispersed_start` over 4,000 seeds on a Hessian with condition number 1e4: whitened by ``L^T`` and divided
    by ``DISPERSION``, the starts are ``N(0, I)``: each coordinate's mean within 4 standard errors (``1 / sqrt(n)``)
    and variance within 4 of theirs (``sqrt(2 / n)``, normal approximation to the chi-square), the correlation within
    ``4 / sqrt(n)``. Deterministic in the seed (a resumed chain starts where the crashed one did)."""
    hess = torch.tensor([[1e4, 99.0], [99.0, 1.0]], dtype=torch.float64)
    chol = torch.linalg.cholesky(hess)
    metric = Metric(torch.tensor([100.0, -3.0], dtype=torch.float64), chol)
    like = torch.zeros(2)
    n = 4000
    starts = torch.stack([dispersed_start(metric, s, like=like) for s in range(n)]).double()
    assert starts.dtype == torch.float64 and dispersed_start(metric, 0, like=like).dtype == torch.float32
    u = ((starts - metric.mode) @ chol / DISPERSION).numpy()  # rows: L^T (start - mode) / DISPERSION
    assert np.all(np.abs(u.mean(0)) < 4 / math.sqrt(n)), u.mean(0)
    assert np.all(np.abs(u.var(0) - 1) < 4 * math.sqrt(2 / n)), u.var(0)
    assert abs(np.corrcoef(u.T)[0, 1]) < 4 / math.sqrt(n)
    assert torch.equal(dispersed_start(metric, 7, like=like), dispersed_start(metric, 7, like=like))


def test_chains_start_apart_at_their_own_dispersed_draws():
    """With several chains each starts at its own draw (seed ``seed + c``): their first potentials differ, and each is
    above the mode's by about ``DISPERSION^2 P / 2`` (a draw from ``N(mode, 4 H^{-1})`` on this Gaussian posterior:
    ``U - U_min = 2 chi^2_P``, P = 3, so between 0 and ~60 nats with overwhelming probability, where main's prior
    draws started 1e5-1e7 nats above it)."""
    model, x, y, mean, _ = _regression()
    post = bp.fit(model, x, y, method="sgld", num_chains=3, num_samples=5, thin=1, num_warmup=5, seed=0, progress=False)
    first = post.history["potential"][:, 0].double()
    assert len(set(first.tolist())) == 3
    # the minimum of U: at the exact posterior mean (the MAP of this conjugate model; beta is unconstrained)
    conditioned = poutine.condition(model, data={"beta": mean.float()})
    u_min = -float(poutine.trace(conditioned).get_trace(x, y).log_prob_sum())
    assert bool(((first - u_min) > 0).all() and ((first - u_min) < 60).all()), (first, u_min)


@pytest.mark.parametrize("method", ["sgld", "sghmc"])
def test_a_bnn_fit_never_builds_the_metric(method, monkeypatch):
    """The whitened path is for Pyro functions only: a ``bp.BNN`` sgld / sghmc fit never calls ``mode_metric`` and its
    optimizer runs without a metric (its draws are those of the code before the change)."""
    import bnn_pyro.infer.sgmcmc as sgmcmc

    torch.manual_seed(0)
    x = torch.randn(30, 2)
    y = x @ torch.tensor([1.0, -0.5]) + 0.1 * torch.randn(30)

    def refuse(*args, **kwargs):
        raise AssertionError("mode_metric called on a BNN")

    metrics = []
    original = sgmcmc.SGMCMC.__init__

    def spy(self, *args, **kwargs):
        metrics.append(kwargs.get("metric"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(sgmcmc, "mode_metric", refuse)
    monkeypatch.setattr(sgmcmc.SGMCMC, "__init__", spy)
    model = bp.BNN(
        torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)
    )
    post = bp.fit(model, x, y, method=method, num_samples=10, thin=2, num_chains=2, seed=0, progress=False)
    assert metrics == [None, None]
    assert post.num_draws == 10 and bool(torch.isfinite(post.samples["weight"]).all())


@pytest.mark.parametrize("method", ["sgld", "sghmc"])
def test_a_whitened_sgld_or_sghmc_run_resumes_bit_identically(crash_and_resume, method):
    """The mode, the metric and the dispersed start are recomputed (deterministically) when a run resumes; the
    checkpoint restores the position, momentum, step and noise generator: the resumed run's draws, statistics and
    traces equal an uninterrupted run's."""

    model, x, y, *_ = _regression()
    config = dict(method=method, num_samples=10, thin=2, num_warmup=20, num_chains=2, seed=3, progress=False)
    whole = bp.fit(model, x, y, **config)
    friction = 1.0 if method == "sgld" else 0.1
    assert abs(float(whole.history["step_size"][0, 0]) - (2 - friction) / 4) < 1e-3  # the whitened path ran
    crash_and_resume(lambda **extra: bp.fit(model, x, y, **extra, **config), whole, crash_at=25, every=5)


def test_an_explicit_init_starts_there_whitened():
    """``init=`` given (here ``"median"``, Pyro's median of 15 prior draws): the chains start there, not at a dispersed
    draw near the mode (``U`` 1e5 nats and more above its minimum against under 60), and the update is still whitened
    (the first step on ``U`` is ``(2 - alpha) / (4 lambda)`` with ``lambda`` the whitened curvature, 1 everywhere on
    this Gaussian posterior, where the raw curvature is ~1e6)."""
    model, x, y, mean, _ = _regression()
    post = bp.fit(
        model,
        x,
        y,
        method="sgld",
        init="median",
        num_samples=5,
        thin=1,
        num_warmup=5,
        num_chains=2,
        seed=0,
        progress=False,
    )
    conditioned = poutine.condition(model, data={"beta": mean.float()})
    u_min = -float(poutine.trace(conditioned).get_trace(x, y).log_prob_sum())
    assert bool((post.history["potential"][:, 0].double() - u_min > 1e4).all())
    assert abs(float(post.history["step_size"][0, 0]) - 0.25) < 1e-3


@pytest.mark.parametrize("method", ["sgld", "sghmc"])
def test_the_whitened_path_keeps_buffers_on_the_models_device(method):
    """The metric, the dispersed start (its generator and ``L^{-T} e``) and the whitened steps on a float64 Pyro
    function with a covariate near 40, under the fake device of ``test_devices.py``: no tensor made off the model's
    device or dtype meets it."""
    from test_devices import SETTINGS, _checked_fit, _data, _linear_function

    x, y = _data(torch.float64)
    post, _ = _checked_fit(_linear_function, x + 40.0, y, method, **SETTINGS[method])
    assert {v.dtype for v in post.samples.values()} == {torch.float64}
    assert abs(float(post.history["step_size"][0, 0]) * 4 / (2 - post.config["friction"]) - 1) < 0.2  # whitened


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("method", ["sgld", "sghmc"])
def test_the_whitened_path_runs_on_cuda(method):
    from test_devices import SETTINGS, _data, _linear_function

    x, y = _data(device="cuda")
    post = bp.fit(_linear_function, x + 40.0, y, method=method, seed=3, progress=False, **SETTINGS[method])
    assert {v.device.type for v in post.samples.values()} == {"cuda"}
    assert all(bool(torch.isfinite(v).all()) for v in post.samples.values())


def test_the_config_says_the_chains_ran_whitened_and_from_where():
    """``config["init"]`` names the resolved default; ``config["preconditioner"]`` and ``config["start"]`` say what ran:
    whitened by the Hessian at the mode, from a Laplace draw (sgld / sghmc) or the mode (snapshot). A ``BNN`` fit has
    neither key."""
    model, x, y, *_ = _regression()
    quick = dict(seed=0, progress=False)
    sgld = bp.fit(model, x, y, method="sgld", num_warmup=20, num_samples=10, **quick)
    snap = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=10, **quick)
    assert (sgld.config["preconditioner"], sgld.config["start"]) == ("hessian_at_mode", "laplace")
    assert (snap.config["preconditioner"], snap.config["start"]) == ("hessian_at_mode", "mode")
    net = bp.BNN(torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=1.0))
    plain = bp.fit(net, (x - x.mean(0)) / x.std(0), y, method="sgld", num_warmup=20, num_samples=10, **quick)
    assert "preconditioner" not in plain.config and "start" not in plain.config
