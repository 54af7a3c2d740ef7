"""benchmarks/hmc_trajectory.py: its longest scale against an exact Gaussian, and a tiny run of HMC on breast_cancer
whose rows hold together (the trajectory is steps times step size, the turn is the trajectory over the scale)."""

from __future__ import annotations

import math

import pandas as pd
import torch


def test_longest_scale_is_the_largest_sd_in_the_metric(load_benchmark):
    """Draws of N(0, diag(9, 1, 1)) rotated by 45 degrees in the first two coordinates: the largest sd is 3 along
    (1, 1, 0) / sqrt(2) in the identity metric; in the metric of the marginal variances (5, 5, 1) it is
    sqrt(9 / 5) = 1.342. 40,000 independent draws: the sd's relative Monte Carlo error is 1 / sqrt(2 n) = 0.35%, so
    4% is over 10 standard errors."""
    module = load_benchmark("hmc_trajectory")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(40_000, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    rotate = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, math.sqrt(2.0)]], dtype=torch.float64)
    draws = z @ rotate / math.sqrt(2.0)
    sd, top = module.longest_scale(draws, torch.ones(3, dtype=torch.float64))
    assert abs(sd / 3.0 - 1) < 0.04, sd
    assert abs(abs(float(top @ torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))) / math.sqrt(2.0) - 1) < 1e-3
    sd, _ = module.longest_scale(draws, torch.tensor([5.0, 5.0, 1.0], dtype=torch.float64))
    assert abs(sd / math.sqrt(9 / 5) - 1) < 0.04, sd


def test_tiny_hmc_run_writes_consistent_rows(tmp_path, load_benchmark):
    module = load_benchmark("hmc_trajectory")
    argv = ["--splits", "0", "--option", "num_samples=20", "--option", "num_warmup=20", "--option", "num_chains=2"]
    rows = module.main([*argv, "--tag", "tiny", "--out", str(tmp_path)])
    assert list(rows.chain) == [0, 1] and set(rows.tag) == {"tiny"}
    assert ((rows.n_steps_mean >= 16) & (rows.n_steps_mean <= 48)).all()  # 32 steps jittered by +-50% per draw
    assert ((rows.trajectory - rows.step_size * rows.n_steps_mean).abs() < 1e-9).all()
    assert ((rows.turn_top - rows.trajectory / rows.sd_max).abs() < 1e-9).all()
    assert rows.tree_depth_mean.isna().all() and (rows.draws == 40).all()
    written = pd.read_csv(tmp_path / "trajectory_breast_cancer.csv")
    assert list(written.step_size) == list(rows.step_size)
    assert "| breast_cancer | 0 | hmc | tiny |" in (tmp_path / "trajectory_breast_cancer.md").read_text()


def test_tiny_gaussian_run_writes_its_own_table(tmp_path, load_benchmark):
    module = load_benchmark("hmc_trajectory")
    argv = ["--dataset", "gaussian", "--splits", "0,1", "--option", "num_samples=20", "--option", "num_warmup=20"]
    rows = module.main([*argv, "--out", str(tmp_path)])
    assert list(rows.split) == [0, 1] and (rows.draws == 20).all()  # one chain per seed, as the mixing test
    assert ((rows.trajectory - rows.step_size * rows.n_steps_mean).abs() < 1e-9).all()
    assert ((rows.ess_min > 0) & (rows.ess_min <= 20 * 4)).all()  # ArviZ's bulk ESS of 20 draws
    text = (tmp_path / "trajectory_gaussian.md").read_text()
    assert "# HMC on the exact Gaussian posterior" in text and "| hmc | defaults | 1 |" in text
