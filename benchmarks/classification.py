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
  test rows from: ``noise``, Gaussian inputs of sd 3 in standardized units (``--noise-rows``, default
  :data:`NOISE_ROWS`, from seed ``NOISE_SEED + split``); ``far``, the test rows scaled by 10; ``class`` (sets
  with 3+ classes), a second fit on the training rows without the last class, scored on the test rows of that
  class against the others;
- beside the noise AUROC, its standard errors: ``se_noise_*`` by Hanley & McNeil (1982), the test rows and
  the noise rows both counted as samples, and ``sedraw_noise_*``, the part from the noise rows alone (the
  spread of the AUROC over redraws of the noise rows with the test rows fixed, DeLong et al. 1988's
  placement values); and ``auroc_noise_ntest_*``, the scoring before ``--noise-rows``: as many noise rows as
  test rows (seed ``1000 + split``), for comparison;
- per split, issue 26's joint target (``verdicts``): noise AUROC by MI (by entropy without MI) >= 0.8 with
  accuracy and NLL within 0.03 of logistic regression on that split, and the AUROC's distance to 0.8 in
  Hanley-McNeil standard errors; where the split has a NUTS row, the same target against NUTS (the exact
  posterior of the same model) too, since where the posterior itself misses logistic regression's NLL no faithful
  engine can meet it;
- for a posterior of several chains of several draws (MCMC, SWAG), its Monte Carlo checks (``chain_scores``): the
  test NLL's standard error over chains, R-hat and bulk ESS of ``f`` at training and test rows, NUTS's share of
  draws at ``max_tree_depth`` and its mean steps per draw;
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

