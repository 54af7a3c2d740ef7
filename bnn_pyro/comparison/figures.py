"""The figures of :meth:`bnn_pyro.Comparison.plot`: test LL per method, predictive bands, reliability diagrams."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from bnn_pyro import metrics
from bnn_pyro.posterior import Posterior, plots

__all__ = ["test_ll", "predictive_bands", "reliability"]


def _grid(count: int) -> tuple[Figure, np.ndarray]:
    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), sharex=True, sharey=True, squeeze=False)
    for ax in axes.ravel()[count:]:
        ax.axis("off")
    return fig, axes.ravel()


def test_ll(table: pd.DataFrame) -> Figure:
    """A dot per method: its test log-likelihood per point with +- one standard error (``test_ll_se``)."""
    shown = table[table["test_ll"].notna()] if "test_ll" in table else table.iloc[:0]
    fig, ax = plt.subplots(figsize=(6, 0.4 * max(len(shown), 2) + 1.2))
    se = shown["test_ll_se"].fillna(0.0) if "test_ll_se" in shown else 0.0
    ax.errorbar(shown["test_ll"], range(len(shown)), xerr=se, fmt="o", capsize=3)
    ax.set_yticks(range(len(shown)), list(shown.index))
    ax.invert_yaxis()
    ax.set_xlabel("test log-likelihood per point (higher is better), +- SE")
    ax.grid(axis="x", alpha=0.3)
    failed = [m for m in table.index if m not in shown.index]
    ax.set_title("Test log-likelihood" + (f" (no value: {', '.join(failed)})" if failed else ""), fontsize=10)
    fig.tight_layout()
    return fig


def predictive_bands(posteriors: dict[str, Posterior], x_test: torch.Tensor, y_test: torch.Tensor) -> Figure:
    """One panel per method (1-D regression): training data, test data, predictive mean and 95% bands."""
    fig, axes = _grid(len(posteriors))
    x_all = torch.cat([p.x.reshape(-1) for p in posteriors.values() if p.x is not None] + [x_test.reshape(-1)])
    lo, hi = float(x_all.min()), float(x_all.max())
    pad = 0.1 * (hi - lo or 1.0)
    grid = torch.linspace(lo - pad, hi + pad, 200, dtype=x_test.dtype)[:, None]
    for ax, (method, post) in zip(axes, posteriors.items()):
        plots.plot_predictive(post, grid, ax=ax)
        ax.scatter(x_test.reshape(-1).numpy(), y_test.reshape(-1).numpy(), s=6, color="C3", alpha=0.5, label="test")
        if ax is axes[0]:
            ax.legend(loc="best", fontsize="x-small")
        else:
            ax.get_legend().remove()
        ax.set(title=method, xlabel="", ylabel="")
    fig.tight_layout()
    return fig


def reliability(
    posteriors: dict[str, Posterior], x_test: torch.Tensor, y_test: torch.Tensor, *, num_bins: int = 10
) -> Figure:
    """One reliability diagram per method (classification): accuracy against confidence on the test data."""
    fig, axes = _grid(len(posteriors))
    for ax, (method, post) in zip(axes, posteriors.items()):
        pred = post.predict(x_test, seed=0)
        confidence, accuracy, _ = metrics.reliability_curve(pred, y_test, num_bins)
        ax.plot([0, 1], [0, 1], color="0.6", lw=1)
        ax.plot(confidence.numpy(), accuracy.numpy(), "o-", ms=3)
        ax.set_title(f"{method}, ECE {metrics.ece(pred, y_test, num_bins):.3f}", fontsize=9)
    fig.supxlabel("confidence (largest predicted probability)")
    fig.supylabel("accuracy")
    fig.tight_layout()
    return fig
