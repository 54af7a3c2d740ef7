"""Scaling curves: how the cost of SVI, NUTS and prediction grows with the data, the net and the draws.

One factor varies at a time around a base setting (tanh MLP, input dimension 8, one hidden layer
of 50 units, Normal(0, 1) prior, Gaussian noise 0.1, one torch thread):

- ``svi``: ms per step (mean-field, fast path, Adam; (time of ``long`` steps - time of ``short``) /
  (long - short), so set-up drops out) against N (full batch), width, depth (hidden layers) and
  particles; base N = 1,000.
- ``nuts``: ms per leapfrog step (the fast path's NUTS, tree depth <= 5): two fits with the same
  seed and warm-up that differ only in the number of kept draws, so their first iterations are
  identical; their extra wall time over their extra leapfrog steps. Against N, width and depth;
  base N = 200.
- ``predict``: ms for ``Posterior.predict(x, interval=None)`` against the number of points, width,
  depth and posterior draws; base 10,000 points, 500 draws (``--quick``: 2,000 and 100).

``--device cuda`` puts the model, data and draws on that device (timers read after a synchronize).

Usage: ``python benchmarks/scaling.py [--quick] [--device cuda] [--out DIR] [--name results]`` writes ``NAME.csv``,
``.md`` (headed by the run's provenance) and ``.png`` in ``benchmarks/results/scaling/``
(log-log curves, one row per workload and one column per factor,
with the line of linear growth through each curve's first point).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
# the performance table's MLP and data
from _common import bnn, check_device, markdown, now, regression, results_dir, thread_note, write_result  # noqa: E402

BASE = dict(n=1000, width=50, depth=1, particles=1, draws=500)


def model(width: int, depth: int, device, d: int = 8) -> bp.BNN:
    return bnn(d, width, depth, device=device)


def data(n: int, device, d: int = 8, seed: int = 0):
    return regression(n, d, seed, device=device)


def svi_ms(n, width, depth, particles, quick: bool, device) -> float:
    m, (x, y) = model(width, depth, device), data(n, device)
    short, long = (5, 15) if quick else (10, 60)

    def run(steps):
        start = now(device)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", bp.diagnostics.DiagnosticWarning
            )  # short runs on purpose: costs, not quality
            bp.fit(m, x, y, method="svi", num_steps=steps, num_particles=particles, num_samples=1, progress=False)
        return now(device) - start

    run(2)
    return min(run(long) - run(short) for _ in range(2)) / (long - short) * 1e3


def nuts_ms(n, width, depth, quick: bool, device) -> float:
    m, (x, y) = model(width, depth, device), data(n, device)
    # the extra draws must cost far more than the run-to-run noise of set-up and compilation (~0.1 s)
    warmup, short, long = (30, 5, 65) if quick else (50, 5, 205)

    def run(draws):
        start = now(device)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", bp.diagnostics.DiagnosticWarning
            )  # costs are measured here, not the fit's quality
            post = bp.fit(
                m, x, y, method="nuts", num_warmup=warmup, num_samples=draws, max_tree_depth=5, seed=0, progress=False
            )
        return now(device) - start, int(post.sample_stats["n_steps"].sum())

    run(short)  # untimed: first-call costs
    (t0, s0), (t1, s1) = run(short), run(long)
    return (t1 - t0) / (s1 - s0) * 1e3 if s1 - s0 >= 50 else float("nan")  # too few extra steps to time


def predict_ms(points, width, depth, draws, device) -> float:
    m = model(width, depth, device)
    g = torch.Generator().manual_seed(1)
    samples = {k: (0.3 * torch.randn((1, draws) + s, generator=g)).to(device) for k, s in m.param_shapes.items()}
    post = bp.Posterior(samples=samples, model=m, method="svi")
    x = data(points, device, seed=2)[0]
    post.predict(x[:10], interval=None)
    best = float("inf")
    for _ in range(2):
        start = now(device)
        post.predict(x, interval=None)
        best = min(best, now(device) - start)
    return best * 1e3


def grid(quick: bool) -> dict[str, dict[str, list[int]]]:
    if quick:
        return {
            "svi": {"n": [100, 1000], "width": [16, 64], "depth": [1, 2], "particles": [1, 4]},
            "nuts": {"n": [100, 400], "width": [16, 64], "depth": [1, 2]},
            "predict": {"n": [500, 2000], "width": [16, 64], "depth": [1, 2], "draws": [50, 200]},
        }
    return {
        "svi": {
            "n": [100, 1000, 10_000, 100_000],
            "width": [16, 64, 256, 1024],
            "depth": [1, 2, 4, 8],
            "particles": [1, 2, 8, 32],
        },
        "nuts": {"n": [50, 200, 1000, 5000], "width": [16, 50, 200, 800], "depth": [1, 2, 4]},
        "predict": {
            "n": [1000, 10_000, 100_000],
            "width": [16, 64, 256],
            "depth": [1, 2, 4],
            "draws": [100, 500, 2000],
        },
    }


def main(args) -> pd.DataFrame:
    device = check_device(args.device)
    torch.set_num_threads(1)  # as bp.fit does by default
    rows = []
    for workload, factors in grid(args.quick).items():
        for factor, values in factors.items():
            for value in values:
                s = dict(BASE)
                if workload == "nuts":
                    s["n"] = 200
                if workload == "predict":
                    s.update(n=2_000, draws=100) if args.quick else s.update(n=10_000)
                s[factor] = value
                if workload == "svi":
                    cost, unit = svi_ms(s["n"], s["width"], s["depth"], s["particles"], args.quick, device), "ms/step"
                elif workload == "nuts":
                    cost, unit = nuts_ms(s["n"], s["width"], s["depth"], args.quick, device), "ms/leapfrog"
                else:
                    cost, unit = predict_ms(s["n"], s["width"], s["depth"], s["draws"], device), "ms"
                rows.append(dict(workload=workload, factor=factor, value=value, cost=round(cost, 3), unit=unit))
                print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    out = results_dir("scaling", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    write_result(
        out / f"{args.name}.md",
        f"torch {torch.__version__}, device {device}, 1 thread ({thread_note()}), {'quick' if args.quick else 'full'} "
        "settings; one factor varied at a time (see benchmarks/scaling.py)\n\n"
        + (f"{args.note}\n\n" if args.note else "")
        + markdown(table),
    )
    plot(table, out / f"{args.name}.png")
    return table


def plot(table: pd.DataFrame, path: Path) -> None:
    """One row per workload, one column per factor: cost against the factor (log-log), with the
    line of linear growth through the first point (dotted) for reference."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "n": "data points N",
        "width": "hidden width",
        "depth": "hidden layers",
        "particles": "ELBO particles",
        "draws": "posterior draws",
    }
    workloads = list(dict.fromkeys(table.workload))
    fig, axes = plt.subplots(
        len(workloads), len(labels), figsize=(3.2 * len(labels), 2.6 * len(workloads)), squeeze=False
    )
    for row, workload in zip(axes, workloads):
        for ax, (factor, label) in zip(row, labels.items()):
            part = table[(table.workload == workload) & (table.factor == factor)].sort_values("value")
            if part.empty:
                ax.axis("off")
                continue
            ax.loglog(part.value, part.cost, "o-", color="C0")
            first = part.iloc[0]
            ax.loglog(part.value, first.cost * part.value / first.value, ":", color="grey", label="linear")
            ax.set_xticks(part.value, [f"{v:,}" for v in part.value])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(label)
            ax.set_ylabel(f"{workload}: {first.unit}")
            ax.legend(fontsize=7)
    fig.suptitle("bnn_pyro: cost against one factor at a time (one torch thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings (a smoke run)")
    parser.add_argument("--device", default="cpu", help="torch device of the models and data, e.g. cuda (default cpu)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/scaling/)")
    parser.add_argument("--name", default="results", help="the result files' name (default results)")
    parser.add_argument("--note", default="", help="a line written under the header (e.g. the machine's load)")
    main(parser.parse_args())
