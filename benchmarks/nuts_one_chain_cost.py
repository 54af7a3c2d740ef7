"""Where a one-chain NUTS transition's fixed cost goes: the layers and pieces of ``method="nuts"``'s kernel at one chain.

On the 1-50-1 tanh MLP of ``fast_path.py`` (N = 200, Normal(0, 1) prior, sigma 0.1), depth <= 2 (3 leapfrog steps
per transition) at a fixed step size, with every leapfrog step replaced by a stored one (its first result,
replayed), so that what is timed is the kernel's own cost per draw, not the potential's:

- the layers: ``FlatNUTS.sample`` (the kernel: the draw split into the sites), ``BatchedChains.sample`` (per-draw
  statistics and adaptation bookkeeping) and ``nuts_transition`` itself;
- the tensor operations the transition makes per draw outside the leapfrog, each timed alone over the same
  inputs: the momentum draw, ``M^-1 p``, the energies read back, the block of uniforms, the chain's ``(D,)`` views,
  the result's ``(1, D)`` views and potential, and the U-turn checks of a 3-step tree (two single-state checks,
  one 4 x 4 product);
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
from bnn_pyro.infer._analytic_batched import sharp
from bnn_pyro.infer._batched import momentum
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS, _Node, _turned, nuts_transition


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
    z, u, g, minv, gen = chains.z, chains.u, chains.g, chains.inverse_mass_matrix, chains.generator
    step = z.new_tensor([1e-3])

    def transition():
        with torch.no_grad():
            nuts_transition(z, u, g, step, minv, leapfrog=chains.leapfrog, generator=gen, max_tree_depth=2)

    p = momentum(minv, gen)
    s = sharp(minv, p)
    single, long = _Node(p[0], s[0], p[0], s[0], p[0], [1.0]), _Node(p[0], s[0], p[0], s[0], p[0], None)
    out = dict(
        kernel=_per_call(lambda: kernel.sample(None), calls),
        chains=_per_call(chains.sample, calls),
        transition=_per_call(transition, calls),
        momentum=_per_call(lambda: momentum(minv, gen), calls),
        sharp=_per_call(lambda: sharp(minv, p), calls),
        energies=_per_call(lambda: (u.tolist(), torch.linalg.vecdot(p, s).tolist()), calls),
        uniforms=_per_call(lambda: torch.rand(7, 1, generator=gen, dtype=z.dtype).tolist(), calls),
        views=_per_call(lambda: (minv[0], z[0], g[0], p[0], s[0]), calls),
        result=_per_call(lambda: (z[0].unsqueeze(0), g[0].unsqueeze(0), u.new_tensor([0.0])), calls),
        uturns=_per_call(
            lambda: (
                _turned([(single, single)], True),
                _turned([(single, single)], True),
                _turned([(long, long)], True),
            ),
            calls,
        ),
    )
    chains.leapfrog.unbatched = real
    return out


def main(args) -> str:
    torch.set_num_threads(1)
    rounds = [measure(args.calls) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    pieces = ("momentum", "sharp", "energies", "uniforms", "views", "result", "uturns")
    rows = [
        ("one-chain kernel: FlatNUTS.sample", med["kernel"], "the whole draw"),
        ("  the kernel's own layer (the draw split into its sites)", med["kernel"] - med["chains"], ""),
        ("  BatchedChains.sample's own layer (statistics, bookkeeping)", med["chains"] - med["transition"], ""),
        ("  nuts_transition", med["transition"], ""),
        ("    momentum p ~ N(0, M) from the chain's generator", med["momentum"], "tensor ops"),
        ("    M^-1 p", med["sharp"], "tensor ops"),
        ("    energies read back (U, p . M^-1 p)", med["energies"], "tensor ops"),
        ("    the block of uniforms (directions, merges, leaves)", med["uniforms"], "tensor ops"),
        ("    the chain's (D,) views at C = 1", med["views"], "tensor ops"),
        ("    the result as (1, D) views and a (1,) potential", med["result"], "tensor ops"),
        ("    U-turn checks of a 3-step tree", med["uturns"], "tensor ops"),
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
