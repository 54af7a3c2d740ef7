"""Does KL annealing (``kl_warmup``) find a better mean-field optimum, or only stop short of it? (issue 26, item 8)

For each split of benchmarks/svi_defaults.py's small-N settings (its ``--rows`` subsets, the uci.py protocol's
model), mean-field SVI is fitted with and without a KL warm-up at the default length and at 4x it, and the run
reports the final negative ELBO (the mean of the last 10% of the per-step losses, all at KL weight 1: a lower value
is a better variational optimum) beside the test log-likelihood per point and the RMSE (original units). A warm-up
that found a better optimum would end at a lower negative ELBO and keep its advantage in a longer run; one that only
stops short of the optimum ends higher and loses its advantage as the run grows.

Usage::

    python benchmarks/svi_warmup_elbo.py --dataset friedman1,diabetes --rows 100 --splits 3

writes ``benchmarks/results/svi_defaults/warmup_elbo.md`` and ``warmup_elbo.csv`` (one row per fit).
"""

from __future__ import annotations

import argparse
import math
import warnings

import pandas as pd
import uci
from _common import results_dir, write_result  # noqa: E402 - uci put benchmarks/ on sys.path
from svi_defaults import _splits

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.infer.svi import DEFAULT_STEPS


def fit_row(split, dataset: str, warmup: float, steps: int) -> dict:
    """One mean-field fit at ``kl_warmup=warmup`` for ``steps`` steps (seed = the split, as in uci.py): its final
    negative ELBO and its test metrics in original units."""
    model = uci.make_model(split.x_train.shape[1], split.split)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence notes; the loss is reported instead
        post = bp.fit(
            model,
            split.x_train,
            split.y_train,
            method="svi",
            kl_warmup=warmup,
            num_steps=steps,
            seed=split.split,
            progress=False,
        )
    loss = post.history["loss"][0]
    scale = float(split.y_scaler.scale)
    return dict(
        dataset=dataset,
        split=split.split,
        kl_warmup=warmup,
        num_steps=steps,
        final_neg_elbo=float(loss[-(steps // 10) :].mean()),
        test_ll=metrics.test_log_likelihood(post, split.x_test, split.y_test) - math.log(scale),
        rmse=metrics.rmse(post.predict(split.x_test, interval=None, seed=0), split.y_test) * scale,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="friedman1,diabetes,friedman1_low_noise")
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=0.5, help="the kl_warmup compared with none")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = results_dir("svi_defaults", args.out)
    rows = []
    for dataset in args.dataset.split(","):
        for split in _splits(dataset, args.splits, args.rows):
            for steps in (DEFAULT_STEPS, 4 * DEFAULT_STEPS):
                for warmup in (0.0, args.warmup):
                    rows.append(fit_row(split, f"{dataset} rows={args.rows}", warmup, steps))
                    print(rows[-1], flush=True)
            pd.DataFrame(rows).to_csv(out / "warmup_elbo.csv", index=False)
    write_result(out / "warmup_elbo.md", report(pd.DataFrame(rows), args.warmup))


def report(rows: pd.DataFrame, warmup: float) -> str:
    """Per dataset and run length: mean ± SE over splits of each metric without and with the warm-up, and the
    paired per-split difference (warm-up minus none)."""
    lines = [
        "# KL warm-up: a better mean-field optimum, or a stop short of it?",
        "",
        "benchmarks/svi_warmup_elbo.py: mean-field SVI at its defaults (uci.py's protocol model, seed = split) with "
        f"kl_warmup=0 and {warmup}, at the default length and 4x it. 'final -ELBO': mean of the last 10% of the "
        "per-step losses (KL weight 1 there; lower is a better variational optimum); test LL per point and RMSE in "
        "original units; 'diff': the paired per-split difference, warm-up minus none (mean ± SE).",
        "",
        "| dataset | steps | final -ELBO none | final -ELBO warm-up | diff | test LL none | test LL warm-up | diff "
        "| RMSE none | RMSE warm-up | diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dataset, steps), group in rows.groupby(["dataset", "num_steps"], sort=False):
        none = group[group["kl_warmup"] == 0].set_index("split")
        warm = group[group["kl_warmup"] != 0].set_index("split")
        cells = [dataset, f"{steps:,}"]
        for metric in ("final_neg_elbo", "test_ll", "rmse"):
            cells += [_ms(none[metric]), _ms(warm[metric]), _ms((warm[metric] - none[metric]).dropna())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ms(values: pd.Series) -> str:
    values = values.astype(float)
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return f"{values.mean():.3f}" + (f" ± {se:.3f}" if math.isfinite(se) else "")


if __name__ == "__main__":
    main()
