"""Is SG-MCMC's "bulk ESS of f" warning on classification fits true? Its ESS against the seed-to-seed spread.

A chain's bulk ESS claims a Monte Carlo error: a posterior mean estimated from its draws is off the one that the
chain's stationary law gives by about ``sd / sqrt(ESS)`` (``sd`` the posterior sd of that quantity over the draws).
Independent runs of the same fit at other seeds (chain ``c`` of ``seed=s`` starts from its own re-draw of the
initializers, ``init="reset"``, and has its own minibatches and noise) give the error itself: the sd over seeds of the
estimate. Per dataset, split (``benchmarks/classification.py``'s splits, net and prior) and engine at its defaults,
``--seeds`` fits; per fit the check's figure (the smallest bulk ESS of the logits ``f`` at the 20 training inputs
``check_mixing`` reads) and, at every test row and class, the predictive probability ``p`` (the mean of the draws'
softmax), its sd over the draws and its bulk ESS. Reported:

- ``ess_f_check``: the check's figure (median over seeds); ``ess_p_test``: the median over test rows and classes of
  the bulk ESS of the probabilities (median over seeds);
- ``ess_centred``: the smallest bulk ESS of the centred logits ``f - mean_k f`` at the same 20 inputs (median over
  seeds): softmax is unchanged by a shift common to every class's logit, so only the centred logits are identified
  by the data;
- ``mc_sd_actual``: the sd over seeds of ``p`` (each test row and class; the median over them);
- ``mc_sd_check``: what the check's ESS implies, ``sd_draws(p) / sqrt(ess_f_check)`` (median over rows, classes and
  seeds); ``mc_sd_p``: the same from each entry's own ESS of ``p``; ``mc_sd_centred``: from ``ess_centred``;
- ``ratio_*``: the median over the entries of ``mc_sd_actual`` over each implied error;
- ``fc_sd_actual``: the sd over seeds of the posterior mean of each centred logit at the 20 training inputs (median
  over them), ``fc_sd_implied``: what each one's own bulk ESS implies, ``sd_draws / sqrt(ESS)`` (median), and
  ``ratio_fc``: the median ratio of the two, entry by entry: near 1 where the ESS of ``f`` is right about ``f``;
- ``nll``: the test NLL of ``p`` (mean over seeds) and ``nll_sd_seeds``, its sd over seeds.

A ratio ``mc_sd_actual / mc_sd_check`` near 1 means the check's ESS told the truth about the predictive's error.

Usage::

    python benchmarks/sgmcmc_ess_truth.py                         # iris and wine split 0, sgld/sghmc/csgmcmc, 5 seeds
    python benchmarks/sgmcmc_ess_truth.py --datasets iris --methods sghmc --seeds 2 --seed-stride 4 \
        --options '{"num_chains": 4}' --name chains4
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import numpy as np
import pandas as pd
import torch
from _common import results_dir, write_result  # noqa: E402 - the script's folder is on sys.path
from classification import load_dataset, make_model, make_split

import bnn_pyro as bp
from bnn_pyro.posterior.diagnostics import NUM_FUNCTION_INPUTS, from_dict, function_draws
from bnn_pyro.utils.upstream_private import arviz_log_level


def bulk_ess(draws: np.ndarray) -> np.ndarray:
    """ArviZ's bulk ESS of every element of ``draws`` shaped ``(chains, draws, ...)``."""
    import arviz as az

    with arviz_log_level(logging.ERROR):
        return az.ess(from_dict(posterior={"v": draws}))["v"].values


