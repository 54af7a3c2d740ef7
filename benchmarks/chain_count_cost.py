"""What an engine's chain count costs in fit time: one classification split, the counts alternating in one process.

Workload: ``classification.py``'s fit of one split (its model, split, seed and ``bp.fit`` call, at the engine's
defaults but for ``num_chains``), for each count in ``--chains``; the counts alternate round by round
(``--rounds``), so a burst of load on a shared machine falls on each alike. One torch thread (the fits' own
default, ``bp.fit``'s). The figures: each count's median fit seconds, wall and this process's CPU (the chains run
one after another in it; on a loaded machine the wall time also counts the other processes' turns, the CPU time
does not), and their ratios to the first count's, from the same rounds. Written for issue 26 item 1 (SWAG's ``num_chains`` 3 against 5); any engine with ``num_chains``.

Usage::

    python benchmarks/chain_count_cost.py --method swag --chains 3,5 --dataset iris --split 0 --rounds 3 \\
        --name swag5_cost_iris

writes ``<name>.md`` (headed by the run's provenance) and ``<name>.csv`` to ``--out`` (default
``benchmarks/results/classification/``).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating, markdown, results_dir, torch_threads, write_result  # noqa: E402
from classification import _fit, load_dataset, make_split  # noqa: E402


def fit_seconds(method: str, dataset: str, split: int, chains: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``classification.py``'s fit of ``split`` with ``num_chains=chains``."""
    x, y = load_dataset(dataset)
    s = make_split(x, y, split)
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fits' health warnings: the benchmark's scoring runs record them
        _fit(method, s["x_train"], s["y_train"], int(y.max()) + 1, split, {"num_chains": chains})
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", required=True, help="an engine with num_chains, e.g. swag")
    parser.add_argument("--chains", required=True, help="comma list of chain counts; the first is the baseline")
    parser.add_argument("--dataset", default="iris")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="chain_count_cost")
    parser.add_argument("--out", default=None, help="default benchmarks/results/classification/")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.chains.split(",")]
    if len(counts) < 2 or min(counts) < 1:
        raise SystemExit(f"--chains: expected at least two positive counts, got {args.chains!r}.")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected a positive int, got {args.rounds}.")
    with torch_threads(1):
        runs = alternating(
            {c: c for c in counts}, args.rounds, lambda c: fit_seconds(args.method, args.dataset, args.split, c)
        )
    med = {c: pd.DataFrame(runs[c], columns=["wall", "cpu"]).median() for c in counts}
    table = pd.DataFrame(
        {
            "num_chains": c,
            "rounds": args.rounds,
            "wall_s_each": " / ".join(f"{w:.1f}" for w, _ in runs[c]),
            "cpu_s_each": " / ".join(f"{u:.1f}" for _, u in runs[c]),
            "median_wall_s": round(float(med[c]["wall"]), 2),
            "median_cpu_s": round(float(med[c]["cpu"]), 2),
            f"wall_ratio_to_{counts[0]}": round(float(med[c]["wall"] / med[counts[0]]["wall"]), 2),
            f"cpu_ratio_to_{counts[0]}": round(float(med[c]["cpu"] / med[counts[0]]["cpu"]), 2),
        }
        for c in counts
    )
    folder = results_dir("classification", args.out)
    table.to_csv(folder / f"{args.name}.csv", index=False)
    title = (
        f"# {args.method}: fit seconds by num_chains, {args.dataset} split {args.split}\n\n"
        f"The counts alternate over {args.rounds} rounds in one process, one torch thread; "
        f"`classification.py`'s fit (seed {args.split}), the engine's other defaults.\n\n"
    )
    write_result(folder / f"{args.name}.md", title + markdown(table))
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    main()
