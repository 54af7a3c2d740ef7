"""Why Metropolis and MALA missed kidiq at their defaults, and what the Laplace start does for each MCMC engine on the
plain Pyro function references (issue 26, docs/reference_suite.md).

Each row is one ``bp.fit(model, x, y, method=m, seed=0)`` on a reference of ``tests/reference`` with ``variant``:

- ``prior``: the start before the Laplace start (a prior draw per chain, the metric adapted from the identity,
  diagonal): ``MODE_START`` switched off on the engine's config, i.e. main's path;
- ``laplace``: ``MODE_START`` on: chains at draws of ``N(mode, 4 H^-1)``, the dense metric adaptation from ``H^-1``
  where the Laplace approximation's PSIS ``k_hat`` is at most 0.7 (``bnn_pyro/infer/_mode_start.py``);
- ``laplace_oldstep``: ``laplace`` without rerunning Pyro's initial step-size search after ``H^-1`` is set (NUTS/HMC
  on Pyro's kernels: the search ran under the identity metric only, as before that fix).

A run may add fit options after its size, ``method:reference:variant:n:key=value;key=value`` (e.g.
``num_leapfrog=4``, ``trajectory_length=1.57``), and ``--chain-method`` sets how chains run (default
``sequential``: in this process, so that the warm-up's leapfrog steps can be counted).

Columns: ``max_abs_z_sd`` (largest ``|mean - exact| / exact sd``), the sd ratios, the smallest bulk ESS and largest
R-hat over the parameters (ArviZ), ``ess_per_s`` (that ESS per second of the fit), ``leapfrog_per_draw`` (NUTS/HMC),
``adapted_var0``: the range over chains of the adapted metric's first diagonal entry (the intercept's variance in
unconstrained coordinates) against ``laplace_var0``, ``H^{-1}``'s, and the fit's DiagnosticWarnings.

Why HMC's draws mix as they do (NUTS/HMC): ``step`` (the adapted step size, mean over chains), ``accept`` (mean
acceptance of the kept draws), ``warmup_leapfrog`` (leapfrog steps per warm-up iteration, mean over chains; counted
when the chains run in this process), ``ess_per_draw`` (``min_bulk_ess`` over all kept draws), ``min_tail_ess`` (ArviZ's tail ESS, the 5% and 95%
quantiles': a trajectory that flips each draw to the other side inflates the bulk ESS, not this), ``mode_start_s``
(the Laplace start's cost: mode, Hessian and ``k_hat``, timed apart), and the trajectory against the posterior's
scales in the metric: ``s_min``/``s_max``, the smallest and largest sd of the posterior (the kept draws' covariance
in unconstrained coordinates) whitened by each chain's adapted metric (``M^{-1} = L L^T``: the singular values of
``L^{-1} Sigma^{1/2}``; 1 for a metric equal to the covariance), and ``rho_slow``/``rho_fast``, the lag-1
autocorrelation an exact Gaussian with those sds would show along those directions under the run's steps:
``mean cos(n * theta)`` over the kept draws, ``n`` the draw's leapfrog steps and ``cos theta = 1 - h^2 / (2 s^2)`` the
leapfrog's rotation per step of size ``h`` (Neal 2011, sec. 5.4.2.2; rejections ignored). Near 0: independent draws;
negative: antithetic (bulk ESS above the number of draws).

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
from pyro import poutine  # noqa: E402
from reference.posteriors import ALL, judge  # noqa: E402
from torch.distributions import biject_to  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import _kernels, mala, mcmc  # noqa: E402
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


def _option(text: str):
    key, _, value = text.partition("=")
    return key, (float(value) if "." in value else int(value))


def _unconstrained(model, x, y, samples: dict) -> dict[str, torch.Tensor]:
    """The draws of each latent site mapped to unconstrained coordinates, flattened: ``(chains, draws, size)``."""
    trace = poutine.trace(model).get_trace(x, y)
    out = {}
    for site, node in trace.nodes.items():
        if node["type"] == "sample" and not node["is_observed"] and site in samples:
            value = biject_to(node["fn"].support).inv(samples[site].double())
            out[site] = value.reshape(*value.shape[:2], -1)
    return out


def _trajectory(post, ref, method: str) -> dict:
    """The columns on step, acceptance and trajectory against the whitened posterior scales (module docstring)."""
    stats = post.sample_stats
    if "n_steps" not in stats:
        return {}
    flat = _unconstrained(ref.model, ref.x, ref.y, post.samples)
    z = torch.cat([flat[k] for k in sorted(flat)], -1)  # Pyro's kernels order the sites by name
    pooled = z.reshape(-1, z.shape[-1])
    cov = torch.cov(pooled.T).reshape(z.shape[-1], z.shape[-1])
    imm = post.history["inverse_mass_matrix"].double()
    s_min, s_max, rho_slow, rho_fast = [], [], [], []
    root = torch.linalg.cholesky(cov)
    for c in range(imm.shape[0]):
        chol = torch.linalg.cholesky(imm[c]) if imm.dim() == 3 else torch.diag(imm[c].sqrt())
        sv = torch.linalg.svdvals(torch.linalg.solve_triangular(chol, root, upper=False))
        h, n = stats["step_size"][c].double(), stats["n_steps"][c].double()
        for sd, rho in ((sv.max(), rho_slow), (sv.min(), rho_fast)):
            theta = torch.arccos((1 - h**2 / (2 * sd**2)).clamp(-1, 1))
            rho.append(float(torch.cos(n * theta).mean()))
        s_min.append(float(sv.min()))
        s_max.append(float(sv.max()))
    return dict(
        step=float(stats["step_size"].double().mean()),
        accept=float(stats["acceptance_rate"].double().mean()),
        s_min=float(np.mean(s_min)),
        s_max=float(np.mean(s_max)),
        rho_slow=float(np.mean(rho_slow)),
        rho_fast=float(np.mean(rho_fast)),
    )


def run(method: str, name: str, variant: str, spec: str, options: dict, chain_method: str) -> dict:
    ref = ALL[name]()
    n, _, w = spec.partition("/")
    num_samples, num_warmup = int(n), int(w or n)
    config = CONFIGS[method]
    before, search = config.MODE_START, _kernels.restart_step_size_search
    config.MODE_START = variant.startswith("laplace")
    if variant == "laplace_oldstep":  # the code before the fix: no step-size search under H^-1
        _kernels.restart_step_size_search = lambda kernel, step, z: None
    counts: dict[int, list[int]] = {}
    sample = _kernels._Counted.sample

    def counted(kernel, params):
        z = sample(kernel, params)
        counts.setdefault(id(kernel), []).append(kernel.stats.n_steps)
        return z

    _kernels._Counted.sample = counted
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
                chain_method=chain_method,
                **options,
            )
            fit_s = time.perf_counter() - start
    finally:
        config.MODE_START, _kernels.restart_step_size_search, _kernels._Counted.sample = before, search, sample
    warmup_steps = [sum(v[:num_warmup]) / num_warmup for v in counts.values()]
    cols = [_columns(v) for k, v in post.samples.items() if k != "f"]
    draws = np.concatenate(cols, axis=-1)
    ess = [float(az.ess(draws[..., i], method="bulk")) for i in range(draws.shape[-1])]
    tail = [float(az.ess(draws[..., i], method="tail")) for i in range(draws.shape[-1])]
    rhat = [float(az.rhat(draws[..., i])) for i in range(draws.shape[-1])]
    j = judge(ref, post)
    imm = post.history["inverse_mass_matrix"]
    var0 = (imm[:, 0, 0] if imm.dim() == 3 else imm[:, 0]).double()
    start = time.perf_counter()
    laplace = mode_start(ref.model, Data(ref.x, ref.y, dataset_size=len(ref.x)), num_chains=4, seed=0, fast_path=True)
    mode_start_s = time.perf_counter() - start
    messages = [str(m.message)[:160] for m in caught if issubclass(m.category, DiagnosticWarning)]
    return dict(
        method=method,
        reference=name,
        variant=variant,
        options=";".join(f"{k}={v}" for k, v in options.items()) or "defaults",
        num_warmup=num_warmup,
        num_samples=num_samples,
        chains=post.num_chains,
        fit_s=fit_s,
        max_abs_z_sd=float(np.abs(j["z"]).max()),
        sd_ratio_min=float(j["ratio"].min()),
        sd_ratio_max=float(j["ratio"].max()),
        min_bulk_ess=min(ess),
        min_tail_ess=min(tail),
        max_rhat=max(rhat),
        ess_per_s=min(ess) / fit_s,
        leapfrog_per_draw=float(post.sample_stats["n_steps"].double().mean())
        if "n_steps" in post.sample_stats
        else None,
        warmup_leapfrog=float(np.mean(warmup_steps)) if warmup_steps else None,
        ess_per_draw=min(ess) / (post.num_chains * num_samples),
        mode_start_s=mode_start_s,
        **_trajectory(post, ref, method),
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
    parser.add_argument("--chain-method", default="sequential", help="bp.fit's chain_method for every run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder, rows = results_dir("reference_suite", args.out), []
    for item in args.runs.split(","):
        method, name, variant, spec, *extra = item.split(":")
        options = dict(_option(o) for o in extra[0].split(";")) if extra else {}
        rows.append(run(method, name, variant, spec, options, args.chain_method))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        table = pd.DataFrame(rows).round(4)
        table.to_csv(folder / f"{args.name}.csv", index=False)
        write_result(
            folder / f"{args.name}.md",
            "MCMC engines on the plain Pyro function references (`tests/reference`), `seed=0`, 4 chains "
            f"(`chain_method={args.chain_method!r}`), one torch "
            "thread: `prior` = the start before the Laplace start (prior draws, a diagonal metric from the identity), "
            "`laplace` = over-dispersed draws of the Laplace approximation and a dense metric from `H^-1` "
            "(`bnn_pyro/infer/_mode_start.py`), `laplace_oldstep` = the same without the step-size search under "
            "`H^-1`; `options`: fit options of the row. Columns: `benchmarks/mcmc_function_start.py`'s docstring. "
            "`adapted_var0`: the adapted metric's first diagonal entry (the "
            "intercept's variance) over chains, against `laplace_var0` (`H^-1`'s); `fit_s` and `ess_per_s` on a shared "
            "2-core machine (compare within the table only).\n\n" + markdown(table),
        )


if __name__ == "__main__":
    main()
