"""Argument checks shared by the whole package. Every error names the argument, what was
expected and what to try."""

from __future__ import annotations

import math
from enum import Enum
from typing import TypeVar

import numpy as np
import torch

E = TypeVar("E", bound=Enum)


def choice(argname: str, value, enum: type[E]) -> E:
    """``enum(value)``, or a ``ValueError`` that lists the valid choices."""
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(repr(e.value) for e in enum)
        raise ValueError(f"{argname}: unknown value {value!r}; choose one of {valid}.") from None


def positive(argname: str, value: float) -> float:
    """A positive finite float."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be a positive number, got {value!r}.") from None
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{argname} must be a positive finite number, got {value}.")
    return value


def positive_int(argname: str, value: int, *, allow_zero: bool = False) -> int:
    """A positive (or non-negative) int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{argname} must be an int, got {type(value).__name__} {value!r}.")
    if value < (0 if allow_zero else 1):
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{argname} must be a {bound} int, got {value}.")
    return int(value)


def as_tensor(argname: str, value, *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """Convert numpy / pandas / lists to a tensor and reject NaN, Inf and empty input."""
    if hasattr(value, "to_numpy"):  # pandas
        value = value.to_numpy()
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.array(value))
        except (TypeError, ValueError) as err:
            raise TypeError(f"{argname}: could not convert {type(value).__name__} to a tensor ({err}).") from None
    if dtype is not None:
        value = value.to(dtype)
    if device is not None:
        value = value.to(device)
    if value.numel() == 0 or value.dim() == 0 or value.shape[0] == 0:
        raise ValueError(f"{argname} is empty (shape {tuple(value.shape)}); pass at least one data point.")
    if value.dtype.is_floating_point and not torch.isfinite(value).all():
        bad = (~torch.isfinite(value)).reshape(value.shape[0], -1).any(-1).nonzero().flatten()
        kinds = "NaN" if torch.isnan(value).any() else "Inf"
        raise ValueError(
            f"{argname} contains {kinds} values in {len(bad)} row(s) (first: {bad[:5].tolist()}); "
            "drop or impute them before fitting."
        )
    return value


def check_data(x, y, *, float_dtype: torch.dtype = torch.get_default_dtype()):
    """Validate and convert ``x`` (and ``y`` when given) to tensors with matching lengths."""
    x = as_tensor("x", x)
    if not x.dtype.is_floating_point:
        x = x.to(float_dtype)
    if y is None:
        return x, None
    y = as_tensor("y", y)
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and y have different numbers of rows: x has {x.shape[0]}, y has {y.shape[0]}. "
            "Each row of x needs one row of y."
        )
    return x, y
