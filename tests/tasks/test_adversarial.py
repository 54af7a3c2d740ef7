"""FGSM on a posterior: the gradient of the predictive (mixture) NLL, by hand for a softmax-linear model."""

from __future__ import annotations

import pytest
import torch

from bnn_pyro import adversarial, metrics


def _hand_gradient(post, x, y):
    """d/dx -log (1/S) sum_s softmax(W_s x + b_s)[y] in closed form."""
    draws = post.sample()
    w, b = draws["weight"].double(), draws["bias"].double()  # (S, K, D), (S, K)
    p = torch.softmax(torch.einsum("skd,nd->snk", w, x.double()) + b[:, None], -1)  # (S, N, K)
    p_y = p[:, torch.arange(len(y)), y]  # (S, N)
    w_y = w[:, y]  # (S, N, D)
    expected_w = torch.einsum("snk,skd->snd", p, w)
    dp_y = p_y[..., None] * (w_y - expected_w)  # d p_s[y] / dx
    return -dp_y.mean(0) / p_y.mean(0)[:, None]


def test_fgsm_steps_along_the_sign_of_the_predictive_nll_gradient(classifier_post):
    x, y = classifier_post.x, classifier_post.y
    grad = _hand_gradient(classifier_post, x, y)
    eps = 0.05
    x_adv = adversarial.fgsm(classifier_post, x, y, eps, num_samples=None)
    assert torch.allclose(x_adv - x, eps * grad.sign().to(x.dtype), atol=1e-6)
    idx = torch.arange(classifier_post.num_chains * classifier_post.num_draws)
    before = adversarial.predictive_nll(classifier_post, x, y, idx)
    after = adversarial.predictive_nll(classifier_post, x_adv, y, idx)
    assert (after > before).float().mean() > 0.95  # a small step up the gradient raises each row's loss
    assert metrics.nll(classifier_post.predict(x_adv), y) > metrics.nll(classifier_post.predict(x), y)


def test_fgsm_defaults_eps_zero_and_bounds(classifier_post):
    x, y = classifier_post.x, classifier_post.y
    assert torch.equal(adversarial.fgsm(classifier_post, x, y, 0.0), x)
    x_adv = adversarial.fgsm(classifier_post, x, y, 0.5)  # default: 100 draws picked with seed 0
    assert torch.equal(x_adv, adversarial.fgsm(classifier_post, x, y, 0.5))
    assert torch.allclose((x_adv - x).abs(), torch.full_like(x, 0.5))
    clipped = adversarial.fgsm(classifier_post, x, y, 0.5, bounds=(-1.0, 1.0))
    assert clipped.min() >= -1.0 and clipped.max() <= 1.0


def test_fgsm_works_for_regression(svi_post):
    x, y = svi_post.x, svi_post.y
    x_adv = adversarial.fgsm(svi_post, x, y, 0.1)
    assert x_adv.shape == x.shape and metrics.nll(svi_post, x_adv, y) > metrics.nll(svi_post, x, y)


def test_fgsm_bad_input(classifier_post):
    x, y = classifier_post.x, classifier_post.y
    with pytest.raises(ValueError, match=r"eps must be a positive finite number, got -0\.1"):
        adversarial.fgsm(classifier_post, x, y, -0.1)
    with pytest.raises(ValueError, match=r"bounds: expected \(lo, hi\) with lo < hi, got \(1\.0, 0\.0\)"):
        adversarial.fgsm(classifier_post, x, y, 0.1, bounds=(1.0, 0.0))
    with pytest.raises(TypeError, match=r"post: expected a bnn_pyro\.Posterior .*got ClassificationPrediction"):
        adversarial.fgsm(classifier_post.predict(x), x, y, 0.1)
    with pytest.raises(ValueError, match=r"x and y have different numbers of rows: x has 60, y has 5"):
        adversarial.fgsm(classifier_post, x, y[:5], 0.1)


def test_fgsm_reads_a_dataframe_by_the_fitted_column_names(classifier_post):
    """A posterior fitted on a DataFrame predicts on one by column name; FGSM read it by position."""
    import dataclasses

    import pandas as pd

    x, y = classifier_post.x, classifier_post.y
    names = [f"f{i}" for i in range(x.shape[1])]
    post = dataclasses.replace(classifier_post, feature_names=names)
    frame = pd.DataFrame(x.numpy(), columns=names)
    expected = adversarial.fgsm(post, x, y, 0.1)
    assert torch.equal(adversarial.fgsm(post, frame[names[::-1]], y, 0.1), expected)
