"""Plots of a :class:`~bnn_pyro.Posterior`: trace, rank, energy, pair, predictive band, reliability;
and of a classifier's predictions: reliability before/after calibration, rejection curves.

Every function takes a posterior (or, for the last two, predictions and labels) and returns the
``matplotlib.figure.Figure`` it drew on (never calls ``plt.show``). Trace, rank, energy and pair plots
are ArviZ's, fed by :func:`bnn_pyro.posterior.diagnostics.to_inference_data`. Scalars are named as in ``post.summary()``:
``"sigma"``, ``"0.weight[3, 0]"``; a bare name of a tensor site means all of its entries.

Example
-------
>>> fig = post.plot_trace(var_names=["sigma"])
>>> fig = post.plot_pair(["0.weight[0, 0]", "0.bias[0]"])
>>> fig = post.plot_predictive()                 # 1-D regression: data, mean, epistemic and total bands
>>> fig.savefig("fit.png")
>>> fig = plots.plot_rejection(clf.predict(x_test), y_test)            # accuracy vs fraction rejected
>>> fig = plots.plot_calibration(pred, calibration.TemperatureScaling.fit(pred_val, y_val)(pred), y_test)
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import arviz as az
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib import MatplotlibDeprecationWarning
from matplotlib.figure import Figure

from bnn_pyro import metrics
from bnn_pyro.posterior import diagnostics
from bnn_pyro.predictions import ClassificationPrediction, RegressionPrediction, quantiles
from bnn_pyro.utils.checks import check_data, match_columns, positive_int

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = [
    "arviz_plotting",
    "plot_trace",
    "plot_rank",
    "plot_energy",
    "plot_pair",
    "plot_predictive",
    "plot_reliability",
    "plot_calibration",
    "plot_rejection",
]

_SCALAR = re.compile(r"^(?P<name>.+?)(\[(?P<index>[\d,\s]*)\])?$")


@contextlib.contextmanager
def arviz_plotting() -> Iterator[None]:
    """Around a call of an ArviZ plot function: ignore the ``MatplotlibDeprecationWarning`` s that ArviZ's own
    code triggers (ArviZ 0.23 calls Matplotlib APIs that Matplotlib 3.10+ deprecates, about 20 warnings per
    plot once warnings are shown), and nothing else.

    Only warnings attributed to ArviZ's modules are ignored, and only inside the ``with`` block
    (``warnings.catch_warnings`` restores the filters on exit), so a user's own Matplotlib code, before or
    after, still shows its deprecations."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=MatplotlibDeprecationWarning, module=r"arviz(\.|$)")
        yield


def _figure(axes) -> Figure:
    return np.ravel(axes)[0].figure


def _samples_only(post: Posterior, data: dict | None = None) -> az.InferenceData:
    """The draws as InferenceData for ArviZ's plots, in float64: ArviZ's density estimate bins each site's range in
    512 bins, which float32 cannot resolve for draws spread over ~1e-7 (numpy's "Too many bins for data range")."""
    if data is None:
        idata = diagnostics.to_inference_data(post, log_likelihood=False, posterior_predictive=False)
        idata.posterior = idata.posterior.astype(np.float64)
        return idata
    data = {k: np.asarray(v, dtype=np.float64) for k, v in data.items()}
    return diagnostics.from_dict(posterior=data, sample_stats=diagnostics.sample_stats(post))


def scalars(post: Posterior, params: Sequence[str] | None = None, *, limit: int = 8) -> dict[str, np.ndarray]:
    """Draws ``(chains, draws)`` of single weights: ``params`` like ``["sigma", "0.weight[3, 0]"]``,
    or the first ``limit`` scalars of the posterior; one string is one entry (not its characters)."""
    if isinstance(params, str):
        params = [params]
    if params is None:
        out = {}
        for name, value in post.samples.items():
            flat = value.reshape(value.shape[:2] + (-1,))
            for k in range(min(flat.shape[-1], limit - len(out))):
                index = np.unravel_index(k, value.shape[2:]) if value.dim() > 2 else ()
                out[_label(name, index)] = flat[..., k].cpu().numpy()
        return out
    out = {}
    for spec in params:
        match = _SCALAR.match(str(spec))
        name = match["name"] if match else str(spec)
        if match is None or name not in post.samples:
            raise ValueError(
                f"params: unknown site {name!r} in {spec!r}; this posterior has {list(post.samples)} "
                "(write single entries as '0.weight[3, 0]')."
            )
        value = post.samples[name]
        if match["index"] is None:
            for index in np.ndindex(*value.shape[2:]):
                out[_label(name, index)] = value[(slice(None), slice(None)) + index].cpu().numpy()
            continue
        index = tuple(int(i) for i in match["index"].split(",") if i.strip())
        if len(index) != value.dim() - 2 or any(not 0 <= i < s for i, s in zip(index, value.shape[2:])):
            raise ValueError(f"params: {spec!r} is not an entry of {name!r}, whose shape is {tuple(value.shape[2:])}.")
        out[_label(name, index)] = value[(slice(None), slice(None)) + index].cpu().numpy()
    return out


