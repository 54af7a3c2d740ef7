"""Does an MCMC engine's extra test NLL shrink with more draws? ``benchmarks/classification.py``'s per-split rows of
the same engines run under several settings ("arms", e.g. the defaults and 4x ``num_samples``), set against the
exact posterior's (NUTS) rows on the same splits.

A model average over ``n_eff`` effective draws has a log loss biased upward by about ``v / (2 p^2 n_eff)`` per test
row (the log loss is convex; ``classification.chain_scores``' ``nll_mc_bias`` estimates it from the draws). If an
engine's NLL above NUTS's is that Monte Carlo error, it shrinks as the arms add effective draws, by about the change
in ``nll_mc_bias``; if it is a bias of the engine's draws (a chain that has not reached its stationary
distribution, a wrong target), it does not. Per engine and arm, over the splits that have every arm and a NUTS row:

- ``nll_ref``: NLL minus NUTS's, paired by split, mean and se over splits (sd / sqrt(n), ddof 1);
- ``nll_change``: NLL minus the first arm's (the baseline), paired by split, mean and se; ``bias_change``: the same
  for ``nll_mc_bias``, the change that Monte Carlo error alone predicts;
- means over splits of ``nll_mc_bias``, ``nll_chain_mean - nll`` (with ``C`` chains and a bias of ``b / n_eff``,
  ``(C - 1)`` times the pooled bias: the same question without the delta method), ``nll_chain_se``, the worst
  bulk ESS and R-hat of ``f`` at the training inputs, the noise AUROC by MI and the fit time; ``miss``: splits
  whose NLL is more than 0.03 above logistic regression's (the NLL half of issue 26's target).

Usage::

    python benchmarks/classification_draws.py --set wine --methods metropolis,mala \\
        --arms d=samplers_ess_wine_d_splits.csv,s4=samplers_ess_wine_s4_splits.csv \\
        --reference noiserows_nuts_wine_splits.csv,splits10_nuts_wine_splits.csv --name samplers_ess_wine

writes ``<name>.csv`` and ``<name>.md`` to ``--out`` (default ``benchmarks/results/classification/``), reading the
files from ``--folder`` (the same by default).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.classification_draws
    from classification import REFERENCE_POSTERIOR, TARGET_GAP
except ImportError:  # pragma: no cover
    from benchmarks.classification import REFERENCE_POSTERIOR, TARGET_GAP
from _common import results_dir, write_result  # noqa: E402 - classification put benchmarks/ on sys.path

MEANS = ("nll_mc_bias", "chain_excess", "nll_chain_se", "ess_f_min", "rhat_f_max", "auroc_noise_mi", "time_s")


def _mean_se(values: pd.Series) -> tuple[float, float]:
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan


def compare(arms: dict[str, pd.DataFrame], reference: pd.DataFrame, methods: list[str]) -> tuple[pd.DataFrame, ...]:
    """``(summary, per_split)``: the module docstring's columns per engine and arm, and per split."""
    ref = reference[reference["method"] == REFERENCE_POSTERIOR].set_index("split")["nll"]
    rows = []
    for arm, frame in arms.items():
        logreg = frame[frame["method"] == "logreg"].set_index("split")["nll"]
        for method in methods:
            g = frame[
                (frame["method"] == method) & (frame["error"].isna() | (frame["error"].astype(str) == ""))
            ].set_index("split")
            rows.append(
                g.assign(
                    arm=arm,
                    nll_ref=g["nll"] - ref.reindex(g.index),
                    nll_gap=g["nll"] - logreg.reindex(g.index),
                    chain_excess=g["nll_chain_mean"] - g["nll"],
                ).reset_index()
            )
    per_split = pd.concat(rows, ignore_index=True)
    per_split = per_split[per_split["nll_ref"].notna()]
    counts = per_split.groupby(["method", "split"])["arm"].nunique()
    complete = counts[counts == len(arms)].reset_index()[["method", "split"]]
    per_split = per_split.merge(complete, on=["method", "split"])
    base = per_split[per_split["arm"] == next(iter(arms))].set_index(["method", "split"])
    out = []
    for (method, arm), g in per_split.groupby(["method", "arm"], sort=False):
        b = base.loc[method].reindex(g["split"])
        row = dict(method=method, arm=arm, splits=len(g), miss=int((g["nll_gap"] > TARGET_GAP).sum()))
        for name, values in (
            ("nll_ref", g["nll_ref"]),
            ("nll_change", g["nll"].to_numpy() - b["nll"].to_numpy()),
            ("bias_change", g["nll_mc_bias"].to_numpy() - b["nll_mc_bias"].to_numpy()),
        ):
            row[name], row[f"{name}_se"] = _mean_se(pd.Series(values))
        row.update({m: float(g[m].mean()) for m in MEANS})
        out.append(row)
    return pd.DataFrame(out), per_split.sort_values(["method", "split", "arm"], kind="stable")


