"""A fit that "predicts the mean" while a learned noise absorbs the targets' variance warns, whatever the engine
(issue 26; ``bnn_pyro/infer/_health.py``'s ``check_noise_collapse``, run by ``bp.fit``). The collapsed case is the
zoo's ``mlp_regression`` card fitted by mean-field SVI at the card's settings (its best ELBO there:
``benchmarks/results/zoo_svi_collapse/``); the fits that must stay quiet are the same card with ``kl_warmup=0.9``
(it uses the data) and the same collapse on targets without signal (explaining nothing is right there)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import bnn_pyro as bp
import bnn_pyro.infer
from bnn_pyro.infer import _health
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

COLLAPSE = "predicts the mean and its learned noise absorbs the rest"
IGNORES = "the posterior ignores the data"  # check_predictive's warning
NOISE = "the learned noise sd"  # check_learned_noise's warning


def _card_fit(*, y=None, **extra):
    entry = bp.zoo.load("mlp_regression", seed=0)
    options = {k: v for k, v in entry.fit_defaults["svi"].items() if k not in ("seed", "progress", "method")}
    y = entry.y if y is None else y
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(entry.model, entry.x, y, method="svi", seed=0, progress=False, **{**options, **extra})
    return post, [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


def _r2_and_noise(post) -> tuple[float, float]:
    """The predictive mean's R^2 on the training rows and the noise sd's posterior median over sd(y), computed here
    from the posterior's own predictions (not through the check)."""
    y = post.y.double().reshape(-1)
    mean = post.predict(post.x, seed=0).mean.double().reshape(-1)
    r2 = 1.0 - float((mean - y).pow(2).mean() / (y - y.mean()).pow(2).mean())
    return r2, float(post.samples["sigma"].double().median()) / float(y.std())


@pytest.fixture(scope="module")
def collapsed():
    return _card_fit()


@pytest.fixture(scope="module")
def uses_the_data():
    return _card_fit(kl_warmup=0.9)


def test_collapsed_fit_warns_once_with_its_figures_and_advice(collapsed):
    """One cause, one warning: the fit also ignores the data and its noise is at the targets' sd, but those symptoms
    (check_predictive's and check_learned_noise's warnings, which it gave before) are the collapse's, said in it."""
    post, messages = collapsed
    r2, ratio = _r2_and_noise(post)
    assert r2 < _health.COLLAPSE_R2_MAX and ratio >= _health.COLLAPSE_NOISE_MIN  # the case the check is for
    assert len(messages) == 1 and COLLAPSE in messages[0], messages  # no other DiagnosticWarning at all
    text = messages[0]
    assert f"{ratio:.2f} of the targets' sd" in text and "out of sample (leave-one-out)" in text
    for advice in (
        "bp.likelihoods.Gaussian(scale=...)",
        "HalfNormal",
        "kl_warmup=0.9",
        "guide='low_rank' or 'full_rank'",
        "method='nuts'",
    ):
        assert advice in text, text


def test_a_fit_that_uses_the_data_is_quiet(uses_the_data):
    post, messages = uses_the_data
    r2, ratio = _r2_and_noise(post)
    assert r2 > 0.5 and ratio < 0.6  # it uses the data (measured, seed 0: R^2 0.94, noise sd 0.44 of sd(y))
    assert not [m for m in messages if COLLAPSE in m], messages


def _with_noise(post, ratio: float):
    """A shallow copy of ``post`` whose every noise draw is ``ratio`` times sd(y) (the fit's f draws kept)."""
    out = copy.copy(post)
    sigma = post.samples["sigma"]
    out.samples = {**post.samples, "sigma": torch.full_like(sigma, ratio * float(post.y.double().std()))}
    return out


def _said(post) -> list[str]:
    """The DiagnosticWarnings of an SVI fit's checks (check_svi, in the engine) and bp.fit's collapse check."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        _health.check_svi(post)
        _health.check_noise_collapse(post)
    return [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


def test_ignoring_the_data_without_a_collapse_keeps_its_own_warning(collapsed):
    """The collapsed fit's f draws with a noise of half sd(y): no collapse (the noise absorbs too little), so the
    predictive check says that the posterior ignores the data, alone of the three."""
    said = _said(_with_noise(collapsed[0], 0.5))
    assert [m for m in said if IGNORES in m] and not [m for m in said if NOISE in m or COLLAPSE in m], said


def test_a_learned_noise_at_the_targets_sd_without_a_collapse_keeps_its_own_warning(uses_the_data):
    """A fit that uses the data (R^2 0.94) given a noise of 1.5 sd(y): no collapse (its mean explains y), so the
    learned-noise check says so, alone of the three."""
    said = _said(_with_noise(uses_the_data[0], 1.5))
    assert [m for m in said if NOISE in m] and not [m for m in said if IGNORES in m or COLLAPSE in m], said


def test_the_same_collapse_on_targets_without_signal_is_quiet():
    entry = bp.zoo.load("mlp_regression", seed=0)
    y = entry.y[torch.randperm(len(entry.y), generator=torch.Generator().manual_seed(0))]  # x no longer tells y
    post, messages = _card_fit(y=y)
    r2, ratio = _r2_and_noise(post)
    assert r2 < _health.COLLAPSE_R2_MAX and ratio >= _health.COLLAPSE_NOISE_MIN  # collapsed, as it should be here
    assert not [m for m in messages if COLLAPSE in m], messages
    # no collapse is said, so the checks that see its symptoms keep theirs
    assert [m for m in messages if IGNORES in m] and [m for m in messages if NOISE in m], messages


def test_bp_fit_runs_the_check_for_any_engine(collapsed, monkeypatch):
    post, _ = collapsed
    monkeypatch.setattr(bnn_pyro.infer, "engine", lambda kind: lambda model, data, **config: post)
    with pytest.warns(DiagnosticWarning, match=COLLAPSE):
        bp.fit(post.model, post.x, post.y, method="nuts", progress=False)


def test_reference_r2_ridge_is_exact_leave_one_out():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        30, generator=g, dtype=torch.float64
    )
    xs = (x - x.mean(0)) / x.std(0)
    design = torch.cat([torch.ones(30, 1, dtype=x.dtype), xs], 1)
    penalty = torch.diag(torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=x.dtype))  # the intercept is not penalized
    errors = []
    for i in range(30):  # refit without row i, predict it
        keep = torch.arange(30) != i
        a, b = design[keep], y[keep]
        coef = torch.linalg.solve(a.T @ a + penalty, a.T @ b)
        errors.append(float(y[i] - design[i] @ coef))
    brute = 1.0 - sum(e * e for e in errors) / float((y - y.mean()).pow(2).sum())
    value, which = _health.reference_r2(x, y)
    assert which == "ridge regression" and value == pytest.approx(brute, rel=1e-9)


def test_reference_r2_finds_a_nonlinear_signal_and_no_signal_in_noise():
    g = torch.Generator().manual_seed(1)
    x = torch.linspace(-2, 2, 80).unsqueeze(-1)
    signal, which = _health.reference_r2(x, torch.sin(3 * x).squeeze(-1) + 0.1 * torch.randn(80, generator=g))
    assert signal > 0.9 and "nearest-neighbour" in which  # a straight line misses sin(3x); the neighbours do not
    noise, _ = _health.reference_r2(x, torch.randn(80, generator=g))
    assert noise < _health.COLLAPSE_SIGNAL_MIN
