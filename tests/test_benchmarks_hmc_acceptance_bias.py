"""benchmarks/hmc_acceptance_bias.py: one seed on the exact Gaussian whose row holds together (the exact curve meets
the target at its crossing, the two variants share the warm-up's 50 pairs) and whose patch leaves the library as it
found it."""

from __future__ import annotations

import pandas as pd

from bnn_pyro.infer import _aimed_step, _batched


def test_one_seed_writes_a_consistent_row(tmp_path, load_benchmark):
    module = load_benchmark("hmc_acceptance_bias")
    rows = module.main(["--seeds", "0", "--draws", "2000", "--out", str(tmp_path)])
    (row,) = rows.itertuples()
    assert row.pairs == 50  # the last adaptation window's pairs, recorded once (the xbar variant does not aim)
    assert row.h_xbar < row.h_aimed < row.h_exact * 1.5
    assert all(0.0 <= v <= 1.0 for v in (row.exact_aimed, row.exact_xbar, row.exact_fit, row.realized_aimed))
    assert row.exact_xbar > row.exact_aimed  # A falls with the step: the curve is read in the right direction
    assert _batched.aimed_step is _aimed_step.aimed_step  # the recording patch undone
    written = pd.read_csv(tmp_path / "bias.csv")
    assert list(written.h_aimed) == list(rows.h_aimed) and "| 0 | " in (tmp_path / "bias.md").read_text()
