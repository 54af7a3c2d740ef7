"""Issue 26's joint target over many splits: the per-split verdicts of ``benchmarks/classification.py`` pooled
per engine and data set.

Reads the per-split rows that ``classification.py`` writes (``<set>_splits.csv``, under the result folder's
prefixes: ``<prefix>_<set>_splits.csv``), scores each split with its :func:`classification.verdicts` (noise AUROC
by MI, by entropy without MI, >= 0.8; accuracy and NLL within 0.03 of logistic regression on that split) and, per
engine and set, reports over the splits with a logistic-regression row:

- ``met``: the number of splits meeting the joint target; ``miss_auroc`` / ``miss_fit``: those missing its AUROC
  half / its accuracy-and-NLL half (a split can miss both);
- ``auroc``, ``nll_gap``, ``accuracy_gap``: means over splits with their standard errors from the split-to-split
  spread (``sd / sqrt(n)``, ddof 1: the splits are the replicates, test rows and fit seed both redrawn);
- ``auroc_z = (mean AUROC - 0.8) / its se`` and ``nll_z = (mean NLL gap - 0.03) / its se``: how far the engine's
  average is from each half's threshold, in those standard errors; ``nll_gap_median``: the NLL gap's median over
  splits (one fit whose NLL diverged moves the mean, not the median);
- ``z_splits``: each split's distance to 0.8 in its own Hanley-McNeil se (``classification.verdicts``'s ``z``), and
  ``near``: how many of them are within 2;
- where splits also have a NUTS row (``classification.REFERENCE_POSTERIOR``, the exact posterior): ``met_ref``, the
  splits meeting the same target with NUTS in logistic regression's place, out of ``splits_ref``, and
  ``nll_gap_ref`` / ``nll_gap_ref_se``, the NLL gap to NUTS paired by split, its mean and standard error over those
  splits (the per-split table shows each split's gap and verdict against it).

A (split, engine) row found in more than one file is kept once where the files agree on every score (the wall
time aside: logistic regression's row, refitted in each run, is the same result), and is an error where they
differ: which of two results to keep is not this script's choice.

Usage::

    python benchmarks/classification_splits.py --sets iris,wine --prefixes noiserows,splits10 \\
        --methods ensemble,swag,snapshot,svi,sghmc --name splits10_summary

writes ``<name>.csv`` (one row per set and engine) and ``<name>.md`` (its run header, the table and the per-split
verdicts) to ``--out`` (default ``benchmarks/results/classification/``), reading from ``--folder`` (the same by
default).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.classification_splits
    from classification import METRICS, REFERENCE_POSTERIOR, TARGET_AUROC, TARGET_GAP, verdicts
    from uci import summarize
except ImportError:  # pragma: no cover
    from benchmarks.classification import METRICS, REFERENCE_POSTERIOR, TARGET_AUROC, TARGET_GAP, verdicts
    from benchmarks.uci import summarize
from _common import results_dir, write_result  # noqa: E402 - classification put benchmarks/ on sys.path

KEYS = ["split", "method"]
SCORED = [m for m in METRICS if m != "time_s"]
"""The columns that make two rows of one (split, engine) the same result: every score but the fit's wall time."""


def read_rows(folder: Path, prefixes: list[str], name: str, methods: list[str]) -> pd.DataFrame:
    """The per-split rows of set ``name`` from ``<folder>/<prefix>_<name>_splits.csv`` for every prefix, kept for
    ``methods`` and logistic regression (the reference); a (split, engine) found twice is an error, not a choice."""
    frames = []
    for prefix in prefixes:
        path = folder / f"{prefix}_{name}_splits.csv"
        if not path.exists():
            raise SystemExit(f"--prefixes: {path} does not exist; expected a classification.py per-split file there.")
        frames.append(pd.read_csv(path).assign(source=path.name))
    rows = pd.concat(frames, ignore_index=True)
    rows = rows[rows["method"].isin(["logreg", *methods])]
    scores = [m for m in SCORED if m in rows]
    rows = rows.drop_duplicates(KEYS + scores)  # the same result in two files (a rerun's logreg row) is one row
    twice = rows[rows.duplicated(KEYS, keep=False)]
    if len(twice):
        found = ", ".join(sorted({f"{r.method} split {r.split} ({r.source})" for r in twice.itertuples()}))
        raise SystemExit(
            f"--prefixes: rows with different results found in more than one file: {found}; "
            "pass files that do not overlap."
        )
    return rows.sort_values(KEYS, kind="stable").reset_index(drop=True)


