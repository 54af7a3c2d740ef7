"""Checkpoint/resume of SWA and SWAG (bnn_pyro/infer/swag.py on the driver's one loop): a run that dies after a
checkpoint and is resumed gives exactly (``torch.equal``) the draws, losses, learning rates, moments and chosen
noise of an uninterrupted run, whether its last checkpoint lies in pre-training (the switch to SGD, early
stopping's restore and ``lr="auto"``'s probe still to come) or in the SWA phase (all three behind it, restored
rather than redone), and when the crash hits a later chain (the finished chain's file is only re-read).

The runs hold rows out (the default early stopping and noise choice) and draw minibatches of 32 with
replacement, so one generator feeds the minibatches, the curvature probe and the SWAG draws: a resumed run that
replayed or redrew any of them differently would differ in its losses or draws.
"""

from __future__ import annotations

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod
from bnn_pyro.infer import swag


class _Crash(Exception):
    pass


def _mlp() -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(240, 1, generator=g) * 4 - 2  # 240 rows: 24 held out by default
    return x, torch.sin(2 * x[:, 0]) + 0.2 * torch.randn(240, generator=g)


# 12 pre-training steps then 12 SWA-phase steps; checkpoints after steps 5, 10, 15, 20 and 24
SWAG = dict(
    method="swag",
    pretrain_steps=12,
    num_steps=12,
    burn_in=0,
    collect_every=2,
    swag_rank=3,
    num_samples=8,
    num_chains=2,
    batch_size=32,
    seed=4,
    progress=False,
)


def _crash_at(monkeypatch, chain: int, step: int):
    save = ckpt_mod.Checkpoint.save

    def crashing(self, at, tensors, meta):  # dies before writing the checkpoint of ``step``
        if self.path.name == f"chain{chain}.ckpt" and at == step:
            raise _Crash(at)
        return save(self, at, tensors, meta)

    monkeypatch.setattr(ckpt_mod.Checkpoint, "save", crashing)


def _assert_same(resumed, whole):
    assert resumed.config == whole.config  # the held-out noise choice included
    for group in ("samples", "history", "sample_stats", "point"):
        assert set(getattr(resumed, group)) == set(getattr(whole, group)), group
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)


@pytest.mark.parametrize(
    "chain, crash, last",
    [(0, 15, 10), (0, 20, 15), (1, 5, 24)],
    ids=["in pre-training", "in the SWA phase", "second chain"],
)
def test_swag_resumed_run_is_bit_identical(toy, tmp_path, monkeypatch, chain, crash, last):
    x, y = toy
    whole = bp.fit(_mlp(), x, y, **SWAG)
    assert whole.config["validation"]["rows"] == 24 and whole.config["lr"] == "auto"
    with monkeypatch.context() as m:
        _crash_at(m, chain, crash)
        with pytest.raises(_Crash):
            bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, **SWAG)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == last
    _assert_same(bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, resume=True, **SWAG), whole)


def test_swa_without_pretraining_resumes_in_its_only_phase(toy, tmp_path, monkeypatch):
    """``pretrain_steps=0``: the switch to SGD (and ``lr="auto"``'s probe) comes before the first step."""
    x, y = toy
    cfg = {**SWAG, "method": "swa", "pretrain_steps": 0, "num_chains": 1}
    for key in ("swag_rank", "num_samples"):
        cfg.pop(key)
    whole = bp.fit(_mlp(), x, y, **cfg)
    with monkeypatch.context() as m:
        _crash_at(m, 0, 10)
        with pytest.raises(_Crash):
            bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, **cfg)
    _assert_same(bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, resume=True, **cfg), whole)


def test_moments_of_a_resumed_run_equal_the_uninterrupted_ones(toy, tmp_path, monkeypatch):
    """What subspace inference builds on: the mean, second moment and deviations of the snapshots."""
    x, y = toy
    data = bp.infer.Data(x=x, y=y, batch_size=32)
    cfg = {k: v for k, v in SWAG.items() if k not in ("method", "batch_size")}
    _, whole = swag.fit_moments(_mlp(), data, swag=True, **cfg)
    with monkeypatch.context() as m:
        _crash_at(m, 0, 20)
        with pytest.raises(_Crash):
            swag.fit_moments(_mlp(), data, swag=True, checkpoint=tmp_path, checkpoint_every=5, **cfg)
    _, resumed = swag.fit_moments(_mlp(), data, swag=True, checkpoint=tmp_path, checkpoint_every=5, resume=True, **cfg)
    for a, b in zip(resumed, whole):
        assert a.count == b.count == 6
        for part in ("mean", "sq_mean", "deviations"):
            assert torch.equal(getattr(a, part), getattr(b, part)), part


def test_divergence_in_pre_training_names_the_phase(toy):
    x, y = toy
    phase = r"\(pre-training, lr [0-9.]+e\+0[78]\)"  # on its cosine from pretrain_lr=1e8
    expected = rf"swa: the loss U/N became (inf|nan) at step \d+ {phase} of swa chain 0.*smaller pretrain_lr"
    with pytest.raises(FloatingPointError, match=expected):
        bp.fit(
            _mlp(),
            x,
            y,
            method="swa",
            pretrain_optimizer="sgd",
            pretrain_lr=1e8,
            pretrain_steps=20,
            num_steps=4,
            burn_in=0,
            collect_every=2,
            validation=None,
            progress=False,
        )
