"""Laplace curvature speed side by side with laplace-torch: the same net, data, likelihood, noise and prior precision.

What is timed is what laplace-torch's ``Laplace(...).fit(loader)`` followed by ``.posterior_precision`` does: the
loss, the curvature of the likelihood (GGN) over the data and the posterior precision ``H + delta I``
(eigendecomposed Kronecker factors for ``kron``, as laplace-torch's ``KronDecomposed``). bnn_pyro's side is the
Laplace fit's own curvature step (:func:`bnn_pyro.infer.laplace.curvature.terms`: value, gradient and GGN of the
likelihood plus the prior's exact Hessian) at the same weights; constructors (bnn_pyro's ``Potential`` tracing,
laplace-torch's ``Laplace(...)``) are outside the timing on both sides, and neither side searches a MAP here.

Cases (``--quick``: N = 200 and narrower nets, for a smoke run):

- ``regression``: a 30-200-200-1 tanh MLP (46,601 weights), N = 2,000, Gaussian likelihood (sigma 0.5), prior
  precision 1: ``last_layer``, ``diag``, ``kron``; ``full`` on a 30-40-1 net (1,281 weights);
- ``classification``: the same with 10 classes (48,410 weights; ``full`` on 30-40-10, 1,650 weights), Categorical.

The weights are those after 100 full-batch Adam steps from torch's initialization (seed 0), data from a random
teacher net. Each timing is the minimum of ``--reps`` runs (default 3) after one untimed run: the machine may be
shared, and the minimum is the least disturbed run (a first run over 60 s is the only one: its time is reported).
Within a repetition the sides take turns (bnn_pyro, laplace-torch, laplace-torch BackPACK), so that a change in the
machine's load falls on both sides alike.
Both sides run at 1 thread and at torch's default thread count (``--threads``). laplace-torch runs at its default
backend (Curvlinops in 0.3) with a data loader of ``--peer-batch`` rows; for ``diag`` also with its BackPACK
backend (exact diagonal GGN by backpropagation), the fastest diagonal it offers; bnn_pyro chunks the data itself.
``--general`` also times bnn_pyro's general path (``vmap(jacrev)`` per-example Jacobians, what every net that is
not a Linear/Conv2d stack gets; one run).

Same answer: ``max |P_ours - P_peer| / max |P_peer|`` over the dense or diagonal posterior precision; for ``kron``
(laplace-torch keeps separate weight and bias blocks, bnn_pyro one block per layer), ``P v`` for random ``v`` on
each layer's weights and on its biases, compared on the same coordinates (relative norm, worst block). Both sides
work in float32, so the two answers differ by their rounding: the table also gives each side's difference from
bnn_pyro's answer on a float64 copy of the net and data (the same measure), the exact answer to ~1e-12.

Usage::

    python benchmarks/laplace_speed.py [--quick] [--general] [--out DIR] [--name results]

writes ``NAME.md`` (headed by the run's provenance) and ``NAME.csv`` in ``benchmarks/results/laplace_speed/``. It
needs laplace-torch (the ``bench`` extra; install it with ``pip install --no-deps laplace-torch`` and its light
dependencies one by one, so that pip cannot replace torch).
"""

from __future__ import annotations

import argparse
import copy
import csv
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from unittest import mock

import torch
from torch.utils.data import DataLoader, TensorDataset

import bnn_pyro as bp
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import curvature
from bnn_pyro.infer.laplace.fit import make_settings
from bnn_pyro.infer.laplace.ggn import ggn
from bnn_pyro.infer.laplace.kron import Kron

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
from _common import results_dir, write_result  # noqa: E402

from bnn_pyro.infer.laplace.priors import potentials
from bnn_pyro.infer.laplace.structure import make_layout

SIGMA, DELTA, INPUTS = 0.5, 1.0, 30


def make_case(task: str, quick: bool, full: bool):
    """Net (trained 100 Adam steps), x, y for a task; ``full``: the small net of the ``full`` structure."""
    n, width = (200, 50) if quick else (2000, 200)
    out = 10 if task == "classification" else 1
    torch.manual_seed(0)
    x = torch.randn(n, INPUTS)
    teacher = torch.nn.Sequential(torch.nn.Linear(INPUTS, 20), torch.nn.Tanh(), torch.nn.Linear(20, out))
    with torch.no_grad():
        t = teacher(x)
    y = t.argmax(-1) if task == "classification" else (t[:, 0] + SIGMA * torch.randn(n))
    hidden = [40] if full else [width, width]
    layers, fan_in = [], INPUTS
    for h in hidden:
        layers += [torch.nn.Linear(fan_in, h), torch.nn.Tanh()]
        fan_in = h
    net = torch.nn.Sequential(*layers, torch.nn.Linear(fan_in, out))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss() if task == "classification" else torch.nn.MSELoss()
    for _ in range(100):
        opt.zero_grad()
        loss_fn(net(x), y if task == "classification" else y[:, None]).backward()
        opt.step()
    return net, x, y


