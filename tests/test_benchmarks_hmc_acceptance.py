"""benchmarks/hmc_acceptance.py: a tiny run on the exact Gaussian whose rows hold together (the variants share the
warm-up, so the kept draws' gradient evaluations agree; ESS per 1,000 evaluations is ESS over them) and whose
variants leave the library as they found it."""

from __future__ import annotations

import pandas as pd

from bnn_pyro.infer import _aimed_step, _batched


def test_tiny_gaussian_run_writes_consistent_rows(tmp_path, load_benchmark):
    module = load_benchmark("hmc_acceptance")
    argv = ["--dataset", "gaussian", "--seeds", "0", "--option", "num_samples=20", "--option", "num_warmup=30"]
    rows = module.main([*argv, "--out", str(tmp_path)])
    assert list(rows.variant) == ["defaults", "xbar", "last"] and (rows.draws == 20).all()
    assert rows.grad_evals.nunique() == 1  # the jittered counts do not depend on the step: one stream for all three
    assert ((rows.ess_f_per_1k - rows.ess_f_min * 1000 / rows.grad_evals).abs() < 1e-9).all()
    assert ((rows.accept >= 0) & (rows.accept <= 1)).all() and (rows.diverging == 0).all()
    assert _batched.aimed_step is _aimed_step.aimed_step  # the variants' patches undone
    assert _batched.WarmupAdapter.__name__ == "WarmupAdapter"
    written = pd.read_csv(tmp_path / "acceptance.csv", keep_default_na=False)
    assert list(written.step_size) == list(rows.step_size)
    assert "| gaussian | hmc | xbar | 0 |" in (tmp_path / "acceptance.md").read_text()
