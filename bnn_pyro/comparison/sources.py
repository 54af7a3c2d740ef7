"""What ``bnn-pyro compare`` compares on: a zoo entry (its model, data, test split and settings per method) or a
CSV file with a target column (the UCI protocol's model on standardized columns)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyro.distributions as dist
import torch

__all__ = ["Source", "from_zoo", "from_csv", "to_original_units"]


@dataclass
class Source:
    """A model and its data for :func:`bnn_pyro.compare`: ``x, y`` with ``test`` (or none: k-fold), the settings
    per method (``options``), a title, and ``y_scale`` (the sd that regression targets were divided by; 1: none)."""

    title: str
    model: Any
    x: torch.Tensor
    y: torch.Tensor
    test: tuple | None
    options: dict[str, dict] = field(default_factory=dict)
    y_scale: float = 1.0


def from_zoo(name: str, methods: list[str] | None, load: Callable) -> Source:
    """The zoo entry ``name`` (``load`` is :func:`bnn_pyro.data.zoo.load`): its test split, and its settings for the
    methods compared (its ``fit_defaults``, less the seed and progress bar, which the comparison sets)."""
    entry = load(name)
    options = {
        m: {k: v for k, v in s.items() if k not in ("seed", "progress")}
        for m, s in entry.fit_defaults.items()
        if methods is None or m in methods
    }
    test = None if entry.x_test is None else (entry.x_test, entry.y_test)
    return Source(f"{entry.name}: {entry.card['title']}", entry.model, entry.x, entry.y, test, options)


def from_csv(path: str, *, target: str | None, task: str | None, seed: int) -> Source:
    """A CSV file: the ``target`` column (default: the last) is ``y``, every other column a feature; columns are
    standardized over all rows (regression targets too: scores are converted back by :func:`to_original_units`).
    The model is the UCI protocol's (Hernandez-Lobato & Adams 2015): ``Linear(D, 50) - ReLU - Linear(50, out)``
    with a ``Normal(0, 1)`` prior, a learned Gaussian noise ``sigma ~ HalfNormal(1)`` or a categorical likelihood."""
    from bnn_pyro import likelihoods, priors
    from bnn_pyro.data import datasets
    from bnn_pyro.model import BNN

    if target is None:
        columns = pd.read_csv(path, nrows=0).columns
        if len(columns) < 2:
            raise ValueError(
                f"{path}: a CSV with a target column and at least one feature column is needed; "
                f"found columns {list(columns)}."
            )
        target = str(columns[-1])
    x, y = datasets.load_csv(path, target, task=task)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-12)
    scale = 1.0
    torch.manual_seed(seed)
    if y.dtype.is_floating_point:
        scale = float(y.std())
        y = (y - y.mean()) / scale
        out, likelihood = 1, likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
    else:
        out, likelihood = int(y.max()) + 1, likelihoods.Categorical()
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 50), torch.nn.ReLU(), torch.nn.Linear(50, out))
    model = BNN(net, prior=priors.Normal(0.0, 1.0), likelihood=likelihood)
    return Source(
        f"{Path(path).name}: target {target!r}, {x.shape[0]} rows x {x.shape[1]} features",
        model,
        x,
        y,
        None,
        y_scale=scale,
    )


def to_original_units(table: pd.DataFrame, scale: float) -> pd.DataFrame:
    """A regression table of targets divided by ``scale`` in the targets' own units: ``test_ll - log scale``;
    ``rmse``, ``width_95`` and their standard errors times ``scale`` (the others are unit-free)."""
    if scale == 1.0:
        return table
    table = table.copy()
    if "test_ll" in table:
        table["test_ll"] -= math.log(scale)
    for column in ("rmse", "rmse_se", "width_95", "width_95_se"):
        if column in table:
            table[column] *= scale
    return table
