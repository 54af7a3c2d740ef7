"""What the ensemble's free start costs, on the CPU and on an accelerator, side by side in one run.

The deep ensemble's default (``bnn_pyro.infer.anchor.free_directions``) computes, once per set of rows a member fits,
the rows' second moment ``X^T X / N`` in float64 (in chunks of rows) and its eigendecomposition. This times that call
for every ``N`` x ``D`` of ``--rows`` x ``--dims`` on the CPU at one torch thread and at torch's default, and on
``--device`` when one is named (a GPU: float64 there is the slow path of most cards, hence this measurement); ratios
are to the CPU at its default threads, measured in the same run. Inputs: standard normal with a tenth of the columns
set to zero (free directions exist, as on images' constant border pixels); each timing is the fastest of
``--repeats`` after one untimed call.

Then, on ``--device``, one anchored ensemble at its defaults (``num_chains=2``, ``num_steps=50``) on such rows with
a ``Linear(D, 50) - ReLU - Linear(50, 10)`` net checks end to end that the free start runs there: the record in
``config["anchor"]`` and the device of the draws.

Usage: ``python benchmarks/free_directions_speed.py [--device cuda] [--quick] [--out DIR] [--name NAME]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro.infer.anchor import free_directions

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    DEFAULT_THREADS,
    check_device,
    markdown,
    now,
    results_dir,
    thread_settings,
    torch_threads,
    write_result,
)


def rows_with_free_columns(n: int, d: int, device="cpu", seed: int = 0) -> torch.Tensor:
    """``n`` x ``d`` standard normal inputs with every tenth column zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, ::10] = 0.0
    return x.to(device)


def classifier(d: int, device="cpu") -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10)).to(device)
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


def time_call(model, x, device, repeats: int) -> tuple[float, int]:
    """(fastest seconds of ``repeats`` calls, the number of free directions found)."""
    found = free_directions(model, x)  # untimed: first-call costs (CUDA kernels, solver workspaces)
    best = float("inf")
    for _ in range(repeats):
        start = now(device)
        free_directions(model, x)
        best = min(best, now(device) - start)
    return best, found.record["free_directions"]


def timings(rows: list[int], dims: list[int], device: str | None, repeats: int) -> pd.DataFrame:
    out = []
    for n in rows:
        for d in dims:
            settings = [("cpu", n) for n in thread_settings()] + ([(device, DEFAULT_THREADS)] if device else [])
            for where, threads in settings:
                with torch_threads(threads):
                    seconds, free = time_call(classifier(d, where), rows_with_free_columns(n, d, where), where, repeats)
                out.append(dict(rows=n, dims=d, device=where, threads=threads, seconds=seconds, free_directions=free))
    table = pd.DataFrame(out)
    base = table[(table.device == "cpu") & (table.threads == DEFAULT_THREADS)].set_index(["rows", "dims"]).seconds
    table["ratio_to_cpu_default"] = [r.seconds / base[(r.rows, r.dims)] for r in table.itertuples()]
    return table


def end_to_end(device: str, d: int) -> dict:
    x = rows_with_free_columns(400, d, device)
    y = (x[:, 1] > 0).long() + (x[:, 2] > 0).long()
    post = bp.fit(classifier(d, device), x, y, method="ensemble", num_chains=2, num_steps=50, seed=0, progress=False)
    draws = {v.device.type for v in post.samples.values()}
    pred = post.predict(x[:5])
    return dict(
        device=device,
        dims=d,
        anchor=str(post.config.get("anchor")),
        draws_on=",".join(sorted(draws)),
        predict_on=pred.probs.device.type,
        finite=bool(torch.isfinite(pred.probs).all()),
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=check_device, default=None, help="an accelerator to time beside the CPU")
    parser.add_argument("--quick", action="store_true", help="one small size (a smoke run, seconds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/free_directions/)")
    parser.add_argument("--name", default="results")
    parser.add_argument("--note", default="", help="a line written under the header (e.g. the machine's load)")
    args = parser.parse_args(argv)
    rows, dims = ([500], [64]) if args.quick else ([10_000, 50_000], [64, 784, 3072])
    table = timings(rows, dims, args.device, args.repeats)
    checks = pd.DataFrame([end_to_end(args.device or "cpu", dims[0])])
    folder = results_dir("free_directions", args.out)
    table.to_csv(folder / f"{args.name}.csv", index=False)
    text = (args.note + "\n\n" if args.note else "") + (
        "`free_directions` (X^T X / N in float64 and its eigendecomposition), fastest of "
        f"{args.repeats} calls; ratios to the CPU at torch's default threads in this run.\n\n"
        + markdown(table.round(4))
        + "\n\nEnd to end (an anchored ensemble at its defaults, 2 members, 50 steps):\n\n"
        + markdown(checks)
        + "\n"
    )
    write_result(folder / f"{args.name}.md", text)
    print(text)
    return table


if __name__ == "__main__":
    main()
