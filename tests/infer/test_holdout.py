"""Held-out rows inside a fit (bnn_pyro/infer/holdout.py): the split, the score, early stopping and the noise
chosen on held-out rows, against closed forms; and the ensemble's default use of them."""

import math
import warnings

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import holdout as ho
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.optim import Horizon
from bnn_pyro.posterior.diagnostics import DiagnosticWarning


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 6 - 3
    return x, torch.sin(x[:, 0]) + 0.5 * torch.randn(n, generator=g)


# ---------------------------------------------------------------------------------------------- split
def test_split_holds_out_a_seeded_disjoint_fraction():
    x, y = _data(300)
    train, held, why = ho.split(Data(x, y), "default", seed=3, method="ensemble")
    assert why is None and held.size == 30 and train.x.shape[0] == 270
    rows = set(held.rows.tolist())
    assert len(rows) == 30 and torch.equal(held.x, x[held.rows]) and torch.equal(held.y, y[held.rows])
    kept = sorted(set(range(300)) - rows)
    assert torch.equal(train.x, x[kept]) and torch.equal(train.y, y[kept])
    again, held2, _ = ho.split(Data(x, y), 0.1, seed=3, method="ensemble")
    assert torch.equal(held2.rows, held.rows)  # the seed fixes the rows
    assert not torch.equal(ho.split(Data(x, y), 0.1, seed=4, method="ensemble")[1].rows, held.rows)


def _noise_model(scale):
    return bp.BNN(
        torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=scale)
    )


def test_split_default_holds_out_min_rows_of_small_data_with_a_learned_noise():
    """Between 2 * MIN_ROWS and 200 rows the default holds out MIN_ROWS rows (10% would be fewer) when the model
    learns a Gaussian noise, so the noise is chosen on held-out rows there too (the old rule held out nothing below
    200 rows). Without a noise to choose (a fixed one, a plain model) the old rule stands: early stopping alone."""
    learned = _noise_model(dist.HalfNormal(1.0))
    for n in (40, 100, 150, 199):
        x, y = _data(n)
        train, held, why = ho.split(Data(x, y), "default", seed=0, method="ensemble", model=learned)
        assert why is None and held.size == ho.MIN_ROWS and train.x.shape[0] == n - ho.MIN_ROWS
        assert sorted(held.rows.tolist() + [int(r) for r in set(range(n)) - set(held.rows.tolist())]) == list(range(n))
        for model in (None, _noise_model(0.5)) if n < 195 else ():  # round(0.1 * N) >= MIN_ROWS from N = 195
            data, none, why = ho.split(Data(x, y), "default", seed=0, method="ensemble", model=model)
            assert none is None and data.x is x and f"{n} rows and no learned Gaussian noise" in why
    assert [ho.default_rows(n) for n in (39, 40, 100, 200, 300)] == [4, 20, 20, 20, 30]
    x, y = _data(300)
    assert ho.split(Data(x, y), "default", seed=0, method="ensemble", model=learned)[1].size == 30


def test_split_default_skips_tiny_data_and_loaders_with_a_reason():
    x, y = _data(39)  # MIN_ROWS held out would leave fewer than MIN_ROWS to train on
    with pytest.warns(DiagnosticWarning, match=r"39 rows are too few.*validation=\(x_val, y_val\).*scale="):
        data, held, why = ho.split(
            Data(x, y), "default", seed=0, method="laplace", model=_noise_model(dist.HalfNormal(1.0))
        )
    assert held is None and data.x is x and "39 rows" in why
    with warnings.catch_warnings():  # a fixed noise is not chosen: nothing to warn about
        warnings.simplefilter("error")
        assert ho.split(Data(x, y), "default", seed=0, method="laplace", model=_noise_model(0.5))[1] is None
        assert ho.split(Data(x, y), None, seed=0, method="laplace", model=_noise_model(dist.HalfNormal(1.0)))[1] is None
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=50)
    data, held, why = ho.split(Data(None, None, loader=loader, dataset_size=150), "default", seed=0, method="x")
    assert held is None and "loader" in why
    assert ho.split(Data(x, y), None, seed=0, method="x")[1] is None


