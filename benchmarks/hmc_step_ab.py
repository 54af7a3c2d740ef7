"""Run a public protocol script (``uci.py``, ``classification.py``) with HMC's step after warm-up of one variant.

The before/after check of 25705ee (HMC's flat kernels end warm-up at a step aimed at ``target_accept`` instead of
the dual average ``exp(x_bar)``): ``--variant defaults`` runs the script as the library is; ``--variant xbar`` runs
it inside :func:`hmc_acceptance.final_step`, which patches ``bnn_pyro.infer._batched.aimed_step`` to return
``None`` (the adapter keeps ``exp(x_bar)``: the library before 25705ee, draw for draw). Everything after the
variant is the script and its own arguments; the two sides then compare by split with ``refit_ab.py``.

Neither script keeps the sampler's own statistics, so ``--stats FILE`` appends one CSV row per fit of a Hamiltonian
engine (its Posterior has ``diverging``): ``tag`` (``--tag``), method, chains, draws, divergences, and per chain
(``;``-joined) the median step, the mean acceptance after warm-up and the mean leapfrog steps per draw.

``--fits BEFORE AFTER --out DIR`` then writes ``validation_fits.md`` / ``.csv`` from two sides' folders (each holding
``stats.csv`` and, anywhere below it, the scripts' ``*_splits.csv`` and ``*_verdicts.csv``): per data set and split,
each side's sampler statistics, fit time, R-hat / ESS of ``f`` (classification), the joint-target verdict and every
warning, and the flags the check asks for (a warning or divergence that only the after side has, a verdict lost).
``--reference CSV ...`` (per-split files of NUTS runs of the same protocol) adds, per split, NUTS's test NLL /
test log-likelihood and how much closer to it each side's is: the exact posterior's value, where one side moves away.

Usage::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/hmc_step_ab.py --variant xbar benchmarks/uci.py \\
        --dataset diabetes --splits 3 --methods hmc --out RUNS/xbar/uci
    python benchmarks/refit_ab.py --before RUNS/xbar/uci --after RUNS/defaults/uci --metrics test_ll,rmse \\
        --name validation_uci --out benchmarks/results/hmc_acceptance
"""

from __future__ import annotations

import argparse
import csv
import re
import runpy
import sys
from pathlib import Path

import pandas as pd

import bnn_pyro.infer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown, write_result  # noqa: E402
from hmc_acceptance import final_step  # noqa: E402

KEYS = ["dataset", "split"]


def _recording(fit, path: str, tag: str):
    """``fit`` (an engine function, ``bnn_pyro.infer.engine(kind)``) that appends its Posterior's sampler
    statistics to ``path`` (module docstring)."""

    def recorded(*args, **kwargs):
        post = fit(*args, **kwargs)
        stats = post.sample_stats
        if "diverging" in stats:
            per_chain = lambda name, f: ";".join(f"{float(v):.4g}" for v in f(stats[name].double()))  # noqa: E731
            row = dict(
                tag=tag,
                method=post.method,
                chains=post.num_chains,
                draws=post.num_draws,
                divergences=int(stats["diverging"].sum()),
                step=per_chain("step_size", lambda t: t.median(-1).values),
                accept=per_chain("acceptance_rate", lambda t: t.mean(-1)),
                n_steps=per_chain("n_steps", lambda t: t.mean(-1)),
            )
            new = not Path(path).exists()
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    writer.writeheader()
                writer.writerow(row)
        return post

    return recorded


def _side(folder: Path) -> pd.DataFrame:
    """One side's HMC fits: a row per data set and split (module docstring)."""
    rows = pd.concat([pd.read_csv(p) for p in sorted(folder.rglob("*_splits.csv"))], ignore_index=True)
    rows = rows[rows["method"] == "hmc"]
    cols = [c for c in ["nll", "test_ll", "time_s", "rhat_f_max", "ess_f_min", "warnings"] if c in rows]
    out = rows[KEYS + cols].copy()
    verdicts = [pd.read_csv(p).assign(dataset=p.name[: -len("_verdicts.csv")]) for p in folder.rglob("*_verdicts.csv")]
    if verdicts:
        v = pd.concat(verdicts, ignore_index=True)
        out = out.merge(v[v["method"] == "hmc"][KEYS + ["met"]], on=KEYS, how="left")
    stats = pd.read_csv(folder / "stats.csv")
    stats[["kind", "dataset", "split"]] = stats["tag"].str.split(":", expand=True)
    stats["split"] = stats["split"].astype(int)
    out = out.merge(stats[KEYS + ["step", "accept", "n_steps", "divergences"]], on=KEYS, how="left")
    out["warnings"] = out["warnings"].astype(object).fillna("")
    return out


