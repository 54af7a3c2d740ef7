"""Whether the log likelihood is quadratic where a Laplace Gaussian puts its draws (bnn_pyro/infer/laplace/quadratic.py)
and the fit-time warning built on it (``health_off_data.check_quadratic``).

Exact where it can be: on Bayesian linear regression (a Gaussian likelihood, quadratic in the weights) the Laplace
Gaussian is the posterior, ``gamma = tr(G C)`` has a closed form, and the draws' excess negative log likelihood over
the mean is ``(w - m)^T G (w - m) / 2``, whose mean is ``gamma / 2`` and variance ``tr((G C)^2) / 2``: the test's
tolerance is 4 of those standard errors of the mean of ``DRAWS`` draws (fixed seed). For classifiers, the two regimes
of the module docstring: overlapping classes (the likelihood near its quadratic model: the ratio within Monte Carlo
error of 1, no warning) and an interpolating linear classifier with large features (the GGN vanishes in most
directions; the draws misfit the training rows: the fit warns).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from blr import make_blr

import bnn_pyro as bp
from bnn_pyro.infer import laplace as lap
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.health_off_data import QUADRATIC_RATIO_MAX
from bnn_pyro.infer.laplace.quadratic import DRAWS, draws_excess, effective_parameters
from bnn_pyro.posterior.diagnostics import DiagnosticWarning


def test_gamma_and_the_draws_excess_are_exact_on_a_quadratic_likelihood():
    blr = make_blr(n=30, d=3, noise=0.7, seed=1)
    approx = lap.laplace_approximation(blr.model(), Data(x=blr.x, y=blr.y), structure="full", seed=0)
    g = blr.design.T @ blr.design / blr.noise**2
    gc = g @ blr.cov
    gamma = float(gc.trace())
    assert approx.effective_parameters is None  # a regression: not judged, so not formed
    assert effective_parameters(g, approx.precision) == pytest.approx(gamma, rel=1e-5)
    chol = torch.linalg.cholesky(approx.precision)
    assert effective_parameters(g, approx.precision, chol=chol) == pytest.approx(gamma, rel=1e-5)
    assert effective_parameters(g.diagonal(), approx.precision.diagonal()) == pytest.approx(
        float((g.diagonal() / approx.precision.diagonal()).sum()), rel=1e-12
    )
    pot = approx.potential
    mean = {k: v[0] for k, v in pot.constrain(pot.unflatten(approx.mean[None])).items()}
    excess = draws_excess(approx.model, approx.sample(DRAWS, seed=3), mean, blr.x, blr.y)
    assert abs(excess - gamma / 2) < 4 * math.sqrt(_excess_variance(blr) / DRAWS), (excess, gamma / 2)


def _excess_variance(blr) -> float:
    """``g^T C g + tr((G C)^2) / 2`` with ``g = -P m`` (the NLL's gradient at the posterior mean, ``P`` the prior
    precision): the variance of one draw's excess under the (here exact) quadratic model."""
    g, gc = -blr.mean / blr.prior_scale**2, blr.design.T @ blr.design / blr.noise**2 @ blr.cov
    return float(g @ blr.cov @ g + (gc @ gc).trace() / 2)


def test_the_excess_variance_has_the_gradient_term():
    """The stated variance of one draw's excess includes ``g^T C g``: on Bayesian linear regression (exact), the
    empirical variance of 20,000 draws' excess matches it within 4 standard errors of a sample variance, and the
    quadratic part alone (the earlier statement) falls short of it by far more. A tighter prior (sd 0.3) moves the
    posterior mode further from the likelihood's, which is where the gradient term grows."""
    blr = make_blr(n=30, d=3, noise=0.7, prior_scale=0.3, seed=1)
    q = torch.distributions.MultivariateNormal(blr.mean, covariance_matrix=blr.cov)
    w = _draws(q, 20_000)
    nll = ((blr.y.double()[None] - w @ blr.design.T) ** 2).sum(-1) / (2 * blr.noise**2)
    at_mean = ((blr.y.double() - blr.design @ blr.mean) ** 2).sum() / (2 * blr.noise**2)
    excess = nll - at_mean
    var, centred = float(excess.var()), excess - excess.mean()
    se = math.sqrt(float((centred**4).mean() - centred.var() ** 2) / len(excess))  # of a sample variance
    stated = _excess_variance(blr)
    assert abs(var - stated) < 4 * se, (var, stated, se)
    gc = blr.design.T @ blr.design / blr.noise**2 @ blr.cov
    assert var - float((gc @ gc).trace()) / 2 > 10 * se


