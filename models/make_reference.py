"""Regenerate the zoo's reference posteriors: ``python -m bnn_pyro.models.make_reference [NAME ...]``.

Each reference is one JSON file ``models/reference/<name>.json`` (posteriordb style, see
``models/reference/README.md``): the function-space summary of the posterior at fixed inputs
(mean, sd and their Monte Carlo standard errors, R-hat and ESS of ``f(x)``) and the provenance
(engine, settings, seed, diagnostics, versions, date, wall time). The NUTS reference (8 chains x
4,000 iterations, the fast path's flat-vector NUTS) takes minutes to tens of minutes, the analytic one a second
(its wall time is in the file's provenance).
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import arviz as az
import numpy as np
import pyro
import torch

import bnn_pyro as bp

FOLDER = Path(__file__).resolve().parent / "reference"

# name -> (hyper-parameters of the entry, reference inputs, engine settings)
NUTS_REFERENCES = {
    "mlp_regression": dict(
        hyper={"hidden": 10},
        x=torch.linspace(-2.5, 2.5, 15)[:, None],
        settings=dict(num_samples=3000, num_warmup=1000, num_chains=8, max_tree_depth=7, seed=0, init="net"),
    ),
}


def function_summary(f: np.ndarray) -> dict[str, list]:
    """ArviZ statistics of ``f`` draws shaped ``(chains, draws, J)``: mean, sd, mcse_mean, mcse_sd,
    ess_bulk, ess_tail, r_hat, one value per input; and each chain's own mean and sd (``chain_mean``,
    ``chain_sd``: ``chains`` lists of ``J``), from which :func:`chain_se` gives chain-level standard errors.
    On a multimodal posterior (BNN weights) chains that settle in different modes make the error of ``f``'s
    moments larger than ArviZ's MCSE (from its ESS estimate) says: on mlp_regression the chain-level SEs were
    1.2-2x ArviZ's; the spread between the chains' own moments shows it."""
    ds = az.convert_to_dataset({"f": f})
    stats = dict(
        mean=f.mean((0, 1)),
        sd=f.std((0, 1), ddof=1),
        mcse_mean=az.mcse(ds, method="mean")["f"].values,
        mcse_sd=az.mcse(ds, method="sd")["f"].values,
        ess_bulk=az.ess(ds, method="bulk")["f"].values,
        ess_tail=az.ess(ds, method="tail")["f"].values,
        r_hat=az.rhat(ds)["f"].values,
    )
    out = {k: np.asarray(v, dtype=float).reshape(-1).tolist() for k, v in stats.items()}
    out["chain_mean"] = np.asarray(f.mean(1), dtype=float).tolist()
    out["chain_sd"] = np.asarray(f.std(1, ddof=1), dtype=float).tolist()
    return out


def chain_se(summary: dict, stat: str) -> list[float]:
    """Standard errors of the pooled ``stat`` (``"mean"`` or ``"sd"``) per input: the larger of ArviZ's MCSE and
    the spread of the chains' own values over ``sqrt(chains)`` (chains as independent replicates; needs 2 or more
    and a summary that holds ``chain_<stat>``, else ArviZ's MCSE alone)."""
    mcse = summary[f"mcse_{stat}"]
    chains = summary.get(f"chain_{stat}")
    if not chains or len(chains) < 2:
        return list(mcse)
    spread = np.asarray(chains, dtype=float).std(0, ddof=1) / np.sqrt(len(chains))
    return np.maximum(np.asarray(mcse, dtype=float), spread).tolist()


