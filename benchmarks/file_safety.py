"""What the file-safety work costs: the atomic writer and the checkpoint folder's data fingerprint.

1. **Writer.** :func:`bnn_pyro.posterior.tensor_files.write_atomic` serializes the file in memory and writes it itself (so a
   full disk is an ``OSError`` naming the path, and the temporary file carries a lock that marks it live). Its
   baseline is what it did before: ``safetensors.torch.save_file`` straight to the temporary file (safetensors
   writes through its own temporary file and rename), then fsync and rename. Each variant runs in a fresh
   process (``--sizes`` MB of float32 tensors, 8 tensors); the process reports the write's wall time (the
   minimum of ``--reps``) and its peak resident memory above the tensors' own (``ru_maxrss`` after minus before
   the first write), so the table shows the memory the in-memory serialization adds.
2. **Fingerprint.** ``bp.fit(..., checkpoint=FOLDER)`` hashes ``x`` and ``y`` once per fit
   (:func:`bnn_pyro.infer.checkpoint_folder.identity`): its time for ``--rows`` rows of 10 float32 features,
   beside ``torch.save`` of the same tensors to the same disk (the baseline, same run).

Variants take turns within each repetition, so a change in the machine's load falls on both alike.

Usage::

    python benchmarks/file_safety.py [--sizes 8 64 256] [--rows 100000 1000000] [--reps 3]
        [--out DIR]      # writes results.md (headed by the run's provenance) and results.csv in
                         # benchmarks/results/file_safety/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from _common import markdown, results_dir, write_result

_CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
import torch
from safetensors.torch import save_file
from bnn_pyro.posterior import tensor_files

variant, size_mb, reps, folder = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
torch.set_num_threads(1)
n = int(size_mb * 2**20 / 4 / 8)
tensors = {f"t{i}": torch.randn(n) for i in range(8)}
path = folder / f"{variant}.bin"

def old_writer():  # the writer before: safetensors writes the temporary file, we fsync and rename it
    tmp = folder / f".{path.name}.old.tmp"
    save_file(tensors, str(tmp), metadata={"k": "v"})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)

def new_writer():
    tensor_files.write_atomic(path, tensors, {"k": "v"})

write = {"save_file (before)": old_writer, "write_atomic": new_writer}[variant]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(reps):
    start = time.perf_counter()
    write()
    times.append(time.perf_counter() - start)
extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux
print(json.dumps({"seconds": min(times), "extra_peak_mb": extra}))
"""


def _writer_rows(sizes: list[float], reps: int, folder: Path) -> list[dict]:
    rows = []
    for size in sizes:
        got = {}
        for variant in ("save_file (before)", "write_atomic"):  # a fresh process each: peak memory is its own
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, variant, str(size), str(reps), str(folder)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            got[variant] = json.loads(out.strip().splitlines()[-1])
        base = got["save_file (before)"]
        for variant, m in got.items():
            rows.append(
                {
                    "case": "writer",
                    "size (MB)": size,
                    "variant": variant,
                    "seconds": round(m["seconds"], 4),
                    "ratio to baseline": round(m["seconds"] / base["seconds"], 3),
                    "extra peak memory (MB)": round(m["extra_peak_mb"], 1),
                }
            )
    return rows


def _fingerprint_rows(row_counts: list[int], reps: int, folder: Path) -> list[dict]:
    import torch

    import bnn_pyro as bp
    from bnn_pyro.infer.checkpoint_folder import identity
    from bnn_pyro.infer.training_data import Data

    torch.set_num_threads(1)
    model = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(10, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
    )
    rows = []
    for n in row_counts:
        x, y = torch.randn(n, 10), torch.randn(n)
        times = {"torch.save of x, y (baseline)": [], "identity(model, data)": []}
        for _ in range(reps):
            start = time.perf_counter()
            torch.save({"x": x, "y": y}, folder / "xy.pt")
            times["torch.save of x, y (baseline)"].append(time.perf_counter() - start)
            start = time.perf_counter()
            identity(model, Data(x=x, y=y))
            times["identity(model, data)"].append(time.perf_counter() - start)
        base = min(times["torch.save of x, y (baseline)"])
        for variant, t in times.items():
            rows.append(
                {
                    "case": "fingerprint",
                    "size (MB)": round(n * 11 * 4 / 2**20, 1),
                    "variant": variant,
                    "seconds": round(min(t), 4),
                    "ratio to baseline": round(min(t) / base, 3),
                    "extra peak memory (MB)": None,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[8, 64, 256])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/file_safety/)")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        rows = _writer_rows(args.sizes, args.reps, Path(folder)) + _fingerprint_rows(args.rows, args.reps, Path(folder))
    table = pd.DataFrame(rows)
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; bnn_pyro at {commit} (plus uncommitted changes, "
        f"if any); {platform.processor() or platform.machine()}, {os.cpu_count()} cores; 1 torch thread; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; minimum of {args.reps} repetitions; "
        f"whole run {time.perf_counter() - start:.0f} s; temporary folder on {tempfile.gettempdir()}."
    )
    out = results_dir("file_safety", args.out)
    table.to_csv(out / "results.csv", index=False)
    write_result(out / "results.md", f"{header}\n\n{markdown(table)}\n")
    print(header)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
