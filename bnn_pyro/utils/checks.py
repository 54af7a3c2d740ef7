"""Argument checks shared by the whole package. Every error names the argument, what was
expected and what to try."""

from __future__ import annotations

import difflib
import inspect
import math
from enum import Enum
from typing import TypeVar

import numpy as np
import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistributionMixin

from bnn_pyro.utils.upstream_private import validates_args

E = TypeVar("E", bound=Enum)


def choice(argname: str, value, enum: type[E]) -> E:
    """``enum(value)``, or a ``ValueError`` that lists the valid choices and names the closest one to a string
    (case aside: ``"NUTS"``, ``"lowrank"``)."""
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(repr(e.value) for e in enum)
        names = {str(e.value).lower(): e.value for e in enum}
        close = difflib.get_close_matches(value.lower(), list(names), n=1) if isinstance(value, str) else []
        hint = f" Did you mean {names[close[0]]!r}?" if close else ""
        raise ValueError(f"{argname}: unknown value {value!r}; choose one of {valid}.{hint}") from None


def positive(argname: str, value: float) -> float:
    """A positive finite float."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be a positive number, got {value!r}; pass a float > 0.") from None
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{argname} must be a positive finite number, got {value}; pass a finite float > 0.")
    return value


def real(argname: str, value: float) -> float:
    """A finite float."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{argname} must be a number, got {type(value).__name__} {value!r}; pass a float, e.g. {argname}=0.0."
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"{argname} must be a finite number, got {value}; pass a finite float.")
    return value


def instance(argname: str, value, example: str) -> None:
    """Refuse a class where an instance is expected (``prior=bp.priors.Normal``), naming the call to make."""
    if isinstance(value, type):
        raise TypeError(
            f"{argname}: got the class {value.__module__}.{value.__qualname__}, not an instance of it; "
            f"pass an instance, e.g. {argname}={example}."
        )


def positive_int(argname: str, value: int, *, allow_zero: bool = False) -> int:
    """A positive (or non-negative) int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{argname} must be an int, got {type(value).__name__} {value!r}; pass a whole number, "
            f"e.g. {argname}={max(int(value) if isinstance(value, float) and math.isfinite(value) else 1, 1)}."
        )
    if value < (0 if allow_zero else 1):
        bound, least = ("non-negative", 0) if allow_zero else ("positive", 1)
        raise ValueError(f"{argname} must be a {bound} int, got {value}; pass an int >= {least}.")
    return int(value)


SEED_MAX = 2**31 - 1


def seed(argname: str, value: int) -> int:
    """A seed in ``[0, SEED_MAX]``: NumPy's global generator (which ``pyro.set_rng_seed`` seeds) takes seeds below
    ``2**32`` and the engines add offsets to a seed (the chain's index, a noise stream's shift), so seeds stop at
    ``2**31 - 1``, which leaves room for them; torch alone would take 64 bits."""
    value = positive_int(argname, value, allow_zero=True)
    if value > SEED_MAX:
        raise ValueError(
            f"{argname} must be at most 2**31 - 1 = {SEED_MAX}, got {value}; the engines seed NumPy's "
            f"generator, which takes 32-bit seeds (plus per-chain offsets). Pass a smaller seed, e.g. "
            f"{argname}={value % (SEED_MAX + 1)}."
        )
    return value


def flag(argname: str, value) -> bool:
    """A bool (``True``/``False``, or numpy's), never a truthy string or number."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{argname} must be True or False, got {type(value).__name__} {value!r}; "
            f"pass {argname}=True or {argname}=False."
        )
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
        value = _pandas_array(argname, value)
    if not isinstance(value, torch.Tensor):
        array = None
        try:
            array = np.array(value)
            value = torch.as_tensor(array, device=device)
        except (TypeError, ValueError, RuntimeError):
            what = type(value).__name__ + ("" if array is None else f" of dtype {array.dtype}")
            raise TypeError(
                f"{argname}: could not convert {what} to a tensor; pass numbers, e.g. a float numpy array "
                "or tensor (encode text or categories as numbers first)."
            ) from None
    if device is not None and value.device != torch.device(device):
        raise ValueError(
            f"{argname} is on device {value.device}, but the model's parameters are on {device}; move one "
            f"of them, e.g. {argname}.to({str(device)!r}) or model.to({str(value.device)!r})."
        )
    if value.layout != torch.strided:
        raise TypeError(
            f"{argname} is a sparse tensor ({value.layout}); the nets and checks take dense rows: pass "
            f"{argname}.to_dense() (for data too large for that, a DataLoader of dense minibatches)."
        )
    if value.dtype.is_complex:
        raise TypeError(
            f"{argname} has complex dtype {value.dtype}; pass real numbers, e.g. {argname}.real or "
            f"torch.view_as_real({argname}) for both parts as features."
        )
    if value.dim() == 0:
        raise ValueError(
            f"{argname} is a single number (shape ()), not data; pass rows shaped (N, ...), e.g. "
            f"torch.tensor([[{value.item()!r}]]) for one row of one feature."
        )
    if dtype is not None:
        value = value.to(dtype)
    if value.numel() == 0:
        raise ValueError(f"{argname} is empty (shape {tuple(value.shape)}); pass at least one data point.")
    if value.dtype.is_floating_point and not torch.isfinite(value).all():
        bad = (~torch.isfinite(value)).reshape(value.shape[0], -1).any(-1).nonzero().flatten()
        kinds = "NaN" if torch.isnan(value).any() else "Inf"
        raise ValueError(
            f"{argname} contains {kinds} values in {len(bad)} row(s) (first: {bad[:5].tolist()}); "
            "drop or impute them before fitting."
        )
    return value


