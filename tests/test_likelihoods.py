"""Likelihoods: targets, noise sites, and the predictive aggregation."""

from __future__ import annotations

import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

import bnn_pyro as bp
from bnn_pyro import predictions


def _obs(likelihood, f, y=None, dataset_size=None):
    tr = poutine.trace(likelihood).get_trace(f, y, dataset_size=dataset_size)
    tr.compute_log_prob()
    return tr


def test_gaussian_known_learned_and_precision_noise():
    f, y = torch.randn(6, 1), torch.randn(6)
    tr = _obs(bp.likelihoods.Gaussian(scale=0.5), f, y)
    assert torch.allclose(tr.nodes["obs"]["log_prob"], dist.Normal(f[:, 0], 0.5).log_prob(y))
    tr = _obs(bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)), f, y)
    assert torch.allclose(tr.nodes["obs"]["fn"].scale, tr.nodes["sigma"]["value"])
    tr = _obs(bp.likelihoods.Gaussian(precision=dist.Gamma(2.0, 1.0)), f, y)
    assert torch.allclose(tr.nodes["obs"]["fn"].scale, tr.nodes["precision"]["value"].rsqrt())
    tr = _obs(bp.likelihoods.Gaussian(scale=0.5), torch.randn(6, 3), torch.randn(6, 3))
    assert tr.nodes["obs"]["fn"].event_shape == (3,)
    with pytest.raises(ValueError, match="give the noise"):
        bp.likelihoods.Gaussian()


def test_data_plate_scales_a_minibatch_by_n_over_b():
    f, y = torch.randn(4, 1), torch.randn(4)
    tr = _obs(bp.likelihoods.Gaussian(scale=1.0), f, y, dataset_size=100)
    assert tr.nodes["obs"]["scale"] == pytest.approx(25.0)
    frame = tr.nodes["obs"]["cond_indep_stack"][0]
    assert frame.name == "data" and frame.size == 4 and frame.full_size == 100


def test_heteroscedastic_splits_mean_and_scale():
    f = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    d = bp.likelihoods.HeteroscedasticGaussian(min_scale=0.01).distribution(f, {})
    assert torch.allclose(d.loc, torch.tensor([1.0, 2.0]))
    assert torch.allclose(d.scale, torch.nn.functional.softplus(torch.tensor([0.0, 3.0])) + 0.01)
    with pytest.raises(ValueError, match="needs a net with 2 \\* D outputs"):
        bp.likelihoods.HeteroscedasticGaussian().check_target(torch.randn(5), 3)


def test_regression_prediction_is_the_law_of_total_variance():
    means = torch.tensor([[0.0], [2.0]])  # two draws, one point
    variances = torch.tensor([[1.0], [3.0]])
    y = torch.randn(1000, 1)
    pred = predictions.regression(means, variances, y, interval=0.9)
    assert pred.mean.item() == 1.0
    assert pred.epistemic_std.item() == pytest.approx(1.0)  # population variance of (0, 2)
    assert pred.aleatoric_std.item() == pytest.approx(2.0**0.5)
    assert pred.std.item() == pytest.approx(3.0**0.5)
    assert torch.allclose(pred.lower, torch.quantile(y, 0.05, dim=0))


def test_classification_prediction_entropy_and_mutual_information():
    probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # two confident draws that disagree
    pred = predictions.classification(probs)
    assert torch.allclose(pred.probs, torch.tensor([[0.5, 0.5]]))
    ln2 = torch.log(torch.tensor(2.0))
    assert torch.allclose(pred.entropy, ln2) and torch.allclose(pred.mutual_information, ln2)
    assert torch.allclose(pred.aleatoric_entropy, torch.zeros(1), atol=1e-6)


def test_bernoulli_reports_two_class_probabilities():
    x = torch.randn(30, 2)
    y = (x[:, 0] > 0).float()
    model = bp.BNN(nn.Linear(2, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Bernoulli())
    post = bp.fit(model, x, y, num_steps=100, lr=0.1, num_samples=20, progress=False)
    pred = post.predict(x)
    assert pred.probs.shape == (30, 2) and (pred.predicted == y.long()).float().mean() > 0.8


@pytest.mark.parametrize(
    "likelihood, out, y, error, match",
    [
        (
            bp.likelihoods.Categorical(),
            3,
            torch.tensor([0.0, 1.0, 2.0, 1.0]),
            TypeError,
            r"Categorical: y must hold integer class labels \(torch.long\), got dtype torch.float32.*y.long\(\)",
        ),
        (
            bp.likelihoods.Categorical(),
            3,
            torch.tensor([0, 1, 3, 1]),
            ValueError,
            r"labels must lie in 0..2 for a net with 3 outputs; found labels in 0..3",
        ),
        (bp.likelihoods.Categorical(), 3, torch.tensor([0, -1, 2, 1]), ValueError, r"labels must lie in 0..2"),
        (
            bp.likelihoods.Bernoulli(),
            1,
            torch.tensor([0.0, 1.0, 0.5, 1.0]),
            TypeError,
            r"Bernoulli: y must hold integer class labels",
        ),
        (
            bp.likelihoods.Bernoulli(),
            1,
            torch.tensor([0, 1, 2, 1]),
            ValueError,
            r"Bernoulli: y must be a vector of 0/1 labels",
        ),
        (
            bp.likelihoods.Gaussian(scale=1.0),
            2,
            torch.randn(4),
            ValueError,
            r"Gaussian: y has shape \(4,\) but the net predicts 2 output\(s\) per row, so y must be shaped \(4, 2\)",
        ),
    ],
)
def test_bad_targets_are_explained(likelihood, out, y, error, match):
    model = bp.BNN(nn.Linear(2, out), prior=bp.priors.Normal(), likelihood=likelihood)
    with pytest.raises(error, match=match):
        bp.fit(model, torch.randn(4, 2), y, num_steps=1, progress=False)


def test_torch_noise_priors_become_pyro_ones_and_must_be_positive():
    td = torch.distributions
    f, y = torch.randn(6, 1), torch.randn(6)
    for likelihood, site, pyro_prior in [
        (bp.likelihoods.Gaussian(scale=td.HalfNormal(2.0)), "sigma", dist.HalfNormal(2.0)),
        (bp.likelihoods.Gaussian(precision=td.Gamma(2.0, 1.0)), "precision", dist.Gamma(2.0, 1.0)),
    ]:
        tr = _obs(likelihood, f, y)
        fn, value = tr.nodes[site]["fn"], tr.nodes[site]["value"]
        assert type(fn) is type(pyro_prior) and torch.allclose(fn.log_prob(value), pyro_prior.log_prob(value))
    for positive in [
        dist.LogNormal(0.0, 1.0),
        dist.InverseGamma(2.0, 1.0),
        dist.Uniform(0.01, 1.0),
        dist.Exponential(1.0),
        dist.HalfCauchy(1.0),
    ]:
        assert bp.likelihoods.Gaussian(scale=positive).sites()["sigma"] is positive
    for real in [dist.Normal(0.0, 1.0), dist.Uniform(-1.0, 1.0), td.StudentT(3.0)]:
        with pytest.raises(ValueError, match=r"scale: \w+ has support .*must be positive"):
            bp.likelihoods.Gaussian(scale=real)


def test_class_labels_shaped_n_by_1_are_accepted():
    labels = torch.tensor([0, 2, 1, 1])
    assert torch.equal(bp.likelihoods.Categorical().check_target(labels[:, None], 3), labels)
