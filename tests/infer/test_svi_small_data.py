"""Mean-field SVI on little data (issue 26, item 8): at its defaults on 100 rows of friedman1 the fitted guide's
learned noise exceeds the targets' spread (the ELBO's optimum there, docs/engines.md "Mean-field SVI on small
data"), and the fit says so; on 500 rows of the same function it fits and says nothing of the kind. Measured here
(the posterior median of the noise sd over the targets' sd): 1.137-1.148 for seeds 0-3 on 100 rows, 0.23 on 500
rows (seed 0); the threshold of 1.0 lies far outside that spread on both sides."""

from __future__ import annotations

import warnings

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

NOISE_WARNING = "the learned noise sd"


def _friedman(n: int):
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=n, n_features=10, noise=1.0, random_state=0)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def _fit(n: int):
    x, y = _friedman(n)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))
    model = bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="svi", seed=0, progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    return post, y, messages


@pytest.mark.slow  # ~5-10 s: 5,000 steps on 100 rows
def test_mean_field_underfit_on_little_data_is_said_at_fit_time():
    post, y, messages = _fit(100)
    assert post.config["guide"] == "mean_field" and post.config["kl_warmup"] == 0.0
    assert float(post.samples["sigma"].median()) >= float(y.std())
    said = [m for m in messages if NOISE_WARNING in m]
    assert said and "kl_warmup do not change that optimum" in said[0], messages


@pytest.mark.slow  # ~10-20 s: 5,000 steps on 500 rows
def test_a_fit_that_explains_the_data_is_not_flagged():
    post, y, messages = _fit(500)
    assert float(post.samples["sigma"].median()) < 0.5 * float(y.std())
    assert not [m for m in messages if NOISE_WARNING in m], messages