@pytest.mark.parametrize(
    "bad, match",
    [(0.7, r"\(0, 0.5\]"), (-0.1, r"\(0, 0.5\]"), ("yes", "fraction"), (True, "fraction"), ((1, 2, 3), "pair")],
)
def test_split_refuses_bad_values(bad, match):
    x, y = _data(300)
    with pytest.raises(ValueError, match=match):
        ho.split(Data(x, y), bad, seed=0, method="ensemble")


def test_split_explicit_fraction_refuses_what_the_default_skips():
    x, y = _data(150)
    with pytest.raises(ValueError, match="validation=0.1.*15 held-out rows"):
        ho.split(Data(x, y), 0.1, seed=0, method="ensemble")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=50)
    with pytest.raises(ValueError, match=r"validation=\(x_val, y_val\)"):
        ho.split(Data(None, None, loader=loader, dataset_size=150), 0.2, seed=0, method="ensemble")


def test_the_record_states_the_rows_and_fraction_actually_held_out():
    """The small-data rule holds out 20 of 100 rows for a learned noise: the record says 0.2 (the fraction used) and
    the 0.1 asked for, not 0.1 alone (it did, for every engine, before); 30 of 300 rows are 0.1, as asked."""
    learned = _noise_model(dist.HalfNormal(1.0))
    x, y = _data(100)
    held = ho.split(Data(x, y), "default", seed=0, method="laplace", model=learned)[1]
    assert ho.describe(held, ho.DEFAULT, None) == {
        "rows": 20,
        "source": "split",
        "fraction": 0.2,
        "requested_fraction": 0.1,
    }
    x3, y3 = _data(300)
    held = ho.split(Data(x3, y3), "default", seed=0, method="laplace", model=learned)[1]
    assert ho.describe(held, ho.DEFAULT, None) == {"rows": 30, "source": "split", "fraction": 0.1}
    post = bp.fit(learned, x, y, method="laplace", seed=0, progress=False)  # the defaults a user gets
    record = post.config["validation"]
    assert (record["rows"], record["fraction"], record["requested_fraction"]) == (20, 0.2, 0.1), record
    assert record["final_fit_rows"] == 100


def test_given_pair_keeps_every_training_row():
    x, y = _data(50)
    xv, yv = _data(12, seed=1)
    data, held, _ = ho.split(Data(x, y), (xv, yv), seed=0, method="ensemble")
    assert data.x is x and held.rows is None and torch.equal(held.x, xv)
    assert ho.describe(held, (xv, yv), None) == {"rows": 12, "source": "given"}


# ---------------------------------------------------------------------------------------------- scoring
def test_heldout_score_profiles_the_noise_in_closed_form():
    """For y ~ N(f, sigma) the profiled score is max_c mean log N(y | f, c sigma): c^2 = mean(z^2)."""
    x, y = _data(40)
    model = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )
    values = {"weight": torch.tensor([[0.8]]), "bias": torch.tensor([0.1]), "sigma": torch.tensor(0.05)}
    score = ho.heldout_score(model, values, ho.Holdout(x, y))
    resid = y.double() - (0.8 * x[:, 0].double() + 0.1)
    s2 = resid.pow(2).mean()
    expected = -0.5 * (math.log(2 * math.pi) + math.log(float(s2)) + 1.0)
    assert score == pytest.approx(expected, abs=1e-5)
    # the score of a fit does not depend on its (overfitted) noise estimate
    assert ho.heldout_score(model, {**values, "sigma": torch.tensor(3.0)}, ho.Holdout(x, y)) == pytest.approx(score)


