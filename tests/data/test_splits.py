"""Random UCI-style splits from arrays (bnn_pyro/data/splits.py: make_uci_splits, write_uci_splits).
load_uci, train_test_split and Standardizer are tested in test_datasets.py."""

from __future__ import annotations

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import datasets


def _data(n: int = 53, d: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g) * torch.tensor([1.0, 10.0, 0.1]) + 5.0
    y = x @ torch.tensor([1.0, -0.2, 3.0]) + torch.randn(n, generator=g)
    return x, y


def test_make_uci_splits_are_train_test_split_rows_standardized_on_training_rows():
    x, y = _data()
    splits = datasets.make_uci_splits(x, y, n_splits=4, seed=7)
    assert [s.split for s in splits] == [0, 1, 2, 3] and all(s.n_splits == 4 for s in splits)
    for k, s in enumerate(splits):
        x_tr, y_tr, x_te, y_te = datasets.train_test_split(x, y, test_fraction=0.1, seed=7 + k)
        assert s.x_test.shape == (5, 3) and s.x_train.shape == (48, 3)  # round(0.1 * 53) = 5 test rows
        torch.testing.assert_close(s.y_test_raw, y_te)
        torch.testing.assert_close(s.x_scaler.mean, x_tr.mean(0))
        torch.testing.assert_close(s.x_scaler.scale, x_tr.std(0, correction=0))
        torch.testing.assert_close(s.y_scaler.mean, y_tr.mean())
        torch.testing.assert_close(s.x_test, (x_te - x_tr.mean(0)) / x_tr.std(0, correction=0))
        torch.testing.assert_close(s.y_train, (y_tr - y_tr.mean()) / y_tr.std(correction=0))
    # different splits hold out different rows; the seed fixes them
    assert not torch.equal(splits[0].y_test_raw, splits[1].y_test_raw)
    torch.testing.assert_close(datasets.make_uci_splits(x, y, n_splits=1, seed=7)[0].x_test, splits[0].x_test)


def test_write_uci_splits_round_trips_through_load_uci(tmp_path):
    x, y = _data()
    folder = datasets.write_uci_splits(tmp_path / "mine", x, y, n_splits=3, seed=2)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["data.txt", "index_features.txt", "index_target.txt", "n_splits.txt"]
        + [f"index_{part}_{k}.txt" for part in ("train", "test") for k in range(3)]
    )
    made = datasets.make_uci_splits(x, y, n_splits=3, seed=2)
    for k in range(3):
        read = datasets.load_uci(folder, split=k)
        assert read.n_splits == 3
        for name in ("x_train", "y_train", "x_test", "y_test", "y_test_raw"):
            torch.testing.assert_close(getattr(read, name), getattr(made[k], name), rtol=0, atol=0)


def test_split_helpers_reject_bad_input_by_name(tmp_path):
    x, y = _data()
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.make_uci_splits(x, y, test_fraction=1.5)
    with pytest.raises(ValueError, match="n_splits"):
        datasets.make_uci_splits(x, y, n_splits=0)
    with pytest.raises(ValueError, match="^x: expected a 2-D"):
        datasets.make_uci_splits(x[:, 0], y)
    with pytest.raises(ValueError, match="^y: expected 1-D float"):
        datasets.make_uci_splits(x, y.long())
    with pytest.raises(ValueError, match="different numbers of rows"):
        datasets.make_uci_splits(x, y[:-1])
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="path"):
        datasets.write_uci_splits(tmp_path / "file", x, y)


def test_the_package_reexports_the_split_functions():
    assert bp.datasets.load_uci is bp.splits.load_uci and bp.datasets.UCISplit is bp.splits.UCISplit
    assert bp.datasets.make_uci_splits is bp.splits.make_uci_splits
