"""Checks of the targets and predictions that metrics and the uncertainty tasks score against one another.

Shared by :mod:`bnn_pyro.metrics` and :mod:`bnn_pyro.tasks` (calibration, conformal, selective, adversarial):
every error names the argument, what was expected and what to try. Imports the model layer's prediction types
only (:mod:`bnn_pyro.predictions`); a posterior is taken as an argument, never imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyro.distributions as dist
import torch

from bnn_pyro.predictions import ClassificationPrediction, RegressionPrediction
from bnn_pyro.utils.checks import as_tensor

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = [
    "PROB_ATOL",
    "float_tensor",
    "regression_target",
    "probs_and_labels",
    "base_distribution",
    "match_target",
    "traced_obs",
]

PROB_ATOL = 1e-3  # rows of probabilities must sum to 1 within this (float32 softmax over many classes)


def float_tensor(argname: str, value) -> torch.Tensor:
    """``value`` as a tensor (checked by :func:`~bnn_pyro.utils.checks.as_tensor`), integers cast to the default float dtype."""
    value = as_tensor(argname, value)
    return value if value.dtype.is_floating_point else value.to(torch.get_default_dtype())


def regression_target(y, shape: torch.Size, argname: str) -> torch.Tensor:
    """Regression targets ``y`` checked against the predicted shape ``shape`` (a ``(N, 1)`` column read as ``(N,)``); the
    error names ``argname``, the prediction they are scored against."""
    y = float_tensor("y", y)
    if len(shape) == 1 and y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if tuple(y.shape) != tuple(shape):
        raise ValueError(
            f"y has shape {tuple(y.shape)} but {argname} predicts shape {tuple(shape)}; "
            "pass the targets of the inputs you predicted at, with one column per output."
        )
    return y


def probs_and_labels(probs, y, argname: str = "prediction") -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities ``(N, K)`` (float64) and integer labels ``(N,)`` from a prediction or probabilities
    (a vector is ``P(class 1)``; sequences ``(N, T, K)`` are flattened to one prediction per position), checked:
    probabilities in [0, 1] with rows summing to 1 within :data:`PROB_ATOL`, labels in ``0..K-1``."""
    if isinstance(probs, RegressionPrediction):
        raise TypeError(
            f"{argname}: this metric is for classification, got a RegressionPrediction; "
            "use rmse, nll or interval_coverage."
        )
    if isinstance(probs, ClassificationPrediction):
        probs = probs.probs
    probs = float_tensor(argname, probs).double().cpu()  # metrics are O(N K): on the CPU, whatever the device
    if probs.dim() == 1:
        if ((probs < 0) | (probs > 1)).any():
            raise ValueError(
                f"{argname}: a vector is read as P(class 1) of a binary problem and must lie in [0, 1]; "
                "pass probabilities, not logits (torch.sigmoid)."
            )
        probs = torch.stack([1.0 - probs, probs], -1)
    if probs.dim() > 2:  # sequence outputs (N, T, K): every position is one prediction, with labels y (N, T)
        y = as_tensor("y", y)
        if tuple(y.shape) != tuple(probs.shape[:-1]):
            raise ValueError(
                f"{argname}: expected class probabilities shaped (N, K), or (N, T, K) with labels y shaped "
                f"(N, T); got {tuple(probs.shape)} and y {tuple(y.shape)}. For sequences pass one label "
                f"per position, shaped {tuple(probs.shape[:-1])}."
            )
        probs, y = probs.reshape(-1, probs.shape[-1]), y.reshape(-1)
    if probs.dim() != 2:
        raise ValueError(f"{argname}: expected class probabilities shaped (N, K), got shape {tuple(probs.shape)}.")
    if ((probs < 0) | (probs > 1)).any():
        raise ValueError(
            f"{argname}: probabilities must lie in [0, 1], found values in "
            f"[{float(probs.min()):.3g}, {float(probs.max()):.3g}]; pass softmax(logits), not logits."
        )
    sums = probs.sum(-1)
    bad = ((sums - 1.0).abs() > PROB_ATOL).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"{argname}: each row of probabilities must sum to 1 (within {PROB_ATOL}); {len(bad)} row(s) "
            f"do not (first: row {int(bad[0])} sums to {float(sums[bad[0]]):.4g}). "
            "Normalize with probs / probs.sum(-1, keepdim=True) or use softmax(logits, -1)."
        )
    y = as_tensor("y", y).cpu()
    if y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.dim() != 1:
        raise ValueError(
            f"y: expected integer class labels shaped (N,), got shape {tuple(y.shape)} "
            "(for one-hot labels pass y.argmax(-1))."
        )
    if y.dtype.is_floating_point:
        if not (y == y.round()).all():
            raise TypeError(
                f"y: expected integer class labels, got non-integer values of dtype {y.dtype}; "
                "pass labels 0..K-1 as y.long()."
            )
        y = y.long()
    y = y.long()
    if y.shape[0] != probs.shape[0]:
        raise ValueError(
            f"y has {y.shape[0]} labels but {argname} has {probs.shape[0]} rows; "
            "pass the labels of the inputs you predicted at."
        )
    k = probs.shape[1]
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"y: labels must lie in 0..{k - 1} for {k} classes, found {int(y.min())}..{int(y.max())}.")
    return probs, y


