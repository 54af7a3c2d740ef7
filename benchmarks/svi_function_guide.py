"""SVI's guide on a plain Pyro function as its dimension grows: what a full-rank guide costs per step against a
mean-field one, and how close each is to the exact posterior at SVI's defaults (issue 26, item 9).

The model is conjugate Bayesian linear regression written as a Pyro function, ``beta ~ N(0, I_D)``,
``y ~ N(X beta, 1)``, on ``N = max(2 D, 50)`` rows whose covariates share one common factor (correlation
:data:`RHO` between any two), so the coefficients' posterior is strongly correlated; its exact posterior is
``N(P^-1 X^T y, P^-1)`` with ``P = I + X^T X``.

Two measurements per dimension ``D`` (``--dims``), both guides side by side in one run:

- ``ms_per_step``: the marginal cost of one SVI step, ``(t(long) - t(short)) / (long - short)`` with the fastest of
  ``--repeats`` timings each (``_common.per_step``), from the default start (the Laplace approximation, whose cost
  is the same in both runs and drops out), with SVI's default ``lr`` for the guide; ``ms_per_step_median_start``
  the same from ``init="median"`` (the guide's own ``init_scale``): the step's arithmetic is the same, so a
  difference between the two is the machine's (a probe once found the Laplace start 2.6x slower at D = 500, and
  nothing once torch.set_flush_denormal was on; the benchmark's runs did not reproduce the gap);
- at the defaults (``bp.fit(model, x, y, method="svi", guide=g, seed=0)``: Laplace start, 5,000 steps, 1,000 draws;
  only for ``D`` in ``--quality-dims``): the fit's wall time, the largest ``|mean - exact| / exact sd``, the range of
  the draws' sd over the exact sd, and whether the fit warned. ``full_rank lr=0.01`` repeats the full-rank fit at
  the mean-field guide's rate, and ``full_rank`` at a quarter of its default rate, to see whether the lower default
  rate of a large full-rank guide (``svi_lr.default_lr``) costs or saves accuracy when the guide starts at the
  Laplace approximation.

Run from the repository root: ``python benchmarks/svi_function_guide.py``. Writes
``benchmarks/results/svi_function_guide/results.md`` and ``results.csv`` (after every row). One torch thread.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import pandas as pd
import pyro
import pyro.distributions as dist
import torch
from _common import markdown, per_step, results_dir, write_result

import bnn_pyro as bp
from bnn_pyro.infer.svi_lr import default_lr
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

RHO = 0.9
"""Correlation between any two covariates (one shared factor): the coefficients' posterior correlations are strong."""
VARIANTS = (("mean_field", None), ("full_rank", None), ("full_rank", 1e-2), ("full_rank", "quarter"))
"""(guide, lr): ``None`` SVI's default rate, a number that rate given, ``"quarter"`` a quarter of the default."""


def problem(dim: int, seed: int = 0):
    """``(model, x, y, exact_mean, exact_sd)`` for the conjugate regression of the module docstring."""
    n = max(2 * dim, 50)
    g = torch.Generator().manual_seed(seed)
    x = RHO**0.5 * torch.randn(n, 1, generator=g) + (1 - RHO) ** 0.5 * torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, generator=g) + torch.randn(n, generator=g)

    def model(x, y=None):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([dim]).to_event(1))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(x @ beta, 1.0), obs=y)

    xd, yd = x.double(), y.double()
    cov = torch.linalg.inv(torch.eye(dim, dtype=torch.float64) + xd.T @ xd)
    return model, x, y, (cov @ xd.T @ yd).numpy(), cov.diagonal().sqrt().numpy()


def step_cost(model, x, y, guide: str, short: int, long: int, repeats: int, init: str | None = None) -> float:
    def run(steps: int) -> None:
        bp.fit(model, x, y, method="svi", guide=guide, init=init, num_steps=steps, num_samples=2, progress=False,
               seed=0)  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 20-step fit has not converged: its warnings are not what is measured
        return per_step(run, short, long, repeats)


