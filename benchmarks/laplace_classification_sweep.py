"""Laplace's classification settings against issue 26's joint target: ``structure`` x ``prior_precision``.

Each setting is one run of ``benchmarks/classification.py`` (its protocol, scoring and ``verdicts``), e.g.::

    python benchmarks/classification.py --dataset iris,wine,breast_cancer --splits 2 --no-class \\
        --methods logreg,laplace --option laplace:structure=kron --option laplace:prior_precision=marglik --out DIR
    python benchmarks/classification.py --dataset digits --max-rows 600 --splits 2 --no-class ...

``--collect`` copies each run's ``<dataset>.md`` and ``<dataset>_splits.csv`` from ``DIR/<structure>_<prior>/`` into
``benchmarks/results/laplace_classification/`` as ``sweep_<structure>_<prior>_<dataset>...``, and this script
writes ``sweep_summary.md`` / ``.csv`` there: per setting and split, the test NLL minus logistic regression's, the
noise AUROC by mutual information, and whether the joint target is met (AUROC >= 0.8, accuracy and NLL within 0.03
of logistic regression on that split), with the count of splits met.

Usage::

    python benchmarks/laplace_classification_sweep.py --collect /tmp/lapsweep
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

try:
    from classification import verdicts
except ImportError:  # pragma: no cover
    from benchmarks.classification import verdicts
from _common import results_dir, write_result  # noqa: E402 - classification put benchmarks/ on sys.path

STRUCTURES = ("last_layer", "kron", "full")
PRIORS = ("model", "marglik", "marglik_layerwise")
DATASETS = ("iris", "wine", "breast_cancer", "digits")


def collect(source: Path, out: Path) -> pd.DataFrame:
    """Copy the runs found under ``source`` into ``out`` and return every setting's per-split verdicts."""
    tables = []
    for structure in STRUCTURES:
        for prior in PRIORS:
            folder = source / f"{structure}_{prior}"
            for name in DATASETS:
                splits = folder / f"{name}_splits.csv"
                if not splits.exists():
                    continue
                tag = f"sweep_{structure}_{prior}_{name}"
                shutil.copy(splits, out / f"{tag}_splits.csv")
                if (folder / f"{name}.md").exists():
                    shutil.copy(folder / f"{name}.md", out / f"{tag}.md")
                rows = pd.read_csv(splits)
                table = verdicts(rows)
                table.insert(0, "dataset", name)
                table.insert(0, "prior_precision", prior)
                table.insert(0, "structure", structure)
                tables.append(table)
    return pd.concat(tables, ignore_index=True)


def markdown(table: pd.DataFrame) -> str:
    """One row per setting: per data set and split, ``NLL gap; AUROC`` and ✓ / ✗, and the splits met."""
    cols = [(d, int(s)) for d in DATASETS for s in sorted(table.loc[table["dataset"] == d, "split"].unique())]
    head = ["structure", "prior_precision"] + [f"{d} {s}" for d, s in cols] + ["met"]
    lines = [
        "# Laplace's classification settings against issue 26's joint target",
        "",
        "Per split: test NLL minus logistic regression's; noise AUROC by mutual information; ✓ where the joint target "
        "(AUROC >= 0.8, accuracy and NLL within 0.03 of logistic regression) is met. Runs: the "
        "sweep_<structure>_<prior>_<set> files beside this one (benchmarks/classification.py, 2,000 noise rows, "
        "no held-out-class fit; digits: a random 600 rows).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for (structure, prior), group in table.groupby(["structure", "prior_precision"], sort=False):
        cells = [structure, prior]
        for d, s in cols:
            r = group[(group["dataset"] == d) & (group["split"] == s)]
            if r.empty:
                cells.append("-")
                continue
            r = r.iloc[0]
            acc = "" if r["accuracy_gap"] >= -0.03 else f" (acc {r['accuracy_gap']:+.2f})"
            cells.append(f"{r['nll_gap']:+.3f}; {r['auroc']:.2f}{acc} {'✓' if r['met'] else '✗'}")
        cells.append(f"{int(group['met'].sum())}/{len(group)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", required=True, help="the folder holding <structure>_<prior>/ runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = results_dir("laplace_classification", args.out)
    table = collect(Path(args.collect), out)
    table.to_csv(out / "sweep_summary.csv", index=False)
    write_result(out / "sweep_summary.md", markdown(table))
    return table


if __name__ == "__main__":
    main()
