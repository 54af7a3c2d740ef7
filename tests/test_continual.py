"""Tests for bnn_pyro.priors.from_posterior: variational continual learning (Nguyen et al. 2018).

Known answer. Bayesian linear regression with an *orthogonal* design on each task (columns of
``[x, 1]`` orthogonal, so ``X^T X`` is diagonal) has a diagonal Gaussian posterior after task A,
so its moment-matched mean-field Gaussian is the posterior itself and Bayes' rule task by task is
exact: the posterior of task B under the prior ``from_posterior(post_A)`` is the posterior of A+B.

What is left is Monte Carlo error: post_A holds ``S = 4000`` exact draws, so the prior's mean
``mu`` and precision ``lam`` per coordinate are estimates with sd ``sqrt(v_A / S)`` and
``lam * sqrt(2 / (S - 1))`` (independent for Gaussian draws). Task B's posterior per coordinate is
``m = (lam mu + b) / (lam + p)``, ``v = 1 / (lam + p)`` (``p``, ``b`` from task B's data), so by the
delta method ``sd(m) = sqrt((lam / (lam + p))^2 v_A / S + ((mu - m) / (lam + p))^2 lam^2 2 / (S - 1))``
and ``sd(v) = lam sqrt(2 / (S - 1)) / (lam + p)^2``. We require ``|error| < 4 sd`` (two-sided
6e-5 each, ~4e-4 over the 6 checks). The MAP of task B found by an engine must equal the
closed-form ``m`` (the mode of a Gaussian) to optimizer tolerance 1e-4.
"""

import math

import pyro.distributions as dist
import pytest
import torch
from blr import BLR
from pyro import poutine

import bnn_pyro as bp

NOISE, PRIOR, S, Z_MAX = 0.5, 1.0, 4000, 4.0


def _orthogonal_task(n: int, scales, seed: int):
    """Inputs whose columns, with a column of ones, are orthogonal; y from a fixed linear rule."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.cat([torch.ones(n, 1), torch.randn(n, 2, generator=g)], 1).double())
    x = (q[:, 1:] * torch.tensor(scales, dtype=torch.double) * math.sqrt(n)).float()
    y = x @ torch.tensor([0.7, -0.4]) + 0.3 + NOISE * torch.randn(n, generator=g)
    return x, y


def _draws_posterior(blr: BLR, draws: int, seed: int) -> bp.Posterior:
    g = torch.Generator().manual_seed(seed)
    w = (blr.mean + torch.randn(draws, 3, generator=g, dtype=torch.double) * blr.cov.diagonal().sqrt()).float()
    return bp.Posterior(
        samples={"weight": w[:, :2].reshape(1, draws, 1, 2), "bias": w[:, 2].reshape(1, draws, 1)},
        model=blr.model(),
        method="exact",
    )


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([d["weight"].reshape(-1), d["bias"].reshape(-1)]).double()


def test_sequential_updating_reproduces_the_joint_posterior():
    xa, ya = _orthogonal_task(15, (1.0, 0.5), seed=0)
    xb, yb = _orthogonal_task(25, (0.7, 1.5), seed=1)
    task_a = BLR(x=xa, y=ya, noise=NOISE, prior_scale=PRIOR)
    joint = BLR(x=torch.cat([xa, xb]), y=torch.cat([ya, yb]), noise=NOISE, prior_scale=PRIOR)
    off_diagonal = (task_a.cov - task_a.cov.diagonal().diag()).abs().max()
    assert off_diagonal < 1e-6 * task_a.cov.diagonal().min()  # orthogonal design (up to float32 rounding of x)

    prior = bp.priors.from_posterior(_draws_posterior(task_a, S, seed=2))
    model_b = bp.BNN(torch.nn.Linear(2, 1), prior=prior, likelihood=bp.likelihoods.Gaussian(scale=NOISE))
    trace = poutine.trace(model_b).get_trace(xb)  # the BNN's prior sites are the moment-matched Normals
    for name in ("weight", "bias"):
        base = trace.nodes[name]["fn"].base_dist
        assert torch.equal(base.loc, prior.loc[name]) and torch.equal(base.scale, prior.scale[name])

    mu, lam = _flat(prior.loc), 1.0 / _flat(prior.scale) ** 2
    design = torch.cat([xb, torch.ones(len(xb), 1)], 1).double()
    p, b = (design**2).sum(0) / NOISE**2, design.T @ yb.double() / NOISE**2
    mean_b, var_b = (lam * mu + b) / (lam + p), 1.0 / (lam + p)

    lam0, mu0, v_a = 1.0 / task_a.cov.diagonal(), task_a.mean, task_a.cov.diagonal()
    sd_mean = (
        (lam0 / (lam0 + p)) ** 2 * v_a / S + ((mu0 - joint.mean) / (lam0 + p)) ** 2 * lam0**2 * 2 / (S - 1)
    ).sqrt()
    sd_var = lam0 * math.sqrt(2 / (S - 1)) / (lam0 + p) ** 2
    z_mean = (mean_b - joint.mean) / sd_mean
    z_var = (var_b - joint.cov.diagonal()) / sd_var
    assert (z_mean.abs() < Z_MAX).all() and (z_var.abs() < Z_MAX).all(), (z_mean, z_var)

    fit_b = bp.fit(
        model_b,
        xb,
        yb,
        method="ensemble",
        num_chains=1,
        num_steps=250,
        lr=0.1,
        lr_schedule="cosine",
        anchored=False,
        progress=False,
    )  # a plain MAP member (anchored ones sit at a prior draw's tilt)
    map_b = _flat({k: v[0, 0] for k, v in fit_b.samples.items()})
    assert (map_b - mean_b).abs().max() < 1e-4


def test_mean_field_svi_posterior_carries_over(svi_post, linear_data):
    """conftest's svi_post: a Bayesian weight and a deterministic bias (bayesian="weights")."""
    x, y = linear_data
    prior = bp.priors.from_posterior(svi_post)
    draws = svi_post.samples["weight"].reshape(-1, 1, 1)
    assert set(prior.loc) == {"weight"}
    torch.testing.assert_close(prior.loc["weight"], draws.mean(0))
    torch.testing.assert_close(prior.scale["weight"], draws.std(0))
    assert repr(prior) == "FromPosterior(sites=['weight'], entries=1, default=None)"

    likelihood = bp.likelihoods.Gaussian(scale=0.1)
    with pytest.raises(ValueError, match="parameter 'bias' that the posterior has no draws of"):
        bp.BNN(torch.nn.Linear(1, 1), prior=prior, likelihood=likelihood)  # bayesian="all" asks for the bias too
    model = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.from_posterior(svi_post, default=bp.priors.Normal(0.0, 1.0)),
        likelihood=likelihood,
    )
    assert model.sample_names == ["weight", "bias"]
    model = bp.BNN(torch.nn.Linear(1, 1), prior=prior, likelihood=likelihood, bayesian="weights")
    post = bp.fit(model, x[:20], y[:20], method="svi", num_steps=100, lr=0.05, num_samples=50, progress=False)
    assert post.predict(x[:3]).mean.shape == (3,)


