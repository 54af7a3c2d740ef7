"""benchmarks/classification_splits.py: the pooled verdicts recomputed by hand on small hand-made tables (the
script is loaded from its file: benchmarks/ is no package)."""

from __future__ import annotations

import math

import pandas as pd
import pytest


@pytest.fixture(scope="module")
def agg(load_benchmark):
    return load_benchmark("classification_splits")  # it imports classification.py and uci.py


def _verdict(split, method, auroc, nll_gap, accuracy_gap, z, met):
    return dict(split=split, method=method, auroc=auroc, nll_gap=nll_gap, accuracy_gap=accuracy_gap, z=z, met=met)


def test_aggregate_counts_means_and_distances_by_hand(agg):
    table = pd.DataFrame(
        [
            _verdict(0, "a", 0.80, 0.01, 0.00, 0.0, True),  # AUROC exactly at 0.8: met, not a miss
            _verdict(1, "a", 0.86, 0.04, -0.05, 2.5, False),  # misses the fit half twice (accuracy and NLL)
            _verdict(2, "a", 0.92, 0.07, 0.00, -1.0, False),  # misses it by NLL
            _verdict(4, "b", 0.70, 0.00, 0.00, -3.0, False),  # one split: no spread, no se
            _verdict(5, "c", 0.90, 0.00, 0.00, 5.0, True),
            _verdict(6, "c", 0.90, 0.02, 0.00, 5.0, True),
            _verdict(7, "c", 0.90, 19.6, 0.00, 5.0, False),  # a diverged fit: it moves the mean, not the median
        ]
    )
    out = agg.aggregate(table).set_index("method")
    a = out.loc["a"]
    assert (a["splits"], a["met"], a["miss_auroc"], a["miss_fit"], a["near"]) == (3, 1, 0, 2, 2)
    # AUROC 0.80, 0.86, 0.92: mean 0.86, sd 0.06, se 0.06 / sqrt(3); its distance to 0.8 is sqrt(3) se
    assert a["auroc"] == pytest.approx(0.86) and a["auroc_se"] == pytest.approx(0.06 / math.sqrt(3))
    assert a["auroc_z"] == pytest.approx(math.sqrt(3))
    # NLL gaps 0.01, 0.04, 0.07: mean 0.04, sd 0.03; (0.04 - 0.03) / (0.03 / sqrt(3)) = 1 / sqrt(3)
    assert a["nll_gap"] == pytest.approx(0.04) and a["nll_gap_se"] == pytest.approx(0.03 / math.sqrt(3))
    assert a["nll_z"] == pytest.approx(1 / math.sqrt(3)) and a["nll_gap_median"] == pytest.approx(0.04)
    # accuracy gaps 0, -0.05, 0: mean -0.05 / 3, sd 0.05 / sqrt(3)
    assert a["accuracy_gap"] == pytest.approx(-0.05 / 3) and a["accuracy_gap_se"] == pytest.approx(0.05 / 3)
    assert a["z_splits"] == "+0.0 +2.5 -1.0" and a["splits_used"] == "0 1 2"
    b = out.loc["b"]
    assert (b["splits"], b["met"], b["miss_auroc"], b["miss_fit"], b["near"]) == (1, 0, 1, 0, 0)
    assert b["auroc"] == pytest.approx(0.70) and math.isnan(b["auroc_se"]) and math.isnan(b["auroc_z"])
    c = out.loc["c"]
    assert c["nll_gap"] == pytest.approx(19.62 / 3) and c["nll_gap_median"] == pytest.approx(0.02)
    assert math.isnan(c["auroc_z"])  # no spread over splits: no distance in se


def _row(split, method, accuracy, nll, auroc_mi, se=0.02):
    mi = method != "logreg"
    return dict(
        dataset="toy",
        method=method,
        split=split,
        error=None,
        accuracy=accuracy,
        nll=nll,
        auroc_noise_entropy=0.5,
        auroc_noise_mi=auroc_mi if mi else math.nan,
        se_noise_entropy=0.05,
        se_noise_mi=se if mi else math.nan,
        sedraw_noise_entropy=0.01,
        sedraw_noise_mi=0.01 if mi else math.nan,
        auroc_noise_ntest_entropy=0.5,
        auroc_noise_ntest_mi=auroc_mi if mi else math.nan,
    )


