"""benchmarks/classification_draws.py: the arms' paired comparisons recomputed by hand on small hand-made rows (the
script is loaded from its file: benchmarks/ is no package)."""

from __future__ import annotations

import math

import pandas as pd
import pytest


@pytest.fixture(scope="module")
def draws(load_benchmark):
    return load_benchmark("classification_draws")  # it imports classification.py


def _row(split, method, nll, bias=0.0, chain_mean=None, error=""):
    return dict(
        split=split,
        method=method,
        error=error,
        nll=nll,
        nll_mc_bias=bias,
        nll_chain_mean=nll if chain_mean is None else chain_mean,
        nll_chain_se=0.01,
        ess_f_min=5.0,
        rhat_f_max=2.0,
        auroc_noise_mi=0.9,
        time_s=1.0,
    )


def test_arms_paired_against_the_reference_and_the_baseline_by_hand(draws):
    reference = pd.DataFrame([_row(s, "nuts", 0.10) for s in (0, 1, 2)] + [_row(0, "logreg", 0.0)])
    logreg = [_row(s, "logreg", 0.085) for s in (0, 1, 2)]
    base = pd.DataFrame(
        logreg
        + [
            _row(0, "m", 0.13, bias=0.004, chain_mean=0.16),
            _row(1, "m", 0.11, bias=0.002),
            _row(2, "m", 0.20, bias=0.010),  # split 2 has no row in the other arm: left out of both
        ]
    )
    more = pd.DataFrame(logreg + [_row(0, "m", 0.10, bias=0.001), _row(1, "m", 0.10, bias=0.0005)])
    summary, per_split = draws.compare({"d": base, "s4": more}, reference, ["m"])
    s = summary.set_index("arm")
    assert list(s.index) == ["d", "s4"] and (s["splits"] == 2).all()
    # baseline: NLL - nuts 0.03 and 0.01 -> mean 0.02, sd 0.01 * sqrt(2), se 0.01
    assert s.loc["d", "nll_ref"] == pytest.approx(0.02) and s.loc["d", "nll_ref_se"] == pytest.approx(0.01)
    assert s.loc["d", "nll_change"] == pytest.approx(0.0) and s.loc["d", "nll_change_se"] == pytest.approx(0.0)
    # more draws: changes -0.03 and -0.01 (mean -0.02, se 0.01); the bias estimate's -0.003 and -0.0015
    assert s.loc["s4", "nll_change"] == pytest.approx(-0.02) and s.loc["s4", "nll_change_se"] == pytest.approx(0.01)
    assert s.loc["s4", "bias_change"] == pytest.approx(-0.00225)
    assert s.loc["s4", "bias_change_se"] == pytest.approx(0.00075)
    assert s.loc["d", "chain_excess"] == pytest.approx(0.015)  # (0.03 + 0.0) / 2
    assert s.loc["d", "miss"] == 1 and s.loc["s4", "miss"] == 0  # NLL - logreg 0.045, 0.025; then 0.015 twice
    assert sorted(per_split["split"].unique()) == [0, 1]


def test_a_failed_fit_is_left_out_and_no_common_split_is_empty(draws):
    reference = pd.DataFrame([_row(0, "nuts", 0.10)])
    base = pd.DataFrame([_row(0, "logreg", 0.05), _row(0, "m", math.nan, error="FitTimeout: ")])
    summary, _ = draws.compare({"d": base, "s4": base}, reference, ["m"])
    assert summary.empty
