"""bnn_pyro/predictions.py: the classification summary's uncertainty decomposition."""

from __future__ import annotations

import math

import torch

from bnn_pyro import acquisition, metrics, selective
from bnn_pyro.predictions import classification, entropy


def test_identical_draws_have_exactly_zero_mutual_information():
    # a point estimate (MAP, one network) repeated over draws: no disagreement, so I[y; w] = 0 exactly;
    # H[mean] - E H left up to ~5e-7 of rounding noise here, enough to rank inputs at random
    probs = torch.rand(1, 50, 10, generator=torch.Generator().manual_seed(0)).softmax(-1).expand(200, 50, 10)
    pred = classification(probs.contiguous())
    assert (pred.mutual_information == 0).all()
    assert (acquisition.scores(pred, "bald") == 0).all()
    other = classification(probs[:, :20].contiguous())
    assert metrics.ood_auroc(pred, other, score="mutual_information") == 0.5  # all ties: chance, not noise
    assert selective.ood_detection(pred, other, score="mutual_information")["auroc"] == 0.5


def test_mutual_information_is_total_minus_expected_entropy():
    g = torch.Generator().manual_seed(1)
    probs = (3 * torch.randn(40, 30, 5, generator=g, dtype=torch.float64)).softmax(-1)
    pred = classification(probs)
    expected = entropy(probs.mean(0)) - entropy(probs).mean(0)
    torch.testing.assert_close(pred.mutual_information, expected, rtol=0, atol=1e-12)
    assert torch.allclose(pred.entropy - pred.aleatoric_entropy, expected, atol=1e-12)


def test_mutual_information_closed_forms():
    # two confident draws that disagree: p_bar = (1/2, 1/2), I = log 2; a class where the draws agree
    # contributes nothing; exact zeros in the draws are fine (0 log 0 = 0)
    probs = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]], dtype=torch.float64)
    assert math.isclose(float(classification(probs).mutual_information), math.log(2.0), rel_tol=1e-12)
    probs = torch.tensor([[[0.5, 0.5, 0.0]], [[0.5, 0.0, 0.5]]], dtype=torch.float64)
    # p_bar = (1/2, 1/4, 1/4): H = 1.5 log 2; each draw's H = log 2
    assert math.isclose(float(classification(probs).mutual_information), 0.5 * math.log(2.0), rel_tol=1e-12)


def test_quantiles_equal_torch_quantile():
    # order statistics from topk at the nearer end give torch.quantile's numbers, ties and NaN included
    from bnn_pyro.predictions import quantiles

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 500):
        y = torch.randn(n, 300, 2, generator=g)
        y[:, :10] = y[:, :10].round()  # ties
        y[0, 20, 0] = float("nan")
        levels = torch.tensor([0.0, 0.025, 0.3, 0.5, 0.975, 1.0])
        torch.testing.assert_close(
            quantiles(y, levels), torch.quantile(y, levels, dim=0), rtol=0, atol=0, equal_nan=True
        )
