"""Data-parallel SVI scaling: one process against two (``torchrun``, gloo, one torch thread per
process), the same global batch, measured in the same run.

Workload: a 16-64-64-1 tanh MLP BNN (Normal(0, 1) prior, Gaussian noise 0.1), mean-field SVI on
10,000 generated regression rows, global batches of 2,000 and 10,000 (half per rank with two
processes), 300 steps. Rows per batch size: the plain one-process fit (no process group), one rank
under torchrun (the same launch path and all-reduce calls, the fair baseline for two ranks), two
ranks. The figure is optimizer steps per second of fit wall time (rank 0, after an untimed 5-step
warm-up fit and a barrier), with ratios to the plain fit and to the one-rank run. With two
ranks each step does half the likelihood work per process plus one all-reduce of the guide's
gradients, so the ratio is at most 2 and falls when the cores are busy with other work: the load
average is recorded with the table.

Usage: ``python benchmarks/distributed.py [--steps 300] [--global-batch 2000 10000] [--out DIR]`` writes
``results.md`` (headed by the run's provenance) and ``results.csv`` in ``benchmarks/results/distributed/``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
from _common import markdown, results_dir, write_result  # noqa: E402

ROWS, FEATURES = 10_000, 16


def workload():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = torch.sin(x[:, :4].sum(1)) + 0.1 * torch.randn(ROWS, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)), x, y


def fit_once(steps: int, distributed: bool, global_batch: int) -> float:
    """Wall seconds of one SVI fit (this rank's shard when ``distributed``)."""
    model, x, y = workload()
    world = bp.distributed.world_size() if distributed else 1
    if distributed:
        x, y = bp.distributed.shard(x, y)
    config = dict(
        method="svi", batch_size=global_batch // world, num_samples=10, seed=0, progress=False, distributed=distributed
    )
    bp.fit(model, x, y, num_steps=5, **config)  # warm-up, untimed: first-call costs are not per-step costs
    if distributed:
        torch.distributed.barrier()
    start = time.perf_counter()
    bp.fit(model, x, y, num_steps=steps, **config)
    return time.perf_counter() - start


def launch(processes: int, steps: int, global_batch: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={processes}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        __file__,
        "--worker",
        "--steps",
        str(steps),
        "--global-batch",
        str(global_batch),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])["wall_s"]


def main(args) -> pd.DataFrame:
    torch.set_num_threads(1)
    tables = []
    for batch in args.global_batch:
        walls = {
            "1 process, plain": fit_once(args.steps, distributed=False, global_batch=batch),
            "1 process, torchrun": launch(1, args.steps, batch),
            "2 processes, torchrun": launch(2, args.steps, batch),
        }
        part = pd.DataFrame(
            [
                dict(
                    setting=k,
                    global_batch=batch,
                    steps=args.steps,
                    wall_s=round(w, 2),
                    steps_per_s=round(args.steps / w, 1),
                )
                for k, w in walls.items()
            ]
        )
        part["ratio_to_plain"] = (part["steps_per_s"] / part["steps_per_s"].iloc[0]).round(2)
        part["ratio_to_1_rank"] = (part["steps_per_s"] / part["steps_per_s"].iloc[1]).round(2)
        tables.append(part)
    table = pd.concat(tables, ignore_index=True)
    out = results_dir("distributed", args.out)
    table.to_csv(out / "results.csv", index=False)
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    write_result(
        out / "results.md",
        markdown(table) + f"\nLoad average (1/5/15 min) at the end of the run: {load}; "
        f"{os.cpu_count()} CPUs, one torch thread per process.\n",
    )
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--global-batch",
        type=int,
        nargs="+",
        default=[2_000, 10_000],
        help="global batch sizes to run (each row set has its own one-process baseline)",
    )
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/distributed/)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, under torchrun
    cli = parser.parse_args()
    if cli.worker:
        torch.set_num_threads(1)
        bp.distributed.init("gloo")
        wall = fit_once(cli.steps, distributed=True, global_batch=cli.global_batch[0])
        if bp.distributed.rank() == 0:
            print(json.dumps({"wall_s": wall}))
        torch.distributed.destroy_process_group()
    else:
        main(cli)
