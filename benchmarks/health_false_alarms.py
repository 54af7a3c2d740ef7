"""How often the fit-time checks that judge chains warn when every draw is an exact, independent posterior draw.

The posterior is Bayesian linear regression, known in closed form: ``y = X w + b + eps``, ``eps ~ N(0, s^2)``,
``w, b ~ N(0, 1)``, so ``(w, b) | y ~ N(m, A^-1)`` with ``A = X1^T X1 / s^2 + I`` and ``m = A^-1 X1^T y / s^2``
(``X1 = [X, 1]``). ``C`` chains of ``S`` independent draws of it are as good as chains can be: a warning that they
disagree (R-hat) is a false alarm, and one that their effective draws are too few (ESS) is true only while
``C S`` itself is below the threshold. Each check runs on ``--reps`` such posteriors per ``(C, S)``:

- :func:`~bnn_pyro.infer._health.check_mixing` (MCMC and SG-MCMC engines): bulk ESS of ``f`` at 20 training
  inputs below ``ESS_MIN`` (100, chains together), or its R-hat above ``RHAT_FIT_MAX`` (1.05), on a ``BNN`` whose net
  is one ``Linear`` layer (``f = X w + b``: 20 correlated outputs of 3 coordinates);
- :func:`~bnn_pyro.infer._health.check_chains_agree` (approximations of a Pyro function): R-hat of each parameter
  above ``max(1.05, rhat_chance_max(C, S, K))``, on the same draws as the sites ``w`` and ``b`` of a Pyro function.

The rates are fractions of ``--reps`` runs with a Monte Carlo standard error ``sqrt(p (1 - p) / reps)``.

Usage::

    python benchmarks/health_false_alarms.py                    # C in {2, 4}, S in {10, 25, 50, 100, 250}, 200 reps
    python benchmarks/health_false_alarms.py --reps 50 --draws 10,50
"""

from __future__ import annotations

import argparse
import math
import warnings

import pandas as pd
import pyro
import pyro.distributions as dist
import torch
from _common import results_dir, write_result  # noqa: E402 - the script's folder is on sys.path

import bnn_pyro as bp
from bnn_pyro.infer._health import check_chains_agree, check_mixing

N, D, NOISE = 30, 2, 0.5


def exact_posterior(seed: int = 0):
    """Data and the exact posterior ``N(m, A^-1)`` of ``(w, b)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = (
        x @ torch.tensor([1.0, -0.5], dtype=torch.float64)
        + 0.3
        + NOISE * torch.randn(N, generator=g, dtype=torch.float64)
    )
    x1 = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    precision = x1.T @ x1 / NOISE**2 + torch.eye(D + 1, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    mean = cov @ x1.T @ y / NOISE**2
    return x.float(), y.float(), torch.distributions.MultivariateNormal(mean, covariance_matrix=cov)


def linear(x, y=None):
    """The same model as a Pyro function (for check_chains_agree)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(D), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ w + b, NOISE), obs=y)


def posteriors(x, y, draws: torch.Tensor, chains: int, per_chain: int):
    """The draws as a ``BNN`` posterior (method "nuts") and a Pyro-function posterior (method "swag")."""
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(D, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=NOISE),
    )
    w = draws[:, :D].float().reshape(chains, per_chain, D)
    b = draws[:, D].float().reshape(chains, per_chain)
    net = bp.Posterior(
        samples={"0.weight": w.reshape(chains, per_chain, 1, D), "0.bias": b.reshape(chains, per_chain, 1)},
        model=model,
        method="nuts",
        x=x,
        y=y,
    )
    function = bp.Posterior(samples={"w": w, "b": b}, model=linear, method="swag", x=x, y=y)
    return net, function


def alarms(check, post) -> tuple[bool, bool]:
    """Whether ``check(post)`` warned about R-hat, and about ESS."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(post)
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, bp.diagnostics.DiagnosticWarning))
    return "R-hat of" in text, "bulk ESS" in text


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", default="2,4")
    parser.add_argument("--draws", default="10,25,50,100,250", help="draws per chain")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--name", default="results")
    parser.add_argument(
        "--out", default=None, help="the folder written (default benchmarks/results/health_false_alarms/)"
    )
    args = parser.parse_args(argv)
    out = results_dir("health_false_alarms", args.out)
    x, y, exact = exact_posterior()
    rows = []
    for chains in map(int, args.chains.split(",")):
        for per_chain in map(int, args.draws.split(",")):
            counts = {"mixing_rhat": 0, "mixing_ess": 0, "chains_agree": 0}
            for rep in range(args.reps):
                torch.manual_seed(1000 + rep)
                net, function = posteriors(x, y, exact.sample((chains * per_chain,)), chains, per_chain)
                rhat, ess = alarms(check_mixing, net)
                counts["mixing_rhat"] += rhat
                counts["mixing_ess"] += ess
                counts["chains_agree"] += alarms(check_chains_agree, function)[0]
            row = {"chains": chains, "draws_per_chain": per_chain, "reps": args.reps}
            for name, count in counts.items():
                p = count / args.reps
                row[name] = p
                row[f"{name}_se"] = math.sqrt(p * (1 - p) / args.reps)
            rows.append(row)
            print(row, flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{args.name}.csv", index=False)
    lines = [
        "# Health checks on exact draws: how often each warns",
        "",
        "Exact independent draws of a Bayesian linear regression's posterior (N = 30, D = 2, noise 0.5, N(0, 1)",
        "priors), split into chains; the fraction of runs in which each check warns, +- its Monte Carlo standard error.",
        "`mixing_rhat`: check_mixing's 'R-hat of f(x) ... is up to ...' (threshold RHAT_FIT_MAX = 1.05 on 20 outputs);",
        "`mixing_ess`: check_mixing's 'bulk ESS ... (threshold 100 in all)', true of fewer than 100 exact draws;",
        "`chains_agree`: check_chains_agree on the same draws as a Pyro function (threshold max(1.05, rhat_chance_max)).",
        "Written by `python benchmarks/health_false_alarms.py`.",
        "",
        "| chains | draws per chain | draws in all | mixing_rhat | mixing_ess | chains_agree |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r[k]:.3f} ± {r[k + '_se']:.3f}" for k in ("mixing_rhat", "mixing_ess", "chains_agree")]
        lines.append(
            f"| {r['chains']} | {r['draws_per_chain']} | {r['chains'] * r['draws_per_chain']} | "
            + " | ".join(cells)
            + " |"
        )
    write_result(out / f"{args.name}.md", "\n".join(lines) + "\n")
    return table


if __name__ == "__main__":
    main()
