"""Prediction time and peak memory, side by side with the tightest hand-written loops, at 1 and 2 threads.

Every case runs each implementation in a fresh process (torch threads set there first; an untimed call on 10
points first), the fastest of ``--repeats`` runs kept; implementations alternate within each repeat, so a
burst of load from other processes falls on all of them alike. The model is ``_common``'s 1-50-1 tanh MLP
with Gaussian noise sigma 0.1 and draws 0.5 * N(0, 1) (the prediction's cost does not depend on where the
draws came from).

- ``speed``: 500 draws x 10,000 points. Baselines: ``loop``, one draw at a time as an expert writes it
  (``addmm``, ``tanh_``, ``addmm``, then the running sum and sum of squares), and ``bmm``, the chunked
  ``baddbmm`` of ``baselines.predict_loop``; the tighter of the two at each thread setting is the
  baseline of the ratio. Ours: ``post.predict(x)`` reading ``mean`` and ``std`` (the call a user makes:
  the default ``interval=0.95`` is computed only when read), and the same reading ``lower``/``upper`` too.
- ``memory``: 1,000 draws x 1,000,000 points (one (draws, points) float32 array would be 4 GB): ours
  reading ``mean``/``std``, and reading ``lower``/``upper`` too, at torch's default threads only (each run
  takes minutes on 2 cores; the loop's memory is a few vectors of N, its time ~ the speed case's ratio).

Peak memory is the resident set above its level just before the timed call, two ways: ``peak_mb`` sampled
every millisecond by a thread (``performance.PeakMemory``) and ``maxrss_mb``, ``getrusage``'s lifetime
peak after the call minus the resident set before it (an upper bound that no sampling can miss).

Usage: ``python benchmarks/predict.py [--quick] [--repeats 3] [--only speed memory] [--memory-points N]
[--memory-draws S] [--memory-kinds ...] [--memory-repeats R] [--note TEXT] [--name speed]``. An earlier
revision is measured by putting its ``bnn_pyro`` first on ``PYTHONPATH`` (``git archive REV bnn_pyro | tar -x -C
DIR``). Writes ``NAME.md`` (headed by the run's provenance) / ``.csv`` in ``benchmarks/results/predict/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
import baselines  # noqa: E402
from _common import (DEFAULT_THREADS, SIGMA, bnn, markdown, regression, results_dir, thread_note,  # noqa: E402
                     thread_settings, write_result)
from performance import PeakMemory  # noqa: E402

KINDS = {"loop": "hand-written loop over draws (addmm, tanh_, addmm, running sums)",
         "bmm": "hand-written chunked baddbmm (baselines.predict_loop)",
         "bnn_pyro": "bnn_pyro post.predict(x): mean, std",
         "bnn_pyro_interval": "bnn_pyro post.predict(x): mean, std, lower, upper"}
CASES = {"speed": (500, 10_000, ["loop", "bmm", "bnn_pyro", "bnn_pyro_interval"]),
         "memory": (1_000, 1_000_000, ["bnn_pyro", "bnn_pyro_interval"])}
QUICK = {"speed": (100, 2_000), "memory": (100, 100_000)}


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


def child(kind: str, draws: int, points: int, threads: int) -> dict:
    """In a fresh process: one prediction's wall time and peak memory above the level before it."""
    torch.set_num_threads(threads)
    model = bnn(1)
    g = torch.Generator().manual_seed(1)
    samples = {n: 0.5 * torch.randn((1, draws) + s, generator=g) for n, s in model.param_shapes.items()}
    post = bp.Posterior(samples=samples, model=model, method="svi")
    x = regression(points, 1, seed=2)[0]
    layers = [(samples[f"{i}.weight"][0], samples[f"{i}.bias"][0]) for i in (0, 2)]

    def run(x):
        if kind == "loop":
            return loop(layers, x)
        if kind == "bmm":
            return baselines.predict_loop(layers, x)
        pred = post.predict(x)
        if kind == "bnn_pyro_interval":
            pred.lower, pred.upper
        return pred.mean, pred.std

    run(x[:10])
    before = _rss_mb()
    watch = PeakMemory(torch.device("cpu"))
    start = time.perf_counter()
    mean, std = run(x)
    wall = time.perf_counter() - start
    peak = watch.stop()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return dict(wall_s=wall, peak_mb=peak, maxrss_mb=maxrss, mean_sum=float(mean.double().sum()),
                std_sum=float(std.double().sum()))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def case_rows(case: str, args) -> list[dict]:
    draws, points, kinds = CASES[case]
    if case == "memory":
        points, draws, kinds = args.memory_points or points, args.memory_draws or draws, args.memory_kinds or kinds
    if args.quick:
        draws, points = QUICK[case]
    rows = []
    for threads in thread_settings() if case == "speed" else [DEFAULT_THREADS]:
        best: dict[str, dict] = {}
        for _ in range(args.memory_repeats or args.repeats if case == "memory" else args.repeats):
            for kind in kinds:
                out = subprocess.run([sys.executable, __file__, "--child", kind, str(draws), str(points), str(threads)],
                                     capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                best[kind] = r if kind not in best or r["wall_s"] < best[kind]["wall_s"] else best[kind]
        hand = [k for k in ("loop", "bmm") if k in best]
        baseline = min(hand, key=lambda k: best[k]["wall_s"]) if hand else None
        for kind in kinds:
            r = best[kind]
            agree = abs(r["mean_sum"] - best["loop"]["mean_sum"]) / points if "loop" in best else float("nan")
            rows.append(dict(case=case, draws=draws, points=points, threads=threads, implementation=KINDS[kind],
                             role="baseline" if kind == baseline else "ours" if kind.startswith("bnn") else "other",
                             wall_s=round(r["wall_s"], 4),
                             ratio=round(r["wall_s"] / best[baseline]["wall_s"], 3) if baseline else float("nan"),
                             peak_mb=round(r["peak_mb"], 1), maxrss_mb=round(r["maxrss_mb"], 1),
                             mean_vs_loop=f"{agree:.1e}"))
        print(pd.DataFrame(rows[-len(kinds):]).to_string(index=False), flush=True)
    return rows


def main(args) -> pd.DataFrame:
    started = time.perf_counter()
    load = os.getloadavg()
    table = pd.DataFrame([r for case in args.only for r in case_rows(case, args)])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=Path(__file__).parent).stdout.strip()
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}{' (with uncommitted changes)' if dirty else ''}; "
              f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {thread_note()}; "
              f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
              f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; {'quick' if args.quick else 'full'} settings, fastest of "
              f"{args.repeats} fresh processes per row; whole run {time.perf_counter() - started:.0f} s.\n"
              "ratio = wall time / the tighter hand-written baseline's at the same thread setting (role baseline). "
              "mean_vs_loop: mean absolute difference of the predictive mean from the loop's.\n\n"
              + (f"{args.note}\n\n" if args.note else ""))
    out = results_dir("predict", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    write_result(out / f"{args.name}.md", header + markdown(table))
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per row; the fastest is kept (default 3)")
    p.add_argument("--only", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--memory-points", type=int, default=None, help="points of the memory case (default 1,000,000)")
    p.add_argument("--memory-draws", type=int, default=None, help="draws of the memory case (default 1,000)")
    p.add_argument("--memory-kinds", nargs="+", default=None, choices=list(KINDS), help="implementations of the memory case")
    p.add_argument("--memory-repeats", type=int, default=None, help="fresh processes per memory row (default --repeats)")
    p.add_argument("--out", default=None, help="the folder written (default benchmarks/results/predict/)")
    p.add_argument("--name", default="results", help="the result files' name, NAME.md and NAME.csv (default results)")
    p.add_argument("--note", default="", help="a line for the header (e.g. what else ran on the machine)")
    return p


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
    else:
        main(parser().parse_args())