def _draws(q, n: int) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return q.sample(torch.Size([n]))


def test_beyond_rows_a_fixed_random_subset_stands_for_every_row(monkeypatch):
    from bnn_pyro.infer.laplace import quadratic

    blr = make_blr(n=30, d=3, noise=0.7, seed=1)
    approx = lap.laplace_approximation(blr.model(), Data(x=blr.x, y=blr.y), structure="full", seed=0)
    pot = approx.potential
    mean = {k: v[0] for k, v in pot.constrain(pot.unflatten(approx.mean[None])).items()}
    draws = approx.sample(DRAWS, seed=3)
    keep = torch.randperm(30, generator=torch.Generator().manual_seed(0))[:10]
    subset = draws_excess(approx.model, draws, mean, blr.x[keep], blr.y[keep])
    monkeypatch.setattr(quadratic, "ROWS", 10)
    assert draws_excess(approx.model, draws, mean, blr.x, blr.y) == pytest.approx(3 * subset, rel=1e-6)


def test_the_features_are_computed_once_not_once_per_draw():
    """``draws_excess`` used to run the whole network on every draw at once (a CNN body vmapped over 100 draws: one
    activation map per draw held together); the body is linear-free of the covered weights, so ``phi = net[:-1](x)``
    is computed once and each draw only applies its last layer. The convolution's FLOPs count its passes over x."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 3)
    )
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 1, 8, 8, generator=g), torch.randint(3, (60,), generator=g)
    approx = lap.laplace_approximation(model, Data(x=x, y=y), seed=0, num_steps=50)
    pot, fitted = approx.potential, approx.model
    mean = {k: v[0] for k, v in pot.constrain(pot.unflatten(approx.mean[None])).items()}
    draws = approx.sample(DRAWS, seed=1)
    conv = torch.ops.aten.convolution
    with FlopCounterMode(display=False) as one_pass, torch.no_grad():
        fitted.net(x)
    with FlopCounterMode(display=False) as counted:
        excess = draws_excess(fitted, draws, mean, x, y)
    ratio = counted.get_flop_counts()["Global"][conv] / one_pass.get_flop_counts()["Global"][conv]
    assert 1 <= ratio < 1.1, ratio  # one pass over x (and output_dim's probe of 2 rows); it was 1 + DRAWS passes
    with torch.no_grad():  # the same number as every draw through the whole network
        lik = fitted.likelihood
        f, f0 = fitted.forward_draws(draws, x), fitted.forward_draws({k: v[None] for k, v in mean.items()}, x)
        per_draw = lik.distribution(f, {}).log_prob(y).sum(-1)
        expected = float((lik.distribution(f0, {}).log_prob(y).sum(-1) - per_draw).mean())
    assert excess == pytest.approx(expected, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("case", ["frozen last bias", "last weight a point value", "last weight frozen"])
def test_the_excess_is_the_networks_own_when_a_last_layer_site_is_not_drawn(case):
    """A Laplace fit may cover only part of the last layer (its bias alone), and a frozen parameter is a buffer: the
    excess must use the layer's fixed values, as the network does (it raised KeyError on the weight, and dropped a
    frozen bias from every logit)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        net[2].bias.copy_(torch.tensor([1.5, -1.5]))  # unequal: a dropped bias changes the softmax
    bayesian = None
    if case == "frozen last bias":
        net[2].bias.requires_grad_(False)
    elif case == "last weight frozen":
        net[2].weight.requires_grad_(False)
    else:
        bayesian = ["0.weight", "0.bias", "2.bias"]
    model = bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical(), bayesian=bayesian or "all"
    )
    g = torch.Generator().manual_seed(0)
    y = torch.arange(60) % 2
    x = torch.randn(60, 2, generator=g) + y[:, None]
    post = bp.fit(model, x, y, method="laplace", seed=0, progress=False)  # raised KeyError: '2.weight'
    assert set(post.config["quadratic_excess"]) >= {"excess", "expected"}
    approx = lap.laplace_approximation(model, Data(x=x, y=y), seed=0)
    pot, fitted = approx.potential, approx.model
    mean = {k: v[0] for k, v in pot.constrain(pot.unflatten(approx.mean[None])).items()}
    draws = approx.sample(DRAWS, seed=1)
    excess = draws_excess(fitted, draws, mean, x, y)
    with torch.no_grad():  # every draw through the whole network (its buffers and point values included)
        lik = fitted.likelihood
        f, f0 = fitted.forward_draws(draws, x), fitted.forward_draws({k: v[None] for k, v in mean.items()}, x)
        expected = float(
            (lik.distribution(f0, {}).log_prob(y).sum(-1) - lik.distribution(f, {}).log_prob(y).sum(-1)).mean()
        )
    assert excess == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_gamma_is_formed_only_for_the_fits_whose_quadratic_excess_is_judged(monkeypatch):
    """gamma = tr(H^-1 G) is a dense O(k^3) solve with k right-hand sides: it used to run on every dense Laplace fit
    (regressions, Pyro functions, full nets), though only a classifier linear in its covered weights reads it."""
    from bnn_pyro.infer.laplace import fit as laplace_fit

    calls = []
    original = laplace_fit.effective_parameters
    monkeypatch.setattr(laplace_fit, "effective_parameters", lambda *a, **k: calls.append(1) or original(*a, **k))
    blr = make_blr(n=30, d=3, noise=0.7, seed=1)
    for structure in ("full", "last_layer"):
        post = bp.fit(blr.model(), blr.x, blr.y, method="laplace", structure=structure, seed=0, progress=False)
        assert "quadratic_excess" not in post.config
    assert calls == []
    g = torch.Generator().manual_seed(0)
    y = torch.arange(60) % 2
    x = torch.randn(60, 2, generator=g) + y[:, None]
    post = bp.fit(_classifier(2, 2), x, y, method="laplace", num_chains=2, seed=0, progress=False)
    assert calls == [1, 1] and len(post.config["quadratic_excess"]) == 2


