"""Posterior: draws, prediction, and bad data given to fit/predict."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import bnn_pyro as bp


@pytest.fixture(scope="module")
def fitted():
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 25)[:, None]
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(25)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    return bp.fit(model, x, y, num_steps=200, lr=0.05, num_chains=2, num_samples=50, seed=0, progress=False), x


def test_sample_pools_chains(fitted):
    post, _ = fitted
    assert post.num_chains == 2 and post.num_draws == 50
    every = post.sample()
    assert every["0.weight"].shape == (100, 8, 1)
    assert torch.equal(every["0.weight"][50], post.samples["0.weight"][1, 0])
    some = post.sample(30, seed=1)
    assert some["0.weight"].shape == (30, 8, 1) and torch.equal(some["0.bias"], post.sample(30, seed=1)["0.bias"])
    assert post.sample(500, seed=0)["2.bias"].shape == (500, 1)  # more than stored: with replacement


def test_predict_matches_a_loop_over_draws(fitted):
    post, x = fitted
    pred = post.predict(x, draws_per_chunk=7, seed=0)
    draws = post.sample()
    f = torch.stack(
        [post.model.forward_draws({k: v[s : s + 1] for k, v in draws.items()}, x)[0, :, 0] for s in range(100)]
    )
    assert torch.allclose(pred.mean, f.mean(0), atol=1e-5)
    assert torch.allclose(pred.epistemic_std, f.std(0, correction=0), atol=1e-5)
    assert torch.allclose(pred.aleatoric_std, torch.full((25,), 0.1))
    assert pred.draws.shape == (100, 25) and (pred.lower < pred.mean).all() and (pred.mean < pred.upper).all()
    again = post.predict(x, draws_per_chunk=64, seed=0)
    assert torch.equal(pred.draws, again.draws)  # same seed, same predictive draws, chunking aside


def test_moments_only_prediction_and_automatic_chunks(fitted):
    post, x = fitted
    full = post.predict(x, seed=0)
    moments = post.predict(x, interval=None, seed=0)
    assert moments.lower is None and moments.upper is None and moments.interval is None
    for field in ("mean", "std", "epistemic_std", "aleatoric_std"):
        assert torch.allclose(getattr(moments, field), getattr(full, field), atol=1e-6)
    with pytest.raises(ValueError, match="interval=None"):
        bp.metrics.interval_coverage(moments, x[:, 0])
    # the default chunk keeps the widest layer output (8 units here) near 8 MB: all 100 draws at 25 points
    # (capped at 64), and a few draws at a million points
    assert post.model.draws_per_chunk(x) == 64
    assert post.model.draws_per_chunk(torch.zeros(1_000_000, 1)) == 1
    assert post.model.draws_per_chunk(torch.zeros(20_000, 1)) == 8 * 2**20 // (20_000 * 8 * 4)


def test_rows_in_chunks_give_the_same_prediction(fitted, monkeypatch):
    post, x = fitted
    whole = post.predict(x, interval=None, seed=0)
    assert (
        post.model.points_per_chunk(x) == 25 and post.model.points_per_chunk(torch.zeros(10**6, 1)) == 8 * 2**20 // 32
    )
    with pytest.raises(ValueError, match="draws_per_chunk must be a positive int, got 0"):
        post.observation_distribution(x, draws_per_chunk=0)
    monkeypatch.setattr(bp.BNN, "points_per_chunk", lambda self, x: 7)  # 25 rows in chunks of 7
    split = post.predict(x, interval=None, seed=0, draws_per_chunk=3)
    for field in ("mean", "std", "epistemic_std"):
        assert torch.allclose(getattr(split, field), getattr(whole, field), atol=1e-6)
    assert torch.equal(split.mean_draws, whole.mean_draws)


def test_predict_accepts_numpy_and_pandas(fitted):
    post, x = fitted
    a = post.predict(x.numpy()).mean
    b = post.predict(pd.DataFrame(x.numpy())).mean
    assert torch.allclose(a, b) and a.shape == (25,)


@pytest.mark.parametrize(
    "x, y, error, match",
    [
        (
            np.array([[0.0], [np.nan], [1.0]]),
            np.zeros(3),
            ValueError,
            r"x contains NaN values in 1 row\(s\) \(first: \[1\]\); drop or impute",
        ),
        (np.array([[0.0], [np.inf], [1.0]]), np.zeros(3), ValueError, r"x contains Inf values"),
        (np.zeros((3, 1)), np.array([0.0, np.nan, 1.0]), ValueError, r"y contains NaN values"),
        (np.zeros((3, 1)), np.zeros(4), ValueError, r"x and y have different numbers of rows: x has 3, y has 4"),
        (np.zeros((0, 1)), np.zeros(0), ValueError, r"x is empty"),
        (
            np.zeros((3, 2)),
            np.zeros(3),
            ValueError,
            r"x has shape \(3, 2\), which the net cannot take .*match the net's first layer",
        ),
    ],
)
def test_bad_data_is_explained(fitted, x, y, error, match):
    post, _ = fitted
    with pytest.raises(error, match=match):
        bp.fit(post.model, x, y, num_steps=1, progress=False)


def test_predict_rejects_bad_input(fitted):
    post, _ = fitted
    with pytest.raises(ValueError, match="x contains NaN"):
        post.predict(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        post.predict(torch.zeros(2, 1), num_samples=0)
    with pytest.raises(ValueError, match="interval must lie in \\(0, 1\\)"):
        post.predict(torch.zeros(2, 1), interval=95)


def _two_inputs(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ w, 0.1), obs=y)


def test_a_function_posterior_names_the_fitted_row_shape_when_the_model_fails_on_new_x():
    """A Pyro function model run on x with other columns raised torch's 'size mismatch, got input (3), mat (3x5),
    vec (2)' from inside the model; now the error names x's shape and the fitted one (torch's chained)."""
    x = torch.randn(10, 2)
    post = bp.fit(_two_inputs, x, x.sum(1), method="svi", num_steps=2, num_samples=2, progress=False)
    for bad in (torch.randn(3, 5), torch.randn(3)):
        with pytest.raises(
            ValueError, match=r"x has shape \(3(, 5)?,\)?.*fitted on inputs shaped \(N, 2\).*Check"
        ) as info:
            post.predict(bad)
        assert isinstance(info.value.__cause__, RuntimeError)
    assert post.predict(torch.randn(3, 2)).mean.shape == (3,)


def test_inputs_with_another_number_of_dimensions_than_the_training_inputs_are_refused():
    """An MLP fitted on (N, 2) rows maps (N, 1, 2) too, as a sequence of one position: predict returned (N, 1)
    means, which broadcast against (N,) targets into an (N, N) table downstream. Now the rank is checked."""
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    x = torch.randn(10, 2)
    post = bp.fit(model, x, x.sum(1), method="svi", num_steps=2, num_samples=2, progress=False)
    with pytest.raises(
        ValueError,
        match=r"x has 3 dimensions \(shape \(10, 1, 2\)\), but the posterior was fitted on "
        r"inputs with 2 \(shape \(N, 2\)\); reshape x",
    ):
        post.predict(x[:, None, :])
    assert post.predict(x).mean.shape == (10,)
