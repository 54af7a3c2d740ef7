"""Batched chains (bnn_pyro/infer/_batched.py, _analytic_batched.py, _vectorized.py, _one_chain.py).

- ``hmc_transition`` on MANY chains at once: 4,000 exact draws of a correlated 3-D Gaussian, ONE transition each
  (fixed step sizes, no adaptation). A correct kernel leaves the target invariant, so the results are again 4,000
  independent exact draws: each mean coordinate, covariance entry and the fraction below each exact median has a
  z-score ``(estimate - exact) / (exact sd / sqrt(n))`` (covariance: ``sd = sqrt(S_ii S_jj + S_ij^2)``; median
  fraction: ``sd = 1/2``), standard normal by the CLT; ``|z| < 4`` fails with probability ~6e-5 each.
- ``StackPotential.leapfrog_batch`` equals C unbatched ``leapfrog`` calls (float64, 1e-12).
- ``bp.fit(method="hmc", chain_method="vectorized")`` and the default flat single-chain HMC recover the exact BLR
  posterior (MCSE z-scores of test_mcmc.py); checkpoint/resume is bit-identical; bad input is refused clearly.
"""

import math

import arviz as az
import pyro
import pytest
import torch
from test_mcmc import SIGMA, _assert_exact, _blr, _data
from test_mcmc_hmc_flat import _assert_origins_match_steps, _spy_aims
from test_nuts import _one_input_net, _three_input_net

import bnn_pyro as bp
from bnn_pyro.infer import _kernels, _logjoint, _one_chain
from bnn_pyro.infer import checkpoint as ckpt_mod
from bnn_pyro.infer._analytic_batched import OneChain, leapfrog_from
from bnn_pyro.infer._batched import hmc_transition
from bnn_pyro.infer._common import quiet_model

N = 4000
MEAN = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
A = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [-0.5, 0.3, 0.4]], dtype=torch.float64)
COV = (
    A
    @ A.T
    * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    .sqrt()
    .outer(torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64).sqrt())
)  # correlations up to ~0.8, unequal scales
PREC = torch.linalg.inv(COV)


def _gaussian(theta):
    d = theta - MEAN
    grad = d @ PREC
    return 0.5 * (d * grad).sum(-1), grad


def _iid_z(w: torch.Tensor) -> dict[str, float]:
    n, z = w.shape[0], {}
    for i in range(3):
        sd = COV[i, i].sqrt()
        z[f"mean[{i}]"] = float((w[:, i].mean() - MEAN[i]) / (sd / math.sqrt(n)))
        z[f"below median[{i}]"] = float(((w[:, i] < MEAN[i]).double().mean() - 0.5) / (0.5 / math.sqrt(n)))
    d = w - MEAN
    for i in range(3):
        for j in range(i, 3):
            sd = math.sqrt(COV[i, i] * COV[j, j] + COV[i, j] ** 2)
            z[f"cov[{i},{j}]"] = float(((d[:, i] * d[:, j]).mean() - COV[i, j]) / (sd / math.sqrt(n)))
    return z


