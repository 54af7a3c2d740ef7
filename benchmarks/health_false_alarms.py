"""How often the fit-time checks that judge chains warn when every draw is an exact, independent posterior draw.

The posterior is Bayesian linear regression, known in closed form: ``y = X w + b + eps``, ``eps ~ N(0, s^2)``,
``w, b ~ N(0, 1)``, so ``(w, b) | y ~ N(m, A^-1)`` with ``A = X1^T X1 / s^2 + I`` and ``m = A^-1 X1^T y / s^2``
(``X1 = [X, 1]``). ``C`` chains of ``S`` independent draws of it are as good as chains can be: a warning that they
disagree (R-hat) is a false alarm, and one that their effective draws are too few (ESS) is true only while
``C S`` itself is below the threshold. Each check runs on ``--reps`` such posteriors per ``(C, S)``:

- :func:`~bnn_pyro.infer.health_mixing.check_mixing` (MCMC and SG-MCMC engines): bulk ESS of ``f`` at 20 training
  inputs below ``ESS_MIN`` (100, chains together), or its R-hat above ``RHAT_FIT_MAX`` (1.05), on a ``BNN`` whose net
  is one ``Linear`` layer (``f = X w + b``: 20 correlated outputs of 3 coordinates);
- :func:`~bnn_pyro.infer.health_mixing.check_chains_agree` (approximations of a Pyro function): R-hat of each parameter
  above ``max(1.05, rhat_chance_max(C, S, K))``, on the same draws as the sites ``w`` and ``b`` of a Pyro function.

The rates are fractions of ``--reps`` runs with a Monte Carlo standard error ``sqrt(p (1 - p) / reps)``.
``ess_limit`` is check_mixing's ESS threshold for ``(C, S)`` (:func:`~bnn_pyro.infer.health_mixing.ess_chance_min`;
100 before it). Power: ``mixing_ess_ar`` is how often check_mixing's ESS warning fires on chains of the same exact
posterior made autocorrelated, each chain an AR(1) ``z_t = m + rho (z_{t-1} - m) + sqrt(1 - rho^2) e_t`` (``e_t``
exact draws less the mean ``m``: every draw still exact, the chains stationary from their first draw), ``rho`` chosen
so that the true ESS, ``C S (1 - rho) / (1 + rho)``, is half of ``ess_limit`` (a warning there is true).

``mixing_ess_fixed`` replays the threshold before :func:`~bnn_pyro.infer.health_mixing.ess_chance_min`, ``ESS_MIN``
whatever ``(C, S)``, on the same draws (check_mixing run with the function replaced; it reads it from its module at each
call).

``--power`` instead writes ``power.md``: for each ``(C, S)``, how often check_mixing's ESS warning fires on AR(1)
chains (as above) whose true ESS is each of ``--true-ess`` (a true warning: its power) and on exact independent draws
(``rho = 0``, true ESS ``C S``: a false alarm), under two thresholds on the same draws: ``ess_chance_min`` as it is
(``now``) and the rule before its interpolation (``stepped``: the smaller of the table's entries at the tabulated
draws per chain either side, replayed here by :func:`stepped_limit`).

``--spread`` instead writes ``spread.md``: the bulk ESS estimate of ``C`` chains of ``S`` independent normal draws
(``--columns`` quantities each), its ratio to ``C S`` (mean, sd times ``sqrt(C S)``, low quantiles), where
:data:`~bnn_pyro.infer.health_mixing.ESS_CHANCE_QUANTILE` comes from (its 5e-4 quantile).

Usage::

    python benchmarks/health_false_alarms.py                    # C in {1, 2, 4}, S in {10, 25, 50, 100, 250}, 200 reps
    python benchmarks/health_false_alarms.py --reps 50 --draws 10,50
    python benchmarks/health_false_alarms.py --spread --chains 1,2,4 --draws 50,100,200,500,1000
    python benchmarks/health_false_alarms.py --power --chains 1 --draws 200,300,399 --true-ess 50,75 --reps 400
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import warnings

import numpy as np
import pandas as pd
import pyro
import pyro.distributions as dist
import torch
from _common import results_dir, write_result  # noqa: E402 - the script's folder is on sys.path

import bnn_pyro as bp
from bnn_pyro.infer import health_mixing
from bnn_pyro.infer.health_mixing import check_chains_agree, check_mixing
from bnn_pyro.posterior.diagnostics import from_dict
from bnn_pyro.utils.upstream_private import arviz_log_level

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


def autocorrelated(exact, chains: int, per_chain: int, rho: float) -> torch.Tensor:
    """``chains`` AR(1) chains of ``per_chain`` exact draws each with lag-1 autocorrelation ``rho`` (module
    docstring), stacked chain after chain as ``exact.sample`` would be."""
    mean = exact.mean
    noise = exact.sample((chains, per_chain)) - mean
    z = torch.empty_like(noise)
    z[:, 0] = noise[:, 0]
    for t in range(1, per_chain):
        z[:, t] = rho * z[:, t - 1] + math.sqrt(1 - rho**2) * noise[:, t]
    return (z + mean).reshape(chains * per_chain, -1)


def spread(chains: list[int], draws: list[int], columns: int, out, name: str) -> pd.DataFrame:
    """The bulk ESS estimate of independent normal draws relative to their number (module docstring)."""
    import arviz as az

    rng = np.random.default_rng(0)
    rows = []
    for c in chains:
        for s in draws:
            with arviz_log_level(logging.ERROR):
                ess = az.ess(from_dict(posterior={"v": rng.standard_normal((c, s, columns))}))["v"].values
            ratio = ess / (c * s)
            q = np.quantile(ratio, [5e-4, 1e-3, 1e-2, 5e-2, 0.5])
            row = {"chains": c, "draws_per_chain": s, "columns": columns, "mean": ratio.mean()}
            row["sd_sqrt_n"] = ratio.std() * math.sqrt(c * s)
            row.update({f"q{p:g}": v for p, v in zip((5e-4, 1e-3, 1e-2, 5e-2, 0.5), q)})
            rows.append(row)
            print(row, flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{name}.csv", index=False)
    lines = [
        "# The bulk ESS estimate of independent draws: its ratio to their number",
        "",
        "ArviZ's bulk ESS (rank-normalized, split chains) of C chains of S independent standard normal draws, "
        f"{columns} independent",
        "quantities (seed 0): the mean of ESS / (C S), its sd times sqrt(C S) and its quantiles (ESS_CHANCE_QUANTILE in",
        "bnn_pyro/infer/health_mixing.py: the 5e-4 one, rounded down). Written by `python benchmarks/health_false_alarms.py --spread`.",
        "",
        "| chains | draws per chain | mean | sd x sqrt(N) | q 0.0005 | q 0.001 | q 0.01 | q 0.05 | median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chains']} | {r['draws_per_chain']} | {r['mean']:.3f} | {r['sd_sqrt_n']:.2f} | {r['q0.0005']:.3f} | "
            f"{r['q0.001']:.3f} | {r['q0.01']:.3f} | {r['q0.05']:.3f} | {r['q0.5']:.3f} |"
        )
    write_result(out / f"{name}.md", "\n".join(lines) + "\n")
    return table


def stepped_limit(num_chains: int, num_draws: int) -> float:
    """``ess_chance_min`` before its interpolation: the table's entry at the largest tabulated chain count and draws
    per chain not above the fit's, or the next tabulated draws per chain if that is smaller."""
    n = num_chains * num_draws
    if n < health_mixing.ESS_MIN or num_draws < 10:
        return float(health_mixing.ESS_MIN)
    row = health_mixing.ESS_CHANCE_QUANTILE[max(c for c in health_mixing.ESS_CHANCE_QUANTILE if c <= num_chains)]
    below = max(s for s in row if s <= num_draws)
    above = min((s for s in row if s > num_draws), default=below)
    return float(min(health_mixing.ESS_MIN, n * min(row[below], row[above])))