def markdown(summary: pd.DataFrame, per_split: pd.DataFrame, notes: list[str]) -> str:
    ref = REFERENCE_POSTERIOR
    lines = [
        "# More draws for an MCMC engine: does its NLL above the exact posterior's shrink?",
        "",
        *notes,
        "",
        f"| engine | arm | splits | NLL − {ref} ± se | NLL − baseline ± se | nll_mc_bias − baseline's ± se "
        "| nll_mc_bias | chain mean − pooled NLL | NLL se over chains | bulk ESS of f (worst) | R-hat of f (worst) "
        "| noise AUROC (MI) | fit s | NLL misses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in summary.iterrows():
        lines.append(
            f"| {r['method']} | {r['arm']} | {r['splits']} | {r['nll_ref']:+.4f} ± {r['nll_ref_se']:.4f} | "
            f"{r['nll_change']:+.4f} ± {r['nll_change_se']:.4f} | {r['bias_change']:+.4f} ± {r['bias_change_se']:.4f} | "
            f"{r['nll_mc_bias']:.4f} | {r['chain_excess']:.4f} | {r['nll_chain_se']:.4f} | {r['ess_f_min']:.1f} | "
            f"{r['rhat_f_max']:.2f} | {r['auroc_noise_mi']:.3f} | {r['time_s']:.1f} | {r['miss']} |"
        )
    lines += [
        "",
        "## Per split",
        "",
        f"| engine | split | arm | NLL | NLL − {ref} | NLL − logreg | nll_mc_bias | chain mean − pooled | NLL se over chains "
        "| bulk ESS of f | R-hat of f | noise AUROC (MI) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in per_split.iterrows():
        lines.append(
            f"| {r['method']} | {r['split']} | {r['arm']} | {r['nll']:.4f} | {r['nll_ref']:+.4f} | {r['nll_gap']:+.4f} | "
            f"{r['nll_mc_bias']:.4f} | {r['chain_excess']:+.4f} | {r['nll_chain_se']:.4f} | {r['ess_f_min']:.0f} | "
            f"{r['rhat_f_max']:.2f} | {r['auroc_noise_mi']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, help="the data set, e.g. wine (for the notes)")
    parser.add_argument("--methods", required=True, help="comma list of engines, e.g. metropolis,mala")
    parser.add_argument("--arms", required=True, help="comma list label=file; the first is the baseline")
    parser.add_argument(
        "--reference", required=True, help=f"comma list of per-split files with {REFERENCE_POSTERIOR} rows"
    )
    parser.add_argument("--name", required=True, help="the files written: <name>.csv and <name>.md")
    parser.add_argument("--note", default="", help="what each arm ran (appended to the notes)")
    parser.add_argument("--folder", default=None, help="where the per-split files are (default: --out's default)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/classification/)")
    args = parser.parse_args(argv)
    folder = Path(args.folder) if args.folder else results_dir("classification")
    files = dict(item.partition("=")[::2] for item in args.arms.split(","))
    for label, name in files.items():
        if not label or not name or not (folder / name).exists():
            raise SystemExit(f"--arms: expected label=file with the file in {folder}, got {label}={name}.")
    arms = {label: pd.read_csv(folder / name) for label, name in files.items()}
    reference = pd.concat([pd.read_csv(folder / name) for name in args.reference.split(",")], ignore_index=True)
    reference = reference[reference["method"] == REFERENCE_POSTERIOR]
    if reference["split"].duplicated().any():
        raise SystemExit(
            f"--reference: a split with more than one {REFERENCE_POSTERIOR} row; pass files that do not overlap."
        )
    summary, per_split = compare(arms, reference, args.methods.split(","))
    if summary.empty:
        raise SystemExit("--arms: no split has every arm and a reference row for these engines.")
    out = results_dir("classification", args.out)
    summary.to_csv(out / f"{args.name}.csv", index=False)
    notes = [
        f"{args.set}: per-split rows of benchmarks/classification.py from {', '.join(f'`{v}` ({k})' for k, v in files.items())}"
        f", against the {REFERENCE_POSTERIOR} rows of `{'`, `'.join(args.reference.split(','))}`, paired by split; the first arm is the baseline; "
        "means and se over splits (sd / sqrt(n), ddof 1); the columns: benchmarks/classification_draws.py's docstring."
        + (f" {args.note}" if args.note else ""),
    ]
    write_result(out / f"{args.name}.md", markdown(summary, per_split, notes))
    return summary


if __name__ == "__main__":
    main()