def at_defaults(model, x, y, mean, sd, guide: str, lr) -> dict:
    extra = {} if lr is None else {"lr": lr}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        start = time.perf_counter()
        post = bp.fit(model, x, y, method="svi", guide=guide, seed=0, progress=False, **extra)
        fit_s = time.perf_counter() - start
    draws = post.samples["beta"].reshape(-1, len(mean)).double().numpy()
    ratio = draws.std(0) / sd
    warned = [str(w.message)[:160] for w in caught if issubclass(w.category, DiagnosticWarning)]
    return dict(
        fit_s=fit_s,
        max_abs_z_sd=float(np.abs((draws.mean(0) - mean) / sd).max()),
        sd_ratio_min=float(ratio.min()),
        sd_ratio_max=float(ratio.max()),
        warned=" | ".join(warned) if warned else "no",
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="10,100,200,500,1000,2000")
    parser.add_argument("--quality-dims", default="10,100,200,500", help="dims also fitted at the defaults")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder, rows = results_dir("svi_function_guide", args.out), []
    quality = {int(d) for d in args.quality_dims.split(",")}
    for dim in (int(d) for d in args.dims.split(",")):
        model, x, y, mean, sd = problem(dim)
        short, long = (10, 60) if dim >= 1000 else (20, 220)
        repeats = args.repeats if dim < 1000 else 1  # the Laplace start's Hessian costs dim gradient passes per fit
        for guide, spec in VARIANTS:
            lr = 0.25 * default_lr(guide, dim) if spec == "quarter" else spec
            if lr is not None and (dim not in quality or lr == default_lr(guide, dim)):
                continue  # another rate only where it differs from the default, at the defaults' fits
            row = dict(dim=dim, guide=guide, lr=default_lr(guide, dim) if lr is None else lr)
            row["lr_given"] = "default" if lr is None else ("quarter of default" if spec == "quarter" else "given")
            if lr is None:
                row["ms_per_step"] = step_cost(model, x, y, guide, short, long, repeats)
                row["ms_per_step_median_start"] = step_cost(model, x, y, guide, short, long, repeats, "median")
            if dim in quality:
                row |= at_defaults(model, x, y, mean, sd, guide, lr)
            rows.append(row)
            print(row, flush=True)
            _write(rows, folder)


def _write(rows: list, folder) -> None:
    table = pd.DataFrame(rows)
    mf = table[table.guide == "mean_field"].set_index("dim")["ms_per_step"]
    table["step_cost_vs_mean_field"] = table["ms_per_step"] / table["dim"].map(mf)
    table = table.round(4)
    table.to_csv(folder / "results.csv", index=False)
    write_result(
        folder / "results.md",
        "SVI on a conjugate Bayesian linear regression written as a Pyro function (`beta ~ N(0, I_D)`, noise sd 1, "
        f"N = max(2D, 50) rows, covariates correlated at {RHO}: `benchmarks/svi_function_guide.py`), one torch "
        "thread. `ms_per_step`: marginal ms per SVI step from the default (Laplace) start (fastest of the repeats, "
        "long minus short run; one repeat from D = 1,000); `ms_per_step_median_start`: the same from "
        "`init='median'`; `step_cost_vs_mean_field`: its ratio to the mean-field guide's at the same D, measured in "
        "the same run (compare ratios only: shared machine); `lr`: the rate used (SVI's default for the guide "
        "unless `lr_given` says otherwise). At the defaults (Laplace start, 5,000 steps, 1,000 draws, seed 0): `fit_s` the fit's "
        "wall time, `max_abs_z_sd` the largest |mean - exact| / exact sd, `sd_ratio_*` the draws' sd over the exact "
        "sd (1,000 draws: each ratio has a Monte Carlo sd of about 0.022), `warned` the fit's DiagnosticWarnings.\n\n"
        + markdown(table),
    )


if __name__ == "__main__":
    main()
