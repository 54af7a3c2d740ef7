"""Tests for bnn_pyro/tools/compression.py: bit precision from posterior variances, and what sparse VD compresses.

The bit rule is checked exactly on a hand-made posterior whose draws have known sample means and sds
(``mu + sigma z`` with ``z`` standardized to sample mean 0 and sample sd 1), and as invariants on
fitted posteriors of the three supported engines at their defaults. Two properties on 8x8 digits
(500 training images, a 64-32-10 ReLU MLP, sparse_vd at its defaults except ``num_steps=500``; slow,
about 25 s per fit on a loaded 2-core machine, two fits shared by both tests):

- **Random labelling** (Molchanov et al. 2017, sec. "Random labeling"): on shuffled labels sparse VD
  removes (nearly) every weight and predicts a constant instead of memorizing. Measured, seeds 0, 1, 2:
  pruned fraction 0.9274 / 0.9223 / 0.9257 with the real labels and 0.9911 / 0.9924 / 0.9899 with
  shuffled ones (kept 172 / 184 / 176 vs 21 / 18 / 24 of 2,368 weights: 7.3-10.2x fewer); training
  accuracy 0.970 / 0.970 / 0.968 on real labels and 0.180 / 0.174 / 0.182 on shuffled ones (chance 0.1;
  memorizing means 1.0). Asserted: a difference in pruned fraction above 0.03 (half the smallest
  measured, 0.064), at least 3x fewer kept weights, shuffled training accuracy below 0.3 and real above 0.9.
- **Quantization keeps the accuracy**: the rounded posterior-mean net vs the posterior predictive on
  the 359 held-out digits. Measured, seeds 0, 1, 2: 0.9638 vs 0.9638, 0.9526 vs 0.9526, 0.9526 vs 0.9554
  (7 bits per layer; compression 63x / 59x / 62x vs float32). Asserted: at most 0.015 below (5 digits,
  against a largest measured drop of 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer.variational_dropout import sparsity_report
from bnn_pyro.tools.compression import quantization_report, quantize


def _exact_draws(mean: torch.Tensor, sd: torch.Tensor, num: int = 7, seed: int = 0) -> torch.Tensor:
    """Draws ``(1, num, *shape)`` whose sample mean is ``mean`` and sample sd (correction 1) ``sd``;
    where ``sd`` is 0 every draw is ``mean`` (0 for a pruned weight)."""
    z = torch.randn(num, *mean.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = (z - z.mean(0)) / z.std(0, correction=1)
    return (mean.double() + sd.double() * z).float().unsqueeze(0)


def _hand_made(method="sparse_vd", config=None):
    torch.manual_seed(0)
    model = bp.BNN(nn.Linear(3, 2), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    mean = torch.tensor([[0.76, -0.30, 0.0], [0.10, 0.0, 0.047]])
    sd = torch.tensor([[0.10, 0.02, 0.0], [0.05, 0.0, 0.20]])  # two pruned weights: 0 in every draw
    samples = {"weight": _exact_draws(mean, sd), "bias": _exact_draws(torch.tensor([0.5, -0.5]), torch.ones(2))}
    config = {"vd_weights": "weight"} if config is None else config
    return bp.Posterior(samples=samples, model=model, method=method, config=config), mean


def test_bit_rule_on_a_hand_made_posterior():
    """Retained: 4 weights; step = smallest sd 0.02; K = round(0.76 / 0.02) = 38 -> 1 + ceil(log2 39) = 7
    bits; compression 32 * 6 / (7 * 4). Rounded: 0.76, -0.30, 0.10, round(2.35) * 0.02 = 0.04."""
    post, mean = _hand_made()
    table = quantization_report(post)
    assert list(table.index) == ["weight", "all"]
    row = table.loc["weight"]
    assert (row["total"], row["kept"], row["bits"]) == (6, 4, 7)
    assert row["step"] == pytest.approx(0.02, rel=1e-6) and row["max_abs"] == pytest.approx(0.76, rel=1e-6)
    assert row["compression"] == pytest.approx(32 * 6 / (7 * 4))
    assert table.loc["all", "compression"] == pytest.approx(row["compression"])
    small = quantize(post)
    assert small.num_draws == 1 and small.config["quantized_bits"] == {"weight": [7]}
    expected = torch.tensor([[0.76, -0.30, 0.0], [0.10, 0.0, 0.04]])
    assert torch.allclose(small.samples["weight"][0, 0], expected, atol=1e-6)
    assert torch.allclose(small.samples["bias"][0, 0], torch.tensor([0.5, -0.5]), atol=1e-6)  # mean, unrounded
    assert small.predict(torch.eye(3)).probs.shape == (3, 2)


def test_bits_follow_the_range_over_the_smallest_sd():
    """Halving the smallest sd doubles K (38 -> 76): one more bit; a layer pruned away needs 0 bits."""
    post, _ = _hand_made()
    draws = post.samples["weight"][0]
    post.samples["weight"] = _exact_draws(draws.mean(0), draws.std(0) * 0.5)
    assert quantization_report(post).loc["weight", "bits"] == 1 + math.ceil(math.log2(77))
    post.samples["weight"] = torch.zeros_like(post.samples["weight"])
    row = quantization_report(post).loc["weight"]
    assert (row["kept"], row["bits"], row["compression"]) == (0, 0, math.inf)


def test_each_chain_gets_its_own_grid(tmp_path):
    """Two chains (restarts): chain 1 has every sd halved (8 bits) and one more weight pruned. The
    report gives the mean kept (3.5) and the largest bits (8); quantize rounds each chain on its own
    grid, and the result saves and loads like any posterior."""
    post, mean = _hand_made()
    second = mean.clone()
    second[1, 2] = 0.0
    sd = torch.tensor([[0.05, 0.01, 0.0], [0.025, 0.0, 0.0]])
    post.samples["weight"] = torch.cat([post.samples["weight"], _exact_draws(second, sd)])
    post.samples["bias"] = post.samples["bias"].expand(2, -1, -1)
    row = quantization_report(post).loc["weight"]
    assert (row["kept"], row["bits"]) == (3.5, 8) and row["step"] == pytest.approx(0.01, rel=1e-6)
    small = quantize(post)
    assert small.config["quantized_bits"] == {"weight": [7, 8]}
    assert torch.allclose(small.samples["weight"][1, 0], second, atol=1e-6)  # all on the 0.01 grid already
    again = bp.load(small.save(tmp_path / "small.bnn"), model=post.model)
    assert torch.equal(again.samples["weight"], small.samples["weight"])


def test_unsupported_posteriors_are_refused_with_the_supported_list():
    post, _ = _hand_made(method="nuts", config={})
    with pytest.raises(ValueError, match="sparse_vd, variational_dropout, svi"):
        quantization_report(post)
    post, _ = _hand_made(method="svi", config={"guide": "low_rank"})
    with pytest.raises(ValueError, match="guide='low_rank'"):
        quantize(post)
    post, _ = _hand_made()
    post.samples = {k: v[:, :1] for k, v in post.samples.items()}
    with pytest.raises(ValueError, match="at least 2 draws"):
        quantization_report(post)
    with pytest.raises(TypeError, match="posterior: expected a bnn_pyro.Posterior"):
        quantize({"weight": torch.zeros(3)})


@pytest.mark.parametrize(
    "method, config", [("sparse_vd", {}), ("variational_dropout", {}), ("svi", {"guide": "mean_field"})]
)
def test_supported_engines_at_their_defaults_round_within_half_a_posterior_sd(method, config):
    """Every engine's default draws and settings except a short run: each retained weight moves by at
    most half the grid step, hence by at most half its own posterior sd; the quantized net predicts."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(80, 2, generator=g) * 4 - 2
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(80, generator=g)
    torch.manual_seed(0)
    model = bp.BNN(
        nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
    )
    post = bp.fit(model, x, y, method=method, num_steps=100, seed=0, progress=False, **config)
    table, small = quantization_report(post), quantize(post)
    assert list(table.index) == ["0.weight", "2.weight", "all"]
    for name in ("0.weight", "2.weight"):
        draws = post.samples[name][0]
        kept = (draws != 0).any(0)
        error = (small.samples[name][0, 0] - draws.mean(0))[kept].abs()
        assert (error <= table.loc[name, "step"] / 2 * (1 + 1e-5)).all()
        assert (error <= draws.std(0)[kept] / 2 * (1 + 1e-5)).all()
        assert 2 <= table.loc[name, "bits"] < 32
    assert torch.isfinite(small.predict(x).mean).all()