writes ``<dataset>_splits.csv`` (one row per split and engine, appended as each fit ends), ``<dataset>.md`` /
``.csv`` (mean ± standard error over splits; the Markdown headed by the run's provenance, with the per-split
verdicts below it where logistic regression ran) and ``<dataset>_verdicts.csv`` to ``--out`` (default
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

import arviz as az
import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.comparison.limits import FitTimeout, time_limit
from bnn_pyro.posterior.diagnostics import function_draws

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.classification
    from uci import git_commit, parse_options
    from uci import summarize as uci_summarize
except ImportError:  # pragma: no cover
    from benchmarks.uci import git_commit, parse_options
    from benchmarks.uci import summarize as uci_summarize
from _common import results_dir, write_result  # noqa: E402 - uci put benchmarks/ on sys.path

DATASETS = ("breast_cancer", "wine", "iris", "digits", "synthetic")
OOD = ("noise", "far", "class")
SCORES = ("entropy", "mi")
METRICS = (
    ["accuracy", "nll", "ece"]
    + [f"auroc_{kind}_{score}" for kind in OOD for score in SCORES]
    + [f"{col}_{score}" for col in ("se_noise", "sedraw_noise", "auroc_noise_ntest") for score in SCORES]
    + ["time_s"]
)
CHAIN_CHECKS = (
    "nll_chain_se",
    "nll_chain_min",
    "nll_chain_max",
    "nll_chain_mean",
    "nll_mc_bias",
    "rhat_f_max",
    "ess_f_min",
    "rhat_f_test_max",
    "ess_f_test_min",
    "max_depth_frac",
    "n_steps_mean",
)
"""The Monte Carlo checks of an MCMC engine's row (:func:`chain_scores`), summarized beside :data:`METRICS`."""
SPLIT_COLUMNS = ["dataset", "method", "split", "n_train", "error", "warnings"] + METRICS + list(CHAIN_CHECKS)
"""The per-split file's columns, the same for every engine (empty where an engine has no such score; without the
held-out-class fit, no ``auroc_class_*`` columns), so that rows appended one by one share the first row's header."""
NOISE_ROWS = 2000
"""Noise rows scored per split by default: the noise rows' part of the AUROC's standard error, ``sd(V) / sqrt(n)``
(:func:`auroc_se_draw`), is then ``sqrt(2000 / 30) = 8`` times smaller than with as many rows as a 30-row test
set, so the verdict no longer turns on which noise rows were drawn; prediction only, no refit."""
NOISE_SEED = 10_000
"""Split ``k``'s noise rows come from a private generator seeded ``NOISE_SEED + k``: a stream of their own,
apart from the fit's seed (``k``, the global RNG) and from the test-row-sized set (seed ``1000 + k``)."""
TARGET_AUROC, TARGET_GAP = 0.8, 0.03
"""Issue 26's joint target: noise AUROC >= 0.8, accuracy and NLL within 0.03 of logistic regression."""
REFERENCE_POSTERIOR = "nuts"
"""The engine whose row, where a split has one, is the exact posterior the others are also judged against
(:func:`verdicts`' ``met_ref``): NUTS samples the model's posterior itself, the others approximate it."""


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


def ood_inputs(s: dict[str, torch.Tensor], split: int, *, noise_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Split ``split``'s off-data inputs: ``noise``, Gaussian rows of sd 3 (as many as test rows from seed
    ``1000 + split`` for ``noise_rows=None``, the scoring before ``--noise-rows``; else ``noise_rows`` of them
    from seed ``NOISE_SEED + split``), and ``far``, the test rows times 10. Private generators: the global RNG
    (the fit's) is neither read nor advanced, so the rows do not depend on the fit nor the fit on them."""
    if noise_rows is None:
        shape, seed = s["x_test"].shape, 1000 + split
    elif isinstance(noise_rows, bool) or not isinstance(noise_rows, int) or noise_rows < 2:
        raise ValueError(f"noise_rows: expected an int >= 2 (or None: as many as test rows), got {noise_rows!r}.")
    else:
        shape, seed = (noise_rows, s["x_test"].shape[1]), NOISE_SEED + split
    g = torch.Generator().manual_seed(seed)
    return dict(noise=3.0 * torch.randn(shape, generator=g), far=10.0 * s["x_test"])


def auroc_se(auroc: float, n_out: int, n_in: int) -> float:
    """Hanley & McNeil's (1982) standard error of an AUROC from ``n_out`` positives (off-data rows) and ``n_in``
    negatives (test rows):

    ``se^2 = [A (1 - A) + (n_out - 1)(Q1 - A^2) + (n_in - 1)(Q2 - A^2)] / (n_out n_in)``, ``Q1 = A / (2 - A)``,
    ``Q2 = 2 A^2 / (1 + A)``,

    the Mann-Whitney statistic's exact variance with ``Q1`` (two positives above one negative) and ``Q2`` (one
    positive above two negatives) taken from exponential scores, the paper's approximation: both samples vary.
    """
    if n_out < 1 or n_in < 1:
        raise ValueError(f"n_out, n_in: expected counts >= 1, got {n_out}, {n_in}.")
    a = auroc
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (n_out - 1) * (q1 - a * a) + (n_in - 1) * (q2 - a * a)) / (n_out * n_in)
    return math.sqrt(max(var, 0.0))


def auroc_se_draw(scores_in: torch.Tensor, scores_out: torch.Tensor) -> float:
    """The AUROC's standard error over redraws of the off-data rows alone, the test rows fixed: with
    ``V_j`` = the share of test-row scores below off-data score ``j`` (ties half; DeLong et al. 1988's placement
    value), ``AUROC = mean_j V_j`` over independent rows, so ``se = sd(V) / sqrt(n_out)`` (sd with ddof 1)."""
    ordered = scores_in.double().sort().values
    b = scores_out.double()
    below = torch.searchsorted(ordered, b, right=False).double()
    up_to = torch.searchsorted(ordered, b, right=True).double()
    v = (below + 0.5 * (up_to - below)) / len(ordered)
    return float(v.std() / math.sqrt(len(v)))


def _scores(predict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(entropy, mutual information or None) of the predictive at ``x``."""
    out = predict(x)
    if isinstance(out, torch.Tensor):  # class probabilities (logistic regression)
        p = out.clamp_min(1e-12)
        return -(p * p.log()).sum(-1), None
    return out.entropy, out.mutual_information


def _aurocs(
    predict, x_in: torch.Tensor, outs: dict[str, torch.Tensor], *, se: tuple[str, ...] = ()
) -> dict[str, float]:
    """``auroc_<kind>_<score>`` per entry of ``outs``; for the kinds in ``se`` also ``se_<kind>_<score>``
    (:func:`auroc_se`) and ``sedraw_<kind>_<score>`` (:func:`auroc_se_draw`)."""
    h_in, mi_in = _scores(predict, x_in)
    row = {}
    for kind, x_out in outs.items():
        h_out, mi_out = _scores(predict, x_out)
        for score, s_in, s_out in (("entropy", h_in, h_out), ("mi", mi_in, mi_out)):
            auc = math.nan if s_in is None else metrics.ood_auroc(s_in, s_out)
            row[f"auroc_{kind}_{score}"] = auc
            if kind in se:
                row[f"se_{kind}_{score}"] = math.nan if s_in is None else auroc_se(auc, len(x_out), len(x_in))
                row[f"sedraw_{kind}_{score}"] = math.nan if s_in is None else auroc_se_draw(s_in, s_out)
    return row


def _fit(method: str, x, y, num_classes: int, split: int, options: dict):
    if method == "logreg":
        from sklearn.linear_model import LogisticRegression

        clf = LogisticRegression(C=1.0, max_iter=5000).fit(x.numpy(), y.numpy())
        return lambda xs: torch.tensor(clf.predict_proba(xs.numpy()), dtype=torch.float64)
    post = bp.fit(
        make_model(x.shape[1], num_classes, split), x, y, method=method, seed=split, progress=False, **options
    )

    def predict(xs):
        return post.predict(xs, seed=0)

    predict.posterior = post  # run_one's chain_scores read it
    return predict


def chain_scores(post, x_test: torch.Tensor, y_test: torch.Tensor) -> dict[str, float]:
    """Monte Carlo checks of a posterior of several chains of several draws (MCMC; SWAG's chains too, where R-hat
    says how far its chains' Gaussians disagree), empty otherwise (one draw per chain: an ensemble).

    ``nll_chain_se``: the standard error of the test NLL over chains, ``sd(NLL_c) / sqrt(C)`` with ``NLL_c`` the
    NLL of chain ``c``'s own model average; chains are independent replicates, so this error holds where
    within-chain ESS understates it (a multimodal posterior; chain-level errors, as the zoo's reference uses).
    ``nll_chain_min`` / ``nll_chain_max`` / ``nll_chain_mean``: the extremes and mean over chains.

    ``nll_mc_bias``: how far the NLL of a model average over few effective draws sits above the exact
    predictive's, by the delta method: the log loss is convex, so with ``p_i`` the posterior mean of row ``i``'s
    probability of its label, ``v_i`` its posterior variance over draws and ``n_i`` the bulk ESS of that
    probability (ArviZ, over chains and draws), ``E[-log p_hat_i] ~ -log p_i + v_i / (2 p_i^2 n_i)``; the column is
    the mean over test rows of ``v_i / (2 p_hat_i^2 n_i)``, plugged in. A bias of ``b / n_eff`` puts a chain's
    own average (``n_eff / C``) ``(C - 1)`` times the pooled bias above the pooled NLL, which ``nll_chain_mean -
    nll`` measures without the delta method. ``rhat_f_max`` / ``ess_f_min``: the worst
    R-hat and bulk ESS of ``f`` at the training inputs the fit-time health check reads
    (``post.summary(space="function")``); ``rhat_f_test_max`` / ``ess_f_test_min``: the same at every test row.
    ``max_depth_frac`` / ``n_steps_mean``: NUTS's share of draws at ``max_tree_depth`` and its mean leapfrog
    steps per draw (the cost per draw), where the kernel records them.
    """
    if post.num_chains < 2 or post.num_draws < 2:
        return {}
    f = function_draws(post, x_test)  # (chains, draws, rows, classes): the logits of Categorical(logits=f)
    chain_nll = torch.tensor([metrics.nll(torch.softmax(fc.double(), -1).mean(0), y_test) for fc in f])
    label = y_test.reshape(1, 1, -1, 1).expand(*f.shape[:3], 1)
    p = torch.softmax(f.double(), -1).gather(-1, label)[..., 0]  # (chains, draws, rows): each draw's p(label)
    ess = torch.as_tensor(np.asarray(az.ess(az.convert_to_dataset(p.numpy()))["x"]), dtype=torch.float64)
    mc_bias = p.flatten(0, 1).var(0) / (2 * p.mean((0, 1)).square() * ess)
    train = post.summary(space="function", warn=False)
    test = post.summary(space="function", x=x_test, warn=False)
    row = dict(
        nll_chain_se=float(chain_nll.std() / math.sqrt(len(chain_nll))),
        nll_chain_min=float(chain_nll.min()),
        nll_chain_max=float(chain_nll.max()),
        nll_chain_mean=float(chain_nll.mean()),
        nll_mc_bias=float(mc_bias.mean()),
        rhat_f_max=float(train["r_hat"].max()),
        ess_f_min=float(train["ess_bulk"].min()),
        rhat_f_test_max=float(test["r_hat"].max()),
        ess_f_test_min=float(test["ess_bulk"].min()),
    )
    stats, depth = post.sample_stats, post.config.get("max_tree_depth")
    if "tree_depth" in stats and depth:
        row["max_depth_frac"] = float((stats["tree_depth"] >= depth).double().mean())
    if "n_steps" in stats:
        row["n_steps_mean"] = float(stats["n_steps"].double().mean())
    return row


def run_one(
    method: str,
    data: tuple,
    split: int,
    options: dict | None = None,
    *,
    max_fit_seconds: float | None = None,
    held_out_class: bool = True,
    noise_rows: int | None = NOISE_ROWS,
    fit=None,
) -> dict:
    """Fit and score ``method`` on one split (a failure becomes a row with its ``error`` text); the held-out-class
    second fit only where ``held_out_class`` (it doubles the cost); ``noise_rows`` noise rows (``None``: as many
    as test rows, the scoring before ``--noise-rows``). ``fit``: a callable with :func:`_fit`'s arguments returning
    a predict function, used in its place (a prototype that is not a ``bp.fit`` engine, scored the same way:
    ``benchmarks/svi_repulsive.py``)."""
    fit = fit or _fit
    x, y = data
    s = make_split(x, y, split)
    k = int(y.max()) + 1
    row = dict(method=method, split=split, n_train=len(s["x_train"]), error="", warnings="")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            with time_limit(max_fit_seconds):
                predict = fit(method, s["x_train"], s["y_train"], k, split, options or {})
            row["time_s"] = time.perf_counter() - start
            out = predict(s["x_test"])
            probs = out if isinstance(out, torch.Tensor) else out.probs
            row.update(
                accuracy=metrics.accuracy(probs, s["y_test"]),
                nll=metrics.nll(probs, s["y_test"]),
                ece=metrics.ece(probs, s["y_test"]),
            )
            outs = ood_inputs(s, split, noise_rows=noise_rows)
            outs["noise_ntest"] = ood_inputs(s, split)["noise"]
            row.update(_aurocs(predict, s["x_test"], outs, se=("noise",)))
            if hasattr(predict, "posterior"):
                row.update(chain_scores(predict.posterior, s["x_test"], s["y_test"]))
            if k >= 3 and held_out_class:  # held-out class: the last one
                keep, held = s["y_train"] < k - 1, s["y_test"] == k - 1
                with time_limit(max_fit_seconds):
                    predict_wo = fit(method, s["x_train"][keep], s["y_train"][keep], k - 1, split, options or {})
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
    return uci_summarize(rows, METRICS + list(CHAIN_CHECKS))


def markdown(summary: pd.DataFrame, title: str, notes: list[str]) -> str:
    cols = [m for m in METRICS + list(CHAIN_CHECKS) if summary[m].notna().any()]
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
    d = 1 if metric in ("time_s", "ess_f_min", "ess_f_test_min", "n_steps_mean") else 3
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
    noise_rows: int | None = NOISE_ROWS,
) -> pd.DataFrame:
    """Every method on every split of ``name``; rows appended as each fit ends, the summary rewritten per split."""
    out.mkdir(parents=True, exist_ok=True)
    data = subset(load_dataset(name), max_rows)
    per_split = out / f"{name}_splits.csv"
    per_split.unlink(missing_ok=True)
    header = [c for c in SPLIT_COLUMNS if held_out_class or not c.startswith("auroc_class_")]
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
                    noise_rows=noise_rows,
                ),
            )
            rows.append(row)
            columns = list(dict.fromkeys(header + list(row)))  # one header for every engine's row
            pd.DataFrame([row], columns=columns).to_csv(per_split, mode="a", header=not per_split.exists(), index=False)
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
            + f" Noise rows per split: {noise_rows or 'as many as test rows'}."
            + (f" {note}" if note else ""),
        ]
        text = markdown(summary, f"Classification: {name}", notes)
        if "logreg" in methods:
            table = verdicts(pd.DataFrame(rows))
            table.to_csv(out / f"{name}_verdicts.csv", index=False)
            text += "\n" + verdicts_markdown(table)
        write_result(out / f"{name}.md", text)
    return summary


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """Per split and engine, issue 26's joint target: noise AUROC by MI (by entropy where there is no MI)
    ``>= TARGET_AUROC``, accuracy ``>=`` and NLL ``<=`` logistic regression's on that split ``-/+ TARGET_GAP``.

    ``z = (AUROC - 0.8) / se`` (Hanley-McNeil ``se``): ``|z| < 2`` marks a verdict within noise of the
    threshold. ``met_ntest`` is the same target scored on the test-row-sized noise set (``auroc_ntest``).
    Splits without a successful logistic-regression row are left out (nothing to compare with).

    Where the split also has a :data:`REFERENCE_POSTERIOR` row (NUTS: the exact posterior of the same model),
    ``accuracy_gap_ref`` / ``nll_gap_ref`` are the gaps to it and ``met_ref`` is the same target with it in
    logistic regression's place: where the posterior itself misses logistic regression's NLL (a property of the
    model's prior on that data), ``met_ref`` judges the engine as an approximation of the posterior; NaN / False
    without such a row (and on the reference's own row).
    """
    ok = rows[rows["error"].fillna("") == ""]
    ref = ok[ok["method"] == "logreg"].set_index("split")
    exact = ok[ok["method"] == REFERENCE_POSTERIOR].set_index("split")
    out = []
    for _, r in ok[ok["method"] != "logreg"].iterrows():
        if r["split"] not in ref.index:
            continue
        score = "mi" if math.isfinite(r.get("auroc_noise_mi", math.nan)) else "entropy"
        acc_gap = r["accuracy"] - ref.loc[r["split"], "accuracy"]
        nll_gap = r["nll"] - ref.loc[r["split"], "nll"]
        fits = acc_gap >= -TARGET_GAP and nll_gap <= TARGET_GAP
        has_ref = r["method"] != REFERENCE_POSTERIOR and r["split"] in exact.index
        acc_ref = r["accuracy"] - exact.loc[r["split"], "accuracy"] if has_ref else math.nan
        nll_ref = r["nll"] - exact.loc[r["split"], "nll"] if has_ref else math.nan
        auc, se = r[f"auroc_noise_{score}"], r[f"se_noise_{score}"]
        old = r.get(f"auroc_noise_ntest_{score}", math.nan)
        out.append(
            dict(
                split=r["split"],
                method=r["method"],
                score=score,
                accuracy_gap=acc_gap,
                nll_gap=nll_gap,
                auroc=auc,
                se=se,
                sedraw=r[f"sedraw_noise_{score}"],
                z=(auc - TARGET_AUROC) / se if se > 0 else math.nan,
                met=bool(fits and auc >= TARGET_AUROC),
                auroc_ntest=old,
                met_ntest=bool(fits and old >= TARGET_AUROC),
                accuracy_gap_ref=acc_ref,
                nll_gap_ref=nll_ref,
                met_ref=bool(has_ref and acc_ref >= -TARGET_GAP and nll_ref <= TARGET_GAP and auc >= TARGET_AUROC),
            )
        )
    return pd.DataFrame(out)


def verdicts_markdown(table: pd.DataFrame) -> str:
    """The per-split verdicts as a Markdown table (✓ met, ✗ not; "(< 2 se)" where ``|z| < 2``), and where a split
    has a :data:`REFERENCE_POSTERIOR` row, a second table of the verdicts against it (``met_ref``)."""
    lines = [
        "## Per split: issue 26's joint target",
        "",
        "Noise AUROC by MI (entropy where there is no MI) ± its Hanley-McNeil se, the noise rows' own part of it "
        "(draw se), the distance to 0.8 in se (z), and the gaps to logistic regression on the split; the last "
        "columns score the same fit on as many noise rows as test rows (the scoring before --noise-rows).",
        "",
        "| split | engine | accuracy − logreg | NLL − logreg | noise AUROC ± se | draw se | z | verdict "
        "| AUROC on n_test rows | verdict then |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in table.iterrows():
        near = " (< 2 se)" if abs(r["z"]) < 2 else ""
        lines.append(
            f"| {r['split']} | {r['method']} | {r['accuracy_gap']:+.3f} | {r['nll_gap']:+.3f} | "
            f"{r['auroc']:.3f} ± {r['se']:.3f} | {r['sedraw']:.3f} | {r['z']:+.1f} | "
            f"{'✓' if r['met'] else '✗'}{near} | {r['auroc_ntest']:.3f} | {'✓' if r['met_ntest'] else '✗'} |"
        )
    judged = table[table["nll_gap_ref"].notna()] if "nll_gap_ref" in table else table.iloc[:0]
    if len(judged):
        ref = REFERENCE_POSTERIOR
        lines += [
            "",
            f"## Per split: the same target against {ref} (the exact posterior of the same model)",
            "",
            f"| split | engine | accuracy − {ref} | NLL − {ref} | noise AUROC | verdict against {ref} |",
            "|---|---|---|---|---|---|",
        ]
        for _, r in judged.iterrows():
            lines.append(
                f"| {r['split']} | {r['method']} | {r['accuracy_gap_ref']:+.3f} | {r['nll_gap_ref']:+.3f} | "
                f"{r['auroc']:.3f} | {'✓' if r['met_ref'] else '✗'} |"
            )
    return "\n".join(lines) + "\n"


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
    parser.add_argument(
        "--noise-rows",
        type=int,
        default=NOISE_ROWS,
        help=f"noise rows scored per split (default {NOISE_ROWS}); 0: as many as test rows (the scoring before)",
    )
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/classification/)")
    args = parser.parse_args(argv)
    engines = [m.value for m in bp.infer.Method]
    methods = ["logreg"] + engines if args.methods == "all" else args.methods.split(",")
    for m in methods:
        if m != "logreg" and m not in engines:
            raise SystemExit(f"--methods: unknown method {m!r}; choose logreg or one of {engines}.")
    if args.noise_rows == 1 or args.noise_rows < 0:
        raise SystemExit(f"--noise-rows: expected 0 (as many as test rows) or an int >= 2, got {args.noise_rows}.")
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
            noise_rows=args.noise_rows or None,
        )
        for name in args.dataset.split(",")
    }


if __name__ == "__main__":
    main()
