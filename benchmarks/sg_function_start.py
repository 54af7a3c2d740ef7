"""sgld and sghmc on the plain Pyro-function references (``tests/reference``): where a chain starts, with the update
whitened by the Hessian at the mode (:mod:`bnn_pyro.infer.sg_metric`).

Two starts, side by side in one run: ``dispersed`` (the default: each chain at its own draw from
``N(mode, 4 H^{-1})``) and ``mode`` (every chain at the mode, as csgmcmc starts; selected here by replacing the
plan's ``metric`` field, which no option exposes). Two settings, each with 4 chains: the defaults otherwise
(500 draws after 5,000 warm-up steps per chain), and a short run (``num_warmup=0``, 100 draws at ``thin=1``) that
has had no time to forget its start. Per row: the largest ``|mean - exact| / sd``, the sd ratios, the reference
suite's SG-MCMC verdict (``tests/reference/posteriors.py``'s ``biased_off``), the largest R-hat and smallest bulk
ESS of the parameters (ArviZ), and the largest distance of a chain's first state from the exact mean in posterior
sds (how dispersed the starts are). The question: does R-hat see a run that has not mixed when the chains start
apart, and does the default's accuracy depend on the start?

Run from the repository root: ``python benchmarks/sg_function_start.py``. Writes
``benchmarks/results/reference_suite/<name>.md`` and ``.csv`` (default ``function_sgld_sghmc_start``). One torch
thread per fit.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import arviz as az
import numpy as np
import pandas as pd
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL, biased_off, flat_draws, judge  # noqa: E402

import bnn_pyro as bp  # noqa: E402
import bnn_pyro.infer.sgmcmc as sgmcmc  # noqa: E402

SETTINGS = {"defaults": {}, "short": dict(num_warmup=0, num_samples=100, thin=1)}
STARTS = ["dispersed", "mode"]


def fit(ref, method: str, start: str, options: dict):
    """``bp.fit`` with 4 chains, the plan's start set to ``start``."""
    plan_of = sgmcmc._plan

    def planned(cfg, model, *, friction):
        plan, settings = plan_of(cfg, model, friction=friction)
        return (replace(plan, metric=start) if plan.metric is not None else plan), settings

    sgmcmc._plan = planned
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bp.fit(ref.model, ref.x, ref.y, method=method, num_chains=4, seed=0, progress=False, **options)
    finally:
        sgmcmc._plan = plan_of


def row(ref, method: str, start: str, setting: str) -> dict:
    begin = time.perf_counter()
    post = fit(ref, method, start, SETTINGS[setting])
    seconds = time.perf_counter() - begin
    j, d = judge(ref, post), flat_draws(post, ref)
    data = az.convert_to_dataset({n: d[..., i] for i, n in enumerate(ref.names)})
    rhat, ess = az.rhat(data), az.ess(data, method="bulk")
    first = np.abs((d[:, 0, :] - ref.mean) / ref.sd).max()  # the chains' first draws, in posterior sds
    return dict(
        reference=ref.name,
        method=method,
        setting=setting,
        start=start,
        max_abs_z_sd=np.abs(j["z"]).max(),
        sd_ratio_min=j["ratio"].min(),
        sd_ratio_max=j["ratio"].max(),
        verdict="matched" if not biased_off(ref, post) else "off",
        max_rhat=max(float(rhat[n]) for n in ref.names),
        min_bulk_ess=min(float(ess[n]) for n in ref.names),
        first_draw_max_abs_z=first,
        fit_s=seconds,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="function_sgld_sghmc_start")
    parser.add_argument("--only", default=None, help="comma-separated references (default: the three functions)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = list(ALL) if args.only is None else args.only.split(",")
    folder, rows = results_dir("reference_suite", args.out), []
    for name in names:
        ref = ALL[name]()
        for setting in SETTINGS:
            for method in ("sgld", "sghmc"):
                for start in STARTS:  # side by side
                    rows.append(row(ref, method, start, setting))
                    print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
                    table = pd.DataFrame(rows).round(3)
                    table.to_csv(folder / f"{args.name}.csv", index=False)
                    write_result(
                        folder / f"{args.name}.md",
                        "sgld and sghmc on the Pyro-function references, whitened by the Hessian at the mode, with 4 "
                        "chains started at their own draws from N(mode, 4 H^-1) (`dispersed`, the default) or all at "
                        "the mode (`mode`); `defaults`: 500 draws after 5,000 warm-up steps per chain; `short`: no "
                        "warm-up, 100 draws at thin=1. `max_abs_z_sd`: largest |mean - exact| / exact sd; "
                        "`sd_ratio_*`: draws' sd / exact sd; `verdict`: the reference suite's SG-MCMC rule; "
                        "`max_rhat`, `min_bulk_ess`: ArviZ over the parameters; `first_draw_max_abs_z`: the chains' "
                        "first kept draws, largest distance from the exact mean in sds; `fit_s`: wall time on a "
                        "shared 2-core machine (compare within the table only).\n\n" + markdown(table),
                    )


if __name__ == "__main__":
    main()
