"""bnn_pyro.posterior.diagnostics: InferenceData for every engine, summaries and their warnings."""

from __future__ import annotations

import warnings

import arviz as az
import numpy as np
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.posterior.diagnostics import DiagnosticWarning, function_draws, to_inference_data

SUMMARY_COLUMNS = ["mean", "sd", "hdi_3%", "hdi_97%", "mcse_mean", "mcse_sd", "ess_bulk", "ess_tail", "r_hat"]


def test_svi_inference_data_groups_and_shapes(svi_post, linear_data):
    x, y = linear_data
    idata = svi_post.to_inference_data()
    assert set(idata.groups()) == {
        "posterior",
        "log_likelihood",
        "posterior_predictive",
        "observed_data",
        "constant_data",
    }  # SVI has no sample stats
    assert idata.posterior["weight"].dims == ("chain", "draw", "weight_dim_0", "weight_dim_1")
    assert idata.posterior["weight"].shape == (2, 100, 1, 1)
    np.testing.assert_array_equal(idata.posterior["weight"].values, svi_post.samples["weight"].numpy())
    assert idata.log_likelihood["obs"].shape == (2, 100, 40)
    assert idata.posterior_predictive["obs"].shape == (2, 100, 40)
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y.numpy())
    np.testing.assert_array_equal(idata.constant_data["x"].values, x.numpy())


