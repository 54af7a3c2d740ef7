"""Laplace structures side by side at the engine's other defaults: ``last_layer`` (the default), ``kron`` (KFAC)
and ``diag``, on the toy gap regression and on digits classification; the diabetes regression is benchmarks/uci.py
(``--methods laplace --option laplace:structure=kron``).

- gap: ``bp.datasets.toy_gap`` split 75/25 (seed 0), 1-50-1 tanh net, Normal(0, 1) prior, Gaussian(0.1) noise:
  test RMSE and log-likelihood per point, mean epistemic sd at 9 points inside the gap and on the training inputs;
- digits: scikit-learn's 8x8 digits split 75/25 (seed 0), ``Conv2d(1, 4, 3) - ReLU - Linear(144, 10)``, Normal(0, 1)
  prior, Categorical, the Gaussian of ``laplace_approximation`` with ``bp.fit``'s held-out rows: accuracy, NLL and
  ECE of the GLM predictive's class probabilities (:func:`bnn_pyro.infer.laplace.predictive_probs`, ``link="mc"``
  and ``"probit"``), and wall times.

Usage::

    python benchmarks/laplace_structures.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import time

import torch

import bnn_pyro as bp
from bnn_pyro.infer import laplace as lap
from bnn_pyro.infer._common import Data

STRUCTURES = ("last_layer", "kron", "diag")


def gap(structure: str, seed: int) -> dict:
    x, y = bp.datasets.toy_gap()
    x_tr, y_tr, x_te, y_te = bp.datasets.train_test_split(x, y, test_fraction=0.25, seed=0)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    start = time.perf_counter()
    post = bp.fit(model, x_tr, y_tr, method="laplace", structure=structure, seed=seed, progress=False)
    seconds = time.perf_counter() - start
    return dict(
        rmse=bp.metrics.rmse(post.predict(x_te), y_te),
        test_ll=bp.metrics.test_log_likelihood(post, x_te, y_te),
        gap_sd=float(post.predict(torch.linspace(-0.4, 0.4, 9)[:, None]).epistemic_std.mean()),
        data_sd=float(post.predict(x_tr).epistemic_std.mean()),
        seconds=seconds,
    )


def digits(structure: str, seed: int) -> dict:
    x, y = bp.datasets.digits_images()
    x_tr, y_tr, x_te, y_te = bp.datasets.train_test_split(x, y, test_fraction=0.25, seed=0)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    start = time.perf_counter()
    approx = lap.laplace_approximation(
        model, Data(x=x_tr, y=y_tr), structure=structure, seed=seed, validation="default"
    )  # bp.fit's held-out rows (early stopping)
    seconds = time.perf_counter() - start
    out = dict(seconds=seconds)
    for link in ("mc", "probit"):
        probs = lap.predictive_probs(approx, x_te, link=link)
        out.update(
            {
                f"{link}_accuracy": bp.metrics.accuracy(probs, y_te),
                f"{link}_nll": float(-probs[torch.arange(len(y_te)), y_te].log().mean()),
                f"{link}_ece": bp.metrics.ece(probs, y_te),
            }
        )
    return out


def main(args):
    for task in (gap, digits):
        for structure in args.structures:
            rows = [task(structure, seed) for seed in args.seeds]
            keys = rows[0].keys()
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
            print(task.__name__, structure, " ".join(f"{k}={v:.4g}" for k, v in mean.items()), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--structures", nargs="+", default=list(STRUCTURES))
    main(parser.parse_args())
