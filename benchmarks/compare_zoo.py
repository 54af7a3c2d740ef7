"""``bp.compare`` on every method for a zoo regression entry and a zoo classification entry: time per method
(fit, and scoring + diagnostics) and in total, with the table it produced.

Each entry is compared exactly as ``bnn-pyro compare ENTRY`` does: every method that applies to its model, at
the entry's settings for the methods its card sets (``fit_defaults``) and the method's defaults otherwise, on the
entry's test split, one seed. ``--time-limit`` stops a fit that runs longer (it becomes an error row). Wall times
on a shared machine drift with the load, so beside the seconds each method's fit time is given as a ratio to
the MAP-like baseline measured in the same run (SWA's fit: one network trained), and the comparison's own
overhead (total minus the fits) as a fraction of the total.

Usage::

    python benchmarks/compare_zoo.py                  # both entries, full settings (benchmarks/results/compare_zoo/)
    python benchmarks/compare_zoo.py --entries mlp_regression --methods svi,laplace --quick   # smoke test

writes ``<entry>.md`` (the run's provenance, timings, then the table) and the figures ``<entry>_*.png``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro import zoo
from bnn_pyro.comparison import markdown, sources

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
from _common import results_dir, write_result  # noqa: E402

BASELINE = "swa"
QUICK = {"num_steps": 50, "num_samples": 20}  # --quick: options that exist are shrunk to these


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_entry(
    name: str, methods: list[str] | None, *, time_limit: float | None, quick: bool
) -> tuple[bp.Comparison, str]:
    source = sources.from_zoo(name, methods, zoo.load)
    options = source.options
    if quick:
        chosen = methods or [m.value for m in bp.infer.Method]
        for m in chosen:
            known = bp.infer.options(m)
            options[m] = {**options.get(m, {}), **{k: v for k, v in QUICK.items() if k in known}}
    load = os.getloadavg()
    result = bp.compare(
        source.model,
        source.x,
        source.y,
        test=source.test,
        methods=methods,
        options=options,
        time_limit=time_limit,
        progress=True,
    )
    return result, f"load average before: {load[0]:.1f} (1 min), after: {os.getloadavg()[0]:.1f}"


COMMIT = _commit()  # read at start: the code that runs, even if the tree moves on during a long run


def report(name: str, result: bp.Comparison, load: str, time_limit: float | None) -> str:
    t = result.table
    fits = t["fit_s"].fillna(0).sum()
    base = t.loc[BASELINE, "fit_s"] if BASELINE in t.index else float("nan")
    timing = pd.DataFrame(
        {
            "fit_s": t["fit_s"],
            "score_s": t["score_s"],
            "fit / swa fit": t["fit_s"] / base,
            "error": t["error"].str.slice(0, 80),
        }
    )
    head = [
        f"# bp.compare on the zoo entry {name}",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, git {COMMIT}, "
        f"{platform.machine()} ({os.cpu_count()} cores shared with other jobs; {load}), torch {torch.__version__}, "
        "bp.fit's default of one torch thread per fit.",
        f"Every method that applies, at the entry's settings where its card sets them, else the method's "
        f"defaults; the entry's test split; seed 0; time limit per fit: {time_limit or 'none'} s.",
        "",
        f"Total wall time of bp.compare: {result.total_s:.0f} s, of which fits {fits:.0f} s; the rest "
        f"(scoring on all draws, function-space diagnostics, PSIS) {result.total_s - fits:.0f} s "
        f"({(result.total_s - fits) / result.total_s:.0%}).",
        "",
        "## Time per method",
        "",
        markdown(timing.round(3)),
        "## The table",
        "",
        markdown(t.drop(columns="warnings")),
        "## Health warnings",
        "",
    ]
    warned = [f"- **{m}**: {w}" for m, w in t["warnings"].items() if w]
    return "\n".join(head + (warned or ["none"])) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", default="mlp_regression,mlp_classifier")
    parser.add_argument("--methods", default=None, help="comma-separated (default: every method that applies)")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per fit (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny budgets: a smoke test, not a measurement")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/compare_zoo/)")
    args = parser.parse_args(argv)
    out = results_dir("compare_zoo", args.out)
    methods = None if args.methods is None else args.methods.split(",")
    for name in args.entries.split(","):
        result, load = run_entry(name, methods, time_limit=args.time_limit, quick=args.quick)
        write_result(out / f"{name}.md", report(name, result, load, args.time_limit))
        import matplotlib.pyplot as plt

        for figure, fig in result.plot().items():
            fig.savefig(out / f"{name}_{figure}.png", dpi=90, bbox_inches="tight")
            plt.close(fig)
        print(f"wrote {out / f'{name}.md'}", flush=True)


if __name__ == "__main__":
    main()