def test_only_weight_sites_carry_over(linear_data, tmp_path):
    """Noise and hyper sites stay with the new model's likelihood and prior; a loaded posterior
    without its model still knows which sites are weights."""
    model = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.HierarchicalNormal(),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )
    g = torch.Generator().manual_seed(0)
    samples = {
        "weight": torch.randn(2, 10, 1, 1, generator=g),
        "weight_scale": torch.rand(2, 10, generator=g) + 0.5,
        "bias": torch.randn(2, 10, 1, generator=g),
        "bias_scale": torch.rand(2, 10, generator=g) + 0.5,
        "sigma": torch.rand(2, 10, generator=g) + 0.1,
    }
    post = bp.Posterior(samples=samples, model=model, method="hand", x=linear_data[0], y=linear_data[1])
    assert set(bp.priors.from_posterior(post).loc) == {"weight", "bias"}
    loaded = bp.load(post.save(tmp_path / "task_a.bnn"))
    torch.testing.assert_close(bp.priors.from_posterior(loaded).scale["bias"], samples["bias"].reshape(-1, 1).std(0))


def test_errors(svi_post, function_post, blr_model):
    prior = bp.priors.from_posterior(svi_post)
    gaussian = bp.likelihoods.Gaussian(scale=0.1)
    with pytest.raises(ValueError, match=r"'weight' has shape \(1, 2\) in the new net but \(1, 1\) in the posterior"):
        bp.BNN(torch.nn.Linear(2, 1), prior=prior, likelihood=gaussian, bayesian="weights")
    with pytest.raises(ValueError, match="parameter '0.weight' that the posterior has no draws of"):
        bp.BNN(torch.nn.Sequential(torch.nn.Linear(1, 1)), prior=prior, likelihood=gaussian, bayesian="weights")
    with pytest.raises(ValueError, match="not the weight tensors of a bp.BNN"):
        bp.priors.from_posterior(function_post)
    with pytest.raises(TypeError, match="posterior: expected a bnn_pyro.Posterior"):
        bp.priors.from_posterior({"weight": torch.zeros(2, 1, 1)})
    one = bp.Posterior(samples={"weight": torch.zeros(1, 1, 1, 1)}, model=blr_model, method="hand")
    with pytest.raises(ValueError, match="'weight' has 1 draw; a spread needs at least 2"):
        bp.priors.from_posterior(one)
    flat = bp.Posterior(samples={"weight": torch.zeros(2, 5, 1, 1)}, model=blr_model, method="hand")
    with pytest.raises(ValueError, match="zero or non-finite spread"):
        bp.priors.from_posterior(flat)
