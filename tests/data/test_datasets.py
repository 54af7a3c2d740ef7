"""bnn_pyro.data.datasets: shapes, dtypes and generating processes of the toy sets; scikit-learn and CSV
loaders; splits and standardization; UCI benchmark folders (a tiny fake one built in tmp_path)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import datasets, metrics, predictions


# ---------------------------------------------------------------------------------------- toy sets
def test_toy_gap_is_unchanged():
    x, y = datasets.toy_gap()
    assert x.shape == (80, 1) and y.shape == (80,) and x.dtype == y.dtype == torch.float32


def test_heteroscedastic_shapes_and_seed():
    x, y = datasets.heteroscedastic(n=50, seed=3)
    assert x.shape == (50, 1) and y.shape == (50,) and x.dtype == y.dtype == torch.float32
    assert ((x >= -3) & (x <= 3)).all()
    torch.testing.assert_close(datasets.heteroscedastic(n=50, seed=3)[1], y)
    assert not torch.equal(datasets.heteroscedastic(n=50, seed=4)[1], y)


def test_heteroscedastic_noise_matches_the_documented_sd():
    """Residuals divided by the true sd are N(0, 1): their variance is 1 within 5 standard errors
    (sd of a sample variance of n standard normals: sqrt(2 / n)), in each half of the x range."""
    n = 20_000
    x, y = datasets.heteroscedastic(n=n, seed=0)
    sd = datasets.heteroscedastic_noise_sd(x)
    torch.testing.assert_close(sd, 0.05 + 0.1 * (x[:, 0] + 3))
    z = ((y - datasets.heteroscedastic_mean(x)) / sd).double()
    for part in (x[:, 0] < 0, x[:, 0] >= 0):
        m = int(part.sum())
        assert abs(float(z[part].pow(2).mean()) - 1.0) < 5 * math.sqrt(2 / m)
        assert abs(float(z[part].mean())) < 5 / math.sqrt(m)
    assert datasets.heteroscedastic_noise_sd(torch.tensor([-3.0, 3.0])).tolist() == pytest.approx([0.05, 0.65])


def test_two_moons():
    x, y = datasets.two_moons(n=101, noise=0.05, seed=1)
    assert x.shape == (101, 2) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert sorted(y.unique().tolist()) == [0, 1] and int((y == 0).sum()) == 50
    torch.testing.assert_close(datasets.two_moons(n=101, noise=0.05, seed=1)[0], x)


def test_spirals_lie_on_their_arms_without_noise():
    """With noise 0, a point of class c at radius r has angle r * pi + c * pi (mod 2 pi)."""
    x, y = datasets.spirals(n=301, noise=0.0, turns=1.5, seed=0)
    assert x.shape == (301, 2) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert int((y == 0).sum()) == 150 and int((y == 1).sum()) == 151
    r = x.double().norm(dim=-1)
    assert float(r.max()) <= 2 * 1.5 + 1e-5
    angle = torch.atan2(x[:, 1].double(), x[:, 0].double())
    gap = torch.remainder(angle - math.pi * r - math.pi * y, 2 * math.pi)
    assert torch.minimum(gap, 2 * math.pi - gap).max() < 1e-4
    assert not torch.equal(datasets.spirals(n=301, seed=1)[0], datasets.spirals(n=301, seed=2)[0])
    # rows are shuffled: the classes are not in two blocks
    assert 0 < int((y[:150] == 1).sum()) < 150


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: datasets.heteroscedastic(n=0), r"n must be a positive int"),
        (lambda: datasets.spirals(n=1), r"n must be at least 2"),
        (lambda: datasets.spirals(noise=-1.0), r"noise must be a non-negative"),
        (lambda: datasets.spirals(turns=0.0), r"turns must be a positive"),
        (lambda: datasets.two_moons(noise=float("nan")), r"noise must be a non-negative"),
    ],
)
def test_toy_sets_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------- scikit-learn
@pytest.mark.parametrize(
    "name, shape, ydtype, classes",
    [
        ("diabetes", (442, 10), torch.float32, None),
        ("breast_cancer", (569, 30), torch.int64, 2),
        ("digits", (1797, 64), torch.int64, 10),
        ("wine", (178, 13), torch.int64, 3),
    ],
)
def test_load_sklearn(name, shape, ydtype, classes):
    x, y = datasets.load_sklearn(name)
    assert x.shape == shape and x.dtype == torch.float32 and y.shape == (shape[0],) and y.dtype == ydtype
    if classes is not None:
        assert y.unique().tolist() == list(range(classes))
    if name == "digits":
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    if name == "diabetes":
        assert float(y.min()) == 25.0 and float(y.max()) == 346.0  # raw targets, not scaled


def test_digits_images_for_a_conv_net():
    images, y = datasets.digits_images()
    x, labels = datasets.load_sklearn("digits")
    assert images.shape == (1797, 1, 8, 8) and torch.equal(images.reshape(1797, 64), x) and torch.equal(y, labels)


def test_load_sklearn_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"name: unknown .* 'iris'.*'diabetes', 'breast_cancer', 'digits', 'wine'"):
        datasets.load_sklearn("iris")


# ---------------------------------------------------------------------------------------- CSV
@pytest.fixture
def csv_file(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b,label,price,city\n1.0,2,0,10.5,x\n3.5,4,1,11.0,y\n5.0,6,2,12.25,x\n")
    return path


def test_load_csv_features_and_target_dtypes(csv_file):
    x, y = datasets.load_csv(csv_file, target="label", features=["a", "b"])
    assert x.dtype == torch.float32 and x.tolist() == [[1.0, 2.0], [3.5, 4.0], [5.0, 6.0]]
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2]  # integer column: class labels
    x, y = datasets.load_csv(csv_file, target="price", features=["b", "a"])
    assert y.dtype == torch.float32 and y.tolist() == [10.5, 11.0, 12.25] and x[:, 0].tolist() == [2.0, 4.0, 6.0]
    _, y = datasets.load_csv(csv_file, target="label", features=["a"], task="regression")
    assert y.dtype == torch.float32


@pytest.mark.parametrize(
    "content, where",
    [
        (b"a,b\n1,2\n\x7fELF\x02\x01\xf0\xff,\x00\n3,4\n", r"line 3 holds bytes that are not utf-8"),  # a binary file
        (b"a,b\n1,2\n3,4,5\n", r"line 3: Expected 2 fields in line 3, saw 3"),
    ],
)
def test_load_csv_names_the_file_and_the_line_of_an_unreadable_table(tmp_path, content, where):
    """A binary or ragged file was a raw UnicodeDecodeError / pandas ParserError that named no file."""
    path = tmp_path / "table.csv"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"path: '.*table\.csv' is not a .*{where}") as info:
        datasets.load_csv(path, target="b")
    assert type(info.value) is ValueError  # not pandas' ParserError, not UnicodeDecodeError


def test_load_csv_of_a_real_binary_file_names_it(tmp_path):
    path = tmp_path / "python.csv"
    path.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    with pytest.raises(ValueError, match=r"path: '.*python\.csv' is not a utf-8 text table: line \d+"):
        datasets.load_csv(path, target="b")


def test_load_csv_errors(csv_file, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"path: no CSV file at .*missing\.csv"):
        datasets.load_csv(tmp_path / "missing.csv", target="label")
    with pytest.raises(
        ValueError,
        match=r"target: column\(s\) \['labels'\] not in .*available columns: "
        r"\['a', 'b', 'label', 'price', 'city'\]",
    ):
        datasets.load_csv(csv_file, target="labels")
    with pytest.raises(ValueError, match=r"features: column\(s\) \['c'\]"):
        datasets.load_csv(csv_file, target="label", features=["a", "c"])
    with pytest.raises(ValueError, match=r"\['city'\] .* are not numeric .*get_dummies"):
        datasets.load_csv(csv_file, target="label")  # every other column, city included
    with pytest.raises(ValueError, match=r"non-integer values, which cannot be class labels"):
        datasets.load_csv(csv_file, target="price", features=["a"], task="classification")
    holes = tmp_path / "holes.csv"
    holes.write_text("a,y\n1,2\n,3\n")
    with pytest.raises(ValueError, match=r"\['a'\] .* missing values"):
        datasets.load_csv(holes, target="y")


# ---------------------------------------------------------------------------------------- splits
def test_train_test_split_partitions_the_rows():
    x = torch.arange(50.0)[:, None]
    y = torch.arange(50.0)
    x_tr, y_tr, x_te, y_te = datasets.train_test_split(x, y, test_fraction=0.2, seed=0)
    assert len(x_te) == 10 and len(x_tr) == 40
    assert torch.equal(x_tr[:, 0], y_tr) and torch.equal(x_te[:, 0], y_te)  # rows stay paired
    assert sorted(torch.cat([y_tr, y_te]).tolist()) == list(range(50))
    again = datasets.train_test_split(x, y, test_fraction=0.2, seed=0)
    assert torch.equal(again[3], y_te)
    assert not torch.equal(datasets.train_test_split(x, y, seed=1)[3], y_te)


def test_stratified_split_keeps_class_proportions():
    y = torch.tensor([0] * 30 + [1] * 60 + [2] * 10)
    x = torch.arange(100.0)[:, None]
    _, y_tr, x_te, y_te = datasets.train_test_split(x, y, test_fraction=0.2, seed=0, stratify=True)
    assert torch.bincount(y_te).tolist() == [6, 12, 2] and torch.bincount(y_tr).tolist() == [24, 48, 8]
    assert torch.equal(y[x_te[:, 0].long()], y_te)


@pytest.mark.parametrize(
    "kwargs, y, message",
    [
        ({"test_fraction": 0.0}, torch.zeros(10), r"test_fraction must lie in \(0, 1\)"),
        ({"test_fraction": 1.0}, torch.zeros(10), r"test_fraction must lie in \(0, 1\)"),
        ({"stratify": True}, torch.zeros(10), r"stratify=True needs integer class labels"),
        ({}, torch.zeros(9), r"x has 10, y has 9"),
    ],
)
def test_train_test_split_errors(kwargs, y, message):
    with pytest.raises(ValueError, match=message):
        datasets.train_test_split(torch.zeros(10, 2), y, **kwargs)


def test_standardizer():
    t = torch.tensor([[1.0, 5.0], [3.0, 5.0], [5.0, 5.0]])
    s = datasets.Standardizer.fit(t)
    torch.testing.assert_close(s.mean, torch.tensor([3.0, 5.0]))
    torch.testing.assert_close(s.scale, torch.tensor([math.sqrt(8 / 3), 1.0]))  # ddof=0; a constant column gets 1
    z = s.transform(t)
    torch.testing.assert_close(z[:, 0], torch.tensor([-1.0, 0.0, 1.0]) * math.sqrt(3 / 2))
    assert (z[:, 1] == 0).all()
    torch.testing.assert_close(s.inverse(z), t)
    torch.testing.assert_close(s.inverse_std(torch.ones(2)), s.scale)
    with pytest.raises(ValueError, match=r"t: expected trailing dimension \(2,\)"):
        s.transform(torch.zeros(4, 3))


# ---------------------------------------------------------------------------------------- UCI
# 6 rows; columns: feature, ignored, feature, target. Split 0 trains on rows 0-3, tests on 4-5.
UCI_DATA = np.array(
    [
        [1.0, 9.0, 10.0, 2.0],
        [2.0, 9.0, 20.0, 4.0],
        [3.0, 9.0, 30.0, 6.0],
        [4.0, 9.0, 40.0, 8.0],
        [100.0, 9.0, 0.0, 20.0],
        [200.0, 9.0, 0.0, 30.0],
    ]
)


@pytest.fixture
def uci_folder(tmp_path):
    folder = tmp_path / "toy-uci" / "data"
    folder.mkdir(parents=True)
    np.savetxt(folder / "data.txt", UCI_DATA)
    (folder / "index_features.txt").write_text("0\n2\n")
    (folder / "index_target.txt").write_text("3\n")
    (folder / "n_splits.txt").write_text("2\n")
    np.savetxt(folder / "index_train_0.txt", [0, 1, 2, 3])  # Gal's files store indices as floats
    np.savetxt(folder / "index_test_0.txt", [4, 5])
    (folder / "index_train_1.txt").write_text("2\n3\n4\n5\n")
    (folder / "index_test_1.txt").write_text("0\n1\n")
    return folder


def test_uci_standardizes_with_training_statistics_only(uci_folder):
    uci = datasets.load_uci(uci_folder, split=0)
    assert (uci.split, uci.n_splits) == (0, 2)
    assert uci.x_train.shape == (4, 2) and uci.x_test.shape == (2, 2) and uci.y_train.shape == (4,)
    assert uci.x_train.dtype == uci.y_test.dtype == torch.float32
    # training rows: features (1..4, 10..40) and target 2..8; means 2.5, 25, 5; sds sqrt(1.25) * (1, 10, 2)
    sd = math.sqrt(1.25)
    torch.testing.assert_close(uci.x_scaler.mean, torch.tensor([2.5, 25.0]))
    torch.testing.assert_close(uci.x_scaler.scale, torch.tensor([sd, 10 * sd]))
    torch.testing.assert_close(uci.y_scaler.mean, torch.tensor(5.0))
    torch.testing.assert_close(uci.y_scaler.scale, torch.tensor(2 * sd))
    torch.testing.assert_close(uci.x_test, torch.tensor([[97.5 / sd, -2.5 / sd], [197.5 / sd, -2.5 / sd]]))
    torch.testing.assert_close(uci.y_test, torch.tensor([15.0, 25.0]) / (2 * sd))
    torch.testing.assert_close(uci.y_test_raw, torch.tensor([20.0, 30.0]))
    assert abs(float(uci.y_train.mean())) < 1e-6 and float(uci.y_train.std(correction=0)) == pytest.approx(1.0)
    # the parent folder works too, and the other split trains on other rows
    other = datasets.load_uci(uci_folder.parent, split=1)
    torch.testing.assert_close(other.y_test_raw, torch.tensor([2.0, 4.0]))


def test_uci_metrics_in_original_units_from_a_prediction(uci_folder):
    uci = datasets.load_uci(uci_folder, split=0)
    s, m = 2 * math.sqrt(1.25), 5.0
    # one draw predicting 19 and 33 (original units) with noise sd 0.5 (standardized units)
    mean = (torch.tensor([19.0, 33.0]) - m) / s
    pred = predictions.regression(mean[None], torch.full((1, 2), 0.25), mean[None])
    original = uci.to_original(pred)
    torch.testing.assert_close(original.mean, torch.tensor([19.0, 33.0]))
    torch.testing.assert_close(original.std, torch.full((2,), 0.5 * s))
    torch.testing.assert_close(uci.unstandardize(mean, torch.full((2,), 0.5))[1], torch.full((2,), 0.5 * s))
    result = uci.metrics(pred)
    assert result["rmse"] == pytest.approx(math.sqrt((1 + 9) / 2), rel=1e-5)
    sigma = 0.5 * s
    expected = np.mean([-0.5 * math.log(2 * math.pi * sigma**2) - e**2 / (2 * sigma**2) for e in (1.0, 3.0)])
    assert result["test_ll"] == pytest.approx(expected, rel=1e-5)


def test_uci_metrics_from_a_posterior_are_exact(uci_folder):
    uci = datasets.load_uci(uci_folder, split=0)
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3)
    )
    w, b = torch.tensor([[0.4, -0.2]]), torch.tensor([0.1])
    post = bp.Posterior(
        samples={"weight": w.reshape(1, 1, 1, 2), "bias": b.reshape(1, 1, 1)}, model=model, method="hand"
    )
    s, m = float(uci.y_scaler.scale), float(uci.y_scaler.mean)
    mean_orig = (uci.x_test @ w.T)[:, 0] * s + b * s + m
    ll = torch.distributions.Normal(mean_orig.double(), 0.3 * s).log_prob(uci.y_test_raw.double()).mean()
    result = uci.metrics(post)
    assert result["test_ll"] == pytest.approx(float(ll), rel=1e-5)
    assert result["rmse"] == pytest.approx(metrics.rmse(mean_orig, uci.y_test_raw), rel=1e-5)
    assert result["test_ll"] == pytest.approx(uci.metrics(post.predict(uci.x_test))["test_ll"], rel=1e-5)


def test_uci_errors(uci_folder, tmp_path):
    uci = datasets.load_uci(uci_folder)
    with pytest.raises(TypeError, match=r"prediction: expected a Posterior or a RegressionPrediction"):
        uci.metrics(torch.zeros(2))
    with pytest.raises(ValueError, match=r"its mean has shape \(3,\), but this split has 2 test targets"):
        uci.metrics(predictions.regression(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3)))
    with pytest.raises(FileNotFoundError, match=r"path: no folder at .*nowhere.*index_features\.txt"):
        datasets.load_uci(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"split: 2 is out of range; .* n_splits = 2"):
        datasets.load_uci(uci_folder, split=2)
    with pytest.raises(TypeError, match=r"split must be an int in 0..1"):
        datasets.load_uci(uci_folder, split="0")
    (uci_folder / "index_test_1.txt").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"index_test_1\.txt is missing from .*expected a folder holding data\.txt"
    ):
        datasets.load_uci(uci_folder, split=1)
    (uci_folder / "index_train_1.txt").write_text("0\n6\n")
    (uci_folder / "index_test_1.txt").write_text("1\n")
    with pytest.raises(ValueError, match=r"index_train_1\.txt .* outside 0..5 .* 0-based"):
        datasets.load_uci(uci_folder, split=1)
    (uci_folder / "n_splits.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"n_splits\.txt is missing"):
        datasets.load_uci(uci_folder)
