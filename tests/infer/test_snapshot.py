"""Snapshot ensembles (bnn_pyro/infer/snapshot.py): the cosine warm-restart schedule step by step, one
snapshot per cycle, the held-out noise, checkpoint/resume, bad options, and a real spread at the defaults."""

from __future__ import annotations

import math

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer.snapshot import snapshot_plan


def _mlp(hidden: int = 8, likelihood=None) -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood or bp.likelihoods.Gaussian(scale=0.1))


def _toy(n: int = 37):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g)


def _cosine(t: int, length: int) -> float:
    """Huang et al. (2017), eq. 2: alpha(t) = alpha_0 / 2 (cos(pi mod(t, K) / K) + 1), t counted from 0."""
    return 0.5 * (math.cos(math.pi * (t % length) / length) + 1.0)


def test_a_given_lr_follows_the_cosine_restart_schedule_exactly():
    x, y = _toy()
    lr, cycles, length = 0.002, 3, 10
    post = bp.fit(
        _mlp(), x, y, method="snapshot", lr=lr, num_cycles=cycles, cycle_length=length, seed=0, progress=False
    )
    steps = post.history["step_size"][0]
    expected = torch.tensor([lr / len(x) * _cosine(t, length) for t in range(cycles * length)], dtype=steps.dtype)
    assert steps.shape == (cycles * length,)
    assert torch.allclose(steps, expected, rtol=1e-12, atol=0), (steps, expected)
    # one snapshot per cycle, the iterate entering the cycle's last step: its potential and step are those
    last = torch.arange(length - 1, cycles * length, length)
    assert post.samples["0.weight"].shape == (1, cycles, 8, 1) and post.num_draws == cycles
    assert torch.equal(post.sample_stats["step_size"][0], steps[last])
    assert torch.equal(post.sample_stats["lp"][0], -post.history["potential"][0, last])
    assert post.config["num_cycles"] == cycles and post.config["cycle_length"] == length


def test_the_plan_has_no_noise_and_keeps_one_iterate_per_cycle():
    plan = snapshot_plan(num_cycles=4, cycle_length=250, friction=0.1)
    assert not plan.noisy.any() and plan.keep.sum() == 4
    assert plan.keep.nonzero().flatten().tolist() == [249, 499, 749, 999]
    early = [1, 2, 4, 5, 8, 11, 16, 22, 32, 45, 64, 90]  # the first cycle only: curvature grows fastest there
    assert plan.adapt.nonzero().flatten().tolist() == sorted(
        [0, *early, 100, 200, 250, 350, 450, 500, 600, 700, 750, 850, 950]
    )
    assert plan.fraction == (2 - 0.1) / 2 and plan.friction == 0.1  # csgmcmc's peak step


def test_auto_lr_keeps_the_cosine_shape_between_curvature_estimates():
    """At the default lr="auto" the peak step is re-estimated every 100 steps of a cycle; between two
    estimates the step is that peak times the cosine factor, exactly."""
    x, y = _toy()
    length = 150
    post = bp.fit(_mlp(), x, y, method="snapshot", num_cycles=2, cycle_length=length, seed=0, progress=False)
    steps = post.history["step_size"][0]
    cos = torch.tensor([_cosine(t, length) for t in range(2 * length)], dtype=steps.dtype)
    starts = [0, 1, 2, 4, 5, 8, 11, 16, 22, 32, 45, 64, 90, 100, 150, 250, 300]  # estimates, then the end
    for start, end in zip(starts, starts[1:]):
        peak = steps[start:end] / cos[start:end]
        assert torch.allclose(peak, peak[0].expand_as(peak), rtol=1e-12), (start, peak)
    assert post.config["lr"] == "auto" and (steps > 0).all()