def feature_names(x) -> list[str] | None:
    """The column names of a pandas ``DataFrame`` ``x``, as text (what a fit records, so that prediction can find
    the columns by name), else ``None``."""
    columns = getattr(x, "columns", None)
    if columns is None or not hasattr(x, "to_numpy"):
        return None
    return [str(c) for c in columns]


def match_columns(x, names: list[str] | None):
    """``x`` with its columns in the fitted order ``names``: a ``DataFrame`` whose columns are the fitted ones in
    another order is reordered by name (a net reads its inputs by position, so the order is what it learned);
    one with missing, unexpected or repeated columns is a ``ValueError`` naming them. Anything else (an array, a
    tensor, a posterior fitted on one) is returned unchanged."""
    given = feature_names(x)
    if names is None or given is None or given == list(names):
        return x
    missing, unexpected = [n for n in names if n not in given], [n for n in given if n not in names]
    repeated = sorted({n for n in given if given.count(n) > 1})
    problems = {"missing": missing, "unexpected": unexpected, "repeated": repeated}
    if missing or unexpected or repeated:
        raise ValueError(
            f"x: the DataFrame's columns are not the {len(names)} the posterior was fitted on "
            f"({'; '.join(f'{k}: {v}' for k, v in problems.items() if v)}); pass a DataFrame of the fitted columns "
            f"{list(names)!r}, in any order."
        )
    return x.iloc[:, [given.index(n) for n in names]]  # by position: the labels may be numbers, names their text


def _pandas_array(argname: str, frame) -> np.ndarray:
    """A pandas ``DataFrame`` or ``Series`` as one numeric array: columns of mixed numeric kinds (bool and float)
    in their common type, non-numeric columns refused by name (they would make one object array)."""
    frame_like = hasattr(frame.dtypes, "items")
    dtypes = list(frame.dtypes.items()) if frame_like else [(None, frame.dtypes)]
    bad = [(name, str(dtype)) for name, dtype in dtypes if getattr(dtype, "kind", "O") not in "biuf"]
    if bad:
        what = (
            "column(s) " + ", ".join(f"{name!r} ({dtype})" for name, dtype in bad) + " of the DataFrame are"
            if frame_like
            else f"the Series' values ({bad[0][1]}) are"
        )
        raise TypeError(
            f"{argname}: {what} not numeric; encode categories as numbers (e.g. pd.get_dummies, or .cat.codes for "
            "labels) and fill or drop missing values (None makes a column object) first."
        )
    try:
        common = np.result_type(*(dtype for _, dtype in dtypes))
    except TypeError:  # pandas' own (nullable) dtypes: their default conversion
        return frame.to_numpy()
    return frame.to_numpy(dtype=common)


