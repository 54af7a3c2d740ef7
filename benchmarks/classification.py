"""Off-data uncertainty in classification: every engine at its defaults on public classification sets.

The classification companion of ``benchmarks/uci.py`` (issue 26). Per dataset and split:

- rows split at random 80/20 (split ``k`` from seed ``k``), inputs standardized with the training rows'
  mean and sd (a constant column keeps sd 1);
- net ``Linear(D, 50) - ReLU - Linear(50, K)`` (initial weights from ``torch.manual_seed(split)``), prior
  ``bp.priors.Normal(0, 1)``, likelihood ``bp.likelihoods.Categorical()``;
- ``bp.fit(model, x_train, y_train, method=m, seed=split, progress=False)``: each engine at ITS defaults
  (``--option method:key=value`` for experiments only);
- on the test rows: accuracy, NLL (``metrics.nll`` of the Bayesian model average) and ECE (15 bins);
- OOD AUROC (``metrics.ood_auroc``) of the predictive entropy and of the mutual information, separating the
  test rows from: ``noise``, Gaussian inputs of sd 3 in standardized units (as many as test rows, seed
  ``1000 + split``); ``far``, the test rows scaled by 10; ``class`` (sets with 3+ classes), a second fit on
  the training rows without the last class, scored on the test rows of that class against the others;
- the reference: scikit-learn's ``LogisticRegression(C=1)`` (an L2 penalty equal to the ``Normal(0, 1)``
  prior's MAP) on the same split, its accuracy and NLL in the ``logreg`` row (its OOD scores too, from its
  predictive entropy; it has no mutual information).

Data (nothing downloaded): scikit-learn's ``breast_cancer`` (569 x 30, 2 classes), ``wine`` (178 x 13, 3),
``iris`` (150 x 4, 3), ``digits`` (1797 x 64, 10 classes, the 8x8 images flattened: the image set) and
``synthetic`` (``make_classification``: 600 x 20, 3 classes, 10 informative, random_state 0). ``--max-rows``
keeps a random subset (seed 0, drawn before the splits) where time needs it.

Usage::

    python benchmarks/classification.py --dataset breast_cancer,wine --splits 3 --methods ensemble,swag
    python benchmarks/classification.py --dataset iris --quick --methods all --max-fit-seconds 300
    python benchmarks/classification.py --dataset digits --max-rows 600 --quick --out benchmarks/results/classification

writes ``<dataset>_splits.csv`` (one row per split and engine, appended as each fit ends) and ``<dataset>.md`` /
``.csv`` (mean ± standard error over splits; the Markdown headed by the run's provenance) to ``--out`` (default
``benchmarks/results/classification/``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.comparison.limits import FitTimeout, time_limit

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.classification
    from uci import git_commit, parse_options
    from uci import summarize as uci_summarize
except ImportError:  # pragma: no cover
    from benchmarks.uci import git_commit, parse_options
    from benchmarks.uci import summarize as uci_summarize
from _common import results_dir, write_result  # noqa: E402 - uci put benchmarks/ on sys.path

DATASETS = ("breast_cancer", "wine", "iris", "digits", "synthetic")
OOD = ("noise", "far", "class")
METRICS = (
    ["accuracy", "nll", "ece"] + [f"auroc_{kind}_{score}" for kind in OOD for score in ("entropy", "mi")] + ["time_s"]
)


def load_dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of a built-in classification set (raw features, int64 labels 0..K-1)."""
    if name in ("breast_cancer", "wine", "digits"):
        return bp.datasets.load_sklearn(name)
    import sklearn.datasets as skd

    if name == "iris":
        bunch = skd.load_iris()
        x, y = bunch.data, bunch.target
    elif name == "synthetic":
        x, y = skd.make_classification(n_samples=600, n_features=20, n_informative=10, n_classes=3, random_state=0)
    else:
        raise ValueError(f"--dataset: unknown dataset {name!r}; choose from {', '.join(DATASETS)}.")
    return torch.tensor(x, dtype=torch.get_default_dtype()), torch.tensor(y, dtype=torch.int64)


