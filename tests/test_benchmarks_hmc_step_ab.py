"""benchmarks/hmc_step_ab.py: the fit-by-fit summary of two sides flags what the validation asks for (a warning or a
divergence only after, a verdict lost) and nothing where the sides agree up to the numbers inside a warning."""

from __future__ import annotations

import pandas as pd

ESS = "hmc: the bulk ESS of f(x) at 20 training inputs is {} at worst (threshold 100 in all)"


def _side(folder, *, warnings: str, divergences: int, met: bool, nll: float = 0.1) -> None:
    run = folder / "cls" / "iris0"
    run.mkdir(parents=True)
    splits = {"dataset": "iris", "split": 0, "error": "", "warnings": warnings, "time_s": 80.0, "nll": nll}
    pd.DataFrame([dict(splits, method="logreg", warnings=""), dict(splits, method="hmc")]).to_csv(
        run / "iris_splits.csv", index=False
    )
    pd.DataFrame([{"split": 0, "method": "hmc", "score": "mi", "met": met}]).to_csv(
        run / "iris_verdicts.csv", index=False
    )
    stats = {"tag": "cls:iris:0", "method": "hmc", "chains": 2, "draws": 10, "divergences": divergences}
    pd.DataFrame([dict(stats, step="0.03;0.04", accept="0.8;0.9", n_steps="31;32")]).to_csv(
        folder / "stats.csv", index=False
    )


def _flags(module, tmp_path, before: dict, after: dict) -> str:
    _side(tmp_path / "before", **before)
    _side(tmp_path / "after", **after)
    paired = module.fits(tmp_path / "before", tmp_path / "after", tmp_path)
    assert len(paired) == 1 and paired.loc[0, "accept_after"] == "0.8;0.9"
    assert (tmp_path / "validation_fits.csv").exists()
    text = (tmp_path / "validation_fits.md").read_text()
    return text.split("## Flags")[1].split("## Every warning")[0]


def test_fits_flags_a_new_warning_a_divergence_and_a_lost_verdict(tmp_path, load_benchmark):
    module = load_benchmark("hmc_step_ab")
    before = dict(warnings="", divergences=0, met=True)
    flags = _flags(module, tmp_path, before, dict(warnings=ESS.format(89), divergences=2, met=False))
    assert "iris split 0: a warning only after: hmc: the bulk ESS" in flags
    assert "iris split 0: divergences 0 before, 2 after" in flags
    assert "iris split 0: the joint target met before, missed after" in flags


def test_fits_flags_nothing_where_only_a_warnings_number_differs(tmp_path, load_benchmark):
    module = load_benchmark("hmc_step_ab")
    before = dict(warnings=ESS.format(60), divergences=1, met=False)
    flags = _flags(module, tmp_path, before, dict(warnings=ESS.format(89), divergences=1, met=True))
    assert flags.strip().endswith("none")


def test_fits_reads_how_much_closer_to_nuts_each_split_moved(tmp_path, load_benchmark):
    module = load_benchmark("hmc_step_ab")
    _side(tmp_path / "before", warnings="", divergences=0, met=True, nll=0.30)
    _side(tmp_path / "after", warnings="", divergences=0, met=True, nll=0.22)
    nuts = tmp_path / "nuts_splits.csv"
    pd.DataFrame([{"dataset": "iris", "method": "nuts", "split": 0, "nll": 0.20}]).to_csv(nuts, index=False)
    paired = module.fits(tmp_path / "before", tmp_path / "after", tmp_path, [str(nuts)])
    assert abs(paired.loc[0, "nll_nuts"] - 0.20) < 1e-12
    assert abs(paired.loc[0, "nll_closer"] - (0.02 - 0.10)) < 1e-12  # after is 0.08 closer to NUTS
