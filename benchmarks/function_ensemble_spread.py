"""The deep ensemble's spread on the plain Pyro-function references of ``tests/reference`` (exact means and sds), per
parameter, with enough members to read an sd: the default scheme (anchors and observation weights, the weighted
likelihood bootstrap), anchors only (``bootstrap=False``, the scheme before) and weights only (``anchored=False``).

With ``M`` members an sd is known to a relative sd of about ``1 / sqrt(2 (M - 1))`` (0.13 at 30); the default 5
members (0.35) cannot tell a ratio of 0.7 from 1, which ``benchmarks/reference_suite.py`` runs at.

Run from the repository root: ``python benchmarks/function_ensemble_spread.py [--members 30] [--only kidiq]``.
Writes ``benchmarks/results/reference_suite/<name>.md`` and ``.csv`` (``--name``, default
``function_ensemble_spread_members``). One torch thread per fit.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL, judge  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

VARIANTS = {
    "anchors + weights (default)": {},
    "anchors only (bootstrap=False)": {"bootstrap": False},
    "weights only (anchored=False)": {"anchored": False},
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=30, help="num_chains of every fit (default 30)")
    parser.add_argument("--only", default=None, help="comma-separated references (default: all three)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="function_ensemble_spread_members")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = list(ALL) if args.only is None else args.only.split(",")
    folder = results_dir("reference_suite", args.out)
    rows = []
    for name in names:
        ref = ALL[name]()
        for variant, options in VARIANTS.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DiagnosticWarning)
                start = time.perf_counter()
                post = bp.fit(
                    ref.model,
                    ref.x,
                    ref.y,
                    method="ensemble",
                    num_chains=args.members,
                    seed=0,
                    progress=False,
                    **options,
                )
                seconds = time.perf_counter() - start
            said = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
            narrow = any("too narrow" in m for m in said)
            j = judge(ref, post)
            for p, z, r in zip(ref.names, j["z"], j["ratio"]):
                rows.append(
                    dict(
                        reference=name,
                        variant=variant,
                        members=args.members,
                        parameter=p,
                        z=z,
                        sd_ratio=r,
                        too_narrow_warned=narrow,
                        fit_s=seconds,
                    )
                )
            print(
                name,
                variant,
                f"{seconds:.0f}s",
                "max|z|",
                np.abs(j["z"]).max().round(2),
                "ratio",
                j["ratio"].round(2),
                flush=True,
            )
            _write(rows, folder, args.name, args.members)


def _write(rows, folder: Path, name: str, members: int) -> None:
    table = pd.DataFrame(rows).round(3)
    table.to_csv(folder / f"{name}.csv", index=False)
    summary = (
        table.groupby(["reference", "variant"], sort=False)
        .agg(
            max_abs_z=("z", lambda z: z.abs().max()),
            sd_ratio_min=("sd_ratio", "min"),
            sd_ratio_max=("sd_ratio", "max"),
            too_narrow_warned=("too_narrow_warned", "first"),
            fit_s=("fit_s", "first"),
        )
        .reset_index()
    )
    write_result(
        folder / f"{name}.md",
        f"The ensemble with {members} members (`bp.fit(model, x, y, method='ensemble', num_chains={members}, "
        "seed=0)`, the defaults otherwise; one torch thread) on the Pyro-function references, per scheme: `z` = "
        "(members' mean - exact) / exact sd, `sd_ratio` = members' sd / exact sd (relative Monte Carlo sd about "
        f"{1 / np.sqrt(2 * (members - 1)):.2f}); `too_narrow_warned`: `check_narrow` said so at fit time; `fit_s` on "
        "a shared 2-core machine (compare within the table only).\n\n## Summary\n\n"
        + markdown(summary)
        + "\n\n## Per parameter\n\n"
        + markdown(table.drop(columns=["fit_s"])),
    )


if __name__ == "__main__":
    main()