def base_distribution(d):
    """The distribution under ``Independent``, ``MaskedDistribution`` and ``ExpandedDistribution`` wrappers (what a
    plate or ``to_event`` adds), e.g. to ask whether an observation site is ``Categorical``."""
    while isinstance(d, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        d = d.base_dist
    return d


def match_target(d, y: torch.Tensor, *, batch_dims: int) -> torch.Tensor:
    """``y`` in the layout ``d.log_prob`` expects: labels for Categorical, floats otherwise, and
    ``(N, 1)`` squeezed for a single output. ``batch_dims`` leading dims of ``d`` are draws."""
    base = base_distribution(d)
    expected = tuple(d.batch_shape[batch_dims:]) + tuple(d.event_shape)
    if isinstance(base, dist.Categorical):
        y = y.reshape(-1) if y.dim() == 2 and y.shape[1] == 1 and len(expected) == 1 else y
        if y.dtype.is_floating_point and not (y == y.round()).all():
            raise TypeError("y: this model is a classifier; pass integer class labels (y.long()).")
        y = y.long()
        k = base.probs.shape[-1]
        if y.min() < 0 or y.max() >= k:
            raise ValueError(f"y: labels must lie in 0..{k - 1} for {k} classes, found {int(y.min())}..{int(y.max())}.")
    else:
        if isinstance(base, dist.Bernoulli) and not ((y == 0) | (y == 1)).all():
            raise ValueError("y: this model is a binary (Bernoulli) classifier; pass 0/1 labels.")
        y = y.to(torch.get_default_dtype()) if not y.dtype.is_floating_point else y
        if len(expected) == 1 and y.dim() == 2 and y.shape[1] == 1:
            y = y[:, 0]
    if tuple(y.shape) != expected:
        raise ValueError(
            f"y has shape {tuple(y.shape)} but the model predicts shape {expected} at x; "
            "pass one row of y per row of x, one column per output."
        )
    return y


def traced_obs(posterior: Posterior, x: torch.Tensor, idx: torch.Tensor) -> list:
    """The observation distribution of a plain Pyro function model, one conditioned trace per draw."""
    fns = []
    for i in idx.tolist():
        trace = posterior.trace_draw(i, x)
        if "obs" not in trace.nodes:
            raise ValueError(
                "posterior: the model has no sample site 'obs'; record observations as "
                "pyro.sample('obs', ..., obs=y) inside pyro.plate('data', ...)."
            )
        fns.append(trace.nodes["obs"]["fn"])
    return fns
