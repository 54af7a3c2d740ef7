"""Streaming data (bnn_pyro/infer/_common.Data): generators, one-shot iterators and IterableDatasets
of batches. A fit on a stream must do exactly what the fit on tensors does when the stream yields
the same batches in the same order (same random draws, same arithmetic): equality, not closeness."""

from __future__ import annotations

import pytest
import torch

import bnn_pyro as bp

N, BATCH, SEED = 60, 20, 0


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(N, 1, generator=g) * 4 - 2
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(N, generator=g)


def _model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def _same_batches(x, y, seed):
    """The minibatches a tensor fit draws (Data.batches: a reshuffle per epoch from ``seed``), as a
    generator that never holds more than one epoch's index."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(N, generator=g)
        for i in range(0, N, BATCH):
            yield x[perm[i : i + BATCH]], y[perm[i : i + BATCH]]


@pytest.mark.parametrize(
    "method, config",
    [
        ("svi", dict(num_steps=30, num_samples=50)),
        ("sgld", dict(lr=1e-3, num_samples=5, num_warmup=10)),
        ("sghmc", dict(num_samples=3, num_warmup=10)),  # auto step size (curvature from the current batch)
        ("csgmcmc", dict(num_cycles=2, num_samples=4, thin=2)),
    ],
)
def test_generator_fit_equals_tensor_fit(method, config):
    x, y = _data()
    on_tensors = bp.fit(_model(), x, y, method=method, batch_size=BATCH, seed=SEED, progress=False, **config)
    streamed = bp.fit(
        _model(), _same_batches(x, y, SEED), method=method, dataset_size=N, seed=SEED, progress=False, **config
    )
    for name, draws in on_tensors.samples.items():
        assert torch.equal(streamed.samples[name], draws), name
    for key, trace in on_tensors.history.items():
        assert torch.equal(streamed.history[key], trace), key
    assert streamed.x is None and streamed.config["dataset_size"] == N


def test_one_shot_iterator_that_runs_out_names_the_fix():
    x, y = _data()
    batches = iter([(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N, BATCH)])  # 3 batches, once
    with pytest.raises(ValueError, match="ran out after 3 batches.*re-iterable"):
        bp.fit(_model(), batches, method="svi", dataset_size=N, num_steps=5, progress=False)


def test_multi_pass_methods_refuse_a_one_shot_generator():
    x, y = _data()
    with pytest.raises(ValueError, match="method='laplace' goes over the data more than once.*re-iterable"):
        bp.fit(_model(), _same_batches(x, y, 0), method="laplace", dataset_size=N, progress=False)


def test_generator_needs_dataset_size_and_num_steps():
    x, y = _data()
    with pytest.raises(ValueError, match="dataset_size"):
        bp.fit(_model(), _same_batches(x, y, 0), method="svi", num_steps=2, progress=False)
    with pytest.raises(ValueError, match="epochs: needs a loader with a length"):
        bp.fit(_model(), _same_batches(x, y, 0), method="svi", dataset_size=N, epochs=1, progress=False)


class _Batches(torch.utils.data.IterableDataset):
    """A re-iterable stream: every pass yields the data again in batches of BATCH rows."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(0, N, BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]


def test_iterable_dataset_goes_round_epochs_and_posterior_works_without_training_data(tmp_path):
    x, y = _data()
    post = bp.fit(
        _model(), _Batches(x, y), method="svi", dataset_size=N, num_steps=7, num_samples=20, seed=SEED, progress=False
    )  # 7 steps = 2 passes of 3 batches and one more
    assert post.x is None and post.history["loss"].shape == (1, 7)
    pred = post.predict(x[:5], seed=0)
    assert pred.mean.shape[0] == 5
    assert "r_hat" in post.summary(warn=False).columns
    with pytest.warns(UserWarning, match="LOO and WAIC need them: pass x= and y="):
        assert "log_likelihood" not in post.to_inference_data().groups()
    assert "log_likelihood" in post.to_inference_data(x=x, y=y).groups()
    post.save(tmp_path / "post")
    assert torch.equal(bp.load(tmp_path / "post").samples["0.weight"], post.samples["0.weight"])