def _task(post: Posterior) -> str | None:
    return getattr(getattr(post.model, "likelihood", None), "task", None)


def _label(name: str, index: tuple) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in index)}]" if len(index) else name


def plot_trace(post: Posterior, var_names: Sequence[str] | None = None, **kwargs) -> Figure:
    """ArviZ trace plot (densities per chain, and draws), one row per site (all sites by default)."""
    names = diagnostics.site_names(post, var_names)
    with arviz_plotting():
        axes = az.plot_trace(_samples_only(post), var_names=names, compact=True, **kwargs)
    return _figure(axes)


def plot_rank(post: Posterior, params: Sequence[str] | None = None, *, limit: int = 8, **kwargs) -> Figure:
    """ArviZ rank plot (rank histograms per chain; flat when chains mix) of chosen scalars."""
    data = scalars(post, params, limit=positive_int("limit", limit))
    with arviz_plotting():
        axes = az.plot_rank(_samples_only(post, data), **kwargs)
    return _figure(axes)


def plot_pair(post: Posterior, params: Sequence[str] | None = None, *, limit: int = 4, **kwargs) -> Figure:
    """ArviZ pair plot (joint scatter of draws) of chosen scalars, e.g. ``["0.weight[0, 0]", "sigma"]``."""
    data = scalars(post, params, limit=positive_int("limit", limit))
    if len(data) < 2:
        raise ValueError(
            f"params: a pair plot needs at least 2 scalars, got {list(data)}; name two, "
            "e.g. ['0.weight[0, 0]', '0.bias[0]']."
        )
    kwargs.setdefault("divergences", "diverging" in diagnostics.sample_stats(post))
    with arviz_plotting():
        axes = az.plot_pair(_samples_only(post, data), **kwargs)
    return _figure(axes)


def plot_energy(post: Posterior, **kwargs) -> Figure:
    """ArviZ energy plot (marginal energy vs. energy transitions) of an HMC/NUTS posterior."""
    if "energy" not in diagnostics.sample_stats(post):
        raise ValueError(
            f"plot_energy needs the Hamiltonian energy per draw (sample_stats['energy'], recorded by HMC and NUTS); "
            f"this posterior (method={post.method!r}) has {sorted(post.sample_stats) or 'no sample stats'}. "
            "Use plot_trace or plot_rank instead."
        )
    with arviz_plotting():
        axes = az.plot_energy(_samples_only(post), **kwargs)
    return _figure(axes)


def plot_predictive(
    post: Posterior, x=None, *, interval: float = 0.95, num_samples: int | None = None, seed: int = 0, ax=None
) -> Figure:
    """Predictive band of a 1-D regression: training data, mean, epistemic and total intervals.

    ``x`` defaults to 200 points spanning the training inputs plus 10% each side. The epistemic band
    holds the central ``interval`` of the per-draw means ``E[y | x, w]``; the total band that of
    predictive draws of ``y`` (adding the noise).
    """
    if _task(post) == "classification":
        raise ValueError("plot_predictive is for regression with one output; use plot_reliability for classification.")
    train_x = post.x
    if x is None:
        if train_x is None:
            raise ValueError("x: this posterior has no training inputs; pass the inputs to plot at, shaped (M, 1).")
        lo, hi = float(train_x.min()), float(train_x.max())
        pad = 0.1 * (hi - lo or 1.0)
        x = torch.linspace(lo - pad, hi + pad, 200, dtype=train_x.dtype).unsqueeze(-1)
    x, _ = check_data(x, None)
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    if x.shape[1:] != (1,):
        raise ValueError(
            f"x: a predictive band needs 1-D inputs shaped (M, 1), got {tuple(x.shape)}. "
            "For more inputs, plot post.predict(x) against one feature yourself."
        )
    pred = post.predict(x, num_samples=num_samples, interval=interval, seed=seed)
    if not isinstance(pred, RegressionPrediction) or pred.mean.dim() != 1:
        raise ValueError("plot_predictive is for regression with one output; use plot_reliability for classification.")
    order = x[:, 0].argsort()
    grid = x[order, 0].numpy()
    alpha = (1 - interval) / 2
    levels = torch.tensor([alpha, 1 - alpha], dtype=pred.mean.dtype)
    q = torch.empty((2,) + pred.mean.shape, dtype=pred.mean.dtype)
    for rows, means in pred.blocks("mean_draws"):  # block by block: never every draw at every point at once
        q[:, rows] = quantiles(means, levels)
    q = q[:, order]
    fig, ax = plt.subplots(figsize=(7, 4)) if ax is None else (ax.figure, ax)
    ax.fill_between(
        grid,
        pred.lower[order].numpy(),
        pred.upper[order].numpy(),
        color="C0",
        alpha=0.2,
        label=f"total {interval:.0%} (with noise)",
    )
    ax.fill_between(grid, q[0].numpy(), q[1].numpy(), color="C0", alpha=0.45, label=f"epistemic {interval:.0%}")
    ax.plot(grid, pred.mean[order].numpy(), color="C0", lw=2, label="predictive mean")
    if train_x is not None and post.y is not None and train_x.shape[1:] in ((1,), ()):
        ax.scatter(train_x.reshape(-1).numpy(), post.y.reshape(-1).numpy(), s=10, color="k", alpha=0.6, label="data")
    ax.set(xlabel="x", ylabel="y", title=f"Posterior predictive ({post.method})")
    ax.legend(loc="best", fontsize="small")
    return fig