def test_main_pools_two_files_and_scores_each_split_against_its_own_logreg(agg, tmp_path):
    pd.DataFrame(
        [_row(0, "logreg", 0.9, 0.20, 0), _row(0, "svi", 0.9, 0.22, 0.84), _row(0, "swag", 0.9, 0.30, 0.90)]
    ).to_csv(tmp_path / "old_toy_splits.csv", index=False)
    pd.DataFrame(
        [
            _row(1, "logreg", 1.0, 0.10, 0),
            _row(1, "svi", 0.95, 0.12, 0.79),  # AUROC miss (z = -0.5); accuracy -0.05: a fit miss too
            _row(1, "swag", 1.0, 0.12, 0.85),
            _row(2, "svi", 1.0, 0.0, 0.99),  # no logreg row on split 2: left out
            dict(_row(3, "logreg", 1.0, 0.1, 0), error="FitTimeout: "),  # a failed reference: split 3 left out
            _row(3, "svi", 1.0, 0.1, 0.99),
        ]
    ).to_csv(tmp_path / "new_toy_splits.csv", index=False)
    argv = ["--sets", "toy", "--prefixes", "old,new", "--methods", "svi,swag", "--folder", str(tmp_path)]
    summary = agg.main(argv + ["--out", str(tmp_path), "--name", "pooled"]).set_index("method")
    svi, swag = summary.loc["svi"], summary.loc["swag"]
    assert (svi["splits"], svi["met"], svi["miss_auroc"], svi["miss_fit"]) == (2, 1, 1, 1)
    assert svi["splits_used"] == "0 1" and svi["z_splits"] == "+2.0 -0.5"  # (0.84 - 0.8) / 0.02, (0.79 - 0.8) / 0.02
    assert svi["nll_gap"] == pytest.approx(0.02) and svi["accuracy_gap"] == pytest.approx(-0.025)
    assert (swag["met"], swag["miss_fit"]) == (1, 1)  # split 0: NLL 0.10 above logreg's
    written = pd.read_csv(tmp_path / "pooled.csv")
    assert written["met"].tolist() == [1, 1] and (written["dataset"] == "toy").all()
    text = (tmp_path / "pooled.md").read_text()
    assert text.startswith("Run ") and "| toy | svi | 1/2 | 1 / 1 |" in text and "new_toy_splits.csv" in text


def test_overlapping_or_missing_files_are_errors_naming_the_argument(agg, tmp_path):
    rows = pd.DataFrame([_row(0, "logreg", 0.9, 0.2, 0), _row(0, "svi", 0.9, 0.2, 0.9)])
    rows.to_csv(tmp_path / "a_toy_splits.csv", index=False)
    base = ["--sets", "toy", "--methods", "svi", "--folder", str(tmp_path), "--out", str(tmp_path)]
    rows.assign(nll=[0.2, 0.3]).to_csv(tmp_path / "b_toy_splits.csv", index=False)  # svi's NLL differs
    with pytest.raises(SystemExit, match="--prefixes: rows with different results .*: svi split 0"):
        agg.main(base + ["--prefixes", "a,b"])
    with pytest.raises(SystemExit, match="--prefixes: .*c_toy_splits.csv does not exist"):
        agg.main(base + ["--prefixes", "a,c"])
    with pytest.raises(SystemExit, match="--methods: expected at least one engine"):
        agg.main(["--sets", "toy", "--prefixes", "a", "--methods", "logreg", "--folder", str(tmp_path)])


