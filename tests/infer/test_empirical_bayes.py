"""Empirical Bayes for SVI (``empirical_bayes=``) against exact type-II maximum likelihood.

Known answer. Bayesian linear regression (tests/blr.py: 20 points, 2 correlated inputs and a bias,
noise 1) with one prior scale ``sigma`` shared by the weights and the bias has the exact evidence
``y ~ N(0, sigma^2 X1 X1^T + s^2 I)``; a grid of 8,001 points over ``log sigma`` in [-4, 4] (spacing
0.001) finds its maximum, ``sigma* = 0.2292``. A full-rank guide contains the exact posterior, so
``max_q ELBO(q, sigma) = log p(y | sigma)`` and SVI must land on ``sigma*``. A mean-field guide
maximizes ``log p(y | sigma) - KL(q*_MF || posterior)``, whose gap is closed form for a Gaussian
posterior with precision ``L``: ``0.5 * (sum_j log L_jj - log det L)``; its maximum is
``sigma*_MF = 0.1752``, a different answer 0.27 away in ``log sigma``.

Tolerance. Fits: 1,000 Adam steps from 0.05 with a cosine schedule, 8 particles. Refitting with
seeds 0-3 put ``log(sigma / sigma*)`` at 0.004, 0.006, 0.023, 0.013 for the full-rank guide (root
mean square 0.014) and 0.023, 0.034, 0.029, 0.018 for the mean-field guide against ``sigma*_MF``
(RMS 0.027): the stochastic optimizer's end point. The tolerances are four times those: 0.055 and
0.11 on ``log sigma``, both well short of the 0.27 that separates the two answers (each test also
checks that it would reject the other guide's answer).

Threads: these models are tiny, so the tests run single-threaded (restored afterwards).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from blr import make_blr
from pyro import poutine

import bnn_pyro as bp
from bnn_pyro.infer.empirical_bayes import LearnedPriorScales, Sharing

FIT = dict(
    empirical_bayes="shared",
    num_steps=1000,
    lr=0.05,
    lr_schedule="cosine",
    num_particles=8,
    num_samples=10,
    seed=0,
    progress=False,
)
FULL_RANK_TOL, MEAN_FIELD_TOL = 0.055, 0.11


def _optima(blr) -> tuple[float, float]:
    """``argmax`` over ``sigma`` of the exact log evidence, and of the mean-field ELBO's maximum."""
    x1, y, n, k = blr.design, blr.y.double(), len(blr.y), blr.design.shape[1]
    log_sigma = torch.linspace(-4, 4, 8001, dtype=torch.double)
    var = torch.exp(2 * log_sigma)
    cov = var[:, None, None] * (x1 @ x1.T) + blr.noise**2 * torch.eye(n, dtype=torch.double)
    evidence = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.double), cov).log_prob(y)
    precision = x1.T @ x1 / blr.noise**2 + (1 / var)[:, None, None] * torch.eye(k, dtype=torch.double)
    gap = 0.5 * (precision.diagonal(dim1=-2, dim2=-1).log().sum(-1) - torch.logdet(precision))
    return math.exp(log_sigma[evidence.argmax()]), math.exp(log_sigma[(evidence - gap).argmax()])


@pytest.fixture(scope="module")
def blr():
    return make_blr()


@pytest.mark.slow  # ~25 s: 1,000 steps
def test_full_rank_guide_finds_the_type_ii_maximum_likelihood_scale(blr):
    exact, mean_field = _optima(blr)
    assert exact == pytest.approx(0.2292, abs=1e-4) and mean_field == pytest.approx(0.1752, abs=1e-4)
    post = bp.fit(blr.model(), blr.x, blr.y, guide="full_rank", **FIT)
    learned = post.config["prior_scales"]
    assert learned["weight"] == learned["bias"]  # one shared scale
    error = math.log(learned["weight"][0] / exact)
    assert abs(error) < FULL_RANK_TOL, error
    assert abs(math.log(learned["weight"][0] / mean_field)) > FULL_RANK_TOL  # the test tells the two apart


@pytest.mark.slow  # ~25 s: 1,000 steps
def test_mean_field_guide_finds_its_own_known_optimum(blr):
    exact, mean_field = _optima(blr)
    post = bp.fit(blr.model(), blr.x, blr.y, guide="mean_field", **FIT)
    learned = post.config["prior_scales"]["weight"][0]
    assert abs(math.log(learned / mean_field)) < MEAN_FIELD_TOL
    assert abs(math.log(learned / exact)) > MEAN_FIELD_TOL


