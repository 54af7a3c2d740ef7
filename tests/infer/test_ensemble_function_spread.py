"""A plain Pyro function's ensemble members weight their observations (the weighted likelihood bootstrap,
:mod:`bnn_pyro.infer.anchor`, "The data half"), so that their spread is the posterior's where the data dominate the
prior. Before, only the prior half was randomized (anchors) and the members' sds were 0.001-0.07 of the exact ones on
kidiq (``benchmarks/results/reference_suite/function_ensemble_converged.md``)."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats

import bnn_pyro as bp
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.anchor import ANCHOR_SEED_OFFSET, bootstrap_sites, bootstrap_weights, weighted
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

PRIOR_SD, NOISE = 1.0, 0.5


def _linear(n: int = 150, seed: int = 0):
    """A conjugate Gaussian linear regression as a plain Pyro function (known noise), its rows, and the design."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = 0.3 + x @ torch.tensor([1.0, -0.5], dtype=torch.float64) + NOISE * torch.randn(n, generator=g, dtype=x.dtype)

    def model(x, y=None):
        beta = pyro.sample("beta", dist.Normal(torch.zeros(3, dtype=x.dtype), PRIOR_SD).to_event(1))
        with pyro.plate("data", size=len(x)):
            f = pyro.deterministic("f", beta[0] + x @ beta[1:])
            return pyro.sample("obs", dist.Normal(f, NOISE), obs=y)

    design = torch.cat([torch.ones(n, 1, dtype=x.dtype), x], 1)
    return model, x, y, design


def _exact(design, y):
    """The posterior's mean and covariance: ``S = (X^T X / sigma^2 + I / s^2)^-1``, ``m = S X^T y / sigma^2``."""
    cov = torch.linalg.inv(design.T @ design / NOISE**2 + torch.eye(3, dtype=y.dtype) / PRIOR_SD**2)
    return cov @ design.T @ y / NOISE**2, cov


def test_bootstrap_weights_are_n_times_a_dirichlet_draw_per_element_of_each_observed_sites_batch_shape():
    model, x, y, _ = _linear(n=40)
    sites = bootstrap_sites(model, x, y)
    assert sites.shapes == {"obs": torch.Size([40])}  # the deterministic site f is not weighted
    a, b = bootstrap_weights(sites, seed=3), bootstrap_weights(sites, seed=4)
    assert a["obs"].shape == (40,) and bool((a["obs"] > 0).all())
    assert abs(float(a["obs"].sum()) - 40) < 1e-4  # n * Dirichlet: the data's total weight stays n
    assert torch.equal(a["obs"], bootstrap_weights(sites, seed=3)["obs"]) and not torch.equal(a["obs"], b["obs"])


