"""Rejection curves by hand; OOD AUROC / AUPR / FPR at 95% TPR against sklearn and exact small cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from bnn_pyro import selective
from bnn_pyro.predictions import classification


def _pred():
    # four inputs, one draw each: confident right, confident wrong, unsure right, unsure wrong
    probs = torch.tensor([[[0.95, 0.05], [0.9, 0.1], [0.6, 0.4], [0.55, 0.45]]], dtype=torch.float64)
    return classification(probs), torch.tensor([0, 1, 0, 1])


def test_rejection_curve_by_hand():
    pred, y = _pred()
    fraction, acc = selective.rejection_curve(pred, y, score="entropy")
    # certainty order: 0 (right), 1 (wrong), 2 (right), 3 (wrong)
    assert fraction.tolist() == [0.0, 0.25, 0.5, 0.75]
    assert acc.tolist() == pytest.approx([2 / 4, 2 / 3, 1 / 2, 1.0])
    assert selective.rejection_auc(pred, y) == pytest.approx((0.5 + 2 / 3 + 0.5 + 1.0) / 4)
    # a score that ranks the two mistakes last gives the perfect curve
    fraction, acc = selective.rejection_curve(pred, y, scores=torch.tensor([0.0, 3.0, 1.0, 2.0]))
    assert acc.tolist() == pytest.approx([0.5, 2 / 3, 1.0, 1.0])
    # max_prob ranks like entropy for two classes
    assert selective.rejection_auc(pred, y, score="max_prob") == pytest.approx(selective.rejection_auc(pred, y))


def test_ood_metrics_exact_small_case():
    s_in = torch.tensor([0.1, 0.2, 0.3, 0.9])
    s_out = torch.tensor([0.25, 0.8, 1.0])
    # thresholds (desc): 1.0 tp1 fp0; 0.9 tp1 fp1; 0.8 tp2 fp1; 0.3 tp2 fp2; 0.25 tp3 fp2; ...
    # AP = 1/3 * 1 + 1/3 * 2/3 + 1/3 * 3/5
    assert selective.ood_aupr(s_in, s_out) == pytest.approx((1 + 2 / 3 + 3 / 5) / 3)
    # 95% TPR needs all three OOD inputs: threshold 0.25 flags 2 of 4 in-distribution inputs
    assert selective.ood_fpr_at_tpr(s_in, s_out) == pytest.approx(0.5)
    assert selective.ood_fpr_at_tpr(s_in, s_out, tpr=0.5) == pytest.approx(0.25)
    # AUROC: pairs (out > in): 0.25 beats 2, 0.8 beats 3, 1.0 beats 4 -> 9 / 12
    assert selective.ood_detection(s_in, s_out)["auroc"] == pytest.approx(9 / 12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ood_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    s_in = np.round(rng.normal(0.0, 1.0, 300), 1)  # rounded: ties across and within the groups
    s_out = np.round(rng.normal(0.8, 1.0, 200), 1)
    labels = np.r_[np.zeros(300), np.ones(200)]
    scores = np.r_[s_in, s_out]
    got = selective.ood_detection(torch.tensor(s_in), torch.tensor(s_out))
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(labels, scores), abs=1e-12)
    assert got["aupr"] == pytest.approx(skm.average_precision_score(labels, scores), abs=1e-12)
    fpr, tpr, _ = skm.roc_curve(labels, scores, drop_intermediate=False)
    assert got["fpr95"] == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-12)


def test_scores_from_predictions():
    p = torch.softmax(torch.randn(5, 30, 3, dtype=torch.float64), -1)
    pred = classification(p)
    assert torch.allclose(selective.uncertainty(pred, "max_prob"), 1 - pred.probs.max(-1).values)
    assert torch.equal(selective.uncertainty(pred, "mutual_information"), pred.mutual_information)
    other = classification(p.flip(1) ** 2 / (p.flip(1) ** 2).sum(-1, keepdim=True))
    a = selective.ood_detection(pred, other, score="mutual_information")
    b = selective.ood_detection(pred.mutual_information, other.mutual_information)
    assert a == pytest.approx(b)


def test_bad_input():
    pred, y = _pred()
    with pytest.raises(ValueError, match="score: unknown value 'confidence'"):
        selective.rejection_curve(pred, y, score="confidence")
    with pytest.raises(ValueError, match=r"tpr must lie in \(0, 1\), got 1\.5"):
        selective.ood_fpr_at_tpr(torch.rand(3), torch.rand(3), tpr=1.5)
    with pytest.raises(ValueError, match="scores has 3 entries"):
        selective.rejection_curve(pred, y, scores=torch.rand(3))
    with pytest.raises(ValueError, match="at least one"):
        selective.ood_aupr(torch.rand(3), torch.rand(0))
    with pytest.raises(ValueError, match="scores_out: expected one score per input"):  # names which argument
        selective.ood_detection(torch.rand(3), torch.rand(3, 2))
