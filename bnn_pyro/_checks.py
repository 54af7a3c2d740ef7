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
        raise TypeError(f"{argname} must be a positive number, got {value!r}; pass a float > 0.") from None
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{argname} must be a positive finite number, got {value}; pass a finite float > 0.")
    return value


def positive_int(argname: str, value: int, *, allow_zero: bool = False) -> int:
    """A positive (or non-negative) int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{argname} must be an int, got {type(value).__name__} {value!r}; pass a whole number, "
                        f"e.g. {argname}={max(int(value) if isinstance(value, float) and math.isfinite(value) else 1, 1)}.")
    if value < (0 if allow_zero else 1):
        bound, least = ("non-negative", 0) if allow_zero else ("positive", 1)
        raise ValueError(f"{argname} must be a {bound} int, got {value}; pass an int >= {least}.")
    return int(value)


def flag(argname: str, value) -> bool:
    """A bool (``True``/``False``, or numpy's), never a truthy string or number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{argname} must be True or False, got {type(value).__name__} {value!r}; "
                        f"pass {argname}=True or {argname}=False.")
    return bool(value)


def probability(argname: str, value, *, suggestion: str) -> float:
    """A number strictly between 0 and 1; ``suggestion`` ends the error message (e.g. "try 0.95")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not 0.0 < value < 1.0:
        raise ValueError(f"{argname} must lie in (0, 1), got {value!r}; {suggestion}.")
    return float(value)


def as_tensor(argname: str, value, *, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """Convert numpy / pandas / lists to a tensor and reject NaN, Inf and empty input.

    With ``device`` given, numpy / pandas / list input is placed there, and a tensor on another
    device is an error (a user's tensors are never moved silently)."""
    if hasattr(value, "to_numpy"):  # pandas
        value = value.to_numpy()
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.array(value), device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{argname}: could not convert {type(value).__name__} to a tensor ({err}); pass numbers, "
                            "e.g. a float numpy array or tensor (encode text or categories as numbers first).") from None
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{argname} is on device {value.device}, but the model's parameters are on {device}; move one "
                         f"of them, e.g. {argname}.to({str(device)!r}) or model.to({str(value.device)!r}).")
    if dtype is not None:
        value = value.to(dtype)
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


def check_data(x, y, *, float_dtype: torch.dtype | None = None, device=None):
    """Validate and convert ``x`` (and ``y`` when given) to tensors with matching lengths (on
    ``device`` when given: the model's). ``x`` is cast to ``float_dtype`` (the model's; torch's
    default dtype when not given) unless it already is floating and no ``float_dtype`` was given."""
    x = as_tensor("x", x, device=device)
    if float_dtype is not None:
        x = x.to(float_dtype)  # e.g. float64 numpy data for a float32 net
    elif not x.dtype.is_floating_point:
        x = x.to(torch.get_default_dtype())
    if y is None:
        return x, None
    y = as_tensor("y", y, device=device)
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and y have different numbers of rows: x has {x.shape[0]}, y has {y.shape[0]}. "
            "Each row of x needs one row of y: check that both come from the same data set and split."
        )
    return x, y
