"""Mean-field SVI at its defaults against Laplace and the deep ensemble on UCI-style regression, with candidate
remedies side by side (issue 26, item 8).

Protocol: benchmarks/uci.py's (its model, standardization, metrics and per-split seeds), every variant fitted on the
same splits in one run, so that per-split differences are paired. Variants are SVI option sets (``--variant
name:key=value,key=value``); the baselines are ``laplace`` and ``ensemble`` at their defaults.

Usage::

    python benchmarks/svi_defaults.py --dataset friedman1_low_noise,friedman1 --splits 3
    python benchmarks/svi_defaults.py --dataset friedman1 --rows 100 --splits 3 \
        --variant svi --variant "svi kl_warmup=0.5:kl_warmup=0.5"      # 100 rows: the small-N setting
    python benchmarks/svi_defaults.py --dataset diabetes --rows 100 --width 200 --splits 2   # and a wider net

writes, in ``benchmarks/results/svi_defaults/``, ``splits.csv`` (one row per dataset, split and variant) and
``results.md`` (headed by the run's provenance; per dataset:
mean ± SE over splits, and the paired test-LL difference to Laplace on the same splits).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import platform
import subprocess
import time

import pandas as pd
import torch
import uci
from _common import results_dir, write_result  # noqa: E402 - uci put benchmarks/ on sys.path
from uci import load_dataset, make_splits, run_one

import bnn_pyro as bp

BASELINES = ("laplace", "ensemble")
WIDTH = 50  # benchmarks/uci.py's hidden units
MAP_STEPS = 1000
"""``init="map"`` in a variant: the mean-field guide starts at a MAP fit (``guide="map"``, ``MAP_STEPS`` steps, the
same seed) of the split (``init=post``); its fit time is added to the variant's."""
MAP_START = "map"
DEFAULT_VARIANTS = {
    "svi": {},
    "svi steps=5000": {"num_steps": 5000},
    "svi empirical_bayes": {"empirical_bayes": True},
    "svi init=MAP": {"init": MAP_START},
    "svi init=MAP steps=5000": {"init": MAP_START, "num_steps": 5000},
}
LOW_NOISE = dict(n_samples=768, n_features=8, noise=0.25, random_state=0)
"""``friedman1_low_noise``: an energy-like set (768 x 8) with a high signal-to-noise ratio (y sd ~5, noise 0.25),
where the classic UCI sets showed mean-field SVI's gap."""


def _splits(dataset: str, n: int, rows: int | None = None) -> list:
    """The first ``n`` splits of ``dataset``; ``rows``: only that many rows of it (a random subset, seed 0), for the
    small-N settings where mean-field VI is known to underfit."""
    if dataset == "friedman1_low_noise":
        from sklearn.datasets import make_friedman1

        x, y = make_friedman1(**LOW_NOISE)
        dtype = torch.get_default_dtype()
        x, y = torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=dtype)
    else:
        x, y = load_dataset(dataset)
    if rows is not None:
        keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:rows]
        x, y = x[keep], y[keep]
    return make_splits(x=x, y=y, n_splits=n)