def ours(net, x, y, task: str, structure: str, general: bool = False):
    """A callable that computes bnn_pyro's posterior precision (``general``: on the vmap(jacrev) path)."""
    lik = bp.likelihoods.Categorical() if task == "classification" else bp.likelihoods.Gaussian(scale=SIGMA)
    model = bp.BNN(copy.deepcopy(net), prior=bp.priors.Normal(0.0, DELTA**-0.5), likelihood=lik)
    data = Data(x=x, y=y)
    pot = Potential(model, data, init="net")
    z = pot.flatten(pot.init)
    settings = make_settings(model, data, structure=structure, init="net")
    layout = make_layout(model, pot, settings.structure)
    pots = potentials(model, data, pot, z, None, None)

    def run():
        with mock.patch.object(curvature, "ggn", partial(ggn, layerwise_path=False)) if general else nullcontext():
            lik_terms, prior_terms = curvature.terms(model, pots, z, data, layout, settings)
        precision = lik_terms.hess + prior_terms.hess
        if isinstance(precision, Kron):
            precision.eigenvalues()  # the factors' eigendecompositions, as laplace-torch's KronDecomposed
        return precision

    return run


def peer(net, x, y, task: str, structure: str, batch: int, backend: str | None = None):
    """A callable that computes laplace-torch's posterior precision (its ``fit`` and ``posterior_precision``)."""
    from laplace import Laplace

    loader = DataLoader(TensorDataset(x, y if task == "classification" else y[:, None]), batch_size=batch)
    subset = "last_layer" if structure == "last_layer" else "all"
    shape = "full" if structure in ("last_layer", "full") else structure
    extra, noise = {}, ({} if task == "classification" else {"sigma_noise": SIGMA})
    if backend == "backpack":
        from laplace.curvature import BackPackGGN

        extra["backend"] = BackPackGGN

    def run():
        la = Laplace(
            copy.deepcopy(net),
            task,
            subset_of_weights=subset,
            hessian_structure=shape,
            prior_precision=DELTA,
            **extra,
            **noise,
        )
        start = time.perf_counter()
        la.fit(loader, progress_bar=False)
        precision = la.posterior_precision
        return precision, time.perf_counter() - start

    return run


def timed(runs: dict, reps: int, slow: float = 60.0) -> tuple[dict, dict]:
    """Results of each side's untimed first run and its minimum seconds over ``reps`` runs, the sides taking turns
    within each repetition so that they share the machine's load alike. ``runs``: name -> (callable, peer side?);
    a peer side returns ``(result, seconds)`` (its own timing, constructor excluded). A side whose first run is
    longer than ``slow`` seconds runs once, and that time is reported."""
    first, best = {}, {}
    for name, (run, peer_side) in runs.items():
        start = time.perf_counter()
        out = run()
        first[name] = out[0] if peer_side else out
        elapsed = out[1] if peer_side else time.perf_counter() - start
        best[name] = elapsed if elapsed > slow else float("inf")
    for _ in range(reps):
        for name, (run, peer_side) in runs.items():
            if best[name] != float("inf") and best[name] > slow:
                continue
            start = time.perf_counter()
            out = run()
            best[name] = min(best[name], out[1] if peer_side else time.perf_counter() - start)
    return first, best


def reference(net, x, y, task: str, structure: str):
    """bnn_pyro's posterior precision on a float64 copy of the net and data (the answer both float32 sides round)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return ours(
            copy.deepcopy(net).double(), x.double(), y if task == "classification" else y.double(), task, structure
        )()
    finally:
        torch.set_default_dtype(old)


def difference(p_ours, p_peer, net, structure: str) -> float:
    """Relative difference of two posterior precisions (module docstring); ``p_peer`` laplace-torch's or, if it is
    bnn_pyro's own (a float64 reference), compared the same way."""
    if structure != "kron":
        a, b = p_ours.double(), p_peer.double()
        return float((a - b).abs().max() / b.abs().max())
    worst, start = 0.0, 0
    gen = torch.Generator().manual_seed(0)
    for p in net.parameters():  # laplace-torch's parameter order: each layer's weight, then its bias
        size = p.numel()
        v = torch.zeros(3, sum(q.numel() for q in net.parameters()), dtype=torch.float64)
        v[:, start : start + size] = torch.randn(3, size, generator=gen, dtype=torch.float64)
        mine = p_ours.matmul(v)[:, start : start + size]
        theirs = (
            p_peer.matmul(v)
            if isinstance(p_peer, Kron)
            else p_peer.bmm(v.float()[:, None, :], exponent=1)[:, 0].double()
        )[:, start : start + size]
        worst = max(worst, float((mine - theirs).norm() / theirs.norm()))
        start += size
    return worst


