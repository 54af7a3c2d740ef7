"""The model zoo: every entry builds, has a finite log density, fits, predicts and has a full card;
``bp.zoo`` lists, loads and describes entries; reference posteriors match fresh fits (slow)."""

from __future__ import annotations

import importlib
import math

import pyro
import pytest
import torch
from pyro import poutine

import bnn_pyro as bp
from bnn_pyro import zoo

ENTRIES = zoo.list()


def test_list_is_sorted_and_has_the_core_entries():
    assert ENTRIES == sorted(ENTRIES)
    for name in [
        "bayesian_linear_regression",
        "mlp_regression",
        "mlp_heteroscedastic",
        "mlp_classifier",
        "lenet",
        "horseshoe_mlp",
        "explicit_mlp",
    ]:
        assert name in ENTRIES
    assert not any(n.startswith("_") or n.startswith("make_") for n in ENTRIES)


def test_entries_import_from_the_installed_package():
    for name in ENTRIES:
        module = importlib.import_module(f"bnn_pyro.models.{name}")
        assert module.__name__ == f"bnn_pyro.models.{name}"
    assert bp.zoo is zoo


def test_bad_names_error_clearly():
    with pytest.raises(ValueError, match="unknown entry 'nope'.*mlp_regression"):
        zoo.load("nope")
    with pytest.raises(ValueError, match="valid names"):
        zoo.card("nope")
    with pytest.raises(FileNotFoundError, match="bayesian_linear_regression"):
        zoo.reference("lenet")
    with pytest.raises(ValueError, match="dataset"):
        zoo.load("mlp_classifier", dataset="mnist")


def test_fit_defaults_seed_every_method_and_leave_the_card_alone():
    card = {"default_settings": {"svi": {"num_steps": 10}, "nuts": {}}}
    got = zoo.fit_defaults(card, seed=3)
    assert got == {"svi": {"num_steps": 10, "seed": 3, "progress": False}, "nuts": {"seed": 3, "progress": False}}
    got["svi"]["num_steps"] = 99  # an entry adjusts its copy (mc_dropout_mlp, mlp_classifier do)
    assert card["default_settings"]["svi"] == {"num_steps": 10}
    entry = zoo.load("bayesian_linear_regression", seed=2)  # what a user gets from an entry that adjusts nothing
    assert entry.fit_defaults == zoo.fit_defaults(zoo.card("bayesian_linear_regression"), seed=2)


@pytest.mark.parametrize("name", ENTRIES)
def test_card_is_complete(name):
    card = zoo.card(name)
    for key in zoo.CARD_KEYS:
        assert card.get(key), f"{name}: card key {key!r} is missing or empty"
    assert isinstance(card["references"], list) and all(isinstance(r, str) and r for r in card["references"])
    assert card["default_method"] in card["default_settings"]


@pytest.mark.parametrize("name", ENTRIES)
def test_entry_builds_fits_and_predicts(name):
    entry = zoo.load(name)
    assert entry.name == name and entry.task in ("regression", "classification")
    assert entry.card == zoo.card(name)
    assert entry.default_method in entry.fit_defaults
    with pyro.get_param_store().scope(), torch.no_grad():
        log_density = poutine.trace(entry.model).get_trace(entry.x, entry.y).log_prob_sum()
    assert math.isfinite(float(log_density))
    post = entry.fit("svi", num_steps=3, num_samples=4, lr=1e-3)
    assert isinstance(post, bp.Posterior) and post.num_draws == 4
    pred = post.predict(entry.x_test[:5])
    if entry.task == "regression":
        assert pred.mean.shape[0] == 5 and torch.isfinite(pred.std).all()
    else:
        assert pred.probs.shape[0] == 5 and torch.allclose(pred.probs.sum(-1), torch.ones(pred.probs.shape[:-1]))


@pytest.mark.parametrize(
    "name, keys", [("mlp_regression", {"rmse", "test_log_likelihood"}), ("mlp_classifier", {"accuracy", "nll", "ece"})]
)
def test_evaluate_reports_the_task_metrics(name, keys):
    entry = zoo.load(name)
    metrics = entry.evaluate(entry.fit("svi", num_steps=3, num_samples=4))
    assert set(metrics) == keys and all(math.isfinite(v) for v in metrics.values())


def test_digits_option_and_hyper_parameters():
    entry = zoo.load("mlp_classifier", dataset="digits", hidden=8)
    assert entry.x.shape[1] == 64 and entry.model.param_shapes["0.weight"] == (8, 64)
    assert zoo.load("mlp_regression", hidden=10).model.param_shapes["0.weight"] == (10, 1)