def test_snapshots_differ_and_predict_averages_them():
    x, y = _toy()
    post = bp.fit(_mlp(), x, y, method="snapshot", num_cycles=3, cycle_length=60, seed=0, progress=False)
    w = post.samples["0.weight"][0]
    assert all(not torch.equal(w[i], w[j]) for i in range(3) for j in range(i + 1, 3))
    pred = post.predict(x)
    f = post.model.forward_draws({k: v[0] for k, v in post.samples.items()}, x)[..., 0]  # (snapshots, N)
    assert torch.allclose(pred.mean, f.mean(0), atol=1e-6)
    assert torch.allclose(pred.epistemic_std, f.std(0, unbiased=False), atol=1e-6)


def test_learned_noise_is_chosen_on_held_out_rows(monkeypatch):
    """As for the other point-fit engines: 10% of >= 200 rows held out, the noise set where the snapshot
    mixture predicts them best (bnn_pyro/infer/holdout.py), every training row kept in post.x."""
    x, y = _toy(n=240)
    model = _mlp(likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))
    from bnn_pyro.infer import snapshot

    final = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=50, seed=0, progress=False)
    assert final.config["validation"]["final_fit_rows"] == 240
    monkeypatch.setattr(
        snapshot, "refit", lambda post, again: post
    )  # the fit that chose, before holdout.refit fits every row again (tested in test_holdout.py)
    post = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=50, seed=0, progress=False)
    assert post.config["validation"] == {"rows": 24, "source": "split", "fraction": 0.1}
    assert final.config["noise"] == post.config["noise"]
    assert post.config["noise"]["selected_on"] == "validation"
    assert torch.equal(post.samples["sigma"], torch.full_like(post.samples["sigma"], post.config["noise"]["sigma"]))
    assert post.x.shape[0] == 240
    kept = bp.fit(
        model, x, y, method="snapshot", num_cycles=2, cycle_length=50, seed=0, progress=False, validation=None
    )
    assert "noise" not in kept.config and kept.config["validation"] == {"rows": 0}


@pytest.mark.parametrize(
    "held_out, length, every, crash_at",
    [
        (False, 15, 5, 25),
        (True, 60, 1, 62),  # 10% of 240 rows held out; the last save (61 steps done) follows cycle 1's unscored start
    ],
)
def test_resumed_run_is_bit_identical(crash_and_resume, held_out, length, every, crash_at):
    x, y = _toy(n=240 if held_out else 37)
    likelihood = bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)) if held_out else None
    config = dict(method="snapshot", num_cycles=2, cycle_length=length, batch_size=8, seed=3, progress=False)
    whole = bp.fit(_mlp(likelihood=likelihood), x, y, **config)
    assert ("exploration_stop" in whole.history) == held_out
    crash_and_resume(
        lambda **extra: bp.fit(_mlp(likelihood=likelihood), x, y, **extra, **config),
        whole,
        crash_at=crash_at,
        every=every,
    )


@pytest.mark.parametrize(
    "config, error, match",
    [
        (dict(num_cycles=0), ValueError, "num_cycles"),
        (dict(cycle_length=1), ValueError, r"cycle_length must be at least 2 .*default is 1000"),
        (dict(cycle_length=2.5), (TypeError, ValueError), "cycle_length"),
        (dict(friction=0.0), ValueError, r"friction must be a number in \(0, 1\]"),
        (dict(lr="fast"), ValueError, r"lr: unknown value 'fast'; pass a positive number \(e.g. 1e-2\) or 'auto'"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(validation=0.9), ValueError, r"validation: expected a fraction in \(0, 0.5\]"),
        (dict(num_samples=5), TypeError, r"num_samples: not an option of method='snapshot'"),
    ],
)
def test_bad_options_are_named(config, error, match):
    x, y = _toy()
    with pytest.raises(error, match=match):
        bp.fit(_mlp(), x, y, method="snapshot", progress=False, **config)


