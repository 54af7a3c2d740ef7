"""SVI with a full-rank or low-rank guide before and after the dimension-aware default ``lr`` (issue 26 items 8-9).

Before: ``lr=0.01`` (the old default for every guide), given explicitly. After: SVI's default, which for a guide with a
covariance factor is ``1e-2 * sqrt(10 / m)`` with ``m`` the factor's free entries per row
(:func:`bnn_pyro.infer.svi.default_lr`). Everything else at its default. Classification: ``benchmarks/classification.py``'s
protocol (its split, ``Linear(D, 50) - ReLU - Linear(50, K)`` net, ``Normal(0, 1)`` prior, ``seed=split``; test
accuracy, NLL, and the noise and far-away AUROC by mutual information, no held-out-class fit); regression:
``benchmarks/uci.py``'s protocol on diabetes (test LL and RMSE in original units). Both sides run in the same
invocation, jobs interleaved, so the machine's load is shared alike.

Run from the repository root: ``python benchmarks/svi_full_rank.py [--jobs 2]``. Writes
``benchmarks/results/svi_full_rank/results.md`` and ``results.csv`` (after every finished fit, so an interrupted run
keeps what it finished). One torch thread per fit.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import time

import pandas as pd
import torch
from _common import markdown, results_dir, write_result

REGRESSION_SPLITS = (0, 1, 2)
BEFORE_LR = 1e-2


def _jobs() -> list[tuple]:
    """In order of priority (an interrupted run keeps the first): full-rank on iris, wine and diabetes split 0, then
    low-rank on iris and wine, diabetes splits 1-2, breast_cancer (the slowest, 1,652 weights)."""
    groups = [
        ("classification", "iris", 0, "full_rank"),
        ("classification", "wine", 0, "full_rank"),
        ("regression", "diabetes", 0, "full_rank"),
        ("classification", "iris", 0, "low_rank"),
        ("classification", "wine", 0, "low_rank"),
        *[("regression", "diabetes", split, "full_rank") for split in REGRESSION_SPLITS[1:]],
        ("classification", "breast_cancer", 0, "full_rank"),
    ]
    return [(*group, side) for group in groups for side in ("before", "after")]


def _weights(net: torch.nn.Module) -> int:
    """The net's weights and biases, from its Linear layers' shapes (a BNN holds them as Pyro sample sites)."""
    return sum(m.in_features * m.out_features + m.out_features for m in net.modules() if isinstance(m, torch.nn.Linear))


def run_job(job: tuple) -> dict:
    torch.set_num_threads(1)
    from bnn_pyro.infer.svi_lr import default_lr

    task, name, split, guide, side = job
    options = dict(guide=guide, **({"lr": BEFORE_LR} if side == "before" else {}))
    start = time.perf_counter()
    if task == "classification":
        import classification

        data = classification.load_dataset(name)
        k = int(data[1].max()) + 1
        dim = _weights(classification.make_model(data[0].shape[1], k, split).net)
        row = classification.run_one("svi", data, split, options, held_out_class=False)
    else:
        import uci

        s = uci.make_splits(dataset=name, n_splits=max(REGRESSION_SPLITS) + 1)[split]
        dim = _weights(uci.make_model(s.x_train.shape[1], split).net) + 1  # + the learned noise
        row = uci.run_one("svi", s, options)
    lr = options.get("lr", default_lr(guide, dim))
    return {
        **row,
        **dict(task=task, dataset=name, guide=guide, side=side, dim=dim, lr=lr, wall_s=time.perf_counter() - start),
    }


COLUMNS = ("accuracy", "nll", "auroc_noise_mi", "auroc_far_mi", "test_ll", "rmse", "coverage_95", "wall_s")


def _table(rows: pd.DataFrame) -> str:
    cols = (
        ["dataset", "split", "guide", "dim", "side", "lr"] + [c for c in COLUMNS if c in rows] + ["error", "warnings"]
    )
    out = rows.reindex(columns=cols).sort_values(
        ["dataset", "guide", "split", "side"], ascending=[True, True, True, False]
    )
    return markdown(out.map(lambda v: f"{v:.4g}" if isinstance(v, float) else v))


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="fits at a time (processes)")
    args = parser.parse_args(argv)
    out = results_dir("svi_full_rank")
    rows = []
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for row in pool.imap_unordered(run_job, _jobs()):
            rows.append(row)
            frame = pd.DataFrame(rows)
            frame.to_csv(out / "results.csv", index=False)
            write_result(
                out / "results.md",
                "# SVI full-rank / low-rank guides: lr=0.01 (before) against the default lr (after)\n\n"
                f"{len(rows)} of {len(_jobs())} fits finished; before: lr={BEFORE_LR:g} given; after: SVI's default.\n\n"
                + _table(frame),
            )
            print(
                row["dataset"],
                row["split"],
                row["guide"],
                row["side"],
                {c: row.get(c) for c in COLUMNS if not (isinstance(row.get(c), float) and math.isnan(row.get(c)))},
                row.get("error"),
                flush=True,
            )
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
