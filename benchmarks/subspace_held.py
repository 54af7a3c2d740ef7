"""Issue 26 (subspace inference's narrow spread): what part of the posterior's spread a ``subspace_dim`` subspace can
hold, in the net's outputs at the training inputs and in each weight, against what the draws show.

Subspace inference samples ``w = w_hat + P z`` only; with the induced prior its posterior is the net's conditioned on
the subspace, whose covariance for a Gaussian posterior is ``C_B = B (B^T H B)^{-1} B^T`` (``B`` the subspace's basis,
``H`` the precision), less than the full ``H^{-1}``. ``check_subspace`` forms both with the Laplace precision at the
draws' mean (``post.config["subspace"]["held"]``) and judges what a user reads: it warns when some output of the net
at the training inputs keeps less than ``SUBSPACE_HELD_MIN`` of its linearized variance (``J_i C_B J_i^T`` over
``J_i H^{-1} J_i^T``, ``J_i`` its gradient in the weights), and, only for a net whose outputs are linear in its weights
(a linear or logistic regression, whose weights are its coefficients), when some weight keeps less than that of its
variance (``diag(C_B) / diag(H^{-1})``). A hidden-layer net's weights are reported, not judged: ``k`` directions
cannot hold the marginals of many weights, yet can hold most of the outputs' spread. Per fit this writes the check's
figures (the smallest weight fraction held, its coordinate, how many weights fall below the threshold, the outputs'
share held, which criteria fired, the ``subspace_dim`` it suggests, whether it warned) and what the draws show:

- the two BNN references of ``tests/reference`` (exact posteriors): the draws' sd over the exact sd per weight, the
  sd the check predicts (the square root of its fraction), and, on the linear reference, the exact fraction (the
  exact precision ``X'X / s^2 + I`` restricted to the span of the centered draws, the subspace itself);
- a small regression BNN on the bundled gap data (a 1-``WIDTH``-1 tanh net, Normal(0, 1) prior, learned noise): the
  draws' sd over the Laplace sd at their mean, against the predicted ``sqrt(fraction)``.

Run from the repository root: ``python benchmarks/subspace_held.py [references] [gap]`` (default both). Writes
``benchmarks/results/subspace_held/held.md`` and ``held.csv``. One torch thread.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyro.distributions as dist
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import BNN_REFERENCES, flat_draws  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer.subspace_held import SUBSPACE_HELD_MIN, subspace_variance_held  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

WIDTH = 8
"""Hidden units of the gap-data net: 25 weights and the noise, small enough for the check (at most 200)."""
PHRASE = "holds too little of the posterior's spread"


def _fit(model, x, y, k):
    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(model, x, y, method="subspace", subspace_dim=k, seed=0, progress=False)
    warned = any(PHRASE in str(w.message) for w in caught)
    return post, warned, time.time() - start


def _row(model_name, k, post, warned, seconds, **extra):
    held = post.config["subspace"]["held"]
    if not held["judged"]:
        return dict(model=model_name, subspace_dim=k, judged=held["reason"], warned=warned, seconds=round(seconds, 1))
    fraction = np.array(held["variance_held"])
    row = dict(
        model=model_name,
        subspace_dim=k,
        min_held=round(float(fraction.min()), 4),
        worst=held["worst"],
        below=int((fraction < SUBSPACE_HELD_MIN).sum()),
        weights=len(fraction),
        suggested=held["suggested_subspace_dim"],
        f_held=f"median {held['function_variance_held']['median']:.3f}, min {held['function_variance_held']['min']:.3f}",
        fired=" ".join(held["fired"]) or "none",
        warned=warned,
        predicted_sd=" ".join(f"{v:.3f}" for v in np.sqrt(fraction)),
        seconds=round(seconds, 1),
    )
    return {**row, **extra}


def references(rows):
    for name in ("linear", "logistic"):
        ref = BNN_REFERENCES[name]()
        order = [f"{site}[{i}]" for site, i in ref.columns]
        for k in (1, 2, 3):
            post, warned, seconds = _fit(ref.model, ref.x, ref.y, k)
            d = flat_draws(post, ref).reshape(-1, len(order))
            held = post.config["subspace"]["held"]
            by_name = dict(zip(held["names"], held["variance_held"]))
            extra = dict(
                draws_sd=" ".join(f"{v:.3f}" for v in d.std(0) / ref.sd),
                predicted_sd=" ".join(f"{np.sqrt(by_name[n]):.3f}" for n in order),
                order=" ".join(order),
            )
            if name == "linear":
                x1 = torch.cat([ref.x, torch.ones(len(ref.x), 1)], 1).double()
                precision = x1.T @ x1 / 0.5**2 + torch.eye(3, dtype=torch.float64)  # noise 0.5, prior N(0, 1)
                span = torch.linalg.svd(torch.tensor(d - d.mean(0)), full_matrices=False)[2][:k].T
                extra["exact_sd"] = " ".join(f"{v:.3f}" for v in subspace_variance_held(precision, span).sqrt())
            row = _row(name, k, post, warned, seconds, **extra)
            print(row, flush=True)
            rows.append(row)


def gap_net(rows):
    x, y = bp.datasets.toy_gap()
    for k in (2, 5, 10):  # 10: the default (NUTS over z took ~500 s there on the loaded machine)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(1, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
        model = bp.BNN(
            net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
        )
        post, warned, seconds = _fit(model, x, y, k)
        held = post.config["subspace"]["held"]
        if not held["judged"]:
            rows.append(_row(f"gap 1-{WIDTH}-1", k, post, warned, seconds))
            print(rows[-1], flush=True)
            continue
        draws = torch.cat([post.samples[s].reshape(-1, post.samples[s][0, 0].numel()) for s in model.sample_names], 1)
        names = [f"{s}[{i}]" for s in model.sample_names for i in range(post.samples[s][0, 0].numel())]
        laplace = dict(zip(held["names"], held.get("laplace_sd", [np.nan] * len(names))))
        ratio = draws.double().std(0).numpy() / np.array([laplace[n] for n in names])
        predicted = np.sqrt(np.array([dict(zip(held["names"], held["variance_held"]))[n] for n in names]))
        row = _row(f"gap 1-{WIDTH}-1", k, post, warned, seconds)
        row.update(
            predicted_sd=f"median {np.median(predicted):.3f}, min {predicted.min():.3f}",
            draws_sd=f"median {np.nanmedian(ratio):.3f}, min {np.nanmin(ratio):.3f}",
            draws_over_predicted=f"median {np.nanmedian(ratio / predicted):.2f}",
        )
        print(row, flush=True)
        rows.append(row)


def main():
    torch.set_num_threads(1)
    only = sys.argv[1:] or ["references", "gap"]
    rows = []
    if "references" in only:
        references(rows)
    if "gap" in only:
        gap_net(rows)
    table = pd.DataFrame(rows)
    folder = results_dir("subspace_held")
    table.to_csv(folder / "held.csv", index=False)
    write_result(
        folder / "held.md",
        "Subspace inference at `subspace_dim` k (its other defaults, seed 0). `check_subspace` (threshold "
        f"{SUBSPACE_HELD_MIN:.3f}) warns when an output of the net at the training inputs keeps less than the "
        "threshold of its linearized Laplace variance (`f_held`: the share held, median and min over the outputs), "
        "and, for a net whose outputs are linear in its weights (the linear and logistic references), when a weight "
        "keeps less than that of its Laplace variance (`min_held`, `worst`, `below`: the weights' fractions, reported "
        "for the gap net but not judged there); `fired`: which criteria did. `predicted_sd`, `draws_sd`, `exact_sd`: "
        "per weight in `order` (reference rows), sd ratios to the exact sd (draws), the square root of the check's "
        "fraction (predicted) and of the exact fraction (linear); gap rows: over the Laplace sd at the draws' mean."
        "\n\n" + markdown(table) + "\n",
    )


if __name__ == "__main__":
    main()