def test_best_scale_is_the_rms_residual_for_one_draw_and_maximizes_the_mixture():
    g = torch.Generator().manual_seed(0)
    f1, y = torch.randn(1, 200, generator=g), torch.randn(200, generator=g)
    sigma, lpd = ho._best_scale(f1, y)
    rms = float((y.double() - f1[0].double()).pow(2).mean().sqrt())
    assert sigma == pytest.approx(rms, rel=2e-3)  # the grid's final spacing is ~1e-3 in log sigma
    f = torch.randn(30, 200, generator=g) * 0.5 + y  # a spread mixture around y
    sigma, lpd = ho._best_scale(f, y)

    def mixture(s):
        lp = dist.Normal(f.double(), s).log_prob(y.double())
        return float((torch.logsumexp(lp, 0) - math.log(30)).mean())

    assert lpd == pytest.approx(mixture(sigma), abs=1e-6)
    assert mixture(sigma * 1.05) < lpd and mixture(sigma / 1.05) < lpd


def test_best_on_holdout_keeps_the_best_state_and_runs_out_of_patience():
    best = ho.BestOnHoldout(every=10, patience=2)
    assert [s for s in range(40) if best.due(s)] == [9, 19, 29, 39]
    state = [torch.zeros(2)]
    assert not best.record(9, -1.0, state)
    state[0] += 1  # the caller's tensors move on; the kept state must not
    assert not best.record(19, -0.5, state)
    state[0] += 1
    assert not best.record(29, -0.7, state)
    assert best.record(39, -0.6, state)  # two scores without improvement
    assert best.best_step == 19 and torch.equal(best.state[0], torch.ones(2))


# ---------------------------------------------------------------------------------------------- engines
def _overfitting_setup(n=240):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)  # 8 inputs, one of which matters: room to overfit
    y = torch.sin(x[:, 0]) + 0.5 * torch.randn(n, generator=g)
    net = torch.nn.Sequential(torch.nn.Linear(8, 100), torch.nn.ReLU(), torch.nn.Linear(100, 1))
    model = bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
    )
    return model, x, y


@pytest.mark.slow
def test_ensemble_default_sets_the_noise_on_held_out_rows(monkeypatch):
    """True noise sd 0.5. Members fitted on all rows learn the training residual (below 0.5); the default holds
    24 rows out and sets sigma to maximize their predictive density. The sd of an sd estimated from n = 24 residuals
    is ~0.5 / sqrt(2n) = 0.072: the tolerance 0.2 (log ratio < 0.35) is ~2.5 of those plus the net's misfit."""
    model, x, y = _overfitting_setup()
    config = dict(method="ensemble", num_chains=2, num_steps=800, lr=0.02, seed=0, progress=False)
    from bnn_pyro.infer import ensemble

    final = bp.fit(model, x, y, **config)
    assert final.config["validation"]["final_fit_rows"] == 240
    monkeypatch.setattr(ensemble, "refit", lambda post, again: post)  # the fit that chose, before the refit
    post = bp.fit(model, x, y, **config)
    assert post.config["validation"] == {"rows": 24, "source": "split", "fraction": 0.1}
    noise = post.config["noise"]
    assert final.config["noise"] == noise and torch.all(final.samples["sigma"] == noise["sigma"])
    assert torch.all(post.samples["sigma"] == noise["sigma"])
    assert abs(math.log(noise["sigma"] / 0.5)) < 0.35, noise
    # its held-out density is the mixture's best over sigma
    held = ho.split(Data(x, y), 0.1, seed=0, method="ensemble")[1]
    assert bp.metrics.log_predictive_density(post, held.x, held.y).mean() == pytest.approx(
        noise["heldout_lpd"], abs=1e-4
    )
    old = bp.fit(model, x, y, validation=None, **config)
    assert "noise" not in old.config and old.config["validation"] == {"rows": 0}
    assert float(old.samples["sigma"].max()) < 0.25  # the MAP noise: the training residual of an overfitted net


