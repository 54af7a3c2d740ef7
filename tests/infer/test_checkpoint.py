"""Checkpoint and resume (bnn_pyro/infer/checkpoint.py): a run interrupted after a checkpoint and
resumed gives exactly (``torch.equal``) the losses and draws of an uninterrupted run; a process
killed mid-write leaves a complete previous checkpoint; a checkpoint is never silently overwritten."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from resume import ResumeSpy

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod
from bnn_pyro.infer import svi as svi_mod


class _Crash(Exception):
    pass


def _crash_at(monkeypatch, module, name: str, crash_step: int):
    """Make ``module.name`` (a checkpoint save) raise when asked to save after ``crash_step`` steps,
    before writing: the run dies with its last checkpoint some steps behind."""
    original = getattr(module, name)

    def save(ckpt, step, *args):
        if step == crash_step:
            raise _Crash(step)
        return original(ckpt, step, *args)

    monkeypatch.setattr(module, name, save)


def _mlp() -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(37, 1, generator=g) * 4 - 2
    return x, torch.sin(x) + 0.1 * torch.randn(x.shape, generator=g)


SVI = dict(
    method="svi",
    guide="mean_field",
    num_steps=20,
    batch_size=8,
    lr=0.05,
    lr_schedule="cosine",
    num_samples=20,
    num_chains=2,
    seed=3,
    progress=False,
)


def test_svi_resumed_run_is_bit_identical(toy, tmp_path, monkeypatch):
    x, y = toy
    whole = bp.fit(_mlp(), x, y, **SVI)
    (tmp_path / "a").mkdir()
    with monkeypatch.context() as m:  # chain 0 dies at step 18, its last checkpoint being at step 12
        _crash_at(m, svi_mod, "save_svi", 18)
        with pytest.raises(_Crash):
            bp.fit(_mlp(), x, y, checkpoint=tmp_path / "a", checkpoint_every=6, **SVI)
    assert ckpt_mod.read(tmp_path / "a" / "chain0.ckpt")[1]["step"] == 12
    with monkeypatch.context() as m:  # a seeded fresh start gives the same bits: check it read step 12 and went on
        spy = ResumeSpy(m)
        resumed = bp.fit(_mlp(), x, y, checkpoint=tmp_path / "a", checkpoint_every=6, resume=True, **SVI)
    spy.check(12)
    assert torch.equal(resumed.history["loss"], whole.history["loss"])
    for name in whole.samples:
        assert torch.equal(resumed.samples[name], whole.samples[name]), name


SGHMC = dict(method="sghmc", num_samples=10, thin=2, num_warmup=12, batch_size=8, seed=5, progress=False)


def test_sghmc_resumed_run_is_bit_identical(toy, tmp_path, monkeypatch):
    x, y = toy
    whole = bp.fit(_mlp(), x, y, **SGHMC)
    with monkeypatch.context() as m:  # dies at step 25 (of 32), after draws were kept; checkpoint at 20
        _crash_at(m, ckpt_mod.Checkpoint, "save", 25)
        with pytest.raises(_Crash):
            bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, **SGHMC)
    with monkeypatch.context() as m:  # a seeded fresh start gives the same bits: check it read step 20 and went on
        spy = ResumeSpy(m)
        resumed = bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=5, resume=True, **SGHMC)
    spy.check(20)
    for group in ("samples", "sample_stats", "history"):
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)


def test_existing_checkpoint_is_never_overwritten_and_other_runs_are_refused(toy, tmp_path):
    x, y = toy
    cfg = {**SVI, "num_chains": 1, "num_steps": 4}
    bp.fit(_mlp(), x, y, checkpoint=tmp_path, **cfg)
    before = (tmp_path / "chain0.ckpt").read_bytes()
    with pytest.raises(FileExistsError, match="resume=True"):
        bp.fit(_mlp(), x, y, checkpoint=tmp_path, **cfg)
    with pytest.raises(ckpt_mod.CheckpointError, match="lr"):
        bp.fit(_mlp(), x, y, checkpoint=tmp_path, resume=True, **{**cfg, "lr": 0.01})
    assert (tmp_path / "chain0.ckpt").read_bytes() == before
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        bp.fit(_mlp(), x, y, checkpoint=tmp_path / "missing", **cfg)
    with pytest.raises(ValueError, match="checkpoint=FOLDER"):
        bp.fit(_mlp(), x, y, resume=True, **cfg)


def test_measured_diagnostics_in_the_run_record_do_not_refuse_a_resume(tmp_path):
    """A Laplace approximation's k_hat and a Hessian's damping are measured from the data (their last bits follow the
    thread count): a resume compares the run without them, but still refuses a run whose choices differ."""
    run = {"method": "nuts", "start": "laplace", "laplace_k_hat": 0.0138, "collection": {"k_hat": 0.1, "damping": 0.0}}
    ckpt_mod.Checkpoint(tmp_path, every=None, resume=False, chain=0, run=run).save(1, {"z": torch.zeros(2)}, {})
    measured = {**run, "laplace_k_hat": 0.0603, "collection": {"k_hat": 0.12, "damping": 1e-9}}
    assert ckpt_mod.Checkpoint(tmp_path, every=None, resume=True, chain=0, run=measured).load() is not None
    with pytest.raises(ckpt_mod.CheckpointError, match="start"):
        ckpt_mod.Checkpoint(tmp_path, every=None, resume=True, chain=0, run={**measured, "start": "prior"}).load()


def test_unreadable_checkpoint_names_the_file(tmp_path):
    bad = tmp_path / "chain0.ckpt"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ckpt_mod.CheckpointError, match="chain0.ckpt"):
        ckpt_mod.read(bad)


_WRITER = """
import sys, torch
from bnn_pyro.infer.checkpoint import write
i = int(sys.argv[2])
while True:
    write(sys.argv[1], {"payload": torch.full((4_000_000,), float(i))}, {"i": i})  # 16 MB per write
    print(i, flush=True)
    i += 1
