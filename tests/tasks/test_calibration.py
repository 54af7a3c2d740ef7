"""Post-hoc calibration: temperatures and vector scalings recovered on synthetic logits with known
values (within the maximum-likelihood standard error from the observed information), and recalibrated
regression intervals that cover held-out data within binomial error of nominal."""

from __future__ import annotations

import math

import pytest
import torch

from bnn_pyro import calibration, metrics
from bnn_pyro.predictions import classification, regression


def _standard_errors(nll, theta: torch.Tensor) -> torch.Tensor:
    """sqrt(diag(H^-1)) of the summed NLL at the MLE: the asymptotic standard errors."""
    hessian = torch.autograd.functional.hessian(nll, theta)
    return torch.linalg.inv(hessian.reshape(theta.numel(), -1)).diagonal().sqrt()


def _labels(logits: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]


def test_temperature_is_recovered():
    g = torch.Generator().manual_seed(0)
    z = 3.0 * torch.randn(4000, 5, generator=g, dtype=torch.float64)
    true_t = 2.0
    y = _labels(z / true_t, 1)
    pred = classification(torch.softmax(z, -1)[None])  # one draw: overconfident by a factor 2
    ts = calibration.TemperatureScaling.fit(pred, y)
    log_p = torch.log_softmax(z, -1)

    def nll(t):
        return torch.nn.functional.cross_entropy(log_p / t, y, reduction="sum")

    se = _standard_errors(nll, torch.tensor(ts.temperature, dtype=torch.float64))
    assert abs(ts.temperature - true_t) < 4 * float(se)
    calibrated = ts(pred)
    assert torch.equal(calibrated.predicted, pred.predicted)  # a temperature never changes the argmax
    assert metrics.nll(calibrated, y) < metrics.nll(pred, y)
    assert metrics.ece(calibrated, y) < metrics.ece(pred, y)
    assert torch.equal(calibrated.mutual_information, pred.mutual_information)  # the draws' own


def test_vector_scaling_is_recovered():
    g = torch.Generator().manual_seed(2)
    z = 2.0 * torch.randn(6000, 3, generator=g, dtype=torch.float64)
    w_true = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)
    b_true = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
    log_p = torch.log_softmax(z, -1)
    y = _labels(w_true * log_p + b_true, 3)
    vs = calibration.VectorScaling.fit(torch.softmax(z, -1), y)
    assert vs.bias[0] == 0.0

    def nll(theta):
        return torch.nn.functional.cross_entropy(
            theta[:3] * log_p + torch.cat([theta.new_zeros(1), theta[3:]]), y, reduction="sum"
        )

    theta = torch.cat([vs.weight, vs.bias[1:]])
    se = _standard_errors(nll, theta)
    assert ((theta - torch.cat([w_true, b_true[1:]])).abs() < 4 * se).all()
    probs = vs(torch.softmax(z, -1))
    assert probs.shape == (6000, 3) and torch.allclose(probs.sum(-1), torch.ones(6000, dtype=torch.float64))


def _regression_pred(x: torch.Tensor, believed_sd: float, seed: int):
    """A fixed predictor of y = sin(3x) that believes its noise sd is ``believed_sd``: 400 draws."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.sin(3 * x).expand(400, -1)
    var = torch.full_like(mean, believed_sd**2)
    return regression(mean, var, mean + believed_sd * torch.randn(mean.shape, generator=g, dtype=x.dtype), interval=0.9)


def _data(n: int, seed: int, sd: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2
    return x, torch.sin(3 * x) + sd * torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("method", ["quantile", "scale"])
def test_recalibrated_regression_intervals_cover_nominal(method):
    n_cal, n_test, level = 1000, 3000, 0.9
    x_cal, y_cal = _data(n_cal, 0)
    x_test, y_test = _data(n_test, 1)
    before = _regression_pred(x_test, 0.2, 3)  # the truth has sd 0.3: 90% intervals cover ~ 73%
    assert metrics.interval_coverage(before, y_test) < 0.8
    if method == "quantile":
        fitted = calibration.QuantileRecalibration.fit(_regression_pred(x_cal, 0.2, 2), y_cal)
        after = fitted(before, interval=level)
    else:
        fitted = calibration.ScaleRecalibration.fit(_regression_pred(x_cal, 0.2, 2), y_cal)
        assert fitted.factor == pytest.approx(1.5, rel=4 / math.sqrt(2 * n_cal))  # sd of a sd estimate ~ 1/sqrt(2n)
        after = fitted(before)
        assert torch.allclose(after.std, fitted.factor * before.std)
    # binomial error of the test coverage plus that of the calibration quantiles (two tails)
    tol = 4 * math.sqrt(level * (1 - level) / n_test + 2 * (1 - level) / 2 * (1 + level) / 2 / n_cal)
    assert metrics.interval_coverage(after, y_test) == pytest.approx(level, abs=tol)


def test_quantile_recalibration_warns_when_the_draws_are_too_narrow():
    x_cal, y_cal = _data(500, 0)
    fitted = calibration.QuantileRecalibration.fit(_regression_pred(x_cal, 0.05, 2), y_cal)
    with pytest.warns(UserWarning, match="ScaleRecalibration"):
        fitted(_regression_pred(x_cal, 0.05, 3), interval=0.9)


def test_pit_and_level():
    pred = regression(
        torch.zeros(4, 1, dtype=torch.float64),
        torch.ones(4, 1, dtype=torch.float64),
        torch.tensor([[-1.0], [0.0], [1.0], [2.0]], dtype=torch.float64),
        interval=None,
    )
    assert calibration.pit(pred, torch.tensor([0.5])).tolist() == [0.5]
    assert calibration.pit(pred, torch.tensor([1.0])).tolist() == [0.625]  # two below, one tie
    rc = calibration.QuantileRecalibration(torch.tensor([0.1, 0.2, 0.9], dtype=torch.float64))
    assert rc.level(torch.tensor([0.0, 0.15, 0.5, 1.0])).tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_bad_input(classifier_post):
    pred = classifier_post.predict(classifier_post.x)
    with pytest.raises(TypeError, match="RegressionPrediction"):
        calibration.ScaleRecalibration.fit(pred, classifier_post.y)
    with pytest.raises(ValueError, match="y has 3 labels"):
        calibration.TemperatureScaling.fit(pred, classifier_post.y[:3])
    with pytest.raises(ValueError, match="classes"):
        calibration.VectorScaling(torch.ones(2), torch.zeros(2))(pred)