def _classifier(d: int, k: int, likelihood=None) -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d, k))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood or bp.likelihoods.Categorical())


def _fit(model, x, y):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="laplace", seed=0, progress=False)
    return post, [w for w in caught if issubclass(w.category, DiagnosticWarning)]


@pytest.mark.parametrize("likelihood, outputs", [(bp.likelihoods.Categorical(), 2), (bp.likelihoods.Bernoulli(), 1)])
def test_overlapping_classes_match_the_quadratic_model_and_do_not_warn(likelihood, outputs):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 2
    x = 0.5 * torch.randn(200, 2, generator=g)
    x[:, 0] += 0.3 * (2 * y - 1)  # the classes overlap: no row is fitted with certainty
    post, caught = _fit(_classifier(2, outputs, likelihood), x, y)
    record = post.config["quadratic_excess"]
    approx = lap.laplace_approximation(
        _classifier(2, outputs, likelihood), Data(x=x, y=y if outputs > 1 else y.float()), seed=0
    )
    assert record["expected"] == pytest.approx(approx.effective_parameters / 2, rel=1e-6)  # the fit's own Gaussian
    m = approx.mean[approx.active].double()
    linear = float(m @ approx.covariance() @ m)  # g^T Sigma g, g = -P m with P = I (the N(0, 1) prior)
    se = math.sqrt((linear + record["expected"]) / DRAWS)  # tr((G Sigma)^2) / 2 <= gamma / 2 (quadratic.DRAWS)
    assert abs(record["excess"] - record["expected"]) < 4 * se, record
    assert not [w for w in caught if "far wider than the posterior" in str(w.message)], caught


def test_an_interpolating_classifier_with_large_features_warns_at_the_defaults():
    g = torch.Generator().manual_seed(0)
    x = 3.0 * torch.randn(40, 20, generator=g)  # 40 rows, 63 weights: every row fitted with certainty
    y = (x @ torch.randn(20, 3, generator=g)).argmax(1)
    post, caught = _fit(_classifier(20, 3), x, y)
    record = post.config["quadratic_excess"]
    assert record["excess"] > QUADRATIC_RATIO_MAX * record["expected"], record
    (w,) = [w for w in caught if "far wider than the posterior" in str(w.message)]
    assert (
        str(w.message).startswith("laplace: ") and "method='nuts'" in str(w.message) and "docs/ood.md" in str(w.message)
    )
    assert w.filename == __file__  # at the user's line
