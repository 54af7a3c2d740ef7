"""The ``lr_schedule`` default of ensemble and MC dropout, before (``"constant"``) and after (``"cosine"``, the one
default of every optimizing engine; issue 29 item 4), on bundled data, side by side in one run.

Protocol: both variants fit the same splits with the same seeds in one run, so per-split differences are paired.
Regression: ``benchmarks/uci.py``'s protocol (its 1-50-1 ReLU model with a learned noise, standardization, scores in
original units) on scikit-learn's bundled diabetes set. Classification: ``benchmarks/classification.py``'s
(1-50-K ReLU net, its splits) on the bundled wine set. Every other option is the method's default (validation,
early stopping and the refit included). Quality only: fit times are reported for completeness, not as a claim.

Usage::

    python benchmarks/lr_schedule_default.py --splits 3 --out benchmarks/results/lr_schedule_default

writes ``lr_schedule_default.csv`` (one row per dataset, method, split and variant) and ``lr_schedule_default.md``
(per dataset and method: mean ± SE over splits of each variant, and the paired after - before difference);
``--datasets diabetes --methods ensemble --splits 10 --name NAME`` narrows a run and names its files.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import classification  # noqa: E402
import uci  # noqa: E402
from _common import thread_note  # noqa: E402

VARIANTS = {"before: constant": {"lr_schedule": "constant"}, "after: cosine (default)": {}}
METHODS = ("ensemble", "mc_dropout")
METRICS = {"regression": ("test_ll", "rmse", "coverage_95"), "classification": ("nll", "accuracy", "ece")}


def _rows(dataset: str, splits: int, methods: list[str]) -> list[dict]:
    rows = []
    if dataset == "diabetes":
        for split in uci.make_splits(dataset="diabetes", n_splits=splits):
            for method in methods:
                for variant, options in VARIANTS.items():
                    row = uci.run_one(method, split, options)
                    rows.append(dict(dataset=dataset, task="regression", variant=variant, **row))
                    print(rows[-1], flush=True)
    else:
        data = classification.load_dataset(dataset)
        for split in range(splits):
            for method in methods:
                for variant, options in VARIANTS.items():
                    row = classification.run_one(method, data, split, options)
                    rows.append(dict(dataset=dataset, task="classification", variant=variant, **row))
                    print(rows[-1], flush=True)
    return rows


def _cell(values: pd.Series) -> str:
    values = values.astype(float).dropna()
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{values.mean():.4f}" + ("" if math.isnan(se) else f" ± {se:.4f}")


def markdown(rows: pd.DataFrame, header: list[str]) -> str:
    lines = header + [""]
    before, after = VARIANTS
    for (dataset, method), group in rows.groupby(["dataset", "method"], sort=False):
        metrics = METRICS[group["task"].iloc[0]]
        lines += [
            f"## {dataset}, {method}",
            "",
            "| variant | " + " | ".join(metrics) + " | fit s | errors |",
            "|---" * (len(metrics) + 3) + "|",
        ]
        for variant in VARIANTS:
            v = group[group["variant"] == variant]
            errors = int((v["error"].fillna("") != "").sum())
            lines.append(
                f"| {variant} | "
                + " | ".join(_cell(v[m]) for m in metrics)
                + f" | {_cell(v['time_s'] if 'time_s' in v else v.get('fit_s'))} | {errors} |"
            )
        paired = group.pivot(index="split", columns="variant", values=list(metrics))
        lines.append(
            "| after - before (paired) | "
            + " | ".join(_cell(paired[m][after] - paired[m][before]) for m in metrics)
            + " | | |"
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="diabetes,wine")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--name", default="lr_schedule_default", help="file name stem of the results")
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default="benchmarks/results/lr_schedule_default")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    start = time.time()
    rows = pd.DataFrame([r for d in args.datasets.split(",") for r in _rows(d, args.splits, args.methods.split(","))])
    if "time_s" not in rows and "fit_s" in rows:
        rows["time_s"] = rows["fit_s"]
    rows.to_csv(out / f"{args.name}.csv", index=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = [
        "# lr_schedule default: constant (before) vs cosine (after) for ensemble and MC dropout",
        "",
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {commit} (plus the working "
        f"tree); machine {platform.machine()}, {thread_note()}; fits use bp.fit's default num_threads=1; load "
        f"average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; whole run {time.time() - start:.0f} s. "
        f"{args.splits} splits per dataset, both variants on the same splits and seeds (paired). {args.note}",
        "",
        "Higher is better for test LL and accuracy; lower for RMSE, NLL and ECE; 95% coverage is best near 0.95. "
        "Means ± standard errors over splits; the last row of each table is the paired difference.",
    ]
    (out / f"{args.name}.md").write_text(markdown(rows, header))
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
