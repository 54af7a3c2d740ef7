"""Subspace inference's inner NUTS at the defaults, before and after it ran in weight units (issue: ~20% divergent
transitions on a small net).

Before (``--before``, default 5cac1a9): NUTS over ``z`` in ``w = w_hat + P z`` with ``P = V_k S_k / sqrt(K - 1)``, so
``z_j = 1`` is one sd of the SWA iterates along direction ``j``. Those sds fall by orders of magnitude from the first
direction to the last, while under the induced prior the posterior along a direction the data leave free keeps the
prior's spread in the weights (in a diagnosis run on a 1-16-1 net, not recorded here, the posterior sds of ``z`` ran
from 14 to 22,000, condition number 5e8; in weight units 4e4). After (the working tree): the inner engine samples
unit-length directions, i.e. weight-space displacements (``Subspace.orthonormal``), and NUTS targets acceptance 0.95
(``subspace.INNER_TARGET_ACCEPT``): in that diagnosis run, weight units alone at 0.8 still diverged on 3.3% of the
draws (3.9% before), 0.95 alone on 0.5%, both together on none.

Per fit (``bp.fit(model, x, y, method="subspace", seed=s, progress=False)``, everything else at its defaults): the
divergent fraction of the kept draws, the median adapted step size, mean leapfrog steps and tree depth per draw, mean
acceptance, the smallest bulk ESS of ``f`` at 20 training inputs (ArviZ, as ``check_mixing``) and that per second of
the whole fit, the fit's wall time, test RMSE and test NLL (``bp.metrics``) on held-out rows, and whether the fit
warned about divergences. The two sides alternate per fit, each in its own process (``_common.side_result``).

Cases: ``gap16`` and ``gap50``, a 1-16-1 and a 1-50-1 tanh net (Normal(0, 1) prior, fixed noise 0.1) on 150 rows of
``y = sin(3x) + 0.3x + N(0, 0.1^2)``, x uniform on [-2, 2] (500 test rows from the same law); ``diabetes``, a 10-16-1
tanh net with a learned noise (HalfNormal(1)) on scikit-learn's diabetes, standardized, 80% train / 20% test.

Run from the repository root: ``OMP_NUM_THREADS=1 python benchmarks/subspace_divergences.py --cases gap16,gap50
--seeds 0,1,2``; writes ``benchmarks/results/subspace_divergences/<name>.md`` and ``.csv`` (``--name``).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import pandas as pd
from _common import exported, markdown, results_dir, side_result, write_result

CASES = ("gap16", "gap50", "diabetes")


def _data(case: str, seed: int):
    import torch

    import bnn_pyro as bp

    if case == "diabetes":
        x, y = bp.datasets.load_sklearn("diabetes")
        x, y = (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
        cut = int(0.8 * x.shape[0])
        return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(650, 1, generator=g) * 4 - 2
    y = torch.sin(3 * x[:, 0]) + 0.3 * x[:, 0] + 0.1 * torch.randn(650, generator=g)
    return x[:150], y[:150], x[150:], y[150:]


def _model(case: str, d: int, seed: int):
    import pyro.distributions as dist
    import torch

    import bnn_pyro as bp

    width = 50 if case == "gap50" else 16
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    noise = dist.HalfNormal(1.0) if case == "diabetes" else 0.1
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=noise))


def run_one(settings: dict) -> dict:
    """One subspace fit at the defaults on ``settings["case"]`` with ``settings["seed"]`` (child entry point)."""
    import arviz as az
    import torch

    import bnn_pyro as bp
    from bnn_pyro.posterior.diagnostics import DiagnosticWarning, from_dict, function_draws

    torch.set_num_threads(1)
    case, seed = settings["case"], settings["seed"]
    x, y, x_test, y_test = _data(case, seed)
    model = _model(case, x.shape[1], seed)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(model, x, y, method="subspace", seed=seed, progress=False)
    seconds = time.perf_counter() - start
    stats = post.sample_stats
    rows = torch.linspace(0, x.shape[0] - 1, 20).round().long()
    f = function_draws(post, x[rows]).double().numpy()
    ess = float(az.ess(from_dict(posterior={"f": f}))["f"].values.min())
    pred = post.predict(x_test)
    return dict(
        diverging=round(float(stats["diverging"].float().mean()), 4),
        step_size=round(float(stats["step_size"].float().median()), 4),
        leapfrog=round(float(stats["n_steps"].float().mean()), 1),
        tree_depth=round(float(stats["tree_depth"].float().mean()), 2),
        accept=round(float(stats["acceptance_rate"].float().mean()), 3),
        ess_f=round(ess, 1),
        seconds=round(seconds, 1),
        ess_per_s=round(ess / seconds, 3),
        rmse=round(bp.metrics.rmse(pred, y_test), 4),
        nll=round(bp.metrics.nll(post, x_test, y_test), 4),
        warned=any("diverged" in str(w.message) for w in caught),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--before", default="5cac1a9", help="git revision of the 'before' side")
    parser.add_argument("--name", default="divergences")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases, seeds = args.cases.split(","), [int(s) for s in args.seeds.split(",")]
    root = Path(__file__).resolve().parents[1]
    rows = []
    with exported(args.before) as before:
        sides = {"before": before, "after": root}
        for case in cases:
            for seed in seeds:
                for side, tree in sides.items():
                    result = side_result(tree, "subspace_divergences", "run_one", dict(case=case, seed=seed))
                    rows.append(dict(case=case, seed=seed, side=side, **result))
                    print(rows[-1], flush=True)
                _write(pd.DataFrame(rows), args)  # after every pair: a run cut short keeps what it measured


def _write(table: pd.DataFrame, args) -> None:
    folder = results_dir("subspace_divergences", args.out)
    table.to_csv(folder / f"{args.name}.csv", index=False)
    mean = table.groupby(["case", "side"], sort=False)[
        ["diverging", "step_size", "leapfrog", "ess_f", "seconds", "ess_per_s", "rmse", "nll"]
    ].mean()
    paired = table.pivot_table(index=["case", "seed"], columns="side", values="seconds")
    ratio = (paired["after"] / paired["before"]).groupby("case").mean().round(2).rename("time_after_over_before")
    write_result(
        folder / f"{args.name}.md",
        "Subspace inference at its defaults, before ("
        + args.before
        + ") and after (the inner NUTS in weight units at target_accept 0.95), "
        f"seeds {args.seeds}; one torch thread per fit; the sides alternate per fit.\n\n"
        + markdown(table)
        + "\nMeans over seeds:\n\n"
        + markdown(mean.round(4).reset_index())
        + "\nFit time ratio (mean over seeds of after / before):\n\n"
        + markdown(ratio.reset_index()),
    )


if __name__ == "__main__":
    main()
