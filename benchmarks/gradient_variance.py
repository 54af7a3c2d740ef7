"""Gradient variance of the SVI estimators: plain reparameterization, closed-form KL, local
reparameterization, flipout (``bp.fit(..., estimator=...)``).

Workload: an 8-50-1 tanh BNN (Normal(0, 1) prior, Gaussian noise 0.1) on N = 1,000 synthetic points,
a mean-field guide, minibatches of B = 100 (the data term scaled by N / B). At two guide states,
``init`` (the net's initial weights, guide scale 0.1) and ``trained`` (after 2,000 plain SVI steps),
each estimator draws ``--draws`` gradients of the negative ELBO with respect to the guide's
parameters, on one fixed minibatch (the variance of the weight noise alone) and on a fresh random
minibatch per draw (the total variance SGD sees). The figure per parameter group (the location or
scale of one layer's weight or bias) is the variance summed over the group's coordinates; the table
gives the plain estimator's variance divided by each estimator's (higher is better), and the
milliseconds per gradient step (single-threaded, median of interleaved repetitions).

Usage: ``python benchmarks/gradient_variance.py [--draws 200] [--out DIR]`` writes ``results.md`` (headed by the
run's provenance) and ``results.csv`` in ``benchmarks/results/gradient_variance/`` (one row per state, minibatch
mode, estimator
and group, with the raw variance and the ratio).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import pandas as pd
import pyro
import torch
from pyro.infer.autoguide import AutoNormal

import bnn_pyro as bp
from bnn_pyro.infer import svi
from bnn_pyro.infer._common import call_model, init_strategy
from bnn_pyro.infer.contract import Engine, Loop, run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_common.py
from _common import results_dir, write_result  # noqa: E402

ESTIMATORS = [("sample", "trace"), ("sample", "mean_field"), ("local_reparam", "mean_field"), ("flipout", "mean_field")]
N, B = 1000, 100


def workload(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, generator=g) / 2) + 0.1 * torch.randn(N, generator=g)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)), x, y


def trained_guide(model, x, y, steps: int) -> AutoNormal:
    """A mean-field guide after ``steps`` plain SVI steps (the current param store holds it)."""
    guide = AutoNormal(model, init_loc_fn=init_strategy(model, "net"), init_scale=0.1)
    guide(x[:B], y[:B])
    if steps:
        data = bp.infer._common.Data(x=x, y=y, batch_size=B)
        state = svi._state(model, guide, guide, data, svi._loss_fn(svi.ElboKind.TRACE, 1, False))
        loop = Loop(num_steps=steps, lr=1e-2, method="svi", desc="svi", progress=False)
        run(Engine(init=None, step=svi._step, draws=None), state, data, loop, seed=0)
    return guide


def estimator_fn(model, guide, estimator: str, elbo: str):
    trained, wrap = svi._handlers(guide, svi.ElboKind(elbo), svi.Estimator(estimator))
    fit_model = partial(call_model, model, dataset_size=N)
    loss = svi._loss_fn(svi.ElboKind(elbo), 1, False)
    return partial(loss, wrap(fit_model) if wrap else fit_model, trained)


def gradient_variance(model, guide, x, y, draws: int, fixed: bool, generator) -> list[dict]:
    names, params = zip(*sorted(guide.named_parameters()))
    rows = []
    for estimator, elbo in ESTIMATORS:
        loss = estimator_fn(model, guide, estimator, elbo)
        grads = {n: [] for n in names}
        for _ in range(draws):
            idx = torch.arange(B) if fixed else torch.randperm(N, generator=generator)[:B]
            surrogate, _ = loss(x[idx], y[idx])
            for n, g in zip(names, torch.autograd.grad(surrogate, params)):
                grads[n].append(g.reshape(-1).double())
        for n in names:
            rows.append(
                dict(
                    estimator=estimator,
                    elbo=elbo,
                    group=n.replace("_unconstrained", ""),
                    variance=torch.stack(grads[n]).var(0).sum().item(),
                )
            )
    return rows


def step_times(model, guide, x, y, repeats: int = 15, inner: int = 10) -> dict[tuple[str, str], float]:
    fns = {(est, elbo): estimator_fn(model, guide, est, elbo) for est, elbo in ESTIMATORS}
    times = {est: [] for est in fns}
    for _ in range(repeats):
        for est, loss in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                surrogate, _ = loss(x[:B], y[:B])
                surrogate.backward()
            times[est].append((time.perf_counter() - start) / inner * 1e3)
    return {est: round(statistics.median(t), 2) for est, t in times.items()}


def main(args) -> pd.DataFrame:
    torch.set_num_threads(1)
    model, x, y = workload()
    rows, timing = [], {}
    for state, steps in [("init", 0), ("trained", args.train_steps)]:
        with pyro.get_param_store().scope():
            pyro.set_rng_seed(0)
            guide = trained_guide(model, x, y, steps)
            generator = torch.Generator().manual_seed(1)
            for fixed in (True, False):
                for row in gradient_variance(model, guide, x, y, args.draws, fixed, generator):
                    rows.append(dict(state=state, minibatch="fixed" if fixed else "resampled", **row))
            timing[state] = step_times(model, guide, x, y)
    table = pd.DataFrame(rows)
    plain = table[table.estimator.eq("sample") & table.elbo.eq("trace")].set_index(["state", "minibatch", "group"])
    table["ratio_to_sample"] = [
        plain.loc[(r.state, r.minibatch, r.group), "variance"] / r.variance for r in table.itertuples()
    ]
    table["ms_per_step"] = [timing[r.state][(r.estimator, r.elbo)] for r in table.itertuples()]
    out = results_dir("gradient_variance", args.out)
    table.to_csv(out / "results.csv", index=False)
    write_result(out / "results.md", markdown(table, args))
    print(markdown(table, args))
    return table


def markdown(table: pd.DataFrame, args) -> str:
    """Variance ratios (plain / estimator) per group, one row per state, minibatch mode and estimator."""
    wide = (
        table.pivot_table(
            index=["state", "minibatch", "estimator", "elbo"], columns="group", values="ratio_to_sample", sort=False
        )
        .round(1)
        .reset_index()
    )
    ms = table.groupby(["state", "estimator", "elbo"], sort=False)["ms_per_step"].first()
    wide["ms_per_step"] = [ms.get((r.state, r.estimator, r.elbo)) for r in wide.itertuples()]
    rows = [list(wide.columns), ["---"] * wide.shape[1]] + wide.astype(str).values.tolist()
    head = (
        f"Gradient variance of the plain estimator divided by each estimator's (higher is better), summed per "
        f"parameter group; 8-50-1 tanh BNN, N = {N}, minibatch {B}, {args.draws} draws per cell, guide states "
        f"'init' and 'trained' ({args.train_steps} plain SVI steps). ms_per_step: one gradient step, "
        "single-threaded, median of interleaved repetitions.\n\n"
    )
    return head + "".join("| " + " | ".join(map(str, r)) + " |\n" for r in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200, help="gradient draws per estimator and setting")
    parser.add_argument("--train-steps", type=int, default=2000, help="plain SVI steps for the 'trained' state")
    parser.add_argument(
        "--out", default=None, help="the folder written (default benchmarks/results/gradient_variance/)"
    )
    main(parser.parse_args())
