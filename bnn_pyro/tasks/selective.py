"""Selective classification and out-of-distribution detection from a classifier's uncertainty.

An uncertainty score is one number per input, higher = less sure: ``"entropy"`` (predictive
entropy), ``"mutual_information"`` (epistemic part), ``"aleatoric_entropy"`` (expected per-draw
entropy) or ``"max_prob"`` (``1 - max_k p_k``, one minus the confidence).

* **Rejection curve**: reject the fraction ``r`` of inputs with the highest score, report the
  accuracy on the rest; the area under it (mean accuracy over ``r = 0, 1/N, ..., (N-1)/N``) summarizes
  how well the score ranks mistakes (higher is better; a perfect ranking of ``e`` errors among ``N``
  gives accuracy 1 from ``r = e / N`` on).
* **OOD detection**: in-distribution inputs are the negatives, out-of-distribution ones the positives,
  the score the detector. AUROC (:func:`bnn_pyro.metrics.ood_auroc`), AUPR (average precision, as
  ``sklearn.metrics.average_precision_score``) and the FPR at 95% TPR (the fraction of
  in-distribution inputs flagged when the threshold flags 95% of the OOD ones).

Example
-------
>>> from bnn_pyro import selective
>>> pred = post.predict(x_test)
>>> fraction, acc = selective.rejection_curve(pred, y_test, score="mutual_information")
>>> selective.rejection_auc(pred, y_test, score="entropy")
>>> selective.ood_detection(post.predict(x_in), post.predict(x_out), score="entropy")  # auroc, aupr, fpr95
"""

from __future__ import annotations

import torch

from bnn_pyro import metrics
from bnn_pyro.metrics import (
    UNCERTAINTY_SCORES as SCORES,
)  # shared with bnn_pyro.posterior.plots
from bnn_pyro.metrics import (
    rejection_curve,
    uncertainty,
)
from bnn_pyro.predictions import ClassificationPrediction
from bnn_pyro.utils.checks import probability

__all__ = ["SCORES", "uncertainty", "rejection_curve", "rejection_auc", "ood_aupr", "ood_fpr_at_tpr", "ood_detection"]


def rejection_auc(pred: ClassificationPrediction, y, *, score: str = "entropy", scores=None) -> float:
    """Area under the :func:`rejection_curve`: ``(1/N) sum_{r=0}^{N-1} accuracy(r / N)``, in ``[0, 1]``."""
    return float(rejection_curve(pred, y, score=score, scores=scores)[1].mean())


def _counts(scores_in, scores_out, score: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """At each distinct threshold ``t`` (descending), the numbers of OOD and in-distribution scores ``>= t``."""
    a = uncertainty(scores_in, score, argname="scores_in")
    b = uncertainty(scores_out, score, argname="scores_out")
    if len(a) == 0 or len(b) == 0:
        raise ValueError(
            "scores_in, scores_out: both need at least one input; pass the scores of in-distribution and of OOD inputs."
        )
    thresholds = torch.cat([a, b]).unique().flip(0)
    a_sorted, b_sorted = a.sort().values, b.sort().values
    true_pos = len(b) - torch.searchsorted(b_sorted, thresholds, right=False)
    false_pos = len(a) - torch.searchsorted(a_sorted, thresholds, right=False)
    return true_pos.double(), false_pos.double(), len(a), len(b)


def ood_aupr(scores_in, scores_out, *, score: str = "entropy") -> float:
    """Average precision with OOD as the positive class:
    ``AP = sum_t (R_t - R_{t-1}) P_t`` over distinct thresholds ``t`` (descending), where ``R_t`` and
    ``P_t`` are the recall and precision of flagging scores ``>= t``. Chance level is the OOD fraction."""
    tp, fp, _, n_out = _counts(scores_in, scores_out, score)
    recall = tp / n_out
    precision = tp / (tp + fp)
    steps = torch.diff(recall, prepend=torch.zeros(1, dtype=torch.float64))
    return float((steps * precision).sum())


def ood_fpr_at_tpr(scores_in, scores_out, *, score: str = "entropy", tpr: float = 0.95) -> float:
    """The smallest false-positive rate (in-distribution inputs flagged) among thresholds that flag at
    least the fraction ``tpr`` of OOD inputs. 0 is perfect; lower is better."""
    tpr = probability("tpr", tpr, suggestion="try 0.95")
    tp, fp, n_in, n_out = _counts(scores_in, scores_out, score)
    reached = (tp / n_out >= tpr - 1e-12).nonzero()
    return float(fp[reached[0, 0]] / n_in)  # the highest threshold reaching it has the fewest false positives


def ood_detection(scores_in, scores_out, *, score: str = "entropy", tpr: float = 0.95) -> dict[str, float]:
    """``{"auroc", "aupr", "fpr95"}`` of detecting OOD inputs by ``score`` (see the module's docstring)."""
    a = uncertainty(scores_in, score, argname="scores_in")
    b = uncertainty(scores_out, score, argname="scores_out")
    return {
        "auroc": metrics.ood_auroc(a, b),
        "aupr": ood_aupr(a, b, score=score),
        "fpr95": ood_fpr_at_tpr(a, b, score=score, tpr=tpr),
    }