def test_an_observed_site_with_every_observation_in_one_event_is_not_weighted_and_the_config_says_why():
    def model(x, y=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        return pyro.sample("obs", dist.Normal(mu, 1.0).expand([len(x)]).to_event(1), obs=y)

    x, y = torch.zeros(30, 1), torch.randn(30) + 2.0
    sites = bootstrap_sites(model, x, y)
    assert not sites.shapes and "one event" in sites.record["skipped"]

    def two_sites(x, y=None):  # a site that can be weighted beside one that cannot: the first is, the second named
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        pyro.sample("summary", dist.Normal(mu, 1.0), obs=torch.tensor(2.0))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    sites = bootstrap_sites(two_sites, x, y)
    assert sites.shapes == {"obs": torch.Size([30])} and "['summary']" in sites.record["unweighted"]
    post = bp.fit(model, x, y, method="ensemble", num_chains=2, num_steps=20, seed=0, progress=False)
    assert "one event" in post.config["observation_weights"]["skipped"]
    assert post.config["bootstrap"] is True


def test_weighted_scales_only_the_observed_sites_log_density():
    """``U_w(z) - U(z) = -sum_i (v_i - 1) log N(y_i | f_i, sigma)``: the prior term is left alone."""
    model, x, y, design = _linear(n=20)
    pot = Potential(model, Data(x, y), init="median")
    z = {"beta": torch.tensor([0.2, 0.9, -0.4], dtype=x.dtype)}
    v = bootstrap_weights(bootstrap_sites(model, x, y), seed=1, like=y)
    u = pot(z, (x, y))
    u_w = weighted(lambda p, zz, batch: p(zz, batch), v)(pot, z, (x, y))
    loglik = dist.Normal(design @ z["beta"], NOISE).log_prob(y)
    assert abs(float(u_w - u) + float(((v["obs"] - 1) * loglik).sum())) < 1e-9


def test_a_members_mode_is_the_weighted_anchored_ridge_solution_in_closed_form():
    """Member ``k`` of the conjugate model minimizes ``sum_i v_i (y_i - x_i b)^2 / (2 sigma^2) + |b - b_0|^2 / (2 s^2)``
    (its weights ``v``, its anchor ``b_0``): ``b = (X^T V X / sigma^2 + I / s^2)^-1 (X^T V y / sigma^2 + b_0 / s^2)``."""
    model, x, y, design = _linear(n=60)
    post = bp.fit(model, x, y, method="ensemble", num_chains=2, num_steps=50, seed=5, progress=False)
    assert post.config["observation_weights"]["sites"] == {"obs": "[60]"}  # clean_config writes lists as text
    sites = bootstrap_sites(model, x, y)
    for k in range(2):
        v = bootstrap_weights(sites, seed=5 + k, like=y)["obs"]
        with torch.random.fork_rng(devices=[]):
            pyro.set_rng_seed(5 + k + ANCHOR_SEED_OFFSET)
            b0 = pyro.poutine.trace(model).get_trace(x, y).nodes["beta"]["value"]
        a = design.T @ (v[:, None] * design) / NOISE**2 + torch.eye(3, dtype=x.dtype) / PRIOR_SD**2
        b = torch.linalg.solve(a, design.T @ (v * y) / NOISE**2 + b0 / PRIOR_SD**2)
        assert torch.allclose(post.samples["beta"][k, 0], b, atol=1e-6), (k, post.samples["beta"][k, 0], b)


@pytest.mark.slow
def test_the_members_spread_on_a_conjugate_pyro_function_is_the_exact_posteriors():
    """40 members (the defaults otherwise). An sd estimated from ``M`` independent draws has relative sd
    ``1 / sqrt(2 (M - 1))`` (0.11 here); the bounds are the chi-square quantiles of ``M - 1`` degrees of freedom at a
    two-sided 4-sigma tail (6e-5 per parameter). The scheme's own first-order covariance,
    ``S (X^T diag(r^2) X / sigma^4 + I / s^2) S`` with the residuals ``r`` at the posterior mean, differs from ``S``
    by the rows' residual variance against ``sigma^2``: that ratio (computed from these rows, not tuned) widens the
    bounds on its side. Before (anchors only) the sds were ``S / s`` along the data's directions: 0.04 of the exact
    ones here."""
    model, x, y, design = _linear()
    mean, cov = _exact(design, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="ensemble", num_chains=40, seed=0, progress=False)
    members = post.samples["beta"][:, 0]
    ratio = members.std(0) / cov.diagonal().sqrt()
    r = y - design @ mean
    first_order = cov @ (design.T @ (r[:, None] ** 2 * design) / NOISE**4 + torch.eye(3, dtype=y.dtype)) @ cov
    expected = first_order.diagonal().sqrt() / cov.diagonal().sqrt()
    m = members.shape[0]
    tail = stats.norm.sf(4.0)
    lo = math.sqrt(stats.chi2.ppf(tail, m - 1) / (m - 1)) * torch.clamp(expected, max=1.0)
    hi = math.sqrt(stats.chi2.isf(tail, m - 1) / (m - 1)) * torch.clamp(expected, min=1.0)
    assert bool(((lo <= ratio) & (ratio <= hi)).all()), (ratio, lo, hi)
    z = (members.mean(0) - mean) / cov.diagonal().sqrt()
    assert bool((z.abs() <= 4.0 / math.sqrt(m)).all()), z  # the members' mean: 4 Monte Carlo sds of M draws
    assert not [w for w in caught if issubclass(w.category, DiagnosticWarning) and "too narrow" in str(w.message)]


def test_given_validation_rows_leave_the_members_unweighted_and_the_config_says_so():
    """With ``validation=(x_val, y_val)`` the members keep their held-out stops and are not refitted to their minima,
    where the weights act: ``config["observation_weights"]`` says they were skipped and why, instead of naming a scheme
    that never ran; without anchors the record says the prior half is not anchored."""
    model, x, y, *_ = _linear(n=60)
    xv, yv = x[:20], y[:20]
    fit = dict(method="ensemble", num_chains=2, num_steps=30, seed=0, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        given = bp.fit(model, x, y, validation=(xv, yv), **fit)
        plain = bp.fit(model, x, y, anchored=False, **fit)
    assert given.config["validation"]["source"] == "given"
    assert "scheme" not in given.config["observation_weights"]
    assert "validation rows were given" in given.config["observation_weights"]["skipped"]
    assert plain.config["observation_weights"]["anchored_prior"] is False
