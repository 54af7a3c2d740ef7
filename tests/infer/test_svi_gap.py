"""The Newton gap of a fitted Gaussian guide (bnn_pyro/infer/svi_gap.py) and its check (_health.check_guide_gap), on a
conjugate model whose posterior is Gaussian: there the KL-optimal full-rank guide is the posterior itself, and for a
guide with the posterior's covariance the control-variated Newton step is exact draw by draw (``S grad log p(z) + (z -
m) = m* - m``), so the gap is the known distance of the guide's mean from the posterior mean in guide sds."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide

import bnn_pyro as bp
from bnn_pyro.infer import _health, guide_density, svi_gap, svi_refine
from bnn_pyro.infer._potential import Potential
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


def _short_fit(x, y, *, num_steps: int):
    """SVI at its default guide (full-rank here) from a prior draw, ``num_steps`` steps, two chains; the fit and the
    ``DiagnosticWarning`` s it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(
            _model,
            x,
            y,
            method="svi",
            init="prior",
            num_steps=num_steps,
            num_samples=10,
            num_chains=2,
            seed=0,
            progress=False,
        )
    return post, caught


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


def test_a_short_default_fit_warns_and_the_gap_is_recorded(monkeypatch):
    """SVI at its default guide (full-rank here) and rate from a prior draw, stopped after 200 steps, with the
    refinement that now takes it to the exact posterior (``tests/infer/test_svi_refine.py``) switched off, as where it
    stops short or does not apply: the guide's mean is still far from the posterior's; the fit records the gap per
    chain (two here) and says so."""
    monkeypatch.setattr(svi_refine, "refine", lambda *args, **kwargs: None)
    x, y = _data()
    post, caught = _short_fit(x, y, num_steps=200)
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    assert post.config["guide"] == "full_rank" and post.history[_health.GAP].shape == (2, 2)
    assert post.config["guide_coordinates"] == ["b[0]", "b[1]"]
    assert any("stopped short of its best fit" in m for m in messages), messages


@pytest.mark.parametrize("guide", ["low_rank", "full_rank", "mean_field"])
def test_a_converged_fit_on_a_gaussian_posterior_is_silent(guide):
    """From the Laplace start (the default), the exact posterior for full-rank and low-rank guides (rank 1 of 2
    coordinates holds any covariance): no gap to report; a mean-field guide records none (its covariance is not the
    inverse curvature where the posterior correlates: svi_gap)."""
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_steps=500, num_samples=10, seed=0, progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    assert not any("stopped short" in m for m in messages), messages
    assert (_health.GAP in post.history) == (guide != "mean_field")


def _wall(x, y=None):
    """th ~ N(0, 1) behind a wall at th = 2 (log density -1e60 (th - 2)^2 below it): the prior median is no valid start."""
    th = pyro.sample("th", dist.Normal(0.0, 1.0))
    pyro.factor("wall", -(((2.0 - th).clamp(min=0) * 1e30) ** 2))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(th, 1.0), obs=y)


def test_a_fit_whose_prior_median_is_no_valid_start_still_returns():
    """The potential is built at the guide's own point: from the prior median (0, behind the wall) it raised after the
    training had run, and the user got an exception instead of the fitted guide."""
    x, y = torch.zeros(20, 1), 3.0 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(
            _wall,
            x,
            y,
            method="svi",
            guide="full_rank",
            init={"th": torch.tensor(3.0)},
            num_steps=300,
            seed=0,
            progress=False,
        )
    assert post.history[_health.GAP].shape == (1, 1), post.history.keys()
    assert post.config["guide_gap"] == [{"method": "dense", "draws": 1000, "reason": None}], post.config


def _guide_at(model, x, y, loc, sd):
    guide = autoguide.AutoMultivariateNormal(model)
    guide(x, y)
    with torch.no_grad():
        guide.loc.copy_(torch.as_tensor(loc, dtype=torch.float32))
        guide.scale = torch.as_tensor(sd, dtype=torch.float32)
    return guide