def test_exact_posterior_of_bayesian_linear_regression():
    """The closed form agrees with the normal equations solved another way (a linear solve)."""
    entry = zoo.load("bayesian_linear_regression")
    mean, cov = entry.exact_posterior()
    X1 = torch.cat([entry.x, torch.ones(len(entry.x), 1)], 1).double()
    s2 = 0.5**2
    precision = X1.T @ X1 / s2 + torch.eye(3, dtype=torch.double)
    torch.testing.assert_close(mean, torch.linalg.solve(precision, X1.T @ entry.y.double() / s2))
    torch.testing.assert_close(cov @ precision, torch.eye(3, dtype=torch.double))


def test_explicit_mlp_is_a_plain_function_with_the_site_conventions():
    entry = zoo.load("explicit_mlp")
    assert not isinstance(entry.model, torch.nn.Module)
    with pyro.get_param_store().scope(), torch.no_grad():
        trace = poutine.trace(entry.model).get_trace(entry.x[:10], entry.y[:10], dataset_size=50)
    assert {"w1", "w2", "w3", "prec_obs", "f", "obs"} <= set(trace.nodes)
    assert trace.nodes["data"]["value"].tolist() == list(range(10))
    trace.compute_log_prob()
    assert trace.nodes["obs"]["scale"] == 5.0  # minibatch of 10 stands for 50 rows


# ------------------------------------------------------------------------------- reference posteriors
def _compare(ref: dict, f_new, alpha: float = 0.01):
    """Compare fresh draws of ``f`` (chains, draws, J) with a stored reference in function space.

    Derivation of the tolerance. At input ``j`` the reference mean ``m_ref`` and the fresh mean
    ``m_new`` are independent Monte Carlo estimates of the same posterior mean; by the Markov chain
    CLT each is approximately normal around it with standard deviation equal to its MCSE
    (``sd / sqrt(ESS)``, estimated by ArviZ; exactly 0 for an analytic reference). So
    ``z_j = (m_new - m_ref) / sqrt(mcse_ref^2 + mcse_new^2)`` is approximately N(0, 1), and the
    same holds for the posterior sd with ``mcse_sd``. Testing ``2 J`` such statistics with a
    Bonferroni correction at family-wise level ``alpha`` gives the threshold
    ``Phi^-1(1 - alpha / (4 J))``. Nothing else enters the tolerance.

    Chain-level standard errors: on a multimodal posterior ArviZ's within-chain MCSEs understate the error of
    f's moments (mlp_regression: the chain-mean SEs were 1.2-2x larger), so each side's SE is the larger of its
    MCSE and the spread of its chains' own moments over sqrt(chains) (``make_reference.chain_se``) wherever it
    has per-chain summaries: the fresh run always, the stored mlp_regression reference too (8 chains); a
    reference without them (an analytic one: MCSE 0) enters with its own MCSE.
    """
    from bnn_pyro.models.make_reference import chain_se, function_summary

    new = function_summary(f_new)
    J = len(ref["x"])
    threshold = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - alpha / (4 * J))))
    failures = []
    for stat in ("mean", "sd"):
        se_ref, se_new = chain_se(ref["f"], stat), chain_se(new, stat)
        for j in range(J):
            se = math.sqrt(se_ref[j] ** 2 + se_new[j] ** 2)
            z = (new[stat][j] - ref["f"][stat][j]) / se
            if not abs(z) < threshold:
                failures.append(
                    f"{stat} at x={ref['x'][j]}: new {new[stat][j]:.4f} vs ref {ref['f'][stat][j]:.4f} "
                    f"(z = {z:.2f}, threshold {threshold:.2f})"
                )
    return failures


def test_reference_files_have_provenance():
    from importlib import resources

    folder = resources.files("bnn_pyro.models").joinpath("reference")
    names = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
    assert "bayesian_linear_regression" in names
    for name in names:
        _check_reference(zoo.reference(name))


def _check_reference(ref):
    assert {"name", "hyper", "x", "f", "provenance", "acceptance"} <= set(ref)
    assert {"engine", "seed", "settings", "versions", "date"} <= set(ref["provenance"])
    assert len(ref["f"]["mean"]) == len(ref["f"]["sd"]) == len(ref["x"])


def test_chain_level_standard_errors_see_chains_that_disagree():
    """Four chains, each i.i.d. within itself but offset from each other by N(0, 0.3^2): the chain-level SE of the
    pooled mean is the chains' spread over sqrt(4), and never below ArviZ's MCSE; without per-chain summaries
    it is ArviZ's MCSE."""
    from bnn_pyro.models.make_reference import chain_se, function_summary

    g = torch.Generator().manual_seed(0)
    offsets = 0.3 * torch.randn(4, 1, 1, generator=g, dtype=torch.float64)
    f = (torch.randn(4, 1000, 3, generator=g, dtype=torch.float64) + offsets).numpy()
    summary = function_summary(f)
    spread = offsets[:, 0, 0].std().item() / 2
    assert all(abs(se - spread) < 0.05 * spread for se in chain_se(summary, "mean"))
    assert all(se >= m for se, m in zip(chain_se(summary, "mean"), summary["mcse_mean"]))
    same = function_summary(torch.randn(4, 1000, 3, generator=g, dtype=torch.float64).numpy())
    assert chain_se({k: v for k, v in same.items() if not k.startswith("chain_")}, "mean") == same["mcse_mean"]