@pytest.mark.parametrize("mass", ["identity", "diagonal", "dense"])
@pytest.mark.parametrize("length", ["num_steps", "trajectory_length"])
def test_one_hmc_transition_keeps_4000_exact_draws_exact(mass, length):
    g = torch.Generator().manual_seed(0)
    start = MEAN + torch.randn(N, 3, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(COV).T
    minv = {
        "identity": torch.ones(3, dtype=torch.float64),
        "diagonal": 2.0 * COV.diagonal(),
        "dense": 1.5 * (torch.eye(3, dtype=torch.float64) + 0.2 * torch.ones(3, 3, dtype=torch.float64)) @ COV,
    }[mass]
    minv = minv.expand(N, *minv.shape).contiguous()
    if mass == "dense":
        minv = 0.5 * (minv + minv.mT)
    # a step size per chain, drawn independently of the state (each chain's kernel keeps the target invariant),
    # between 20% and 90% of the leapfrog's stability limit 2 / sqrt(largest eigenvalue of M^-1 P)
    dense = minv[0] if minv.dim() == 3 else minv[0].diag()
    limit = 2.0 / float(torch.linalg.eigvals(dense @ PREC).real.max().sqrt())
    step = limit * (0.2 + 0.7 * torch.rand(N, generator=g, dtype=torch.float64))
    options = dict(num_steps=6) if length == "num_steps" else dict(trajectory_length=1.2)
    u, grad = _gaussian(start)
    z, u1, g1, stats = hmc_transition(
        start, u, grad, step, minv, leapfrog=leapfrog_from(_gaussian), generator=g, **options
    )
    moved = (z != start).any(1).double().mean()
    assert 0.3 < moved < 1.0  # proposals were made, and some rejected
    u_ref, g_ref = _gaussian(z)  # the potential and gradient returned are those of the returned position
    torch.testing.assert_close(u1, u_ref)
    torch.testing.assert_close(g1, g_ref)
    expected_steps = 6 if length == "num_steps" else (1.2 / step).floor().clamp(min=1)
    assert torch.equal(stats.n_steps.double(), torch.as_tensor(expected_steps, dtype=torch.float64).expand(N))
    assert not stats.diverging.any() and ((stats.accept_prob >= 0) & (stats.accept_prob <= 1)).all()
    # the energy after the momentum refresh: U plus a kinetic energy p . M^-1 p / 2 with p ~ N(0, M), i.e. half a
    # chi-square with 3 degrees of freedom (mean 3/2, variance 3/2) whatever the mass matrix
    kinetic = stats.energy - u
    scores = _iid_z(z)
    scores["kinetic"] = float((kinetic.mean() - 1.5) / math.sqrt(1.5 / N))
    bad = {k: round(v, 2) for k, v in scores.items() if not abs(v) < 4.0}
    assert not bad, f"one HMC transition moved exact draws off the target: {bad}"


def test_a_diverging_transition_is_flagged_and_rejected_not_raised():
    g = torch.Generator().manual_seed(1)
    start = MEAN + torch.randn(50, 3, generator=g, dtype=torch.float64)
    u, grad = _gaussian(start)
    step = torch.full((50,), 40.0, dtype=torch.float64)  # far past the stability limit: the energy explodes
    z, u1, _, stats = hmc_transition(
        start,
        u,
        grad,
        step,
        torch.ones(50, 3, dtype=torch.float64),
        leapfrog=leapfrog_from(_gaussian),
        generator=g,
        num_steps=10,
    )
    assert stats.diverging.all() and torch.equal(z, start) and torch.equal(u1, u)
    assert (stats.accept_prob == 0).all()
    with pytest.raises(ValueError, match="num_steps= or trajectory_length="):
        hmc_transition(
            start, u, grad, step, torch.ones(50, 3, dtype=torch.float64), leapfrog=leapfrog_from(_gaussian), generator=g
        )


# ---------------------------------------------------------------------- the batched analytic leapfrog
@pytest.mark.parametrize(
    "net, noise, d, bayesian",
    [
        (_one_input_net, "fixed", 1, "all"),  # one input: the first layer is an outer product
        (_three_input_net, "sigma", 3, "all"),  # a learned noise; the net ends with an activation
        (_three_input_net, "fixed", 3, "weights"),  # deterministic biases: constants in the stack
    ],
)
@pytest.mark.parametrize("dense", [False, True])
def test_leapfrog_batch_equals_separate_unbatched_leapfrogs(net, noise, d, bayesian, dense):
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(20, d, generator=g)
        y = torch.sin(x.sum(1)) + 0.1 * torch.randn(20, generator=g)
        likelihood = bp.likelihoods.Gaussian(scale=0.3 if noise == "fixed" else pyro.distributions.HalfNormal(1.0))
        model = bp.BNN(net(), prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood, bayesian=bayesian)
        init, _, _, _ = pyro.infer.mcmc.util.initialize_model(lambda: quiet_model(model, 20)(x, y), model_args=())
        names, shapes, _ = _one_chain.flat_layout(init)
        pot = _logjoint.analytic(_logjoint.build(model, 20), names, shapes, x, y)
        size, chains = sum(v.numel() for v in init.values()), 5
        z, p = torch.randn(chains, size, generator=g), torch.randn(chains, size, generator=g)
        step = torch.tensor([0.01, -0.02, 0.03, -0.01, 0.05])  # signed: the sign is the direction
        a = torch.randn(chains, size, size, generator=g)
        minv = a @ a.mT / size + torch.eye(size) if dense else torch.rand(chains, size, generator=g) + 0.5
        u0, g0 = pot.batch(chains)(z)
        u_gen, g_gen = pot(z)  # the general (C, D) path agrees with the bound batch
        torch.testing.assert_close(u0, u_gen, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g0, g_gen, rtol=1e-12, atol=1e-12)
        batched = pot.leapfrog_batch(z, p, g0, step, minv)
        generic = leapfrog_from(pot)(z, p, g0, step, minv)  # the generic step on the general potential
        for found, expected in zip(batched, generic):
            torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)
        for c in range(chains):
            zc, pc, gc, sharp, (uc, kinetic) = pot.leapfrog(z[c], p[c], pot(z[c])[1], float(step[c]), minv[c])
            for found, expected in zip(batched[:4], (zc, pc, gc, sharp)):
                torch.testing.assert_close(found[c], expected, rtol=1e-12, atol=1e-12)
            assert float(batched[4][c]) == pytest.approx(uc, rel=1e-12, abs=1e-12)
            assert float(batched[5][c]) == pytest.approx(kinetic, rel=1e-12, abs=1e-12)
            # FlatHMC's one-chain step (the unbatched bound-data step behind the batched interface)
            one = OneChain(pot)(z[c : c + 1], p[c : c + 1], g0[c : c + 1], step[c : c + 1], minv[c : c + 1])
            for found, expected in zip(one, batched):
                torch.testing.assert_close(found, expected[c : c + 1], rtol=1e-12, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


# ---------------------------------------------------------------------- fits
VEC = dict(method="hmc", chain_method="vectorized", num_chains=4, num_leapfrog=4, progress=False)


def test_vectorized_hmc_recovers_the_exact_posterior_with_the_other_executions_shapes():
    x, y = _data(2)
    post = bp.fit(_blr(2), x, y, num_samples=500, num_warmup=300, seed=2, **VEC)
    _assert_exact(post, x, y)
    assert post.config["chain_execution"] == "vectorized" and post.config["chain_method"] == "vectorized"
    other = bp.fit(
        _blr(2),
        x,
        y,
        method="hmc",
        num_chains=2,
        num_leapfrog=4,
        num_samples=5,
        num_warmup=5,
        seed=2,
        chain_method="sequential",
        progress=False,
    )
    assert set(post.sample_stats) == set(other.sample_stats)
    for name, value in post.sample_stats.items():
        assert value.shape == (4, 500) and value.dtype == other.sample_stats[name].dtype, name
    assert post.samples["weight"].shape == (4, 500, 1, 2) and post.samples["bias"].shape == (4, 500, 1)
    mass = post.history["inverse_mass_matrix"]
    assert mass.shape == (4, 3) and (mass > 0).all() and not torch.equal(mass[0], mass[1])  # adapted per chain
    counts = post.sample_stats["n_steps"]  # jittered per chain and draw within 4 +- 50%: chains of unequal lengths
    assert ((counts >= 2) & (counts <= 6)).all() and (counts != counts[:1]).any(dim=0).float().mean() > 0.5
    steps = post.sample_stats["step_size"]
    assert len(set(steps[:, -1].tolist())) == 4 and torch.equal(steps, steps[:, :1].expand_as(steps))


@pytest.mark.slow  # ~11 s on a loaded 2-core machine
def test_vectorized_nuts_recovers_the_exact_posterior():
    x, y = _data(2)
    post = bp.fit(
        _blr(2),
        x,
        y,
        **dict(
            {k: v for k, v in VEC.items() if k != "num_leapfrog"},
            method="nuts",
            num_samples=400,
            num_warmup=200,
            seed=1,
        ),
    )
    assert post.config["chain_execution"] == "vectorized" and post.sample_stats["tree_depth"].shape == (4, 400)
    _assert_exact(post, x, y)


def test_vectorized_same_seed_same_draws_and_dense_mass():
    x, y = _data(2)
    runs = [bp.fit(_blr(2), x, y, num_samples=20, num_warmup=30, seed=3, dense_mass=True, **VEC) for _ in range(2)]
    for name in runs[0].samples:
        assert torch.equal(runs[0].samples[name], runs[1].samples[name])
    assert runs[0].history["inverse_mass_matrix"].shape == (4, 3, 3)


@pytest.mark.slow  # ~10 s on a loaded 2-core machine
def test_default_flat_single_chain_hmc_recovers_the_exact_posterior(monkeypatch):
    used = []
    original = _one_chain.FlatHMC.setup
    monkeypatch.setattr(_one_chain.FlatHMC, "setup", lambda self, *a, **k: used.append(1) or original(self, *a, **k))
    x, y = _data(2)
    post = bp.fit(
        _blr(2), x, y, method="hmc", num_samples=600, num_warmup=300, num_chains=1, seed=0, progress=False
    )  # defaults otherwise
    assert used and post.config["fast_path"] is True
    steps, count = post.sample_stats["n_steps"], bp.infer.mcmc.DEFAULT_NUM_LEAPFROG  # jittered: count +- 50%
    assert ((steps >= count // 2) & (steps <= count * 3 // 2)).all() and len(steps.unique()) > 1
    # the exactness check is informative only with a fair ESS, so that is checked first
    weights = post.samples["weight"].reshape(1, 600, 2).numpy()
    assert min(float(az.ess(weights[..., i])) for i in range(2)) > 100
    _assert_exact(post, x, y)


def test_pyros_hmc_runs_without_the_fast_path(monkeypatch):
    used = []
    original = _kernels.PyroHMC.setup
    monkeypatch.setattr(_kernels.PyroHMC, "setup", lambda self, *a, **k: used.append(1) or original(self, *a, **k))
    x, y = _data(2)
    bp.fit(
        _blr(2),
        x,
        y,
        method="hmc",
        num_chains=1,
        num_samples=3,
        num_warmup=3,
        num_leapfrog=2,
        progress=False,
        fast_path=False,
    )
    assert used


@pytest.mark.parametrize("method", ["hmc", "nuts"])
def test_vectorized_checkpoint_resume_is_bit_identical(tmp_path, monkeypatch, method):
    x, y = _data(2)
    config = dict(VEC, num_samples=8, num_warmup=12, seed=4)
    if method == "nuts":
        del config["num_leapfrog"]
        config.update(method="nuts", max_tree_depth=4)
    whole = bp.fit(_blr(2), x, y, **config)
    original = ckpt_mod.Checkpoint.save
    # the run dies when saving after `crash` iterations: mid-warm-up (the checkpoint at 5 is inside the mass-matrix
    # window) or mid-sampling (the checkpoint at 15 holds kept draws)
    for crash, resumed_from in ((10, 5), (20, 15)):
        folder = tmp_path / str(crash)
        folder.mkdir()

        def save(ckpt, step, *args, crash=crash):
            if step == crash:
                raise RuntimeError(f"crash at {step}")
            return original(ckpt, step, *args)

        with monkeypatch.context() as m:
            m.setattr(ckpt_mod.Checkpoint, "save", save)
            with pytest.raises(RuntimeError, match="crash"):
                bp.fit(_blr(2), x, y, checkpoint=folder, checkpoint_every=5, **config)
        assert sorted(p.name for p in folder.iterdir()) == [
            ".lock",
            "chain0.ckpt",
            "identity.ckpt",
        ]  # one for the batch
        assert ckpt_mod.read(folder / "chain0.ckpt")[1]["step"] == resumed_from
        resumed = bp.fit(_blr(2), x, y, checkpoint=folder, checkpoint_every=5, resume=True, **config)
        for group in ("samples", "sample_stats", "history"):
            for name, value in getattr(whole, group).items():
                assert torch.equal(getattr(resumed, group)[name], value), (crash, group, name)
        # HMC's record of where each chain's step came from, read from the window's pairs the checkpoint kept
        assert resumed.config.get("step_size_origin") == whole.config.get("step_size_origin"), crash
    # a sequential run's files are not a vectorized run's (its draws differ)
    folder = tmp_path / "sequential"
    folder.mkdir()
    bp.fit(_blr(2), x, y, checkpoint=folder, **dict(config, chain_method="sequential"))
    with pytest.raises(ckpt_mod.CheckpointError, match="chain_execution"):
        bp.fit(_blr(2), x, y, checkpoint=folder, resume=True, **config)


def test_vectorized_extends_a_posterior_without_warmup():
    x, y = _data(2)
    first = bp.fit(_blr(2), x, y, num_samples=10, num_warmup=40, seed=0, **VEC)
    more = bp.fit(_blr(2), x, y, resume=first, num_samples=6, seed=9, **VEC)
    assert more.num_draws == 16 and more.config["extended_by"] == 6
    for name, value in first.samples.items():
        assert torch.equal(more.samples[name][:, :10], value)
    assert torch.equal(more.sample_stats["step_size"][:, 10:], first.sample_stats["step_size"][:, -1:].expand(4, 6))
    assert torch.equal(more.history["inverse_mass_matrix"], first.history["inverse_mass_matrix"])
    assert more.config["step_size_origin"] == first.config["step_size_origin"]  # the extended chains' steps


def test_vectorized_hmc_records_which_rule_gave_each_chains_step(monkeypatch):
    """``config["step_size_origin"]``: one per chain, each the rule of the aimed step it runs at (review 21 finding
    5; the one-chain kernels' case: tests/infer/test_mcmc_hmc_flat.py); NUTS, which does not aim, records none."""
    seen = _spy_aims(monkeypatch)
    x, y = _data(2)
    post = bp.fit(_blr(2), x, y, num_samples=4, num_warmup=40, seed=0, **VEC)
    assert len(post.config["step_size_origin"]) == 4
    _assert_origins_match_steps(post, seen)
    nuts = dict({k: v for k, v in VEC.items() if k != "num_leapfrog"}, method="nuts", max_tree_depth=3)
    assert "step_size_origin" not in bp.fit(_blr(2), x, y, num_samples=4, num_warmup=10, **nuts).config


def test_one_progress_bar_for_all_vectorized_chains(capfd):
    x, y = _data(2)
    bp.fit(_blr(2), x, y, **dict(VEC, progress=True, num_samples=3, num_warmup=3))
    err = capfd.readouterr().err
    assert "hmc chains 0-3:" in err and "hmc chain 1" not in err


def test_vectorized_refuses_what_it_cannot_run():
    x, y = _data(2)
    with pytest.raises(
        ValueError,
        match="chain_method='vectorized' applies to method='nuts' and 'hmc' only, not "
        "'metropolis'.*chain_method='auto'",
    ):
        bp.fit(_blr(2), x, y, method="metropolis", chain_method="vectorized", num_chains=2, progress=False)
    with pytest.raises(ValueError, match="chain_method='vectorized' needs the fast path.*fast_path=True"):
        bp.fit(_blr(2), x, y, fast_path=False, **VEC)
    laplace = bp.BNN(
        torch.nn.Linear(2, 1), prior=bp.priors.Laplace(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=SIGMA)
    )
    with pytest.raises(ValueError, match="chain_method='vectorized' needs the analytic potential.*chain_method='auto'"):
        bp.fit(laplace, x, y, **VEC)
    with pytest.raises(ValueError, match="chain_method: unknown value"):
        bp.fit(_blr(2), x, y, **dict(VEC, chain_method="vectorised"))