def make_split(x: torch.Tensor, y: torch.Tensor, split: int, test_fraction: float = 0.2) -> dict[str, torch.Tensor]:
    """Split ``split`` (a random permutation from seed ``split``), standardized on its training rows."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(split))
    n_test = int(round(test_fraction * len(x)))
    test, train = perm[:n_test], perm[n_test:]
    mean, sd = x[train].mean(0), x[train].std(0)
    sd = torch.where(sd > 1e-8, sd, torch.ones_like(sd))
    xs = (x - mean) / sd
    return dict(x_train=xs[train], y_train=y[train], x_test=xs[test], y_test=y[test])


def make_model(input_dim: int, num_classes: int, seed: int) -> bp.BNN:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(input_dim, 50), torch.nn.ReLU(), torch.nn.Linear(50, num_classes))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


def ood_inputs(s: dict[str, torch.Tensor], split: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + split)
    return dict(noise=3.0 * torch.randn(s["x_test"].shape, generator=g), far=10.0 * s["x_test"])


def _scores(predict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(entropy, mutual information or None) of the predictive at ``x``."""
    out = predict(x)
    if isinstance(out, torch.Tensor):  # class probabilities (logistic regression)
        p = out.clamp_min(1e-12)
        return -(p * p.log()).sum(-1), None
    return out.entropy, out.mutual_information


def _aurocs(predict, x_in: torch.Tensor, outs: dict[str, torch.Tensor]) -> dict[str, float]:
    h_in, mi_in = _scores(predict, x_in)
    row = {}
    for kind, x_out in outs.items():
        h_out, mi_out = _scores(predict, x_out)
        row[f"auroc_{kind}_entropy"] = metrics.ood_auroc(h_in, h_out)
        row[f"auroc_{kind}_mi"] = math.nan if mi_in is None else metrics.ood_auroc(mi_in, mi_out)
    return row


def _fit(method: str, x, y, num_classes: int, split: int, options: dict):
    if method == "logreg":
        from sklearn.linear_model import LogisticRegression

        clf = LogisticRegression(C=1.0, max_iter=5000).fit(x.numpy(), y.numpy())
        return lambda xs: torch.tensor(clf.predict_proba(xs.numpy()), dtype=torch.float64)
    post = bp.fit(
        make_model(x.shape[1], num_classes, split), x, y, method=method, seed=split, progress=False, **options
    )
    return lambda xs: post.predict(xs, seed=0)