def _kinds(warnings: str) -> set[str]:
    """A fit's warnings without their numbers, so that the same warning on both sides compares equal."""
    return {re.sub(r"[0-9.]+", "#", w)[:80] for w in warnings.split(" / ") if w}


def _with_reference(paired: pd.DataFrame, b: pd.DataFrame, a: pd.DataFrame, files: list[str]) -> pd.DataFrame:
    """``paired`` with NUTS's ``nll`` / ``test_ll`` of each split (the last file that has it) and, per metric,
    ``|after - nuts| - |before - nuts|`` (negative: the after side is closer to the exact posterior's value)."""
    ref = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    ref = ref[ref["method"] == "nuts"].drop_duplicates(KEYS, keep="last")
    for m in [m for m in ("nll", "test_ll") if m in ref]:
        sides = b[KEYS + [m]].merge(a[KEYS + [m]], on=KEYS, suffixes=("_before", "_after"))
        sides = sides.merge(ref[KEYS + [m]].rename(columns={m: f"{m}_nuts"}), on=KEYS)
        sides[f"{m}_closer"] = (sides[f"{m}_after"] - sides[f"{m}_nuts"]).abs() - (
            sides[f"{m}_before"] - sides[f"{m}_nuts"]
        ).abs()
        paired = paired.merge(sides[KEYS + [f"{m}_nuts", f"{m}_closer"]], on=KEYS, how="left")
    return paired


def fits(before: Path, after: Path, out: Path, reference: list[str] | None = None) -> pd.DataFrame:
    """``validation_fits.md`` / ``.csv`` (module docstring)."""
    b, a = _side(before), _side(after)
    paired = b.merge(a, on=KEYS, suffixes=("_before", "_after"), validate="one_to_one")
    if reference:
        paired = _with_reference(paired, b, a, reference)
    flags = []
    for _, r in paired.iterrows():
        where = f"{r['dataset']} split {r['split']}"
        new = _kinds(r["warnings_after"]) - _kinds(r["warnings_before"])
        flags += [f"{where}: a warning only after: {w}" for w in sorted(new)]
        if r["divergences_after"] > r["divergences_before"]:
            flags.append(f"{where}: divergences {r['divergences_before']} before, {r['divergences_after']} after")
        if "met_before" in r and r["met_before"] == True and r["met_after"] != True:  # noqa: E712 (NaN: no verdict)
            flags.append(f"{where}: the joint target met before, missed after")
    paired.to_csv(out / "validation_fits.csv", index=False)
    show = paired.drop(columns=["warnings_before", "warnings_after"])
    notes = [
        f"- {r['dataset']} split {r['split']}, {side}: {r[f'warnings_{side}']}"
        for _, r in paired.iterrows()
        for side in ("before", "after")
        if r[f"warnings_{side}"]
    ]
    text = (
        "# HMC at its defaults: the aimed step (after) against exp(x_bar) (before), fit by fit\n\n"
        "Per chain (`;`-joined): median step, mean acceptance after warm-up, mean leapfrog steps per draw. "
        "`met`: issue 26's joint target (classification.py's verdict).\n\n" + markdown(show) + "\n\n"
        "## Flags (a warning or divergence only after, a verdict lost)\n\n"
        + ("\n".join(f"- {f}" for f in flags) or "none")
        + "\n\n## Every warning\n\n"
        + ("\n".join(notes) or "none")
        + "\n"
    )
    write_result(out / "validation_fits.md", text)
    print(text)
    return paired


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["defaults", "xbar"])
    parser.add_argument("--fits", nargs=2, metavar=("BEFORE", "AFTER"), help="summarize two sides' folders instead")
    parser.add_argument("--out", help="with --fits: the folder written")
    parser.add_argument("--reference", nargs="+", help="with --fits: per-split CSVs of NUTS on the same protocol")
    parser.add_argument("--stats", help="a CSV that each Hamiltonian fit's sampler statistics are appended to")
    parser.add_argument("--tag", default="", help="the stats rows' first column (e.g. the data set and split)")
    parser.add_argument("script", nargs="?", help="the protocol script, e.g. benchmarks/uci.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    if args.fits:
        fits(Path(args.fits[0]), Path(args.fits[1]), Path(args.out), args.reference)
        return
    if not (args.variant and args.script):
        parser.error("--variant and script are required (or --fits BEFORE AFTER --out DIR)")
    sys.argv = [args.script, *args.args]
    if args.stats:
        engine = bnn_pyro.infer.engine
        bnn_pyro.infer.engine = lambda kind: _recording(engine(kind), args.stats, args.tag)
    with final_step(args.variant):
        runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
