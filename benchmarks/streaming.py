"""Data larger than memory: 1,000,000 generated rows streamed through SVI and SGLD, against the same
fits on an in-memory tensor of the same 1,000,000 rows (the baseline, measured in the same run).

Workload: a 16-32-1 tanh BNN (Normal(0, 1) prior, Gaussian noise 0.1), batches of 1,000 rows, one
pass over the data (1,000 optimizer / sampler steps). The stream is a generator that makes each batch
from its own seed when asked (it never holds more than one batch); the baseline first builds all rows
(16 + 1 floats each, 68 MB) and fits with ``batch_size=1000``. Each case runs in a fresh process, so
its peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is its own; the figures are
rows per second of fit wall time and peak RSS, with ratios to the in-memory run of the same method.
The stream's wall time includes making its batches (its stand-in for reading them from disk); the
baseline's tensor is built before the clock starts, but its peak RSS includes building it.

Usage: ``python benchmarks/streaming.py [--rows 1000000] [--out DIR]`` writes ``results.md`` (headed by the run's
provenance) and ``results.csv`` in ``benchmarks/results/streaming/``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
from _common import markdown, results_dir, write_result  # noqa: E402

FEATURES, BATCH = 16, 1000
METHODS = {
    "svi": dict(method="svi", guide="mean_field", lr=1e-2, num_samples=100),
    "sgld": dict(method="sgld", thin=10),
}


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` of the data set, generated from its own seed (the same rows every time)."""
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, torch.sin(x[:, :4].sum(1)) + 0.1 * torch.randn(BATCH, generator=g)


def stream(rows: int):
    for i in range(rows // BATCH):
        yield batch(i)


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def case(method: str, source: str, rows: int) -> dict:
    """One fit in this process: ``source`` is ``"stream"`` or ``"tensor"``."""
    steps = rows // BATCH
    config = {**METHODS[method], "seed": 0, "progress": False}
    if method == "svi":
        config["num_steps"] = steps
    else:  # half warm-up, then a draw every 10 steps: one pass in all
        config.update(num_warmup=steps // 2, num_samples=(steps - steps // 2) // 10)
    start = time.perf_counter()
    if source == "stream":
        bp.fit(model(), stream(rows), dataset_size=rows, **config)
    else:
        parts = [batch(i) for i in range(steps)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        del parts
        start = time.perf_counter()  # the fit only: building the tensor is not the fit's work
        bp.fit(model(), x, y, batch_size=BATCH, **config)
    wall = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return dict(
        method=method,
        data=source,
        rows=rows,
        wall_s=round(wall, 2),
        rows_per_s=round(rows / wall),
        peak_rss_mb=round(peak_mb),
    )


def main(args) -> pd.DataFrame:
    rows = []
    for method in METHODS:
        for source in ("tensor", "stream"):
            done = subprocess.run(
                [sys.executable, __file__, "--case", f"{method},{source}", "--rows", str(args.rows)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = pd.DataFrame(rows)
    base = table[table["data"] == "tensor"].set_index("method")
    table["throughput_ratio_to_tensor"] = (table["rows_per_s"] / table["method"].map(base["rows_per_s"])).round(2)
    table["peak_rss_ratio_to_tensor"] = (table["peak_rss_mb"] / table["method"].map(base["peak_rss_mb"])).round(2)
    out = results_dir("streaming", args.out)
    table.to_csv(out / "results.csv", index=False)
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    write_result(
        out / "results.md",
        markdown(table) + f"\nLoad average (1/5/15 min) at the end of the run: {load}; "
        f"{os.cpu_count()} CPUs, one torch thread per fit.\n",
    )
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/streaming/)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "method,source": one fit, JSON on stdout
    cli = parser.parse_args()
    if cli.case:
        torch.set_num_threads(1)
        print(json.dumps(case(*cli.case.split(","), cli.rows)))
    else:
        main(cli)
