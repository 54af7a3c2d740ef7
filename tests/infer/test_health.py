"""End-of-fit health warnings (bnn_pyro/infer/_health.py, health_mixing.py, health_spread.py): each fires on a
deliberately bad fit and stays silent on a healthy one (Bayesian linear regression, whose exact posterior is known)."""

from __future__ import annotations

import re
import warnings

import pyro.distributions as dist
import pytest
import torch
from blr import make_blr  # tests/ is on sys.path (pytest puts conftest.py's folder there)

import bnn_pyro as bp
from bnn_pyro.infer import _health, health_mixing, health_spread
from bnn_pyro.posterior.diagnostics import DiagnosticWarning


def _quiet(fn):
    """Run ``fn`` with DiagnosticWarnings as errors: a healthy fit must raise none."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        return fn()


def _messages(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, DiagnosticWarning)]


@pytest.fixture(scope="module")
def blr():
    return make_blr(n=40, d=2, noise=0.3, correlation=0.5, seed=3)


def _mlp(seed: int = 0) -> bp.BNN:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def _wiggle(n: int = 60):
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, n)[:, None]
    return x, torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)


# ------------------------------------------------------------------ healthy fits: silent
MEAN_FIELD = dict(guide="mean_field", num_steps=800, lr=0.05, lr_schedule="cosine", num_samples=200)


@pytest.mark.parametrize(
    "data, options",
    [
        ("blr", dict(method="nuts", num_samples=200, num_warmup=200, num_chains=2, chain_method="sequential")),
        ("blr", dict(method="svi", **MEAN_FIELD)),
        # noise-dominated: the exact posterior's mean explains ~1% of y in-sample, yet the data made the posterior far
        # surer than the prior, so it must not be mistaken for the prior
        ("weak", dict(method="svi", guide="map", num_steps=500, lr=0.1, lr_schedule="cosine")),
        ("weak", dict(method="svi", **MEAN_FIELD)),
    ],
    ids=["blr-nuts", "blr-svi", "noise_dominated-map", "noise_dominated-svi"],
)
def test_healthy_fits_of_blr_give_no_warning(data, options, blr):
    """Bayesian linear regression fitted well (NUTS, mean-field SVI) and a noise-dominated one (noise sd 1 on weak
    signal: MAP and mean-field SVI): no DiagnosticWarning."""
    blr = make_blr(n=20, d=2, noise=1.0, correlation=0.0) if data == "weak" else blr
    _quiet(lambda: bp.fit(blr.model(), blr.x, blr.y, seed=0, progress=False, **options))


# ------------------------------------------------------------------ bad fits: each warning fires
def test_ten_step_svi_warns_that_the_elbo_has_not_converged(blr):
    with pytest.warns(DiagnosticWarning) as record:
        bp.fit(blr.model(), blr.x, blr.y, method="svi", num_steps=10, lr=0.01, seed=0, progress=False)
    assert any("ELBO has not converged" in m and "num_steps" in m for m in _messages(record)), _messages(record)


def test_a_rising_elbo_is_reported_as_unstable():
    losses = torch.cat([torch.linspace(100.0, 50.0, 80), torch.full((10,), 50.0), torch.full((10,), 60.0)])
    losses = losses + 0.1 * torch.randn(100, generator=torch.Generator().manual_seed(0))
    with pytest.warns(DiagnosticWarning, match=r"ELBO got worse.*lower lr"):
        _health.check_elbo(losses[None], lr=0.1)
    _quiet(lambda: _health.check_elbo(torch.full((1, 100), 50.0) + 0.1 * torch.randn(1, 100)))
    _quiet(lambda: _health.check_elbo(torch.linspace(50.0, 49.5, 100)[None]))  # falling by < 1 nat: converged


def test_nuts_at_tree_depth_two_warns_about_saturation_and_mixing():
    x, y = _wiggle()
    with pytest.warns(DiagnosticWarning) as record:
        bp.fit(
            _mlp(),
            x,
            y,
            method="nuts",
            max_tree_depth=2,
            num_samples=100,
            num_warmup=100,
            num_chains=2,
            chain_method="sequential",
            seed=0,
            progress=False,
        )
    messages = _messages(record)
    assert any("stopped at max_tree_depth=2" in m and "larger max_tree_depth" in m for m in messages), messages
    ess = [m for m in messages if "bulk ESS of f(x) at 20 training inputs" in m]
    assert ess and all("num_samples" in m and "method='nuts'" not in m for m in ess), messages  # it is NUTS already


def test_short_metropolis_warns_about_too_few_effective_draws():
    x, y = _wiggle()
    with pytest.warns(DiagnosticWarning) as record:
        bp.fit(
            _mlp(),
            x,
            y,
            method="metropolis",
            num_samples=50,
            num_warmup=50,
            num_chains=2,
            chain_method="sequential",
            seed=0,
            progress=False,
        )
    messages = _messages(record)
    ess = f"threshold {health_mixing.ess_chance_min(2, 50):.0f} in all"  # 100 draws: below 100 by chance (15)
    assert any("bulk ESS of f(x)" in m and ess in m and "method='nuts'" in m for m in messages), messages
    limit = f"threshold {health_mixing.rhat_chance_max(2, 50, 20):.3g}"  # above 1.05 at 50 draws per chain: chance
    assert any("R-hat of f(x)" in m and limit in m for m in messages), messages
    # the structural reason, with the number: 100 effective draws / (0.3 / 61 per iteration) / 2 chains = 10,167
    assert any("random walk in 61 coordinates" in m and "~10,167 draws per chain (this run: 50)" in m for m in messages)


def test_random_walk_advice_only_where_the_dimension_explains_the_miss():
    """The bound: ``ESS_MIN * dim / (0.3 * chains)`` iterations per chain at best (Gelman, Roberts & Gilks 1996).
    A run at least that long gets the usual advice (empty here); a shorter one the number it would need."""
    assert health_mixing.random_walk_advice(3, 4, 1000) == ""  # needs 250 per chain
    assert health_mixing.random_walk_advice(12, 4, 1000) == ""  # needs exactly 1,000
    advice = health_mixing.random_walk_advice(853, 4, 1000)  # the classification benchmark's wine net
    assert "853 coordinates" in advice and "~71,084 draws per chain (this run: 1,000)" in advice
    assert "NUTS's cost per effective draw" in advice


def test_the_random_walk_counts_the_coordinates_it_moves_in():
    """An LKJCholesky(4) site moves in 6 unconstrained coordinates (16 elements), a Dirichlet(3) in 2 (3 elements),
    plus 2 coefficients: 10, where the constrained elements would say 21 (review 15). A BNN: its weights."""
    from bnn_pyro.infer.mcmc import walk_size
    from bnn_pyro.infer.training_data import Data

    def model(x, y=None):
        import pyro

        chol = pyro.sample("L", dist.LKJCholesky(4, 2.0))
        mix = pyro.sample("w", dist.Dirichlet(torch.ones(3)))
        b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(x @ b + chol[1, 0] + mix[0], 1.0), obs=y)

    x, y = torch.randn(10, 2), torch.randn(10)
    samples = {
        "L": torch.eye(4).expand(1, 1, 4, 4),
        "w": torch.full((1, 1, 3), 1 / 3),
        "b": torch.zeros(1, 1, 2),
    }
    assert walk_size(model, samples, Data(x, y)) == 10
    shapes = {"0.weight": (20, 1), "0.bias": (20,), "2.weight": (1, 20), "2.bias": (1,)}
    weights = {k: torch.zeros(1, 1, *shape) for k, shape in shapes.items()}
    assert walk_size(_mlp(), weights, Data(torch.randn(5, 1), torch.randn(5))) == 61


def test_pyro_function_without_f_is_monitored_by_its_log_density():
    def model(x, y=None):
        import pyro
        import pyro.distributions as dist

        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(w * x[:, 0], 0.5), obs=y)

    x = torch.linspace(-1, 1, 30)[:, None]
    y = 0.5 * x[:, 0]
    with pytest.warns(DiagnosticWarning, match=r"bulk ESS of the parameters and the log density lp \(worst: "):
        bp.fit(
            model,
            x,
            y,
            method="metropolis",
            num_chains=1,
            num_samples=20,
            num_warmup=20,
            jit=False,
            seed=0,
            progress=False,
        )


def _plain_posterior(shift: float, num_chains: int = 4, draws: int = 500) -> bp.Posterior:
    """Independent N(0, 1) draws of a plain model's sites ``a`` (scalar) and ``theta`` (3,), and an ``lp`` column;
    ``theta[1]`` of chain 0 is shifted by ``shift`` posterior sds (a chain stuck elsewhere)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(num_chains, draws, 3, generator=g)
    theta[0, :, 1] += shift
    return bp.Posterior(
        samples={"a": torch.randn(num_chains, draws, generator=g), "theta": theta},
        model=lambda x, y=None: None,
        method="metropolis",
        sample_stats={"lp": torch.randn(num_chains, draws, generator=g)},
    )