def test_no_verdict_where_the_log_density_is_not_finite_at_some_draws():
    """A guide straddling a support edge (th > 2 only, the factor -inf below): its draws below 2 give a non-finite log
    density. The old code averaged NaN into every coordinate and the check stayed silent with nothing recorded; now
    there is no verdict and the reason says how many draws failed."""

    def edge(x, y=None):
        th = pyro.sample("th", dist.Normal(0.0, 1.0))
        pyro.factor("edge", torch.where(th > 2.0, 0.0, -math.inf))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(th, 1.0), obs=y)

    x, y = torch.zeros(20, 1), 3.0 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    with pyro.get_param_store().scope():
        guide = _guide_at(edge, x, y, [2.5], [1.0])  # P(th < 2) = 0.31: ~310 of 1,000 draws fail
        result = svi_gap.newton_gap(guide, edge, Data(x, y))
    assert result.gap is None and result.se is None
    bad = int(result.reason.split("not finite at ")[1].split(" of")[0])
    assert 250 < bad < 370, result.reason  # 1000 * 0.31 +- 4 binomial sds


def test_labels_name_unconstrained_coordinates():
    """A positive scale's coordinate is its log: labelled so, since post.summary() shows the constrained value."""

    def scaled(x, y=None):
        b = pyro.sample("b", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
        s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(b[0] + b[1] * x, s), obs=y)

    x, y = _data()
    with pyro.get_param_store().scope():
        guide = _guide_at(scaled, x, y, [1.0, 0.5, 0.0], [0.1, 0.1, 0.1])
        result = svi_gap.newton_gap(guide, scaled, Data(x, y), num_draws=50)
    assert result.labels == ["b[0]", "b[1]", "s (unconstrained)"]


def test_the_batched_pass_matches_the_draw_by_draw_one(monkeypatch):
    """The one vmap pass gives the gradients that the row-by-row fallback gives (same model, same points), and the
    inputs of the statistic share the guide's device and the potential's dtype."""
    x, y = _data()
    pot = Potential(_model, Data(x, y), init={"b": torch.tensor([1.0, 0.5])}, fast_path=False)
    z = torch.randn(40, 2, generator=torch.Generator().manual_seed(1))
    values, batched, _ = guide_density.derivatives(pot, ["b"], z)
    monkeypatch.setattr(torch.func, "vmap", _no_vmap)
    row_values, rows, _ = guide_density.derivatives(pot, ["b"], z)
    assert batched.device == z.device and batched.dtype == z.dtype and values.shape == (40,)
    assert torch.allclose(batched, rows, rtol=1e-5, atol=1e-4) and torch.allclose(values, row_values, rtol=1e-6)


def _no_vmap(*args, **kwargs):
    raise RuntimeError("vmap: not batchable (test)")


