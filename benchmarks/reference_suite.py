"""Every engine at its defaults on every reference posterior of ``tests/reference`` (exact means and sds, computed
independently of this library): how far each engine's draws are from the exact posterior, whether the fit warned or
refused, and how long it took.

For each (engine, reference): the largest ``|z|`` of the means in posterior sds (``(mean - exact) / sd``), the range
of the sd ratios (draws' sd / exact sd), the largest ``|z|`` in Monte Carlo standard errors (ArviZ's ESS of the mean,
its MCSE of the sd; only where there are at least 4 draws per chain), the number of draws, the fit's
``DiagnosticWarning`` messages, or the error that refused the model, and a ``verdict``: ``matched`` by the rule of
``tests/infer/test_reference_engines.py`` (MCMC: within 4 MCSEs; SG-MCMC and approximations: the bias bounds
widened by the draws' Monte Carlo error, ``tests/reference/posteriors.py``), ``warned``, ``refused``, ``timed out``
(``--max-seconds``), or ``SILENT MISS`` (neither matched nor warned: a bug). Every engine runs on every reference
(the three plain Pyro models and the two BNNs): an engine that cannot fit a model must refuse it with an error that
says what to use, and that refusal is its row. The note that one chain leaves R-hat undefined is said of every
one-chain fit whatever its draws, so it is kept in ``notes`` and not counted as a warning about the fit.

Run from the repository root: ``python benchmarks/reference_suite.py [--only linear_bnn,kidiq] [--methods a,b]``;
``--guide mean_field,default`` fits SVI once per guide (``default``: its own default), with the guide given and the
one used as columns.
Writes ``benchmarks/results/reference_suite/<name>.md`` and ``<name>.csv`` (``--name``, default ``results``). One
torch thread per fit.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import markdown, results_dir, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference.posteriors import ALL, BNN_REFERENCES, biased_off, exact_off, judge  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer.registry import REGISTRY, Method  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

ENGINES = [m.value for m in Method]
"""Every engine on every reference: what an engine cannot fit it must refuse clearly, and that is judged too."""
EXACT = {m.value for m, d in REGISTRY.items() if d.capabilities.markov_chain and not d.capabilities.minibatches}
"""The unbiased samplers (full-data MCMC), judged within Monte Carlo error; the rest within the bias bounds."""
ONE_CHAIN_NOTE = "with one chain R-hat is undefined"


class _TimedOut(Exception):
    pass


def _alarm(signum, frame):
    raise _TimedOut


def run(
    ref, method: str, max_seconds: int, init: str | None = None, options: dict | None = None, guide: str | None = None
) -> dict:
    row = {"reference": ref.name + ("" if ref.columns is None else " (BNN)"), "method": method}
    if guide is not None:
        row["guide_given"] = guide
    old = signal.signal(signal.SIGALRM, _alarm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        start = time.perf_counter()
        signal.alarm(max_seconds)
        try:
            extra = {} if init is None else {"init": init}  # --init: one option off its default (a variant)
            extra.update(options or {})  # --options: options off their defaults (a variant, e.g. more chains)
            extra |= {} if guide in (None, "default") else {"guide": guide}  # --guide: svi's guide (a variant)
            post = bp.fit(ref.model, ref.x, ref.y, method=method, seed=0, progress=False, **extra)
        except _TimedOut:
            row.update(verdict="timed out", outcome=f"no result within {max_seconds} s", fit_s=max_seconds)
            return row
        except Exception as err:  # noqa: BLE001 - a refusal is a result
            row.update(
                verdict="refused",
                outcome=f"refused: {type(err).__name__}: {str(err)[:300]}",
                fit_s=time.perf_counter() - start,
            )
            return row
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        row["fit_s"] = time.perf_counter() - start
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    notes = [m for m in messages if m.startswith(f"{method}: {ONE_CHAIN_NOTE}")]
    warned = [m for m in messages if m not in notes]
    j = judge(ref, post)
    off = exact_off(ref, post) if method in EXACT else biased_off(ref, post)
    row.update(
        chains_x_draws=f"{post.num_chains} x {post.num_draws}",
        max_abs_z_sd=np.abs(j["z"]).max(),
        sd_ratio_min=j["ratio"].min(),
        sd_ratio_max=j["ratio"].max(),
        max_abs_z_mcse=_largest(np.concatenate([j["z_mcse_mean"], j["z_mcse_sd"]])),
        verdict="matched" if not off else ("warned" if warned else "SILENT MISS"),
        off=" ".join(f"{n}:{z}/{r}" for n, z, r in off),
        outcome="warned: " + " | ".join(m[:240] for m in warned) if warned else "no warning",
        notes="one-chain R-hat note" if notes else "",
    )
    if guide is not None:  # the guide the fit used (svi's default resolves by model)
        row["guide_used"] = post.config.get("guide")
    return row


def _largest(z: np.ndarray) -> float:
    """The largest ``|z|``, NaN where none is defined (fewer than 4 draws per chain)."""
    finite = np.abs(z[np.isfinite(z)])
    return float(finite.max()) if finite.size else float("nan")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated references (eight_schools, ..., linear_bnn)")
    parser.add_argument("--methods", default=None, help="comma-separated methods (default: every engine)")
    parser.add_argument("--max-seconds", type=int, default=600, help="wall-time bound of one fit (default 600)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="results", help="file name stem of the table (results.md, results.csv)")
    parser.add_argument("--init", default=None, help="pass init= to every fit (default: each engine's own default)")
    parser.add_argument(
        "--options",
        default=None,
        help="JSON object of options passed to every fit, e.g. '{\"num_chains\": 4}' (default: none)",
    )
    parser.add_argument(
        "--guide",
        default=None,
        help="comma-separated guides, each fit once per guide (svi only; 'default': svi's own default, recorded)",
    )
    args = parser.parse_args(argv)
    options = None if args.options is None else json.loads(args.options)
    if options is not None and not isinstance(options, dict):
        raise SystemExit(f"--options: expected a JSON object of fit options, got {args.options!r}.")
    torch.set_num_threads(1)
    cases = {name: f for name, f in ALL.items()} | {f"{name}_bnn": f for name, f in BNN_REFERENCES.items()}
    only = None if args.only is None else args.only.split(",")
    unknown = set(only or []) - set(cases)
    if unknown:
        raise SystemExit(f"--only: unknown references {sorted(unknown)}; expected some of {sorted(cases)}.")
    methods = ENGINES if args.methods is None else args.methods.split(",")
    if set(methods) - set(ENGINES):
        raise SystemExit(f"--methods: unknown {sorted(set(methods) - set(ENGINES))}; expected some of {ENGINES}.")
    rows = []
    folder = results_dir("reference_suite", args.out)
    given = {**({} if args.init is None else {"init": args.init}), **(options or {})}
    variant = f" Options off their defaults in every fit: `{json.dumps(given)}`." if given else ""
    for key, make in cases.items():
        if only is not None and key not in only:
            continue
        ref = make()
        for method in methods:
            for guide in [None] if args.guide is None else args.guide.split(","):
                rows.append(run(ref, method, args.max_seconds, args.init, options, guide))
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
                _write(rows, folder, args.name, variant)  # after every fit: a long run cut short keeps its rows


def _write(rows: list, folder: Path, name: str, variant: str = "") -> None:
    table = pd.DataFrame(rows).round(3)
    table.to_csv(folder / f"{name}.csv", index=False)
    write_result(
        folder / f"{name}.md",
        "Every engine at its defaults (`bp.fit(model, x, y, method=m, seed=0)`, one torch thread) on every reference "
        "posterior of `tests/reference` (exact means and sds; `tests/reference/generate.py`). `max_abs_z_sd`: the "
        "largest |mean - exact| / exact sd; `sd_ratio_*`: draws' sd / exact sd; `max_abs_z_mcse`: the largest error "
        "in Monte Carlo standard errors (ArviZ), means and sds together; `verdict`: matched (the rule of "
        "`tests/infer/test_reference_engines.py`), warned, refused, timed out, or SILENT MISS; `off`: the "
        "parameters outside that rule (name:z/sd ratio, or for MCMC name:z of the mean/z of the sd in MCSEs); "
        "`fit_s`: wall time of the fit on a shared 2-core machine (compare within the table only)."
        + variant
        + "\n\n"
        + markdown(table),
    )


if __name__ == "__main__":
    main()