def test_plain_model_parameters_are_checked_not_only_its_log_density():
    """Without an 'f' site the parameters' R-hat and ESS are checked (before, only lp's: a chain stuck away from
    the others in one parameter went unreported); the worst element is named. Independent draws: R-hat of the
    unshifted elements ~1.00 +- 0.003, of theta[1] with one of 4 chains shifted by 1 sd ~1.1."""
    _quiet(lambda: health_mixing.check_mixing(_plain_posterior(0.0)))
    with pytest.warns(
        DiagnosticWarning,
        match=r"R-hat of the parameters and the log density lp \(worst: "
        r"theta\[1\]\) is up to 1\.[1-9]",
    ):
        health_mixing.check_mixing(_plain_posterior(1.0))


def test_few_exact_draws_per_chain_are_not_said_to_disagree_and_a_stuck_chain_still_is():
    """2 chains of 25 independent draws of one distribution: their R-hat exceeds the fixed 1.05 by chance in most
    runs (benchmarks/results/health_false_alarms/: 82% of runs), and check_mixing said such chains disagree (R-hat
    1.08 on these draws); its threshold is now also above what exchangeable chains reach by chance (rhat_chance_max,
    1.21 for 5 quantities). A chain stuck 3 sds away is still flagged at these draws."""
    exact = _plain_posterior(0.0, num_chains=2, draws=25)
    limit = health_mixing.rhat_chance_max(2, 25, 5)
    assert 1.15 < limit < 1.25
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        health_mixing.check_mixing(exact)
    said = " ".join(str(w.message) for w in caught)
    assert "R-hat" not in said and "bulk ESS" in said  # 50 draws: the ESS floor is the true statement
    with pytest.warns(DiagnosticWarning, match=rf"R-hat of .*theta\[1\]\) is up to .*\(threshold {limit:.3g}\)"):
        health_mixing.check_mixing(_plain_posterior(3.0, num_chains=2, draws=25))


