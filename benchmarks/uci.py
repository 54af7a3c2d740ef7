"""The UCI regression protocol for every registered engine at its defaults.

Protocol (Hernandez-Lobato & Adams 2015; Gal & Ghahramani 2016), per train/test split:

- ``x`` and ``y`` standardized with the training rows' mean and sd (:class:`bp.datasets.UCISplit`);
- net ``Linear(D, 50) - ReLU - Linear(50, 1)`` (initial weights from ``torch.manual_seed(split)``),
  prior ``bp.priors.Normal(0, 1)``, likelihood ``bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))``
  (observation noise learned, site ``"sigma"``);
- ``bp.compare(model, splits=[split], methods=[m], seed=split)`` (so ``bp.fit(..., seed=split)``): each
  engine at ITS defaults (``--option method:key=value`` overrides one setting, for experiments only); the
  fit, its time limit, its captured warnings and its error row are ``bp.compare``'s;
- metrics on the test rows, in ORIGINAL units: RMSE of the predictive mean and the test
  log-likelihood per point (``bp.compare``'s, the exact mixture over posterior draws, converted by
  ``bnn_pyro.comparison.sources.to_original_units``), coverage of the exact central 95% interval of the
  predictive mixture (``metrics.predictive_interval``), and, added here, the regression calibration error (``metrics.regression_calibration_error`` of ``metrics.pit``: mean
  |empirical - nominal| coverage of central intervals at 0.1..0.9), the mean epistemic sd and the
  mean aleatoric (noise) sd of the predictive, and the wall time of ``bp.fit``;
- what the fit's held-out rows chose (``post.config["validation"]["chosen"]``, :func:`bnn_pyro.infer.holdout.refit`),
  per split: ``chosen_num_steps`` (where the refit on all rows stopped), ``chosen_horizon`` (the length of the
  schedule it stopped in) and ``chosen_sigma`` (the chosen noise sd, in original units); empty where the engine held
  no rows out or made no such choice.

Aggregate: mean and standard error (sd / sqrt(n), ddof 1) over the splits that succeeded. A failing
engine is recorded with its error text and the run goes on (``--max-fit-seconds`` turns a fit that
runs longer into such an error: NUTS at its defaults, 1,000 + 1,000 draws of up to 1,023 leapfrog
steps, can take most of an hour per split on a busy 2-core machine).

Datasets (none of the classic UCI eight; nothing is downloaded): ``diabetes`` (scikit-learn, 442 x 10),
``friedman1`` (scikit-learn's ``make_friedman1``, 500 x 10, noise 1, random_state 0) and
``heteroscedastic`` (``bp.datasets.heteroscedastic``, 500 x 1, seed 0), each with random 90/10
splits from ``bp.datasets.make_uci_splits`` (split k from seed k); or any folder in the layout
``bp.datasets.load_uci`` reads (``--path DIR``; ``bp.datasets.write_uci_splits`` makes one).

Usage::

    python benchmarks/uci.py --dataset diabetes --splits 20 --methods all   # into benchmarks/results/uci/
    python benchmarks/uci.py --dataset diabetes --quick                     # 2 splits, smoke test
    python benchmarks/uci.py --path UCI_Datasets/yacht/data --methods svi,nuts --splits 5
    python benchmarks/uci.py --dataset friedman1 --methods svi --option svi:num_steps=2000
    python benchmarks/uci.py --dataset diabetes --splits 5 --only-splits 3,4 --out part2   # then merge with --resume

writes, in ``--out`` (default ``benchmarks/results/uci/``), ``<dataset>_splits.csv`` (one row per split and engine,
written as each fit ends, so a partial run is kept; ``--resume`` goes on from it), ``<dataset>.csv`` and
``<dataset>.md`` (the summary, rewritten after each split, headed by the run's provenance) and ``test_ll.png`` (test
LL per engine with SE bars, one panel per dataset summary in ``--out``).
"""

from __future__ import annotations

import argparse
import ast
import math
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyro.distributions as dist
import torch

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.comparison import sources

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import results_dir, write_result  # noqa: E402

METRICS = ["test_ll", "rmse", "coverage_95", "calibration_error", "epistemic_sd", "noise_sd", "time_s"]
LABELS = {
    "test_ll": "test LL",
    "rmse": "RMSE",
    "coverage_95": "95% cov.",
    "calibration_error": "cal. err.",
    "epistemic_sd": "epist. sd",
    "noise_sd": "noise sd",
    "time_s": "fit time s",
}