def test_log_likelihood_is_pointwise_and_chunking_does_not_change_it(svi_post, linear_data):
    x, y = linear_data
    expected = svi_post.observation_distribution(x).log_prob(y).reshape(2, 100, 40)
    small = to_inference_data(svi_post, draws_per_chunk=7, points_per_chunk=9, seed=3)
    big = to_inference_data(svi_post, seed=3)
    np.testing.assert_allclose(small.log_likelihood["obs"].values, expected.numpy(), rtol=1e-6)
    np.testing.assert_allclose(big.log_likelihood["obs"].values, expected.numpy(), rtol=1e-6)
    # predictive draws are seeded: same seed, same draws; the global RNG is left alone
    state = torch.get_rng_state()
    again = to_inference_data(svi_post, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    np.testing.assert_array_equal(big.posterior_predictive["obs"].values, again.posterior_predictive["obs"].values)


def _new_data(linear_data):
    """Inputs as many as the training rows but elsewhere (x + 3), and their observations: a length
    match must never pair them with the training y."""
    x, y = linear_data
    return x + 3.0, y + 0.8 * 3.0


def test_new_x_alone_gives_the_posterior_predictive_there_and_no_log_likelihood(svi_post, linear_data):
    x_new, _ = _new_data(linear_data)
    idata = svi_post.to_inference_data(x=x_new, seed=1)
    assert set(idata.groups()) == {"posterior", "posterior_predictive", "constant_data"}  # no training y anywhere
    np.testing.assert_array_equal(idata.constant_data["x"].values, x_new.numpy())
    pp = torch.as_tensor(idata.posterior_predictive["obs"].values)
    assert pp.shape == (2, 100, 40)
    pred = svi_post.predict(x_new, interval=None)  # the predictive at x_new, not at the training inputs
    z = (pp.mean((0, 1)) - pred.mean.reshape(-1)) / (pred.std.reshape(-1) / 200**0.5)
    assert z.abs().max() < 4.0, z  # independent draws (SVI): MC error std / sqrt(200), 4 sigma over 40 points
    # the same draws as with observations at x_new (one pass, same seed): only the log-likelihood is added
    with_y = svi_post.to_inference_data(x=x_new, y=_new_data(linear_data)[1], seed=1)
    np.testing.assert_array_equal(with_y.posterior_predictive["obs"].values, pp.numpy())


def test_new_x_with_y_gives_log_likelihood_of_those_pairs(svi_post, linear_data):
    x_new, y_new = _new_data(linear_data)
    idata = svi_post.to_inference_data(x=x_new, y=y_new)
    assert set(idata.groups()) == {
        "posterior",
        "log_likelihood",
        "posterior_predictive",
        "observed_data",
        "constant_data",
    }
    expected = svi_post.observation_distribution(x_new).log_prob(y_new).reshape(2, 100, 40)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values, expected.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(idata.observed_data["obs"].values, y_new.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pareto-k advice on 40 points is not under test
        assert az.loo(idata).n_data_points == 40
    training = svi_post.observation_distribution(x_new).log_prob(linear_data[1]).reshape(2, 100, 40)
    assert not np.allclose(idata.log_likelihood["obs"].values, training.numpy())  # the pairing matters here


def test_function_model_with_new_x_alone(function_post, linear_data):
    x_new, _ = _new_data(linear_data)
    idata = function_post.to_inference_data(x=x_new[:7])
    assert "log_likelihood" not in idata.groups() and "observed_data" not in idata.groups()
    assert idata.posterior_predictive["obs"].shape == (2, 20, 7)


def test_y_without_x_and_log_likelihood_without_y_are_errors(svi_post, linear_data):
    x_new, y_new = _new_data(linear_data)
    with pytest.raises(ValueError, match=r"y: given without x.*pass both"):
        svi_post.to_inference_data(y=y_new)
    with pytest.raises(ValueError, match=r"log_likelihood=True needs the observations at x: pass y="):
        svi_post.to_inference_data(x=x_new, log_likelihood=True)


def test_loo_and_waic_work(svi_post):
    idata = svi_post.to_inference_data(posterior_predictive=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pareto-k advice on 40 points is not under test
        loo, waic = az.loo(idata), az.waic(idata)
    assert np.isfinite(loo.elpd_loo) and np.isfinite(waic.elpd_waic)
    assert loo.n_data_points == 40


def test_mcmc_style_sample_stats_are_kept_with_arviz_names(make_posterior, blr_model, linear_data):
    post = make_posterior(
        blr_model,
        *linear_data,
        divergences=3,
        stat_names={"diverging": "divergences", "acceptance_rate": "accept_prob"},
    )
    idata = post.to_inference_data()
    stats = idata.sample_stats
    assert set(stats.data_vars) == {"diverging", "acceptance_rate", "step_size", "tree_depth", "n_steps", "energy"}
    assert stats["diverging"].dtype == bool and int(stats["diverging"].sum()) == 3
    assert stats["energy"].shape == (2, 200)
    assert idata.log_likelihood["obs"].shape == (2, 200, 40)


def test_misshaped_sample_stat_is_rejected(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data)
    post.sample_stats = dict(post.sample_stats, step_size=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"sample_stats\['step_size'\].*\(chains, draws\)"):
        post.to_inference_data()


def test_function_model_log_likelihood_matches_by_hand(function_post, linear_data):
    x, y = linear_data
    idata = function_post.to_inference_data()
    w, b = function_post.samples["w"], function_post.samples["b"]
    expected = dist.Normal(w[..., None] * x[:, 0] + b[..., None], 0.1).log_prob(y)
    np.testing.assert_allclose(idata.log_likelihood["obs"].values, expected.numpy(), rtol=1e-5)
    f = function_draws(function_post, x[:3])
    torch.testing.assert_close(f[..., 0], w[..., None] * x[:3, 0] + b[..., None])


def test_summary_columns_weights_and_function_space(svi_post):
    table = svi_post.summary(warn=False)
    assert list(table.columns) == SUMMARY_COLUMNS
    assert list(table.index) == ["weight[0, 0]"]
    f_table = svi_post.summary(space="function", warn=False)
    assert len(f_table) == 20 and list(f_table.columns) == SUMMARY_COLUMNS
    assert f_table.index[0] == "f[0, 0]" and f_table.index[-1] == "f[39, 0]"  # labelled by training row
    custom = svi_post.summary(space="function", x=torch.tensor([[-1.0], [0.5], [1.0]]), warn=False)
    assert len(custom) == 3


def test_well_mixed_posterior_gives_no_warning(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data, chains=4, draws=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        table = post.summary()
    assert table["r_hat"].iloc[0] < 1.01


def test_divergences_warn_with_advice(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data, chains=4, draws=500, divergences=5)
    with pytest.warns(DiagnosticWarning, match=r"5 of 2000 transitions diverged.*target_accept"):
        post.summary()


def test_rhat_warning_counts_and_points_to_function_space(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data, chains=4, draws=500, shift=0.2)
    with pytest.warns(DiagnosticWarning) as record:
        post.summary()
    messages = [str(w.message) for w in record]
    assert any("1 of 1 parameters have R-hat > 1.01" in m and "space='function'" in m for m in messages), messages


def test_low_ess_warning(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data, chains=2, draws=300, rho=0.97)
    with pytest.warns(DiagnosticWarning) as record:
        post.summary()
    assert any("ESS below 200 (100 per chain" in str(w.message) for w in record), [str(w.message) for w in record]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        post.summary(warn=False)


def test_single_chain_notes_rhat_instead_of_warning(make_posterior, blr_model, linear_data, capfd):
    post = make_posterior(blr_model, *linear_data, chains=1, draws=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        warnings.filterwarnings("ignore", message="Shape validation failed", category=UserWarning)
        table = post.summary()
    assert np.isnan(table["r_hat"]).all()
    assert "at least 2 chains" in table.attrs["notes"][0]
    assert (
        "Shape validation failed" not in capfd.readouterr().err
    )  # ArviZ's own 1-chain log line is replaced by the note


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(space="output"), r"space: unknown value 'output'; choose one of 'weights', 'function'"),
        (dict(var_names=["nope"]), r"var_names: unknown site\(s\) \['nope'\]"),
        (dict(space="function", var_names=["weight"]), r"var_names: only used with space='weights'"),
        (dict(x=torch.zeros(2, 1)), r"x: only used with space='function'"),
    ],
)
def test_summary_rejects_bad_arguments(svi_post, kwargs, message):
    with pytest.raises(ValueError, match=message):
        svi_post.summary(**kwargs)


def test_bp_exposes_modules_lazily():
    assert bp.diagnostics.summary is not None and bp.plots.plot_trace is not None
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        bp.nonexistent  # noqa: B018


def test_one_draw_per_chain_is_summarized_over_chains_without_arviz_shape_guesses(
    make_posterior, blr_model, linear_data
):
    post = make_posterior(blr_model, *linear_data, chains=5, draws=1)  # the layout of ensembles and SWA
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # ArviZ's "More chains (5) than draws (1)" would raise
        warnings.filterwarnings("ignore", message=r"to_inference_data: .* 5 draws in all")  # LOO's (tested below)
        table = post.summary(warn=False)
        idata = to_inference_data(post)
    assert idata.posterior.sizes["chain"] == 5 and idata.posterior.sizes["draw"] == 1
    assert np.isnan(table["r_hat"]).all() and "One draw per chain" in table.attrs["notes"][0]
    assert np.allclose(table["mean"].values[:2], post.samples["weight"].reshape(5, -1).mean(0).numpy()[:2], atol=1e-3)


def test_a_one_draw_log_likelihood_group_says_that_loo_needs_more_draws(make_posterior, blr_model, linear_data):
    """SWA with one chain is one draw: az.loo on its data failed with ArviZ's IndexError and nothing said why."""
    post = make_posterior(blr_model, *linear_data, chains=1, draws=1)
    with pytest.warns(UserWarning, match=r"1 draw in all .*LOO is undefined.*>= 21 draws in all.*'nuts'"):
        idata = to_inference_data(post)
    assert idata.log_likelihood["obs"].shape == (1, 1, 40)  # kept: the log-likelihood at that draw
    with pytest.raises(IndexError):  # the ArviZ failure the warning explains (arviz 0.23)
        az.loo(idata)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        to_inference_data(post, log_likelihood=False)  # no log-likelihood group: nothing to say


def test_a_single_draw_is_summarized_without_numpy_warnings(make_posterior, blr_model, linear_data):
    post = make_posterior(blr_model, *linear_data, chains=1, draws=1)  # SWA's one point
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's "Degrees of freedom <= 0" would raise
        table = post.summary(warn=False)
    assert np.isnan(table["sd"]).all() and "One draw per chain" in table.attrs["notes"][0]
    assert np.allclose(table["mean"].values[:2], post.samples["weight"].reshape(-1).numpy()[:2], atol=1e-3)


@pytest.mark.parametrize("chains, draws", [(4, 1), (5, 4)])
def test_fewer_than_21_draws_in_all_warn_that_loo_is_undefined(make_posterior, blr_model, linear_data, chains, draws):
    """az.loo pools chains, and its Pareto fit needs 5 tail ratios (21 draws): 4 x 1 draws, which the old warning
    advised (num_chains=4), and 5 x 4 gave every pointwise k = inf, and 2-20 draws were not warned about at all."""
    post = make_posterior(blr_model, *linear_data, chains=chains, draws=draws)
    with pytest.warns(UserWarning, match=rf"{chains * draws} draws in all .*LOO is undefined.*>= 21 draws in all"):
        idata = to_inference_data(post)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ's own warnings about the shape estimates
        assert not np.isfinite(az.loo(idata, pointwise=True).pareto_k.values).any()
    enough = make_posterior(blr_model, *linear_data, chains=21, draws=1)  # 21 draws in all: k finite, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        idata = to_inference_data(enough)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isfinite(az.loo(idata, pointwise=True).pareto_k.values).all()
