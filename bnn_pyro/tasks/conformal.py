"""Split-conformal prediction on top of any engine's predictive (Vovk et al.; Angelopoulos & Bates 2021).

Fit on ``n`` held-out calibration rows (not used for training): each gets a nonconformity score
``s_i``, and ``q = `` the ``ceil((n + 1)(1 - alpha))``-th smallest score (infinite when that exceeds
``n``). For a new exchangeable row, the set ``{y : s(x, y) <= q}`` covers the truth with probability
at least ``1 - alpha`` whatever the model, and (scores without ties) at most ``1 - alpha + 1/(n + 1)``.
The posterior only shapes the sets: a good predictive gives small ones.

Regression scores (:class:`ConformalRegressor`): ``"absolute"`` ``|y - mean|`` (constant width),
``"normalized"`` ``|y - mean| / std`` (the predictive sd: wider where the posterior is unsure),
``"epistemic"`` ``|y - mean| / epistemic_std``. With several outputs each output gets its own ``q``.

Classification sets (:class:`ConformalClassifier`): APS (Romano et al. 2020). Sort the classes by
predictive probability; a label's score is the probability mass of the classes ranked above it plus
``u`` times its own (``u ~ U(0, 1)``, ``randomized=True``; ``u = 1`` otherwise, which only adds
coverage). RAPS (Angelopoulos et al. 2021) adds ``lam * max(0, rank - k_reg)`` (rank from 1) to
penalize large sets; ``lam=0`` is APS.

Example
-------
>>> from bnn_pyro import conformal
>>> cr = conformal.ConformalRegressor.fit(post.predict(x_cal), y_cal, alpha=0.1, score="normalized")
>>> pred = cr(post.predict(x_test))                      # lower / upper: a 90% conformal interval
>>> cc = conformal.ConformalClassifier.fit(clf.predict(x_cal), y_cal, alpha=0.1)
>>> sets = cc(clf.predict(x_test))                       # bool (N, K): the classes in each set
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from bnn_pyro.predictions import RegressionPrediction
from bnn_pyro.utils.checks import positive_int, probability
from bnn_pyro.utils.targets import probs_and_labels, regression_target

__all__ = ["REGRESSION_SCORES", "conformal_quantile", "ConformalRegressor", "ConformalClassifier"]

REGRESSION_SCORES = ("absolute", "normalized", "epistemic")


def conformal_quantile(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ``ceil((n + 1)(1 - alpha))``-th smallest of ``scores`` along dim 0 (``inf`` past ``n``)."""
    alpha = probability("alpha", alpha, suggestion="try 0.1 for 90% coverage")
    n = scores.shape[0]
    if n == 0:
        raise ValueError("scores: the calibration set is empty; hold out some rows (e.g. 20% of the data).")
    rank = math.ceil((n + 1) * (1.0 - alpha))
    if rank > n:
        return torch.full(scores.shape[1:], float("inf"), dtype=scores.dtype)
    return scores.sort(0).values[rank - 1]


def _regression_scale(pred: RegressionPrediction, score: str) -> torch.Tensor:
    if score == "absolute":
        return torch.ones_like(pred.mean)
    scale = pred.std if score == "normalized" else pred.epistemic_std
    if not (scale > 0).all():
        raise ValueError(
            f"score: {score!r} divides by the prediction's "
            f"{'std' if score == 'normalized' else 'epistemic_std'}, which has zeros; "
            "use score='absolute'."
        )
    return scale