# ---------------------------------------------------------------------------------------- data
def load_dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of a built-in dataset: ``diabetes``, ``friedman1`` or ``heteroscedastic``."""
    if name == "diabetes":
        return bp.datasets.load_sklearn("diabetes")
    if name == "friedman1":
        from sklearn.datasets import make_friedman1

        x, y = make_friedman1(n_samples=500, n_features=10, noise=1.0, random_state=0)
        return torch.tensor(x, dtype=torch.get_default_dtype()), torch.tensor(y, dtype=torch.get_default_dtype())
    if name == "heteroscedastic":
        return bp.datasets.heteroscedastic(n=500, seed=0)
    raise ValueError(
        f"--dataset: unknown dataset {name!r}; choose diabetes, friedman1 or heteroscedastic, "
        "or give a folder in the load_uci layout with --path."
    )


def make_splits(
    *, dataset: str | None = None, path: str | None = None, x=None, y=None, n_splits: int = 20
) -> list[bp.datasets.UCISplit]:
    """The first ``n_splits`` splits of a folder (``path``), of arrays ``(x, y)`` or of a built-in dataset."""
    if path is not None:
        first = bp.datasets.load_uci(path, 0)
        return [first] + [bp.datasets.load_uci(path, k) for k in range(1, min(n_splits, first.n_splits))]
    if x is None:
        x, y = load_dataset(dataset)
    return bp.datasets.make_uci_splits(x, y, n_splits=n_splits, test_fraction=0.1, seed=0)


def make_model(input_dim: int, seed: int) -> bp.BNN:
    """The protocol's model: ReLU MLP with 50 hidden units, Normal(0, 1) prior, learned Gaussian noise."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(input_dim, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))


CHOSEN = ["chosen_num_steps", "chosen_horizon", "chosen_sigma"]


# ---------------------------------------------------------------------------------------- one fit
def chosen_columns(post: bp.Posterior, scale: float) -> dict[str, float]:
    """What ``post``'s held-out rows chose (``post.config["validation"]["chosen"]``) as the :data:`CHOSEN` columns:
    the stop ``num_steps``, the ``horizon`` and the noise ``sigma`` times ``scale`` (the targets' training sd: original
    units; the median over chains where each chose its own); NaN for what was not chosen (no rows held out: absent)."""
    validation = post.config.get("validation")
    chosen = (validation.get("chosen") or {}) if isinstance(validation, dict) else {}
    sigma = chosen.get("sigma")
    if isinstance(sigma, list):
        sigma = statistics.median(sigma)
    return dict(
        chosen_num_steps=chosen.get("num_steps", math.nan),
        chosen_horizon=chosen.get("horizon", math.nan),
        chosen_sigma=math.nan if sigma is None else float(sigma) * scale,
    )


def extra_metrics(post: bp.Posterior, split: bp.datasets.UCISplit) -> dict[str, float]:
    """What the protocol adds to ``bp.compare``'s columns, in original units: the regression calibration error
    (from ``metrics.pit``), the mean epistemic sd and the mean aleatoric (noise) sd of the predictive."""
    pred = post.predict(split.x_test, interval=None, seed=0)
    s = float(split.y_scaler.scale)
    return dict(
        calibration_error=metrics.regression_calibration_error(metrics.pit(post, split.x_test, split.y_test)),
        epistemic_sd=float(pred.epistemic_std.double().mean()) * s,
        noise_sd=float(pred.aleatoric_std.double().mean()) * s,
    )


def run_one(
    method: str, split: bp.datasets.UCISplit, options: dict | None = None, *, max_fit_seconds: float | None = None
) -> dict:
    """Fit ``method`` on one split with ``bp.compare`` (its fit, time limit, captured warnings, error row and
    scores) and convert its scores to original units; a failure (or a fit longer than ``max_fit_seconds``)
    becomes a row with its ``error`` text."""
    row = dict(method=method, split=split.split, n_train=split.x_train.shape[0], n_test=split.x_test.shape[0])
    result = bp.compare(
        make_model(split.x_train.shape[1], split.split),
        splits=[(split.x_train, split.y_train, split.x_test, split.y_test)],
        methods=[method],
        options={method: options or {}},
        seed=split.split,
        progress=False,
        time_limit=max_fit_seconds,
    )
    scored = sources.to_original_units(result.table, float(split.y_scaler.scale)).loc[method]
    row.update(error=scored["error"], warnings=scored["warnings"])
    if not row["error"]:
        row.update(
            test_ll=scored["test_ll"],
            rmse=scored["rmse"],
            coverage_95=scored["coverage_95"],
            time_s=scored["fit_s"],
            **extra_metrics(result.posteriors[method], split),
            **chosen_columns(result.posteriors[method], float(split.y_scaler.scale)),
        )
    return row


