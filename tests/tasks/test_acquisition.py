"""Acquisition scores against hand computations on two-draw posteriors, and the greedy BatchBALD choice."""

from __future__ import annotations

import math

import pytest
import torch

from bnn_pyro import acquisition
from bnn_pyro.predictions import classification


def _h(*p):
    return -sum(q * math.log(q) for q in p if q > 0)


def _pred():
    # two draws, three pool inputs, two classes
    draws = torch.tensor(
        [
            [[0.9, 0.1], [0.5, 0.5], [0.8, 0.2]],
            [[0.1, 0.9], [0.5, 0.5], [0.8, 0.2]],
        ],
        dtype=torch.float64,
    )
    return classification(draws)


def test_bald_entropy_and_variation_ratios_match_hand_computations():
    pred = _pred()
    bald = acquisition.scores(pred, "bald")
    # input 0: mean (0.5, 0.5), H = log 2; each draw H(0.9, 0.1)
    assert bald[0].item() == pytest.approx(math.log(2) - _h(0.9, 0.1), abs=1e-12)
    assert bald[1].item() == pytest.approx(0.0, abs=1e-12)  # draws agree: no information about the weights
    assert bald[2].item() == pytest.approx(0.0, abs=1e-12)
    ent = acquisition.scores(pred, "entropy")
    assert ent.tolist() == pytest.approx([math.log(2), math.log(2), _h(0.8, 0.2)], abs=1e-12)
    vr = acquisition.scores(pred, "variation_ratios")
    assert vr.tolist() == pytest.approx([0.5, 0.0, 0.0])  # input 0: draws vote 0 and 1; ties argmax to class 0
    assert acquisition.select(pred, 1, "bald").tolist() == [0]
    assert acquisition.select(pred, 1, "entropy").tolist() in ([0], [1])


def test_bald_is_zero_when_all_draws_agree():
    p = torch.softmax(torch.randn(1, 20, 4, dtype=torch.float64), -1).expand(7, 20, 4)
    assert acquisition.scores(classification(p), "bald").abs().max() < 1e-12


def test_random_is_reproducible_and_covers_the_pool():
    pred = classification(torch.softmax(torch.randn(3, 50, 3), -1))
    a = acquisition.select(pred, 50, "random", seed=3)
    assert sorted(a.tolist()) == list(range(50))
    assert torch.equal(a, acquisition.select(pred, 50, "random", seed=3))
    assert not torch.equal(a, acquisition.select(pred, 50, "random", seed=4))


def test_joint_mutual_information_of_independent_inputs_adds_up():
    # draws that make inputs 0 and 1 exact copies: joint MI = MI of one; input 2 independent of the weights
    pred = classification(
        torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.0, 1.0], [0.5, 0.5]]], dtype=torch.float64)
    )
    assert acquisition.joint_mutual_information(pred, [0]) == pytest.approx(math.log(2), abs=1e-12)
    assert acquisition.joint_mutual_information(pred, [0, 1]) == pytest.approx(math.log(2), abs=1e-12)
    assert acquisition.joint_mutual_information(pred, [0, 2]) == pytest.approx(math.log(2), abs=1e-12)


def test_batchbald_avoids_duplicates_that_top_k_bald_picks():
    # inputs 0 and 1 carry the same information (the same draws disagree on them); input 2 is a bit
    # less informative alone but about different draws
    draws = torch.tensor(
        [
            [[0.95, 0.05], [0.95, 0.05], [0.9, 0.1]],
            [[0.05, 0.95], [0.05, 0.95], [0.9, 0.1]],
            [[0.95, 0.05], [0.95, 0.05], [0.1, 0.9]],
            [[0.05, 0.95], [0.05, 0.95], [0.1, 0.9]],
        ],
        dtype=torch.float64,
    )
    pred = classification(draws)
    assert sorted(acquisition.select(pred, 2, "bald").tolist()) == [0, 1]
    chosen = acquisition.select(pred, 2, "batchbald")
    assert sorted(chosen.tolist()) in ([0, 2], [1, 2])
    # the greedy gain equals the exact joint MI: it is the best pair
    best = max(acquisition.joint_mutual_information(pred, [i, j]) for i in range(3) for j in range(i + 1, 3))
    assert acquisition.joint_mutual_information(pred, chosen) == pytest.approx(best, abs=1e-12)


def test_acquire_on_a_fitted_posterior(classifier_post):
    x = classifier_post.x
    idx = acquisition.acquire(classifier_post, x, 5, num_samples=40, seed=0)
    pred = classifier_post.predict(x, num_samples=40, seed=0)
    assert torch.equal(idx, acquisition.scores(pred, "bald").topk(5).indices)
    assert len(set(acquisition.acquire(classifier_post, x, 3, strategy="batchbald").tolist())) == 3
    # the defaults: BALD over 100 draws picked with seed 0 (this posterior has 2 x 50 draws: all of them)
    default = acquisition.acquire(classifier_post, x, 5)
    assert torch.equal(default, acquisition.scores(classifier_post.predict(x, num_samples=100, seed=0)).topk(5).indices)


def test_bad_input_names_the_argument(classifier_post, svi_post):
    pred = _pred()
    with pytest.raises(ValueError, match="strategy"):
        acquisition.select(pred, 1, "maxent")
    with pytest.raises(ValueError, match="k: asked for 4"):
        acquisition.select(pred, 4)
    with pytest.raises(ValueError, match="max_configurations"):
        acquisition.select(pred, 3, "batchbald", max_configurations=3)
    with pytest.raises(TypeError, match="classifier"):
        acquisition.acquire(svi_post, svi_post.x, 2)