@pytest.mark.slow  # the defaults: 5,000 steps; ~25 s idle, 100-200 s on a 2-core machine shared by 8 jobs
def test_defaults_are_more_uncertain_in_the_gap_than_on_the_data():
    """Only ``method=`` changes (1-50-1 tanh net, known noise 0.1, the bundled gap data): the snapshots
    spread apart where there are no data (measured at seed 0: epistemic sd 0.090 in the gap, 0.033 on the
    clusters, 2.74x; NUTS 6.6x) and fit the data (RMSE 0.106; the noise is 0.1)."""
    x, y = bp.datasets.toy_gap()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    post = bp.fit(model, x, y, method="snapshot", seed=0, progress=False)
    assert post.num_chains == 1 and post.num_draws == 5 and post.config["cycle_length"] == 1000
    grid = torch.linspace(-2, 2, 401).reshape(-1, 1)
    sd = post.predict(grid, seed=0).epistemic_std
    on_data, gap = grid[:, 0].abs() >= 0.5, grid[:, 0].abs() < 0.3
    assert sd[gap].mean() > 2 * sd[on_data].mean(), (sd[gap].mean(), sd[on_data].mean())
    assert (post.predict(x).mean - y).pow(2).mean().sqrt() < 0.15


def test_with_held_out_rows_each_snapshot_is_its_cycles_best_scored_state(monkeypatch):
    """Every cycle is scored on the held-out rows every SCORE_EVERY steps after its start and at its end, and its
    snapshot is the best-scoring of those states (early stopping within the cycle): a cycle run to its end overfits
    a small data set (diabetes: test LL -5.90 at the cycle ends, NUTS -5.54). The cycle's start (the previous
    snapshot, or the random start) is not scored: it is no candidate."""
    from bnn_pyro.infer import holdout, sgmcmc, snapshot

    monkeypatch.setattr(
        snapshot, "refit", lambda post, again: post
    )  # the fit that chose, before holdout.refit fits every row again (tested in test_holdout.py)
    scores = []

    def recording(model, values, held):
        scores.append(holdout.heldout_score(model, values, held))
        return scores[-1]

    monkeypatch.setattr(sgmcmc, "heldout_score", recording)
    x, y = _toy(n=240)
    model = _mlp(likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))
    K = 120
    post = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=K, seed=0, progress=False)
    per_cycle = len(range(sgmcmc.SCORE_EVERY, K, sgmcmc.SCORE_EVERY)) + 1  # steps 50, 100 and the cycle's last
    assert len(scores) == 2 * per_cycle
    stops = post.history["exploration_stop"][0].tolist()
    _, held, _ = holdout.split(bp.infer._common.Data(x=x, y=y), 0.1, seed=0, method="snapshot")
    for c in range(2):
        cycle = scores[c * per_cycle : (c + 1) * per_cycle]
        assert c * K < stops[c] <= c * K + K - 1
        # scored at the steps t with t % SCORE_EVERY == 0 (counted over the run, as sgmcmc's _early_stop does; the
        # same as "from the cycle's start" when K is a multiple of it) and at the cycle's last step
        assert stops[c] % sgmcmc.SCORE_EVERY == 0 or stops[c] == c * K + K - 1
        snapshot = {k: v[0, c] for k, v in post.samples.items()}  # the noise is profiled out of the score
        assert holdout.heldout_score(post.model, snapshot, held) == pytest.approx(max(cycle), rel=1e-6, abs=1e-9)


def test_a_cycle_never_repeats_the_snapshot_it_starts_from(monkeypatch):
    """Even when every state a cycle reaches scores worse on the held-out rows than the snapshot it restarted from
    (forced here: each score is lower than the one before), the cycle's snapshot is its own best state, the first
    one scored after its start, not the previous snapshot (which made every later cycle repeat the first snapshot
    on diabetes and digits before)."""
    from bnn_pyro.infer import sgmcmc

    calls = []
    monkeypatch.setattr(sgmcmc, "heldout_score", lambda *args: calls.append(0) or -float(len(calls)))
    x, y = _toy(n=240)
    model = _mlp(likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))
    post = bp.fit(model, x, y, method="snapshot", num_cycles=3, cycle_length=120, seed=0, progress=False)
    assert post.history["exploration_stop"][0].tolist() == [50, 150, 250]  # scored at steps divisible by 50
    _assert_distinct(post)