@contextlib.contextmanager
def _width(hidden: int):
    """benchmarks/uci.py's protocol with ``hidden`` units in its one hidden layer instead of 50 (its ``make_model``,
    which ``run_one`` calls, swapped for the run)."""
    base = uci.make_model

    def make(input_dim: int, seed: int) -> bp.BNN:
        protocol = base(input_dim, seed)  # the protocol's prior and likelihood
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(input_dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        return bp.BNN(net, prior=protocol.prior, likelihood=protocol.likelihood)

    uci.make_model = make if hidden != WIDTH else base
    try:
        yield
    finally:
        uci.make_model = base


def _parse_variant(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    opts = {}
    for pair in filter(None, body.split(",")):
        key, _, value = pair.partition("=")
        try:
            opts[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            opts[key] = value
    return name, opts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dataset",
        default="friedman1_low_noise,friedman1",
        help="friedman1_low_noise (module constant LOW_NOISE) or benchmarks/uci.py's datasets",
    )
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--rows", type=int, default=None, help="use only this many rows of each dataset (seed 0)")
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden units of the protocol's net (default 50)")
    parser.add_argument("--variant", action="append", default=[], help="name:key=value,... (replaces the defaults)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="comma list (laplace is the reference)")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/svi_defaults/)")
    args = parser.parse_args()
    variants = dict(_parse_variant(v) for v in args.variant) if args.variant else DEFAULT_VARIANTS
    out = results_dir("svi_defaults", args.out)
    rows = []
    setting = "".join(f" {k}={v}" for k, v in (("rows", args.rows), ("width", args.width)) if v not in (None, WIDTH))
    with _width(args.width):
        for dataset in args.dataset.split(","):
            for split in _splits(dataset, args.splits, args.rows):
                jobs = [(m, m, {}) for m in args.baselines.split(",") if m] + [
                    (name, "svi", opts) for name, opts in variants.items()
                ]
                map_post = map_time = None
                for label, method, opts in jobs:
                    if opts.get("init") == MAP_START:
                        if map_post is None:
                            start = time.perf_counter()
                            map_post = bp.fit(
                                uci.make_model(split.x_train.shape[1], split.split),
                                split.x_train,
                                split.y_train,
                                method="svi",
                                guide="map",
                                num_steps=MAP_STEPS,
                                seed=split.split,
                                progress=False,
                            )
                            map_time = time.perf_counter() - start
                        opts = {**opts, "init": map_post}
                    row = run_one(method, split, opts)
                    if map_post is not None and opts.get("init") is map_post and "time_s" in row:
                        row["time_s"] += map_time
                    row.update(dataset=dataset + setting, variant=label)
                    rows.append(row)
                    print(
                        dataset + setting,
                        split.split,
                        label,
                        f"{row.get('test_ll', math.nan):.3f}",
                        f"{row.get('rmse', math.nan):.3f}",
                        f"{row.get('time_s', math.nan):.1f}s",
                        row["error"],
                        row["warnings"][:100],
                        flush=True,
                    )
                    pd.DataFrame(rows).to_csv(out / "splits.csv", index=False)
    write_result(out / "results.md", report(pd.DataFrame(rows), args.note))


def report(rows: pd.DataFrame, note: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Mean-field SVI at its defaults against Laplace and the ensemble, with candidate remedies",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, git {commit}, torch {torch.__version__} on "
        f"{platform.machine()} ({torch.get_num_threads()} torch thread(s): bp.fit's default). {note}",
        "",
        "Protocol: benchmarks/uci.py's (ReLU 50 net, Normal(0, 1) prior, learned noise, 90/10 splits, metrics "
        "in original units). Every variant on the same splits in one run; 'LL - laplace' is the paired "
        "per-split difference of test LL to Laplace's, 'time / svi' the per-split ratio of fit time to the 'svi' row's "
        "(mean ± SE; the machine's load changes during a run, so only these ratios compare).",
        "",
    ]
    for dataset, group in rows.groupby("dataset", sort=False):
        ok = group[group["error"].fillna("") == ""]
        base = ok[ok["variant"] == "laplace"].set_index("split")["test_ll"]
        svi_time = ok[ok["variant"] == "svi"].set_index("split")["time_s"]
        lines += [
            f"## {dataset}",
            "",
            "| variant | test LL | RMSE | noise sd | epist. sd | LL - laplace | fit time s | "
            "time / svi | splits ok | warnings |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant, v in group.groupby("variant", sort=False):
            good = v[v["error"].fillna("") == ""]
            diff = good.set_index("split")["test_ll"] - base
            cells = [variant] + [_ms(good[m]) for m in ("test_ll", "rmse", "noise_sd", "epistemic_sd")]
            ratio = (good.set_index("split")["time_s"] / svi_time).dropna()
            cells += [
                _ms(diff.dropna()),
                _ms(good["time_s"], 1),
                _ms(ratio, 2),
                f"{len(good)}/{len(v)}",
                (
                    v["error"].fillna("").iloc[0]
                    or " / ".join(sorted({t for w in good["warnings"].fillna("") for t in w.split(" / ") if t}))
                )[:160],
            ]
            lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _ms(values: pd.Series, digits: int = 3) -> str:
    values = values.astype(float)
    if not len(values):
        return "-"
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{values.mean():.{digits}f}" + (f" ± {se:.{digits}f}" if math.isfinite(se) else "")


if __name__ == "__main__":
    main()
