"""Paired before/after comparison of two runs of the public protocols (``uci.py``, ``classification.py``).

Each side is a folder of the per-split CSVs those scripts write (``<dataset>_splits.csv``), the same splits, seeds
and settings, run from two revisions of the library (``PYTHONPATH`` pointing at each tree). Per data set, engine and
metric: the mean and standard error over splits of each side, and the paired difference (after - before) per split
with its mean and standard error. Written for issue 26 item 2 (the held-out refit on the schedule of the run that
chose, against the refit annealed over the chosen steps); any two runs of the same protocol compare the same way.

Usage::

    python benchmarks/refit_ab.py --before RUNS/before/uci --after RUNS/after/uci --metrics test_ll,rmse,coverage_95 \\
        --name refit_schedule_ab --out benchmarks/results/uci
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import markdown, results_dir, write_result  # noqa: E402

KEYS = ["dataset", "method", "split"]


def _mean_se(values: pd.Series) -> tuple[float, float]:
    v = values.dropna()
    if not len(v):
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


def _fmt(mean: float, se: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if math.isfinite(se) else "")


def compare(before: pd.DataFrame, after: pd.DataFrame, metrics: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(paired, table)``: one row per data set, engine and split with both sides' metrics and their
    differences, and one row per data set, engine and metric with the summaries."""
    cols = KEYS + [m for m in metrics if m in before and m in after]
    paired = before[cols].merge(after[cols], on=KEYS, suffixes=("_before", "_after"), validate="one_to_one")
    rows = []
    for (name, method), g in paired.groupby(["dataset", "method"], sort=False):
        g = g.sort_values("split")
        for m in metrics:
            if f"{m}_before" not in g:
                continue
            diff = g[f"{m}_after"] - g[f"{m}_before"]
            paired.loc[g.index, f"{m}_diff"] = diff
            rows.append(
                {
                    "dataset": name,
                    "method": method,
                    "metric": m,
                    "splits": len(g),
                    "before": _fmt(*_mean_se(g[f"{m}_before"])),
                    "after": _fmt(*_mean_se(g[f"{m}_after"])),
                    "after - before": _fmt(*_mean_se(diff)),
                    "per split (after - before)": " / ".join(f"{d:+.3f}" for d in diff),
                    "up / down / same": f"{int((diff > 1e-9).sum())} / {int((diff < -1e-9).sum())} / "
                    f"{int((diff.abs() <= 1e-9).sum())}",
                }
            )
    return paired, pd.DataFrame(rows)


def read_side(folders: str, methods: list[str] | None = None) -> pd.DataFrame:
    """The per-split rows of a comma list of folders; a (data set, engine, split) row of a later folder replaces an
    earlier one's (a side stitched from runs of revisions whose code paths for those engines are the same)."""
    frames = []
    for folder in (Path(f) for f in folders.split(",")):
        found = [pd.read_csv(p) for p in sorted(folder.glob("*_splits.csv"))]
        if not found:
            raise SystemExit(f"{folder}: no *_splits.csv (the per-split files of uci.py / classification.py).")
        frames += found
    out = pd.concat(frames, ignore_index=True).drop_duplicates(KEYS, keep="last")
    if methods:
        out = out[out["method"].isin(methods)]
    folder = folders
    if "error" in out and out["error"].notna().any():
        bad = out[out["error"].notna()][KEYS + ["error"]]
        print(f"{folder}: fits that failed (left out of the comparison):\n{bad.to_string(index=False)}")
        out = out[out["error"].isna()]
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="folder(s), comma list, of the 'before' run's *_splits.csv")
    parser.add_argument("--after", required=True, help="folder(s), comma list: later folders' rows replace earlier")
    parser.add_argument("--methods", default=None, help="comma list of engines to compare (default: all)")
    parser.add_argument("--metrics", required=True, help="comma list of the CSV columns to compare")
    parser.add_argument("--name", default="refit_ab", help="the result files' stem")
    parser.add_argument("--title", default="Before / after, paired by split")
    parser.add_argument("--note", default="", help="a paragraph under the title (what each side ran, the load)")
    parser.add_argument("--out", required=True, help="the folder written (e.g. benchmarks/results/uci)")
    args = parser.parse_args(argv)
    metrics = args.metrics.split(",")
    methods = args.methods.split(",") if args.methods else None
    paired, table = compare(read_side(args.before, methods), read_side(args.after, methods), metrics)
    out = results_dir("refit_ab", args.out)
    paired.to_csv(out / f"{args.name}_splits.csv", index=False)
    text = (
        f"# {args.title}\n\n{args.note}\n\nMean ± standard error over splits of each side, and of the paired "
        f"difference after - before (split by split: the same split, seed and settings). Per split: "
        f"[{args.name}_splits.csv]({args.name}_splits.csv).\n\n" + markdown(table) + "\n"
    )
    write_result(out / f"{args.name}.md", text)
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    main()
