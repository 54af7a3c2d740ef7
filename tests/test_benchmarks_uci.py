"""benchmarks/uci.py end to end on a tiny generated data set: the table's numbers are those of the
per-split fits, recomputed by hand here (the script is loaded from its file: benchmarks/ is no package)."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import metrics

CHEAP = {"svi": {"num_steps": 30, "num_samples": 20}, "mc_dropout": {"num_steps": 30, "num_samples": 20}}


@pytest.fixture(scope="module")
def uci(load_benchmark):
    return load_benchmark("uci")


def _tiny(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 2, generator=g) * 10
    y = 3.0 * torch.sin(x[:, 0]) + x[:, 1] + torch.randn(40, generator=g)
    return bp.datasets.write_uci_splits(tmp_path / "tiny" / "data", x, y, n_splits=3, seed=0)


def test_runner_end_to_end_matches_a_hand_computation(uci, tmp_path):
    folder, out = _tiny(tmp_path), tmp_path / "results"
    argv = [
        "--path",
        str(folder),
        "--splits",
        "2",
        "--methods",
        "svi,mc_dropout,swa",
        "--out",
        str(out),
        "--option",
        "swa:not_an_option=1",
    ]  # swa fails on purpose: its error is recorded and the run goes on
    for method, options in CHEAP.items():
        argv += [f"--option={method}:{k}={v}" for k, v in options.items()]
    summary = uci.main(argv)["tiny"]
    rows = pd.read_csv(out / "tiny_splits.csv", keep_default_na=False)
    assert list(rows["method"]) == ["svi", "mc_dropout", "swa"] * 2 and list(rows["split"]) == [0, 0, 0, 1, 1, 1]
    assert (rows.loc[rows["method"] == "swa", "error"].str.contains("not_an_option")).all()
    assert (rows.loc[rows["method"] != "swa", "error"] == "").all()

    # per split: the same fit by hand (the protocol's model and seeds) gives the same numbers
    for k in range(2):
        split = bp.datasets.load_uci(folder, split=k)
        post = bp.fit(
            uci.make_model(2, k), split.x_train, split.y_train, method="svi", seed=k, progress=False, **CHEAP["svi"]
        )
        row = rows[(rows["method"] == "svi") & (rows["split"] == k)].iloc[0]
        scores = split.metrics(post)
        pred = post.predict(split.x_test, seed=0)
        assert float(row["test_ll"]) == pytest.approx(scores["test_ll"], rel=1e-5)
        assert float(row["rmse"]) == pytest.approx(scores["rmse"], rel=1e-5)
        u = metrics.pit(post, split.x_test, split.y_test)
        assert float(row["coverage_95"]) == pytest.approx(float(((u >= 0.025) & (u <= 0.975)).double().mean()))
        cal = metrics.regression_calibration_error(metrics.pit(post, split.x_test, split.y_test))
        assert float(row["calibration_error"]) == pytest.approx(cal, rel=1e-5)
        epistemic = float(pred.epistemic_std.double().mean() * split.y_scaler.scale)
        assert float(row["epistemic_sd"]) == pytest.approx(epistemic, rel=1e-5)

    # the summary is the mean and standard error (ddof 1) of the per-split values, in the CSV and the Markdown
    table = pd.read_csv(out / "tiny.csv", keep_default_na=False).set_index("method")
    for method in ("svi", "mc_dropout"):
        for metric in uci.METRICS:
            values = [float(v) for v in rows.loc[rows["method"] == method, metric]]
            mean, se = sum(values) / 2, abs(values[0] - values[1]) / 2  # sd (ddof 1) of two values / sqrt(2)
            assert float(table.loc[method, metric]) == pytest.approx(mean, rel=1e-9)
            assert float(table.loc[method, f"{metric}_se"]) == pytest.approx(se, rel=1e-9, abs=1e-12)
        assert table.loc[method, "splits_ok"] == 2
    assert table.loc["swa", "splits_ok"] == 0 and "not_an_option" in table.loc["swa", "error"]
    text = (out / "tiny.md").read_text()
    ll, ll_se = summary.set_index("method").loc["svi", ["test_ll", "test_ll_se"]]
    assert f"| svi | {ll:.3f} ± {ll_se:.3f} |" in text
    assert (out / "test_ll.png").stat().st_size > 0

    # --resume fits only the pairs missing from the per-split file (here the last two) and rebuilds the table
    rows.iloc[:4].to_csv(out / "tiny_splits.csv", index=False)
    again = uci.main(argv + ["--resume"])["tiny"]
    redone = pd.read_csv(out / "tiny_splits.csv", keep_default_na=False)
    assert list(zip(redone["method"], redone["split"])) == list(zip(rows["method"], rows["split"]))
    assert float(redone.loc[4, "test_ll"]) == pytest.approx(
        float(rows.loc[4, "test_ll"]), rel=1e-6
    )  # same seed, same fit
    timing = ["time_s", "time_s_se"]  # wall times differ between runs; everything else is the same
    pd.testing.assert_frame_equal(again.drop(columns=timing), summary.drop(columns=timing), rtol=1e-6)
    # --summarize fits nothing and rebuilds the same summary from the per-split rows
    pd.testing.assert_frame_equal(uci.main(argv + ["--summarize"])["tiny"], again, rtol=1e-12)


def test_a_fit_past_the_time_limit_is_recorded_and_the_alarm_is_cleared(uci):
    split = bp.datasets.make_uci_splits(*bp.datasets.heteroscedastic(n=30), n_splits=1)[0]
    row = uci.run_one("svi", split, {"num_steps": 10**7}, max_fit_seconds=0.5)
    assert row["error"].startswith("FitTimeout: stopped after 0.5 s") and "test_ll" not in row
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_option_parsing_and_bad_names(uci):
    assert uci.parse_options(["svi:num_steps=10", "svi:guide=full_rank", "nuts:step_size=1e-3"]) == {
        "svi": {"num_steps": 10, "guide": "full_rank"},
        "nuts": {"step_size": 1e-3},
    }
    with pytest.raises(SystemExit, match="method:key=value"):
        uci.parse_options(["num_steps=10"])
    with pytest.raises(SystemExit, match="unknown method 'bogus'"):
        uci.main(["--methods", "svi,bogus"])
    assert math.isnan(
        uci.summarize(pd.DataFrame([dict(method="svi", split=0, error="E: x", warnings="")])).loc[0, "test_ll"]
    )


def test_each_row_records_what_the_held_out_rows_chose(uci, tmp_path):
    """216 training rows: Laplace holds 10% out, chooses its stop, horizon and noise there and refits on every row;
    the row records those choices (the noise in original units). SVI holds nothing out: its CHOSEN cells are empty."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(240, 2, generator=g) * 10
    y = 3.0 * torch.sin(x[:, 0]) + x[:, 1] + torch.randn(240, generator=g)
    folder, out = bp.datasets.write_uci_splits(tmp_path / "held" / "data", x, y, n_splits=1, seed=0), tmp_path / "res"
    argv = ["--path", str(folder), "--splits", "1", "--methods", "laplace,svi", "--out", str(out)]
    argv += ["--option=laplace:num_steps=300", "--option=svi:num_steps=30", "--option=svi:num_samples=20"]
    uci.main(argv)
    rows = pd.read_csv(out / "held_splits.csv").set_index("method")

    split = bp.datasets.load_uci(folder, split=0)
    post = bp.fit(
        uci.make_model(2, 0), split.x_train, split.y_train, method="laplace", seed=0, progress=False, num_steps=300
    )
    chosen = post.config["validation"]["chosen"]  # the same fit by hand
    assert rows.loc["laplace", "chosen_num_steps"] == chosen["num_steps"]
    assert rows.loc["laplace", "chosen_horizon"] == chosen["horizon"] == 300
    sigma = chosen["sigma"] * float(split.y_scaler.scale)
    assert rows.loc["laplace", "chosen_sigma"] == pytest.approx(sigma, rel=1e-6)
    assert rows.loc["svi", uci.CHOSEN].isna().all() and post.config["validation"]["final_fit_rows"] == 216

    # a file written before these columns is resumed: the refitted row gets them, the old row's cells stay empty
    rows.drop(columns=uci.CHOSEN).drop(index="laplace").reset_index().to_csv(out / "held_splits.csv", index=False)
    uci.main(argv + ["--resume"])
    again = pd.read_csv(out / "held_splits.csv").set_index("method")
    assert list(again.index) == ["svi", "laplace"] and again.loc["svi", uci.CHOSEN].isna().all()
    assert again.loc["laplace", "chosen_num_steps"] == chosen["num_steps"]
