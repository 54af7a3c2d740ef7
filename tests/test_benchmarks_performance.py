"""The speed benchmarks' hand-written baselines compute what they claim (the ELBO, the MLP, the
predictive moments), so a ratio against them compares equal work; and their tables and options
behave. The scripts are imported from benchmarks/ (no package), which is put on sys.path for this
module only."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

_BENCH = str(Path(__file__).resolve().parents[1] / "benchmarks")
_NAMES = ("_common", "baselines", "numpyro_peer", "performance", "predict")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, _BENCH)
    try:
        yield {name: importlib.import_module(name) for name in _NAMES}
    finally:
        sys.path.remove(_BENCH)
        for name in _NAMES:
            sys.modules.pop(name, None)


def _flat(net) -> torch.Tensor:
    return torch.cat([torch.cat([m.weight.flatten(), m.bias]) for m in net if isinstance(m, torch.nn.Linear)]).detach()


def _net_at(net, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``net``'s output at ``x`` with its parameters replaced by the flat vector ``w`` (layer order)."""
    params, start = {}, 0
    for name, p in net.named_parameters():
        params[name] = w[start : start + p.numel()].view_as(p)
        start += p.numel()
    return torch.func.functional_call(net, params, (x,))[:, 0]


def test_flat_forward_is_the_mlp_for_one_and_several_draws(bench):
    common, baselines = bench["_common"], bench["baselines"]
    net = common.mlp(3, width=7, depth=2).double()
    x = torch.randn(11, 3, dtype=torch.float64)
    shapes = common.layer_shapes(3, 7, 2)
    w = _flat(net) + 0.3 * torch.randn(4, _flat(net).numel(), dtype=torch.float64)
    assert torch.allclose(baselines._forward(w[:1], x, shapes)[0], _net_at(net, w[0], x), atol=1e-12)
    several = baselines._forward(w, x, shapes)  # the batched (baddbmm) path
    for p in range(4):
        assert torch.allclose(several[p], _net_at(net, w[p], x), atol=1e-12)


@pytest.mark.parametrize("kl", ["analytic", "mc"])
def test_negative_elbo_is_the_negative_elbo_without_the_likelihood_constant(bench, kl):
    common, baselines = bench["_common"], bench["baselines"]
    Normal = torch.distributions.Normal
    net = common.mlp(2, width=5).double()
    shapes, d = common.layer_shapes(2, 5), _flat(net).numel()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 2, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    mu, rho = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64) - 2
    eps = torch.randn(3, d, generator=g, dtype=torch.float64)
    got = baselines.negative_elbo(mu, rho, eps, x, y, shapes, kl)
    scale = torch.nn.functional.softplus(rho)
    w = mu + scale * eps
    nll = torch.stack([-Normal(_net_at(net, w[p], x), common.SIGMA).log_prob(y).sum() for p in range(3)]).mean()
    constant = len(y) * (math.log(common.SIGMA) + 0.5 * math.log(2 * math.pi))
    if kl == "analytic":
        div = torch.distributions.kl_divergence(Normal(mu, scale), Normal(0.0, 1.0)).sum()
    else:
        div = torch.stack(
            [Normal(mu, scale).log_prob(w[p]).sum() - Normal(0.0, 1.0).log_prob(w[p]).sum() for p in range(3)]
        ).mean()
    assert torch.allclose(got, nll - constant + div, rtol=1e-12)