def aggregate(table: pd.DataFrame) -> pd.DataFrame:
    """Per engine of a :func:`classification.verdicts` table: the counts, means, standard errors and distances
    described in this module's docstring (the means and se by ``uci.summarize``, the benchmarks' one rule)."""
    stats = summarize(table.assign(error=""), ["auroc", "nll_gap", "accuracy_gap"]).set_index("method")
    out = []
    for method, g in table.groupby("method", sort=False):
        s = stats.loc[method]
        fits = (g["accuracy_gap"] >= -TARGET_GAP) & (g["nll_gap"] <= TARGET_GAP)
        out.append(
            dict(
                method=method,
                splits=len(g),
                met=int(g["met"].sum()),
                miss_auroc=int((g["auroc"] < TARGET_AUROC).sum()),
                miss_fit=int((~fits).sum()),
                auroc=s["auroc"],
                auroc_se=s["auroc_se"],
                auroc_z=_z(s["auroc"] - TARGET_AUROC, s["auroc_se"]),
                nll_gap=s["nll_gap"],
                nll_gap_se=s["nll_gap_se"],
                nll_z=_z(s["nll_gap"] - TARGET_GAP, s["nll_gap_se"]),
                nll_gap_median=g["nll_gap"].median(),
                accuracy_gap=s["accuracy_gap"],
                accuracy_gap_se=s["accuracy_gap_se"],
                near=int((g["z"].abs() < 2).sum()),
                z_splits=" ".join(f"{z:+.1f}" for z in g["z"]),
                splits_used=" ".join(str(int(k)) for k in g["split"]),
                **_against_reference(g),
            )
        )
    return pd.DataFrame(out)


def _against_reference(g: pd.DataFrame) -> dict:
    """``met_ref`` / ``splits_ref`` / ``nll_gap_ref`` of one engine's verdicts: over its splits with a NUTS row."""
    judged = g[g["nll_gap_ref"].notna()] if "nll_gap_ref" in g else g.iloc[:0]
    gaps = judged["nll_gap_ref"] if len(judged) else pd.Series(dtype=float)
    return dict(
        met_ref=int(judged["met_ref"].sum()) if len(judged) else 0,
        splits_ref=len(judged),
        nll_gap_ref=gaps.mean() if len(gaps) else math.nan,
        nll_gap_ref_se=gaps.std(ddof=1) / math.sqrt(len(gaps)) if len(gaps) > 1 else math.nan,
    )


def _z(distance: float, se: float) -> float:
    return distance / se if se > 0 else math.nan


def z_cell(z: float, mean: float, se: float, fmt: str) -> str:
    """A distance in se for the Markdown table: ``z`` with its sign, or why there is none: ``se 0`` when every split
    gave the same value (``mean``, written with ``fmt``; e.g. SWA's MI AUROC, exactly 0.5 on every split), ``one
    split: no se`` when a single split leaves no spread (its se, ddof 1, is NaN)."""
    if math.isfinite(z):
        return f"{z:+.1f}"
    if se == 0:
        return f"se 0: every split {mean:{fmt}}"
    return "one split: no se"


