"""Lockstep batched NUTS (:func:`bnn_pyro.infer._nuts.nuts_transition`) against FlatNUTS, per leapfrog step.

The 1-50-1 tanh BNN of ``_common.py`` (Normal(0, 1) prior, sigma 0.1, N = 200), one torch thread, a fixed step
size (``--step``, no adaptation) and tree depth <= ``--depth``; FlatNUTS first takes ``--warm`` transitions from a
prior draw (toward the posterior's bulk, where every tree reaches the depth cap) and all batched chains start from
its state, each with its own momenta. FlatNUTS (one chain, the analytic bound-data leapfrog) against C = 1, 2,
4, 8 chains in lockstep, whose leapfrog is the analytic batched one on the bound data
(:meth:`~bnn_pyro.infer._analytic.StackPotential.leapfrog_batch`: ``baddbmm``/``bmm``, what
``chain_method="vectorized"`` runs).
Columns: ms per lockstep leapfrog step (one batched step of all C chains, masked ones included), ms per
chain-leapfrog (the time over the steps the chains actually took: what a draw costs), chain-leapfrogs per second,
the time per lockstep step outside the leapfrog calls (the transition's bookkeeping, timed in the same run), and
aten operations per lockstep step (``torch.profiler``, top-level operations) in all and in one bare leapfrog
step.

Times are the thread's CPU time (``time.thread_time``), the minimum over ``--repeats``; a loaded machine inflates
them all (shared cores and caches), so read the ratios. Usage:
``python benchmarks/nuts_batched.py [--chains 1 2 4 8] [--out DIR] [--name results]`` writes ``NAME.md`` (headed by
the run's provenance) in ``benchmarks/results/nuts_batched/``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter

import pyro
import torch
from _common import bnn, regression, results_dir, write_result
from torch.profiler import ProfilerActivity, profile

from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._analytic_batched import OneChain
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS, nuts_transition

N = 200


def _top_level_ops(run) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(
        Counter(
            e.name
            for e in prof.events()
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ).values()
    )


def _flat(args):
    """FlatNUTS on the model, set up at a fixed step and warmed up, and a function timing it (ms per leapfrog)."""
    x, y = regression(N, 1)
    model = bnn(1)
    kernel = FlatNUTS(
        quiet_model(model, N),
        _logjoint.build(model, N),
        init_strategy=pyro.infer.autoguide.init_to_sample,
        max_tree_depth=args.depth,
    )
    torch.manual_seed(1)
    kernel.setup(0, x, y)
    kernel.chains._adapters[0].step_size = args.step
    for _ in range(args.warm):  # from the prior draw toward the posterior's bulk, where the trees are deep
        kernel.sample(None)

    def timed() -> float:
        steps, start = 0, time.thread_time()
        for _ in range(args.transitions):
            kernel.sample(None)
            steps += kernel.stats.n_steps
        return (time.thread_time() - start) / steps * 1e3

    return kernel, timed


class _Batched:
    """``C`` chains in lockstep from FlatNUTS's state; :meth:`timed` runs ``--transitions`` transitions and returns
    ms per lockstep step, ms per chain-leapfrog, and ms per lockstep step outside the leapfrog (the bookkeeping:
    thread time in the transition less the thread time inside the leapfrog calls, measured in the same run)."""

    def __init__(self, kernel, c: int, args):
        pot = kernel.chains.leapfrog.pot
        self.c, self.args = c, args
        self.inner = pot.leapfrog_batch if c > 1 else OneChain(pot)  # as chain_method="vectorized" does
        self.z = kernel.chains.z.expand(c, -1).clone()
        self.u, self.g = pot(self.z)
        self.step, self.minv = torch.full((c,), args.step), torch.ones_like(self.z)
        self.gen = torch.Generator().manual_seed(c)
        self.calls, self.inside = 0, 0.0
        self.transitions(1)  # first-call costs

    def leapfrog(self, *a):
        self.calls += 1
        start = time.thread_time()
        out = self.inner(*a)
        self.inside += time.thread_time() - start
        return out

    def transitions(self, n: int) -> int:
        steps = 0
        for _ in range(n):
            self.z, self.u, self.g, stats = nuts_transition(
                self.z,
                self.u,
                self.g,
                self.step,
                self.minv,
                leapfrog=self.leapfrog,
                generator=self.gen,
                max_tree_depth=self.args.depth,
            )
            steps += sum(stats.n_steps)
        return steps

    def timed(self) -> tuple[float, float, float]:
        self.calls, self.inside = 0, 0.0
        start = time.thread_time()
        steps = self.transitions(self.args.transitions)
        spent = time.thread_time() - start
        return spent / self.calls * 1e3, spent / steps * 1e3, (spent - self.inside) / self.calls * 1e3

    def counts(self) -> tuple[float, int]:
        """aten operations per lockstep step, and in one bare leapfrog step."""
        self.calls = 0
        ops = _top_level_ops(lambda: self.transitions(1))
        p = torch.randn_like(self.z)
        return ops / self.calls, _top_level_ops(lambda: self.inner(self.z, p, self.g, self.step, self.minv))


def main(args) -> str:
    torch.set_num_threads(1)
    kernel, flat = _flat(args)
    sides = [_Batched(kernel, c, args) for c in args.chains]
    flat_ms, best = float("inf"), {c: (float("inf"),) * 3 for c in args.chains}
    for _ in range(args.repeats):  # alternating, so that a burst of load hits every side
        flat_ms = min(flat_ms, flat())
        for side in sides:
            best[side.c] = tuple(map(min, best[side.c], side.timed()))
    rows = []
    for side in sides:
        lock, chain, book = best[side.c]
        ops, leap_ops = side.counts()
        rows.append(
            dict(
                chains=side.c,
                lockstep_ms=lock,
                chain_leapfrog_ms=chain,
                chain_leapfrogs_per_s=1e3 / chain,
                bookkeeping_ms=book,
                ops_per_lockstep=ops,
                leapfrog_ops=leap_ops,
            )
        )
    lines = [
        "| chains | ms / lockstep leapfrog | ms / chain-leapfrog | chain-leapfrogs / s | vs FlatNUTS per "
        "chain-leapfrog | ms / lockstep step outside the leapfrog | aten ops / lockstep step (leapfrog's) |",
        "|---|---|---|---|---|---|---|",
        f"| FlatNUTS (1) | {flat_ms:.4f} | {flat_ms:.4f} | {1e3 / flat_ms:.0f} | 1.00 | | |",
    ]
    for r in rows:
        lines.append(
            f"| {r['chains']} | {r['lockstep_ms']:.4f} | {r['chain_leapfrog_ms']:.4f} | "
            f"{r['chain_leapfrogs_per_s']:.0f} | {r['chain_leapfrog_ms'] / flat_ms:.2f} | "
            f"{r['bookkeeping_ms']:.4f} | {r['ops_per_lockstep']:.1f} ({r['leapfrog_ops']}) |"
        )
    lines += [
        "",
        f"1-50-1 tanh BNN, N = {N}, float32, 1 torch thread; step {args.step}, depth <= {args.depth}, "
        f"{args.warm} FlatNUTS warm-up transitions, {args.transitions} transitions per repeat, minimum of "
        f"{args.repeats} repeats of thread CPU time, FlatNUTS and each C alternating. Load average at the end: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
    ]
    text = "\n".join(lines) + ("\n\n" + args.note if args.note else "")
    print(text)
    write_result(results_dir("nuts_batched", args.out) / f"{args.name}.md", text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=3)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/nuts_batched/)")
    parser.add_argument("--name", default="results", help="the result file's name (default results)")
    main(parser.parse_args())
