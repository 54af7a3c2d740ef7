"""Subspace inference's structural limit (issue 26): confined to ``w_hat + P z``, a weight keeps only the fraction
``diag(B (B^T H B)^{-1} B^T) / diag(H^{-1})`` of a Gaussian posterior's variance, and ``check_subspace`` says so at
fit time. Checked against the conditional Gaussian in covariance form (an independent closed form), against the
exact posterior of the linear BNN reference (``tests/reference``; the outputs' share too), and for false alarms where the subspace holds the
spread (the whole weight space; a subspace along the posterior's dominant directions)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import arviz as az
import numpy as np
import pyro
import pytest
import torch
from reference.posteriors import BNN_REFERENCES, Z_MAX, flat_draws

import bnn_pyro as bp
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.mcmc import NUTSConfig
from bnn_pyro.infer.subspace_held import SUBSPACE_HELD_MIN, check_subspace, laplace_precision, subspace_variance_held
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

PHRASE = "holds too little of the posterior's spread"


def _conditional_variance(cov: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The variance of ``N(mu, cov)`` given ``U^T (w - mu) = 0`` (``U`` spanning the complement of ``basis``'s
    columns): the covariance-form Schur complement ``cov - cov U (U^T cov U)^{-1} U^T cov``."""
    q = torch.linalg.qr(basis, mode="complete")[0]
    u = q[:, basis.shape[1] :]
    return (cov - cov @ u @ torch.linalg.solve(u.T @ cov @ u, u.T @ cov)).diagonal()


def test_the_held_fraction_is_the_gaussian_conditional_in_closed_form():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 5, generator=g, dtype=torch.float64)
    cov = a @ a.T + 0.1 * torch.eye(5, dtype=torch.float64)
    for k in (1, 2, 4):
        basis = torch.randn(5, k, generator=g, dtype=torch.float64) * 3.0  # any scale: the span is what counts
        held = subspace_variance_held(torch.linalg.inv(cov), basis)
        assert torch.allclose(held, _conditional_variance(cov, basis) / cov.diagonal(), rtol=1e-9, atol=1e-12)
        assert bool((held <= 1 + 1e-12).all()) and bool((held >= 0).all())
    full = subspace_variance_held(torch.linalg.inv(cov), torch.randn(5, 5, generator=g, dtype=torch.float64))
    assert torch.allclose(full, torch.ones(5, dtype=torch.float64), atol=1e-10)


def test_a_subspace_along_the_dominant_directions_holds_the_spread():
    """No false alarm for a posterior with k dominant directions: a basis spanning them (mixed by any invertible
    k x k map) holds nearly all of every coordinate's variance; one orthogonal to them holds next to none."""
    g = torch.Generator().manual_seed(1)
    q = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    variances = torch.tensor([1.0, 0.5, 1e-4, 1e-4, 1e-4, 1e-4], dtype=torch.float64)
    precision = q @ torch.diag(1 / variances) @ q.T
    dominant = q[:, :2] @ torch.randn(2, 2, generator=g, dtype=torch.float64)
    held = subspace_variance_held(precision, dominant)
    expected = (q[:, :2] ** 2 @ variances[:2]) / (q**2 @ variances)  # the conditional is q_2 diag(1, 0.5) q_2^T
    assert torch.allclose(held, expected, rtol=1e-9) and float(held.min()) > SUBSPACE_HELD_MIN
    assert float(subspace_variance_held(precision, q[:, 2:4]).max()) < SUBSPACE_HELD_MIN