def run_one(
    method: str,
    data: tuple,
    split: int,
    options: dict | None = None,
    *,
    max_fit_seconds: float | None = None,
    held_out_class: bool = True,
) -> dict:
    """Fit and score ``method`` on one split (a failure becomes a row with its ``error`` text); the held-out-class
    second fit only where ``held_out_class`` (it doubles the cost)."""
    x, y = data
    s = make_split(x, y, split)
    k = int(y.max()) + 1
    row = dict(method=method, split=split, n_train=len(s["x_train"]), error="", warnings="")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            with time_limit(max_fit_seconds):
                predict = _fit(method, s["x_train"], s["y_train"], k, split, options or {})
            row["time_s"] = time.perf_counter() - start
            out = predict(s["x_test"])
            probs = out if isinstance(out, torch.Tensor) else out.probs
            row.update(
                accuracy=metrics.accuracy(probs, s["y_test"]),
                nll=metrics.nll(probs, s["y_test"]),
                ece=metrics.ece(probs, s["y_test"]),
            )
            row.update(_aurocs(predict, s["x_test"], ood_inputs(s, split)))
            if k >= 3 and held_out_class:  # held-out class: the last one
                keep, held = s["y_train"] < k - 1, s["y_test"] == k - 1
                with time_limit(max_fit_seconds):
                    predict_wo = _fit(method, s["x_train"][keep], s["y_train"][keep], k - 1, split, options or {})
                row.update(
                    {n: v for n, v in _aurocs(predict_wo, s["x_test"][~held], {"class": s["x_test"][held]}).items()}
                )
        texts = sorted(
            {
                str(w.message).splitlines()[0][:120]
                for w in caught
                if not issubclass(w.category, (DeprecationWarning, FutureWarning))
            }
        )
        row["warnings"] = " / ".join(texts)
    except (Exception, FitTimeout) as err:  # noqa: BLE001 - the benchmark records any failure and goes on
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return row


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per method: mean and standard error of each metric over the successful splits (uci's summary)."""
    return uci_summarize(rows, METRICS)


def markdown(summary: pd.DataFrame, title: str, notes: list[str]) -> str:
    cols = [m for m in METRICS if summary[m].notna().any()]
    header = ["engine"] + cols + ["splits ok", "error"]
    lines = [f"# {title}", "", *notes, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for _, r in summary.iterrows():
        cells = [r["method"]] + [_cell(r[m], r[f"{m}_se"], m) for m in cols]
        cells += [f"{r['splits_ok']}/{r['splits']}", str(r["error"]).replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(mean: float, se: float, metric: str) -> str:
    if not math.isfinite(mean):
        return "-"
    d = 1 if metric == "time_s" else 3
    return f"{mean:.{d}f}" if not math.isfinite(se) else f"{mean:.{d}f} ± {se:.{d}f}"


def subset(data: tuple[torch.Tensor, torch.Tensor], max_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """At most ``max_rows`` rows of ``data``, drawn at random (seed 0) before the splits; all of them for ``None``."""
    x, y = data
    if max_rows is None or max_rows >= len(x):
        return x, y
    keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:max_rows]
    return x[keep], y[keep]


def run(
    name: str,
    methods: list[str],
    splits: list[int],
    out: Path,
    *,
    options: dict | None = None,
    note: str = "",
    max_fit_seconds: float | None = None,
    max_rows: int | None = None,
    held_out_class: bool = True,
) -> pd.DataFrame:
    """Every method on every split of ``name``; rows appended as each fit ends, the summary rewritten per split."""
    out.mkdir(parents=True, exist_ok=True)
    data = subset(load_dataset(name), max_rows)
    per_split = out / f"{name}_splits.csv"
    per_split.unlink(missing_ok=True)
    rows = []
    for split in splits:
        for method in methods:
            row = dict(
                dataset=name,
                **run_one(
                    method,
                    data,
                    split,
                    (options or {}).get(method),
                    max_fit_seconds=max_fit_seconds,
                    held_out_class=held_out_class,
                ),
            )
            rows.append(row)
            pd.DataFrame([row]).to_csv(per_split, mode="a", header=not per_split.exists(), index=False)
            status = row["error"] or " ".join(f"{m} {row.get(m, math.nan):.3f}" for m in METRICS[:5])
            print(f"[{name}] split {split} {method:12s} {status}", flush=True)
        summary = summarize(pd.DataFrame(rows))
        summary.to_csv(out / f"{name}.csv", index=False)
        x, y = data
        notes = [
            f"Data: {name}, N = {len(x)}, D = {x.shape[1]}, K = {int(y.max()) + 1}, splits {splits[: len(rows) // len(methods) or 1]}. "
            "Protocol and metrics: benchmarks/classification.py's docstring; every engine at its defaults"
            + (f" except {options}" if options else "")
            + ".",
            f"Mean ± standard error over splits. Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"torch {torch.__version__} on {platform.machine()} ({os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} at writing), {torch.get_num_threads()} torch thread(s) in this process, "
            f"git {git_commit()}."
            + (f" Rows: a random {len(data[0])} of the set's." if max_rows else "")
            + (f" {note}" if note else ""),
        ]
        write_result(out / f"{name}.md", markdown(summary, f"Classification: {name}", notes))
    return summary


def main(argv: list[str] | None = None) -> dict[str, pd.DataFrame]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="breast_cancer", help=f"comma list of {', '.join(DATASETS)}")
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument(
        "--methods",
        default="logreg,ensemble,swag,snapshot,mc_dropout",
        help="'all' (every engine) or a comma list; 'logreg' is the scikit-learn reference",
    )
    parser.add_argument("--option", action="append", default=[], help="method:key=value, for experiments")
    parser.add_argument("--quick", action="store_true", help="1 split (smoke test)")
    parser.add_argument("--first-split", type=int, default=0, help="run splits first..first+splits-1 (default 0)")
    parser.add_argument(
        "--no-class", action="store_true", help="skip the held-out-class second fit (it doubles a slow engine's cost)"
    )
    parser.add_argument("--max-fit-seconds", type=float)
    parser.add_argument("--max-rows", type=int, help="a random subset of this many rows (seed 0), e.g. for digits")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/classification/)")
    args = parser.parse_args(argv)
    engines = [m.value for m in bp.infer.Method]
    methods = ["logreg"] + engines if args.methods == "all" else args.methods.split(",")
    for m in methods:
        if m != "logreg" and m not in engines:
            raise SystemExit(f"--methods: unknown method {m!r}; choose logreg or one of {engines}.")
    splits = [args.first_split + k for k in range(1 if args.quick else args.splits)]
    options = parse_options(args.option)
    np.seterr(all="ignore")
    return {
        name: run(
            name,
            methods,
            splits,
            results_dir("classification", args.out),
            options=options,
            note=args.note,
            max_fit_seconds=args.max_fit_seconds,
            max_rows=args.max_rows,
            held_out_class=not args.no_class,
        )
        for name in args.dataset.split(",")
    }


if __name__ == "__main__":
    main()