def test_predict_loop_gives_the_moments_of_all_draws_at_once(bench):
    common, baselines = bench["_common"], bench["baselines"]
    g = torch.Generator().manual_seed(1)
    layers = [
        (torch.randn(13, 6, 2, generator=g, dtype=torch.float64), torch.randn(13, 6, generator=g, dtype=torch.float64)),
        (torch.randn(13, 1, 6, generator=g, dtype=torch.float64), torch.randn(13, 1, generator=g, dtype=torch.float64)),
    ]
    x = torch.randn(17, 2, generator=g, dtype=torch.float64)
    mean, std = baselines.predict_loop(layers, x, chunk=4)  # 13 draws: the last chunk is short
    f = torch.from_numpy(common.forward_draws([(w[None].numpy(), b[None].numpy()) for w, b in layers], x.numpy()))[0]
    exact = torch.stack(
        [torch.tanh(x @ layers[0][0][s].T + layers[0][1][s]) @ layers[1][0][s].T + layers[1][1][s] for s in range(13)]
    )[..., 0]
    assert torch.allclose(f, exact, atol=1e-12)  # forward_draws (numpy, for ESS) is the same MLP
    assert torch.allclose(mean, exact.mean(0), atol=1e-12)
    assert torch.allclose(std, (exact.var(0, unbiased=False) + common.SIGMA**2).sqrt(), atol=1e-12)


def test_predict_benchmark_loop_and_posterior_predict_compute_the_same_moments(bench):
    # benchmarks/predict.py's per-draw loop is the baseline of Posterior.predict: the same mean and std
    common, predict = bench["_common"], bench["predict"]
    import bnn_pyro as bp

    model = common.bnn(1, width=6)
    g = torch.Generator().manual_seed(1)
    samples = {n: torch.randn((1, 13) + s, generator=g) for n, s in model.param_shapes.items()}
    x = torch.randn(17, 1, generator=g)
    mean, std = predict.loop([(samples[f"{i}.weight"][0], samples[f"{i}.bias"][0]) for i in (0, 2)], x)
    pred = bp.Posterior(samples=samples, model=model, method="svi").predict(x)
    torch.testing.assert_close(mean, pred.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std, pred.std, rtol=1e-4, atol=1e-5)  # sum of squares vs two-pass variance


def test_summary_compares_each_side_at_its_best_and_at_its_default_threads(bench):
    table = pd.DataFrame(
        [
            dict(group="svi", role="baseline", threads=1, user_default=False, value=2.0, unit="ms/step"),
            dict(group="svi", role="baseline", threads=2, user_default=True, value=8.0, unit="ms/step"),
            dict(group="svi", role="ours", threads=1, user_default=True, value=3.0, unit="ms/step"),
            dict(group="svi", role="ours", threads=2, user_default=False, value=6.0, unit="ms/step"),
            dict(group="svi", role="other", threads=1, user_default=True, value=0.5, unit="ms/step"),
            dict(
                group="chains x2", role="ours", threads=1, user_default=True, value=30.0, unit="chains x iterations/s"
            ),
            dict(
                group="chains x2",
                role="baseline",
                threads=1,
                user_default=True,
                value=10.0,
                unit="chains x iterations/s",
            ),
            dict(
                group="chains x2",
                role="baseline",
                threads=1,
                user_default=False,
                value=60.0,
                unit="chains x iterations/s",
            ),
        ]
    )
    out = bench["performance"].summary(table).set_index("workload")
    assert out.loc["svi", "ratio at best"] == pytest.approx(3.0 / 2.0)  # lower is better: each side's minimum
    assert out.loc["svi", "ratio at defaults"] == pytest.approx(3.0 / 8.0)
    assert out.loc["chains x2", "ratio at best"] == pytest.approx(30.0 / 60.0)  # a rate: each side's maximum
    assert out.loc["chains x2", "ratio at defaults"] == pytest.approx(30.0 / 10.0)


def test_bulk_ess_of_independent_draws_is_near_their_number(bench):
    draws = np.random.default_rng(0).standard_normal((1, 400, 3))
    assert 300 < bench["_common"].bulk_ess(draws) < 530  # independent draws: ESS ~ 400


def test_device_option_errors_name_the_option_and_what_to_try(bench):
    check = bench["_common"].check_device
    assert check("cpu") == "cpu"
    with pytest.raises(SystemExit, match="--device: expected a torch device such as cpu or cuda"):
        check("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device.*use --device cpu"):
            check("cuda")
