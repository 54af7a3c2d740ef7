"""MCMC before and after the engines moved onto typed configs (issue 29): ``bp.fit`` per iteration, in one run.

The commit ``--before`` (default ``a7736d0``, the branch point) is exported by ``git archive``; each side runs in a
child process of its own with ``PYTHONPATH`` set to its ``bnn_pyro`` (before) or this tree (after), the sides
alternating ``--rounds`` times so that a change in the machine's load touches both alike. Workload: ``bp.fit`` of
the 1-50-1 tanh BNN of ``_common`` (N = 200, Normal(0, 1) prior, sigma 0.1), one chain, ``seed=0``, defaults
otherwise (NUTS with ``max_tree_depth=6`` to bound a draw's cost): ms per iteration = (time of ``--long`` iterations
- time of ``--short``) / (long - short), warm-up and draws split evenly, so that set-up (model copy, MAP of
deterministic parameters, kernel construction) cancels; ``setup_s`` is the short fit's whole time. Each figure is
the median over rounds; after / before is the ratio of medians (1.0: unchanged). One torch thread.

Usage: ``python benchmarks/mcmc_contract_ab.py [--before a7736d0] [--rounds 3] [--out DIR] [--note "..."]`` writes
``DIR/mcmc_contract_ab.md`` and ``.csv``.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import alternating, exported, markdown, side_result  # noqa: E402

METHODS = {"nuts": dict(max_tree_depth=6), "hmc": {}, "metropolis": {}}


def child(settings: dict) -> list[dict]:
    """In a child process: the figures of the ``bnn_pyro`` on ``sys.path``."""
    import time
    import warnings

    import torch
    from _common import bnn, regression

    import bnn_pyro as bp

    torch.set_num_threads(1)
    short, long = settings["short"], settings["long"]
    x, y = regression(200, 1)
    rows = []
    for method, extra in METHODS.items():

        def fit(n: int, method=method, extra=extra) -> float:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                bp.fit(
                    bnn(1),
                    x,
                    y,
                    method=method,
                    num_samples=n // 2,
                    num_warmup=n - n // 2,
                    num_chains=1,
                    seed=0,
                    progress=False,
                    **extra,
                )
                return time.perf_counter() - start

        fit(short)  # first fit in the process: imports, compilation and allocator warm-up, not timed
        t_short, t_long = fit(short), fit(long)
        rows.append(
            dict(
                method=method,
                ms_per_iteration=(t_long - t_short) / (long - short) * 1e3,
                setup_s=t_short,
                library=bp.__file__,
            )
        )
    return rows


def main(args) -> pd.DataFrame:
    settings = dict(short=args.short, long=args.long)
    with exported(args.before) as before:
        sides = {"before": before, "after": ROOT}
        runs = alternating(sides, args.rounds, lambda tree: side_result(tree, "mcmc_contract_ab", "child", settings))
    rows = []
    for side, rounds in runs.items():
        for r, result in enumerate(rounds):
            for row in result:
                assert row.pop("library").startswith(str(sides[side])), (side, sides[side])
                rows.append(dict(row, side=side, round=r))
    raw = pd.DataFrame(rows)
    med = raw.groupby(["method", "side"])[["ms_per_iteration", "setup_s"]].median().unstack("side")
    table = pd.DataFrame(
        {
            "before ms/iter": med[("ms_per_iteration", "before")],
            "after ms/iter": med[("ms_per_iteration", "after")],
            "after / before": med[("ms_per_iteration", "after")] / med[("ms_per_iteration", "before")],
            "before setup s": med[("setup_s", "before")],
            "after setup s": med[("setup_s", "after")],
        }
    ).reset_index()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw.to_csv(out / "mcmc_contract_ab.csv", index=False)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    header = (
        f"# MCMC before ({args.before}) and after the typed-config contract\n\n"
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {commit} (after) vs "
        f"{args.before} (before); machine {platform.machine()} {os.cpu_count()} cores, {platform.python_version()}; "
        f"one torch thread per side; load average at the end {os.getloadavg()[0]:.1f}; {args.rounds} rounds, "
        f"{args.short} vs {args.long} iterations differenced. {args.note}\n\n"
    )
    (out / "mcmc_contract_ab.md").write_text(header + markdown(table.round(3)) + "\n")
    print(header + markdown(table.round(3)))
    return table


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="a7736d0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--long", type=int, default=120)
    p.add_argument("--out", default=str(HERE / "results" / "mcmc_contract_ab"))
    p.add_argument("--note", default="")
    main(p.parse_args())
