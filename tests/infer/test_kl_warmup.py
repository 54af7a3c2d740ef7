"""KL annealing (``kl_warmup=``): the weighted ELBO it optimizes, its schedule, its errors, and that after the
warm-up the fit still lands on the exact mean-field optimum of Bayesian linear regression (same tolerances and
settings as tests/infer/test_svi.py's exact mean-field test, whose docstring derives them)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from blr import flat_draws, make_blr  # tests/ is on sys.path (conftest.py's folder)
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import bnn_pyro as bp
from bnn_pyro.infer import _svi_flat
from bnn_pyro.infer.kl_warmup import KLWeight, warmup_steps

MEAN_TOL, SD_TOL = 0.12, 0.08  # tests/infer/test_svi.py's (4x the seed scatter of such a fit)
SHORT = dict(
    num_steps=30,
    num_samples=6,
    seed=2,
    progress=False,
    kl_warmup=0.5,
    optimizer=lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True),  # Pyro's path's Adam, not fused
)


@pytest.fixture(scope="module")
def blr():
    return make_blr()


def test_schedule_rises_linearly_to_one_and_stays():
    weight = KLWeight(warmup_steps(0.25, 400))
    assert weight.warmup_steps == 100
    assert [weight.at(s) for s in (0, 49, 99, 100, 399)] == [0.01, 0.5, 1.0, 1.0, 1.0]
    assert KLWeight(0).at(0) == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2, "0.2", True, None])
def test_bad_kl_warmup_is_explained(blr, bad):
    with pytest.raises(ValueError, match=r"kl_warmup: expected the fraction of num_steps .* in \[0, 1\)"):
        bp.fit(blr.model(), blr.x, blr.y, kl_warmup=bad, num_steps=2, progress=False)


def test_weighted_elbo_is_likelihood_plus_beta_times_the_kl_estimate(blr):
    """For one fixed draw (same seed): loss(beta) = -log p(y | w) + beta * (log q(w) - log p(w)), with
    -log p(y | w) read from the model's trace at the guide's draw and the KL estimate the plain ELBO's rest."""
    model = blr.model()
    guide = AutoNormal(model, init_scale=0.3)
    n = len(blr.x)
    with pyro.get_param_store().scope():
        guide(blr.x, blr.y)
        pyro.set_rng_seed(5)
        plain = Trace_ELBO().loss(model, guide, blr.x, blr.y, dataset_size=n)
        pyro.set_rng_seed(5)
        guide_trace = poutine.trace(guide).get_trace(blr.x, blr.y, dataset_size=n)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(blr.x, blr.y, dataset_size=n)
        model_trace.compute_log_prob()
        observed = [k for k, s in model_trace.nodes.items() if s["type"] == "sample" and s["is_observed"]]
        nll = -sum(float(model_trace.nodes[k]["log_prob_sum"].detach()) for k in observed)
        kl = plain - nll
        assert abs(kl) > 1.0  # the weighting is visible
        for step, beta in [(4, 0.5), (1, 0.2), (9, 1.0)]:
            weight = KLWeight(10)
            weight.at(step)
            pyro.set_rng_seed(5)
            loss = Trace_ELBO().loss(weight(model), weight(guide), blr.x, blr.y, dataset_size=n)
            assert weight.beta == pytest.approx(beta)
            assert loss == pytest.approx(nll + beta * kl, rel=1e-5)


@pytest.mark.slow  # ~5-10 s: 1,000 steps of 8 vectorized particles
def test_after_the_warmup_the_fit_reaches_the_exact_mean_field_optimum(blr):
    post = bp.fit(
        blr.model(),
        blr.x,
        blr.y,
        kl_warmup=0.3,
        num_steps=1000,
        lr=0.02,
        num_particles=8,
        num_samples=4000,
        seed=0,
        progress=False,
    )
    assert post.config["kl_warmup"] == 0.3 and post.config["fast_path"] is True
    d = flat_draws(post.samples)
    mf_sd = blr.precision.diag().rsqrt()  # the KL(q || p) optimum's sds
    assert ((d.mean(0) - blr.mean).abs() / blr.cov.diag().sqrt()).max() < MEAN_TOL
    assert ((d.std(0) / mf_sd) - 1).abs().max() < SD_TOL


@pytest.mark.parametrize("options", [dict(), dict(num_particles=3, batch_size=16)])
def test_the_flat_path_weighs_the_kl_as_pyros_path_does(options, monkeypatch):
    """The same draws on both paths (a learned noise included, whose prior and Jacobian are weighted too): the
    losses and draws agree within float32 rounding, as tests/infer/test_svi_flat.py holds for the unweighted ELBO."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 2, generator=g) * 4 - 2
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(40, generator=g)

    def fit(**more):
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model = bp.BNN(
            net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the convergence diagnostics of a short run
            return bp.fit(model, x, y, **{**SHORT, **options, **more})

    steps, original = [], _svi_flat.FlatMeanField.step
    monkeypatch.setattr(_svi_flat.FlatMeanField, "step", lambda self, x, y: steps.append(1) or original(self, x, y))
    flat = fit()
    assert len(steps) == 30 and flat.config["fast_path"] is True  # the flat path ran every step
    pyro_path = fit(fast_path=False)
    assert len(steps) == 30 and pyro_path.config["fast_path"] is False
    torch.testing.assert_close(flat.history["loss"], pyro_path.history["loss"], rtol=1e-5, atol=0)
    for name in flat.samples:
        torch.testing.assert_close(flat.samples[name], pyro_path.samples[name], rtol=1e-5, atol=1e-6)
    plain = fit(kl_warmup=0.0)  # the weight is visible: the same draws give other losses during the warm-up
    assert (plain.history["loss"] - flat.history["loss"]).abs().max() > 1e-3 * flat.history["loss"].abs().max()
