"""Why Metropolis and MALA missed kidiq at their defaults, and what the Laplace start does for each MCMC engine on the
plain Pyro function references (issue 26, docs/reference_suite.md).

Each row is one ``bp.fit(model, x, y, method=m, seed=0)`` on a reference of ``tests/reference`` with ``variant``:

- ``prior``: the start before the Laplace start (a prior draw per chain, the metric adapted from the identity,
  diagonal): ``MODE_START`` switched off on the engine's config, i.e. main's path;
- ``laplace``: ``MODE_START`` on: chains at draws of ``N(mode, 4 H^-1)``, the dense metric adaptation from ``H^-1``
  where the Laplace approximation's PSIS ``k_hat`` is at most 0.7 (``bnn_pyro/infer/_mode_start.py``).

Columns: ``max_abs_z_sd`` (largest ``|mean - exact| / exact sd``), the sd ratios, the smallest bulk ESS and largest
R-hat over the parameters (ArviZ), ``ess_per_s`` (that ESS per second of the fit), ``leapfrog_per_draw`` (NUTS/HMC),
``adapted_var0``: the range over chains of the adapted metric's first diagonal entry (the intercept's variance in
unconstrained coordinates) against ``laplace_var0``, ``H^{-1}``'s, and the fit's DiagnosticWarnings.

Run from the repository root: ``python benchmarks/mcmc_function_start.py [--runs method:reference:variant:n,...]``
(``n``: ``num_samples`` = ``num_warmup``; ``n/w``: ``n`` draws after ``w`` warm-up iterations). Writes
``benchmarks/results/reference_suite/<name>.md/.csv`` (``--name``, default ``function_mh_cause``). One torch thread.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import arviz as az
import numpy as np
import pandas as pd
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL, judge  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import mala, mcmc  # noqa: E402
from bnn_pyro.infer._mode_start import mode_start  # noqa: E402
from bnn_pyro.infer.training_data import Data  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

CONFIGS = {"metropolis": mcmc.MetropolisConfig, "mala": mala.MALAConfig, "nuts": mcmc.NUTSConfig, "hmc": mcmc.HMCConfig}
DEFAULT_RUNS = (
    "metropolis:kidiq:prior:1000,metropolis:kidiq:prior:1000/5000,metropolis:kidiq:laplace:1000,"
    "mala:kidiq:prior:1000,mala:kidiq:prior:1000/5000,mala:kidiq:laplace:1000,"
    "nuts:kidiq:laplace:250,nuts:kidiq:prior:250,hmc:kidiq:laplace:250,hmc:kidiq:prior:250,"
    "nuts:logistic:laplace:250,nuts:logistic:prior:250,hmc:logistic:laplace:250,hmc:logistic:prior:250"
)


def _columns(v: torch.Tensor) -> np.ndarray:
    return v.reshape(v.shape[0], v.shape[1], -1).double().numpy()


def run(method: str, name: str, variant: str, spec: str) -> dict:
    ref = ALL[name]()
    n, _, w = spec.partition("/")
    num_samples, num_warmup = int(n), int(w or n)
    config = CONFIGS[method]
    before = config.MODE_START
    config.MODE_START = variant == "laplace"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DiagnosticWarning)
            start = time.perf_counter()
            post = bp.fit(
                ref.model,
                ref.x,
                ref.y,
                method=method,
                seed=0,
                progress=False,
                num_samples=num_samples,
                num_warmup=num_warmup,
            )
            fit_s = time.perf_counter() - start
    finally:
        config.MODE_START = before
    cols = [_columns(v) for k, v in post.samples.items() if k != "f"]
    draws = np.concatenate(cols, axis=-1)
    ess = [float(az.ess(draws[..., i], method="bulk")) for i in range(draws.shape[-1])]
    rhat = [float(az.rhat(draws[..., i])) for i in range(draws.shape[-1])]
    j = judge(ref, post)
    imm = post.history["inverse_mass_matrix"]
    var0 = (imm[:, 0, 0] if imm.dim() == 3 else imm[:, 0]).double()
    laplace = mode_start(ref.model, Data(ref.x, ref.y, dataset_size=len(ref.x)), num_chains=1, seed=0, fast_path=True)
    messages = [str(m.message)[:160] for m in caught if issubclass(m.category, DiagnosticWarning)]
    return dict(
        method=method,
        reference=name,
        variant=variant,
        num_warmup=num_warmup,
        num_samples=num_samples,
        chains=post.num_chains,
        fit_s=fit_s,
        max_abs_z_sd=float(np.abs(j["z"]).max()),
        sd_ratio_min=float(j["ratio"].min()),
        sd_ratio_max=float(j["ratio"].max()),
        min_bulk_ess=min(ess),
        max_rhat=max(rhat),
        ess_per_s=min(ess) / fit_s,
        leapfrog_per_draw=float(post.sample_stats["n_steps"].double().mean())
        if "n_steps" in post.sample_stats
        else None,
        start=post.config.get("start", "prior"),
        laplace_k_hat=post.config.get("laplace_k_hat"),
        adapted_var0=f"{float(var0.min()):.3g}-{float(var0.max()):.3g}",
        laplace_var0=float(laplace.cov[0, 0]),
        warnings=" | ".join(messages) or "none",
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated method:reference:variant:n[/warmup]")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="function_mh_cause")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder, rows = results_dir("reference_suite", args.out), []
    for item in args.runs.split(","):
        method, name, variant, spec = item.split(":")
        rows.append(run(method, name, variant, spec))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        table = pd.DataFrame(rows).round(4)
        table.to_csv(folder / f"{args.name}.csv", index=False)
        write_result(
            folder / f"{args.name}.md",
            "MCMC engines on the plain Pyro function references (`tests/reference`), `seed=0`, 4 chains, one torch "
            "thread: `prior` = the start before the Laplace start (prior draws, a diagonal metric from the identity), "
            "`laplace` = over-dispersed draws of the Laplace approximation and a dense metric from `H^-1` "
            "(`bnn_pyro/infer/_mode_start.py`). `adapted_var0`: the adapted metric's first diagonal entry (the "
            "intercept's variance) over chains, against `laplace_var0` (`H^-1`'s); `fit_s` and `ess_per_s` on a shared "
            "2-core machine (compare within the table only).\n\n" + markdown(table),
        )


if __name__ == "__main__":
    main()
