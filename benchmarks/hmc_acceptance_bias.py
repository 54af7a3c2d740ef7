"""Where HMC's aimed step lands against ``target_accept``, measured against the exact acceptance curve.

On the exact Gaussian posterior of ``tests/infer/test_mcmc.py``'s HMC mixing and acceptance tests (their settings,
``tests/blr.py``'s ``HMC_ACCEPTANCE_FIT``: ``make_blr(n=200, d=5, noise=1.0, seed=0)``, HMC at its defaults, one chain
of 500 draws, the fast path), per seed:
the fit with the library's step after warm-up (:func:`bnn_pyro.infer._aimed_step.aimed_step`, ``aimed``) and with
the dual average's ``exp(x_bar)`` (``xbar``, :func:`hmc_acceptance.final_step`: the same warm-up, the same pairs and
metric), and, at that fit's adapted metric, the exact acceptance curve ``A(h)``: the expected Metropolis acceptance
of one transition from the posterior at step ``h`` (``tests/blr.py``'s ``hmc_acceptance_curve``: HMC's own
transition, the fit's jittered leapfrog counts from its post.config, ``--draws`` exact posterior draws as
independent chains; Monte Carlo se ~0.002 at 20,000).
Columns:

- ``h_aimed``, ``h_xbar``, ``h_exact``: the aimed step, ``exp(x_bar)``, and the step where ``A(h)`` = the target
  (bisection on ``log h``, the same random numbers at every step);
- ``exact_aimed``, ``exact_xbar``: ``A`` at the two steps, the realized acceptance each step is expected to give;
- ``realized_aimed``, ``realized_xbar``: the kept draws' mean acceptance (one chain, 500 draws: Monte Carlo error);
- ``exact_fit``: ``A`` at the step ``aimed_step`` returns for the window's own steps with noise-free responses
  ``A(h_t)`` instead of the transitions' acceptances: the error of the logistic curve's shape alone.

Usage::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/hmc_acceptance_bias.py --seeds 0-29

writes ``bias.csv`` and ``bias.md`` (per seed, then means +- se over seeds) into ``--out`` (default
``benchmarks/results/hmc_acceptance/``), and ``bias_config.json``: the settings they were measured under
(``HMC_ACCEPTANCE_FIT``, the first fit's ``post.config`` at ``tests/blr.py``'s ``ACCEPTANCE_CONFIG`` keys, ``--draws``),
which the acceptance test checks its own fits against (a stale reference fails there, saying to rerun this).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import warnings
from pathlib import Path

import pandas as pd

import bnn_pyro as bp
from bnn_pyro.infer import _batched

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import results_dir, write_result  # noqa: E402
from hmc_acceptance import TESTS, final_step  # noqa: E402


@contextlib.contextmanager
def window_pairs(seen: list):
    """Inside the block each call of the aimed step appends its window's ``(steps, accepts)`` to ``seen``."""
    inner = _batched.aimed_step

    def recorded(steps, accepts, target):
        seen.append((list(steps), list(accepts)))
        return inner(steps, accepts, target=target)

    _batched.aimed_step = recorded
    try:
        yield
    finally:
        _batched.aimed_step = inner


def _blr():
    """``tests/blr.py``: the test's posterior, its :func:`hmc_acceptance_curve` (the exact ``A(h)``), and the module
    (its ``HMC_ACCEPTANCE_FIT`` and ``ACCEPTANCE_CONFIG``)."""
    sys.path.insert(0, str(TESTS))
    try:
        import blr
    finally:
        sys.path.remove(str(TESTS))
    return blr.make_blr(**blr.HMC_ACCEPTANCE_FIT["blr"]), blr.hmc_acceptance_curve, blr


def config_record(module, post, draws: int) -> dict:
    """What ``bias_config.json`` holds: the fits' settings (``module.HMC_ACCEPTANCE_FIT``), ``post.config`` at
    ``module.ACCEPTANCE_CONFIG``'s keys, and the curve's ``draws``."""
    config = {key: post.config[key] for key in module.ACCEPTANCE_CONFIG}
    return dict(fit=module.HMC_ACCEPTANCE_FIT, config=config, draws=draws)


def crossing(curve, target: float, lo: float = -4.0, hi: float = 1.0) -> float:
    """``log h`` where ``curve`` falls through ``target`` (bisection; ``curve(lo) > target > curve(hi)``)."""
    for _ in range(20):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if curve(mid) > target else (lo, mid)
    return 0.5 * (lo + hi)


