"""bnn_pyro.metrics: exact answers on hand-computed examples, closed forms, and clear errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import metrics, predictions

# Four rows, three classes, binned with n_bins=4 (edges 0, .25, .5, .75, 1):
#   conf .9 (bin 3, correct), .8 (bin 3, wrong), .6 (bin 2, correct), .4 (bin 1, wrong)
PROBS = torch.tensor([[0.9, 0.05, 0.05], [0.8, 0.1, 0.1], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25]])
LABELS = torch.tensor([0, 1, 0, 1])


# ---------------------------------------------------------------------------------------- classification
def test_hand_computed_classification_metrics():
    # ECE = (2 |0.5 - 0.85| + |1 - 0.6| + |0 - 0.4|) / 4 = 0.375
    assert metrics.ece(PROBS, LABELS, n_bins=4) == pytest.approx(0.375, abs=1e-6)
    # Brier = (0.015 + 1.46 + 0.26 + 0.645) / 4
    assert metrics.brier(PROBS, LABELS) == pytest.approx(0.595, abs=1e-6)
    assert metrics.accuracy(PROBS, LABELS) == 0.5
    expected_nll = -(math.log(0.9) + math.log(0.1) + math.log(0.6) + math.log(0.35)) / 4
    assert metrics.nll(PROBS, LABELS) == pytest.approx(expected_nll, rel=1e-6)
    conf, acc, counts = metrics.reliability_curve(PROBS, LABELS, n_bins=4)
    assert counts.tolist() == [0, 1, 1, 2]
    assert torch.isnan(conf[0]) and torch.isnan(acc[0])  # empty bin
    np.testing.assert_allclose(conf[1:].numpy(), [0.4, 0.6, 0.85], atol=1e-6)
    np.testing.assert_allclose(acc[1:].numpy(), [0.0, 1.0, 0.5])


def test_metrics_accept_a_classification_prediction():
    pred = predictions.classification(PROBS[None].expand(3, -1, -1))
    # (the float32 average of three equal draws may differ from PROBS in the last bit)
    assert metrics.ece(pred, LABELS, n_bins=4) == pytest.approx(metrics.ece(PROBS, LABELS, n_bins=4), abs=1e-6)
    assert metrics.brier(pred, LABELS) == pytest.approx(metrics.brier(PROBS, LABELS), abs=1e-6)
    assert metrics.accuracy(pred, LABELS) == metrics.accuracy(PROBS, LABELS)
    assert metrics.nll(pred, LABELS) == pytest.approx(metrics.nll(PROBS, LABELS), rel=1e-6)


def test_binary_probability_vector_and_binary_brier():
    p1 = torch.tensor([0.2, 0.7, 0.9, 0.4])
    y = torch.tensor([0, 1, 0, 1])
    # the multi-class Brier of two classes is twice the binary (p1 - y)^2
    assert metrics.brier(p1, y) == pytest.approx(2 * float(((p1 - y) ** 2).mean()), abs=1e-6)
    assert metrics.accuracy(p1, y) == 0.5


def test_constant_overconfidence_has_exact_ece():
    # every row says 70% for class 0, but exactly 60% of the labels are 0: one bin, ECE = 0.1
    probs = torch.tensor([[0.7, 0.3]]).expand(100, 2)
    y = (torch.arange(100) >= 60).long()
    assert metrics.ece(probs, y) == pytest.approx(0.1, abs=1e-6)


def test_perfectly_calibrated_probabilities_have_near_zero_ece():
    """y ~ Bernoulli(p) exactly, so each bin's expected accuracy equals its mean confidence; only
    Monte Carlo error remains, at most sd_b = sqrt(c_b (1 - c_b) / n_b) per bin. The tolerance is
    4 sd per bin, weighted as in the ECE."""
    g = torch.Generator().manual_seed(0)
    n, bins = 20_000, 10
    p1 = torch.rand(n, generator=g, dtype=torch.float64)
    y = torch.bernoulli(p1, generator=g).long()
    probs = torch.stack([1 - p1, p1], -1)
    conf, _, counts = metrics.reliability_curve(probs, y, n_bins=bins)
    filled = counts > 0
    c, k = conf[filled], counts[filled].double()
    tolerance = float((k / n * 4 * (c * (1 - c) / k).sqrt()).sum())
    assert tolerance < 0.03
    assert metrics.ece(probs, y, n_bins=bins) < tolerance
    # and a miscalibrated forecast (probabilities squeezed toward 1/2) is clearly detected
    squeezed = 0.5 + 0.5 * (probs - 0.5)
    assert metrics.ece(squeezed, y, n_bins=bins) > 0.1


def test_reliability_curve_bins_like_numpy_digitize():
    """Left-closed bins on numpy's linspace edges, the last bin taking confidence 1 (the rule the
    reliability plot always used), including confidences exactly on an edge."""
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(500, 4, generator=g)
    probs = torch.softmax(logits, -1)
    probs[:3] = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    y = torch.randint(4, (500,), generator=g)
    bins = 10
    conf, pred = probs.max(-1)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf.numpy(), edges[1:-1]), 0, bins - 1)
    counts = np.bincount(which, minlength=bins)
    acc = np.bincount(which, (pred == y).double().numpy(), bins) / np.maximum(counts, 1)
    mean_conf = np.bincount(which, conf.double().numpy(), bins) / np.maximum(counts, 1)
    ours_conf, ours_acc, ours_counts = metrics.reliability_curve(probs, y, n_bins=bins)
    assert ours_counts.tolist() == counts.tolist()
    filled = counts > 0
    np.testing.assert_allclose(ours_conf.numpy()[filled], mean_conf[filled], rtol=1e-12)
    np.testing.assert_allclose(ours_acc.numpy()[filled], acc[filled], rtol=1e-12)
    expected_ece = float(np.sum(counts / counts.sum() * np.abs(acc - mean_conf)))
    assert metrics.ece(probs, y, n_bins=bins) == pytest.approx(expected_ece, rel=1e-12)


# ---------------------------------------------------------------------------------------- AUROC
def test_auroc_hand_example_and_extremes():
    # pairs (out, in): 2>1, 2=2 (half), 2<3, 4>1, 4>2, 4>3 -> 4.5 / 6
    assert metrics.ood_auroc(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0])) == 0.75
    assert metrics.ood_auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 1.0
    assert metrics.ood_auroc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 0.0


def test_auroc_of_identical_samples_is_one_half_exactly():
    scores = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    assert metrics.ood_auroc(scores, scores.flip(0)) == 0.5
    assert metrics.ood_auroc(torch.zeros(7), torch.zeros(3)) == 0.5


def test_auroc_equals_brute_force_mann_whitney_with_ties():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 10, (57,), generator=g).double()
    b = torch.randint(3, 13, (41,), generator=g).double()
    wins = (b[:, None] > a[None, :]).double() + 0.5 * (b[:, None] == a[None, :]).double()
    assert metrics.ood_auroc(a, b) == pytest.approx(float(wins.mean()), abs=1e-12)


def test_auroc_takes_a_score_of_classification_predictions():
    sure = predictions.classification(torch.tensor([[[0.99, 0.01], [0.95, 0.05]]]))
    unsure = predictions.classification(torch.tensor([[[0.5, 0.5], [0.6, 0.4]]]))
    assert metrics.ood_auroc(sure, unsure) == 1.0
    assert metrics.ood_auroc(sure, unsure, score="aleatoric_entropy") == 1.0
    # one draw: no disagreement between draws, so the mutual information is 0 everywhere (ties)
    assert metrics.ood_auroc(sure, unsure, score="mutual_information") == 0.5


# ---------------------------------------------------------------------------------------- regression
def _gaussian_prediction(means, variances, draws=None):
    means, variances = torch.as_tensor(means), torch.as_tensor(variances)
    return predictions.regression(means, variances, means if draws is None else draws)


def test_rmse_closed_form():
    y = torch.tensor([3.0, 4.0])
    assert metrics.rmse(torch.zeros(2), y) == pytest.approx(math.sqrt(12.5))
    assert metrics.rmse(_gaussian_prediction(torch.zeros(1, 2), torch.ones(1, 2)), y[:, None]) == pytest.approx(
        math.sqrt(12.5)
    )


def test_nll_of_one_gaussian_matches_the_closed_form():
    mu, sigma = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.3, 1.0, 2.5])
    y = torch.tensor([0.1, 0.0, 5.0])
    pred = _gaussian_prediction(mu[None], (sigma**2)[None])
    expected = float(
        (0.5 * torch.log(2 * math.pi * sigma.double() ** 2) + (y - mu).double() ** 2 / (2 * sigma.double() ** 2)).mean()
    )
    assert metrics.nll(pred, y) == pytest.approx(expected, rel=1e-6)


def test_nll_of_a_prediction_is_the_mixture_over_draws():
    # two draws with means -1 and +1 and unit noise: at y = 0 both components give N(1; 0, 1)
    pred = _gaussian_prediction(torch.tensor([[-1.0], [1.0]]), torch.ones(2, 1))
    assert metrics.nll(pred, torch.zeros(1)) == pytest.approx(0.5 * math.log(2 * math.pi) + 0.5, rel=1e-6)
    # at y = 1 the mixture is (N(2; 0, 1) + N(0; 0, 1)) / 2, not a Gaussian with the total variance 2
    mixture = 0.5 * (math.exp(-2.0) + 1.0) / math.sqrt(2 * math.pi)
    assert metrics.nll(pred, torch.ones(1)) == pytest.approx(-math.log(mixture), rel=1e-6)


def test_interval_coverage_counts_targets_inside_the_bounds():
    pred = _gaussian_prediction(torch.zeros(1, 4), torch.ones(1, 4))
    pred = dataclasses.replace(
        pred, lower=torch.tensor([-1.0, -1.0, 0.0, 0.0]), upper=torch.tensor([1.0, 1.0, 2.0, 2.0])
    )
    assert metrics.interval_coverage(pred, torch.tensor([0.0, 1.0, 2.5, -0.1])) == 0.5


# ---------------------------------------------------------------------------------------- exact densities
def _linear_posterior(weights, biases, *, scale=0.5):
    """A BNN ``y = w x + b + N(0, scale^2)`` whose posterior is the given draws (one chain)."""
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=scale)
    )
    w = torch.tensor(weights).reshape(1, -1, 1, 1)
    b = torch.tensor(biases).reshape(1, -1, 1)
    return bp.Posterior(samples={"weight": w, "bias": b}, model=model, method="hand")


def _function_posterior():
    """A Posterior of a plain Pyro function model (pit and predictive_interval need a bp.BNN)."""

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=y)

    return bp.Posterior(samples={"w": torch.zeros(1, 3)}, model=model, method="hand")


X = torch.tensor([[-1.0], [0.0], [2.0]])
Y = torch.tensor([-0.5, 0.4, 2.5])


def test_log_predictive_density_of_one_draw_is_the_gaussian_log_density():
    post = _linear_posterior([1.2], [0.3])
    expected = dist.Normal(1.2 * X[:, 0] + 0.3, 0.5).log_prob(Y)
    torch.testing.assert_close(metrics.log_predictive_density(post, X, Y), expected)
    assert metrics.test_log_likelihood(post, X, Y) == pytest.approx(float(expected.mean()), rel=1e-6)
    assert metrics.nll(post, X, Y) == pytest.approx(-float(expected.mean()), rel=1e-6)


def test_log_predictive_density_is_the_mixture_over_draws():
    post = _linear_posterior([1.2, 0.8], [0.3, -0.1])
    p = (
        dist.Normal(1.2 * X[:, 0] + 0.3, 0.5).log_prob(Y).exp()
        + dist.Normal(0.8 * X[:, 0] - 0.1, 0.5).log_prob(Y).exp()
    ) / 2
    torch.testing.assert_close(metrics.log_predictive_density(post, X, Y[:, None]), p.log())
    # with fixed noise, the prediction-based mixture is exact too
    assert metrics.nll(post.predict(X), Y) == pytest.approx(metrics.nll(post, X, Y), rel=1e-5)
    # one of the two draws, picked by flat index
    one = metrics.log_predictive_density(post, X, Y, draws=torch.tensor([1]))
    torch.testing.assert_close(one, dist.Normal(0.8 * X[:, 0] - 0.1, 0.5).log_prob(Y))


def test_log_predictive_density_of_a_plain_pyro_model():
    def linreg(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(w * x[:, 0] + b, 0.5), obs=y)

    post = bp.Posterior(
        samples={"w": torch.tensor([[1.2, 0.8]]), "b": torch.tensor([[0.3, -0.1]])}, model=linreg, method="hand"
    )
    torch.testing.assert_close(
        metrics.log_predictive_density(post, X, Y),
        metrics.log_predictive_density(_linear_posterior([1.2, 0.8], [0.3, -0.1]), X, Y),
    )


@pytest.mark.parametrize(
    "likelihood, outputs, classes", [(bp.likelihoods.Categorical(), 3, 3), (bp.likelihoods.Bernoulli(), 1, 2)]
)
def test_classifier_nll_from_posterior_equals_nll_of_its_prediction(likelihood, outputs, classes):
    """For a classifier the prediction's probabilities are the exact model average, so both routes agree."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    model = bp.BNN(torch.nn.Linear(2, outputs), prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    post = bp.Posterior(
        samples={"weight": torch.randn(2, 5, outputs, 2, generator=g), "bias": torch.randn(2, 5, outputs, generator=g)},
        model=model,
        method="hand",
    )
    x, y = torch.randn(20, 2, generator=g), torch.randint(classes, (20,), generator=g)
    assert metrics.nll(post, x, y) == pytest.approx(metrics.nll(post.predict(x), y), rel=1e-5)


