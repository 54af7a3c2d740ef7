"""Prediction time and peak memory, side by side with the tightest hand-written loops, at 1 and 2 threads.

Every run of an implementation is a fresh process (torch threads set there first; an untimed call on 10 points,
then ``--calls`` timed calls of which the fastest is kept). Implementations alternate within each of
``--repeats`` rounds, so a burst of load from other processes falls on all of them alike, and each round gives
one ratio to the baseline measured in the same round: the table reports the median ratio and its range over the
rounds, for wall time and for CPU time (``time.process_time``: the time the process ran, which other processes'
load inflates less than wall time; at 2 threads it also counts a thread's spinning while it waits for the
other). The model is ``_common``'s 1-50-1 tanh MLP with Gaussian noise sigma 0.1 and draws 0.5 * N(0, 1) (the
prediction's cost does not depend on where the draws came from).

- ``speed``: 500 draws x 10,000 points. Baselines: ``loop``, one draw at a time as an expert writes it
  (``addmm``, ``tanh_``, ``addmm``, then the running sum and sum of squares), and ``bmm``, the chunked
  ``baddbmm`` of ``baselines.predict_loop``; the tighter of the two (by median CPU time) at each thread setting is
  the baseline of the ratios. Ours: ``post.predict(x)`` reading ``mean``, ``std``, ``epistemic_std`` and
  ``aleatoric_std`` (the call a user makes; the split comes from the same pass, and the default
  ``interval=0.95`` is computed only when read), and the same reading ``lower``/``upper`` too.
- ``rule``: the rule of ``bnn_pyro.utils.linear_stack.PER_DRAW_ELEMENTS`` (one draw at a time from 2**15 elements of
  one draw's widest layer output): ``post.predict(x).std`` for 500 draws at 330, 1,000, 3,000 and 10,000
  points (16,500 to 500,000 elements), one draw at a time against batched products, at 1 thread.
- ``memory``: 1,000 draws x 1,000,000 points (one (draws, points) float32 array would be 4 GB): ours
  reading ``mean``/``std``, and reading ``lower``/``upper`` too, at torch's default threads only (each run
  takes minutes on 2 cores; the loop's memory is a few vectors of N, its time ~ the speed case's ratio).

Peak memory is the resident set above its level just before the timed calls, two ways: ``peak_mb`` sampled
every millisecond by a thread (``performance.PeakMemory``) and ``maxrss_mb``, ``getrusage``'s lifetime
peak after the calls minus the resident set before them (an upper bound that no sampling can miss).

Usage: ``python benchmarks/predict.py [--quick] [--repeats 5] [--calls 3] [--only speed rule memory]
[--memory-points N] [--memory-draws S] [--memory-kinds ...] [--memory-repeats R] [--note TEXT] [--name NAME]``.
An earlier revision is measured by putting its ``bnn_pyro`` first on ``PYTHONPATH`` (``git archive REV bnn_pyro |
tar -x -C DIR``). Writes ``NAME.md`` (headed by the run's provenance) / ``.csv`` in ``benchmarks/results/predict/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
import baselines  # noqa: E402
from _common import (
    DEFAULT_THREADS,
    SIGMA,
    markdown,
    predict_workload,
    results_dir,
    thread_note,  # noqa: E402
    thread_settings,
    write_result,
)
from performance import PeakMemory  # noqa: E402

KINDS = {
    "loop": "hand-written loop over draws (addmm, tanh_, addmm, running sums)",
    "bmm": "hand-written chunked baddbmm (baselines.predict_loop)",
    "bnn_pyro": "bnn_pyro post.predict(x): mean, std, epistemic_std, aleatoric_std",
    "bnn_pyro_interval": "bnn_pyro post.predict(x): mean, std, lower, upper",
    "per_draw": "bnn_pyro post.predict(x).std, the stack one draw at a time",
    "batched": "bnn_pyro post.predict(x).std, the stack as batched products",
}
CASES = {
    "speed": (500, [10_000], ["loop", "bmm", "bnn_pyro", "bnn_pyro_interval"]),
    "rule": (500, [330, 1_000, 3_000, 10_000], ["per_draw", "batched"]),
    "memory": (1_000, [1_000_000], ["bnn_pyro", "bnn_pyro_interval"]),
}
QUICK = {"speed": (100, [2_000]), "rule": (100, [330, 3_000]), "memory": (100, [100_000])}


def loop(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor):
    """Predictive mean and std (noise included) at ``x``, one draw at a time: per layer one ``addmm`` (the
    bias added in the product), ``tanh_`` in place, and the running sum and sum of squares of the output."""
    draws = layers[0][0].shape[0]
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    total_sq = torch.zeros_like(total)
    with torch.inference_mode():
        for s in range(draws):
            h = x
            for j, (w, b) in enumerate(layers):
                h = torch.addmm(b[s], h, w[s].T)
                if j < len(layers) - 1:
                    h.tanh_()
            f = h[:, 0]
            total += f
            total_sq.addcmul_(f, f)
    mean = total / draws
    return mean, (total_sq / draws - mean.square() + SIGMA**2).clamp_min(0).sqrt()


def child(kind: str, draws: int, points: int, threads: int, calls: int) -> dict:
    """In a fresh process: the fastest of ``calls`` predictions' wall and CPU times, and the peak memory above
    the level before them."""
    torch.set_num_threads(threads)
    if kind in ("per_draw", "batched"):
        from bnn_pyro.utils import linear_stack

        linear_stack.PER_DRAW_ELEMENTS = 0 if kind == "per_draw" else 2**62
    post, x, layers = predict_workload(draws, points, training_data=False)

    def run(x):
        if kind == "loop":
            return loop(layers, x)
        if kind == "bmm":
            return baselines.predict_loop(layers, x)
        pred = post.predict(x)
        if kind == "bnn_pyro_interval":
            _ = pred.lower, pred.upper  # computed when first read
        if kind == "bnn_pyro":
            _ = pred.epistemic_std, pred.aleatoric_std
        return pred.mean, pred.std

    run(x[:10])
    before = _rss_mb()
    watch = PeakMemory(torch.device("cpu"))
    walls, cpus = [], []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        mean, std = run(x)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    peak = watch.stop()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return dict(
        wall_s=min(walls),
        cpu_s=min(cpus),
        peak_mb=peak,
        maxrss_mb=maxrss,
        mean_sum=float(mean.double().sum()),
        std_sum=float(std.double().sum()),
    )


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def case_rows(case: str, args) -> list[dict]:
    draws, sizes, kinds = CASES[case]
    repeats = args.repeats
    if case == "memory":
        sizes, draws, kinds = (
            [args.memory_points] if args.memory_points else sizes,
            args.memory_draws or draws,
            args.memory_kinds or kinds,
        )
        repeats = args.memory_repeats or args.repeats
    if args.quick:
        draws, sizes = QUICK[case]
    settings = {"speed": thread_settings(), "rule": [1], "memory": [DEFAULT_THREADS]}[case]
    rows = []
    for points in sizes:
        for threads in settings:
            runs: dict[str, list[dict]] = {k: [] for k in kinds}
            for _ in range(repeats):
                for kind in kinds:
                    cmd = [
                        sys.executable,
                        __file__,
                        "--child",
                        kind,
                        str(draws),
                        str(points),
                        str(threads),
                        str(args.calls),
                    ]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            hand = [k for k in ("loop", "bmm") if k in runs] or [kinds[-1]]
            baseline = min(hand, key=lambda k: statistics.median(r["cpu_s"] for r in runs[k]))
            for kind in kinds:
                rs = runs[kind]
                wall = [r["wall_s"] / b["wall_s"] for r, b in zip(rs, runs[baseline])]
                cpu = [r["cpu_s"] / b["cpu_s"] for r, b in zip(rs, runs[baseline])]
                agree = (
                    abs(rs[0]["mean_sum"] - runs["loop"][0]["mean_sum"]) / points if "loop" in runs else float("nan")
                )
                rows.append(
                    dict(
                        case=case,
                        draws=draws,
                        points=points,
                        threads=threads,
                        implementation=KINDS[kind],
                        role="baseline" if kind == baseline else "ours" if kind.startswith("bnn") else "other",
                        cpu_s=round(min(r["cpu_s"] for r in rs), 4),
                        cpu_ratio=f"{statistics.median(cpu):.3f} [{min(cpu):.3f}, {max(cpu):.3f}]",
                        wall_s=round(min(r["wall_s"] for r in rs), 4),
                        wall_ratio=f"{statistics.median(wall):.3f} [{min(wall):.3f}, {max(wall):.3f}]",
                        peak_mb=round(max(r["peak_mb"] for r in rs), 1),
                        maxrss_mb=round(max(r["maxrss_mb"] for r in rs), 1),
                        mean_vs_loop=f"{agree:.1e}",
                    )
                )
            print(pd.DataFrame(rows[-len(kinds) :]).to_string(index=False), flush=True)
    return rows


def main(args) -> pd.DataFrame:
    started = time.perf_counter()
    load = os.getloadavg()
    # the revision measured: the one checked out when the run starts
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    table = pd.DataFrame([r for case in args.only for r in case_rows(case, args)])
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}{' (with uncommitted changes)' if dirty else ''}; "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {thread_note()}; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; {'quick' if args.quick else 'full'} settings, "
        f"{args.repeats} rounds of fresh processes per row (implementations alternating), the fastest of "
        f"{args.calls} calls per process; whole run {time.perf_counter() - started:.0f} s.\n"
        "cpu_s / wall_s: the fastest over the rounds. cpu_ratio / wall_ratio: the median over the rounds of "
        "the time / the baseline's time in the same round, [the smallest, the largest]; the baseline (role "
        "baseline) is the tighter hand-written loop at the same thread setting (the rule case: batched "
        "products). mean_vs_loop: mean absolute difference of the predictive mean from the loop's. peak_mb, "
        "maxrss_mb: the largest over the rounds.\n\n" + (f"{args.note}\n\n" if args.note else "")
    )
    out = results_dir("predict", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    write_result(out / f"{args.name}.md", header + markdown(table))
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of fresh processes per row (default 5)")
    p.add_argument("--calls", type=int, default=3, help="timed calls per process; the fastest is kept (default 3)")
    p.add_argument("--only", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--memory-points", type=int, default=None, help="points of the memory case (default 1,000,000)")
    p.add_argument("--memory-draws", type=int, default=None, help="draws of the memory case (default 1,000)")
    p.add_argument(
        "--memory-kinds", nargs="+", default=None, choices=list(KINDS), help="implementations of the memory case"
    )
    p.add_argument(
        "--memory-repeats", type=int, default=None, help="fresh processes per memory row (default --repeats)"
    )
    p.add_argument("--out", default=None, help="the folder written (default benchmarks/results/predict/)")
    p.add_argument("--name", default="results", help="the result files' name, NAME.md and NAME.csv (default results)")
    p.add_argument("--note", default="", help="a line for the header (e.g. what else ran on the machine)")
    return p


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))))
    else:
        main(parser().parse_args())
