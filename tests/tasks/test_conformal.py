"""Split-conformal coverage over 200 independent calibration/test draws of a fixed predictor.

With ``n`` calibration rows and continuous scores, the coverage of one split given its calibration
set is Beta(k, n + 1 - k) distributed, ``k = ceil((n + 1)(1 - alpha))``, with mean ``k / (n + 1)``
(between ``1 - alpha`` and ``1 - alpha + 1 / (n + 1)``); the test rows add binomial noise. The mean
over ``R`` independent repetitions must lie within 4 Monte Carlo standard errors of ``k / (n + 1)``."""

from __future__ import annotations

import math

import pytest
import torch

from bnn_pyro import conformal, metrics
from bnn_pyro.predictions import classification, regression

N_CAL, N_TEST, REPS, ALPHA = 50, 200, 200, 0.1  # n = 50: one rank off moves the mean by 1/51 > 4 s.e.
K = math.ceil((N_CAL + 1) * (1 - ALPHA))
EXPECTED = K / (N_CAL + 1)


def _tolerance() -> float:
    beta_var = K * (N_CAL + 1 - K) / ((N_CAL + 1) ** 2 * (N_CAL + 2))
    binomial_var = EXPECTED * (1 - EXPECTED) / N_TEST  # an upper bound on E[c (1 - c)] / n_test
    return 4 * math.sqrt((beta_var + binomial_var) / REPS)


def _regression_split(g: torch.Generator, n: int):
    """Data from y = sin(3x) + (0.1 + 0.3|x|) eps, and a fixed two-draw predictive of it."""
    x = torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2
    noise = 0.1 + 0.3 * x.abs()
    y = torch.sin(3 * x) + noise * torch.randn(n, generator=g, dtype=torch.float64)
    spread = 0.05 * (1 + x**2)  # epistemic sd: the two draws sit at mean -+ spread
    means = torch.stack([torch.sin(3 * x) - spread, torch.sin(3 * x) + spread])
    pred = regression(means, (noise**2).expand(2, -1), means, interval=None)
    return pred, y


@pytest.mark.parametrize("score", ["absolute", "normalized", "epistemic"])
def test_regression_coverage_over_repeated_splits(score):
    g = torch.Generator().manual_seed(0)
    coverage, width = [], []
    for _ in range(REPS):
        fitted = conformal.ConformalRegressor.fit(*_regression_split(g, N_CAL), alpha=ALPHA, score=score)
        pred, y = _regression_split(g, N_TEST)
        out = fitted(pred)
        coverage.append(metrics.interval_coverage(out, y))
        width.append(float((out.upper - out.lower).mean()))
    mean = sum(coverage) / REPS
    assert mean == pytest.approx(EXPECTED, abs=_tolerance())
    assert 1 - ALPHA - _tolerance() <= mean <= 1 - ALPHA + 1 / (N_CAL + 1) + _tolerance()
    if score == "normalized":  # the predictive sd follows the noise: narrower on average than constant width
        absolute = conformal.ConformalRegressor.fit(*_regression_split(g, 2000), alpha=ALPHA, score="absolute")
        pred, _ = _regression_split(g, 2000)
        assert sum(width) / REPS < float((absolute(pred).upper - absolute(pred).lower).mean())


def _classification_split(g: torch.Generator, n: int):
    """Labels from softmax(2 * logits); the predictor reports softmax(logits) over 3 draws (underconfident)."""
    logits = 2.0 * torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(2.0 * logits, -1), 1, generator=g)[:, 0]
    draws = torch.softmax(logits + 0.3 * torch.randn(3, n, 4, generator=g, dtype=torch.float64), -1)
    return classification(draws), y


@pytest.mark.parametrize("lam, randomized", [(0.0, True), (0.2, True), (0.0, False)])
def test_classification_sets_cover_over_repeated_splits(lam, randomized):
    g = torch.Generator().manual_seed(1)
    coverage, size = [], []
    for r in range(REPS):
        fitted = conformal.ConformalClassifier.fit(
            *_classification_split(g, N_CAL), alpha=ALPHA, lam=lam, k_reg=1, randomized=randomized, seed=2 * r
        )
        pred, y = _classification_split(g, N_TEST)
        sets = fitted(pred, seed=2 * r + 1)
        coverage.append(float(sets[torch.arange(N_TEST), y].double().mean()))
        size.append(float(sets.sum(-1).double().mean()))
    mean = sum(coverage) / REPS
    if randomized:  # continuous scores: the exact mean coverage k / (n + 1)
        assert mean == pytest.approx(EXPECTED, abs=_tolerance())
    else:  # u = 1 only enlarges the sets: at least the guarantee
        assert mean >= 1 - ALPHA - _tolerance()
    assert 1.0 < sum(size) / REPS < 4.0  # informative: neither single labels nor every class


def test_aps_scores_and_sets_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    fitted = conformal.ConformalClassifier(quantile=0.8, alpha=0.1, randomized=False)
    assert fitted(probs).tolist() == [[True, True, False]]  # cumulative 0.5, 0.8 <= 0.8, 1.0
    raps = conformal.ConformalClassifier(quantile=0.8, alpha=0.1, randomized=False, lam=0.1, k_reg=1)
    assert raps(probs).tolist() == [[True, False, False]]  # the second class costs 0.8 + 0.1
    # calibration: the score of the true label is the mass up to and including it (u = 1)
    cal = conformal.ConformalClassifier.fit(
        probs.expand(9, 3), torch.tensor([0, 1, 2] * 3), alpha=0.5, randomized=False
    )
    assert cal.quantile == pytest.approx(0.8)  # ceil(10 * 0.5) = 5th smallest of {0.5 x3, 0.8 x3, 1.0 x3}


def test_quantile_rule_and_infinite_sets():
    scores = torch.arange(1.0, 10.0)  # n = 9
    assert float(conformal.conformal_quantile(scores, 0.2)) == 8.0  # ceil(10 * 0.8) = 8th smallest
    assert math.isinf(float(conformal.conformal_quantile(scores, 0.05)))  # ceil(10 * 0.95) = 10 > 9


def test_on_a_fitted_posterior_and_bad_input(svi_post, classifier_post):
    x, y = svi_post.x, svi_post.y
    fitted = conformal.ConformalRegressor.fit(svi_post.predict(x[:20]), y[:20])  # defaults: alpha 0.1, normalized
    out = fitted(svi_post.predict(x[20:]))
    assert out.interval == pytest.approx(0.9) and (out.lower < out.upper).all()
    with pytest.raises(ValueError, match="score: unknown value"):
        conformal.ConformalRegressor.fit(svi_post.predict(x), y, score="studentized")
    with pytest.raises(TypeError, match="ConformalClassifier"):
        conformal.ConformalRegressor.fit(classifier_post.predict(classifier_post.x), classifier_post.y)
    with pytest.raises(ValueError, match=r"alpha must lie in \(0, 1\), got 1\.5"):
        conformal.ConformalClassifier.fit(classifier_post.predict(classifier_post.x), classifier_post.y, alpha=1.5)
    with pytest.raises(ValueError, match=r"lam: expected a finite penalty >= 0, got -1"):
        conformal.ConformalClassifier.fit(classifier_post.predict(classifier_post.x), classifier_post.y, lam=-1)