"""


def _complete(path) -> int:
    tensors, meta = ckpt_mod.read(path)  # loads, passes its checksum
    assert torch.equal(tensors["payload"], torch.full((4_000_000,), float(meta["i"])))  # one whole write
    return meta["i"]


@pytest.mark.slow
def test_killed_writer_leaves_a_complete_checkpoint(tmp_path):
    """SIGKILL a process that rewrites one checkpoint in a loop, at least three times at different
    moments (each time restarted where it left off): the file always loads and is one complete write,
    the newest one reported or a later one. A leftover temporary file shows that a kill hit a write.
    The kill comes at a fraction of the writer's own cycle (timed between two of its writes), so the
    moments spread over the cycle however busy the machine is (fixed delays of 11-43 ms all landed in
    the tensor's hashing on a loaded machine); the kills go on until one has hit a write, at phases that sweep
    the cycle ever more finely (at most 30: on an idle machine the write is a small part of the cycle, and 12
    kills at six phases once all missed it)."""
    path, start, mid_write = tmp_path / "c.ckpt", 0, 0
    sweep = [0.5, 0.8, 0.3, 0.65, 0.95, 0.15] + [(k + 0.5) / 24 for k in range(24)]
    for kill, phase in enumerate(sweep):
        if kill >= 3 and mid_write > 0:
            break
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(start)], stdout=subprocess.PIPE, text=True
        )
        try:
            proc.stdout.readline()
            began = time.perf_counter()
            done = int(proc.stdout.readline())  # at least two writes are complete
            time.sleep(phase * (time.perf_counter() - began))  # into the next write's cycle
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        temporary = list(tmp_path.glob(".c.ckpt.*.tmp"))
        mid_write += len(temporary)
        for t in temporary:
            t.unlink()
        start = _complete(path) + 1
        assert start > done
    assert mid_write > 0  # at least one kill landed inside a write (with 16 MB writes, nearly all do)


class _FakeCuda:
    """torch.cuda as seen by the checkpoint's generator code on a 2-device machine (CPU tensors as states)."""

    def __init__(self, states):
        self.states, self.set = states, None

    def patch(self, m):
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: len(self.states))
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        m.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "set", [s.clone() for s in states]))