def test_the_precision_is_laplaces_gauss_newton_in_closed_form():
    """The check's precision (Laplace's ``structure="full", hessian="ggn"``) on a 1-3-1 tanh net with a learned noise,
    at a point that is no mode: in the weights the prior's precision ``I`` plus ``J^T J / sigma^2`` (a Gaussian's
    ``Lambda_i = 1 / sigma^2``; ``J`` by hand from ``f = W2 tanh(W1 x + b1) + b2``), no weight-noise coupling, and in
    ``u = log sigma`` the exact ``2 sigma^2`` (the HalfNormal(1) prior with its log-Jacobian, ``sigma^2 / 2 - u``)
    plus ``2 RSS / sigma^2`` (the likelihood, ``sum_i u + r_i^2 / (2 sigma^2)``); the Jacobian returned is ``J``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()
    model = bp.BNN(
        net,
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=pyro.distributions.HalfNormal(1.0)),
    )
    x = torch.linspace(-2, 2, 7, dtype=torch.float64)[:, None]
    y = torch.sin(2 * x[:, 0])
    pot = Potential(model, Data(x, y), init="net", fast_path=False)
    assert list(pot.shapes) == ["0.weight", "0.bias", "2.weight", "2.bias", "sigma"]
    z = pot.flatten(pot.init)
    values = pot.constrain(pot.unflatten(z))
    w1, b1, w2, b2, sigma = (values[k] for k in pot.shapes)
    t = torch.tanh(x @ w1.T + b1)  # (7, 3)
    slope = w2[0] * (1 - t**2)
    jac = torch.cat([slope * x, slope, t, torch.ones(7, 1, dtype=torch.float64)], 1)  # d f / d (W1, b1, W2, b2)
    rss = float(((y - (t @ w2.T + b2)[:, 0]) ** 2).sum())
    expected = torch.zeros(11, 11, dtype=torch.float64)
    expected[:10, :10] = torch.eye(10, dtype=torch.float64) + jac.T @ jac / sigma**2
    expected[10, 10] = 2 * sigma**2 + 2 * rss / sigma**2
    precision, outputs_jac = laplace_precision(SimpleNamespace(model=model, x=x, y=y), pot, z, model.sample_names)
    assert torch.allclose(precision, expected, rtol=1e-10, atol=1e-12), (precision - expected).abs().max()
    assert torch.allclose(outputs_jac, jac, rtol=1e-10, atol=1e-12)


def _fit(ref, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(ref.model, ref.x, ref.y, method="subspace", seed=0, progress=False, **kw)
    return post, [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


@pytest.mark.slow  # one subspace fit of the 3-weight reference at its defaults: ~15 s (~40 s on a busy 2-core machine)
def test_subspace_dim_2_on_the_linear_reference_warns_with_the_exact_fraction():
    """Two of three weights: the check's fraction is the exact one (the exact precision ``X'X / s^2 + I`` restricted
    to the subspace, which the centered draws span), the draws reach it (weight[1]'s sd, 0.36 of the exact one, within
    ``Z_MAX`` MCSEs of the predicted sd), and the warning names weight[1] and ``subspace_dim=3``."""
    ref = BNN_REFERENCES["linear"]()
    post, messages = _fit(ref, subspace_dim=2)
    held = post.config["subspace"]["held"]
    assert held["judged"] and held["names"] == ["weight[0]", "weight[1]", "bias[0]"]
    x1 = torch.cat([ref.x, torch.ones(len(ref.x), 1)], 1).double()
    precision = x1.T @ x1 / 0.5**2 + torch.eye(3, dtype=torch.float64)  # noise 0.5, prior N(0, 1): conjugate
    draws = flat_draws(post, ref)  # (chains, draws, 3) in the reference's order: weight[0], weight[1], bias
    flat = torch.tensor(draws.reshape(-1, 3))
    span = torch.linalg.svd(flat - flat.mean(0), full_matrices=False)[2][:2].T
    exact = subspace_variance_held(precision, span)
    assert np.allclose(held["variance_held"], exact.numpy(), rtol=1e-3), (held["variance_held"], exact)
    assert held["worst"] == "weight[1]" and held["suggested_subspace_dim"] == 3
    assert held["outside"] == pytest.approx(1 - float(exact[1]), rel=1e-3) and float(exact[1]) < SUBSPACE_HELD_MIN
    # the outputs f_i = x_i^T w (+ bias) keep x_i^T C_sub x_i / x_i^T C x_i of their variance (linear: exact)
    q = torch.linalg.qr(span)[0]
    within = q @ torch.linalg.solve(q.T @ precision @ q, q.T)
    share = ((x1 @ within) * x1).sum(1) / ((x1 @ torch.linalg.inv(precision)) * x1).sum(1)
    f_held = held["function_variance_held"]
    assert f_held["median"] == pytest.approx(float(share.median()), rel=1e-3)
    assert f_held["min"] == pytest.approx(float(share.min()), rel=1e-3)
    predicted = float(exact[1].sqrt()) * ref.sd[1]
    assert abs(draws[..., 1].std() - predicted) < Z_MAX * float(az.mcse(draws[..., 1], method="sd"))
    own = [m for m in messages if m.startswith("subspace: ") and PHRASE in m]
    assert len(own) == 1 and "weight[1] 13%" in own[0] and "subspace_dim=3" in own[0] and "method='nuts'" in own[0]


@pytest.mark.slow  # one subspace fit of a 3-weight model at its defaults: ~15 s
def test_a_subspace_of_every_weight_holds_all_and_is_silent_with_the_learned_noise_free():
    """No false alarm where the subspace is the whole weight space: every weight keeps all its variance. A learned
    noise is not a weight: the inner engine samples it jointly with ``z``, so the check leaves its coordinate free
    (the weights' fractions are then exactly 1, the noise's coupling included) and names only the weights."""
    ref = BNN_REFERENCES["linear"]()
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Linear(2, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=pyro.distributions.HalfNormal(1.0)),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(model, ref.x, ref.y, method="subspace", subspace_dim=3, seed=0, progress=False)
    held = post.config["subspace"]["held"]
    assert "sigma" in post.samples and held["judged"], held
    assert held["names"] == ["weight[0]", "weight[1]", "bias[0]"]
    assert np.allclose(held["variance_held"], 1.0, atol=1e-6) and held["outside"] < 1e-6, held
    assert held["suggested_subspace_dim"] is None
    assert not [w for w in caught if PHRASE in str(w.message)]


def test_the_isotropic_prior_is_not_judged():
    """Under ``prior="isotropic"`` the prior over ``z`` is not the net's, so the subspace posterior is not the net's
    conditioned on the subspace: there is nothing exact to hold it to, and the check records why."""
    post = SimpleNamespace(config={"subspace": {"rank": 2}})
    assert check_subspace(post, directions={}, rank=2, prior="isotropic") is post
    assert post.config["subspace"] == {
        "rank": 2,
        "held": {"judged": False, "reason": "prior='isotropic': the prior over z is not the net's"},
    }


def _subspace_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning) and PHRASE in str(w.message)]


@pytest.fixture(scope="module")
def gap_net_fit():
    """A subspace fit of a small network at the default ``subspace_dim=10`` and SWA run (the gap data's 1-8-1 tanh
    net, Normal(0, 1) prior, a learned noise: 25 weights; the inner NUTS run shortened to 50 warm-up steps and draws
    in one chain at tree depth 5, since the check reads only the draws' mean): its ``held`` record and subspace warnings, then the
    check rerun on the same draws and SWA directions (those the engine passed it) at ``rank=2``."""
    import bnn_pyro.infer.subspace as engine

    seen = {}

    def spy(post, **kwargs):
        seen.update(kwargs)
        return check_subspace(post, **kwargs)

    x, y = bp.datasets.toy_gap()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    likelihood = bp.likelihoods.Gaussian(scale=pyro.distributions.HalfNormal(1.0))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    inner = NUTSConfig(num_warmup=50, max_tree_depth=5)
    patch = pytest.MonkeyPatch()
    patch.setattr(engine, "check_subspace", spy)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DiagnosticWarning)
            post = bp.fit(
                model, x, y, method="subspace", num_samples=50, num_chains=1, inner=inner, seed=0, progress=False
            )
    finally:
        patch.undo()
    default = dict(post.config["subspace"]["held"]), _subspace_messages(caught), seen["rank"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        check_subspace(post, **{**seen, "rank": 2})
    return {"default": default, "rank2": (dict(post.config["subspace"]["held"]), _subspace_messages(caught), 2)}


@pytest.mark.slow  # one subspace fit of a 25-weight net (its SWA run at the defaults, a short inner run)
def test_a_small_net_whose_outputs_keep_their_variance_is_not_warned_about_its_weights(gap_net_fit):
    """Subspace inference is about the function: at the default ``subspace_dim=10`` the net's outputs at the training
    inputs keep at least :data:`SUBSPACE_HELD_MIN` of their linearized variance while many of its weights keep far
    less (marginals that 10 directions of 25 weights cannot hold). The check judges the outputs, keeps the weights'
    figures, and is silent (the code before warned here, on the weights)."""
    held, messages, rank = gap_net_fit["default"]
    assert rank == 10 and held["judged"] and not held["weights_judged"], held
    assert held["function_variance_held"]["min"] >= SUBSPACE_HELD_MIN, held["function_variance_held"]
    assert sum(f < SUBSPACE_HELD_MIN for f in held["variance_held"]) >= 5, held["variance_held"]  # reported, not judged
    assert held["fired"] == [] and held["suggested_subspace_dim"] is None
    assert messages == []


@pytest.mark.slow  # reuses the fit above; the check itself takes well under a second
def test_a_subspace_whose_outputs_lose_their_variance_warns_with_the_outputs_criterion(gap_net_fit):
    """The same draws and SWA directions judged at ``rank=2``: the outputs keep too little of their linearized
    variance, so the check warns, says it is the outputs' criterion (a net's weights are not listed) and suggests the
    smallest number of the run's directions that holds it (at most the default 10, which held it above)."""
    held, messages, _ = gap_net_fit["rank2"]
    assert held["fired"] == ["outputs"] and held["function_variance_held"]["min"] < SUBSPACE_HELD_MIN, held
    assert 2 < held["suggested_subspace_dim"] <= 10
    assert len(messages) == 1, messages
    said = messages[0]
    assert "the network's outputs at the training inputs keep a median" in said and "post.predict()" in said
    assert "linear in the weights" not in said and f"subspace_dim={held['suggested_subspace_dim']}" in said