@dataclass(frozen=True)
class ConformalRegressor:
    """Intervals ``mean -+ quantile * scale`` with ``scale`` 1, ``std`` or ``epistemic_std`` by ``score``."""

    quantile: torch.Tensor
    alpha: float
    score: str

    @classmethod
    def fit(cls, pred: RegressionPrediction, y, *, alpha: float = 0.1, score: str = "normalized") -> ConformalRegressor:
        """Calibrate on held-out rows: ``pred = post.predict(x_cal)`` and their targets ``y``."""
        if not isinstance(pred, RegressionPrediction):
            raise TypeError(
                f"pred: expected a RegressionPrediction (post.predict(x_cal) of a regression model), got "
                f"{type(pred).__name__}; for a classifier use ConformalClassifier."
            )
        if score not in REGRESSION_SCORES:
            raise ValueError(
                f"score: unknown value {score!r}; choose one of {', '.join(map(repr, REGRESSION_SCORES))}."
            )
        y = regression_target(y, pred.mean.shape, "pred").to(pred.mean.dtype)
        scores = (y - pred.mean).abs() / _regression_scale(pred, score)
        return cls(conformal_quantile(scores, alpha), float(alpha), score)

    def __call__(self, pred: RegressionPrediction) -> RegressionPrediction:
        """``pred`` with ``lower``/``upper`` the conformal interval and ``interval = 1 - alpha``."""
        if not isinstance(pred, RegressionPrediction):
            raise TypeError(
                f"pred: expected a RegressionPrediction, got {type(pred).__name__}; pass post.predict(x_test)."
            )
        half = self.quantile.to(pred.mean.dtype) * _regression_scale(pred, self.score)
        return dataclasses.replace(pred, lower=pred.mean - half, upper=pred.mean + half, interval=1.0 - self.alpha)


def _aps_scores(probs: torch.Tensor, u: torch.Tensor, lam: float, k_reg: int) -> torch.Tensor:
    """The APS/RAPS score of every class of every row, ``(N, K)``."""
    sorted_p, order = probs.sort(-1, descending=True)
    above = sorted_p.cumsum(-1) - sorted_p  # mass of the classes ranked above
    rank = torch.arange(1, probs.shape[1] + 1, dtype=probs.dtype)
    sorted_scores = above + u[:, None] * sorted_p + lam * (rank - k_reg).clamp_min(0.0)
    return torch.empty_like(sorted_scores).scatter_(-1, order, sorted_scores)


@dataclass(frozen=True)
class ConformalClassifier:
    """Prediction sets by APS (``lam=0``) or RAPS; call it on a prediction for a bool mask ``(N, K)``."""

    quantile: float
    alpha: float
    randomized: bool = True
    lam: float = 0.0
    k_reg: int = 0

    @classmethod
    def fit(
        cls,
        pred,
        y,
        *,
        alpha: float = 0.1,
        randomized: bool = True,
        lam: float = 0.0,
        k_reg: int = 0,
        seed: int | None = 0,
    ) -> ConformalClassifier:
        """Calibrate on held-out rows: ``pred = post.predict(x_cal)`` (or probabilities ``(N, K)``) and labels ``y``."""
        if not (float(lam) >= 0.0 and math.isfinite(float(lam))):
            raise ValueError(f"lam: expected a finite penalty >= 0, got {lam!r}; 0 gives APS, e.g. 0.01 for RAPS.")
        k_reg = positive_int("k_reg", k_reg, allow_zero=True)
        probs, labels = probs_and_labels(pred, y, argname="pred")
        u = _uniforms(len(labels), randomized, seed)
        scores = _aps_scores(probs, u, float(lam), k_reg).gather(1, labels[:, None])[:, 0]
        return cls(float(conformal_quantile(scores, alpha)), float(alpha), bool(randomized), float(lam), k_reg)

    def __call__(self, pred, *, seed: int | None = 1) -> torch.Tensor:
        """The prediction sets: ``sets[n, k]`` is True when class ``k`` is in row ``n``'s set.
        ``seed`` draws the randomization ``u`` of the test rows (use a seed other than the fit's)."""
        probs = probs_and_labels(pred, torch.zeros(_rows(pred), dtype=torch.long), argname="pred")[0]
        u = _uniforms(probs.shape[0], self.randomized, seed)
        return _aps_scores(probs, u, self.lam, self.k_reg) <= self.quantile


def _rows(pred) -> int:
    return (pred.probs if hasattr(pred, "probs") else torch.as_tensor(pred)).shape[0]


def _uniforms(n: int, randomized: bool, seed: int | None) -> torch.Tensor:
    if not randomized:
        return torch.ones(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    return torch.rand(n, generator=g, dtype=torch.float64)