def provenance(**fields) -> dict:
    return dict(
        fields,
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyro": pyro.__version__,
            "arviz": az.__version__,
            "bnn_pyro": bp.__version__,
        },
        machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def exact_blr(num_draws: int = 1000, seed: int = 0) -> dict:
    """Bayesian linear regression: exact function-space moments, and exact iid draws of the weights."""
    entry = bp.zoo.load("bayesian_linear_regression")
    mean, cov = entry.exact_posterior()
    x = entry.x_test[:15]
    X1 = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    g = torch.Generator().manual_seed(seed)
    draws = mean + torch.randn(num_draws, 3, generator=g, dtype=torch.double) @ torch.linalg.cholesky(cov).T
    zeros = [0.0] * len(x)
    return dict(
        name="bayesian_linear_regression",
        hyper={},
        x=x.tolist(),
        f=dict(
            mean=(X1 @ mean).tolist(),
            sd=torch.einsum("ij,jk,ik->i", X1, cov, X1).sqrt().tolist(),
            mcse_mean=zeros,
            mcse_sd=zeros,
        ),
        draws={"weight": draws[:, :2].tolist(), "bias": draws[:, 2].tolist()},
        provenance=provenance(
            engine="analytic (conjugate Gaussian posterior, closed form)",
            seed=seed,
            settings={"num_draws": num_draws},
            note="f moments are exact (MCSE 0); draws are "
            "iid from the exact posterior via its Cholesky factor, seeded generator.",
        ),
        acceptance={"accepted": True, "criteria": "exact"},
    )


def nuts_reference(name: str, hyper: dict, x: torch.Tensor, settings: dict) -> dict:
    entry = bp.zoo.load(name, **hyper)
    start = time.perf_counter()
    post = entry.fit("nuts", progress=False, **settings)
    wall = time.perf_counter() - start
    f = bp.diagnostics.function_draws(post, x)[..., 0].double().numpy()
    summary = function_summary(f)
    weights = post.summary(space="weights", warn=False)
    stats = post.sample_stats
    divergences = int(stats["diverging"].sum())
    total = post.num_chains * post.num_draws
    checks = {
        "max_r_hat_f < 1.05": max(summary["r_hat"]) < 1.05,
        "min_ess_bulk_f >= 100": min(summary["ess_bulk"]) >= 100,
        "divergences <= 1% of draws": divergences <= 0.01 * total,
    }
    return dict(
        name=name,
        hyper=hyper,
        x=x.tolist(),
        f=summary,
        provenance=provenance(
            engine=(
                "bnn_pyro NUTS ("
                + (
                    "flat-vector multinomial NUTS, compiled leapfrog"
                    if post.config["fast_path"]
                    else "Pyro NUTS, multinomial, jit"
                )
                + ", diagonal mass matrix)"
            ),
            seed=settings["seed"],
            settings=settings,
            wall_time_s=round(wall, 1),
            divergences=divergences,
            max_r_hat_weights=float(weights["r_hat"].max()),
            min_ess_bulk_weights=float(weights["ess_bulk"].min()),
            mean_tree_depth=float(stats["tree_depth"].float().mean()),
            mean_leapfrog_steps=float(stats["n_steps"].float().mean()),
            step_size=[float(s) for s in stats["step_size"][:, -1]],
            config=post.config,
        ),
        acceptance={"accepted": all(checks.values()), "checks": checks},
    )


def dumps(ref: dict) -> str:
    """Compact, diff-friendly JSON: one top-level key per line, floats to 6 significant digits."""

    def rounded(v):
        if isinstance(v, float):
            return float(f"{v:.6g}")
        if isinstance(v, dict):
            return {k: rounded(u) for k, u in v.items()}
        return [rounded(u) for u in v] if isinstance(v, list) else v

    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(rounded(v))}" for k, v in ref.items()) + "\n}\n"


def main(names: list[str]) -> None:
    FOLDER.mkdir(exist_ok=True)
    todo = names or ["bayesian_linear_regression", *NUTS_REFERENCES]
    for name in todo:
        ref = exact_blr() if name == "bayesian_linear_regression" else nuts_reference(name, **NUTS_REFERENCES[name])
        path = FOLDER / f"{name}.json"
        path.write_text(dumps(ref))
        print(f"{name}: wrote {path} (accepted: {ref['acceptance']})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
