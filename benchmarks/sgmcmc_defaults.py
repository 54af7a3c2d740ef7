"""Do sgld and sghmc at their defaults (``lr="auto"``) finish on every split of the regression benchmark?

Issue 26 item 6: 3 of 24 sghmc fits at the UCI benchmark's settings stopped with ``FloatingPointError: sghmc
chain 0 diverged``. This runs the benchmark's protocol (:mod:`uci`: its net, prior, learned noise, standardized
splits, ``seed=split``) for the chosen methods on the first ``--splits`` splits of each dataset and records, per
fit, whether it finished, whether it had to recover from a divergence
(``post.config["divergence_recovery"]``), whether the step fell during warm-up (a later curvature estimate or
the stability guard lowered it), the test log-likelihood and the time. Results from old code come from running
this script against an older checkout (the table says which commit).

Usage::

    python benchmarks/sgmcmc_defaults.py --datasets diabetes,friedman1,heteroscedastic --splits 8 --methods sghmc

writes ``results.csv`` and ``results.md`` (headed by the run's provenance) in ``--out`` (default
``benchmarks/results/sgmcmc_defaults/``).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import torch
import uci  # benchmarks/ is the script's folder
from _common import markdown, results_dir, write_result

import bnn_pyro as bp


def one(method: str, split, dataset: str) -> dict:
    row = dict(
        dataset=dataset,
        method=method,
        split=split.split,
        finished=False,
        recoveries=0,
        step_fell_in_warmup=False,
        test_ll=float("nan"),
        time_s=float("nan"),
        error="",
    )
    model = uci.make_model(split.x_train.shape[1], split.split)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            post = bp.fit(model, split.x_train, split.y_train, method=method, seed=split.split, progress=False)
    except Exception as err:  # noqa: BLE001 - a crash is the result being measured
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return row
    row["time_s"] = time.perf_counter() - start
    warm = post.history["step_size"][0, : post.config["num_warmup"]]
    row.update(
        finished=True,
        test_ll=uci.evaluate(post, split)["test_ll"],
        recoveries=sum(len(v) for v in post.config.get("divergence_recovery", {}).values()),
        step_fell_in_warmup=bool((warm[1:] < warm[:-1]).any()),
    )
    return row


def _commit() -> str:
    return (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        or "unknown"
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="diabetes,friedman1,heteroscedastic")
    parser.add_argument("--methods", default="sghmc")
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/sgmcmc_defaults/)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite the .md from the .csv")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    out = results_dir("sgmcmc_defaults", args.out)
    for dataset in [] if args.summary_only else args.datasets.split(","):
        splits = uci.make_splits(dataset=dataset, n_splits=args.splits)
        for method in args.methods.split(","):
            for split in splits:
                rows.append(one(method, split, dataset))
                print(rows[-1], flush=True)
                pd.DataFrame(rows).to_csv(out / "results.csv", index=False)
    table = (
        pd.read_csv(out / "results.csv", dtype={"error": "string"}).fillna({"error": ""})
        if args.summary_only
        else pd.DataFrame(rows)
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (
        f"# sgld / sghmc at their defaults on the regression benchmark's splits\n\n"
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {_commit()}, {platform.machine()} "
        f"{os.cpu_count()} cores, 1 torch thread, load average {load:.1f} at the end (shared machine). "
        f"Protocol of benchmarks/uci.py; `python benchmarks/sgmcmc_defaults.py --datasets {args.datasets} "
        f"--methods {args.methods} --splits {args.splits}`.\n\n"
        f"Finished {int(table.finished.sum())} of {len(table)} fits; recoveries from a divergence: "
        f"{int(table.recoveries.sum())}; fits whose step fell during warm-up (a later estimate or the guard): "
        f"{int(table.step_fell_in_warmup.sum())}.\n\n"
    )
    write_result(out / "results.md", header + markdown(table.round(3)) + "\n")
    return table


if __name__ == "__main__":
    main()