def test_cuda_generator_states_are_saved_and_restored_when_cuda_is_in_use(monkeypatch):
    """The device logic on CPU: with CUDA initialised, every device's generator state goes into the checkpoint
    and comes back on resume, in device order; a machine without those devices refuses to resume."""
    states = [torch.arange(i, i + 10 * (i + 1), dtype=torch.uint8) for i in range(2)]  # device 1's is longer
    fake = _FakeCuda(states)
    with monkeypatch.context() as m:
        fake.patch(m)
        tensors, meta = ckpt_mod.rng_state()
        assert [k for k in tensors if k.startswith("rng/cuda/")] == ["rng/cuda/0", "rng/cuda/1"]
        ckpt_mod.set_rng_state(tensors, meta)
    assert [torch.equal(a, b) for a, b in zip(fake.set, states)] == [True, True]
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ckpt_mod.CheckpointError, match=r"2 CUDA device\(s\), but this machine has 0"):
            ckpt_mod.set_rng_state(tensors, meta)
    with monkeypatch.context() as m:  # devices present but CUDA never initialised: their generators are not in use
        fake.patch(m)
        m.setattr(torch.cuda, "is_initialized", lambda: False)
        assert not any(k.startswith("rng/cuda/") for k in ckpt_mod.rng_state()[0])
    here, _ = ckpt_mod.rng_state()  # this machine, unpatched: CUDA entries exactly when CUDA is in use here
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert any(k.startswith("rng/cuda/") for k in here) == in_use


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generators_round_trip_on_a_real_device():
    torch.zeros(1, device="cuda")  # initialise CUDA
    tensors, meta = ckpt_mod.rng_state()
    expected = torch.rand(3, device="cuda")
    ckpt_mod.set_rng_state(tensors, meta)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_extra_state_round_trips_a_generator_lists_and_early_stopping_through_a_file(tmp_path):
    from bnn_pyro.infer.holdout import BestOnHoldout

    gen, sums, baseline, best = torch.Generator().manual_seed(7), [torch.zeros(3), torch.zeros(2, 2)], [], None
    best = BestOnHoldout(2)
    torch.rand(5, generator=gen)
    sums[0] += torch.tensor([1.0, 2.0, 3.0])
    baseline.append(0.1 + 0.2)  # a float that JSON must keep to the last bit
    best.record(1, -3.5, [torch.ones(2)])
    tensors, meta = ckpt_mod.ExtraState(gen=gen, sums=sums, baseline=baseline, best=best).state_dict()
    ckpt_mod.write(tmp_path / "x.ckpt", tensors, meta)
    expected = torch.rand(4, generator=gen)

    fresh = torch.Generator().manual_seed(0), [torch.full((3,), 9.0), torch.zeros(2, 2)], [], BestOnHoldout(2)
    ckpt_mod.ExtraState(gen=fresh[0], sums=fresh[1], baseline=fresh[2], best=fresh[3]).load_state_dict(
        *ckpt_mod.read(tmp_path / "x.ckpt")
    )
    assert torch.equal(torch.rand(4, generator=fresh[0]), expected)
    assert torch.equal(fresh[1][0], sums[0]) and torch.equal(fresh[1][1], sums[1])
    assert fresh[2] == [0.1 + 0.2] and fresh[3].best_step == 1 and torch.equal(fresh[3].state[0], torch.ones(2))


# ---------------------------------------------------------------------- MCMC (bnn_pyro/infer/mcmc.py)
# 12 warm-up iterations: Pyro's schedule for them is a 1-step buffer, one mass-matrix window (steps 1-10) and a
# 1-step buffer, so a checkpoint every 5 iterations lands inside the window (step 5: the Welford estimator and the
# dual averaging half-way), at its end (10) and in the sampling phase (15), then after the last iteration (20)
MCMC = dict(num_warmup=12, num_samples=8, num_chains=1, seed=4, progress=False)
KERNELS = {
    "nuts": dict(method="nuts", max_tree_depth=4),
    "nuts_dense": dict(method="nuts", max_tree_depth=4, dense_mass=True),
    "hmc": dict(method="hmc", num_leapfrog=4),
    "metropolis": dict(method="metropolis"),
    "nuts_pyro": dict(method="nuts", max_tree_depth=3, fast_path=False),  # Pyro's own kernel, traced model
}
_WHOLE = {}


