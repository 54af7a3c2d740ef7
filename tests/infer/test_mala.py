"""MALA (bnn_pyro/infer/mala.py): exact on Bayesian linear regression at the defaults, bit-identical resume after a
crash, its options and statistics. Checkpoint/resume, determinism and stream refusal are also in the engine
matrix (tests/infer/test_engine_matrix.py), which runs every registered method."""

from __future__ import annotations

import pytest
import torch
from test_mcmc import _assert_exact, _blr, _data

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod


@pytest.fixture(scope="module")
def default_fit():
    x, y = _data(2)
    return x, y, bp.fit(_blr(2), x, y, method="mala", seed=0, progress=False)  # the defaults: 4 x (1000 + 1000)


def test_mala_defaults_recover_the_exact_posterior(default_fit):
    x, y, post = default_fit
    assert post.method == "mala" and post.num_chains == 4 and post.num_draws == 1000
    assert post.config["target_accept"] == 0.574 and post.config["kernel"] == "mala"
    _assert_exact(post, x, y)  # every mean and covariance entry within 4 MCSE (ESS over the chains; tests/blr.py)
    # adapted, neither stuck nor a random walk of tiny steps; the kept draws use dual averaging's averaged step,
    # which errs toward a higher acceptance than the target (as Stan's NUTS at 0.8 accepts ~0.85-0.9)
    accept = post.sample_stats["acceptance_rate"].double().mean(1)
    assert ((accept > 0.45) & (accept < 0.85)).all(), accept
    steps = post.sample_stats["step_size"]
    assert torch.equal(steps, steps[:, :1].expand_as(steps)) and len(set(steps[:, 0].tolist())) == 4
    assert post.history["inverse_mass_matrix"].shape == (4, 3)  # the diagonal metric adapted per chain


def test_mala_sample_stats_reach_arviz_under_their_names(default_fit):
    post = default_fit[2]
    assert set(post.sample_stats) == {"lp", "acceptance_rate", "step_size"}
    idata = post.to_inference_data()
    assert {"lp", "acceptance_rate", "step_size"} <= set(idata.sample_stats.data_vars)
    assert idata.posterior["weight"].shape[:2] == (4, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("fast_path", [True, False])
def test_mala_with_a_dense_metric_recovers_the_exact_posterior(fast_path):
    x, y = _data(3, seed=1)
    post = bp.fit(
        _blr(3),
        x,
        y,
        method="mala",
        dense_mass=True,
        num_samples=1500,
        num_warmup=500,
        num_chains=2,
        fast_path=fast_path,
        seed=2,
        progress=False,
    )
    assert post.config["fast_path"] == fast_path and post.history["inverse_mass_matrix"].shape == (2, 4, 4)
    _assert_exact(post, x, y)


@pytest.mark.parametrize("crash, resumed_from", [(10, 5), (20, 15)], ids=["mid_warmup", "mid_sampling"])
def test_mala_resumed_run_is_bit_identical(crash, resumed_from, tmp_path, monkeypatch):
    x, y = _data(2)
    run = dict(method="mala", num_warmup=12, num_samples=8, num_chains=1, seed=4, progress=False)
    whole = bp.fit(_blr(2), x, y, **run)
    original = ckpt_mod.Checkpoint.save

    def save(ckpt, step, *args):
        if step == crash:
            raise RuntimeError(f"killed at {step}")
        return original(ckpt, step, *args)

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.Checkpoint, "save", save)
        with pytest.raises(RuntimeError, match=f"killed at {crash}"):
            bp.fit(_blr(2), x, y, checkpoint=tmp_path, checkpoint_every=5, **run)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == resumed_from
    resumed = bp.fit(_blr(2), x, y, checkpoint=tmp_path, checkpoint_every=5, resume=True, **run)
    for group in ("samples", "sample_stats", "history"):
        assert set(getattr(resumed, group)) == set(getattr(whole, group))
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)


def test_mala_extends_a_posterior_without_warmup():
    x, y = _data(2)
    first = bp.fit(_blr(2), x, y, method="mala", num_samples=20, num_warmup=40, num_chains=2, seed=0, progress=False)
    more = bp.fit(_blr(2), x, y, method="mala", resume=first, num_samples=10, seed=1, progress=False)
    assert more.num_draws == 30 and torch.equal(more.samples["weight"][:, :20], first.samples["weight"])
    assert torch.equal(more.sample_stats["step_size"][:, 20:], first.sample_stats["step_size"][:, -1:].expand(2, 10))


def test_mala_options_are_exactly_the_mcmc_ones():
    mala = bp.infer.options("mala")
    assert mala["target_accept"] == 0.574 and mala["num_chains"] is None and mala["dense_mass"] is False
    assert set(mala) == set(bp.infer.options("metropolis"))
    x, y = _data(2)
    with pytest.raises(TypeError, match=r"num_leapfrog: not an option of method='mala'.*\(hmc\)"):
        bp.fit(_blr(2), x, y, method="mala", num_leapfrog=3)


def test_mala_is_subspace_inference_s_inner_engine_by_its_declaration():
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.2))
    x = torch.linspace(-2, 2, 40)[:, None]
    post = bp.fit(
        model,
        x,
        torch.sin(x[:, 0]),
        method="subspace",
        inner="mala",
        subspace_dim=2,
        num_samples=4,
        inner_options=dict(num_warmup=4),
        swa=dict(pretrain_steps=6, num_steps=6, collect_every=2, rank=2),
        progress=False,
    )
    assert post.config["inner_config"]["kernel"] == "mala" and post.num_draws == 4
    assert post.samples["0.weight"].shape[:2] == (1, 4)
