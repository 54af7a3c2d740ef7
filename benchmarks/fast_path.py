"""The analytic fast path (bnn_pyro/infer/_analytic.py) against the generic one, side by side in one run.

- ``nuts``: ms per leapfrog step of :class:`~bnn_pyro.infer._nuts.FlatNUTS` on a tanh MLP (Normal(0, 1) prior,
  sigma 0.1), one chain, one thread, from the same start at a fixed step size (``--step``, no adaptation) with
  tree depth <= ``--depth``: wall time of ``--transitions`` transitions / leapfrog steps taken. "generic" is the
  path before the analytic one (the potential and gradient recorded by ``make_fx`` and frozen by TorchScript,
  ``_logjoint.flat_potential_and_grad``); "analytic" is ``_analytic.build``. Nets 1-50-1 with N = 200 and
  8-50-50-1 with N = 1,000.
- ``svi``: ms per optimizer step of ``bp.fit(method="svi")`` (mean-field, Adam, lr 1e-2, full batch), 8-50-1,
  N = 1,000 (``_common``'s data and net, as ``performance.py``), 1 and 8 particles, at each of ``--threads``:
  (time of 50 + ``--svi-steps`` steps - time of 50) / ``--svi-steps`` (``_common.per_step``), so set-up and
  drawing cancel. Every bnn_pyro row uses Pyro's ``Trace_ELBO`` estimator (``w = loc + scale * eps`` and the Monte
  Carlo ``log p(y, w) - log q(w)`` at the draw): "flat" is the default (``_svi_flat``: two flat tensors, analytic
  gradient, fused Adam, its own lean loop), "analytic through autograd" the path before it (the same analytic ELBO
  as an autograd function over every site's tensors, the driver's loop), "generic" the Pyro-free autograd path.
  Baselines: ``baselines.svi_loop``, the tightest hand-written loop (one flat ``loc`` and softplus scale, autograd,
  fused Adam, no per-step ``.item()``), with the same Monte Carlo KL (the ratio's baseline) and with the closed-form
  KL. (Before, this script's baseline was a per-layer loop with foreach Adam, ``baddbmm`` even for one particle and an
  ``.item()`` per step, ~1.6x slower than ``baselines.svi_loop``: why it reported 0.66x where ``performance.py``
  reported 3.4x.)

Each figure is the minimum of ``--repeats`` repetitions, interleaved across implementations (the machine may be
shared: minima are the least disturbed); ratios are to the baseline of the same row group, measured in the same run.

Usage: ``python benchmarks/fast_path.py [--quick] [--only svi] [--out DIR]`` writes ``results.md`` (``svi.md`` with
``--only svi``), headed by the run's provenance, in ``benchmarks/results/fast_path/``.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager, nullcontext

import _common as common
import baselines
import pyro
import torch

import bnn_pyro as bp
from bnn_pyro.infer import _analytic, _logjoint, _svi_flat
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS

SIGMA = 0.1


def regression(n: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * 4 - 2
    return x, torch.sin(2 * x.mean(1)) + SIGMA * torch.randn(n, generator=g)


def mlp(widths) -> bp.BNN:
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return bp.BNN(
        torch.nn.Sequential(*layers[:-1]),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=SIGMA),
    )


@contextmanager
def generic_path():
    """The fast path as it was before the analytic potential: ``_analytic.build`` declines every model."""
    build = _analytic.build
    _analytic.build = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _analytic.build = build


# ---------------------------------------------------------------------- NUTS
def nuts_ms_per_leapfrog(widths, n, *, analytic: bool, transitions: int, step: float, depth: int) -> float:
    x, y = regression(n, widths[0])
    model = mlp(widths)
    joint = _logjoint.build(model, n)
    kernel = FlatNUTS(
        quiet_model(model, n), joint, init_strategy=pyro.infer.autoguide.init_to_sample, max_tree_depth=depth
    )
    torch.manual_seed(1)
    if analytic:
        kernel.setup(0, x, y)
    else:
        with generic_path():
            kernel.setup(0, x, y)
    assert isinstance(kernel.chains.leapfrog.pot, _analytic.StackPotential) == analytic
    kernel.chains._adapters[0].step_size = step
    kernel.sample(None)  # compiles the generic path's graphs
    steps, start = 0, time.perf_counter()
    for _ in range(transitions):
        kernel.sample(None)
        steps += kernel.stats.n_steps
    return (time.perf_counter() - start) / steps * 1e3


# ---------------------------------------------------------------------- SVI
@contextmanager
def autograd_path():
    """SVI's analytic path as it was before the flat one: the analytic ELBO through autograd, the driver's loop."""
    of = _svi_flat.FlatMeanField.of
    _svi_flat.FlatMeanField.of = classmethod(lambda cls, *args: None)
    try:
        yield
    finally:
        _svi_flat.FlatMeanField.of = of


def svi_run(particles: int, path: str, x, y):
    """``run(steps)``: one ``bp.fit(method="svi")`` of ``steps`` steps on ``path`` ("flat", "autograd", "generic")."""
    model = common.bnn(x.shape[1])
    context = {"flat": nullcontext, "autograd": autograd_path, "generic": generic_path}[path]

    def run(steps: int):
        with context():
            bp.fit(
                model,
                x,
                y,
                method="svi",
                num_steps=steps,
                num_particles=particles,
                num_samples=1,
                seed=0,
                progress=False,
                num_threads=torch.get_num_threads(),
            )

    return run


# ---------------------------------------------------------------------- table
def main(args) -> None:
    torch.set_num_threads(1)
    rows = []
    nuts = dict(transitions=3 if args.quick else args.transitions, step=args.step, depth=args.depth)
    for widths, n in (((1, 50, 1), 200), ((8, 50, 50, 1), 1000)) if "nuts" in args.only else ():
        runs = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, so that a burst of load hits both
            for analytic in runs:
                runs[analytic].append(nuts_ms_per_leapfrog(widths, n, analytic=analytic, **nuts))
        figures = {k: min(v) for k, v in runs.items()}
        net = "-".join(map(str, widths))
        rows.append(("nuts", f"{net}, N={n}", "generic (before)", figures[False], "ms/leapfrog", 1.0))
        rows.append(("nuts", f"{net}, N={n}", "analytic", figures[True], "ms/leapfrog", figures[True] / figures[False]))
    steps = (5, 25) if args.quick else (50, 50 + args.svi_steps)
    x, y = common.regression(1000, 8)
    for threads in args.threads if "svi" in args.only else ():
        torch.set_num_threads(threads)
        for particles in (1, 8):
            impls = {
                "bnn_pyro, generic (Pyro-free, autograd)": svi_run(particles, "generic", x, y),
                "bnn_pyro, analytic through autograd (before)": svi_run(particles, "autograd", x, y),
                "bnn_pyro, flat (default)": svi_run(particles, "flat", x, y),
                "hand, flat loop, Monte Carlo KL (same estimator)": baselines.svi_loop(
                    x, y, particles=particles, kl="mc"
                ),
                "hand, flat loop, analytic KL": baselines.svi_loop(x, y, particles=particles),
            }
            runs = {name: [] for name in impls}
            for _ in range(args.repeats):  # interleaved
                for name, run in impls.items():
                    runs[name].append(common.per_step(run, *steps, repeats=1))
            figures = {name: min(v) for name, v in runs.items()}
            base = figures["hand, flat loop, Monte Carlo KL (same estimator)"]
            for name, value in figures.items():
                rows.append(
                    (
                        "svi",
                        f"8-50-1, N=1000, {particles} particle(s), {threads} thread(s)",
                        name,
                        value,
                        "ms/step",
                        value / base,
                    )
                )
    lines = ["| workload | setting | implementation | value | unit | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {w} | {s} | {i} | {v:.4f} | {u} | {r:.2f} |" for w, s, i, v, u, r in rows]
    lines.append("")
    lines.append(
        f"torch {torch.__version__}, minimum of {args.repeats} interleaved repeats; NUTS: 1 thread, step "
        f"{args.step}, depth <= {args.depth}, {nuts['transitions']} transitions; SVI: (time of {steps[1]} steps - "
        f"time of {steps[0]}) / {steps[1] - steps[0]}; ratios: NUTS to the generic path, SVI to the hand-written "
        "flat loop with the same (Monte Carlo KL) estimator at the same thread setting."
    )
    text = "\n".join(lines)
    print(text)
    out = common.results_dir("fast_path", args.out)
    name = "results" if set(args.only) == {"nuts", "svi"} else "_".join(sorted(args.only))
    common.write_result(out / f"{name}.md", text + "\n" + (f"\n{args.note}\n" if args.note else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=10)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--svi-steps", type=int, default=500, help="timed SVI steps (after 50 untimed)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads of the SVI rows")
    parser.add_argument("--only", nargs="+", default=["nuts", "svi"], choices=["nuts", "svi"])
    parser.add_argument(
        "--out",
        default=None,
        help="the folder of results.md (svi.md with --only svi); default benchmarks/results/fast_path/",
    )
    parser.add_argument("--note", default="", help="a line written under the table (e.g. the machine's load)")
    main(parser.parse_args())
