"""Datasets bundled with the package or generated on the fly; nothing is downloaded.

Inputs ``x`` are floating point tensors (torch's default dtype, float32 unless changed); targets
``y`` are floating point for regression and ``torch.int64`` class labels for classification.

Example
-------
>>> x, y = bp.datasets.toy_gap()                      # 80 points of 1-D regression with a gap
>>> x, y = bp.datasets.heteroscedastic(n=200)         # noise grows with x
>>> x, y = bp.datasets.two_moons(n=200, noise=0.1)    # 2-D binary classification
>>> x, y = bp.datasets.load_sklearn("breast_cancer")  # bundled with scikit-learn, no download
>>> x_tr, y_tr, x_te, y_te = bp.datasets.train_test_split(x, y, test_fraction=0.2, stratify=True)
>>> xs = bp.datasets.Standardizer.fit(x_tr); x_tr, x_te = xs.transform(x_tr), xs.transform(x_te)
>>> uci = bp.datasets.load_uci("UCI_Datasets/boston-housing/data", split=0)
>>> post = bp.fit(model, uci.x_train, uci.y_train, method="svi", seed=0)
>>> uci.metrics(post)                                 # {'rmse': ..., 'test_ll': ...} in original units
>>> splits = bp.datasets.make_uci_splits(x, y, n_splits=20)   # your own random 90/10 splits

The splits, scaling and UCI-folder functions live in :mod:`bnn_pyro.data.splits` and are re-exported here.
"""

from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bnn_pyro.data.splits import (
    Standardizer,
    UCISplit,
    as_float_tensor,
    load_uci,
    make_uci_splits,
    train_test_split,
    write_uci_splits,
)
from bnn_pyro.utils.checks import positive, positive_int
from bnn_pyro.utils.checks import seed as checked_seed

__all__ = [
    "toy_gap",
    "heteroscedastic",
    "heteroscedastic_mean",
    "heteroscedastic_noise_sd",
    "two_moons",
    "spirals",
    "load_sklearn",
    "digits_images",
    "load_csv",
    "train_test_split",
    "Standardizer",
    "UCISplit",
    "load_uci",
    "make_uci_splits",
    "write_uci_splits",
    "SKLEARN_DATASETS",
]

SKLEARN_DATASETS = {
    "diabetes": "regression",
    "breast_cancer": "classification",
    "digits": "classification",
    "wine": "classification",
}


def _labels(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.int64)


# ---------------------------------------------------------------------------------------- toy sets
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


def heteroscedastic_mean(x: torch.Tensor) -> torch.Tensor:
    """The true mean of :func:`heteroscedastic`: ``E[y | x] = sin(x)`` (``x`` shaped ``(n, 1)`` or ``(n,)``)."""
    x = torch.as_tensor(x)
    return torch.sin(x.reshape(x.shape[0]) if x.dim() == 2 else x)


def heteroscedastic_noise_sd(x: torch.Tensor) -> torch.Tensor:
    """The true noise standard deviation of :func:`heteroscedastic`: ``sd(x) = 0.05 + 0.1 (x + 3)``,
    which grows linearly from 0.05 at ``x = -3`` to 0.65 at ``x = 3``. Shaped ``(n,)``."""
    x = torch.as_tensor(x)
    return 0.05 + 0.1 * ((x.reshape(x.shape[0]) if x.dim() == 2 else x) + 3.0)