def markdown(summary: pd.DataFrame, per_split: pd.DataFrame, notes: list[str]) -> str:
    """The summary (one row per set and engine) and the per-split verdicts as Markdown."""
    lines = [
        "# Issue 26's joint target over splits",
        "",
        *notes,
        "",
        "| set | engine | met | miss AUROC / fit | noise AUROC (MI) ± se | (AUROC − 0.8) / se | NLL − logreg ± se "
        "| (gap − 0.03) / se | NLL gap, median | accuracy − logreg ± se | per-split z (Hanley-McNeil) | |z| < 2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in summary.iterrows():
        lines.append(
            f"| {r['dataset']} | {r['method']} | {r['met']}/{r['splits']} | {r['miss_auroc']} / {r['miss_fit']} | "
            f"{r['auroc']:.3f} ± {r['auroc_se']:.3f} | {z_cell(r['auroc_z'], r['auroc'], r['auroc_se'], '.3f')} | "
            f"{r['nll_gap']:+.3f} ± {r['nll_gap_se']:.3f} | {z_cell(r['nll_z'], r['nll_gap'], r['nll_gap_se'], '+.3f')} | "
            f"{r['nll_gap_median']:+.3f} | {r['accuracy_gap']:+.3f} ± {r['accuracy_gap_se']:.3f} | {r['z_splits']} "
            f"| {r['near']} |"
        )
    ref = REFERENCE_POSTERIOR
    judged = summary[summary["splits_ref"] > 0] if "splits_ref" in summary else summary.iloc[:0]
    if len(judged):
        lines += [
            "",
            f"Against {ref} (the exact posterior of the same model), on the splits with a {ref} row:",
            "",
            f"| set | engine | met against {ref} | NLL − {ref}, mean ± se (paired by split) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['dataset']} | {r['method']} | {r['met_ref']}/{r['splits_ref']} | {r['nll_gap_ref']:+.3f}"
            + (f" ± {r['nll_gap_ref_se']:.3f} |" if math.isfinite(r["nll_gap_ref_se"]) else " (one split: no se) |")
            for _, r in judged.iterrows()
        ]
    with_ref = len(judged) > 0
    extra = f" NLL − {ref} | verdict against {ref} |" if with_ref else ""
    lines += [
        "",
        "## Per split",
        "",
        "| set | split | engine | accuracy − logreg | NLL − logreg | noise AUROC ± se | z | verdict | file |" + extra,
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if with_ref else ""),
    ]
    for _, r in per_split.iterrows():
        cells = ""
        if with_ref:
            gap = r.get("nll_gap_ref", math.nan)
            cells = " - | - |" if not math.isfinite(gap) else f" {gap:+.3f} | {'✓' if r['met_ref'] else '✗'} |"
        lines.append(
            f"| {r['dataset']} | {r['split']} | {r['method']} | {r['accuracy_gap']:+.3f} | {r['nll_gap']:+.3f} | "
            f"{r['auroc']:.3f} ± {r['se']:.3f} | {r['z']:+.1f} | {'✓' if r['met'] else '✗'} | {r['source']} |" + cells
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", required=True, help="comma list of data sets, e.g. iris,wine")
    parser.add_argument("--prefixes", required=True, help="comma list: <folder>/<prefix>_<set>_splits.csv is read")
    parser.add_argument("--methods", required=True, help="comma list of engines (logistic regression is the reference)")
    parser.add_argument("--name", default="splits_summary", help="the files written: <name>.csv and <name>.md")
    parser.add_argument("--folder", default=None, help="where the per-split files are (default: --out's default)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/classification/)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m != "logreg"]
    if not methods:
        raise SystemExit("--methods: expected at least one engine besides logreg, e.g. ensemble,svi.")
    prefixes = args.prefixes.split(",")
    folder = Path(args.folder) if args.folder else results_dir("classification")
    summaries, tables = [], []
    for name in args.sets.split(","):
        rows = read_rows(folder, prefixes, name, methods)
        table = verdicts(rows).merge(rows[KEYS + ["source"]], on=KEYS)
        if table.empty:
            raise SystemExit(f"--sets: no split of {name} has both a logreg row and an engine row to compare.")
        tables.append(table.assign(dataset=name))
        summaries.append(aggregate(table).assign(dataset=name))
    summary = pd.concat(summaries, ignore_index=True)
    per_split = pd.concat(tables, ignore_index=True)
    out = results_dir("classification", args.out)
    summary.to_csv(out / f"{args.name}.csv", index=False)
    notes = [
        f"Per-split rows of {', '.join(args.sets.split(','))} from `{'`, `'.join(f'{p}_<set>_splits.csv' for p in prefixes)}` "
        "(benchmarks/classification.py at the engines' defaults); the verdicts are `classification.verdicts`'s; means "
        "and se over splits (sd / sqrt(n), ddof 1); the method: benchmarks/classification_splits.py's docstring.",
        f"Miss AUROC: splits with the noise AUROC below {TARGET_AUROC}; miss fit: accuracy more than {TARGET_GAP} "
        f"below or NLL more than {TARGET_GAP} above logistic regression's (a split can miss both).",
    ]
    write_result(out / f"{args.name}.md", markdown(summary, per_split, notes))
    return summary


if __name__ == "__main__":
    main()
