"""benchmarks/free_directions_speed.py on its quick setting (the script is loaded from its file: benchmarks/ is no
package): every tenth input column is zero, so the rows' second moment has exactly that many zero eigenvalues and the
other 57 of 64 near 1, far above the free start's threshold ``4 / (N s^4)`` (0.008 at N = 500, s = 1)."""

from __future__ import annotations

import pandas as pd


def test_quick_run_times_the_cpu_and_finds_exactly_the_zero_columns(tmp_path, load_benchmark):
    module = load_benchmark("free_directions_speed")
    table = module.main(["--quick", "--repeats", "1", "--out", str(tmp_path), "--name", "quick"])
    assert set(table.device) == {"cpu"} and bool((table.seconds > 0).all())
    assert bool((table.free_directions == 7).all())  # columns 0, 10, ..., 60
    assert bool((table[table.threads == table.threads.max()].ratio_to_cpu_default == 1.0).all())
    written = pd.read_csv(tmp_path / "quick.csv")
    assert list(written.free_directions) == list(table.free_directions)
    text = (tmp_path / "quick.md").read_text()
    assert "'free_directions': 7" in text and "| cpu | 64 |" in text  # the end-to-end ensemble's record