def run(blr, curve_of, seed: int, draws: int, fit: dict) -> tuple[dict, object]:
    """One seed's row, and its aimed fit (``fit``: ``bp.fit``'s arguments besides the seed)."""
    fits, seen = {}, []
    for variant in ("defaults", "xbar"):
        with warnings.catch_warnings(), final_step(variant), window_pairs(seen):
            warnings.simplefilter("ignore")
            fits[variant] = bp.fit(blr.model(), blr.x, blr.y, seed=seed, **fit)
    aimed, xbar = fits["defaults"], fits["xbar"]
    curve = curve_of(blr, aimed, draws, seed)
    target = aimed.config["target_accept"]
    steps, _ = seen[0]
    exact_fit = _batched.aimed_step(steps, [curve(math.log(h)) for h in steps], target=target).step
    h_aimed, h_xbar = (float(p.sample_stats["step_size"][0, -1]) for p in (aimed, xbar))
    row = dict(
        seed=seed,
        h_aimed=h_aimed,
        h_xbar=h_xbar,
        h_exact=math.exp(crossing(curve, target)),
        exact_aimed=curve(math.log(h_aimed)),
        realized_aimed=float(aimed.sample_stats["acceptance_rate"].double().mean()),
        exact_xbar=curve(math.log(h_xbar)),
        realized_xbar=float(xbar.sample_stats["acceptance_rate"].double().mean()),
        exact_fit=curve(math.log(exact_fit)),
        pairs=len(steps),
    )
    return row, aimed


def markdown(rows: pd.DataFrame, draws: int) -> str:
    cols = ["h_aimed", "h_xbar", "h_exact", "exact_aimed", "realized_aimed", "exact_xbar", "realized_xbar", "exact_fit"]
    lines = [
        "# HMC's step after warm-up against the exact acceptance curve (target 0.8)",
        "",
        "benchmarks/hmc_acceptance_bias.py's docstring says what each column is: the exact Gaussian posterior of "
        f"tests/infer/test_mcmc.py's HMC tests, HMC at its defaults, one chain of 500 draws per fit; A(h) from {draws:,} "
        "exact posterior draws at each fit's adapted metric.",
        "",
        "| seed | " + " | ".join(cols) + " |",
        "|" + "---|" * (len(cols) + 1),
    ]
    for _, r in rows.iterrows():
        lines.append(
            f"| {int(r.seed)} | " + " | ".join(f"{r[c]:.4g}" if c[0] == "h" else f"{r[c]:.3f}" for c in cols) + " |"
        )
    n = len(rows)
    lines += ["", f"Over {n} seeds (mean ± se; sd; min-max):", "", "| column | mean ± se | sd | min | max |", "|---|---|---|---|---|"]  # fmt: skip
    for c in cols + ["log_h_ratio"]:
        v = (rows.h_aimed / rows.h_exact).map(math.log) if c == "log_h_ratio" else rows[c]
        lines.append(f"| {c} | {v.mean():.4f} ± {v.std() / math.sqrt(n):.4f} | {v.std():.4f} | {v.min():.3f} | {v.max():.3f} |")  # fmt: skip
    lines += [
        "",
        "log_h_ratio: log(h_aimed / h_exact), the aimed step's distance below the step that meets the target.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-29", help="a range a-b or a comma list")
    parser.add_argument("--draws", type=int, default=20_000, help="exact posterior draws per point of A(h)")
    parser.add_argument("--note", default="", help="a line added under the tables")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi) + 1) if hi else [int(s) for s in args.seeds.split(",")]
    out, (blr, curve_of, module) = results_dir("hmc_acceptance", args.out), _blr()
    rows, record = [], None
    for seed in seeds:
        row, aimed = run(blr, curve_of, seed, args.draws, module.HMC_ACCEPTANCE_FIT["fit"])
        rows.append(row)
        record = record or config_record(module, aimed, args.draws)
        print(rows[-1], flush=True)
    rows = pd.DataFrame(rows)
    rows.to_csv(out / "bias.csv", index=False)
    (out / "bias_config.json").write_text(json.dumps(record, indent=1) + "\n")
    write_result(out / "bias.md", markdown(rows, args.draws) + (f"\n{args.note}\n" if args.note else ""))
    return rows


if __name__ == "__main__":
    main()