def _assert_distinct(post, rel: float = 1e-3):
    """The snapshots differ pairwise by more than a cycle's last step can move a state (a repeated snapshot, the
    previous behaviour, differed from the one it repeated by less than 1e-3 of the weights' scale)."""
    names = [n for n in post.samples if n not in ("sigma", "precision")]
    w = torch.cat([post.samples[n][0].reshape(post.num_draws, -1) for n in names], 1)
    for i in range(post.num_draws):
        for j in range(i + 1, post.num_draws):
            assert float((w[i] - w[j]).abs().max()) > rel * float(w.abs().max()), (i, j)


@pytest.mark.slow  # the defaults: 5,000 steps; 12-18 s each on a loaded 2-core machine
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_snapshots_are_distinct_at_the_defaults_with_held_out_rows(task):
    """At the defaults (5 cycles of 1,000 steps, 10% of 240 rows held out) the ensemble has num_cycles distinct
    members, each stopped inside its own cycle, never at its start: a regression with a learned noise and a
    3-class classification."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(240, 2, generator=g)
    if task == "regression":
        y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.1 * torch.randn(240, generator=g)
        likelihood, out = bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)), 1
    else:
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        likelihood, out = bp.likelihoods.Categorical(), 3
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, out))
    post = bp.fit(
        bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood),
        x,
        y,
        method="snapshot",
        seed=0,
        progress=False,
    )
    assert post.config["validation"]["rows"] == 24 and post.num_draws == 5
    stops = post.history["exploration_stop"][0]
    starts = torch.arange(5) * 1000
    assert ((stops > starts) & (stops < starts + 1000)).all(), stops
    _assert_distinct(post)


def test_anchored_cycles_end_at_their_closed_form_randomized_maps():
    # anchored=True tilts cycle c toward its own prior draw w0_c (bnn_pyro/infer/anchor.py): on Bayesian linear
    # regression its objective's minimizer is C (X^T y / s^2 + w0_c / p^2), an exact posterior draw (Pearce et al.
    # 2020), and a noise-free cycle ends there; plain cycles all end at the one mode, blr.mean.
    from blr import make_blr

    from bnn_pyro.infer._common import Data
    from bnn_pyro.infer._potential import Potential
    from bnn_pyro.infer.anchor import anchor
    from bnn_pyro.infer.snapshot import ANCHOR_CYCLE_OFFSET

    blr = make_blr(n=20, d=2, noise=0.5, prior_scale=0.7)
    opts = dict(method="snapshot", num_cycles=3, cycle_length=500, seed=4, validation=None, progress=False)
    post = bp.fit(blr.model(), blr.x, blr.y, anchored=True, **opts)
    plain = bp.fit(blr.model(), blr.x, blr.y, anchored=False, **opts)
    assert post.config["anchored"] is True and plain.config["anchored"] is False
    model = blr.model()
    pot = Potential(model, Data(x=blr.x, y=blr.y))
    X, y = blr.design, blr.y.double()

    def snap(p, c):
        return torch.cat([p.samples["weight"][0, c].reshape(-1), p.samples["bias"][0, c].reshape(-1)]).double()

    for c in range(3):
        _, w0 = anchor(model, pot, (blr.x, blr.y), seed=4 + c * ANCHOR_CYCLE_OFFSET)
        w0 = torch.cat([w0["weight"].reshape(-1), w0["bias"].reshape(-1)]).double()
        exact = blr.cov @ (X.T @ y / 0.5**2 + w0 / 0.7**2)
        assert (snap(post, c) - exact).abs().max() < 1e-4, c  # optimization tolerance (the ensemble test's)
        assert (exact - blr.mean).abs().max() > 1e-2  # the test tells anchored and plain cycles apart
        assert (snap(plain, c) - blr.mean).abs().max() < 1e-4
