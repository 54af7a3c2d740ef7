"""What the driver (bnn_pyro/infer/driver.py) gives every registered method, checked method by method.

* checkpoint/resume: every method that takes ``checkpoint=`` (its declaration's ``Capabilities.checkpoint``)
  resumes bit-identically after a crash; every other method refuses ``checkpoint=`` with an error naming
  the methods that take it.
* the same seed gives the same draws, and ``progress=False`` prints nothing.
* streaming: a one-shot generator of ``(x, y)`` batches with ``dataset_size`` is fitted by every method whose
  declaration says it consumes one (a Posterior without training data), and refused by every other method
  before fitting, with an error naming the methods that take a stream.
"""

from __future__ import annotations

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import REGISTRY, Method
from bnn_pyro.infer import checkpoint as ckpt_mod

# the smallest runs that exercise each method's loop (several steps between checkpoints)
TINY = {
    "svi": dict(num_steps=12, num_samples=4, num_chains=2),
    "nuts": dict(num_samples=4, num_warmup=4, num_chains=1, max_tree_depth=3),
    "hmc": dict(num_samples=4, num_warmup=4, num_chains=1, num_leapfrog=3),
    "metropolis": dict(num_samples=4, num_warmup=4, num_chains=1),
    "mala": dict(num_samples=4, num_warmup=4, num_chains=1),
    "sgld": dict(num_samples=4, num_warmup=6, thin=1),
    "sghmc": dict(num_samples=4, num_warmup=6, thin=1),
    "csgmcmc": dict(num_cycles=2, num_samples=4, thin=1),
    "swa": dict(pretrain_steps=6, num_steps=6, collect_every=2),
    "swag": dict(pretrain_steps=6, num_steps=6, collect_every=2, swag_rank=2, num_samples=4, num_chains=1),
    "mc_dropout": dict(num_steps=12, num_samples=4),
    "variational_dropout": dict(num_steps=12, num_samples=4, num_chains=2),
    "sparse_vd": dict(num_steps=12, num_samples=4),
    "ensemble": dict(num_chains=2, num_steps=12, lr=1.0),  # member 0 peaks on held-out rows at step 3 (of 12)
    "laplace": dict(num_steps=12, lr=1.0, num_samples=4),  # its MAP search peaks on held-out rows at step 3 (of 12)
    "snapshot": dict(num_cycles=2, cycle_length=6),
    "subspace": dict(
        subspace_dim=2,
        num_samples=4,
        inner_options=dict(num_warmup=4, max_tree_depth=2),
        swa=dict(pretrain_steps=6, num_steps=6, collect_every=2, rank=2),
    ),
}
METHODS = [m.value for m in Method]


def test_every_method_has_tiny_settings():
    assert set(TINY) >= set(METHODS)  # a new method must be added to this matrix


def _model() -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.2))


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(240, 1, generator=g) * 4 - 2  # 240 rows: the default held-out split (24 rows) applies
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(240, generator=g)


def _fit(method, x, y, **extra):
    return bp.fit(_model(), x, y, method=method, seed=3, progress=False, **TINY.get(method, {}), **extra)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("method", METHODS)
def test_checkpoint_resume_is_bit_identical_or_refused_by_name(method, toy, tmp_path, monkeypatch):
    x, y = toy
    takes = "checkpoint" in bp.infer.options(method)
    assert takes == bp.infer.REGISTRY[bp.infer.Method(method)].capabilities.checkpoint, "declared checkpoint=True"
    if not takes:
        with pytest.raises(TypeError, match=rf"checkpoint: not an option of method='{method}'.*\(svi, "):
            _fit(method, x, y, checkpoint=tmp_path)
        return
    whole = _fit(method, x, y)
    saves = []
    save = ckpt_mod.Checkpoint.save

    def crashing(self, step, tensors, meta):  # the second save of chain 0 dies before writing
        if self.path.name == "chain0.ckpt":
            saves.append(step)
            if len(saves) == 2:
                raise _Crash(step)
        return save(self, step, tensors, meta)

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.Checkpoint, "save", crashing)
        with pytest.raises(_Crash):
            _fit(method, x, y, checkpoint=tmp_path, checkpoint_every=4)
    (first,) = tmp_path.rglob("chain0.ckpt")  # subspace: in the sub-folder of the stage that crashed
    assert ckpt_mod.read(first)[1]["step"] == saves[0] < saves[1]
    resumed = _fit(method, x, y, checkpoint=tmp_path, checkpoint_every=4, resume=True)
    for name in whole.samples:
        assert torch.equal(resumed.samples[name], whole.samples[name]), name
    for name in whole.history:
        assert torch.equal(resumed.history[name], whole.history[name]), name


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_same_draws_and_progress_false_prints_nothing(method, toy, capfd):
    x, y = toy
    first, second = _fit(method, x, y), _fit(method, x, y)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    for name in first.samples:
        assert torch.equal(first.samples[name], second.samples[name]), name


def _one_shot(x, y, batch=40):
    """A generator of (x, y) batches: it can be consumed once only."""
    while True:
        for i in range(0, x.shape[0], batch):
            yield x[i : i + batch], y[i : i + batch]


@pytest.mark.parametrize("method", METHODS)
def test_one_shot_stream_is_fitted_or_refused_naming_the_alternatives(method, toy):
    x, y = toy
    takers = [m for m in METHODS if REGISTRY[Method(m)].capabilities.one_shot]
    assert {"svi", "sgld", "ensemble"} <= set(takers) and "laplace" not in takers
    stream = _one_shot(x, y)
    if method not in takers:
        with pytest.raises(ValueError, match=rf"^x: method='{method}' .*one-shot iterator") as err:
            bp.fit(_model(), stream, method=method, dataset_size=len(x), seed=3, progress=False, **TINY[method])
        assert all(m in str(err.value) for m in takers), str(err.value)
        return
    post = bp.fit(_model(), stream, method=method, dataset_size=len(x), seed=3, progress=False, **TINY[method])
    assert post.x is None and post.y is None and post.config["dataset_size"] == len(x)
    assert all(torch.isfinite(v).all() for v in post.samples.values())
    assert post.predict(x[:5]).mean.shape[0] == 5  # a usable posterior: the stream held all the training data