# ------------------------------------------------------------------------------------------ digits (slow)
@pytest.fixture(scope="module")
def digits():
    x, y, x_test, y_test = bp.datasets.train_test_split(
        *bp.datasets.load_sklearn("digits"), test_fraction=0.2, seed=0, stratify=True
    )
    x, y = x[:500], y[:500]

    def fit(labels):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        model = bp.BNN(net, prior=bp.priors.LayerwiseNormal("radford"), likelihood=bp.likelihoods.Categorical())
        return bp.fit(model, x, labels, method="sparse_vd", num_steps=500, seed=0, progress=False)

    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    return dict(x=x, y=y, shuffled=shuffled, x_test=x_test, y_test=y_test, real=fit(y), random=fit(shuffled))


@pytest.mark.slow
def test_sparse_vd_prunes_more_when_the_labels_are_random(digits):
    real, random = sparsity_report(digits["real"]).loc["all"], sparsity_report(digits["random"]).loc["all"]
    assert random["sparsity"] - real["sparsity"] > 0.03
    assert random["kept"] * 3 <= real["kept"]
    train_acc = lambda post, y: (post.predict(digits["x"], seed=0).predicted == y).float().mean().item()  # noqa: E731
    assert train_acc(digits["random"], digits["shuffled"]) < 0.3 < 0.9 < train_acc(digits["real"], digits["y"])


@pytest.mark.slow
def test_quantized_net_keeps_its_accuracy_on_digits(digits):
    post = digits["real"]
    x_test, y_test = digits["x_test"], digits["y_test"]
    accuracy = lambda p: (p.predict(x_test, seed=0).predicted == y_test).float().mean().item()  # noqa: E731
    table = quantization_report(post)
    assert (table.loc[["0.weight", "2.weight"], "bits"] < 32).all() and table.loc["all", "compression"] > 32
    assert accuracy(quantize(post)) >= accuracy(post) - 0.015


def test_a_quantized_posterior_matches_a_dataframes_columns_by_name_as_its_source():
    """A posterior fitted on a DataFrame matches a DataFrame given to predict by column name; its quantized copy
    kept no names and read a reordered frame by position (found by review)."""
    import pandas as pd

    post, _ = _hand_made()
    post.feature_names = ["a", "b", "c"]
    small = quantize(post)
    frame = pd.DataFrame(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).numpy(), columns=["a", "b", "c"])
    assert torch.equal(small.predict(frame[["c", "a", "b"]]).probs, small.predict(frame).probs)
