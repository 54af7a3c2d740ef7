"""Datasets bundled with the package or generated on the fly; nothing is downloaded.

Example
-------
>>> x, y = bp.datasets.toy_gap()      # 80 points of 1-D regression with a gap in (-0.5, 0.5)
"""

from __future__ import annotations

from importlib import resources

import pandas as pd
import torch

__all__ = ["toy_gap"]


def toy_gap() -> tuple[torch.Tensor, torch.Tensor]:
    """1-D regression with a gap between two clusters: ``x`` in [-2, -0.5] and [0.5, 2],
    ``y = sin(3x) + 0.3x + N(0, 0.1^2)`` (80 points, generated once with seed 0 and bundled as
    ``bnn_pyro/data/toy_gap.csv``). A good BNN is confident on the clusters and uncertain in the
    gap. Returns ``x`` shaped ``(80, 1)`` and ``y`` shaped ``(80,)``."""
    with resources.files("bnn_pyro.data").joinpath("toy_gap.csv").open() as f:
        frame = pd.read_csv(f)
    x = torch.tensor(frame["x"].to_numpy(), dtype=torch.get_default_dtype())[:, None]
    y = torch.tensor(frame["y"].to_numpy(), dtype=torch.get_default_dtype())
    return x, y
