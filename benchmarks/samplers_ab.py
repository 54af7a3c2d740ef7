"""The fast path's samplers, this checkout against an earlier revision of bnn_pyro, interleaved in one run.

What the one-implementation-per-sampler change could slow down, side by side (``--before``, default ``a7736d0``:
main before it, with a recursive one-chain NUTS builder beside the lockstep one):

- ``nuts 1 chain``: ``method="nuts"``'s one-chain kernel (``FlatNUTS``; what every chain of ``chain_method="auto"``
  or ``"sequential"`` runs), ms per leapfrog step at tree depth <= ``--depth`` (deep trees: the per-leapfrog cost),
  ms per transition at depth <= 2 (shallow trees: the per-draw cost), and the same with every leapfrog step
  replaced by a stored one (the kernel's fixed cost per draw without the potential's);
- ``hmc 1 chain``: ``FlatHMC``, ms per leapfrog step (``--num-leapfrog`` steps per draw) and per transition at 4;
- ``nuts C chains``: the lockstep transition of ``chain_method="vectorized"`` for ``C`` in ``--chains``, ms per
  lockstep leapfrog step (C = 1 runs the one-chain leapfrog, as ``chain_method="vectorized"`` does);
- ``svi 1 chain``: ms per optimizer step of SVI's default fit (mean field on the flat path: the gradient loop),
  from two fits of ``--svi-steps / 10`` and ``--svi-steps`` steps (the difference removes the setup).

On the tanh MLPs of ``fast_path.py`` (Normal(0, 1) prior, sigma 0.1): 1-50-1 with N = 200 and 8-50-50-1 with
N = 1,000 (the analytic potential), and 1-50-1 under a Laplace prior (the generic potential, one compiled graph).
Fixed step size (``--step``, no adaptation), every kernel from the same start. Each side runs in a child process
of its own (``PYTHONPATH`` set to its tree: ``--before``'s ``bnn_pyro`` extracted by ``git archive``), the sides
alternating ``--repeats`` times; each figure is the minimum over repeats of the thread's CPU time
(``time.thread_time``), which a busy machine inflates less than wall time (it still does: shared cores and caches),
so read the ratios.

Usage: ``python benchmarks/samplers_ab.py [--before a7736d0] [--repeats 3] [--only svi] [--out benchmarks/results/samplers_ab]``
(``--only svi``: the SVI rows alone).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NETS = (
    ("1-50-1, N=200", (1, 50, 1), 200, "normal"),
    ("8-50-50-1, N=1000", (8, 50, 50, 1), 1000, "normal"),
    ("1-50-1, N=200, Laplace prior (generic)", (1, 50, 1), 200, "laplace"),
)


def _child(settings: dict) -> list[dict]:
    """In a child process: the figures of the bnn_pyro on ``sys.path``."""
    import importlib

    import pyro
    import torch
    from fast_path import SIGMA, mlp, regression

    import bnn_pyro as bp
    from bnn_pyro.infer import _logjoint
    from bnn_pyro.infer._common import quiet_model
    from bnn_pyro.infer._nuts import FlatNUTS

    try:
        FlatHMC = importlib.import_module("bnn_pyro.infer._one_chain").FlatHMC
    except ModuleNotFoundError:  # before: the one-chain kernels' module was named _flat_hmc
        FlatHMC = importlib.import_module("bnn_pyro.infer._flat_hmc").FlatHMC
    analytic_batched = importlib.import_module("bnn_pyro.infer._analytic_batched")
    one_chain = getattr(analytic_batched, "OneChain", None) or analytic_batched.one_chain_leapfrog
    try:
        nuts_transition = importlib.import_module("bnn_pyro.infer._nuts").nuts_transition
    except AttributeError:  # before: the lockstep transition had a module of its own
        nuts_transition = importlib.import_module("bnn_pyro.infer._nuts_batched").nuts_transition

    torch.set_num_threads(1)
    step = settings["step"]

    def kernel_of(cls, model, n, x, y, **options):
        kernel = cls(
            quiet_model(model, n),
            _logjoint.build(model, n),
            init_strategy=pyro.infer.autoguide.init_to_sample,
            **options,
        )
        torch.manual_seed(1)
        kernel.setup(0, x, y)
        adapter = kernel.chains._adapters[0] if hasattr(kernel, "chains") else kernel._adapter
        adapter.step_size = step
        for _ in range(settings["warm"]):  # first-call costs; from the prior draw toward the posterior's bulk
            kernel.sample(None)
        return kernel

    def timed(kernel, transitions: int) -> tuple[float, float, float]:
        """ms per leapfrog step, ms per transition, leapfrog steps per transition"""
        steps, start = 0, time.thread_time()
        for _ in range(transitions):
            kernel.sample(None)
            steps += kernel.stats.n_steps
        spent = (time.thread_time() - start) * 1e3
        return spent / steps, spent / transitions, steps / transitions

    def outside_leapfrog(kernel, transitions: int) -> tuple[float, float]:
        """ms per transition with every leapfrog step replaced by a stored one (its first result, replayed): the
        kernel's fixed cost per draw, without the potential's; and the leapfrog steps per transition."""
        holder, name = (
            (kernel.chains.leapfrog, "unbatched") if hasattr(kernel, "chains") else (kernel._potential, "leapfrog")
        )
        own, real, stored = name in vars(holder), getattr(holder, name), []

        def replay(*args):
            if not stored:
                stored.append(real(*args))
            return stored[0]

        setattr(holder, name, replay)
        try:
            _, per_transition, length = timed(kernel, transitions)
        finally:
            setattr(holder, name, real) if own else delattr(holder, name)
        return per_transition, length

    rows = []
    for label, widths, n, prior in NETS:
        if settings["only"] == "svi" and prior != "normal":  # no SVI row on the generic net
            continue
        x, y = regression(n, widths[0])
        model = mlp(widths)
        if prior == "laplace":  # the same net under another prior: no analytic potential
            torch.manual_seed(0)
            net = torch.nn.Sequential(
                torch.nn.Linear(widths[0], widths[1]), torch.nn.Tanh(), torch.nn.Linear(widths[1], widths[2])
            )
            model = bp.BNN(net, prior=bp.priors.Laplace(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=SIGMA))
        kernels = settings["only"] == "all"  # built before the SVI fits, as without --only
        if kernels:
            deep = kernel_of(FlatNUTS, model, n, x, y, max_tree_depth=settings["depth"])
            shallow = kernel_of(FlatNUTS, model, n, x, y, max_tree_depth=2)
            hmc = kernel_of(FlatHMC, model, n, x, y, num_leapfrog=settings["num_leapfrog"])
            hmc_short = kernel_of(FlatHMC, model, n, x, y, num_leapfrog=4)
        row = dict(net=label)
        if prior == "normal":  # SVI's default mean-field fit: the flat path's gradient loop (driver.descend)
            import warnings

            spent = {}
            for k in (settings["svi_steps"] // 10, settings["svi_steps"] // 10, settings["svi_steps"]):  # 1st: warm-up
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    start = time.thread_time()
                    bp.fit(model, x, y, method="svi", num_steps=k, num_chains=1, progress=False, seed=0)
                    spent[k] = time.thread_time() - start
            short, long_ = sorted(spent)
            row["svi 1 chain: ms/step"] = (spent[long_] - spent[short]) / (long_ - short) * 1e3
        if not kernels:
            rows.append(row)
            continue
        per_leapfrog, _, length = timed(deep, settings["transitions"])
        row["nuts 1 chain: ms/leapfrog"] = per_leapfrog
        row[f"nuts 1 chain: leapfrog steps/transition (<= {2 ** settings['depth'] - 1})"] = length
        row["nuts 1 chain: ms/transition, depth <= 2"] = timed(shallow, 20 * settings["transitions"])[1]
        outside, length = outside_leapfrog(shallow, 20 * settings["transitions"])
        row["nuts 1 chain: ms/transition outside the leapfrog (a replayed step), depth <= 2"] = outside
        row["nuts 1 chain: leapfrog steps/transition (replayed, <= 3)"] = length
        row["hmc 1 chain: ms/leapfrog"] = timed(hmc, settings["transitions"])[0]
        row["hmc 1 chain: ms/transition, 4 steps"] = timed(hmc_short, 20 * settings["transitions"])[1]
        if prior == "normal":  # chain_method="vectorized" runs on the analytic potential only
            pot = deep.chains.leapfrog.pot if hasattr(deep, "chains") else deep._potential
            for c in settings["chains"]:
                leapfrog = one_chain(pot) if c == 1 else pot.leapfrog_batch
                gen = torch.Generator().manual_seed(2)
                z = deep.chains.z if hasattr(deep, "chains") else deep._state[0][None]
                z = z.expand(c, -1).clone()
                z = z + 1e-3 * torch.randn(z.shape, generator=gen)
                u, g = pot.batch(c)(z)
                minv, steps_c = torch.ones_like(z), torch.full((c,), step)
                nuts_transition(
                    z, u, g, steps_c, minv, leapfrog=leapfrog, generator=gen, max_tree_depth=settings["depth"]
                )
                lock, start = 0, time.thread_time()
                for _ in range(settings["transitions"]):
                    z, u, g, stats = nuts_transition(
                        z, u, g, steps_c, minv, leapfrog=leapfrog, generator=gen, max_tree_depth=settings["depth"]
                    )
                    lock += 2 ** int(max(stats.tree_depth)) - 1  # lockstep steps: the deepest chain's tree
                spent = (time.thread_time() - start) * 1e3
                row[f"nuts {c} chains lockstep: ms/lockstep leapfrog"] = spent / lock
        rows.append(row)
    return rows


def main(args) -> str:
    settings = dict(
        transitions=args.transitions,
        step=args.step,
        depth=args.depth,
        chains=args.chains,
        num_leapfrog=args.num_leapfrog,
        svi_steps=args.svi_steps,
        warm=args.warm,
        only=args.only,
    )
    load_start = os.getloadavg()[0]
    sys.path.insert(0, str(HERE))
    from _common import alternating, exported, results_dir, side_result, write_result  # this checkout's bnn_pyro

    with exported(args.before) as before:
        sides = {"before": before, "after": ROOT}
        runs = alternating(sides, args.repeats, lambda tree: side_result(tree, "samplers_ab", "_child", settings))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "bnn_pyro"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    header = [
        f"# samplers A/B: {args.before} (before) against {commit}{' + uncommitted changes' if dirty else ''} (after)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}; torch threads: 1 per side",
        f"- load average: {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        f"- settings: step {args.step}, NUTS depth <= {args.depth}, HMC {args.num_leapfrog} leapfrog steps, "
        f"SVI {args.svi_steps // 10} and {args.svi_steps} steps, "
        f"{args.warm} transitions before timing a kernel, {args.transitions} transitions per figure (20x that "
        f"for the per-transition figures), minimum of {args.repeats} alternating repeats of thread CPU time",
        f"- command: `python benchmarks/samplers_ab.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    lines = ["| net | measure | before ms | after ms | after / before |", "|---|---|---|---|---|"]
    for i, row in enumerate(runs["after"][0]):
        for key in row:
            if key == "net":
                continue
            before, after = (min(r[i][key] for r in runs[side]) for side in ("before", "after"))
            if "steps/transition" in key:  # a count, not a time (its mean over the repeats)
                before, after = (sum(r[i][key] for r in runs[side]) / len(runs[side]) for side in ("before", "after"))
                lines.append(f"| {row['net']} | {key} | {before:.1f} | {after:.1f} | |")
                continue
            lines.append(f"| {row['net']} | {key} | {before:.4f} | {after:.4f} | {after / before:.2f} |")
    text = "\n".join(header + lines) + ("\n\n" + args.note if args.note else "") + "\n"
    print(text)
    if args.out:
        write_result(results_dir("samplers_ab", args.out) / f"{args.name}.md", text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="a7736d0", help="the git revision measured as 'before'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=5)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--num-leapfrog", type=int, default=64)
    parser.add_argument("--chains", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--svi-steps", type=int, default=2000)
    parser.add_argument("--warm", type=int, default=5, help="transitions before timing a kernel")
    parser.add_argument(
        "--only", choices=["all", "svi"], default="all", help="'svi': the SVI rows alone (no kernel is built)"
    )
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="samplers_ab")
    main(parser.parse_args())