# ---------------------------------------------------------------------------------------- tables
def summarize(rows: pd.DataFrame, metrics: list[str] | None = None) -> pd.DataFrame:
    """One row per method: mean and standard error (ddof 1) of each metric (default :data:`METRICS`) over the
    successful splits where it was measured."""
    out = []
    for method, group in rows.groupby("method", sort=False):
        ok = group[group["error"].fillna("") == ""]
        entry = dict(method=method, splits_ok=len(ok), splits=len(group))
        for m in METRICS if metrics is None else metrics:
            values = ok[m].astype(float).dropna() if m in ok else pd.Series(dtype=float)
            entry[m] = values.mean() if len(values) else math.nan
            entry[f"{m}_se"] = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        errors = group.loc[group["error"].fillna("") != "", "error"]
        entry["error"] = errors.iloc[0] if len(errors) else ""
        texts = sorted({t for w in ok.get("warnings", pd.Series(dtype=str)).fillna("") for t in w.split(" / ") if t})
        entry["warnings"] = " / ".join(texts)
        out.append(entry)
    return pd.DataFrame(out)


def markdown(summary: pd.DataFrame, title: str, notes: list[str]) -> str:
    """The summary as a GitHub Markdown table of ``mean ± se`` cells."""
    header = ["engine"] + [LABELS[m] for m in METRICS] + ["splits ok", "error / warnings"]
    lines = [f"# {title}", "", *notes, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in summary.iterrows():
        cells = [r["method"]] + [_cell(r[m], r[f"{m}_se"], m) for m in METRICS]
        extra = r["error"] or (f"warned: {r['warnings']}" if r["warnings"] else "")
        cells += [f"{r['splits_ok']}/{r['splits']}", extra.replace("|", "/")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(mean: float, se: float, metric: str) -> str:
    if not math.isfinite(mean):
        return "-"
    digits = 1 if metric == "time_s" else 3
    return f"{mean:.{digits}f}" if not math.isfinite(se) else f"{mean:.{digits}f} ± {se:.{digits}f}"


def plot(out: Path) -> Path | None:
    """Test LL per engine with SE bars, one panel per ``<dataset>.csv`` summary in ``out`` (a summary: its ``.md``
    is this script's table for that dataset; other CSVs in the folder, e.g. a ``<dataset>_before.csv`` kept for
    reference, are left out)."""
    files = sorted(
        p
        for p in out.glob("*.csv")
        if p.with_suffix(".md").exists() and f"# UCI protocol: {p.stem}\n" in p.with_suffix(".md").read_text()
    )
    if not files:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(files), figsize=(4.5 * len(files), 5), squeeze=False)
    for ax, file in zip(axes[0], files):
        table = pd.read_csv(file)
        table = table[table["test_ll"].notna()]
        ax.errorbar(table["test_ll"], range(len(table)), xerr=table["test_ll_se"].fillna(0), fmt="o", capsize=3)
        ax.set_yticks(range(len(table)), table["method"])
        ax.invert_yaxis()
        ax.set_title(file.stem)
        ax.set_xlabel("test LL per point (mean ± SE over splits)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = out / "test_ll.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- driver
def run(
    splits: list[bp.datasets.UCISplit],
    methods: list[str],
    name: str,
    out: Path,
    *,
    options: dict[str, dict] | None = None,
    resume: bool = False,
    note: str = "",
    max_fit_seconds: float | None = None,
    verbose: bool = True,
) -> pd.DataFrame:
    """Every method on every split (splits outer, so a partial run has every engine on the same splits).
    Per-split rows are written to ``<name>_splits.csv`` as each fit ends and the summary is
    rewritten after each split; ``resume=True`` keeps the rows already there and fits only the
    (split, method) pairs they lack. Returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    per_split = out / f"{name}_splits.csv"
    rows = []
    if resume and per_split.exists():
        rows = read_rows(per_split).to_dict("records")
    else:
        per_split.unlink(missing_ok=True)
    done = {(int(r["split"]), r["method"]) for r in rows}
    for split in splits:
        for method in methods:
            if (split.split, method) in done:
                continue
            row = dict(
                dataset=name, **run_one(method, split, (options or {}).get(method), max_fit_seconds=max_fit_seconds)
            )
            rows.append(row)
            # the whole file, so that its columns are every row's (an error row has no scores; a file from before
            # the CHOSEN columns is resumed with them)
            pd.DataFrame(rows).to_csv(per_split, index=False)
            if verbose:
                status = row["error"] or (
                    f"LL {row['test_ll']:.3f}  RMSE {row['rmse']:.3f}  cov {row['coverage_95']:.2f}"
                    f"  cal {row['calibration_error']:.3f}  {row['time_s']:.1f}s"
                )
                print(f"[{name}] split {split.split} {method:20s} {status}", flush=True)
        summary = write_summary(pd.DataFrame(rows), splits, name, out, options, note)
    return summary


def read_rows(path: Path) -> pd.DataFrame:
    """The per-split rows of a ``<name>_splits.csv`` (empty error/warning cells as "")."""
    rows = pd.read_csv(path, dtype={"error": str, "warnings": str})
    rows[["error", "warnings"]] = rows[["error", "warnings"]].fillna("")
    return rows


def write_summary(
    rows: pd.DataFrame, splits, name: str, out: Path, options: dict | None, note: str = ""
) -> pd.DataFrame:
    """``<name>.csv`` and ``.md`` from the per-split rows, and the plot."""
    rows = rows[rows["split"].isin([s.split for s in splits])]
    summary = summarize(rows)
    summary.to_csv(out / f"{name}.csv", index=False)
    d = splits[0].x_train.shape[1]
    n = splits[0].x_train.shape[0] + splits[0].x_test.shape[0]
    done = sorted(set(int(k) for k in rows["split"]))
    notes = [
        f"Data: {name}, N = {n}, D = {d}, split(s) {done} ({splits[0].path}). "
        "Protocol and metrics: benchmarks/uci.py's docstring; every engine at its defaults"
        + (f" except {options}" if options else "")
        + ".",
        f"Mean ± standard error over splits. Measured with torch {torch.__version__} on {platform.machine()} "
        f"(bp.fit's default of one torch thread), git {git_commit()}." + (f" {note}" if note else ""),
    ]
    write_result(out / f"{name}.md", markdown(summary, f"UCI protocol: {name}", notes))
    plot(out)
    return summary


def parse_options(items: list[str]) -> dict[str, dict]:
    """``["svi:num_steps=100", ...]`` -> ``{"svi": {"num_steps": 100}}`` (values read as Python literals)."""
    options: dict[str, dict] = {}
    for item in items or []:
        method, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"--option: expected method:key=value (e.g. svi:num_steps=2000), got {item!r}.")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a bare word stays a string, e.g. svi:guide=full_rank
        options.setdefault(method, {})[key] = value
    return options


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="diabetes", help="diabetes, friedman1, heteroscedastic (comma list)")
    parser.add_argument("--path", help="a folder in the bp.datasets.load_uci layout (overrides --dataset)")
    parser.add_argument("--splits", type=int, default=20, help="number of splits (default 20)")
    parser.add_argument("--methods", default="all", help="'all' or a comma list, e.g. svi,nuts")
    parser.add_argument("--option", action="append", default=[], help="method:key=value, for experiments")
    parser.add_argument("--quick", action="store_true", help="2 splits (smoke test)")
    parser.add_argument("--only-splits", help="a comma list of split numbers to run, e.g. 3,4 (of the --splits)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows of <dataset>_splits.csv in --out and fit only the missing (split, method) pairs",
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="fit nothing: rebuild <dataset>.md/.csv and "
        "the plot from the rows of <dataset>_splits.csv in --out (e.g. after merging partial runs)",
    )
    parser.add_argument("--max-fit-seconds", type=float, help="record a fit that runs longer as an error and go on")
    parser.add_argument("--note", default="", help="a line added to the Markdown summary (e.g. the machine's load)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/uci/)")
    args = parser.parse_args(argv)
    methods = [m.value for m in bp.infer.Method] if args.methods == "all" else args.methods.split(",")
    for m in methods:
        if m not in {e.value for e in bp.infer.Method}:
            raise SystemExit(f"--methods: unknown method {m!r}; choose from {[e.value for e in bp.infer.Method]}.")
    n_splits = 2 if args.quick else args.splits
    options = parse_options(args.option)
    if args.path:
        names = {
            Path(args.path).resolve().name
            if Path(args.path).name != "data"
            else Path(args.path).resolve().parent.name: dict(path=args.path)
        }
    else:
        names = {name: dict(dataset=name) for name in args.dataset.split(",")}
    summaries, out = {}, results_dir("uci", args.out)
    for name, source in names.items():
        splits = make_splits(n_splits=n_splits, **source)
        if args.only_splits:
            keep = {int(k) for k in args.only_splits.split(",")}
            splits = [s for s in splits if s.split in keep]
            if not splits:
                raise SystemExit(f"--only-splits: none of {sorted(keep)} is among the splits 0..{n_splits - 1}.")
        if args.summarize:
            rows = read_rows(out / f"{name}_splits.csv")
            rows = rows[rows["method"].isin(methods)]
            summaries[name] = write_summary(rows, splits, name, out, options, args.note)
        else:
            summaries[name] = run(
                splits,
                methods,
                name,
                out,
                options=options,
                resume=args.resume,
                note=args.note,
                max_fit_seconds=args.max_fit_seconds,
            )
    return summaries


if __name__ == "__main__":
    main()