def test_the_count_is_of_coordinates_not_chains_times_coordinates():
    post = bp.Posterior(
        samples={"b": torch.zeros(2, 2, 2)},
        model=_model,
        method="svi",
        config={"guide": "full_rank", "num_steps": 5000, "guide_coordinates": ["b[0]", "b[1]"]},
        history={
            _health.GAP: torch.tensor([[0.3, 0.0], [0.3, 0.0]]),
            _health.GAP_SE: torch.full((2, 2), 0.001),
        },
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        _health.check_guide_gap(post)
    (message,) = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    assert "1 unconstrained coordinate(s) of 2 over" in message, message


def test_a_guide_with_sites_the_potential_lacks_is_not_judged():
    """The MVN path checks that the guide's coordinates are exactly the sites': an extra one would shift every slice."""
    x, y = _data()
    with pyro.get_param_store().scope():
        guide = _guide_at(_model, x, y, [1.0, 0.5], [0.1, 0.1])
        assert svi_gap.guide_gaussian(guide, ["b"], {"b": torch.Size([2])}) is not None
        assert svi_gap.guide_gaussian(guide, ["b"], {"b": torch.Size([1])}) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gap_of_a_guide_on_a_gpu_comes_back_on_the_cpu():
    x, y = (v.cuda() for v in _data())
    mean, cov = _posterior(x.cpu(), y.cpu())
    with pyro.get_param_store().scope():
        guide = _guide_at(_model, x, y, mean, cov.diagonal().sqrt())
        result = svi_gap.newton_gap(guide, _model, Data(x, y), num_draws=100)
    assert result.reason is None and result.gap.device.type == "cpu" and result.se.device.type == "cpu"


def test_a_fit_without_a_verdict_records_why_and_nan_gaps(monkeypatch):
    """Where newton_gap has no verdict (here forced: the potential cannot be built), every chain's gap is NaN (so that
    the chains' histories stack), the reason is in post.config and the check is silent."""

    def broken(*args, **kwargs):
        raise ValueError("Model specification seems incorrect (test)")

    monkeypatch.setattr(guide_density, "Potential", broken)
    x, y = _data()
    post, caught = _short_fit(x, y, num_steps=100)
    assert post.history[_health.GAP].shape == (2, 2) and bool(post.history[_health.GAP].isnan().all())
    records = post.config["guide_gap"]  # per chain, one shape
    assert len(records) == 2 and all(r["method"] is None for r in records), records
    assert all(r["reason"].startswith("the log density could not be evaluated at the guide's") for r in records)
    assert not any("stopped short" in str(w.message) for w in caught)


def test_a_model_vmap_cannot_batch_is_evaluated_draw_by_draw():
    """A model that reads a latent value as a Python number (``float(...)``) cannot be batched by vmap: the gap is then
    evaluated one draw at a time, with the same answer as the batched model it equals (same draws, same seed)."""

    calls = []

    def branching(x, y=None):
        calls.append(1)
        b = pyro.sample("b", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
        slope = b[1] if float(b[1].detach()) > -1e9 else -b[1]  # always b[1]: a Python branch on a latent value
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(b[0] + slope * x, 1.0), obs=y)

    x, y = _data()
    results = []
    for model in (branching, _model):
        with pyro.get_param_store().scope():
            guide = _guide_at(model, x, y, [1.0, 0.5], [0.2, 0.05])
            results.append(svi_gap.newton_gap(guide, model, Data(x, y), num_draws=100))
    assert len(calls) > 100  # one call per draw: the row-by-row path ran
    assert results[0].reason is None and torch.allclose(results[0].gap, results[1].gap, atol=1e-5)


def _branching(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
    slope = b if float(b[0].detach()) > -1e9 else -b  # always b: a Python branch on a latent value
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(slope[0] + slope[1] * x, 1.0), obs=y)


def test_a_dense_failure_before_any_draw_records_no_draws():
    """A low-rank guide's Hessians of a model vmap cannot batch (a Python branch on a latent value): the batched pass
    refuses before any draw's value is known, so the record says 0 draws, not the 1,000 it would have taken (review
    15)."""
    x, y = _data()
    with pyro.get_param_store().scope():
        guide = autoguide.AutoLowRankMultivariateNormal(_branching, rank=1)
        guide(x, y)
        result = svi_gap.newton_gap(guide, _branching, Data(x, y))
    assert result.gap is None and "torch.func.vmap cannot batch the model" in result.reason, result.reason
    assert result.record == {"method": "dense", "draws": 0, "reason": result.reason}, result.record


@pytest.mark.parametrize("scale, tril", [([1.0, 1e-6], [[1.0, 0.0], [1e6, 1.0]]), ([1.0, math.nan], None)])
def test_a_guide_covariance_without_a_cholesky_factor_is_named_as_the_cause(scale, tril):
    """A full-rank guide whose covariance has no Cholesky factor, singular (``L = [[1, 0], [1, 1e-6]]``: ``L L^T`` is
    ``[[1, 1], [1, 1]]`` in float32) or NaN (Pyro's validation off, as a user may have it): no draw can be taken, so
    the record says 0 draws and the covariance as the cause, not "the log density's gradient could not be evaluated",
    the reason the old code gave it (review 17, finding 8)."""
    x, y = _data()
    with pyro.get_param_store().scope(), pyro.validation_enabled(False):
        guide = autoguide.AutoMultivariateNormal(_model)
        guide(x, y)
        with torch.no_grad():
            guide.scale = torch.tensor(scale)
            if tril is not None:
                guide.scale_tril = torch.tensor(tril)
        result = svi_gap.newton_gap(guide, _model, Data(x, y))
    assert result.gap is None and result.reason.startswith("the guide's covariance has no Cholesky factor"), result
    assert result.record == {"method": "dense", "draws": 0, "reason": result.reason}, result.record


def test_a_gap_that_failed_before_a_path_records_draws_0(monkeypatch):
    """``Gap.record`` has one shape (method, reason, draws) where no path was taken too: the potential cannot be built
    (NoDensity), or anything else raises before a path is chosen (review 17, finding 8: no ``draws`` there)."""

    def broken(*args, **kwargs):
        raise ValueError("Model specification seems incorrect (test)")

    x, y = _data()
    for name, error in (("Potential", broken), ("guide_target", _no_vmap)):
        with monkeypatch.context() as patch, pyro.get_param_store().scope():
            patch.setattr(guide_density if name == "Potential" else svi_gap, name, error)
            guide = _guide_at(_model, x, y, [1.0, 0.5], [0.1, 0.1])
            result = svi_gap.newton_gap(guide, _model, Data(x, y))
        assert result.gap is None and result.record == {"method": None, "draws": 0, "reason": result.reason}, name