def one_fit(method: str, s: dict, num_classes: int, seed: int, options: dict) -> dict:
    """The figures of one fit (module docstring)."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(
            make_model(s["x_train"].shape[1], num_classes, 0),
            s["x_train"],
            s["y_train"],
            method=method,
            seed=seed,
            progress=False,
            **options,
        )
    seconds = time.perf_counter() - start
    x = s["x_train"]
    rows = torch.linspace(0, x.shape[0] - 1, min(NUM_FUNCTION_INPUTS, x.shape[0])).round().long()
    with torch.no_grad():
        f_train = function_draws(post, x[rows]).double().numpy()
        probs = torch.softmax(function_draws(post, s["x_test"]).double(), -1).numpy()  # (C, S, rows, K)
    flat = probs.reshape((-1,) + probs.shape[2:])
    centred = f_train - f_train.mean(-1, keepdims=True)
    ess_warned = [str(w.message) for w in caught if "bulk ESS" in str(w.message)]
    return dict(
        seconds=seconds,
        ess_f_check=float(bulk_ess(f_train).min()),
        ess_centred=float(bulk_ess(centred).min()),
        fc=centred.reshape((-1,) + centred.shape[2:]).mean(0),
        sd_fc=centred.reshape((-1,) + centred.shape[2:]).std(0),
        ess_fc=bulk_ess(centred),
        ess_p=bulk_ess(probs),
        p=flat.mean(0),
        sd_p=flat.std(0),
        nll=float(-np.log(flat.mean(0)[np.arange(len(s["y_test"])), s["y_test"].numpy()]).mean()),
        warned=bool(ess_warned),
    )


def summarize(fits: list[dict]) -> dict:
    """Across the seeds' fits of one engine (module docstring)."""
    p = np.stack([f["p"] for f in fits])  # (seeds, rows, K)
    sd_p = np.stack([f["sd_p"] for f in fits])
    ess_p = np.stack([f["ess_p"] for f in fits])
    ess_check = np.array([f["ess_f_check"] for f in fits])
    ess_centred = np.array([f["ess_centred"] for f in fits])
    actual = p.std(0, ddof=1)
    informative = sd_p.mean(0) > 1e-3  # entries whose draws vary at all (saturated probabilities carry no error)
    implied_check = (sd_p / np.sqrt(ess_check)[:, None, None]).mean(0)
    implied_p = (sd_p / np.sqrt(ess_p)).mean(0)
    implied_centred = (sd_p / np.sqrt(ess_centred)[:, None, None]).mean(0)
    nll = np.array([f["nll"] for f in fits])
    fc_actual = np.stack([f["fc"] for f in fits]).std(0, ddof=1)
    fc_implied = np.stack([f["sd_fc"] / np.sqrt(f["ess_fc"]) for f in fits]).mean(0)
    return dict(
        fits=len(fits),
        warned=int(sum(f["warned"] for f in fits)),
        ess_f_check=float(np.median(ess_check)),
        ess_centred=float(np.median(ess_centred)),
        ess_p_test=float(np.median(ess_p[:, informative])),
        mc_sd_actual=float(np.median(actual[informative])),
        mc_sd_check=float(np.median(implied_check[informative])),
        mc_sd_p=float(np.median(implied_p[informative])),
        mc_sd_centred=float(np.median(implied_centred[informative])),
        ratio_check=float(np.median(actual[informative] / implied_check[informative])),
        ratio_p=float(np.median(actual[informative] / implied_p[informative])),
        ratio_centred=float(np.median(actual[informative] / implied_centred[informative])),
        fc_sd_actual=float(np.median(fc_actual)),
        fc_sd_implied=float(np.median(fc_implied)),
        ratio_fc=float(np.median(fc_actual / fc_implied)),
        nll=float(nll.mean()),
        nll_sd_seeds=float(nll.std(ddof=1)),
        seconds=float(np.mean([f["seconds"] for f in fits])),
    )


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default="iris,wine")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--methods", default="sgld,sghmc,csgmcmc")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--seed-stride",
        type=int,
        default=1,
        help="seeds 0, k, 2k, ...: with num_chains=C chain c of seed s is seeded s + c, so a stride of C keeps the "
        "seeds' chains apart",
    )
    parser.add_argument("--options", default="{}", help="JSON of bp.fit options added to the defaults")
    parser.add_argument("--name", default="results")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/sgmcmc_ess_truth/)")
    args = parser.parse_args(argv)
    out = results_dir("sgmcmc_ess_truth", args.out)
    options = json.loads(args.options)
    rows = []
    for dataset in args.datasets.split(","):
        x, y = load_dataset(dataset)
        s = make_split(x, y, args.split)
        num_classes = int(y.max()) + 1
        for method in args.methods.split(","):
            seeds = range(0, args.seeds * args.seed_stride, args.seed_stride)
            fits = [one_fit(method, s, num_classes, seed, options) for seed in seeds]
            row = {"dataset": dataset, "split": args.split, "method": method, "options": args.options}
            row.update(summarize(fits))
            rows.append(row)
            print(row, flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{args.name}.csv", index=False)
    columns = [c for c in table.columns if c not in ("split",)]
    lines = [
        "# SG-MCMC classification: the check's ESS against the seed-to-seed spread of the predictive",
        "",
        f"Split {args.split}, each engine at its defaults plus `{args.options}`, {args.seeds} seeds (0, {args.seed_stride}, ...).",
        "Columns: `benchmarks/sgmcmc_ess_truth.py`'s docstring. Medians over the test rows and classes whose",
        "probability varies over the draws (sd > 1e-3). Written by `python benchmarks/sgmcmc_ess_truth.py`.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    write_result(out / f"{args.name}.md", "\n".join(lines) + "\n")
    return table


if __name__ == "__main__":
    main()
