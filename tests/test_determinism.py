"""Determinism: for every registered method, two fits with the same seed give identical draws
(``torch.equal``), and a different seed gives different ones.

The two same-seed fits build their nets under different states of torch's global generator (so
with different initial weights: the default ``init="reset"`` re-draws them under the fit's seed)
and start the fit from different states of it, so an engine that draws from it without seeding it
fails here; and a fit leaves the caller's global random states (torch, numpy, Python) as it found
them. The configurations are the smallest that exercise each engine's random parts
(initialization, minibatch order, noise, proposals, draws from the approximation). MCMC chains run
sequentially here; a slow test checks that forked chains give the same draws. Two fresh Python
processes, each seeding torch differently before building its net, give bit-identical draws for a
representative set of methods (no state shared through the process either).
"""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import forks_chains

import bnn_pyro as bp
from bnn_pyro.infer import Method

# Runs this short are not meant to converge: the samplers' divergence / acceptance warnings are expected.
pytestmark = pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")

TINY = {
    Method.SVI: dict(num_steps=3, num_samples=3),
    Method.NUTS: dict(num_samples=3, num_warmup=3, max_tree_depth=2, chain_method="sequential"),
    Method.HMC: dict(num_samples=3, num_warmup=3, num_leapfrog=2, chain_method="sequential"),
    Method.METROPOLIS: dict(num_samples=5, num_warmup=5, chain_method="sequential"),
    Method.MALA: dict(num_samples=5, num_warmup=5, chain_method="sequential"),
    Method.SGLD: dict(num_samples=3, num_warmup=3, thin=1),
    Method.SGHMC: dict(num_samples=3, num_warmup=3, thin=1),
    Method.CSGMCMC: dict(num_cycles=1, num_samples=3, thin=1),
    Method.SWA: dict(pretrain_steps=3, num_steps=4, collect_every=1),
    Method.SWAG: dict(pretrain_steps=3, num_steps=4, collect_every=1, swag_rank=2, num_samples=3),
    Method.MC_DROPOUT: dict(num_steps=3, num_samples=3),
    Method.VARIATIONAL_DROPOUT: dict(num_steps=3, num_samples=3),
    Method.SPARSE_VD: dict(num_steps=3, num_samples=3),
    Method.ENSEMBLE: dict(num_chains=2, num_steps=3),
    Method.LAPLACE: dict(num_steps=3, polish_steps=2, num_samples=3),
    Method.SNAPSHOT: dict(num_cycles=2, cycle_length=3),
    Method.SUBSPACE: dict(
        subspace_dim=2,
        num_samples=3,
        inner_options=dict(num_warmup=3, max_tree_depth=2, chain_method="sequential"),
        swa=dict(pretrain_steps=3, num_steps=4, collect_every=1, rank=2),
    ),
}


def _model(build_seed: int = 123):
    torch.manual_seed(build_seed)  # the net's initial weights: the fits must not depend on them (init="reset")
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(12, generator=g)


def _fit(method: Method, seed: int, global_seed: int, build_seed: int = 123) -> dict[str, torch.Tensor]:
    x, y = _data()
    model = _model(build_seed)
    torch.manual_seed(global_seed)  # the caller's global generator: engines must not depend on its state
    post = bp.fit(
        model,
        x,
        y,
        method=method.value,
        batch_size=6 if method in _MINIBATCH else None,
        seed=seed,
        progress=False,
        **TINY[method],
    )
    return post.samples


# Engines that take minibatches: their batch order must follow the seed too.
_MINIBATCH = {
    Method.SVI,
    Method.SGLD,
    Method.SGHMC,
    Method.CSGMCMC,
    Method.SWA,
    Method.SWAG,
    Method.SNAPSHOT,
    Method.SUBSPACE,
}


def test_every_method_has_a_tiny_configuration():
    assert set(TINY) == set(Method)


@pytest.mark.parametrize("method", list(Method), ids=lambda m: m.value)
def test_same_seed_same_draws_other_seed_other_draws(method):
    first, other = _fit(method, 0, global_seed=1), _fit(method, 1, global_seed=1)
    again = _fit(method, 0, global_seed=2, build_seed=456)  # another net (initial weights) and global state
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
@forks_chains
def test_parallel_chains_equal_sequential_chains():
    """Chain c is seeded with seed + c in its own process or in this one: the same draws."""
    x, y = _data()
    config = dict(TINY[Method.NUTS], num_chains=2)
    runs = {
        how: bp.fit(_model(), x, y, method="nuts", seed=3, progress=False, **dict(config, chain_method=how)).samples
        for how in ("sequential", "parallel")
    }
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


# One fresh process: torch seeded with sys.argv[1] before the nets are built, then fits with seed=0.
# Prints a digest of the initial weights and one of every fit's draws and deterministic values.
_PROCESS = textwrap.dedent("""
    import hashlib, json, sys, warnings
    import torch
    import bnn_pyro as bp

    warnings.simplefilter("ignore")
    torch.manual_seed(int(sys.argv[1]))
    torch.rand(int(sys.argv[1]))  # and a different number of draws before the net is built
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5))
    weights = bp.BNN(mixed, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5),
                     bayesian="weights")  # biases deterministic: their start must follow the seed too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, generator=g)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(16, generator=g)

    def digest(tensors):
        h = hashlib.sha256()
        for name in sorted(tensors):
            h.update(name.encode() + tensors[name].detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    FITS = {
        "svi": (model, dict(method="svi", num_steps=5, num_samples=3)),
        "svi-low-rank-2-chains": (model, dict(method="svi", guide="low_rank", num_steps=5, num_samples=3,
                                              num_chains=2)),
        "svi-deterministic-biases": (weights, dict(method="svi", guide="map", num_steps=5)),
        "nuts-2-chains": (model, dict(method="nuts", num_samples=3, num_warmup=3, max_tree_depth=2, num_chains=2,
                                      chain_method="sequential", jit=False)),  # the fast path, uncompiled: 6 s less
        "metropolis-deterministic-biases": (weights, dict(method="metropolis", num_samples=3, num_warmup=3)),
        "sgld": (model, dict(method="sgld", num_samples=3, num_warmup=3, thin=1)),
        "swag": (model, dict(method="swag", pretrain_steps=3, num_steps=4, collect_every=1, swag_rank=2,
                             num_samples=3)),
        "mc_dropout": (model, dict(method="mc_dropout", num_steps=3, num_samples=3)),
        "sparse_vd": (model, dict(method="sparse_vd", num_steps=3, num_samples=3)),
        "ensemble": (model, dict(method="ensemble", num_chains=2, num_steps=3)),
        "laplace": (model, dict(method="laplace", num_steps=3, polish_steps=2, num_samples=3)),
    }
    out = {"net": digest(dict(net.named_parameters()))}
    for name, (m, config) in FITS.items():
        post = bp.fit(m, x, y, seed=0, progress=False, **config)
        out[name] = digest({**post.samples, **{"point." + k: v for k, v in post.point.items()}})
    print(json.dumps(out))
""")


def test_two_fresh_processes_give_bit_identical_draws_whatever_torch_drew_before_the_net():
    """``seed=`` alone fixes a fit: each process seeds torch differently (and draws a different
    number of random numbers) before building its nets, as a user who does not seed torch would."""
    env = dict(os.environ, PYTHONHASHSEED="0", MPLBACKEND="Agg")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for k in (1, 2)
    ]
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    first, second = outputs
    assert first.pop("net") != second.pop("net")  # the two nets really start from different weights
    assert len(first) == 11
    differ = [name for name in first if first[name] != second[name]]
    assert not differ, f"draws differ between the two processes for {differ}"
