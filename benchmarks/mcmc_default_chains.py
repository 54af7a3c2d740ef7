"""What the MCMC defaults' four chains cost against one chain, on this machine, side by side.

Workload: the 1-50-1 tanh BNN of ``_common`` (Normal(0, 1) prior, Gaussian noise 0.1), N = 200, every chain from
``init="reset"`` under its seed; ``--draws`` warm-up plus ``--draws`` kept iterations per chain; NUTS at
``max_tree_depth=--depth`` (its default 10 saturates on this posterior: every draw would cost 1,023 steps), HMC
and Metropolis at their defaults. For each method the rows are: one chain (``num_chains=1``, the old default),
the new default (``num_chains=4``, ``chain_method="auto"``: forked processes, at most one per core, one torch
thread each) and, for NUTS/HMC, four chains ``chain_method="vectorized"`` (one batched computation, one thread).
The three are interleaved round by round (``--rounds``), so that a shared machine's load falls on each alike, and
the figure is the median wall time per round and its ratio to the one-chain row of the same method.

Usage: ``python benchmarks/mcmc_default_chains.py [--quick] [--out DIR] [--name results]`` writes ``NAME.md``
(headed by the run's provenance) and ``NAME.csv`` in ``benchmarks/results/mcmc_default_chains/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
from _common import bnn, markdown, regression, results_dir, thread_note, write_result  # noqa: E402

METHODS = {"nuts": {}, "hmc": {}, "metropolis": {}}


def run(method: str, chains: int, how: str, draws: int, depth: int) -> float:
    x, y = regression(200, 1)
    options = dict(max_tree_depth=depth) if method == "nuts" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short runs: the health warnings
        start = time.perf_counter()
        bp.fit(
            bnn(1),
            x,
            y,
            method=method,
            num_chains=chains,
            chain_method=how,
            num_warmup=draws,
            num_samples=draws,
            seed=0,
            progress=False,
            **options,
        )
        return time.perf_counter() - start


def variants(method: str) -> list[tuple[int, str]]:
    rows = [(1, "auto"), (4, "auto")]
    return rows + [(4, "vectorized")] if method != "metropolis" else rows


def main(args) -> pd.DataFrame:
    for method in METHODS:  # untimed: each method's one-time costs in this process
        run(method, 1, "auto", 3, args.depth)
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for method in METHODS:
            for chains, how in variants(method):
                times.setdefault((method, chains, how), []).append(run(method, chains, how, args.draws, args.depth))
    rows = []
    for (method, chains, how), walls in times.items():
        rows.append(
            dict(
                method=method,
                num_chains=chains,
                chain_method=how,
                default=chains == 4 and how == "auto",
                median_wall_s=pd.Series(walls).median(),
                walls_s=" ".join(f"{w:.1f}" for w in walls),
            )
        )
    table = pd.DataFrame(rows)
    one = table[table.num_chains == 1].set_index("method").median_wall_s
    table["ratio_to_one_chain"] = (table.median_wall_s / table.method.map(one)).round(2)
    table["per_chain_ratio"] = (table.ratio_to_one_chain / table.num_chains).round(2)
    table = table.round(2)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    load = os.getloadavg()
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {os.cpu_count()} CPU cores "
        f"(affinity {len(os.sched_getaffinity(0))}), {thread_note()}, load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; {args.draws} + {args.draws} iterations per chain, NUTS "
        f"max_tree_depth={args.depth}, {args.rounds} interleaved rounds (median)"
    )
    out = results_dir("mcmc_default_chains", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    write_result(
        out / f"{args.name}.md",
        header + "\n\n" + (f"{args.note}\n\n" if args.note else "") + markdown(table.astype(object)),
    )
    print(header)
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 + 10 iterations, 1 round")
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default=None, help="the folder written (default benchmarks/results/mcmc_default_chains/)"
    )
    parser.add_argument("--name", default="results", help="the result files' name (default results)")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    if args.quick:
        args.draws, args.rounds = 10, 1
    main(args)