def test_exact_reference_matches_the_closed_form():
    ref = zoo.reference("bayesian_linear_regression")
    mean, cov = zoo.load("bayesian_linear_regression").exact_posterior()
    draws = torch.cat([torch.tensor(ref["draws"]["weight"]), torch.tensor(ref["draws"]["bias"])[:, None]], 1).double()
    # 1,000 iid draws: each mean is within 4.5 standard errors (sqrt(var / 1000)) of the exact one
    assert ((draws.mean(0) - mean).abs() < 4.5 * (cov.diagonal() / len(draws)).sqrt()).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, method, settings",
    [
        ("bayesian_linear_regression", "nuts", {}),  # the entry's default NUTS run
        # an independent NUTS run (other seed) against the 8 x 1,500-draw 1-10-1 reference. 500 + 500 iterations
        # left the fresh run unconverged by the reference's own criteria (max R-hat_f 1.04-1.16, min bulk
        # ESS_f 19-68 over seeds 1-13), and then its MCSEs, hence the z-scores below, are not valid
        # init="net" is the reference's own recipe (its provenance) and what this test ran with before
        # init="reset" became the default. On this posterior (weight-space R-hat 2.0) ArviZ's MCSEs understate the
        # error of f's moments (chain-mean SEs 1.2-2x larger): _compare takes both sides' chain-level SEs (the
        # stored reference, 8 x 3,000 draws, holds its chains' own moments)
        # 1,500 draws per chain converged for seed 1 under the earlier NUTS random streams; the one NUTS transition
        # (this layout) draws its uniforms from torch, and at 1,500 seed 1 gave max R-hat_f 1.070, min bulk ESS_f 45,
        # so the run is longer, not another seed
        (
            "mlp_regression",
            "nuts",
            dict(num_samples=3000, num_warmup=1000, num_chains=4, max_tree_depth=7, seed=1, init="net"),
        ),
    ],
)
def test_fresh_fit_matches_reference_in_function_space(name, method, settings):
    from bnn_pyro.models.make_reference import function_summary

    ref = zoo.reference(name)
    checks = ref["acceptance"]
    assert checks["accepted"], f"the stored reference for {name} failed its acceptance criteria: {checks}"
    entry = zoo.load(name, **ref["hyper"])
    post = entry.fit(method, **settings)
    f = bp.diagnostics.function_draws(post, torch.tensor(ref["x"]))[..., 0].double().numpy()
    if post.num_chains > 1:  # the z-scores need valid MCSEs: the fresh run must converge as the reference did
        fresh = function_summary(f)
        assert max(fresh["r_hat"]) < 1.05 and min(fresh["ess_bulk"]) >= 100, (
            f"the fresh run did not converge (max R-hat_f {max(fresh['r_hat']):.3f}, min bulk ESS_f "
            f"{min(fresh['ess_bulk']):.0f}): run it longer before comparing it with the reference"
        )
    failures = _compare(ref, f)
    assert not failures, "fresh fit differs from the reference beyond Monte Carlo error:\n" + "\n".join(failures)


@pytest.mark.slow
def test_gru_sequence_at_its_card_defaults_beats_the_trivial_baselines():
    """The card's default fit (svi, 400 steps: ~40 s on a busy 2-core machine) recalls the token 2 steps back
    far better than guessing: the most frequent label of the test set or copying the current token each get
    about 1/vocab = 0.25 (measured 0.25 and 0.33); the fit gets 1.0 (NLL per sequence of 10 tokens 0.32)."""
    entry = zoo.load("gru_sequence")
    assert entry.x.dtype == torch.int64 and entry.model.integer_inputs and not entry.model.vmappable
    post = entry.fit()
    scores = entry.evaluate(post, num_samples=100)
    y = entry.y_test
    majority = float((y == y.flatten().mode().values).double().mean())
    copy_current = float((y == entry.x_test).double().mean())
    assert scores["accuracy"] > max(majority, copy_current) + 0.3, (scores, majority, copy_current)
    # a uniform guess has NLL 10 log 4 = 13.9 per sequence; the fit must be far below it
    assert scores["nll"] < 0.5 * 10 * math.log(4), scores


@pytest.mark.parametrize(
    "name, method, tiny",
    [
        ("mc_dropout_mlp", "mc_dropout", dict(num_steps=5, num_samples=4)),
        ("sparse_vd_digits", "sparse_vd", dict(num_steps=5, num_samples=4)),
    ],
)
def test_method_entries_fit_with_their_own_method(name, method, tiny):
    entry = zoo.load(name)
    assert entry.default_method == method
    post = entry.fit(**tiny)
    assert post.method == method and post.num_draws == 4
    metrics = entry.evaluate(post, num_samples=4)
    assert metrics and all(math.isfinite(v) for v in metrics.values())