def test_one_chain_says_that_r_hat_is_undefined():
    with pytest.warns(
        DiagnosticWarning,
        match=r"with one chain R-hat is undefined \(NaN in post.summary\(\)\).*"
        r"num_chains >= 2, as the MCMC engines do by default with 4",
    ):
        health_mixing.check_mixing(_plain_posterior(0.0, num_chains=1))


def test_one_chain_with_a_mixing_problem_says_so_once_and_keeps_the_engines_note():
    """One chain of 30 draws (bulk ESS under its threshold) with an engine's note (Metropolis's random-walk bound):
    the undefined R-hat is said once and the note follows the advice. It had been said twice, the note dropped: the
    one-chain sentence had taken the note's variable name (found in a GPU run's warnings, 2026-11-28)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        health_mixing.check_mixing(_plain_posterior(0.0, num_chains=1, draws=30), note="THE ENGINE'S NOTE")
    said = " ".join(str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning))
    assert "bulk ESS" in said and said.count("R-hat is undefined") == 1, said
    assert said.endswith("THE ENGINE'S NOTE."), said


def test_svi_that_ignores_the_data_is_flagged():
    """A mean-field guide whose draws are the prior's at every weight (scales 1, means 0), as a
    collapsed fit ends: the predictive is flat and f varies more than y at the data."""
    x, y = _wiggle()
    post = bp.fit(_mlp(), x, y, method="svi", num_steps=20, lr=1e-3, num_samples=200, seed=0, progress=False)
    g = torch.Generator().manual_seed(1)
    post.samples = {k: torch.randn(v.shape, generator=g) for k, v in post.samples.items()}
    with pytest.warns(DiagnosticWarning, match=r"posterior ignores the data.*guide='low_rank'"):
        _health.check_svi(post)


@pytest.mark.parametrize("guide, entries", [("full_rank", 60), ("low_rank", 8)])
def test_a_factor_guide_that_ignores_the_data_is_told_to_lower_lr_not_to_add_steps(guide, entries):
    """A full-rank or low-rank fit whose draws are the prior's: the advice names the factor's entries per row (61
    weights: 60 and round(sqrt(61)) = 8), the lr used and a lower one, not more steps (which lengthen Adam's walk)."""
    x, y = _wiggle()
    post = bp.fit(
        _mlp(), x, y, method="svi", guide=guide, num_steps=20, lr=1e-2, num_samples=200, seed=0, progress=False
    )
    g = torch.Generator().manual_seed(1)
    post.samples = {k: torch.randn(v.shape, generator=g) for k, v in post.samples.items()}
    with pytest.warns(DiagnosticWarning, match=r"posterior ignores the data") as record:
        _health.check_svi(post)
    text = " ".join(str(w.message) for w in record if "ignores the data" in str(w.message))
    assert f"{guide} guide on 61 coordinates has {entries} free covariance-factor entries per row" in text
    assert "This fit used lr=0.01" in text and "Try a lower lr (e.g. lr=0.00" in text
    assert "Try more num_steps" not in text


def test_classifier_equal_to_its_prior_is_flagged_and_a_fitted_one_is_not():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = bp.BNN(torch.nn.Linear(2, 2), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    # a full-rank guide: a mean-field one is too narrow for this softmax's redundant (correlated) biases, and says so
    fitted = _quiet(
        lambda: bp.fit(
            model,
            x,
            y,
            method="svi",
            guide="full_rank",
            num_steps=800,
            lr=0.05,
            num_samples=100,
            seed=0,
            progress=False,
        )
    )
    fitted.samples = {k: torch.randn(v.shape, generator=g) for k, v in fitted.samples.items()}  # prior draws
    with pytest.warns(DiagnosticWarning, match=r"log loss .* training class frequencies.*than prior draws"):
        _health.check_predictive(fitted)


def test_checks_leave_the_global_random_state_alone(blr):
    post = bp.fit(
        blr.model(), blr.x, blr.y, method="svi", num_steps=300, lr=0.05, num_samples=50, seed=0, progress=False
    )
    state = torch.get_rng_state()
    _health.check_predictive(post)
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------ raw-unit targets under a small fixed noise
def _raw_units(n: int = 100):
    """Targets in raw units (sd ~55, as the issue's public regression sets: 55-77) of a wiggly function."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, generator=g)
    return x, 150.0 + 55.0 * torch.sin(2 * x[:, 0]) + 5.0 * torch.randn(n, generator=g)


def test_raw_unit_targets_under_the_default_noise_warn_with_their_sd_and_the_noise_before_the_fit():
    x, y = _raw_units()
    sd = float(y.std(correction=0))
    with pytest.warns(DiagnosticWarning) as record:
        bp.fit(_mlp(), x, y, method="svi", num_steps=200, lr=0.01, seed=0, progress=False)
    messages = _messages(record)
    first = [m for m in messages if m.startswith("unscaled targets")]
    assert first and f"standard deviation {sd:.3g}" in first[0] and "Gaussian(scale=0.1)" in first[0], messages
    assert "Standardizer" in first[0] and "HalfNormal" in first[0]  # what to do: standardize, or learn the noise
    elbo = [m for m in messages if "ELBO has not converged" in m]  # 200 steps: still falling, for another reason
    assert elbo and "Try more num_steps" not in elbo[0] and "units" in elbo[0], messages
    assert record[0].filename == __file__  # the warning points at the user's bp.fit call


def test_standardized_targets_or_a_learned_noise_or_a_noise_in_their_units_do_not_warn():
    x, y = _raw_units()
    z = (y - y.mean()) / y.std()

    def model(likelihood):
        net = torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1))
        return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)

    assert _health.unscaled_targets(_mlp(), y) is not None  # the raw targets under the default scale 0.1: flagged
    assert _health.unscaled_targets(_mlp(), z) is None  # standardized: the README's setting
    assert _health.unscaled_targets(model(bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))), y) is None
    assert _health.unscaled_targets(model(bp.likelihoods.Gaussian(scale=10.0)), y) is None  # noise in y's units
    _quiet(lambda: _health.check_targets(_mlp(), z))


def _two_class(n: int = 60):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    return x, (x[:, 0] > 0).long()


def _classifier():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


@pytest.mark.parametrize(
    "method, options, says",
    [
        ("mc_dropout", dict(num_steps=20, num_samples=10), "dropping the fitted net's own hidden units"),
        (
            "swag",
            dict(pretrain_steps=10, num_steps=40, rank=2, num_samples=10, num_chains=1, anchored=False),
            "gradient noise",
        ),
        (
            "snapshot",
            dict(num_cycles=2, cycle_length=10, anchored=False),
            "every snapshot minimizes the same objective",
        ),
        ("laplace", dict(num_steps=50, num_samples=10), "every layer but the last stays at its MAP"),  # its default
        (
            "subspace",
            dict(
                subspace_dim=2,
                num_samples=10,
                swa=dict(pretrain_steps=20, num_steps=30, collect_every=1),
                inner_options=dict(num_warmup=10, max_tree_depth=3),
            ),
            "the directions the data leave free",
        ),
    ],
)
def test_classification_fits_of_structurally_limited_engines_say_so_at_fit_time(method, options, says):
    # issue 26: MC dropout, and snapshot ensembles and SWAG without anchoring, separate noise inputs from test rows no
    # better than chance (docs/ood.md), for reasons the engines state; the fit says so, at the user's line
    x, y = _two_class()
    with pytest.warns(DiagnosticWarning, match="off-data uncertainty is not represented") as record:
        bp.fit(_classifier(), x, y, method=method, seed=0, progress=False, **options)
    (w,) = [w for w in record if "off-data" in str(w.message)]
    text = str(w.message)
    assert text.startswith(f"{method}: ") and says in text and "method='ensemble'" in text and "docs/ood.md" in text
    assert "'laplace'" not in text.split("For out-of-distribution detection")[1]  # its default fails the target too
    assert w.filename == __file__


@pytest.mark.parametrize(
    "method, options",
    [
        ("mc_dropout", dict(num_steps=20, num_samples=10)),  # regression: nothing to say
        ("ensemble", dict(num_members=2, num_steps=20)),  # anchored members keep the prior's spread
        ("swag", dict(pretrain_steps=10, num_steps=40, rank=2, num_samples=10, num_chains=1)),  # anchored by default
        ("mc_dropout", dict(num_steps=20, num_samples=10, dropout_inputs=True)),  # masks reach the input directions
        ("snapshot", dict(num_cycles=2, cycle_length=10)),  # anchored cycles by default
        ("laplace", dict(num_steps=50, num_samples=10, structure="full")),  # every layer's spread
        ("laplace", dict(num_steps=50, num_samples=10, structure="kron")),
    ],
)
def test_regression_fits_and_anchored_engines_do_not_warn_about_off_data(method, options):
    x, y = _two_class()
    model = _classifier()
    if method == "mc_dropout" and "dropout_inputs" not in options:
        model = bp.BNN(
            torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
            prior=bp.priors.Normal(0.0, 1.0),
            likelihood=bp.likelihoods.Gaussian(scale=0.5),
        )
        y = x[:, :1]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        bp.fit(model, x, y, method=method, seed=0, progress=False, **options)
    assert not [w for w in record if "off-data" in str(w.message)]


@pytest.mark.parametrize("body", ["frozen", "deterministic"])
def test_laplace_on_a_model_whose_only_bayesian_layer_is_the_last_does_not_blame_its_structure(body):
    """The last-layer note says structure='full' or 'kron' would cover every layer; for a head on a frozen body
    (tutorial 09's Bayesian last layer) or one whose body is deterministic, they cover the same coordinates (the same
    fit), so the note's advice is wrong there and it is not given. The same net with a Bayesian body still gets it
    (above)."""
    x, y = _two_class()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if body == "frozen":
        net[0].requires_grad_(False)
    bayesian = ["2.*"] if body == "deterministic" else "all"
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical(), bayesian=bayesian)
    assert model.sample_names == ["2.weight", "2.bias"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="laplace", seed=0, progress=False, num_steps=50, num_samples=10)
    full = bp.fit(model, x, y, method="laplace", seed=0, progress=False, num_steps=50, num_samples=10, structure="full")
    assert post.config["structure"] == "last_layer" and post.config["dim"] == full.config["dim"] == 18
    assert not [w for w in record if "off-data" in str(w.message)], [str(w.message) for w in record]


@pytest.mark.parametrize(
    "method, options, units",
    [
        ("ensemble", dict(num_chains=2, num_steps=20), "members"),  # anchored by default
        ("swag", dict(pretrain_steps=10, num_steps=40, swag_rank=2, num_samples=10, num_chains=1), "chains"),
        ("snapshot", dict(num_cycles=2, cycle_length=10), "cycles"),
    ],
)
def test_anchored_classification_fits_say_their_log_loss_is_not_the_posteriors(method, options, units):
    # issue 26: anchored members separate noise inputs but their mixture's test log loss stays above the exact
    # posterior's (wine: 0.131 for 40 members, NUTS 0.087), and no fit-time measure predicts it (docs/ood.md)
    x, y = _two_class()
    with pytest.warns(DiagnosticWarning, match="test log loss may be well above the posterior's") as record:
        bp.fit(_classifier(), x, y, method=method, seed=0, progress=False, **options)
    (w,) = [w for w in record if "test log loss may be" in str(w.message)]
    text = str(w.message)
    assert text.startswith(f"{method}: ") and f"anchored {units}" in text and "docs/ood.md" in text
    assert "method='nuts'" in text and "method='sghmc'" in text and "anchored=False" in text
    assert w.filename == __file__


@pytest.mark.parametrize(
    "method, options",
    [
        ("ensemble", dict(num_chains=2, num_steps=20)),
        ("swag", dict(pretrain_steps=10, num_steps=40, swag_rank=2, num_samples=10, num_chains=1)),
        ("snapshot", dict(num_cycles=2, cycle_length=10)),
    ],
)
def test_anchored_regression_fits_and_plain_members_do_not_warn_about_log_loss(method, options):
    x, _ = _two_class()
    y = x[:, :1]
    torch.manual_seed(0)
    regression = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.5),
    )
    for model, yy, extra in [(regression, y, {}), (_classifier(), _two_class()[1], dict(anchored=False))]:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            bp.fit(model, x, yy, method=method, seed=0, progress=False, **options, **extra)
        assert not [w for w in record if "test log loss may be" in str(w.message)], (method, extra)


def test_an_unconverged_factor_guide_is_not_told_to_raise_lr():
    """A full-rank fit whose ELBO still falls: more steps, not a higher lr (which speeds its factor's random walk)."""
    x, y = _wiggle()
    post = bp.fit(
        _mlp(),
        x,
        y,
        method="svi",
        guide="full_rank",
        num_steps=200,
        lr=2e-3,
        lr_schedule="constant",
        num_samples=20,
        progress=False,
    )
    with pytest.warns(DiagnosticWarning, match=r"ELBO has not converged") as record:
        _health.check_svi(post)
    text = " ".join(str(w.message) for w in record if "not converged" in str(w.message))
    assert "Try more num_steps (not a higher lr" in text and "or a higher lr" not in text


def _regression(x, y=None):
    """Bayesian linear regression as a Pyro function (check_gaussian judges function models only)."""
    import pyro

    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ w + b, 1.0), obs=y)


def _gaussian_draws(blr, width: float, chains: int, draws: int, seed: int) -> bp.Posterior:
    """``chains x draws`` draws of ``q = N(m, width^2 C)`` around the exact posterior ``N(m, C)``, log q recorded."""
    q = dist.MultivariateNormal(blr.mean, covariance_matrix=width**2 * blr.cov)
    z = _seeded(q, chains * draws, seed)
    return bp.Posterior(
        samples={"w": z[:, :2].float().reshape(chains, draws, 2), "b": z[:, 2].float().reshape(chains, draws)},
        model=_regression,
        method="laplace",
        sample_stats={"log_q": q.log_prob(z).reshape(chains, draws)},
        x=blr.x,
        y=blr.y,
    )


def _seeded(q, n: int, seed: int) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return q.sample(torch.Size([n]))


def _gaussian_alarms(post) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        health_spread.check_gaussian(post)
    return [str(w.message) for w in caught if "far from the fitted Gaussian" in str(w.message)]


def test_check_gaussian_judges_from_100_draws_per_chain_only():
    """At 5 x 21 to 5 x 99 draws the largest per-chain k_hat is too noisy to judge by (a good q is judged far in
    about 1 run in 4 at 21-25 draws per chain; benchmarks/results/psis_khat_noise/), so the check is skipped there;
    it used to judge from 21 per chain. A q far too narrow (0.3 of the posterior's sds) is still caught at 100."""
    from bnn_pyro.posterior.psis import RELIABLE_DRAWS_PER_CHAIN

    blr = make_blr(n=20, d=2, noise=1.0, prior_scale=1.0)
    assert RELIABLE_DRAWS_PER_CHAIN == 100
    narrow = _gaussian_draws(blr, 0.3, chains=5, draws=100, seed=0)
    assert narrow.psis(warn=False).k_hat > 0.7
    assert _gaussian_alarms(narrow)  # judged at 100 per chain
    fewer = bp.Posterior(
        samples={k: v[:, :99] for k, v in narrow.samples.items()},
        model=_regression,
        method="laplace",
        sample_stats={"log_q": narrow.sample_stats["log_q"][:, :99]},
        x=blr.x,
        y=blr.y,
    )
    assert fewer.psis(warn=False).k_hat > 0.7 and not _gaussian_alarms(fewer)  # skipped at 99


@pytest.mark.parametrize("seed", range(5))
def test_a_good_gaussian_of_5_chains_of_100_draws_is_not_judged_far(seed):
    """q 1.2 times wider than the exact posterior: the largest k_hat of 5 chains of 100 draws exceeded 0.7 in 0 of
    1000 simulated runs (under 0.3% per run at 95%: benchmarks/results/psis_khat_noise/), so a false alarm at any of
    these 5 fixed seeds has probability under 1.5%. At 5 x 21, where the check used to judge, the rate is 25%."""
    blr = make_blr(n=20, d=2, noise=1.0, prior_scale=1.0)
    assert not _gaussian_alarms(_gaussian_draws(blr, 1.2, chains=5, draws=100, seed=seed))


def test_psis_warning_says_when_few_draws_per_chain_make_k_hat_noisy():
    blr = make_blr(n=20, d=2, noise=1.0, prior_scale=1.0)
    with pytest.warns(DiagnosticWarning, match=r"With 21 draws per chain k_hat itself is noisy.*>= 100 draws per"):
        _gaussian_draws(blr, 0.3, chains=5, draws=21, seed=0).psis()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _gaussian_draws(blr, 0.3, chains=5, draws=100, seed=0).psis()
    assert caught and not [w for w in caught if "itself is noisy" in str(w.message)]


@pytest.mark.parametrize(
    "target_accept, suggested",
    [(0.8, "now 0.8; e.g. 0.95"), (0.95, "now 0.95; e.g. 0.99"), (0.99, "prior (target_accept is already 0.99)")],
)
def test_the_divergence_warning_suggests_a_target_accept_above_the_one_that_ran(target_accept, suggested):
    """At 0.95 (subspace's inner NUTS) the advice was "now 0.95; e.g. 0.95": it must name a higher value, and none
    at 0.99 or above (review 12)."""
    diverging = torch.zeros(1, 100, dtype=torch.bool)
    diverging[0, :5] = True
    with pytest.warns(DiagnosticWarning, match=re.escape(suggested)):
        health_mixing.check_sampler("nuts", {}, {"diverging": diverging}, target_accept=target_accept)


def test_the_descent_check_reads_the_elbo_windows_from_their_one_home(monkeypatch):
    """``ELBO_WINDOW`` and ``ELBO_MIN_WINDOW`` live in ``_health`` and are read there at call time, so a change reaches
    ``health_spread.check_descent`` too (it imported them by value once, which a monkeypatch of ``_health`` missed).
    A potential flat at 0 for 90 steps, then 9 for the last 10 (2 coordinates): over the default window (the last 10
    steps) it ended 9 above its start, more than P = 2, and warns; over the last half it ended 1.8 above and passes;
    with a minimum window of 60 steps the 100-step run is too short to judge."""
    potential = torch.cat([torch.zeros(90), torch.full((10,), 9.0)])[None]

    def post():
        return bp.Posterior(
            samples={"b": torch.zeros(1, 5, 2)},
            model=lambda x, y=None: None,
            method="snapshot",
            history={"potential": potential},
        )

    with pytest.warns(DiagnosticWarning, match="chain 0 diverged"):
        health_spread.check_descent(post())
    for name, value in (("ELBO_WINDOW", 0.5), ("ELBO_MIN_WINDOW", 60)):
        with monkeypatch.context() as patched:
            patched.setattr(_health, name, value)
            _quiet(lambda: health_spread.check_descent(post()))
