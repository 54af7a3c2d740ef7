"""benchmarks/classification.py on iris with tiny budgets: the row's numbers are recomputed by hand here (the
script is loaded from its file: benchmarks/ is no package)."""

from __future__ import annotations

import math

import pytest
import torch

from bnn_pyro import metrics


@pytest.fixture(scope="module")
def cls(load_benchmark):
    return load_benchmark("classification")  # it imports its sibling uci.py


def test_split_is_standardized_on_its_training_rows(cls):
    x, y = cls.load_dataset("iris")
    s = cls.make_split(x, y, 3)
    assert len(s["x_test"]) == 30 and len(s["x_train"]) == 120
    torch.testing.assert_close(s["x_train"].mean(0), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(s["x_train"].std(0), torch.ones(4), atol=1e-5, rtol=0)


def test_row_scores_recomputed_by_hand(cls):
    from sklearn.linear_model import LogisticRegression

    data = cls.load_dataset("iris")
    row = cls.run_one("logreg", data, 0)
    assert row["error"] == ""
    s = cls.make_split(*data, 0)
    clf = LogisticRegression(C=1.0, max_iter=5000).fit(s["x_train"].numpy(), s["y_train"].numpy())
    p = torch.tensor(clf.predict_proba(s["x_test"].numpy()), dtype=torch.float64)
    assert row["accuracy"] == pytest.approx(float((p.argmax(-1) == s["y_test"]).double().mean()))
    assert row["nll"] == pytest.approx(float(-p[torch.arange(len(p)), s["y_test"]].log().mean()), rel=1e-6)
    noise = cls.ood_inputs(s, 0)["noise"]
    assert noise.std().item() == pytest.approx(3.0, rel=0.1)

    def h(q):
        return -(q * q.log()).sum(-1)

    p_noise = torch.tensor(clf.predict_proba(noise.numpy()), dtype=torch.float64)
    assert row["auroc_noise_entropy"] == pytest.approx(metrics.ood_auroc(h(p), h(p_noise)))
    assert math.isnan(row["auroc_noise_mi"])  # logistic regression has no mutual information
    keep = s["y_train"] < 2
    clf2 = LogisticRegression(C=1.0, max_iter=5000).fit(s["x_train"][keep].numpy(), s["y_train"][keep].numpy())
    held = s["y_test"] == 2
    q = torch.tensor(clf2.predict_proba(s["x_test"].numpy()), dtype=torch.float64)
    assert row["auroc_class_entropy"] == pytest.approx(metrics.ood_auroc(h(q[~held]), h(q[held])))


def test_an_engine_row_has_every_score(cls):
    row = cls.run_one("ensemble", cls.load_dataset("iris"), 1, {"num_chains": 2, "num_steps": 20})
    assert row["error"] == ""
    for m in cls.METRICS:
        assert 0.0 <= row[m] and math.isfinite(row[m]), m


def test_max_rows_takes_a_fixed_random_subset_of_distinct_rows(cls):
    x, y = cls.load_dataset("iris")
    xs, ys = cls.subset((x, y), 50)
    again, _ = cls.subset((x, y), 50)
    assert xs.shape == (50, 4) and torch.equal(xs, again)  # seed 0: the same rows every run
    rows = {tuple(r) for r in x.tolist()}
    assert all(tuple(r) in rows for r in xs.tolist()) and len(set(ys.tolist())) == 3  # real rows, every class
    assert not torch.equal(xs, x[:50])  # drawn at random, not the first rows (iris is sorted by class)
    assert cls.subset((x, y), None)[0] is x and cls.subset((x, y), 10_000)[0] is x


def test_no_class_skips_the_second_fit_and_first_split_offsets_the_splits(cls, tmp_path):
    data = cls.load_dataset("iris")
    row = cls.run_one("logreg", data, 0, held_out_class=False)
    assert row["error"] == "" and "auroc_class_entropy" not in row and math.isfinite(row["auroc_noise_entropy"])
    assert row["nll"] == pytest.approx(cls.run_one("logreg", data, 0)["nll"])
    out = cls.main(
        [
            "--dataset",
            "iris",
            "--methods",
            "logreg",
            "--first-split",
            "2",
            "--splits",
            "2",
            "--no-class",
            "--out",
            str(tmp_path),
        ]
    )
    rows = __import__("pandas").read_csv(tmp_path / "iris_splits.csv")
    assert rows["split"].tolist() == [2, 3] and "auroc_class_entropy" not in rows
    assert out["iris"]["splits_ok"].tolist() == [2]
