"""Post-hoc calibration of a posterior's predictions, fitted on held-out rows (not the training data).

Classification (Guo et al. 2017). A BNN's predictive is a mixture over draws, ``p = (1/S) sum_s p_s``;
both scalings act on its log, ``z = log p`` (not on each draw's logits), so they apply to any
engine's prediction, and to the Bayesian model average that is actually reported:

* :class:`TemperatureScaling`: ``softmax(z / T)``, one ``T > 0`` minimizing the held-out NLL.
  ``T > 1`` softens an overconfident predictive; the predicted class never changes.
* :class:`VectorScaling`: ``softmax(w * z + b)``, a weight and a bias per class (``b_0 = 0``, since a
  common shift of ``b`` changes nothing); it can change the predicted class.

The calibrated prediction has new ``probs``, ``predicted`` and ``entropy``; ``draws``,
``aleatoric_entropy`` and ``mutual_information`` still describe the (uncalibrated) posterior draws.

Regression (Kuleshov et al. 2018):

* :class:`ScaleRecalibration`: multiplies the predictive spread about the mean by ``s``, the Gaussian
  maximum-likelihood factor ``s^2 = (1/N) sum_n ((y_n - mean_n) / std_n)^2``; ``std``, both of its
  parts, ``lower``/``upper`` and the draws are scaled.
* :class:`QuantileRecalibration`: the map ``R(p)`` = fraction of held-out PIT values ``F_n(y_n) <= p``
  (``F_n``: the empirical CDF of the predictive draws at row ``n``), which is monotone, so the isotonic
  fit of Kuleshov et al. is this empirical CDF itself. A central ``c`` interval then takes the draws'
  quantiles at the levels ``R^{-1}((1 -+ c) / 2)``, the held-out PIT quantiles. It cannot reach beyond
  the predictive draws (it warns when held-out targets fall outside them too often): for a predictive
  far too narrow, use :class:`ScaleRecalibration`.

Example
-------
>>> from bnn_pyro import calibration
>>> ts = calibration.TemperatureScaling.fit(post.predict(x_val), y_val)
>>> calibrated = ts(post.predict(x_test))                        # a ClassificationPrediction
>>> rc = calibration.QuantileRecalibration.fit(reg.predict(x_val), y_val)
>>> pred = rc(reg.predict(x_test), interval=0.9)                 # new lower / upper
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from bnn_pyro.predictions import ClassificationPrediction, RegressionPrediction, entropy
from bnn_pyro.utils.checks import probability
from bnn_pyro.utils.targets import probs_and_labels, regression_target
from bnn_pyro.utils.user_warnings import warn

__all__ = ["TemperatureScaling", "VectorScaling", "ScaleRecalibration", "QuantileRecalibration", "pit"]


def _log_probs(pred) -> torch.Tensor:
    probs, _ = probs_and_labels(pred, torch.zeros(_rows(pred), dtype=torch.long), argname="pred")
    return probs.clamp_min(torch.finfo(torch.float64).tiny).log()


def _rows(pred) -> int:
    return (pred.probs if isinstance(pred, ClassificationPrediction) else torch.as_tensor(pred)).shape[0]


def _minimize(params: list[torch.Tensor], loss_fn) -> None:
    opt = torch.optim.LBFGS(
        params, lr=1.0, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    opt.step(closure)


def _calibrated(pred, log_probs: torch.Tensor):
    probs = torch.softmax(log_probs, -1)
    if not isinstance(pred, ClassificationPrediction):
        return probs
    probs = probs.to(pred.probs.dtype)
    return dataclasses.replace(pred, probs=probs, predicted=probs.argmax(-1), entropy=entropy(probs))


@dataclass(frozen=True)
class TemperatureScaling:
    """``softmax(log p / temperature)``; fit with :meth:`fit`, apply by calling on a prediction
    (or probabilities ``(N, K)``, which returns probabilities)."""

    temperature: float

    @classmethod
    def fit(cls, pred, y) -> TemperatureScaling:
        """The temperature minimizing the NLL of held-out labels ``y`` (LBFGS on ``log T``, float64)."""
        z = _log_probs(pred)
        _, labels = probs_and_labels(pred, y, argname="pred")
        log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
        _minimize([log_t], lambda: torch.nn.functional.cross_entropy(z / log_t.exp(), labels))
        return cls(float(log_t.detach().exp()))

    def __call__(self, pred):
        return _calibrated(pred, _log_probs(pred) / self.temperature)


@dataclass(frozen=True)
class VectorScaling:
    """``softmax(weight * log p + bias)`` with a weight and bias per class (``bias[0] = 0``)."""

    weight: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def fit(cls, pred, y) -> VectorScaling:
        """Weights and biases minimizing the NLL of held-out labels ``y`` (LBFGS, float64)."""
        z = _log_probs(pred)
        _, labels = probs_and_labels(pred, y, argname="pred")
        k = z.shape[1]
        w = torch.ones(k, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(k - 1, dtype=torch.float64, requires_grad=True)

        def loss():
            return torch.nn.functional.cross_entropy(w * z + torch.cat([b.new_zeros(1), b]), labels)

        _minimize([w, b], loss)
        return cls(w.detach(), torch.cat([b.new_zeros(1), b.detach()]))

    def __call__(self, pred):
        z = _log_probs(pred)
        if z.shape[1] != len(self.weight):
            raise ValueError(
                f"pred: has {z.shape[1]} classes but this scaling was fitted on {len(self.weight)}; "
                "fit it on held-out predictions of the same model."
            )
        return _calibrated(pred, self.weight * z + self.bias)


def _regression(pred, y=None):
    if not isinstance(pred, RegressionPrediction):
        raise TypeError(
            f"pred: expected a RegressionPrediction (post.predict(x) of a regression model), got "
            f"{type(pred).__name__}; for a classifier use TemperatureScaling or VectorScaling."
        )
    return pred if y is None else (pred, regression_target(y, pred.mean.shape, "pred").to(pred.mean.dtype))


@dataclass(frozen=True)
class ScaleRecalibration:
    """Scale the predictive spread about the mean by ``factor`` (see the module's docstring)."""

    factor: float

    @classmethod
    def fit(cls, pred: RegressionPrediction, y) -> ScaleRecalibration:
        pred, y = _regression(pred, y)
        if not (pred.std > 0).all():
            raise ValueError(
                "pred: its std has zeros; the scale factor needs a positive predictive sd "
                "(use a likelihood with observation noise, or QuantileRecalibration)."
            )
        z = (y.double() - pred.mean.double()) / pred.std.double()
        return cls(float((z**2).mean().sqrt()))

    def __call__(self, pred: RegressionPrediction) -> RegressionPrediction:
        pred = _regression(pred)
        return pred.affine((1.0 - self.factor) * pred.mean, self.factor)  # m + s (y - m), draws and bounds alike


def pit(pred: RegressionPrediction, y) -> torch.Tensor:
    """Probability integral transform ``F_n(y_n)`` per target: the fraction of predictive draws below
    ``y_n`` (ties counted as halves), float64, shaped like ``pred.mean``. Read block by block
    (:meth:`RegressionPrediction.blocks`), in memory bounded by the block size, not draws x points."""
    pred, y = _regression(pred, y)
    out = torch.empty(pred.mean.shape, dtype=torch.float64, device=pred.mean.device)
    for rows, draws in pred.blocks("draws"):
        target = y[rows]
        out[rows] = (draws < target).double().mean(0) + 0.5 * (draws == target).double().mean(0)
    return out


@dataclass(frozen=True)
class QuantileRecalibration:
    """Kuleshov et al.'s recalibration: ``pit_values`` are the sorted held-out PIT values."""

    pit_values: torch.Tensor

    @classmethod
    def fit(cls, pred: RegressionPrediction, y) -> QuantileRecalibration:
        return cls(pit(pred, y).reshape(-1).sort().values)

    def level(self, p) -> torch.Tensor:
        """``R(p)``: the calibrated probability of a predictive level ``p``."""
        p = torch.as_tensor(p, dtype=torch.float64)
        return torch.searchsorted(self.pit_values, p, right=True).double() / len(self.pit_values)

    def __call__(self, pred: RegressionPrediction, interval: float = 0.95) -> RegressionPrediction:
        pred = _regression(pred)
        interval = probability("interval", interval, suggestion="try 0.95 for a central 95% interval")
        alpha = (1.0 - interval) / 2.0
        levels = torch.quantile(self.pit_values, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
        if levels[0] <= 0.0 or levels[1] >= 1.0:
            outside = float(((self.pit_values <= 0.0) | (self.pit_values >= 1.0)).double().mean())
            warn(
                f"the predictive draws are too narrow for a recalibrated {interval:.0%} interval: "
                f"{outside:.1%} of the held-out targets fell outside all draws, and this interval cannot reach beyond "
                "them; use ScaleRecalibration, or predict with more draws.",
                UserWarning,
            )
        q = pred.quantiles(levels)  # block by block: never all draws x points at once
        return dataclasses.replace(pred, lower=q[0], upper=q[1], interval=interval)