def power(chains: list[int], draws: list[int], true_ess: list[float], reps: int, out, name: str) -> pd.DataFrame:
    """check_mixing's ESS warning on AR(1) chains of a given true ESS and on exact draws, under ``ess_chance_min``
    and :func:`stepped_limit` on the same draws (module docstring)."""
    x, y, exact = exact_posterior()
    rules = {"now": health_mixing.ess_chance_min, "stepped": stepped_limit}
    rows = []
    for c in chains:
        for s in draws:
            n = c * s
            for ess in [float(n)] + [e for e in true_ess if e < n]:
                rho = (n - ess) / (n + ess)  # true ESS n (1 - rho) / (1 + rho)
                counts = dict.fromkeys(rules, 0)
                for rep in range(reps):
                    torch.manual_seed(5000 + rep)
                    draws_ = exact.sample((n,)) if rho == 0 else autocorrelated(exact, c, s, rho)
                    net, _ = posteriors(x, y, draws_, c, s)
                    for rule, limit in rules.items():
                        with ess_rule(limit):
                            counts[rule] += alarms(check_mixing, net)[1]
                row = {"chains": c, "draws_per_chain": s, "true_ess": ess, "rho": rho, "reps": reps}
                for rule, limit in rules.items():
                    row[f"limit_{rule}"] = limit(c, s)
                    row[f"flagged_{rule}"], row[f"flagged_{rule}_se"] = rate(counts[rule], reps)
                rows.append(row)
                print(row, flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{name}.csv", index=False)
    lines = [
        "# check_mixing's ESS warning: power at a given true ESS, and false alarms on exact draws",
        "",
        "C chains of S draws of a Bayesian linear regression's exact posterior (N = 30, D = 2, noise 0.5, N(0, 1)",
        "priors): AR(1) chains of exact draws with lag-1 autocorrelation rho, true ESS C S (1 - rho) / (1 + rho); rho = 0",
        "are independent draws (true ESS C S: a warning there is a false alarm wherever C S >= 100). The fraction of",
        f"{reps} runs (seeds 5000 on) in which check_mixing's ESS warning fires, +- its Monte Carlo standard error, under",
        "ess_chance_min as it is (`now`) and the rule before its interpolation (`stepped`), on the same draws.",
        "Written by `python benchmarks/health_false_alarms.py --power`.",
        "",
        "| chains | draws per chain | true ESS | rho | limit now | flagged now | limit stepped | flagged stepped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chains']} | {r['draws_per_chain']} | {r['true_ess']:.0f} | {r['rho']:.3f} | {r['limit_now']:.1f} | "
            f"{r['flagged_now']:.3f} ± {r['flagged_now_se']:.3f} | {r['limit_stepped']:.1f} | "
            f"{r['flagged_stepped']:.3f} ± {r['flagged_stepped_se']:.3f} |"
        )
    write_result(out / f"{name}.md", "\n".join(lines) + "\n")
    return table


@contextlib.contextmanager
def ess_rule(limit):
    """check_mixing's ESS threshold replaced by ``limit(num_chains, num_draws)`` inside the block (the rule before
    ``ess_chance_min``, or its stepped version), restored after."""
    real, health_mixing.ess_chance_min = health_mixing.ess_chance_min, limit
    try:
        yield
    finally:
        health_mixing.ess_chance_min = real


def rate(count: int, reps: int) -> tuple[float, float]:
    """The fraction of ``reps`` runs that warned and its binomial Monte Carlo standard error."""
    p = count / reps
    return p, math.sqrt(p * (1 - p) / reps)


def alarms(check, post) -> tuple[bool, bool]:
    """Whether ``check(post)`` warned about R-hat, and about ESS."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(post)
    text = " ".join(str(w.message) for w in caught if issubclass(w.category, bp.diagnostics.DiagnosticWarning))
    return "R-hat of" in text, "bulk ESS" in text


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", default="1,2,4")
    parser.add_argument("--draws", default="10,25,50,100,250", help="draws per chain")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--spread", action="store_true", help="write spread.md instead (module docstring)")
    parser.add_argument("--columns", type=int, default=5000, help="--spread: quantities per (chains, draws)")
    parser.add_argument("--power", action="store_true", help="write power.md instead (module docstring)")
    parser.add_argument("--true-ess", default="50,75", help="--power: the AR(1) chains' true ESS values")
    parser.add_argument("--name", default="results")
    parser.add_argument(
        "--out", default=None, help="the folder written (default benchmarks/results/health_false_alarms/)"
    )
    args = parser.parse_args(argv)
    out = results_dir("health_false_alarms", args.out)
    chains_list, draws_list = [int(c) for c in args.chains.split(",")], [int(d) for d in args.draws.split(",")]
    if args.spread:
        return spread(chains_list, draws_list, args.columns, out, args.name)
    if args.power:
        true_ess = [float(e) for e in args.true_ess.split(",")]
        return power(chains_list, draws_list, true_ess, args.reps, out, args.name)
    x, y, exact = exact_posterior()
    rows = []
    for chains in chains_list:
        for per_chain in draws_list:
            counts = {"mixing_rhat": 0, "mixing_ess": 0, "mixing_ess_fixed": 0, "chains_agree": 0, "mixing_ess_ar": 0}
            n = chains * per_chain
            limit = health_mixing.ess_chance_min(chains, per_chain)
            rho = max(0.0, (n - limit / 2) / (n + limit / 2))  # true ESS n (1 - rho) / (1 + rho) = limit / 2
            for rep in range(args.reps):
                torch.manual_seed(1000 + rep)
                net, function = posteriors(x, y, exact.sample((n,)), chains, per_chain)
                rhat, ess = alarms(check_mixing, net)
                with ess_rule(lambda *a: float(health_mixing.ESS_MIN)):
                    counts["mixing_ess_fixed"] += alarms(check_mixing, net)[1]
                counts["mixing_rhat"] += rhat
                counts["mixing_ess"] += ess
                counts["chains_agree"] += alarms(check_chains_agree, function)[0]
                slow, _ = posteriors(x, y, autocorrelated(exact, chains, per_chain, rho), chains, per_chain)
                counts["mixing_ess_ar"] += alarms(check_mixing, slow)[1]
            row = {"chains": chains, "draws_per_chain": per_chain, "reps": args.reps, "ess_limit": limit, "rho": rho}
            for name, count in counts.items():
                row[name], row[f"{name}_se"] = rate(count, args.reps)
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
        "`mixing_ess`: check_mixing's 'bulk ESS ... (threshold ess_limit in all)', true of fewer than 100 exact draws;",
        "`chains_agree`: check_chains_agree on the same draws as a Pyro function (threshold max(1.05, rhat_chance_max)).",
        "`mixing_ess_fixed`: the same with the threshold before ess_chance_min (100 whatever C and S), same draws.",
        "`ess_limit`: check_mixing's ESS threshold here (ess_chance_min(C, S)); `mixing_ess_ar`: its ESS warning on",
        "AR(1) chains of exact draws whose true ESS is ess_limit / 2 (lag-1 autocorrelation `rho`): a true warning.",
        "Written by `python benchmarks/health_false_alarms.py`.",
        "",
        "| chains | draws per chain | draws in all | mixing_rhat | mixing_ess | mixing_ess_fixed | chains_agree "
        "| ess_limit | rho | mixing_ess_ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r[k]:.3f} ± {r[k + '_se']:.3f}"
            for k in ("mixing_rhat", "mixing_ess", "mixing_ess_fixed", "chains_agree")
        ]
        lines.append(
            f"| {r['chains']} | {r['draws_per_chain']} | {r['chains'] * r['draws_per_chain']} | "
            + " | ".join(cells)
            + f" | {r['ess_limit']:.1f} | {r['rho']:.3f} | {r['mixing_ess_ar']:.3f} ± {r['mixing_ess_ar_se']:.3f} |"
        )
    write_result(out / f"{args.name}.md", "\n".join(lines) + "\n")
    return table


if __name__ == "__main__":
    main()
