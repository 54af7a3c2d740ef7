"""Lockstep batched NUTS (:func:`bnn_pyro.infer._nuts_batched.nuts_transition`) against FlatNUTS, per leapfrog step.

The 1-50-1 tanh BNN of ``_common.py`` (Normal(0, 1) prior, sigma 0.1, N = 200), one torch thread, a fixed step
size (``--step``, no adaptation) and tree depth <= ``--depth``; FlatNUTS first takes ``--warm`` transitions from a
prior draw (toward the posterior's bulk, where every tree reaches the depth cap) and all batched chains start from
its state, each with its own momenta. FlatNUTS (one chain, the analytic bound-data leapfrog) against C = 1, 2,
4, 8 chains in lockstep, whose leapfrog is the generic :func:`~bnn_pyro.infer._nuts_batched.batched_leapfrog` on
``StackPotential.__call__`` with ``theta`` shaped (C, D) (the general batched path: ``baddbmm``/``bmm``).
Columns: ms per lockstep leapfrog step (one batched step of all C chains, masked ones included), ms per
chain-leapfrog (the time over the steps the chains actually took: what a draw costs), chain-leapfrogs per second,
the bare batched leapfrog in ms, the rest of a lockstep step (the transition's bookkeeping), and aten operations
per lockstep step (``torch.profiler``, top-level operations) in all and in the leapfrog alone. The generic batched
leapfrog is the part an analytic batched one would replace.

Times are the thread's CPU time (``time.thread_time``), the minimum over ``--repeats``; a loaded machine inflates
them all (shared cores and caches), so read the ratios. Usage:
``python benchmarks/nuts_batched.py [--chains 1 2 4 8] [--out benchmarks/results --name nuts_batched_loaded]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

import pyro
import torch
from torch.profiler import ProfilerActivity, profile

from _common import bnn, regression
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS
from bnn_pyro.infer._nuts_batched import batched_leapfrog, nuts_transition

N = 200


def _top_level_ops(run) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                       and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))).values())


def _flat(args):
    """FlatNUTS on the model: its kernel (set up at a fixed step) and ms per leapfrog step."""
    x, y = regression(N, 1)
    model = bnn(1)
    kernel = FlatNUTS(quiet_model(model, N), _logjoint.build(model, N), init_strategy=pyro.infer.autoguide.init_to_sample,
                      max_tree_depth=args.depth)
    torch.manual_seed(1)
    kernel.setup(0, x, y)
    kernel._adapter.step_size = args.step
    for _ in range(args.warm):  # from the prior draw toward the posterior's bulk, where the trees are deep
        kernel.sample(None)
    best = float("inf")
    for _ in range(args.repeats):
        steps, start = 0, time.thread_time()
        for _ in range(args.transitions):
            kernel.sample(None)
            steps += kernel.stats.n_steps
        best = min(best, (time.thread_time() - start) / steps * 1e3)
    return kernel, best


def _batched(kernel, c: int, args) -> dict:
    pot = kernel._potential
    z0, _, _ = kernel._state
    z = z0.expand(c, -1).clone()
    u, g = pot(z)
    step, minv = torch.full((c,), args.step), torch.ones_like(z)
    counted = [0]
    inner = batched_leapfrog(pot)

    def leapfrog(*a):
        counted[0] += 1
        return inner(*a)

    gen = torch.Generator().manual_seed(c)

    def transitions(n):
        nonlocal z, u, g
        steps = 0
        for _ in range(n):
            z, u, g, stats = nuts_transition(z, u, g, step, minv, leapfrog=leapfrog, generator=gen,
                                             max_tree_depth=args.depth)
            steps += int(stats.n_steps.sum())
        return steps

    transitions(1)  # first-call costs
    lock = chain = float("inf")
    for _ in range(args.repeats):
        counted[0] = 0
        start = time.thread_time()
        steps = transitions(args.transitions)
        spent = time.thread_time() - start
        lock, chain = min(lock, spent / counted[0] * 1e3), min(chain, spent / steps * 1e3)
    p = torch.randn_like(z)
    start = time.thread_time()
    for _ in range(args.calls):
        inner(z, p, g, step, minv)
    bare = (time.thread_time() - start) / args.calls * 1e3
    counted[0] = 0
    ops = _top_level_ops(lambda: transitions(1))
    per_lock = ops / counted[0]
    leap_ops = _top_level_ops(lambda: inner(z, p, g, step, minv))
    return dict(chains=c, lockstep_ms=lock, chain_leapfrog_ms=chain, chain_leapfrogs_per_s=1e3 / chain,
                bare_leapfrog_ms=bare, ops_per_lockstep=per_lock, leapfrog_ops=leap_ops)


def main(args) -> str:
    torch.set_num_threads(1)
    kernel, flat_ms = _flat(args)
    rows = [_batched(kernel, c, args) for c in args.chains]
    lines = ["| chains | ms / lockstep leapfrog | ms / chain-leapfrog | chain-leapfrogs / s | vs FlatNUTS per "
             "chain-leapfrog | bare batched leapfrog ms | bookkeeping ms (lockstep - bare) | aten ops / lockstep step "
             "(leapfrog's) |",
             "|---|---|---|---|---|---|---|---|",
             f"| FlatNUTS (1) | {flat_ms:.4f} | {flat_ms:.4f} | {1e3 / flat_ms:.0f} | 1.00 | | | |"]
    for r in rows:
        lines.append(f"| {r['chains']} | {r['lockstep_ms']:.4f} | {r['chain_leapfrog_ms']:.4f} | "
                     f"{r['chain_leapfrogs_per_s']:.0f} | {r['chain_leapfrog_ms'] / flat_ms:.2f} | "
                     f"{r['bare_leapfrog_ms']:.4f} | {r['lockstep_ms'] - r['bare_leapfrog_ms']:.4f} | "
                     f"{r['ops_per_lockstep']:.1f} ({r['leapfrog_ops']}) |")
    lines += ["", f"1-50-1 tanh BNN, N = {N}, float32, 1 torch thread; step {args.step}, depth <= {args.depth}, "
              f"{args.warm} FlatNUTS warm-up transitions, {args.transitions} transitions per repeat, minimum of {args.repeats} repeats of thread CPU time; "
              f"{args.calls} calls for the bare leapfrog. Load average at the end: {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores."]
    text = "\n".join(lines) + ("\n\n" + args.note if args.note else "")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="nuts_batched")
    main(parser.parse_args())
