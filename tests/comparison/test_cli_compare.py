"""``bnn-pyro compare``: a zoo entry or a CSV file in, the table and figures out; a rerun with ``--resume`` fits
nothing again; a non-empty ``--out`` is refused unless asked; bad options exit with status 2 before any fit."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from bnn_pyro import cli

TINY = [
    "--option",
    "svi:num_steps=30",
    "--option",
    "svi:num_samples=20",
    "--option",
    "laplace:num_steps=30",
    "--option",
    "laplace:num_samples=20",
]


def test_zoo_entry_writes_the_table_and_a_resume_fits_nothing_again(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = ["compare", "mlp_regression", "--methods", "svi,laplace", *TINY, "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "the entry's test split" in printed and "laplace" in printed
    table = pd.read_csv(out / "table.csv", index_col="method", keep_default_na=False)
    assert list(table.index) == ["svi", "laplace"] and (table["error"] == "").all()
    assert {"table.md", "rows.csv", "test_ll.png", "predictive.png"} <= {p.name for p in out.iterdir()}

    assert cli.main(argv) == 2  # a non-empty --out is refused
    assert "--resume" in capsys.readouterr().err

    import bnn_pyro.comparison as comparison

    monkeypatch.setattr(comparison, "fit", lambda *a, **k: pytest.fail("a cached fit was repeated"))
    assert cli.main(argv + ["--resume"]) == 0
    again = pd.read_csv(out / "table.csv", index_col="method", keep_default_na=False)
    pd.testing.assert_frame_equal(again, table)


def test_csv_with_k_fold_reports_regression_scores_in_the_targets_units(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(36, 2))
    y = 100.0 * (np.sin(x[:, 0]) + 0.1 * rng.normal(size=36)) + 500.0
    path = tmp_path / "data.csv"
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "price": y}).to_csv(path, index=False)
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "compare",
                str(path),
                "--methods",
                "laplace",
                *TINY[4:],
                "--splits",
                "3",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "3-fold" in capsys.readouterr().out
    table = pd.read_csv(out / "table.csv", index_col="method", keep_default_na=False)
    rows = pd.read_csv(out / "rows.csv")
    assert table.loc["laplace", "splits_ok"] == 3
    assert table.loc["laplace", "test_ll"] == pytest.approx(rows["test_ll"].mean())
    scale = float(np.std(y, ddof=1))  # the model saw y / scale; the cache holds its scores in those units
    for split in range(3):
        fitted = json.loads((out / "cache" / f"laplace__split{split}.json").read_text())["row"]
        row = rows[rows["split"] == split].iloc[0]
        assert row["test_ll"] == pytest.approx(fitted["test_ll"] - math.log(scale), rel=1e-5)
        assert row["rmse"] == pytest.approx(fitted["rmse"] * scale, rel=1e-5)
        assert row["width_95"] == pytest.approx(fitted["width_95"] * scale, rel=1e-5)
        assert row["coverage_95"] == fitted["coverage_95"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--option", "svi:no_such=1"], "not an option of svi"),
        (["--option", "nope:lr=1"], "not a method"),
        (["--target", "y"], "CSV file"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, extra, message):
    assert cli.main(["compare", "mlp_regression", "--methods", "svi", *extra, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