def test_metrics_is_reachable_from_the_package():
    assert bp.metrics is metrics


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: metrics.ece(torch.tensor([[0.5, 0.6]]), torch.tensor([0])),
            ValueError,
            r"probs: each row .* sum to 1",
        ),
        (
            lambda: metrics.brier(torch.tensor([[2.0, -1.0]]), torch.tensor([0])),
            ValueError,
            r"probs: .*\[0, 1\].*softmax",
        ),
        (lambda: metrics.accuracy(PROBS, LABELS[:3]), ValueError, r"y has 3 labels but prediction has 4 rows"),
        (lambda: metrics.accuracy(PROBS, torch.tensor([0, 1, 2, 3])), ValueError, r"labels must lie in 0..2"),
        (lambda: metrics.accuracy(PROBS, torch.tensor([0.5, 1, 2, 0])), TypeError, r"y: expected integer class labels"),
        (lambda: metrics.ece(PROBS, LABELS, n_bins=0), ValueError, r"n_bins must be a positive int"),
        (lambda: metrics.ece(PROBS[None], LABELS), ValueError, r"probs: expected class probabilities shaped \(N, K\)"),
        (lambda: metrics.rmse(torch.zeros(3), torch.zeros(4)), ValueError, r"y has shape \(4,\) but pred_or_mean"),
        (lambda: metrics.rmse(predictions.classification(PROBS[None]), LABELS), TypeError, r"rmse is for regression"),
        (lambda: metrics.nll(PROBS), TypeError, r"nll\(prediction, y\)"),
        (lambda: metrics.nll(_linear_posterior([1.0], [0.0]), X), TypeError, r"nll\(posterior, x, y\)"),
        (lambda: metrics.log_predictive_density(PROBS, X, Y), TypeError, r"posterior: expected a bnn_pyro.Posterior"),
        (
            lambda: metrics.log_predictive_density(_linear_posterior([1.0], [0.0]), X, Y[:2]),
            ValueError,
            r"x has 3, y has 2",
        ),
        (
            lambda: metrics.pit(_linear_posterior([1.0], [0.0]), X, Y[:2]),
            ValueError,
            r"x has 3, y has 2\. Each row of x needs one row of y",
        ),
        (lambda: metrics.interval_coverage(PROBS, LABELS), TypeError, r"prediction: expected a RegressionPrediction"),
        (
            lambda: metrics.pit(PROBS, X, Y),
            TypeError,
            r"posterior: expected a bnn_pyro.Posterior of a bp.BNN .* got Tensor",
        ),
        (
            lambda: metrics.predictive_interval(_function_posterior(), X),
            TypeError,
            r"posterior: expected a bnn_pyro.Posterior of a bp.BNN regression model, got Posterior of a Pyro function",
        ),
        (lambda: metrics.ood_auroc(torch.zeros(2, 2), torch.zeros(2)), ValueError, r"scores_in: expected one score"),
        (lambda: metrics.ood_auroc(torch.zeros(2), torch.tensor([])), ValueError, r"scores_out is empty"),
        (lambda: metrics.ood_auroc(torch.zeros(2), torch.zeros(2), score="max"), ValueError, r"score: unknown value"),
        (
            lambda: metrics.brier(torch.tensor([[float("nan"), 1.0]]), torch.tensor([0])),
            ValueError,
            r"probs contains NaN",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------- regression calibration
def test_regression_calibration_error_exact_cases():
    # PIT values on the midpoints of 1000 equal cells: every central interval at 0.1..0.9 holds exactly c
    u = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    assert metrics.regression_calibration_error(u) == pytest.approx(0.0, abs=1e-12)
    # all mass at the median: every central interval covers everything, error = mean(1 - c) = 0.5
    assert metrics.regression_calibration_error(torch.full((10,), 0.5)) == pytest.approx(0.5, abs=1e-12)
    assert metrics.regression_calibration_error(torch.tensor([0.0, 1.0]), levels=[0.5]) == pytest.approx(0.5)


def test_regression_calibration_error_of_an_overconfident_gaussian_matches_the_closed_form():
    # y ~ N(0, 2^2) scored by the predictive N(0, 1): coverage_c = P(|2 Z| <= z_c) = 2 Phi(z_c / 2) - 1
    n = 100_000
    y = 2.0 * torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    c = torch.arange(1, 10, dtype=torch.float64) / 10
    exact = float((2 * normal.cdf(normal.icdf((1 + c) / 2) / 2) - 1 - c).abs().mean())
    # each empirical coverage has sd <= sqrt(0.25 / n) = 0.0016; 4 sd bounds the mean of their errors
    assert metrics.regression_calibration_error(normal.cdf(y)) == pytest.approx(exact, abs=4 * math.sqrt(0.25 / n))
    assert exact > 0.15  # far from calibrated, so the check has teeth


def test_regression_calibration_error_rejects_bad_input():
    with pytest.raises(ValueError, match="pit_values"):
        metrics.regression_calibration_error(torch.tensor([0.2, 1.5]))
    with pytest.raises(ValueError, match="levels"):
        metrics.regression_calibration_error(torch.tensor([0.2]), levels=[0.0, 0.5])


def test_pit_is_the_mixture_cdf_over_posterior_draws(svi_post, linear_data):
    x, y = linear_data
    pred = svi_post.predict(x, interval=None)  # every draw, in order, as pit uses them; noise sd fixed at 0.1
    expected = torch.distributions.Normal(pred.mean_draws.double(), 0.1).cdf(y.double()).mean(0)
    torch.testing.assert_close(metrics.pit(svi_post, x, y), expected, rtol=1e-5, atol=1e-6)


def test_pit_needs_a_bnn_posterior(function_post, linear_data):
    with pytest.raises(TypeError, match="posterior"):
        metrics.pit(function_post, *linear_data)