def test_ensemble_known_noise_is_never_changed():
    x, y = _data(240)
    model = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.3),
    )
    post = bp.fit(model, x, y, method="ensemble", num_chains=2, num_steps=100, seed=0, progress=False)
    assert post.config["validation"]["rows"] == 24 and "noise" not in post.config
    assert set(post.samples) == {"0.weight", "0.bias", "2.weight", "2.bias"}


# ------------------------------------------------------------------------------- the refit on all rows
def test_scaled_steps_keep_the_number_of_epochs():
    assert ho.scaled_steps(120, rows_train=180, rows_all=200, batch_size=None) == 120  # full batch: a step is an epoch
    assert ho.scaled_steps(120, rows_train=180, rows_all=200, batch_size=200) == 120
    # 18 steps per epoch on 180 rows, 20 on 200: 120 steps are 6.67 epochs, 133.3 steps on all rows
    assert ho.scaled_steps(120, rows_train=180, rows_all=200, batch_size=10) == 133
    assert ho.scaled_steps(0, rows_train=180, rows_all=200, batch_size=10) == 0


def test_laplace_defaults_are_the_exact_posterior_of_blr_with_200_rows():
    """Known noise: nothing to choose, so nothing is held out and every row is fitted (before: 10% held out and an
    early-stopped MAP, the mean 2.6 posterior sd off). The GGN Laplace of BLR is its exact posterior, so the only
    error is Monte Carlo: the mean of 1,000 independent draws has sd 1/sqrt(1000) = 0.032 posterior sd, and the
    tolerance 0.13 is 4 of those; a sample sd's relative sd is 1/sqrt(2 * 1000) = 0.022, tolerance 0.09."""
    from blr import flat_draws, make_blr

    blr = make_blr(n=200, d=2, noise=0.5, correlation=0.5, seed=0)
    post = bp.fit(blr.model(), blr.x, blr.y, method="laplace", seed=0, progress=False)
    assert post.config["validation"]["rows"] == 0 and "no learned Gaussian noise" in post.config["validation"]["reason"]
    w = flat_draws(post.samples)
    sd = blr.cov.diagonal().sqrt()
    assert ((w.mean(0) - blr.mean).abs() / sd).max() < 4 / math.sqrt(1000)
    assert ((w.std(0) / sd).log().abs()).max() < 4 / math.sqrt(2 * 1000)


def _learned_noise(n=240):
    x, y = _data(n)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return (
        bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))),
        x,
        y,
    )


@pytest.mark.parametrize(
    "method, options",
    [("ensemble", dict(num_chains=2, num_steps=150)), ("mc_dropout", dict(num_steps=150, num_samples=20))],
)
def test_the_final_fit_is_the_fit_on_every_row_with_what_the_held_out_rows_chose(method, options):
    """The default holds 24 of 240 rows out to choose the stopping point k and the noise, then returns the engine's
    fit on all 240 rows for k steps (full batch: the same number of epochs) of the schedule of the run that chose
    (the cosine over its 150 steps), with the chosen noise: bit for bit the fit a user would run by hand with
    validation=None, num_steps=k and that cosine (as ``optim.Horizon`` or a callable), not the fit annealed over k
    steps. SWAG's pre-training: tests/infer/test_refit_schedule.py."""
    model, x, y = _learned_noise()
    post = bp.fit(model, x, y, method=method, seed=0, progress=False, **options)
    record = post.config["validation"]
    assert record["rows"] == 24 and record["source"] == "split" and record["final_fit_rows"] == 240
    chosen = record["chosen"]
    k = chosen["num_steps"]
    assert 1 <= k < chosen["horizon"] == 150 and chosen["sigma"] == post.config["noise"]["sigma"]
    assert post.config["num_steps"] == k and post.config["lr_schedule"] == "cosine over 150 steps"

    def cosine(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=150, eta_min=opt.defaults["lr"] / 100)

    by_hand = dict(options, num_steps=k, validation=None, seed=0, progress=False)
    for schedule in (Horizon("cosine", 150), cosine):
        again = bp.fit(model, x, y, method=method, lr_schedule=schedule, **by_hand)
        for name in ("0.weight", "2.weight"):
            assert torch.equal(post.samples[name], again.samples[name]), name
    assert torch.all(post.samples["sigma"] == chosen["sigma"])  # the chosen noise, not the refit's own estimate
    assert not torch.all(again.samples["sigma"] == chosen["sigma"])
    annealed = bp.fit(model, x, y, method=method, **by_hand)  # the refit before: a cosine over the k steps
    assert not torch.equal(post.samples["0.weight"], annealed.samples["0.weight"])


