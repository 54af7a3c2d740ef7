"""Prediction on a device: ``Posterior.predict`` as the library ran it off the CPU before (the draws of a stack of
Linear layers one at a time by the CPU's size rule, ``linear_stack.PER_DRAW_ELEMENTS``, in chunks of the CPU's 8 MiB
cache budget), batched products in those chunks, and the library's default (batched, in chunks of at least
``model.ACCELERATOR_CHUNK_BYTES``), side by side with the hand-written chunked ``baddbmm`` of
``baselines.predict_loop``, in one process.

The model is ``_common``'s 1-50-1 tanh MLP with draws 0.5 * N(0, 1); the workloads are ``performance.py``'s quick
prediction (100 draws x 2,000 points) and ``predict.py``'s speed case (500 draws x 10,000 points). Each round times
every implementation ``--calls`` times (the fastest kept; the device synchronized around each call) after an untimed
call, the implementations alternating within the round; the table reports the median over ``--repeats`` rounds of
the ratio to the baseline measured in the same round. Every side reads ``mean`` and ``std`` (``interval=None``).

Usage: ``python benchmarks/predict_device.py [--device cuda] [--repeats 5] [--calls 5] [--name NAME]``. Writes
``NAME.md`` / ``NAME.csv`` in ``benchmarks/results/predict/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro.model as bp_model
import bnn_pyro.utils.linear_stack as stack

sys.path.insert(0, str(Path(__file__).parent))
import baselines  # noqa: E402
from _common import check_device, markdown, now, predict_workload, results_dir, write_result  # noqa: E402

SIZES = [(100, 2_000), (500, 10_000)]


def size_rule(layers, x, template) -> bool:
    """The per-draw rule by size alone, whatever the device (the library's rule on the CPU)."""
    widths = [x.shape[1]] + [template.get_submodule(path).out_features for path, act in layers if act is None]
    return x.shape[0] * max(widths) >= stack.PER_DRAW_ELEMENTS


@contextmanager
def rule(fn, accelerator_budget: int):
    """``fn`` as the per-draw rule of ``linear_stack`` and of ``BNN.draws_per_chunk``, and ``accelerator_budget`` as
    ``model.ACCELERATOR_CHUNK_BYTES`` (``model.CPU_CHUNK_BYTES``: the CPU's budget everywhere), for the duration."""
    saved = stack.runs_per_draw, bp_model._runs_per_draw, bp_model.ACCELERATOR_CHUNK_BYTES
    stack.runs_per_draw = bp_model._runs_per_draw = fn
    bp_model.ACCELERATOR_CHUNK_BYTES = accelerator_budget
    try:
        yield
    finally:
        stack.runs_per_draw, bp_model._runs_per_draw, bp_model.ACCELERATOR_CHUNK_BYTES = saved


def best_of(run, calls: int, device) -> float:
    run()
    times = []
    for _ in range(calls):
        start = now(device)
        run()
        times.append(now(device) - start)
    return min(times)


def measure(draws: int, points: int, device: torch.device, repeats: int, calls: int) -> list[dict]:
    post, x, layers = predict_workload(draws, points, device)

    def ours():
        pred = post.predict(x, interval=None)
        return pred.mean, pred.std

    library = (stack.runs_per_draw, bp_model.ACCELERATOR_CHUNK_BYTES)
    sides = {
        "hand-written chunked baddbmm (baseline)": None,
        "Posterior.predict, one draw at a time, 8 MiB chunks (before)": (size_rule, bp_model.CPU_CHUNK_BYTES),
        "Posterior.predict, batched, 8 MiB chunks": (library[0], bp_model.CPU_CHUNK_BYTES),
        "Posterior.predict, library default (batched, accelerator chunks)": library,
    }
    with rule(*sides["Posterior.predict, one draw at a time, 8 MiB chunks (before)"]):
        reference = ours()
    got = ours()
    torch.testing.assert_close(got[0], reference[0], rtol=1e-4, atol=1e-5)  # the same prediction every way
    timed: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, setting in sides.items():
            if setting is None:
                timed[name].append(best_of(lambda: baselines.predict_loop(layers, x), calls, device))
            else:
                with rule(*setting):
                    timed[name].append(best_of(ours, calls, device))
    base = timed["hand-written chunked baddbmm (baseline)"]
    return [
        dict(
            draws=draws,
            points=points,
            implementation=name,
            median_ms=round(1e3 * statistics.median(t), 3),
            ratio_median=round(statistics.median(a / b for a, b in zip(t, base)), 3),
            ratio_min=round(min(a / b for a, b in zip(t, base)), 3),
            ratio_max=round(max(a / b for a, b in zip(t, base)), 3),
        )
        for name, t in timed.items()
    ]


def main(argv=None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--sizes", default=None, help="draws x points pairs, e.g. 100x2000,500x10000 (default both)")
    p.add_argument("--name", default="device")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(check_device(args.device))
    sizes = SIZES if args.sizes is None else [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    rows = [r for d, n in sizes for r in measure(d, n, device, args.repeats, args.calls)]
    table = pd.DataFrame(rows)
    folder = results_dir("predict", args.out)
    table.to_csv(folder / f"{args.name}.csv", index=False)
    head = f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
    head += f"{args.repeats} rounds x best of {args.calls} calls; ratio = time / the baseline's in the same round.\n\n"
    write_result(folder / f"{args.name}.md", head + markdown(table))
    print(markdown(table))
    return table


if __name__ == "__main__":
    main()
