"""Before and after in one run: ``performance.py`` with bnn_pyro at another commit and at this tree, rounds interleaved.

The commit ``--before`` is exported (``git archive``) to a temporary folder; each round runs this tree's
``performance.py`` (the same measuring code and baselines for both sides) once with that export first on
``PYTHONPATH`` (before) and once with this tree's library (after), in that order; ``--rounds`` rounds interleave
the two so that a change in the machine's load touches both sides alike. Every row is reported as the median over
the rounds of each side, beside each other, with after / before, and the median of its ratio to the workload's
baseline measured in the same run (robust to the load moving between runs); the baselines' own after / before shows
how much the load moved.

Usage: ``python benchmarks/before_after.py --before main --rounds 3 --name svi -- --quick --only svi``
(arguments after ``--`` go to ``performance.py``) writes ``NAME.md`` / ``.csv`` (default ``results``) in ``--out``
(default ``benchmarks/results/before_after/``), the Markdown headed by the run's provenance.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _common import markdown, results_dir, thread_note, write_result  # noqa: E402

ROOT = HERE.parent


def export(ref: str, folder: Path) -> str:
    """The library at ``ref`` (a commit, branch or tag) written into ``folder``; returns the full commit id."""
    commit = subprocess.run(
        ["git", "rev-parse", ref], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "bnn_pyro"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return commit


def run_once(side: str, library: Path | None, out: Path, index: int, extra: list[str]) -> pd.DataFrame:
    env = dict(os.environ)
    if library is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(library)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    name = f"{side}_{index}"
    cmd = [sys.executable, str(HERE / "performance.py"), *extra, "--out", str(out), "--name", name]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    table = pd.read_csv(out / f"{name}.csv")
    return table.assign(side=side, round=index)


def main(args, extra: list[str]) -> pd.DataFrame:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "before").mkdir()
        commit = export(args.before, tmp / "before")
        runs = []
        for i in range(args.rounds):
            for side, library in (("before", tmp / "before"), ("after", None)):
                print(f"round {i + 1}/{args.rounds}: {side} ...", flush=True)
                runs.append(run_once(side, library, tmp, i, extra))
    rows = pd.concat(runs)
    keys = ["group", "implementation", "threads"]
    grouped = rows.groupby(keys + ["side"], sort=False)
    wide = grouped.value.median().unstack("side")[["before", "after"]]
    # value / the workload's baseline at its best thread setting IN THE SAME RUN: robust to load between the runs
    ratios = grouped.ratio.median().unstack("side")[["before", "after"]].add_prefix("ratio to baseline, ")
    wide = wide.join(ratios).reset_index()
    wide.insert(5, "after / before", (wide["after"] / wide["before"]).round(3))
    out = results_dir("before_after", args.out)
    rows.to_csv(out / f"{args.name}.csv", index=False)
    header = (
        f"before: bnn_pyro at {commit[:10]} ({args.before}); after: this tree; {args.rounds} rounds interleaved "
        f"(before, after, before, ...); `performance.py {' '.join(extra)}`; medians over rounds; {thread_note()}; "
        f"whole run {time.perf_counter() - started:.0f} s.\n\n" + (f"{args.note}\n\n" if args.note else "")
    )
    write_result(out / f"{args.name}.md", header + markdown(wide.round(4)))
    print(wide.to_string(index=False))
    return wide


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="main", help="the commit to compare with (default main)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--out", default=None, help="the folder written (default benchmarks/results/before_after/)")
    p.add_argument("--name", default="results", help="the result files' name, NAME.md and NAME.csv (default results)")
    p.add_argument("--note", default="", help="a line written under the header (e.g. the machine's load)")
    return p


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    main(parser().parse_args(argv[:split]), argv[split + 1 :])