def test_laplace_with_a_learned_noise_refits_every_row_with_the_chosen_noise_fixed():
    model, x, y = _learned_noise()
    post = bp.fit(model, x, y, method="laplace", seed=0, progress=False)
    record = post.config["validation"]
    assert record["rows"] == 24 and record["final_fit_rows"] == 240 and post.config["polish_steps"] == 0
    sigma = record["chosen"]["sigma"]
    assert post.config["noise"]["sigma"] == sigma and torch.allclose(post.samples["sigma"], torch.tensor(sigma))
    assert post.config["num_steps"] == record["chosen"]["num_steps"] < record["chosen"]["horizon"] == 1000
    assert "log_q" in post.sample_stats  # the Gaussian was fitted with the noise in: its density still holds


def test_a_given_pair_is_not_refitted():
    model, x, y = _learned_noise()
    post = bp.fit(
        model,
        x[:216],
        y[:216],
        method="ensemble",
        num_chains=1,
        num_steps=50,
        seed=0,
        progress=False,
        validation=(x[216:], y[216:]),
    )
    assert post.config["validation"] == {"rows": 24, "source": "given"}


@pytest.mark.parametrize(
    "method, options",
    [
        ("csgmcmc", dict(num_cycles=2, num_samples=10, thin=2)),
        ("snapshot", dict(num_cycles=2, cycle_length=40)),
    ],
)
def test_cyclical_engines_refit_every_row_replaying_the_stages_stops(method, options):
    model, x, y = _learned_noise()
    post = bp.fit(model, x, y, method=method, seed=0, progress=False, **options)
    record = post.config["validation"]
    assert record["rows"] == 24 and record["final_fit_rows"] == 240 and post.config["dataset_size"] == 240
    assert post.history["exploration_stop"].tolist() == record["chosen"]["stops"]  # the refit stopped there too
    assert torch.all(post.samples["sigma"] == record["chosen"]["sigma"])


def test_replayed_stops_reproduce_the_run_that_chose_them():
    """A run on all rows that chose its stops on a given held-out pair, and a run on the same rows that replays
    those stops without held-out rows: the same weights, draw for draw (the noise aside, which the first one
    chose on the pair)."""
    from bnn_pyro.infer import sgmcmc

    model, x, y = _learned_noise(264)
    options = dict(num_cycles=2, num_samples=10, thin=2, seed=0, progress=False)
    chose = bp.fit(model, x[:240], y[:240], method="csgmcmc", validation=(x[240:], y[240:]), **options)
    stops = chose.history["exploration_stop"].tolist()
    assert chose.config["validation"] == {"rows": 24, "source": "given"}
    assert any(t % 50 != 40 for t in stops[0])  # a stage stopped before its end (step 40 of each 50): a real replay
    cfg = sgmcmc.CSGMCMCConfig(validation=None, **options)
    plan = sgmcmc.cyclical_plan(2, 10, 2, cfg.exploration, cfg.friction)
    replayed = sgmcmc.run_plan(model, Data(x[:240], y[:240]), plan, "csgmcmc", {}, cfg, stops=stops)
    assert replayed.history["exploration_stop"].tolist() == stops
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert torch.equal(replayed.samples[name], chose.samples[name]), name
