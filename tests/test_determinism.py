"""Determinism: for every registered method, two fits with the same seed in one process give
identical draws (``torch.equal``), and a different seed gives different ones.

The two same-seed fits start from different states of torch's global generator, so an engine that
draws from it without seeding it fails here; and a fit leaves the caller's global random states
(torch, numpy, Python) as it found them. The configurations are the smallest that exercise each
engine's random parts (initialization, minibatch order, noise, proposals, draws from the
approximation). MCMC chains run sequentially here; a slow test checks that forked chains give the
same draws.
"""

import os
import random

import numpy as np
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import Method

# Runs this short are not meant to converge: the samplers' divergence / acceptance warnings are expected.
pytestmark = pytest.mark.filterwarnings("ignore::bnn_pyro.diagnostics.DiagnosticWarning")

TINY = {
    Method.SVI: dict(num_steps=3, num_samples=3),
    Method.NUTS: dict(num_samples=3, num_warmup=3, max_tree_depth=2, chain_method="sequential"),
    Method.HMC: dict(num_samples=3, num_warmup=3, num_leapfrog=2, chain_method="sequential"),
    Method.METROPOLIS: dict(num_samples=5, num_warmup=5, chain_method="sequential"),
    Method.SGLD: dict(num_samples=3, num_warmup=3, thin=1),
    Method.SGHMC: dict(num_samples=3, num_warmup=3, thin=1),
    Method.CSGMCMC: dict(num_cycles=1, num_samples=3, thin=1),
    Method.SWA: dict(pretrain_steps=3, num_steps=4, collect_every=1),
    Method.SWAG: dict(pretrain_steps=3, num_steps=4, collect_every=1, rank=2, num_samples=3),
    Method.MC_DROPOUT: dict(num_steps=3, num_samples=3),
    Method.VARIATIONAL_DROPOUT: dict(num_steps=3, num_samples=3),
    Method.SPARSE_VD: dict(num_steps=3, num_samples=3),
    Method.ENSEMBLE: dict(num_members=2, num_steps=3),
    Method.LAPLACE: dict(num_steps=3, polish_steps=2, num_samples=3),
}


def _model():
    torch.manual_seed(123)  # the same net (initial weights) for every fit
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(12, generator=g)


def _fit(method: Method, seed: int, global_seed: int) -> dict[str, torch.Tensor]:
    x, y = _data()
    model = _model()
    torch.manual_seed(global_seed)  # the caller's global generator: engines must not depend on its state
    post = bp.fit(model, x, y, method=method.value, batch_size=6 if method in _MINIBATCH else None, seed=seed,
                  progress=False, **TINY[method])
    return post.samples


# Engines that take minibatches: their batch order must follow the seed too.
_MINIBATCH = {Method.SVI, Method.SGLD, Method.SGHMC, Method.CSGMCMC, Method.SWA, Method.SWAG}


def test_every_method_has_a_tiny_configuration():
    assert set(TINY) == set(Method)


@pytest.mark.parametrize("method", list(Method), ids=lambda m: m.value)
def test_same_seed_same_draws_other_seed_other_draws(method):
    first, again, other = _fit(method, 0, global_seed=1), _fit(method, 0, global_seed=2), _fit(method, 1, global_seed=1)
    assert first and set(first) == set(again) == set(other)
    for name in first:
        assert torch.equal(first[name], again[name]), f"{method.value}: {name!r} differs between two fits with seed 0"
    assert any(not torch.equal(first[n], other[n]) for n in first), f"{method.value}: seeds 0 and 1 gave the same draws"


def test_a_fit_leaves_the_global_random_states_as_it_found_them():
    (x, y), model = _data(), _model()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    bp.fit(model, x, y, method="svi", seed=0, progress=False, **TINY[Method.SVI])  # reseeds all three inside
    got = torch.rand(3), np.random.rand(3), random.random()
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


@pytest.mark.slow  # two forked processes: ~10 s on 2 busy cores
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="parallel chains need 2+ cores")
def test_parallel_chains_equal_sequential_chains():
    """Chain c is seeded with seed + c in its own process or in this one: the same draws."""
    x, y = _data()
    config = dict(TINY[Method.NUTS], num_chains=2)
    runs = {how: bp.fit(_model(), x, y, method="nuts", seed=3, progress=False, **dict(config, chain_method=how)).samples
            for how in ("sequential", "parallel")}
    for name, draws in runs["sequential"].items():
        assert draws.shape[0] == 2 and torch.equal(draws, runs["parallel"][name]), name


def test_predict_with_a_seed_repeats_and_leaves_the_global_generator_alone():
    x, y = _data()
    post = bp.fit(_model(), x, y, method="svi", seed=0, progress=False, **TINY[Method.SVI])
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    first, again, other = (post.predict(x, seed=s).draws for s in (0, 0, 1))
    assert torch.equal(torch.rand(2), expected)
    assert torch.equal(first, again) and not torch.equal(first, other)
