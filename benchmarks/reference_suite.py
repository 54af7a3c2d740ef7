"""Every engine at its defaults on the reference posteriors of ``tests/reference`` (exact means and sds, computed
independently of this library): how far each engine's draws are from the exact posterior, whether the fit warned,
and how long it took.

For each (engine, reference): the largest ``|z|`` of the means in posterior sds (``(mean - exact) / sd``), the range
of the sd ratios (draws' sd / exact sd), the largest ``|z|`` in Monte Carlo standard errors (ArviZ's ESS of the mean,
its MCSE of the sd; only where there are at least 4 draws per chain), the number of draws, the fit's
``DiagnosticWarning`` messages, or the error that refused the model. The engines that fit a Pyro function
(``Capabilities.function_model``) run on the three plain-model references; every engine runs on the two BNN
references (Bayesian linear regression, the logistic regression as ``nn.Linear(2, 1)``).

Run from the repository root: ``python benchmarks/reference_suite.py [--only linear,logistic_bnn] [--methods a,b]``.
Writes ``benchmarks/results/reference_suite/<name>.md`` and ``<name>.csv`` (``--name``, default ``results``). One torch thread per fit.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL, BNN_REFERENCES, judge  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer.registry import REGISTRY, Method  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

FUNCTION_ENGINES = [m.value for m, d in REGISTRY.items() if d.capabilities.function_model]
ALL_ENGINES = [m.value for m in Method]


def run(ref, method: str) -> dict:
    row = {"reference": ref.name + ("" if ref.columns is None else " (BNN)"), "method": method}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        start = time.perf_counter()
        try:
            post = bp.fit(ref.model, ref.x, ref.y, method=method, seed=0, progress=False)
        except Exception as err:  # noqa: BLE001 - a refusal is a result
            row.update(outcome=f"refused: {type(err).__name__}: {str(err)[:160]}", fit_s=time.perf_counter() - start)
            return row
        row["fit_s"] = time.perf_counter() - start
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    j = judge(ref, post)
    row.update(
        chains_x_draws=f"{post.num_chains} x {post.num_draws}",
        max_abs_z_sd=np.abs(j["z"]).max(),
        sd_ratio_min=j["ratio"].min(),
        sd_ratio_max=j["ratio"].max(),
        max_abs_z_mcse=np.nanmax(np.abs(np.concatenate([j["z_mcse_mean"], j["z_mcse_sd"]]))),
        outcome="warned: " + " | ".join(m[:200] for m in messages) if messages else "no warning",
    )
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated references (eight_schools, ..., linear_bnn)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: all that apply)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="results", help="file name stem of the table (results.md, results.csv)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = [(f(), FUNCTION_ENGINES) for f in ALL.values()] + [(f(), ALL_ENGINES) for f in BNN_REFERENCES.values()]
    keys = [n for n in ALL] + [f"{n}_bnn" for n in BNN_REFERENCES]
    only = None if args.only is None else set(args.only.split(","))
    methods = None if args.methods is None else args.methods.split(",")
    rows = []
    folder = results_dir("reference_suite", args.out)
    for key, (ref, engines) in zip(keys, cases):
        if only is not None and key not in only:
            continue
        for method in methods or engines:
            rows.append(run(ref, method))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
            _write(rows, folder, args.name)  # after every fit: a long run cut short keeps its rows


def _write(rows: list, folder: Path, name: str) -> None:
    table = pd.DataFrame(rows).round(3)
    table.to_csv(folder / f"{name}.csv", index=False)
    write_result(
        folder / f"{name}.md",
        "Every engine at its defaults (`bp.fit(model, x, y, method=m, seed=0)`, one torch thread) on the reference "
        "posteriors of `tests/reference` (exact means and sds; `tests/reference/generate.py`). `max_abs_z_sd`: the "
        "largest |mean - exact| / exact sd; `sd_ratio_*`: draws' sd / exact sd; `max_abs_z_mcse`: the largest error "
        "in Monte Carlo standard errors (ArviZ), means and sds together; `fit_s`: wall time of the fit on a loaded "
        "2-core machine (compare within the table only).\n\n" + markdown(table),
    )


if __name__ == "__main__":
    main()
