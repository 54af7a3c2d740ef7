"""NUTS per leapfrog step: this checkout against an earlier revision of bnn_pyro, interleaved in one run.

The fast path's NUTS (:class:`~bnn_pyro.infer._nuts.FlatNUTS` on the analytic potential) on the tanh MLPs of
``fast_path.py`` (Normal(0, 1) prior, sigma 0.1): 1-50-1 with N = 200 and 8-50-50-1 with N = 1,000, one thread,
from the same start at a fixed step size (``--step``, no adaptation), tree depth <= ``--depth``. Per net and
side: ms per leapfrog step over ``--transitions`` NUTS transitions, ms per potential-and-gradient call, ms per
bare leapfrog step (``StackPotential.leapfrog``), and the aten operations per leapfrog step of a NUTS transition
(``torch.profiler``: top-level operations, i.e. those not called by another aten operation).

``--before REV`` (default ``HEAD``): that revision's ``bnn_pyro`` is extracted by ``git archive`` into a temporary
folder; each side runs in a child process of its own (``PYTHONPATH`` set to its tree), the sides alternating
``--repeats`` times; each figure is the minimum over repeats. Times are the measuring thread's CPU time
(``time.thread_time``), which a busy machine inflates less than wall time (it still inflates it: shared caches).

Usage: ``python benchmarks/leapfrog_ab.py [--before REV] [--repeats 3] [--out DIR]`` writes ``results.md``
(headed by the run's provenance) in ``benchmarks/results/leapfrog_ab/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NETS = (((1, 50, 1), 200), ((8, 50, 50, 1), 1000))


def _child(settings: dict) -> list[dict]:
    """In a child process: the figures of the bnn_pyro on ``sys.path`` for every net."""
    from collections import Counter

    import pyro
    import torch
    from fast_path import mlp, regression
    from torch.profiler import ProfilerActivity, profile

    from bnn_pyro.infer import _logjoint
    from bnn_pyro.infer._common import quiet_model
    from bnn_pyro.infer._nuts import FlatNUTS

    torch.set_num_threads(1)
    rows = []
    for widths, n in NETS:
        x, y = regression(n, widths[0])
        model = mlp(widths)
        kernel = FlatNUTS(
            quiet_model(model, n),
            _logjoint.build(model, n),
            init_strategy=pyro.infer.autoguide.init_to_sample,
            max_tree_depth=settings["depth"],
        )
        torch.manual_seed(1)
        kernel.setup(0, x, y)
        chains = getattr(kernel, "chains", None)  # the one-chain kernel over BatchedChains (after the one NUTS)
        (chains._adapters[0] if chains is not None else kernel._adapter).step_size = settings["step"]
        kernel.sample(None)  # first-call costs
        steps, start = 0, time.thread_time()
        for _ in range(settings["transitions"]):
            kernel.sample(None)
            steps += kernel.stats.n_steps
        nuts = (time.thread_time() - start) / steps * 1e3
        if chains is not None:
            z, g, pot, minv = chains.z[0], chains.g[0], chains.leapfrog.pot, chains.inverse_mass_matrix[0]
        else:
            (z, _, g), pot = kernel._state, kernel._potential
            kernel._mass()
            minv = kernel._minv
        p = torch.randn_like(z)
        calls = settings["calls"]
        start = time.thread_time()
        for _ in range(calls):
            pot(z)
        potential = (time.thread_time() - start) / calls * 1e3
        start = time.thread_time()
        for _ in range(calls):
            pot.leapfrog(z, p, g, settings["step"], minv)
        leapfrog = (time.thread_time() - start) / calls * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            counted = 0
            for _ in range(2):
                kernel.sample(None)
                counted += kernel.stats.n_steps
        ops = Counter(
            e.name
            for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        )
        rows.append(
            dict(
                net="-".join(map(str, widths)),
                n=n,
                nuts_ms_per_leapfrog=nuts,
                potential_ms=potential,
                leapfrog_ms=leapfrog,
                aten_ops_per_leapfrog=sum(ops.values()) / counted,
            )
        )
    return rows


def main(args) -> str:
    settings = dict(transitions=args.transitions, step=args.step, depth=args.depth, calls=args.calls)
    sys.path.insert(0, str(HERE))
    from _common import alternating, exported, results_dir, side_result, write_result  # this checkout's bnn_pyro

    with exported(args.before) as before:
        sides = {f"before ({args.before})": before, "after (this checkout)": ROOT}
        runs = alternating(sides, args.repeats, lambda tree: side_result(tree, "leapfrog_ab", "_child", settings))
    keys = ("nuts_ms_per_leapfrog", "potential_ms", "leapfrog_ms", "aten_ops_per_leapfrog")
    lines = [
        "| net | side | NUTS ms/leapfrog | potential+gradient ms | bare leapfrog ms | aten ops/leapfrog |",
        "|---|---|---|---|---|---|",
    ]
    best = {}
    for i, (_widths, n) in enumerate(NETS):
        for name, reps in runs.items():
            best[name, i] = {k: min(r[i][k] for r in reps) for k in keys}
            b = best[name, i]
            lines.append(
                f"| {reps[0][i]['net']}, N={n} | {name} | {b['nuts_ms_per_leapfrog']:.4f} | "
                f"{b['potential_ms']:.4f} | {b['leapfrog_ms']:.4f} | {b['aten_ops_per_leapfrog']:.1f} |"
            )
        before, after = (best[name, i]["nuts_ms_per_leapfrog"] for name in runs)
        lines.append(f"| {reps[0][i]['net']}, N={n} | ratio after / before | {after / before:.2f} | | | |")
    lines.append("")
    lines.append(
        f"Thread CPU time, minimum of {args.repeats} alternating repeats, 1 thread; step {args.step}, depth <= "
        f"{args.depth}, {args.transitions} transitions; {args.calls} calls for the potential and leapfrog "
        f"columns. Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    )
    text = "\n".join(lines) + ("\n\n" + args.note if args.note else "")
    print(text)
    write_result(results_dir("leapfrog_ab", args.out) / "results.md", text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="HEAD", help="the git revision measured as 'before'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/leapfrog_ab/)")
    main(parser.parse_args())