def plot_reliability(
    post: Posterior, x=None, y=None, *, num_bins: int = 10, num_samples: int | None = None, seed: int = 0
) -> Figure:
    """Reliability diagram: accuracy against confidence per bin, and the histogram of confidences.

    Uses the training data unless ``x`` and ``y`` (integer labels) are given; the title reports the
    expected calibration error ``ECE = sum_b (n_b / N) |accuracy_b - confidence_b|``.
    """
    num_bins = positive_int("num_bins", num_bins)
    if _task(post) == "regression":
        raise ValueError("plot_reliability is for classification; use plot_predictive for regression.")
    if x is not None or y is not None:  # token ids stay integer for a net with embeddings (bnn_pyro.inputs)
        x, y = check_data(
            match_columns(x, post.feature_names), y, keep_integer=getattr(post.model, "integer_inputs", False)
        )
    else:
        x, y = post.x, post.y
    if x is None or y is None:
        raise ValueError("x, y: no training data stored in this posterior; pass held-out x and labels y.")
    pred = post.predict(x, num_samples=num_samples, seed=seed)
    if not isinstance(pred, ClassificationPrediction):
        raise ValueError("plot_reliability is for classification; use plot_predictive for regression.")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    labels = y if pred.probs.dim() > 2 else y.reshape(-1)  # sequence outputs: one label per position (N, T)
    _reliability_axes(top, bottom, pred, labels, num_bins, f"Reliability ({post.method})")
    return fig


def _reliability_axes(top, bottom, pred, y, num_bins: int, title: str) -> None:
    """Draw a reliability diagram of ``pred`` (a prediction or probabilities) on two stacked axes."""
    mean_conf, accuracy, counts = (t.numpy() for t in metrics.reliability_curve(pred, y, num_bins))
    ece = metrics.ece(pred, y, num_bins)
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    centers, width = (edges[:-1] + edges[1:]) / 2, 1.0 / num_bins
    filled = counts > 0
    top.bar(centers[filled], accuracy[filled], width=width, edgecolor="k", color="C0", label="accuracy")
    top.bar(
        centers[filled],
        (mean_conf - accuracy)[filled],
        bottom=accuracy[filled],
        width=width,
        color="C3",
        alpha=0.3,
        edgecolor="C3",
        label="gap to confidence",
    )
    top.plot([0, 1], [0, 1], "k--", label="perfect calibration")
    top.set(ylabel="accuracy", ylim=(0, 1), title=f"{title}, ECE = {ece:.3f}")
    top.legend(loc="upper left", fontsize="small")
    bottom.bar(centers, counts, width=width, edgecolor="k", color="C1")
    bottom.set(xlabel="confidence (max predicted probability)", ylabel="count", xlim=(0, 1))


def plot_calibration(before, after, y, *, num_bins: int = 10) -> Figure:
    """Reliability diagrams side by side: a prediction ``before`` and ``after`` post-hoc calibration
    (e.g. :class:`bnn_pyro.tasks.calibration.TemperatureScaling`), on the same held-out labels ``y``."""
    num_bins = positive_int("num_bins", num_bins)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for column, (pred, title) in enumerate([(before, "Before"), (after, "After")]):
        _reliability_axes(axes[0, column], axes[1, column], pred, y, num_bins, title)
    return fig


def plot_rejection(
    pred, y, scores: Sequence[str] = ("entropy", "mutual_information", "max_prob"), *, ax=None
) -> Figure:
    """Accuracy against the fraction of inputs rejected (the most uncertain first), one line per
    uncertainty score of :mod:`bnn_pyro.tasks.selective`; the legend gives each curve's area."""
    fig, ax = plt.subplots(figsize=(6, 4)) if ax is None else (ax.figure, ax)
    for score in scores:
        fraction, accuracy = metrics.rejection_curve(pred, y, score=score)
        ax.plot(fraction.numpy(), accuracy.numpy(), label=f"{score} (area {float(accuracy.mean()):.3f})")
    ax.set(xlabel="fraction rejected", ylabel="accuracy of the rest", xlim=(0, 1), title="Rejection curve")
    ax.legend(loc="lower right", fontsize="small")
    return fig
