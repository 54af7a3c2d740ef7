"""Metrics of predictive quality: accuracy of the mean, calibration, and out-of-distribution detection.

Every metric takes tensors, or a prediction from :meth:`Posterior.predict` (or, for exact predictive
densities, the posterior itself), plus the targets, and returns a Python ``float`` (per-point
densities and reliability curves return tensors). Reductions are done in float64.

Example
-------
>>> from bnn_pyro import metrics
>>> pred = post.predict(x_test)                         # regression
>>> metrics.rmse(pred, y_test), metrics.interval_coverage(pred, y_test)
>>> metrics.nll(post, x_test, y_test)                   # exact mixture over posterior draws
>>> metrics.test_log_likelihood(post, x_test, y_test)   # = -nll: the UCI convention
>>> metrics.regression_calibration_error(metrics.pit(post, x_test, y_test))
>>> pred = clf.predict(x_test)                          # classification
>>> metrics.accuracy(pred, y_test), metrics.nll(pred, y_test), metrics.ece(pred, y_test), metrics.brier(pred, y_test)
>>> metrics.ood_auroc(clf.predict(x_in).entropy, clf.predict(x_out).entropy)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pyro.distributions as dist
import torch

from bnn_pyro.model import BNN
from bnn_pyro.predictions import ClassificationPrediction, RegressionPrediction
from bnn_pyro.utils.checks import as_tensor, match_columns, positive_int
from bnn_pyro.utils.targets import (
    base_distribution,
    float_tensor,
    match_target,
    probs_and_labels,
    regression_target,
    traced_obs,
)

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = [
    "rmse",
    "nll",
    "log_predictive_density",
    "test_log_likelihood",
    "accuracy",
    "ece",
    "reliability_curve",
    "brier",
    "interval_coverage",
    "ood_auroc",
    "pit",
    "regression_calibration_error",
    "predictive_interval",
    "UNCERTAINTY_SCORES",
    "uncertainty",
    "rejection_curve",
]


# ---------------------------------------------------------------------------------------- regression
def rmse(pred_or_mean, y) -> float:
    """Root mean squared error of a point prediction.

    ``RMSE = sqrt( (1/N) sum_n (mu_n - y_n)^2 )`` where ``mu`` is ``pred_or_mean`` (a tensor) or the
    predictive mean of a :class:`~bnn_pyro.predictions.RegressionPrediction`. With several outputs
    the mean runs over every entry.

    Example
    -------
    >>> metrics.rmse(post.predict(x_test), y_test)
    """
    if isinstance(pred_or_mean, ClassificationPrediction):
        raise TypeError(
            "pred_or_mean: rmse is for regression; for a ClassificationPrediction use accuracy, nll, brier or ece."
        )
    mean = pred_or_mean.mean if isinstance(pred_or_mean, RegressionPrediction) else pred_or_mean
    mean = float_tensor("pred_or_mean", mean)
    y = regression_target(y, mean.shape, "pred_or_mean")
    return float(((mean.double() - y.double()) ** 2).mean().sqrt())


def interval_coverage(prediction: RegressionPrediction, y) -> float:
    """Fraction of targets inside the predictive interval: ``(1/N) sum_n 1[lower_n <= y_n <= upper_n]``.

    A calibrated 95% interval (``post.predict(x, interval=0.95)``) covers about 95% of held-out
    targets; with ``N`` test points the Monte Carlo error of the fraction is about
    ``sqrt(0.95 * 0.05 / N)``.
    """
    if not isinstance(prediction, RegressionPrediction):
        raise TypeError(
            f"prediction: expected a RegressionPrediction (post.predict(x) of a regression model), got "
            f"{type(prediction).__name__}."
        )
    if prediction.lower is None:
        raise ValueError(
            "prediction: has no interval (it was made with interval=None); "
            "predict with post.predict(x, interval=0.95) to score its coverage."
        )
    y = regression_target(y, prediction.lower.shape, "prediction")
    inside = (prediction.lower <= y) & (y <= prediction.upper)
    return float(inside.double().mean())


def pit(posterior: Posterior, x, y, *, num_samples: int | None = None, seed: int | None = 0) -> torch.Tensor:
    """Probability integral transform of regression targets, shaped ``(N,)``:

    ``u_n = F(y_n | x_n, D) = (1/S) sum_s F(y_n | x_n, w_s)``,

    the predictive CDF (the exact mixture over posterior draws, each with its own noise, drawn as in
    :func:`log_predictive_density`) at the observed target. For a calibrated predictive the ``u_n``
    of held-out data are uniform on ``[0, 1]``. Needs a :class:`~bnn_pyro.BNN` with one output and
    an observation distribution that has a CDF (e.g. ``Gaussian``).
    """
    _check_bnn_posterior(posterior)
    x, y = _held_out(posterior, x, y)
    idx = posterior.draw_index(num_samples, seed)
    with torch.no_grad():
        d = posterior.observation_distribution(x, idx)
        target = match_target(d, y, batch_dims=1)
        if target.dim() != 1 or not target.dtype.is_floating_point:
            raise ValueError(
                f"y: pit needs one real-valued output per row, got the model's target shape {tuple(target.shape)}."
            )
        try:
            cdf = base_distribution(d).cdf(target)
        except NotImplementedError:
            raise ValueError(
                f"posterior: its observation distribution {type(base_distribution(d)).__name__} has no CDF; "
                "pit needs a likelihood such as bp.likelihoods.Gaussian."
            ) from None
    return cdf.double().reshape(cdf.shape[0], -1).mean(0)


def predictive_interval(
    posterior: Posterior, x, *, level: float = 0.95, num_samples: int | None = None, seed: int | None = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact central ``level`` interval of the predictive mixture at ``x``: ``(lower, upper)``, each ``(N,)``.

    ``F(t) = (1/S) sum_s F(t | x_n, w_s)`` is the mixture's CDF over the posterior draws (each with its own
    noise, as in :func:`pit`); ``lower`` solves ``F = (1 - level) / 2`` and ``upper`` ``F = (1 + level) / 2``,
    by bisection between the smallest and the largest of the draws' own quantiles (the mixture's quantile
    lies between them) down to float64 resolution. Unlike ``post.predict(x).lower``/``upper`` (quantiles of
    one predictive draw per posterior draw) it does not shrink when there are few draws (a 5-member
    ensemble). Needs a :class:`~bnn_pyro.BNN` with one output and a likelihood whose distribution has a CDF
    and an inverse CDF (e.g. ``Gaussian``); ``ValueError`` otherwise.
    """
    _check_bnn_posterior(posterior)
    level = float(level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected a probability in (0, 1), e.g. 0.95, got {level}.")
    x = posterior.inputs(x)
    with torch.no_grad():
        d = base_distribution(posterior.observation_distribution(x, posterior.draw_index(num_samples, seed)))
        if d.batch_shape[2:].numel() != 1:
            raise ValueError(
                f"posterior: predictive_interval needs one real-valued output per row, got a "
                f"predictive of shape {tuple(d.batch_shape[1:])} per draw."
            )
        bounds = []
        for q in ((1 - level) / 2, (1 + level) / 2):
            try:
                each = d.icdf(torch.full(d.batch_shape, q, dtype=d.mean.dtype, device=d.mean.device))
                each = each.double().reshape(d.batch_shape[0], -1)
                lo, hi = each.min(0).values, each.max(0).values
                for _ in range(64):  # halves the bracket each time: float64 resolution for any finite bracket
                    mid = (lo + hi) / 2
                    below = d.cdf(mid.to(d.mean.dtype).reshape(d.batch_shape[1:])).double()
                    below = below.reshape(d.batch_shape[0], -1).mean(0) < q
                    lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
            except NotImplementedError:
                raise ValueError(
                    f"posterior: its observation distribution {type(d).__name__} has no CDF or inverse "
                    "CDF; predictive_interval needs a likelihood such as bp.likelihoods.Gaussian."
                ) from None
            bounds.append((lo + hi) / 2)
    return bounds[0], bounds[1]


def regression_calibration_error(pit_values, levels=None) -> float:
    """Mean absolute miscalibration of central predictive intervals:

    ``(1/L) sum_c |coverage_c - c|``, ``coverage_c = (1/N) sum_n 1[|u_n - 1/2| <= c/2]``,

    over the nominal levels ``c`` (default ``0.1, 0.2, ..., 0.9``), where ``u_n`` are the
    :func:`pit` values of held-out targets (the central ``c`` interval of the predictive holds
    ``y_n`` exactly when ``|u_n - 1/2| <= c/2``). 0 is perfect, overconfident and underconfident
    predictives both score high. Even a calibrated predictive scores above 0 on finite data: each
    ``coverage_c`` has a standard error of ``sqrt(c (1 - c) / N)``.
    """
    u = float_tensor("pit_values", pit_values).double().reshape(-1)
    if u.numel() == 0 or not ((u >= 0) & (u <= 1)).all():
        raise ValueError(
            "pit_values: expected probabilities in [0, 1] (metrics.pit(post, x, y)), "
            f"got {u.numel()} values{'' if u.numel() == 0 else f' in {float(u.min())}..{float(u.max())}'}."
        )
    c = torch.arange(1, 10, dtype=torch.float64) / 10 if levels is None else float_tensor("levels", levels).double()
    c = c.reshape(-1)
    if c.numel() == 0 or not ((c > 0) & (c < 1)).all():
        raise ValueError(f"levels: expected nominal coverages in (0, 1), e.g. [0.1, ..., 0.9], got {c.tolist()}.")
    coverage = ((u[None, :] - 0.5).abs() <= c[:, None] / 2).double().mean(1)
    return float((coverage - c).abs().mean())


# ---------------------------------------------------------------------------------------- densities
def log_predictive_density(
    posterior: Posterior,
    x,
    y,
    *,
    num_samples: int | None = None,
    seed: int | None = 0,
    draws: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pointwise log posterior predictive density, shaped ``(N,)``.

    ``log p(y_n | x_n, D) ~= log (1/S) sum_s p(y_n | x_n, w_s) = logsumexp_s log p(y_n | x_n, w_s) - log S``

    over the posterior draws ``w_s`` (all of them, or ``num_samples`` picked with ``seed`` as in
    :meth:`Posterior.predict`, or the flat indices ``draws``). This is the exact predictive of the
    model under the posterior draws: a mixture over draws, including each draw's own noise (learned
    ``sigma``, heteroscedastic scales), not a Gaussian approximation. For a
    :class:`~bnn_pyro.BNN` it uses :meth:`Posterior.observation_distribution`; for a plain Pyro
    function model it traces the model once per draw. With several outputs the density of a row is
    the joint density of its outputs.

    Example
    -------
    >>> lpd = metrics.log_predictive_density(post, x_test, y_test)   # (N,)
    """
    if not _is_posterior(posterior):
        raise TypeError(
            f"posterior: expected a bnn_pyro.Posterior (what bp.fit returns), got "
            f"{type(posterior).__name__}. For a prediction use metrics.nll(prediction, y)."
        )
    x, y = _held_out(posterior, x, y)
    if draws is None:
        idx = posterior.draw_index(num_samples, seed)
    else:
        idx = torch.as_tensor(draws, dtype=torch.long).reshape(-1)
    with torch.no_grad():
        return mixture_log_density(posterior, x, y, idx)


def mixture_log_density(posterior: Posterior, x, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``log (1/S) sum_s p(y_n | x_n, w_s)`` per row ``(N,)`` over the posterior draws ``idx`` (flat indices), for
    ``x`` and ``y`` already checked: the mixture of :func:`log_predictive_density`, differentiable in ``x`` (the
    caller decides on ``no_grad``; :func:`bnn_pyro.tasks.adversarial.predictive_nll` differentiates it)."""
    if isinstance(posterior.model, BNN):
        d = posterior.observation_distribution(x, idx)
        log_p = d.log_prob(match_target(d, y, batch_dims=1))
    else:
        log_p = torch.stack([fn.log_prob(match_target(fn, y, batch_dims=0)) for fn in traced_obs(posterior, x, idx)])
    if log_p.dim() > 2:  # several outputs per row: their joint density
        log_p = log_p.reshape(log_p.shape[0], log_p.shape[1], -1).sum(-1)
    return torch.logsumexp(log_p, 0) - math.log(log_p.shape[0])


def test_log_likelihood(posterior: Posterior, x, y, *, num_samples: int | None = None, seed: int | None = 0) -> float:
    """Mean log posterior predictive density of held-out data (the UCI benchmark's "test LL"):

    ``(1/N) sum_n log (1/S) sum_s p(y_n | x_n, w_s)``; see :func:`log_predictive_density`.
    Higher is better; it equals ``-nll(posterior, x, y)``. Units matter: for targets standardized
    by ``s``, subtract ``log s`` to report it in original units (``UCISplit.metrics`` does).
    """
    return float(log_predictive_density(posterior, x, y, num_samples=num_samples, seed=seed).double().mean())


def nll(prediction, *data, num_samples: int | None = None, seed: int | None = 0) -> float:
    """Mean negative log predictive density (lower is better).

    ``NLL = -(1/N) sum_n log p(y_n | x_n, D)``, called in one of three ways:

    * ``nll(posterior, x, y)``: exact for the model, ``p = (1/S) sum_s p(y | x, w_s)``
      (:func:`log_predictive_density`). Prefer this for regression.
    * ``nll(classification_prediction, y)`` (or class probabilities ``(N, K)``): exact,
      ``p = probs[n, y_n]``, the Bayesian model average.
    * ``nll(regression_prediction, y)``: a prediction keeps the per-draw means but only the
      *average* noise variance, so the predictive is taken as the mixture
      ``(1/S) sum_s N(y | mean_draws_s, aleatoric_std^2)``. This is exact when every draw has the
      same noise (a Gaussian likelihood with a fixed ``scale``) and an approximation when the noise
      is learned or heteroscedastic; use ``nll(posterior, x, y)`` for the exact value.
    """
    if _is_posterior(prediction):
        if len(data) != 2:
            raise TypeError(
                "nll(posterior, x, y): give the inputs x and the targets y "
                f"(got {len(data)} positional argument(s) after the posterior)."
            )
        return -test_log_likelihood(prediction, *data, num_samples=num_samples, seed=seed)
    if len(data) != 1:
        raise TypeError(
            "nll(prediction, y): give the targets y only (or call nll(posterior, x, y)); "
            f"got {len(data)} positional argument(s) after the prediction."
        )
    (y,) = data
    if isinstance(prediction, RegressionPrediction):
        y = regression_target(y, prediction.mean.shape, "prediction")
        scale = prediction.aleatoric_std.double()
        if not (scale > 0).all():
            raise ValueError(
                "prediction: its aleatoric_std has zeros, so the mixture density is undefined; "
                "use nll(posterior, x, y) or a likelihood with observation noise."
            )
        lpd = torch.empty(prediction.mean.shape[0], dtype=torch.float64)
        for rows, means in prediction.blocks("mean_draws"):  # block by block: never every draw at every point
            log_p = dist.Normal(means.double(), scale[rows]).log_prob(y[rows].double())
            if log_p.dim() > 2:
                log_p = log_p.reshape(log_p.shape[0], log_p.shape[1], -1).sum(-1)
            lpd[rows] = torch.logsumexp(log_p, 0) - math.log(log_p.shape[0])
        return float(-lpd.mean())
    probs, labels = probs_and_labels(prediction, y)
    picked = probs.gather(1, labels[:, None])[:, 0].clamp_min(torch.finfo(torch.float64).tiny)
    return float(-picked.log().mean())


# ---------------------------------------------------------------------------------------- classification
def accuracy(prediction, y) -> float:
    """Fraction of correct predictions: ``(1/N) sum_n 1[argmax_k p_nk = y_n]``.

    ``prediction`` is a :class:`~bnn_pyro.predictions.ClassificationPrediction` or probabilities
    ``(N, K)`` (``(N,)`` means ``P(class 1)`` of a binary problem); ``y`` holds labels ``0..K-1``. For
    sequence outputs ``(N, T, K)`` with labels ``(N, T)`` every position counts as one prediction (as
    in :func:`nll`, :func:`brier`, :func:`reliability_curve` and :func:`ece`).
    """
    probs, labels = probs_and_labels(prediction, y)
    return float((probs.argmax(-1) == labels).double().mean())


def brier(probs, y) -> float:
    """Multi-class Brier score: ``(1/N) sum_n sum_k (p_nk - 1[y_n = k])^2``, in ``[0, 2]``.

    Lower is better. For two classes this is twice the binary form ``(1/N) sum_n (p_n1 - y_n)^2``.
    ``probs``: a ``ClassificationPrediction`` or probabilities ``(N, K)`` (``(N,)``: ``P(class 1)``).
    """
    probs, labels = probs_and_labels(probs, y, argname="probs")
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return float(((probs - onehot) ** 2).sum(-1).mean())


def reliability_curve(probs, y, n_bins: int = 15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Confidence against accuracy in ``n_bins`` equal-width bins of confidence.

    The confidence of row ``n`` is ``c_n = max_k p_nk``, its prediction ``argmax_k p_nk``. Bin ``b``
    holds the rows with ``b / B <= c_n < (b + 1) / B`` (the last bin also takes ``c_n = 1``).

    Returns
    -------
    (confidence, accuracy, counts), each shaped ``(n_bins,)``: the mean confidence and the fraction
    correct in each bin (float64; NaN for empty bins), and the number of rows per bin (int64).
    """
    n_bins = positive_int("n_bins", n_bins)
    probs, labels = probs_and_labels(probs, y, argname="probs")
    confidence, predicted = probs.max(-1)
    correct = (predicted == labels).double()
    # the same edges (numpy's linspace) and the same rule (left-closed bins) as np.digitize
    inner = torch.from_numpy(np.linspace(0.0, 1.0, n_bins + 1)[1:-1])
    which = torch.bucketize(confidence, inner, right=True).clamp(0, n_bins - 1)
    counts = torch.bincount(which, minlength=n_bins)
    total_conf = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, which, confidence)
    total_correct = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, which, correct)
    filled = counts > 0
    nan = torch.full((n_bins,), float("nan"), dtype=torch.float64)
    mean_conf = torch.where(filled, total_conf / counts.clamp_min(1), nan)
    mean_acc = torch.where(filled, total_correct / counts.clamp_min(1), nan)
    return mean_conf, mean_acc, counts


def ece(probs, y, n_bins: int = 15) -> float:
    """Expected calibration error: ``ECE = sum_b (n_b / N) |accuracy_b - confidence_b|``
    over the bins of :func:`reliability_curve` (empty bins contribute nothing). 0 is perfect.

    Even perfectly calibrated probabilities give a small positive ECE on finite data: each bin's
    accuracy has Monte Carlo error ``sqrt(c_b (1 - c_b) / n_b)``.
    """
    confidence, acc, counts = reliability_curve(probs, y, n_bins)
    filled = counts > 0
    weights = counts[filled].double() / counts.sum()
    return float((weights * (acc[filled] - confidence[filled]).abs()).sum())


# ---------------------------------------------------------------------------------------- OOD detection
_SCORES = ("entropy", "mutual_information", "aleatoric_entropy")


def ood_auroc(scores_in, scores_out, *, score: str = "entropy") -> float:
    """Area under the ROC curve for telling out-of-distribution inputs from in-distribution ones
    by an uncertainty score (higher = more likely OOD), e.g. predictive entropy or mutual information.

    ``AUROC = P(s_out > s_in) + 1/2 P(s_out = s_in) = (1 / (n_in n_out)) sum_{i,j} [1(o_j > i_i) + 1/2 1(o_j = i_i)]``,

    the Mann-Whitney U statistic of the two samples with ties counted as halves. 1 separates
    perfectly, 0.5 is chance. ``scores_in`` / ``scores_out`` are 1-D tensors, or
    ``ClassificationPrediction`` objects whose ``score`` attribute (``"entropy"``,
    ``"mutual_information"`` or ``"aleatoric_entropy"``) is used.
    """
    if score not in _SCORES:
        raise ValueError(f"score: unknown value {score!r}; choose one of {', '.join(map(repr, _SCORES))}.")
    a = uncertainty(scores_in, score, argname="scores_in")
    b = uncertainty(scores_out, score, argname="scores_out")
    ordered = a.sort().values
    below = torch.searchsorted(ordered, b, right=False).double()  # in-scores strictly below each out-score
    up_to = torch.searchsorted(ordered, b, right=True).double()  # ... below or equal
    wins = below.sum() + 0.5 * (up_to - below).sum()
    return float(wins / (len(a) * len(b)))


# ---------------------------------------------------------------------------------------- selective prediction
# (bnn_pyro.tasks.selective re-exports these; they live here so that bnn_pyro.posterior.plots draws the curve
# without importing the tasks layer)
UNCERTAINTY_SCORES = ("entropy", "mutual_information", "aleatoric_entropy", "max_prob")


def uncertainty(pred, score: str = "entropy", *, argname: str = "scores") -> torch.Tensor:
    """The score ``(N,)`` (float64) of a ``ClassificationPrediction``; a 1-D tensor passes through.

    Either is checked (finite, non-empty, one score per input); ``argname`` names the argument in the error,
    so that a caller with two score arguments (``scores_in`` / ``scores_out``) says which one is wrong.
    """
    if score not in UNCERTAINTY_SCORES:
        raise ValueError(f"score: unknown value {score!r}; choose one of {', '.join(map(repr, UNCERTAINTY_SCORES))}.")
    if isinstance(pred, ClassificationPrediction):
        pred = 1.0 - pred.probs.max(-1).values if score == "max_prob" else getattr(pred, score)
    value = as_tensor(argname, pred)
    if value.dim() != 1:
        raise ValueError(
            f"{argname}: expected one score per input, shaped (N,), got shape {tuple(value.shape)}; "
            "pass a ClassificationPrediction or e.g. pred.entropy or pred.mutual_information."
        )
    return value.double()


def rejection_curve(
    pred: ClassificationPrediction, y, *, score: str = "entropy", scores=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy of the retained inputs against the fraction rejected (the most uncertain first).

    Returns ``(fraction_rejected, accuracy)``, each ``(N,)`` float64: ``fraction_rejected[r] = r / N``
    and ``accuracy[r]`` the accuracy on the ``N - r`` inputs with the lowest score. ``scores`` (a
    tensor ``(N,)``) replaces the named ``score``. Ties are broken by input order (a stable sort).
    """
    probs, labels = probs_and_labels(pred, y)
    u = uncertainty(pred if scores is None else scores, score)
    if u.shape[0] != labels.shape[0]:
        raise ValueError(f"scores has {u.shape[0]} entries but there are {labels.shape[0]} labels; give one per input.")
    order = torch.sort(u, stable=True).indices  # most certain first
    correct = (probs.argmax(-1) == labels).double()[order]
    n = len(correct)
    kept = torch.arange(n, 0, -1, dtype=torch.float64)  # N - r inputs kept at r rejected
    accuracy = correct.cumsum(0).flip(0)[:n] / kept  # accuracy of the first N - r in certainty order
    return torch.arange(n, dtype=torch.float64) / n, accuracy


# ---------------------------------------------------------------------------------------- checks
def _check_bnn_posterior(posterior) -> None:
    """``TypeError`` unless ``posterior`` is a fitted Posterior of a :class:`~bnn_pyro.BNN` (what :func:`pit` and
    :func:`predictive_interval` need: its observation distribution at new inputs)."""
    if not _is_posterior(posterior) or not isinstance(posterior.model, BNN):
        raise TypeError(
            f"posterior: expected a bnn_pyro.Posterior of a bp.BNN regression model, got "
            f"{type(posterior).__name__}{'' if not _is_posterior(posterior) else ' of a Pyro function'}."
        )


def _held_out(posterior, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out ``x`` (as the fit converted its inputs, for a BNN; floats for a Pyro function model) and ``y``,
    checked to have one row each."""
    x = (
        posterior.inputs(x)
        if isinstance(posterior.model, BNN)
        else float_tensor("x", match_columns(x, posterior.feature_names))
    )
    y = as_tensor("y", y)
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and y have different numbers of rows: x has {x.shape[0]}, y has {y.shape[0]}. "
            "Each row of x needs one row of y."
        )
    return x, y


def _is_posterior(obj) -> bool:
    """Whether ``obj`` is a fitted :class:`~bnn_pyro.Posterior` (its draws and their predictive), known by its
    interface: this module does not import :mod:`bnn_pyro.posterior`, whose plots use these metrics."""
    return hasattr(obj, "observation_distribution") and hasattr(obj, "samples")