def test_main_counts_the_verdicts_against_nuts_on_the_splits_that_have_a_nuts_row(agg, tmp_path):
    pd.DataFrame(
        [
            _row(0, "logreg", 0.95, 0.10, 0),
            _row(0, "nuts", 0.95, 0.15, 0.99),  # the posterior itself 0.05 above logistic regression
            _row(0, "svi", 0.95, 0.17, 0.90),  # misses logreg's NLL half, within 0.03 of NUTS's
            _row(0, "swag", 0.95, 0.20, 0.90),  # 0.05 above NUTS too
            _row(1, "logreg", 0.95, 0.10, 0),
            _row(1, "nuts", 0.95, 0.12, 0.99),
            _row(1, "svi", 0.95, 0.11, 0.90),
            _row(1, "swag", 0.95, 0.16, 0.90),  # 0.04 above NUTS
            _row(2, "logreg", 0.95, 0.10, 0),
            _row(2, "svi", 0.95, 0.11, 0.90),  # no NUTS row on split 2: not judged against it
        ]
    ).to_csv(tmp_path / "x_toy_splits.csv", index=False)
    argv = ["--sets", "toy", "--prefixes", "x", "--methods", "nuts,svi,swag", "--folder", str(tmp_path)]
    out = agg.main(argv + ["--out", str(tmp_path), "--name", "ref"]).set_index("method")
    svi, swag, nuts = out.loc["svi"], out.loc["swag"], out.loc["nuts"]
    assert (svi["met"], svi["met_ref"], svi["splits_ref"]) == (2, 2, 2)  # met on 1 and 2 against logreg
    assert svi["nll_gap_ref"] == pytest.approx((0.02 - 0.01) / 2)
    assert (swag["met"], swag["met_ref"], swag["splits_ref"]) == (0, 0, 2)
    assert swag["nll_gap_ref"] == pytest.approx(0.045)
    assert nuts["splits_ref"] == 0 and math.isnan(nuts["nll_gap_ref"])  # not its own reference
    text = (tmp_path / "ref.md").read_text()
    # paired gaps to NUTS: svi +0.02, -0.01 (se 0.015); swag +0.05, +0.04 (se 0.005)
    assert svi["nll_gap_ref_se"] == pytest.approx(0.015) and swag["nll_gap_ref_se"] == pytest.approx(0.005)
    assert "| toy | svi | 2/2 | +0.005 ± 0.015 |" in text and "| toy | swag | 0/2 | +0.045 ± 0.005 |" in text
    assert "| toy | 0 | svi | +0.000 | +0.070 | 0.900 ± 0.020 | +5.0 | ✗ | x_toy_splits.csv | +0.020 | ✓ |" in text
    assert "| toy | 2 | svi | +0.000 | +0.010 | 0.900 ± 0.020 | +5.0 | ✓ | x_toy_splits.csv | - | - |" in text


def test_a_z_without_spread_says_why_instead_of_nan(agg, tmp_path):
    # SWA's MI AUROC is exactly 0.5 on every split: se 0, so (AUROC - 0.8) / se has no value; the table says so
    rows = [
        _row(0, "logreg", 0.9, 0.20, 0),
        _row(0, "swa", 0.9, 0.20, 0.5),
        _row(1, "logreg", 1.0, 0.10, 0),
        _row(1, "swa", 1.0, 0.15, 0.5),
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "toy_toy_splits.csv", index=False)
    argv = ["--sets", "toy", "--prefixes", "toy", "--methods", "swa", "--folder", str(tmp_path), "--out", str(tmp_path)]
    swa = agg.main(argv + ["--name", "flat"]).set_index("method").loc["swa"]
    assert swa["auroc_se"] == 0 and math.isnan(swa["auroc_z"])  # the CSV keeps the number: NaN
    row = next(line for line in (tmp_path / "flat.md").read_text().splitlines() if line.startswith("| toy | swa |"))
    assert "nan" not in row.lower()
    assert "| 0.500 ± 0.000 | se 0: every split 0.500 |" in row
    assert agg.z_cell(-1.3, 0.9, 0.08, ".3f") == "-1.3"
    assert agg.z_cell(math.nan, 0.7, math.nan, ".3f") == "one split: no se"
    assert agg.z_cell(math.nan, 0.01, 0.0, "+.3f") == "se 0: every split +0.010"


def test_the_same_result_in_two_files_is_pooled_once(agg, tmp_path):
    # a rerun's logistic-regression row (same scores, another wall time) beside the first run's: one row, not an
    # error; the engine rows come from either file
    first = pd.DataFrame([dict(_row(0, "logreg", 0.9, 0.2, 0), time_s=1.0), _row(0, "svi", 0.9, 0.25, 0.9)])
    second = pd.DataFrame([dict(_row(0, "logreg", 0.9, 0.2, 0), time_s=2.0), _row(0, "nuts", 0.9, 0.21, 0.95)])
    first.to_csv(tmp_path / "a_toy_splits.csv", index=False)
    second.to_csv(tmp_path / "b_toy_splits.csv", index=False)
    argv = ["--sets", "toy", "--prefixes", "a,b", "--methods", "svi,nuts", "--folder", str(tmp_path)]
    out = agg.main(argv + ["--out", str(tmp_path), "--name", "once"]).set_index("method")
    assert out.loc["svi", "nll_gap"] == pytest.approx(0.05) and out.loc["svi", "nll_gap_ref"] == pytest.approx(0.04)
    assert out.loc["nuts", "splits"] == 1 and math.isnan(out.loc["svi", "nll_gap_ref_se"])  # one split: no se
    assert "| toy | svi | 0/1 | +0.040 (one split: no se) |" in (tmp_path / "once.md").read_text()