def _mcmc(x, y, case, **extra):
    return bp.fit(_mlp(), x, y, **{**MCMC, **KERNELS[case], **extra})


@pytest.mark.parametrize("crash, resumed_from", [(10, 5), (20, 15)], ids=["mid_warmup", "mid_sampling"])
@pytest.mark.parametrize("case", KERNELS)
def test_mcmc_resumed_run_is_bit_identical(case, crash, resumed_from, toy, tmp_path, monkeypatch):
    """The chain dies when saving after ``crash`` iterations; resumed from the checkpoint ``resumed_from``
    iterations in (inside the mass-matrix window, or among the kept draws), it gives exactly the draws,
    statistics and adapted mass matrix of an uninterrupted run, on the fast path and on Pyro's kernels."""
    x, y = toy
    whole = _WHOLE.get(case) or _WHOLE.setdefault(case, _mcmc(x, y, case))
    assert whole.config["fast_path"] == (case != "nuts_pyro")
    with monkeypatch.context() as m:
        _crash_at(m, ckpt_mod.Checkpoint, "save", crash)
        with pytest.raises(_Crash):
            _mcmc(x, y, case, checkpoint=tmp_path, checkpoint_every=5)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == resumed_from
    with monkeypatch.context() as m:  # a seeded fresh start gives the same bits: check it read the file and went on
        spy = ResumeSpy(m)
        resumed = _mcmc(x, y, case, checkpoint=tmp_path, checkpoint_every=5, resume=True)
    spy.check(resumed_from)
    for group in ("samples", "sample_stats", "history"):
        assert set(getattr(resumed, group)) == set(getattr(whole, group))
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)


def test_mcmc_chains_in_processes_resume_each_from_its_own_file(toy, tmp_path, monkeypatch):
    x, y = toy
    whole = _mcmc(x, y, "metropolis", num_chains=2)
    with monkeypatch.context() as m:  # chain 0 dies (in its process, when the chains run in parallel); chain 1 ends
        original = ckpt_mod.Checkpoint.save

        def save(ckpt, step, *args):
            if ckpt.path.name == "chain0.ckpt" and step == 15:
                raise _Crash(step)
            return original(ckpt, step, *args)

        m.setattr(ckpt_mod.Checkpoint, "save", save)
        with pytest.raises((_Crash, RuntimeError), match="_Crash|15"):
            _mcmc(x, y, "metropolis", num_chains=2, checkpoint=tmp_path, checkpoint_every=5)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == 10
    resumed = _mcmc(x, y, "metropolis", num_chains=2, checkpoint=tmp_path, checkpoint_every=5, resume=True)
    assert ckpt_mod.read(tmp_path / "chain1.ckpt")[1]["step"] == 20
    for name, value in whole.samples.items():
        assert torch.equal(resumed.samples[name], value), name


def test_mcmc_checkpoint_errors_name_the_argument(toy, tmp_path):
    x, y = toy
    post = _mcmc(x, y, "hmc", checkpoint=tmp_path)  # saved once, after the last iteration (the default)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == 20
    with pytest.raises(ckpt_mod.CheckpointError, match="num_leapfrog"):
        _mcmc(x, y, "hmc", checkpoint=tmp_path, resume=True, num_leapfrog=5)
    with pytest.raises(ValueError, match="^resume: a Posterior to extend cannot be combined with checkpoint="):
        bp.fit(_mlp(), x, y, method="hmc", num_samples=2, checkpoint=tmp_path, resume=post, progress=False)
    with pytest.raises(ValueError, match="checkpoint=FOLDER"):
        _mcmc(x, y, "hmc", resume=True)
    with pytest.raises(ValueError, match="^resume: expected True"):
        _mcmc(x, y, "hmc", resume="yes")
