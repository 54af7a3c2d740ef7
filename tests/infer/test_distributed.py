"""Data-parallel SVI and chains-as-ranks (bnn_pyro/infer/distributed.py) on 2 processes over
loopback (gloo, one torch thread each), against the same fits in one process.

Tolerance. Both runs draw the same weights (same seed on every rank) and see the same global batch;
only the order of the floating-point additions differs (each rank sums its half of the
log-likelihood, then the all-reduce adds the halves and divides by 2). That is a relative error of
a few float32 ulps (~1e-7) per step; Adam's normalized steps carry it along without amplifying it
much over 40 steps, so the loss trace and the draws must agree to rtol 1e-5 (absolute 1e-5 for
draws near zero). The ensemble members see identical data and seeds in both runs: equal exactly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bnn_pyro as bp

N, BATCH = 64, 8  # two shards of 32 rows; minibatches of 8 rows per rank, 16 global
SVI = dict(guide="mean_field", num_steps=40, lr=0.02, num_samples=30, seed=3, progress=False)
ENSEMBLE = dict(num_steps=20, lr=0.01, seed=5, progress=False)


def data():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(N, 1, generator=g) * 4 - 2
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(N, generator=g)


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    # gloo's teardown now and then aborts a rank after its results are saved (SIGABRT, "terminate called without an
    # active exception"); a fresh launch (a fresh port) tells that apart from a real failure, which fails both launches
    for _ in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            str(Path(__file__).parent / "_dist_worker.py"),
            str(out),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow
def test_data_parallel_svi_equals_one_process(ranks):
    x, y = data()
    single = bp.fit(model(), x, y, method="svi", **SVI)
    for result in ranks:
        assert result["config"]["dataset_size"] == N and result["config"]["world_size"] == 2
        torch.testing.assert_close(result["loss"], single.history["loss"], rtol=1e-5, atol=0)
        for name, draws in single.samples.items():
            torch.testing.assert_close(result["samples"][name], draws, rtol=1e-5, atol=1e-5)
    for name in single.samples:  # every rank returns the same posterior
        assert torch.equal(ranks[0]["samples"][name], ranks[1]["samples"][name])


def _global_batches(x, y, seed):
    """The global batches of the 2-rank minibatched fit: each rank reshuffles its shard with the same
    generator (seed ``seed``), so step t sees rows perm_t of both shards."""
    shards = [(x[: N // 2], y[: N // 2]), (x[N // 2 :], y[N // 2 :])]
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(N // 2, generator=g)
        for i in range(0, N // 2, BATCH):
            j = perm[i : i + BATCH]
            yield torch.cat([s[0][j] for s in shards]), torch.cat([s[1][j] for s in shards])


@pytest.mark.slow
def test_minibatched_data_parallel_svi_equals_one_process_on_the_global_batches(ranks):
    x, y = data()
    single = bp.fit(model(), _global_batches(x, y, SVI["seed"]), method="svi", dataset_size=N, **SVI)
    for result in ranks:
        torch.testing.assert_close(result["minibatch_loss"], single.history["loss"], rtol=1e-5, atol=0)
        for name, draws in single.samples.items():
            torch.testing.assert_close(result["minibatch_samples"][name], draws, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ensemble_members_on_ranks_gather_into_the_one_process_posterior(ranks):
    x, y = data()
    single = bp.fit(model(), x, y, method="ensemble", num_chains=2, **ENSEMBLE)
    for result in ranks:
        assert result["ensemble_chains"] == 2
        for name, draws in single.samples.items():
            assert torch.equal(result["ensemble"][name], draws), name
        assert torch.equal(result["ensemble_loss"], single.history["loss"])


def test_distributed_without_a_process_group_says_how_to_launch():
    x, y = data()
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        bp.fit(model(), x, y, method="svi", distributed=True, num_steps=1, progress=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        bp.distributed.shard(x, y)
