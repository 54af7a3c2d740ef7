"""The point-fit engines' learned noise on small regression sets: held-out rows (the default) against none.

On data of fewer than 200 rows the default used to hold nothing out (10% of the rows was fewer than
``holdout.MIN_ROWS`` = 20), so a learned Gaussian noise was the MAP's training residual; it now holds out
``MIN_ROWS`` rows (``bnn_pyro/infer/holdout.py``'s ``default_rows``) and refits on all rows with what they
chose. ``validation=None`` is exactly the old default on these sizes (no rows held out, the same code path), so
both are measured in one run on the same splits, fits and seeds.

Protocol: ``benchmarks/uci.py``'s (standardized, random 90/10 splits, ``Linear(D, 50) - ReLU - Linear(50, 1)``,
Normal(0, 1) prior, ``Gaussian(scale=HalfNormal(1))``, metrics in original units), on a random subset of
``--rows`` rows of each data set (seeded by ``--subset-seed``): test log-likelihood per point, RMSE, and the
noise sd of the predictive (its mean aleatoric sd, original units).

Usage::

    python benchmarks/small_data_noise.py                      # friedman1 and diabetes, 100 rows, 3 splits
    python benchmarks/small_data_noise.py --methods laplace --splits 1
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from _common import results_dir, write_result  # noqa: E402 - the script's folder is on sys.path
from uci import load_dataset, make_splits, run_one

VARIANTS = {"held out (new default)": {}, "none held out (old default)": {"validation": None}}


def subset(name: str, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random rows of the built-in data set ``name`` (uci.py's ``load_dataset``)."""
    x, y = load_dataset(name)
    keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:rows]
    return x[keep], y[keep]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="friedman1,diabetes")
    parser.add_argument("--methods", default="laplace,ensemble,swag")
    parser.add_argument("--rows", type=int, default=100, help="rows of each data set (before the 90/10 split)")
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--subset-seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a line added to the Markdown result (e.g. the machine's load)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/uci/)")
    args = parser.parse_args(argv)
    out = results_dir("uci", args.out)
    rows = []
    for name in args.datasets.split(","):
        x, y = subset(name, args.rows, args.subset_seed)
        for split in make_splits(x=x, y=y, n_splits=args.splits):
            for method in args.methods.split(","):
                for variant, options in VARIANTS.items():
                    row = dict(dataset=name, variant=variant, **run_one(method, split, options))
                    rows.append(row)
                    print(
                        f"{name} split {split.split} {method:9s} {variant:28s} "
                        + (
                            row["error"]
                            or f"LL {row['test_ll']:.3f} RMSE {row['rmse']:.3f} noise {row['noise_sd']:.3f}"
                        ),
                        flush=True,
                    )
    table = pd.DataFrame(rows)
    table.to_csv(out / "small_data_noise_splits.csv", index=False)
    cols = ["test_ll", "rmse", "noise_sd", "coverage_95"]
    ok = table[table["error"] == ""]
    summary = ok.groupby(["dataset", "method", "variant"])[cols].agg(["mean", "min", "max"])
    summary.columns = [f"{c}_{a}" for c, a in summary.columns]
    summary = summary.reset_index()
    summary.to_csv(out / "small_data_noise.csv", index=False)
    lines = [
        "| dataset | method | held-out rows | test LL mean [min, max] | RMSE mean [min, max] | noise sd mean [min, max] | coverage 95% |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary.itertuples():
        lines.append(
            f"| {r.dataset} | {r.method} | {r.variant} | {r.test_ll_mean:.3g} [{r.test_ll_min:.3g}, {r.test_ll_max:.3g}] "
            f"| {r.rmse_mean:.3g} [{r.rmse_min:.3g}, {r.rmse_max:.3g}] "
            f"| {r.noise_sd_mean:.3g} [{r.noise_sd_min:.3g}, {r.noise_sd_max:.3g}] | {r.coverage_95_mean:.2f} |"
        )
    errors = table[table["error"] != ""]
    notes = [
        f"Data: {args.datasets}, a random subset of {args.rows} rows each (subset seed {args.subset_seed}), "
        f"{args.splits} random 90/10 splits; methods {args.methods} at their defaults, and with validation=None "
        "(the old default on these sizes). Protocol: benchmarks/small_data_noise.py's docstring. Mean, min and "
        "max over splits, in original units; per-split rows in small_data_noise_splits.csv.",
        f"Errors: {len(errors)}." + (f" {args.note}" if args.note else ""),
    ]
    write_result(
        out / "small_data_noise.md",
        "# Learned noise on small regression sets: held-out rows against none\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n\n".join(notes)
        + "\n",
    )
    return summary


if __name__ == "__main__":
    main()