def main(args) -> list[dict]:
    default_threads = torch.get_num_threads()
    rows = []
    for task in args.tasks:
        for structure in args.structures:
            net, x, y = make_case(task, args.quick, full=structure == "full")
            weights = sum(p.numel() for p in net.parameters())
            batch = min(args.peer_batch, len(x))
            for threads in args.threads:
                torch.set_num_threads(default_threads if threads == "default" else int(threads))
                runs = {
                    "ours": (ours(net, x, y, task, structure), False),
                    "peer": (peer(net, x, y, task, structure, batch), True),
                }
                if structure == "diag":
                    runs["backpack"] = (peer(net, x, y, task, structure, batch, "backpack"), True)
                first, best = timed(runs, args.reps)
                exact = reference(net, x, y, task, structure)
                row = dict(
                    task=task,
                    structure=structure,
                    weights=weights,
                    n=len(x),
                    threads=torch.get_num_threads(),
                    ours_s=best["ours"],
                    peer_s=best["peer"],
                    ratio=best["ours"] / best["peer"],
                    peer_backpack_s=best.get("backpack"),
                    ratio_backpack=best["ours"] / best["backpack"] if "backpack" in best else None,
                    difference=difference(first["ours"], first["peer"], net, structure),
                    ours_error=difference(first["ours"], exact, net, structure),
                    peer_error=difference(exact, first["peer"], net, structure),
                    ours_general_s=None,
                )
                if args.general and structure != "kron":
                    start = time.perf_counter()
                    ours(net, x, y, task, structure, general=True)()
                    row["ours_general_s"] = time.perf_counter() - start
                rows.append(row)
                print({k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def write(rows: list[dict], out: Path, args) -> None:
    """``out.csv`` and ``out.md`` (``out`` without its suffix)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import laplace

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    lines = [
        "# Laplace curvature: bnn_pyro against laplace-torch, side by side",
        "",
        f"`python benchmarks/laplace_speed.py {' '.join(args.argv)}`; torch {torch.__version__}, laplace-torch "
        f"{getattr(laplace, '__version__', '0.3')}, {platform.machine()}, git {commit}. Seconds of curvature + "
        f"posterior precision (laplace-torch: `fit` + `posterior_precision`), minimum of {args.reps} runs after an "
        "untimed one (a first run over 60 s is the only one), the sides taking turns in each repetition; ratio = "
        "bnn_pyro / laplace-torch (default backend; BackPACK for `diag`) in the same run; difference = relative "
        "difference of the two posterior precisions, error = each side's difference from bnn_pyro's float64 answer "
        "(benchmarks/laplace_speed.py's docstring).",
        "",
        "| task | structure | weights | N | threads | bnn_pyro s | laplace-torch s | ratio | laplace-torch BackPACK s "
        "| ratio to BackPACK | bnn_pyro general path s | difference | bnn_pyro error | laplace-torch error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        opt = lambda v, f="{:.3f}": "" if v is None else f.format(v)  # noqa: E731
        lines.append(
            f"| {r['task']} | {r['structure']} | {r['weights']:,} | {r['n']:,} | {r['threads']} | "
            f"{r['ours_s']:.3f} | {r['peer_s']:.3f} | {r['ratio']:.2g}x | {opt(r['peer_backpack_s'])} | "
            f"{opt(r['ratio_backpack'], '{:.2g}x')} | {opt(r['ours_general_s'])} | {r['difference']:.1e} | "
            f"{r['ours_error']:.1e} | {r['peer_error']:.1e} |"
        )
    write_result(out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small nets and N = 200 (a smoke run)")
    parser.add_argument("--tasks", nargs="+", default=["regression", "classification"])
    parser.add_argument("--structures", nargs="+", default=["last_layer", "diag", "kron", "full"])
    parser.add_argument("--threads", nargs="+", default=["1", "default"], help="'1' and/or 'default' or a number")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peer-batch", type=int, default=250, help="rows per batch of laplace-torch's loader")
    parser.add_argument("--general", action="store_true", help="also time bnn_pyro's vmap(jacrev) path (slow)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/laplace_speed/)")
    parser.add_argument("--name", default="results", help="the result files' name, NAME.md and NAME.csv")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = main(args)
    write(result, results_dir("laplace_speed", args.out) / args.name, args)