def _same_rows(x, y) -> None:
    """Refuse pandas ``x`` and ``y`` whose row labels differ: rows are paired by position, so a ``y`` indexed in
    another order (or selected by another mask) would pair each input with another row's target."""
    if not all(hasattr(v, "index") and hasattr(v, "to_numpy") for v in (x, y)) or x.index.equals(y.index):
        return
    if len(x.index) != len(y.index):
        return  # the row counts differ: check_data says so
    first, a, b = next((i, a, b) for i, (a, b) in enumerate(zip(x.index.tolist(), y.index.tolist())) if a != b)
    raise ValueError(
        f"x and y are pandas objects with different row labels (row {first}: x has {a!r}, y has {b!r}); rows are paired by position, so this would pair inputs with other rows' targets. "
        "Align them by label first, e.g. y = y.loc[x.index], or reset both indexes (.reset_index(drop=True)) if "
        "position is what pairs them."
    )


def check_data(x, y, *, float_dtype: torch.dtype | None = None, device=None, keep_integer: bool = False):
    """Validate and convert ``x`` (and ``y`` when given) to tensors with matching lengths (on
    ``device`` when given: the model's). Floating ``x`` is cast to ``float_dtype`` (the model's) when
    given; integer ``x`` is kept as it is with ``keep_integer`` (token ids for an ``nn.Embedding``),
    else cast to ``float_dtype`` (torch's default dtype when not given). A tuple or dict of arrays
    (a net taking several inputs) becomes a :class:`bnn_pyro.inputs.Inputs`, each tensor checked so."""
    from bnn_pyro.inputs import Inputs, is_structured

    def one(argname, value):
        value = as_tensor(argname, value, device=device)
        if value.dtype.is_floating_point:
            return value if float_dtype is None else value.to(float_dtype)  # e.g. float64 numpy data, float32 net
        if keep_integer and value.dtype != torch.bool:
            return value
        return value.to(float_dtype or torch.get_default_dtype())

    if y is not None:
        _same_rows(x, y)
    if is_structured(x):
        if not isinstance(x, Inputs):
            x = Inputs(args=x) if isinstance(x, tuple) else Inputs(kwargs=_string_keys(x))
        x = x.map(one)
    else:
        x = one("x", x)
    if y is None:
        return x, None
    y = as_tensor("y", y, device=device)
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and y have different numbers of rows: x has {x.shape[0]}, y has {y.shape[0]}. "
            "Each row of x needs one row of y: check that both come from the same data set and split."
        )
    return x, y


