"""The analytic fast path (bnn_pyro/infer/_analytic.py) against the generic one, side by side in one run.

- ``nuts``: ms per leapfrog step of :class:`~bnn_pyro.infer._nuts.FlatNUTS` on a tanh MLP (Normal(0, 1) prior,
  sigma 0.1), one chain, one thread, from the same start at a fixed step size (``--step``, no adaptation) with
  tree depth <= ``--depth``: wall time of ``--transitions`` transitions / leapfrog steps taken. "generic" is the
  path before the analytic one (the potential and gradient recorded by ``make_fx`` and frozen by TorchScript,
  ``_logjoint.flat_potential_and_grad``); "analytic" is ``_analytic.build``. Nets 1-50-1 with N = 200 and
  8-50-50-1 with N = 1,000.
- ``svi``: ms per optimizer step of ``bp.fit(method="svi")`` (mean-field, Adam, lr 1e-2, full batch), 8-50-1,
  N = 1,000, 1 and 8 particles: (time of 50 + ``--svi-steps`` steps - time of 50) / ``--svi-steps``, so set-up and
  drawing cancel. Both bnn_pyro
  paths use Pyro's ``Trace_ELBO`` estimator: ``w = loc + scale * eps`` and the Monte Carlo log density
  ``log p(y, w) - log q(w)`` at the draw. Baselines: a tight hand-written torch loop (plain tensors, one flat
  ``loc``/``log scale`` per layer, autograd, ``torch.optim.Adam(foreach=True)``), with the same sampled estimator
  ("hand, sampled") and with the closed-form KL ("hand, analytic KL", Bayes by Backprop's usual form).

Each figure is the minimum of ``--repeats`` repetitions, interleaved across implementations (the machine may be
shared: minima are the least disturbed); ratios are to the baseline of the same row group, measured in the same run.

Usage: ``python benchmarks/fast_path.py [--quick] [--out benchmarks/results]`` writes ``fast_path.md``.
"""

from __future__ import annotations

import argparse
import math
import time
from contextlib import contextmanager
from pathlib import Path

import pyro
import torch

import bnn_pyro as bp
from bnn_pyro.infer import _analytic, _logjoint
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
    return bp.BNN(torch.nn.Sequential(*layers[:-1]), prior=bp.priors.Normal(0.0, 1.0),
                  likelihood=bp.likelihoods.Gaussian(scale=SIGMA))


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
    kernel = FlatNUTS(quiet_model(model, n), joint, init_strategy=pyro.infer.autoguide.init_to_sample,
                      max_tree_depth=depth)
    torch.manual_seed(1)
    if analytic:
        kernel.setup(0, x, y)
    else:
        with generic_path():
            kernel.setup(0, x, y)
    assert isinstance(kernel._potential, _analytic.StackPotential) == analytic
    kernel._adapter.step_size = step
    kernel.sample(None)  # compiles the generic path's graphs
    steps, start = 0, time.perf_counter()
    for _ in range(transitions):
        kernel.sample(None)
        steps += kernel.stats.n_steps
    return (time.perf_counter() - start) / steps * 1e3


# ---------------------------------------------------------------------- SVI
def svi_fit_ms(widths, n, particles, *, analytic: bool, steps=(50, 550)) -> float:
    x, y = regression(n, widths[0])
    times = []
    for num_steps in steps:
        start = time.perf_counter()
        if analytic:
            bp.fit(mlp(widths), x, y, method="svi", num_steps=num_steps, num_particles=particles, lr=1e-2,
                   num_samples=10, seed=0, progress=False)
        else:
            with generic_path():
                bp.fit(mlp(widths), x, y, method="svi", num_steps=num_steps, num_particles=particles, lr=1e-2,
                       num_samples=10, seed=0, progress=False)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / (steps[1] - steps[0]) * 1e3