def heteroscedastic(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D regression whose noise grows with ``x``.

    Generating process (``torch.Generator`` seeded by ``seed``)::

        x ~ Uniform(-3, 3)
        y = sin(x) + sd(x) * eps,   eps ~ N(0, 1),   sd(x) = 0.05 + 0.1 * (x + 3)

    The true mean and noise are :func:`heteroscedastic_mean` and :func:`heteroscedastic_noise_sd`.
    A homoscedastic likelihood must compromise on one noise level; ``HeteroscedasticGaussian``
    can recover ``sd(x)``. Returns ``x`` shaped ``(n, 1)`` and ``y`` shaped ``(n,)``.
    """
    n = positive_int("n", n)
    g = torch.Generator().manual_seed(checked_seed("seed", seed))
    dtype = torch.get_default_dtype()
    x = torch.rand(n, 1, generator=g, dtype=dtype) * 6.0 - 3.0
    eps = torch.randn(n, generator=g, dtype=dtype)
    y = heteroscedastic_mean(x) + heteroscedastic_noise_sd(x) * eps
    return x, y


def two_moons(n: int = 200, noise: float = 0.1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved half circles (``sklearn.datasets.make_moons``): ``x`` shaped ``(n, 2)``,
    ``y`` int64 labels in ``{0, 1}`` (``n // 2`` and ``n - n // 2`` points), Gaussian noise of sd
    ``noise`` added to the coordinates."""
    from sklearn.datasets import make_moons

    n = positive_int("n", n)
    if n < 2:
        raise ValueError(f"n must be at least 2 (one point per class), got {n}.")
    noise = _nonnegative("noise", noise)
    x, y = make_moons(n_samples=n, noise=noise, random_state=checked_seed("seed", seed))
    return as_float_tensor(x), _labels(y)


def spirals(n: int = 200, noise: float = 0.2, turns: float = 1.5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved (Archimedean) spirals, a classic hard 2-D classification set.

    Generating process (``torch.Generator`` seeded by ``seed``), for class ``c`` in ``{0, 1}``::

        u ~ Uniform(0, 1),   theta = 2 pi * turns * sqrt(u),   r = theta / pi
        x = r * (cos(theta + c pi), sin(theta + c pi)) + noise * N(0, I_2)

    so the two arms are 1 apart and the outer radius is ``2 * turns`` (``sqrt`` spreads the points
    evenly along the arms). Class 0 gets ``n // 2`` points, class 1 the rest; rows are shuffled.
    Returns ``x`` shaped ``(n, 2)`` and int64 labels ``y`` shaped ``(n,)``.
    """
    n = positive_int("n", n)
    if n < 2:
        raise ValueError(f"n must be at least 2 (one point per class), got {n}.")
    noise = _nonnegative("noise", noise)
    turns = positive("turns", turns)
    g = torch.Generator().manual_seed(checked_seed("seed", seed))
    dtype = torch.get_default_dtype()
    y = torch.cat([torch.zeros(n // 2, dtype=torch.int64), torch.ones(n - n // 2, dtype=torch.int64)])
    theta = 2 * math.pi * turns * torch.rand(n, generator=g, dtype=dtype).sqrt()
    r = theta / math.pi
    angle = theta + math.pi * y.to(dtype)
    x = torch.stack([r * angle.cos(), r * angle.sin()], -1) + noise * torch.randn(n, 2, generator=g, dtype=dtype)
    order = torch.randperm(n, generator=g)
    return x[order], y[order]


def _nonnegative(argname: str, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{argname} must be a non-negative number, got {value!r}.") from None
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{argname} must be a non-negative finite number, got {value}.")
    return value


# ---------------------------------------------------------------------------------------- scikit-learn
def load_sklearn(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset bundled with scikit-learn (read from its installed files; nothing is downloaded).

    ===============  ==============  ============  ==========================================
    name             task            x             y
    ===============  ==============  ============  ==========================================
    "diabetes"       regression      (442, 10)     float, disease progression (25..346)
    "breast_cancer"  classification  (569, 30)     int64, 0 malignant / 1 benign
    "digits"         classification  (1797, 64)    int64, 0..9; pixels scaled from 0..16 to [0, 1]
    "wine"           classification  (178, 13)     int64, 0..2
    ===============  ==============  ============  ==========================================

    Features are raw (except the digits' scaling): standardize them with :class:`Standardizer`
    fitted on a training split. See :func:`digits_images` for the digits as ``(N, 1, 8, 8)`` images.
    """
    import sklearn.datasets as skd

    loaders = {
        "diabetes": lambda: skd.load_diabetes(scaled=False),
        "breast_cancer": skd.load_breast_cancer,
        "digits": skd.load_digits,
        "wine": skd.load_wine,
    }
    if name not in loaders:
        valid = ", ".join(repr(k) for k in SKLEARN_DATASETS)
        raise ValueError(
            f"name: unknown scikit-learn dataset {name!r}; choose one of {valid}. "
            "For your own data use load_csv(path, target=...)."
        )
    bunch = loaders[name]()
    x = bunch.data / 16.0 if name == "digits" else bunch.data
    y = as_float_tensor(bunch.target) if SKLEARN_DATASETS[name] == "regression" else _labels(bunch.target)
    return as_float_tensor(x), y


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 handwritten digits as images for a conv net: ``x`` shaped
    ``(1797, 1, 8, 8)`` with pixels in [0, 1], ``y`` int64 labels 0..9 shaped ``(1797,)``."""
    x, y = load_sklearn("digits")
    return x.reshape(-1, 1, 8, 8), y


# ---------------------------------------------------------------------------------------- CSV
def _read_table(path: Path, read_csv_kwargs: dict) -> pd.DataFrame:
    """``pandas.read_csv``, its parse and decode errors re-raised as a ``ValueError`` naming the file and the line."""
    try:
        return pd.read_csv(path, **read_csv_kwargs)
    except UnicodeDecodeError as err:
        encoding = read_csv_kwargs.get("encoding") or "utf-8"
        raise ValueError(
            f"path: {str(path)!r} is not a {encoding} text table: line {_undecodable_line(path, encoding)} "
            f"holds bytes that are not {encoding} ({err.reason}). Is it a CSV file? Pass a text table, or "
            "its encoding (encoding='latin-1')."
        ) from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        reason = str(err).strip().removeprefix("Error tokenizing data. C error: ")
        found = re.search(r"(line|row) (\d+)", reason)
        where = f"{found.group(1)} {found.group(2)}" if found else "a line pandas does not name"
        raise ValueError(
            f"path: {str(path)!r} is not a readable CSV table ({where}: {reason}). Check that line (a "
            "row with extra fields, an unclosed quote), or pass the separator (sep=';')."
        ) from None


def _undecodable_line(path: Path, encoding: str) -> int:
    """The number (from 1) of the first line of ``path`` that does not decode as ``encoding``."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode(encoding)
            except UnicodeDecodeError:
                return number
    return number


def load_csv(
    path, target: str, features: list[str] | None = None, *, task: str | None = None, **read_csv_kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a table with :func:`pandas.read_csv` and return ``(x, y)``.

    Parameters
    ----------
    path:
        The CSV file.
    target:
        The column holding ``y``.
    features:
        The columns of ``x``, in order (default: every column but ``target``).
    task:
        ``"regression"`` (``y`` float), ``"classification"`` (``y`` int64 labels) or ``None``:
        int64 when the target column holds integers, float otherwise.
    read_csv_kwargs:
        Passed on to :func:`pandas.read_csv` (e.g. ``sep=";"``).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``x`` shaped ``(N, len(features))`` and ``y`` shaped ``(N,)``.

    Notes
    -----
    Every column used must be numeric and complete: encode categories (``pandas.get_dummies``) and drop or impute missing
    values first. A file pandas cannot parse or decode (a binary file, a row with extra fields) is a
    ``ValueError`` naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"path: no CSV file at {str(path)!r}" + (" (it is a folder)." if path.is_dir() else "; check the path.")
        )
    if task not in (None, "regression", "classification"):
        raise ValueError(f"task: unknown value {task!r}; choose 'regression', 'classification' or None (infer).")
    frame = _read_table(path, read_csv_kwargs)
    columns = [str(c) for c in frame.columns]
    frame.columns = columns
    if features is None:
        features = [c for c in columns if c != target]
    elif isinstance(features, str):
        raise TypeError(
            f"features must be a list of column names, got the string {features!r}; write features=[{features!r}]."
        )
    features = list(features)
    missing = [c for c in [target, *features] if c not in columns]
    if missing:
        raise ValueError(
            f"{'target' if target in missing else 'features'}: column(s) {missing} not in "
            f"{str(path)!r}; available columns: {columns}."
        )
    if not features:
        raise ValueError(f"features: no feature columns left in {str(path)!r} besides the target {target!r}.")
    used = features + [target]
    text = [c for c in used if not pd.api.types.is_numeric_dtype(frame[c])]
    if text:
        raise ValueError(
            f"column(s) {text} in {str(path)!r} are not numeric (dtypes "
            f"{[str(frame[c].dtype) for c in text]}); encode them first, e.g. with pandas.get_dummies "
            "or Series.astype('category').cat.codes, or leave them out of features."
        )
    holes = [c for c in used if frame[c].isna().any()]
    if holes:
        raise ValueError(f"column(s) {holes} in {str(path)!r} have missing values; drop or impute those rows first.")
    x = as_float_tensor(frame[features].to_numpy(dtype=np.float64))
    column = frame[target]
    integer = pd.api.types.is_integer_dtype(column) or pd.api.types.is_bool_dtype(column)
    if task == "classification" or (task is None and integer):
        values = column.to_numpy()
        if not np.all(np.asarray(values, dtype=np.float64) == np.round(np.asarray(values, dtype=np.float64))):
            raise ValueError(
                f"target: column {target!r} holds non-integer values, which cannot be class labels; "
                "use task='regression'."
            )
        return x, _labels(np.asarray(values, dtype=np.float64).astype(np.int64))
    return x, as_float_tensor(column.to_numpy(dtype=np.float64))