def owned(made, given):
    """``made`` (what :func:`check_data` made of ``given``: a tensor or an :class:`~bnn_pyro.inputs.Inputs`) with
    every tensor that shares memory with a tensor of ``given`` replaced by a copy.

    A fit keeps its training data (``Posterior.x`` / ``.y``: LOO, predictions at the training inputs, files), so it
    needs its own copy: a user's tensor edited in place after the fit would change the fitted posterior. Only
    tensors that share the user's storage are copied (a numpy or pandas input, or a cast, is a new tensor already).
    The copy is on the model's device and lives with the fit and its posterior, so a training tensor there takes twice
    its memory; for data near the device's memory pass a loader of batches, which is converted batch by batch and not
    stored (``docs/devices.md``, "Training data").
    """
    from bnn_pyro.inputs import Inputs

    if isinstance(given, Inputs):
        given = given.tensors()
    elif isinstance(given, dict):
        given = list(given.values())
    elif not isinstance(given, (tuple, list)):
        given = [given]
    storages = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}

    def one(_, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.untyped_storage().data_ptr() in storages else t

    if made is None or not storages:
        return made
    return made.map(one) if isinstance(made, Inputs) else one(None, made)


def _string_keys(x: dict) -> dict:
    bad = [k for k in x if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise TypeError(
            f"x: a dict input is passed to the net as keyword arguments, so its keys must be argument "
            f"names; got {bad!r}. Use the names of the net's forward arguments, e.g. {{'tokens': t}}."
        )
    return x


# torch parameterizations that exclude each other: the rebuilt Pyro distribution gets the first one present.
_EXCLUSIVE = (("logits", "probs"), ("scale_tril", "covariance_matrix", "precision_matrix"))
_ATTRIBUTE = {"base_distribution": "base_dist"}  # constructor argument -> attribute, where the names differ


def pyro_distribution(argname: str, d, *, example: str = "dist.Normal(0., 1.)"):
    """``d`` as a Pyro distribution: a ``pyro.distributions`` one unchanged, a ``torch.distributions`` one
    rebuilt as the Pyro class of the same name (Pyro wraps every torch distribution under its name) from the
    same parameters, nested distributions included. Anything else is a ``TypeError`` naming ``argname``."""
    if isinstance(d, TorchDistributionMixin):
        return d
    if not isinstance(d, torch.distributions.Distribution):
        instance(argname, d, example)
        raise TypeError(
            f"{argname}: expected a pyro.distributions distribution, got {type(d).__name__} {d!r}; "
            f"pass e.g. {example} (import pyro.distributions as dist)."
        )
    target = getattr(dist, type(d).__name__, None)
    rebuilt = None
    if isinstance(target, type) and issubclass(target, type(d)):
        rebuilt = _rebuild(argname, d, target)
    if rebuilt is None or not _same_density(rebuilt, d):
        raise TypeError(
            f"{argname}: {type(d).__module__}.{type(d).__name__} is a torch distribution without a "
            f"Pyro counterpart; use one from pyro.distributions (e.g. {example}), or make it "
            "a subclass of pyro.distributions.TorchDistribution."
        )
    return rebuilt


def _same_density(a, b) -> bool:
    """Same shapes, and the same log density at a draw of ``b`` (drawn under a fixed seed; the caller's random
    state is kept)."""
    if a.batch_shape != b.batch_shape or a.event_shape != b.event_shape:
        return False
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        value = b.sample()
        return bool(torch.allclose(a.log_prob(value), b.log_prob(value), equal_nan=True))


def _rebuild(argname: str, d, target: type):
    """``target(**parameters of d)``, or None where they cannot be read back."""
    kwargs = {}
    for name, param in inspect.signature(type(d).__init__).parameters.items():
        if name in ("self", "validate_args") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = getattr(d, _ATTRIBUTE.get(name, name), None)
        if value is None:
            if param.default is param.empty:
                return None
            continue
        kwargs[name] = (
            pyro_distribution(argname, value) if isinstance(value, torch.distributions.Distribution) else value
        )
    for group in _EXCLUSIVE:
        present = [k for k in group if k in kwargs]
        for k in present[1:]:
            del kwargs[k]
    try:
        return target(**kwargs, validate_args=validates_args(d))
    except (TypeError, ValueError):
        return None


def positive_support(argname: str, d, *, example: str = "dist.HalfNormal(1.0)") -> None:
    """Refuse a distribution that can put mass on zero or negative values where a scale is drawn."""
    support = d.support
    while isinstance(support, torch.distributions.constraints.independent):
        support = support.base_constraint
    bound = getattr(support, "lower_bound", None)
    if bound is None or not bool(torch.all(torch.as_tensor(bound) >= 0)):
        raise ValueError(
            f"{argname}: {type(d).__name__} has support {support}, but a scale or precision must be "
            f"positive; use a distribution over positive numbers, e.g. {argname}={example} or "
            "dist.LogNormal(0., 1.)."
        )