def hand_ms(widths, n, particles, *, analytic_kl: bool, steps=(50, 550)) -> float:
    """A tight hand-written mean-field loop: plain tensors, batched over particles by ``baddbmm``, Adam."""
    x, y = regression(n, widths[0])
    shapes = [s for a, b in zip(widths[:-1], widths[1:]) for s in ((b, a), (b,))]
    times = []
    for num_steps in steps:
        torch.manual_seed(0)
        locs = [(0.1 * torch.randn(s)).requires_grad_() for s in shapes]
        log_scales = [torch.full(s, math.log(0.1)).requires_grad_() for s in shapes]
        opt = torch.optim.Adam(locs + log_scales, lr=1e-2, foreach=True)
        yy = y.view(-1, 1)
        start = time.perf_counter()
        for _ in range(num_steps):
            opt.zero_grad(set_to_none=True)
            scales = [s.exp() for s in log_scales]
            eps = [torch.randn((particles,) + loc.shape) for loc in locs]
            ws = [torch.addcmul(loc, scale, e) for loc, scale, e in zip(locs, scales, eps)]
            h = x.expand(particles, n, widths[0])
            for i in range(0, len(ws), 2):
                h = torch.baddbmm(ws[i + 1].unsqueeze(1), h, ws[i].mT)
                if i + 2 < len(ws):
                    h = torch.tanh(h)
            log_lik = -0.5 * ((h - yy) ** 2).sum((1, 2)) / SIGMA ** 2
            if analytic_kl:  # KL(N(loc, scale) || N(0, 1)) in closed form, constants dropped
                penalty = sum((0.5 * (s * s + m * m) - ls).sum() for m, s, ls in zip(locs, scales, log_scales))
                loss = -log_lik.mean() + penalty
            else:  # log q(w) - log p(w) at the draw: the sampled estimator (Pyro's Trace_ELBO)
                penalty = sum((0.5 * w.square() - 0.5 * e.square() - ls).flatten(1).sum(1)
                              for w, e, ls in zip(ws, eps, log_scales))
                loss = (penalty - log_lik).mean()
            loss.backward()
            opt.step()
            loss.detach().item()  # the loss value, as every loop records it
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / (steps[1] - steps[0]) * 1e3


# ---------------------------------------------------------------------- table
def main(args) -> None:
    torch.set_num_threads(1)
    rows = []
    nuts = dict(transitions=3 if args.quick else args.transitions, step=args.step, depth=args.depth)
    for widths, n in (((1, 50, 1), 200), ((8, 50, 50, 1), 1000)):
        runs = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, so that a burst of load hits both
            for analytic in runs:
                runs[analytic].append(nuts_ms_per_leapfrog(widths, n, analytic=analytic, **nuts))
        figures = {k: min(v) for k, v in runs.items()}
        net = "-".join(map(str, widths))
        rows.append(("nuts", f"{net}, N={n}", "generic (before)", figures[False], "ms/leapfrog", 1.0))
        rows.append(("nuts", f"{net}, N={n}", "analytic", figures[True], "ms/leapfrog", figures[True] / figures[False]))
    steps = (5, 25) if args.quick else (50, 50 + args.svi_steps)
    for particles in (1, 8):
        impls = {
            "bnn_pyro, generic (before)": lambda: svi_fit_ms((8, 50, 1), 1000, particles, analytic=False, steps=steps),
            "bnn_pyro, analytic": lambda: svi_fit_ms((8, 50, 1), 1000, particles, analytic=True, steps=steps),
            "hand, sampled": lambda: hand_ms((8, 50, 1), 1000, particles, analytic_kl=False, steps=steps),
            "hand, analytic KL": lambda: hand_ms((8, 50, 1), 1000, particles, analytic_kl=True, steps=steps),
        }
        runs = {name: [] for name in impls}
        for _ in range(args.repeats):
            for name, fn in impls.items():
                runs[name].append(fn())
        figures = {name: min(v) for name, v in runs.items()}
        base = figures["hand, sampled"]
        for name, value in figures.items():
            rows.append(("svi", f"8-50-1, N=1000, {particles} particle(s)", name, value, "ms/step", value / base))
    lines = ["| workload | setting | implementation | value | unit | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {w} | {s} | {i} | {v:.4f} | {u} | {r:.2f} |" for w, s, i, v, u, r in rows]
    lines.append("")
    lines.append(f"torch {torch.__version__}, 1 thread, minimum of {args.repeats} interleaved repeats; NUTS: step "
                 f"{args.step}, depth <= {args.depth}, {nuts['transitions']} transitions; SVI: {steps[1] - steps[0]} "
                 "timed steps; ratios: NUTS to the generic path, SVI to 'hand, sampled'.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fast_path.md").write_text(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=10)
    parser.add_argument("--step", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--svi-steps", type=int, default=500, help="timed SVI steps (after 50 untimed)")
    parser.add_argument("--out", default=None)
    main(parser.parse_args())
