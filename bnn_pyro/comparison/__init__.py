"""``bp.compare``: every inference engine that applies to a model, fitted and scored the same way, in one table.

Every engine returns the same :class:`~bnn_pyro.Posterior` from the same model, so "which engine can I
trust on my model and data?" is one call: each method is fitted on the training rows (of each split),
scored on the held-out rows from all of its draws, and diagnosed (function-space R-hat and ESS,
divergences, PSIS k-hat, the health warnings of its fit). See ``docs/compare.md`` for the columns.

Example
-------
>>> result = bp.compare(model, x, y, test=(x_test, y_test), options={"nuts": {"num_samples": 200}})
>>> result.table                       # one row per method
>>> result.posteriors["swag"].predict(x_new)
>>> result.save("runs/compare")        # table.csv, table.md, the figures as PNG
>>> bp.compare(model, x, y, splits=5, cache="runs/cache")   # 5-fold: mean and SE; a rerun skips what is done
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from bnn_pyro.comparison.cache import Cache, fingerprint
from bnn_pyro.comparison.limits import FitTimeout, time_limit
from bnn_pyro.comparison.scoring import CLASSIFICATION, DIAGNOSTICS, REGRESSION, diagnose, score
from bnn_pyro.data.splits import k_fold
from bnn_pyro.infer import Method, fit, unfit_reason
from bnn_pyro.infer.progress import progress_bar
from bnn_pyro.model import BNN, check_model_data
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import check_data, choice, feature_names, flag, match_columns, positive_int
from bnn_pyro.utils.user_warnings import warn

__all__ = ["compare", "Comparison"]

Split = tuple[Any, Any, Any, Any]
_QUIET = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)  # library upkeep, not the fit's health


@dataclass
class Comparison:
    """What :func:`compare` returns.

    Attributes
    ----------
    table:
        One row per method (index: the method's name); the columns are described in ``docs/compare.md``.
        With several splits each metric is the mean over the splits that succeeded and ``<metric>_se`` its
        standard error (sd / sqrt(n), ddof 1); with one test set ``test_ll_se`` is the standard error over
        the test points.
    posteriors:
        Method -> its fitted :class:`~bnn_pyro.Posterior` (on the first split when there are several).
    rows:
        One row per method and split (the table before averaging).
    task:
        ``"regression"`` or ``"classification"``.
    test:
        ``(x_train, y_train, x_test, y_test)`` of the first split (what :meth:`plot` draws).
    total_s:
        Wall time of the whole comparison in seconds (fits, scoring, diagnostics, cache).
    """

    table: pd.DataFrame
    posteriors: dict[str, Posterior]
    rows: pd.DataFrame
    task: str
    test: Split = field(repr=False)
    total_s: float = math.nan

    def plot(self) -> dict[str, Any]:
        """The figures, by name: ``"test_ll"`` (a dot per method, +- SE); ``"predictive"`` (bands side by side,
        regression with 1-D inputs) or ``"reliability"`` (diagrams side by side, classification)."""
        from bnn_pyro.comparison import figures

        out = {"test_ll": figures.test_ll(self.table)}
        x_test, y_test = (torch.as_tensor(t) for t in self.test[2:])
        if self.posteriors and self.task == "classification":
            out["reliability"] = figures.reliability(self.posteriors, x_test, y_test)
        elif self.posteriors and x_test.dim() <= 2 and x_test.reshape(len(x_test), -1).shape[1] == 1:
            out["predictive"] = figures.predictive_bands(self.posteriors, x_test.reshape(-1, 1), y_test)
        return out

    def save(self, folder: str | os.PathLike) -> list[Path]:
        """Write ``table.csv``, ``table.md``, ``rows.csv`` (per split) and the figures of :meth:`plot` as PNG into
        ``folder`` (created if missing; these files are replaced, nothing else there is touched)."""
        import matplotlib.pyplot as plt

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "table.csv", out / "table.md", out / "rows.csv"]
        self.table.to_csv(paths[0])
        paths[1].write_text(markdown(self.table))
        self.rows.to_csv(paths[2], index=False)
        for name, fig in self.plot().items():
            paths.append(out / f"{name}.png")
            fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
            plt.close(fig)
        return paths


def compare(
    model: BNN | Callable,
    x=None,
    y=None,
    *,
    methods: Sequence[str] | None = None,
    test: tuple | None = None,
    splits: int | Sequence[Split] | None = None,
    ood=None,
    options: dict[str, dict] | None = None,
    seed: int = 0,
    progress: bool = True,
    cache: str | os.PathLike | None = None,
    time_limit: float | None = None,
) -> Comparison:
    """Fit ``model`` with every method in ``methods`` and tabulate held-out quality, cost and diagnostics.

    Parameters
    ----------
    model:
        A :class:`~bnn_pyro.BNN` or a Pyro function model, as for :func:`bnn_pyro.fit`.
    x, y:
        The training data (with ``test=`` or ``splits=k``); leave them out when ``splits`` is a list.
    methods:
        Method names; ``None``: every registered method whose declaration applies to the model
        (:func:`bnn_pyro.infer.unfit_reason`), in the registry's order.
    test:
        ``(x_test, y_test)``: the held-out rows. With neither ``test`` nor ``splits`` the scores are taken on
        the training rows (in-sample; a warning says so).
    splits:
        An integer ``k``: k-fold cross-validation of ``(x, y)`` (:func:`bnn_pyro.data.splits.k_fold`, shuffled by
        ``seed``); or a list of ``(x_train, y_train, x_test, y_test)``. The table holds the mean and standard
        error over the splits (the UCI protocol for any data).
    ood:
        Out-of-distribution inputs: adds ``ood_auroc``, how well the predictive's uncertainty tells them from
        the test inputs (classification: the entropy of the model-averaged probabilities; regression: the
        predictive standard deviation).
    options:
        Settings per method, e.g. ``{"nuts": {"num_samples": 200}}``; every other setting is the method's default.
    seed:
        Split ``i`` is fitted with ``seed=seed + i`` (unless ``options`` sets a seed) and ``k``-fold rows are
        shuffled with ``seed``.
    progress:
        One progress bar over the fits (the engines' own bars are off unless ``options`` turns them on).
    cache:
        A folder: each method's row and posterior on each split is written there as soon as it is done, and
        a rerun with the same arguments reuses them instead of fitting again (see ``docs/compare.md``). Rows with
        an error are not kept: a rerun tries those fits again.
    time_limit:
        Seconds of wall time per fit; a longer fit is stopped and becomes an error row (``FitTimeout``). It uses
        ``SIGALRM``: the main thread of a Unix process only. ``None``: no limit.

    Notes
    -----
    A method that fails (an error from ``bp.fit`` or from scoring) becomes a row with its ``error`` text; the
    others go on. Ctrl-C stops the comparison; with ``cache`` a rerun resumes it.
    """
    started = time.perf_counter()
    progress = flag("progress", progress)
    seed = positive_int("seed", seed, allow_zero=True)
    given = (*_convert(model, x, y), test, splits, seed) if _pandas(x) and isinstance(splits, int) else None  # k-fold
    raw = _splits(*(given or (x, y, test, splits, seed)))
    data = [_arrays(split, model) for split in raw]
    if ood is not None and (_pandas(ood) or _off_cpu(model)):  # its columns matched to the training inputs' by name
        ood = _convert(model, match_columns(ood, feature_names(x if x is not None else raw[0][0])), None)[0]
    _check_rows(model, data)
    methods = _methods(model, methods, data[0][0], data[0][1])
    options = _options(options, methods)
    task = _task(model, data[0][1])
    store = Cache(cache)
    rows, posteriors = [], {}

    with progress_bar(len(data) * len(methods), "compare", progress, leave=True) as bar:
        for i, (x_train, y_train, x_test, y_test) in enumerate(data):
            for method in methods:
                bar.set_description(f"compare: {method}" + (f", split {i + 1}/{len(data)}" if len(data) > 1 else ""))
                settings = {"seed": seed + i, "progress": False, **options[method]}
                key = fingerprint(
                    method,
                    settings,
                    seed + i,
                    model,
                    (x_train, y_train, x_test, y_test, *(() if ood is None else (ood,))),
                )
                row, post = store.row(method, i, key), None
                if row is None:
                    row, post = _run(model, method, settings, x_train, y_train, x_test, y_test, ood, time_limit)
                    if not row["error"]:
                        store.write(method, i, key, row, post)
                elif i == 0 and not row["error"]:
                    post = store.posterior(method, i, model)
                if i == 0 and post is not None:
                    posteriors[method] = post
                rows.append({"method": method, "split": i, **row})
                bar.update()
    rows = pd.DataFrame(rows)
    table = _table(rows, task, len(data), ood is not None)
    return Comparison(
        table=table,
        posteriors=posteriors,
        rows=rows,
        task=task,
        test=_own(data[0]),
        total_s=time.perf_counter() - started,
    )


def _own(split: Split) -> Split:
    """The result's own copy of the first split (what :meth:`Comparison.plot` draws): a user's array edited in place
    after the comparison would otherwise change the figures (tensors cloned; numpy and pandas ``.copy()``)."""
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t.copy() if hasattr(t, "copy") else t for t in split)


def _run(
    model, method: str, settings: dict, x_train, y_train, x_test, y_test, ood, seconds: float | None
) -> tuple[dict, Posterior | None]:
    """Fit and score one method on one split: ``(row, posterior)``, or an error row and ``None``."""
    row: dict[str, Any] = {"fit_s": math.nan, "score_s": math.nan, "error": "", "warnings": ""}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            with time_limit(seconds):
                post = fit(model, x_train, y_train, method=method, **settings)
            row["fit_s"] = time.perf_counter() - start
        row["warnings"] = " / ".join(
            dict.fromkeys(
                str(w.message).strip().splitlines()[0]
                for w in caught
                if not issubclass(w.category, _QUIET) and str(w.message).strip()
            )
        )
        start = time.perf_counter()
        row.update(score(post, x_test, y_test, ood=ood))
        row.update(diagnose(post))
        row["score_s"] = time.perf_counter() - start
        return row, post
    except (Exception, FitTimeout) as err:  # noqa: BLE001 - any failure becomes the method's row; the table goes on
        text = str(err).strip().splitlines()
        row["error"] = f"{type(err).__name__}: {text[0] if text else ''}"
        return row, None


def _splits(x, y, test, splits, seed: int) -> list[Split]:
    if splits is not None and test is not None:
        raise ValueError(
            "test: give test=(x_test, y_test) or splits=, not both; with splits every split holds its own test rows."
        )
    if isinstance(splits, (list, tuple)):
        if x is not None or y is not None:
            raise ValueError(
                "x, y: with splits= a list of (x_train, y_train, x_test, y_test), leave x and y out; "
                "or pass x, y with splits=k for k-fold cross-validation."
            )
        if not splits or not all(isinstance(s, (list, tuple)) and len(s) == 4 for s in splits):
            raise ValueError(
                "splits: expected an integer k (k-fold) or a non-empty list of (x_train, y_train, x_test, "
                "y_test) tuples, e.g. [bp.datasets.train_test_split(x, y, seed=s) for s in range(5)]."
            )
        return [tuple(s) for s in splits]
    if x is None or y is None:
        raise ValueError(
            "x, y: the training data are missing; pass bp.compare(model, x, y, test=(x_test, y_test)), "
            "or splits= a list of (x_train, y_train, x_test, y_test)."
        )
    if splits is not None:
        return k_fold(x, y, splits, seed=seed)
    if test is None:
        warn(
            "bp.compare: no test= or splits= given, so every score is taken on the training rows (in-sample: "
            "it rewards overfitting). Pass test=(x_test, y_test) or splits=5.",
            UserWarning,
        )
        return [(x, y, x, y)]
    if not (isinstance(test, (list, tuple)) and len(test) == 2):
        raise ValueError(
            f"test: expected a pair (x_test, y_test), got {type(test).__name__}"
            f"{' of length ' + str(len(test)) if isinstance(test, (list, tuple)) else ''}."
        )
    return [(x, y, *test)]


def _pandas(value) -> bool:
    return hasattr(value, "to_numpy")


def _off_cpu(model) -> bool:
    return isinstance(model, BNN) and model.device.type != "cpu"


def _convert(model, x, y):
    """``x``, ``y`` converted as ``bp.fit`` converts a fit's data (:func:`~bnn_pyro.model.check_model_data`'s
    conversion: a ``BNN``'s device, float dtype and integer inputs; ``check_data``'s defaults otherwise), without
    its checks against the model (:func:`_check_rows` makes them, naming the split)."""
    if isinstance(model, BNN):
        return check_data(x, y, device=model.device, float_dtype=model.dtype, keep_integer=model.integer_inputs)
    return check_data(x, y)


def _arrays(split: Split, model) -> Split:
    """A split whose pandas parts are arrays: the test inputs' columns matched to the training inputs' by name
    (as a posterior matches a DataFrame's, :attr:`~bnn_pyro.Posterior.feature_names`), each pair checked and
    converted as a fit converts its data (:func:`_convert`: row labels paired, non-numeric columns named, onto a
    ``BNN``'s device). A model off the CPU gets every split so, so that the test rows meet the predictions there."""
    if not (_off_cpu(model) or any(_pandas(part) for part in split)):
        return split
    x_train, y_train, x_test, y_test = split
    x_test = match_columns(x_test, feature_names(x_train))
    return (*_convert(model, x_train, y_train), *_convert(model, x_test, y_test))


def _check_rows(model, data: list[Split]) -> None:
    """Every split's training and test rows checked as ``bp.fit`` checks its data, before any fit: a test set with
    other columns or another number of rows than its targets failed once per method, each after its fit."""
    for i, split in enumerate(data):
        for what, (x, y) in (("training", split[:2]), ("test", split[2:])):
            try:
                check_model_data(model, x, y)
            except (TypeError, ValueError) as err:
                where = f"split {i}'s" if len(data) > 1 else "the"
                raise type(err)(f"{'test' if what == 'test' else 'x, y'}: {where} {what} rows: {err}") from None


def _methods(model, methods, x, y) -> list[str]:
    if methods is None:
        if isinstance(model, BNN):
            try:
                x, _ = _convert(model, x, y)
            except (TypeError, ValueError):  # tuple/dict inputs: the declaration's check sees them as given
                pass
        return [m.value for m in Method if unfit_reason(m, model, x) is None]
    if isinstance(methods, str):
        methods = [methods]
    chosen = [choice("methods", m, Method).value for m in methods]
    if not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"methods: expected distinct method names, got {list(methods)}; e.g. ['svi', 'nuts'], "
            "or None for every method that applies."
        )
    return chosen


def _options(options, methods: list[str]) -> dict[str, dict]:
    options = {} if options is None else options
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise TypeError("options: expected a dict of method -> dict of settings, e.g. {'nuts': {'num_samples': 200}}.")
    extra = [m for m in options if choice("options", m, Method).value not in methods]
    if extra:
        raise ValueError(
            f"options: settings for {extra}, which are not compared here (methods: {methods}); drop them "
            "or add those methods."
        )
    return {m: dict(options.get(m, options.get(Method(m), {}))) for m in methods}


def _task(model, y) -> str:
    task = getattr(getattr(model, "likelihood", None), "task", None)
    if task is None:  # a Pyro function model: integer targets are class labels
        task = "regression" if torch.as_tensor(y).dtype.is_floating_point else "classification"
    return task


def _table(rows: pd.DataFrame, task: str, n_splits: int, ood: bool) -> pd.DataFrame:
    """One row per method: the split's values, or mean and SE over the splits without an error."""
    metrics = list(REGRESSION if task == "regression" else CLASSIFICATION) + (["ood_auroc"] if ood else [])
    numeric = ["fit_s", "score_s", *metrics, *DIAGNOSTICS]
    for name in numeric + ["test_ll_se"]:
        if name not in rows:
            rows[name] = math.nan
    if n_splits == 1:
        columns = ["fit_s", "score_s", "test_ll", "test_ll_se", *metrics[1:], *DIAGNOSTICS, "error", "warnings"]
        table = rows.set_index("method")[columns]
        return table.astype({c: float for c in numeric + ["test_ll_se"]})
    out = {}
    for method, group in rows.groupby("method", sort=False):
        ok = group[group["error"] == ""]
        entry: dict[str, Any] = {}
        for name in numeric:
            values = ok[name].to_numpy(dtype=float)
            with np.errstate(invalid="ignore"):  # an infinite k-hat: mean inf, SE NaN
                entry[name] = values.mean() if len(values) else math.nan
                entry[f"{name}_se"] = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        entry["splits_ok"] = len(ok)
        errors = group.loc[group["error"] != "", "error"]
        entry["error"] = errors.iloc[0] if len(errors) else ""
        entry["warnings"] = " / ".join(dict.fromkeys(t for w in ok["warnings"] for t in w.split(" / ") if t))
        out[method] = entry
    table = pd.DataFrame.from_dict(out, orient="index")
    table.index.name = "method"
    return table


def markdown(table: pd.DataFrame) -> str:
    """``table`` as a GitHub Markdown table: numbers to 4 significant digits, a column ``c`` with ``c_se`` beside
    it as ``mean ± se`` cells, empty cells for NaN."""

    def cell(value, se=math.nan) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return ""
            return f"{value:.4g}" if math.isnan(se) else f"{value:.4g} ± {se:.2g}"
        return str(value).replace("|", "/").replace("\n", " ")

    columns = [c for c in table.columns if not (str(c).endswith("_se") and str(c)[:-3] in table.columns)]
    header = [table.index.name or ""] + [f"{c} ± se" if f"{c}_se" in table.columns else str(c) for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in table.iterrows():
        cells = [cell(row[c], row[f"{c}_se"] if f"{c}_se" in table.columns else math.nan) for c in columns]
        lines.append("| " + " | ".join([str(name)] + cells) + " |")
    return "\n".join(lines) + "\n"
