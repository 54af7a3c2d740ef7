"""The Newton gap of a fitted Gaussian guide (bnn_pyro/infer/svi_gap.py) and its check (_health.check_guide_gap), on a
conjugate model whose posterior is Gaussian: there the KL-optimal full-rank guide is the posterior itself, and for a
guide with the posterior's covariance the control-variated Newton step is exact draw by draw (``S grad log p(z) + (z -
m) = m* - m``), so the gap is the known distance of the guide's mean from the posterior mean in guide sds."""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide

import bnn_pyro as bp
from bnn_pyro.infer import _health, svi_gap
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

PRIOR_SD = 10.0


def _model(x, y=None):
    """y_i ~ N(b0 + b1 x_i, 1), b ~ N(0, PRIOR_SD^2 I): a Gaussian posterior in closed form."""
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(b[0] + b[1] * x, 1.0), obs=y)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, generator=g) + 3.0  # uncentered: intercept and slope correlate
    return x, 1.0 + 0.5 * x + torch.randn(30, generator=g)


def _posterior(x, y):
    design = torch.stack([torch.ones_like(x), x], 1).double()
    cov = torch.linalg.inv(design.T @ design + torch.eye(2, dtype=torch.float64) / PRIOR_SD**2)
    return cov @ design.T @ y.double(), cov


def test_the_gap_is_the_known_distance_on_a_gaussian_posterior():
    x, y = _data()
    mean, cov = _posterior(x, y)
    guide = autoguide.AutoMultivariateNormal(_model)
    with pyro.get_param_store().scope():
        guide(x, y)
        shift = torch.tensor([0.3, -0.2], dtype=torch.float64) * cov.diagonal().sqrt()  # 0.3 and -0.2 sds off
        chol = torch.linalg.cholesky(cov)
        with torch.no_grad():
            guide.loc.copy_((mean + shift).float())
            guide.scale = chol.diagonal().float()
            guide.scale_tril = (chol / chol.diagonal()[:, None]).float()
        result = svi_gap.newton_gap(guide, _model, Data(x, y), num_draws=200)
    gap, se = result.gap, result.se
    assert result.labels == ["b[0]", "b[1]"] and result.reason is None
    assert gap.device.type == "cpu" and gap.dtype == torch.float64
    expected = np.array([-0.3, 0.2])
    assert np.allclose(gap.numpy(), expected, atol=2e-3), gap  # float32 rounding of the model's gradient
    assert float(se.max()) < 2e-3, se


def _post(gap, se, guide="full_rank"):
    post = bp.Posterior(
        samples={"b": torch.zeros(1, 2, 2)},
        model=_model,
        method="svi",
        config={"guide": guide, "num_steps": 5000, "guide_coordinates": ["b[0]", "b[1]"]},
        history={_health.GAP: torch.tensor([gap]), _health.GAP_SE: torch.tensor([se])},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        _health.check_guide_gap(post)
    return [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


def test_the_check_warns_on_a_gap_beyond_both_thresholds_only():
    assert not _post([0.04, -0.01], [0.001, 0.001])  # within GAP_MAX
    assert not _post([0.3, -0.01], [0.1, 0.001])  # within GAP_Z standard errors
    (message,) = _post([0.02, -0.3], [0.001, 0.01])
    assert "b[1] is 0.3 of its sds" in message and "num_steps=20000" in message and "method='nuts'" in message


def test_a_short_default_fit_warns_and_the_gap_is_recorded():
    """SVI at its default guide (full-rank here) and rate from a prior draw, stopped after 200 steps: the guide's mean
    is still far from the posterior's; the fit records the gap per chain (two here) and says so."""
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(
            _model,
            x,
            y,
            method="svi",
            init="prior",
            num_steps=200,
            num_samples=10,
            num_chains=2,
            seed=0,
            progress=False,
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    assert post.config["guide"] == "full_rank" and post.history[_health.GAP].shape == (2, 2)
    assert post.config["guide_coordinates"] == ["b[0]", "b[1]"]
    assert any("stopped short of its best fit" in m for m in messages), messages


@pytest.mark.parametrize("guide", ["low_rank", "full_rank", "mean_field"])
def test_a_converged_fit_on_a_gaussian_posterior_is_silent(guide):
    """From the Laplace start (the default), the exact posterior for a full-rank guide: no gap to report; mean-field and
    low-rank guides record none (their covariance is not the inverse curvature at their optimum: svi_gap)."""
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_steps=500, num_samples=10, seed=0, progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    assert not any("stopped short" in m for m in messages), messages
    assert (_health.GAP in post.history) == (guide == "full_rank")
