"""Where a one-chain NUTS transition's fixed cost goes: the layers and pieces of ``method="nuts"``'s kernel at one chain.

On the 1-50-1 tanh MLP of ``fast_path.py`` (N = 200, Normal(0, 1) prior, sigma 0.1), depth <= 2 (3 leapfrog steps
per transition) at a fixed step size, with every leapfrog step replaced by a stored one (its first result,
replayed), so that what is timed is the kernel's own cost per draw, not the potential's:

- the layers: ``FlatNUTS.sample`` (the kernel: the draw split into the sites), ``BatchedChains.sample`` (per-draw
  statistics and adaptation bookkeeping) and ``nuts_transition`` itself;
- the pieces the transition makes per draw outside the leapfrog, each timed alone over the same inputs: the
  momentum draw, ``M^-1 p``, the energies read back, the block of uniforms, the argument check, the drawn potential
  rounded to the chain's dtype, and the U-turn checks of a 3-step tree (two single-state checks: the merge after
  the last doubling is not checked). The chain is held unbatched (``(D,)`` vectors, a float potential), as
  ``BatchedChains`` holds one chain;
- the rest of the transition: its Python bookkeeping (the per-chain lists of the lockstep builder at ``C = 1``).

Each figure is the median over ``--repeats`` rounds of thread CPU time per call (``time.thread_time``), one
thread; on a loaded machine read the shares, not the microseconds.

Usage: ``python benchmarks/nuts_one_chain_cost.py [--repeats 5] [--calls 3000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch
from _common import results_dir, write_result
from fast_path import mlp, regression

from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._batched import momentum
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS, _check_one, _in_dtype, _Node, _sharp_one, _turned, nuts_transition


def _per_call(fn, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def measure(calls: int) -> dict[str, float]:
    """Microseconds per call of each layer and piece (one round)."""
    n = 200
    x, y = regression(n, 1)
    model = mlp((1, 50, 1))
    kernel = FlatNUTS(
        quiet_model(model, n),
        _logjoint.build(model, n),
        init_strategy=pyro.infer.autoguide.init_to_sample,
        max_tree_depth=2,
    )
    torch.manual_seed(1)
    kernel.setup(0, x, y)
    chains = kernel.chains
    chains._adapters[0].step_size = 1e-3
    for _ in range(5):  # first-call costs, with the real leapfrog
        kernel.sample(None)
    # the stored step: the chain's state with a fresh momentum, its energies consistent (U here, 0.5 p . M^-1 p),
    # so that the replayed tree neither diverges nor turns: every transition takes its 3 leapfrog steps
    real, m1 = chains.leapfrog.unbatched, chains.inverse_mass_matrix[0]
    p1 = torch.randn(m1.shape, generator=torch.Generator().manual_seed(0), dtype=m1.dtype) * m1.rsqrt()
    s1 = m1 * p1
    stored = (chains.z[0], p1, chains.g[0], s1, (float(chains.u[0]), 0.5 * float(p1.dot(s1))))
    chains.leapfrog.unbatched = lambda *args: stored
    steps = 0
    for _ in range(50):
        kernel.sample(None)
        steps += kernel.stats.n_steps
    if steps != 3 * 50:
        raise SystemExit(f"the replayed trees took {steps / 50} leapfrog steps per transition, not 3")
    # the chain as BatchedChains holds it: (D,) vectors, float potential and step
    z, u, g, minv, gen = chains.z[0], float(chains.u[0]), chains.g[0], chains.inverse_mass_matrix[0], chains.generator
    step = 1e-3

    def transition():
        with torch.no_grad():
            nuts_transition(z, u, g, step, minv, leapfrog=chains.leapfrog, generator=gen, max_tree_depth=2)

    p = momentum(minv, gen, batched=False)
    s = _sharp_one(minv, p)
    single = _Node(p, s, p, s, p, [1.0])
    out = dict(
        kernel=_per_call(lambda: kernel.sample(None), calls),
        chains=_per_call(chains.sample, calls),
        transition=_per_call(transition, calls),
        momentum=_per_call(lambda: momentum(minv, gen, batched=False), calls),
        sharp=_per_call(lambda: _sharp_one(minv, p), calls),
        energies=_per_call(lambda: torch.linalg.vecdot(p.unsqueeze(0), s).tolist(), calls),
        uniforms=_per_call(lambda: torch.rand(7, 1, generator=gen, dtype=z.dtype).tolist(), calls),
        check=_per_call(lambda: _check_one(z, u, g, step, minv, chains.leapfrog, 2), calls),
        rounded=_per_call(lambda: _in_dtype(u, z.dtype), calls),
        uturns=_per_call(lambda: (_turned([(single, single)], True), _turned([(single, single)], True)), calls),
    )
    chains.leapfrog.unbatched = real
    return out


def main(args) -> str:
    torch.set_num_threads(1)
    rounds = [measure(args.calls) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    pieces = ("momentum", "sharp", "energies", "uniforms", "check", "rounded", "uturns")
    rows = [
        ("one-chain kernel: FlatNUTS.sample", med["kernel"], "the whole draw"),
        ("  the kernel's own layer (the draw split into its sites)", med["kernel"] - med["chains"], ""),
        ("  BatchedChains.sample's own layer (statistics, bookkeeping)", med["chains"] - med["transition"], ""),
        ("  nuts_transition", med["transition"], ""),
        ("    momentum p ~ N(0, M) from the chain's generator", med["momentum"], "tensor ops"),
        ("    M^-1 p", med["sharp"], "tensor ops"),
        ("    energies read back (U, p . M^-1 p)", med["energies"], "tensor ops"),
        ("    the block of uniforms (directions, merges, leaves)", med["uniforms"], "tensor ops"),
        ("    the argument check (one chain, unbatched)", med["check"], "Python"),
        ("    the drawn potential rounded to the chain's dtype", med["rounded"], "Python (struct)"),
        ("    U-turn checks of a 3-step tree (2 single-state)", med["uturns"], "tensor ops"),
        ("    the rest: Python bookkeeping", med["transition"] - sum(med[k] for k in pieces), "by difference"),
    ]
    table = "| part | us per draw | share of the draw | how |\n|---|---|---|---|\n" + "".join(
        f"| {name} | {v:.1f} | {v / med['kernel']:.0%} | {how} |\n" for name, v, how in rows
    )
    text = (
        "# Where a one-chain NUTS transition's fixed cost goes (1-50-1, depth <= 2, leapfrog replayed)\n\n"
        f"Median of {args.repeats} rounds of {args.calls} calls, thread CPU time, 1 thread.\n\n"
        + table
        + ("\n" + args.note + "\n" if args.note else "")
    )
    print(text)
    if args.out is not None or args.write:
        write_result(results_dir("samplers_ab", args.out) / f"{args.name}.md", text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--write", action="store_true", help="write into benchmarks/results/samplers_ab/")
    parser.add_argument("--name", default="one_chain_cost")
    main(parser.parse_args())