def test_handler_rescales_each_prior_and_keeps_layerwise_ratios():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model = bp.BNN(net, prior=bp.priors.LayerwiseNormal("radford"), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    x, y = torch.randn(5, 4), torch.randn(5)
    for sharing in Sharing:
        handler = LearnedPriorScales(model, x, y, 5, sharing)
        assert handler.base_scales == pytest.approx(
            {"0.weight": 0.5, "0.bias": 0.5, "2.weight": 3**-0.5, "2.bias": 3**-0.5}
        )
        with pyro.get_param_store().scope():
            if sharing is Sharing.SHARED:
                pyro.param("prior_scale", torch.tensor(3.0))
            else:
                for site in handler.base_scales:
                    pyro.param(handler.param_name(site), torch.tensor(2.0 if site.startswith("0.") else 0.5))
            trace = poutine.trace(handler(model)).get_trace(x, y)
            scales = handler.scales()
        for site, s0 in handler.base_scales.items():
            c = 3.0 if sharing is Sharing.SHARED else (2.0 if site.startswith("0.") else 0.5)
            assert torch.allclose(trace.nodes[site]["fn"].base_dist.scale, torch.tensor(c * s0))
            assert scales[site] == pytest.approx(c * s0)


def test_per_tensor_scales_end_to_end(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 2, generator=g)
    y = 0.2 * x[:, 0] + 0.1 * torch.randn(50, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    post = bp.fit(
        model,
        x,
        y,
        empirical_bayes=True,
        estimator="flipout",
        num_steps=60,
        lr=0.05,
        num_chains=2,
        num_samples=20,
        progress=False,
    )
    scales = post.config["prior_scales"]
    assert post.config["empirical_bayes"] == "tensor"
    assert set(scales) == {"0.weight", "0.bias", "2.weight", "2.bias"} and all(len(v) == 2 for v in scales.values())
    assert len({v[0] for v in scales.values()}) == 4  # one scale per tensor
    trace = post.history["prior_scale[2.weight]"]
    assert trace.shape == (2, 60) and trace[0, -1].item() == pytest.approx(scales["2.weight"][0])
    assert all(v[0] < 1.0 for v in scales.values())  # y is small: every learned scale shrinks from 1
    assert post.predict(x[:4]).mean.shape == (4,)
    assert "r_hat" in post.summary(warn=False).columns
    assert "posterior" in post.to_inference_data().groups()
    again = bp.load(post.save(tmp_path / "eb.bnn"), model=model)
    assert again.config["prior_scales"] == scales
    assert torch.equal(again.history["prior_scale[2.weight]"], trace)


@pytest.mark.parametrize(
    "prior, kwargs, error, match",
    [
        (bp.priors.HierarchicalNormal(), {}, ValueError, r"prior of 'weight' is hierarchical"),
        (bp.priors.ScaleMixtureNormal(), {}, ValueError, r"prior of 'weight' is MixtureSameFamily, which has no scale"),
        (
            {"weight": dist.Normal(0.0, torch.tensor([1.0, 2.0])), "bias": dist.Normal(0.0, 1.0)},
            {},
            ValueError,
            r"scale of 'weight' varies within",
        ),
        (bp.priors.Normal(), dict(guide="map"), ValueError, r"empirical_bayes needs a guide with spread"),
        (
            bp.priors.Normal(),
            dict(empirical_bayes="layer"),
            ValueError,
            r"empirical_bayes: unknown value 'layer'; choose one of 'tensor', 'shared'",
        ),
        (bp.priors.Normal(), dict(empirical_bayes=1.5), TypeError, r"empirical_bayes: expected True, False"),
        ("function", {}, ValueError, r"empirical_bayes: needs a bp.BNN"),
    ],
)
def test_bad_empirical_bayes_input_is_explained(prior, kwargs, error, match):
    x, y = torch.randn(6, 2), torch.randn(6)
    if prior == "function":

        def model(x, y=None):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
            with pyro.plate("data", len(x)):
                return pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=y)
    else:
        model = bp.BNN(torch.nn.Linear(2, 1), prior=prior, likelihood=bp.likelihoods.Gaussian(scale=0.1))
    with pytest.raises(error, match=match):
        bp.fit(model, x, y, **{"empirical_bayes": True, "num_steps": 2, "progress": False, **kwargs})
