"""Every engine at its defaults on the reference suite (``tests/reference``: exact means and sds computed independently
of this library): it matches the exact posterior, or its fit warns (``DiagnosticWarning``), or it refuses the model
with an error that says what to use. ``test_reference_posteriors.py`` holds NUTS's and SVI's guides' checks; this
module the other engines: the samplers and SG-MCMC on the plain Pyro models (the engines with
``Capabilities.function_model``) and the engines that take either kind of model (SWA, SWAG, ensembles, Laplace,
snapshot ensembles; subspace refuses a Pyro function), and every engine that needs or takes a ``bp.BNN`` on the two
BNN references (Bayesian linear regression, conjugate; the logistic regression as ``nn.Linear(2, 1)``, the same
posterior as the plain model's, so the same quadrature reference).

What "matches" means, per engine family (``Z_MAX`` = 4 Monte Carlo standard errors: a two-sided 6e-5 tail):

- **MCMC with an accept/reject or exact-dynamics kernel** (HMC, Metropolis, MALA): unbiased, so NUTS's rule: every
  mean and sd within ``Z_MAX`` Monte Carlo standard errors (ArviZ's ESS of the mean, its MCSE of the sd).
- **SG-MCMC** (SGLD, SG-HMC, cyclical SG-MCMC): no accept/reject step, so the draws target a distribution biased by
  the step size (Welling & Teh 2011; Vollmer et al. 2016: the bias is first order in the step): the bias may reach
  the approximations' :data:`APPROX_MEAN` (0.25 posterior sd) and :data:`APPROX_SD` (a factor 1.5), on top of the
  Monte Carlo error of the draws.
- **Approximations and point-fit ensembles** (ensemble, Laplace, SWA, SWAG, snapshot, MC dropout, variational and
  sparse variational dropout, subspace): the same bias bounds, on top of the Monte Carlo error of as many
  draws as the engine returns (an ensemble's 5 members are 5 draws: even exact draws would put its mean up to
  ``Z_MAX / sqrt(5)`` = 1.8 sd away by chance, so few draws test little, and that is stated, not hidden). An sd of
  zero (one point) never matches.

What each engine does on each reference today is pinned (:data:`SAMPLER_OUTCOMES`, :data:`BNN_OUTCOMES`,
:data:`POINT_FIT_OUTCOMES`), so that a warning about something else cannot excuse a fit that is off: ``"matches"``
(nothing outside the rule; warnings about other things may come), ``"warns: PHRASE"`` (something is off, and a
warning of this engine says PHRASE, the check that names the problem: "too narrow", "spread is not this model's
posterior", "far from the fitted Gaussian", "diverged", "holds too little of the posterior's spread"),
``"refuses"`` (a clear error, checked where it is raised), or ``"silent miss"`` (off, and no warning of this engine says so: a known defect, named in the table's
comment, pinned so that its fix shows). A change of outcome fails the test: update the table with the reason.

Each fit runs at the engine's defaults (``bp.fit(model, x, y, method=m, seed=0)``); the MCMC engines with a smaller
``num_samples`` (:data:`MCMC_DRAWS`; the warm-up follows it by the default rule), which changes the Monte Carlo error
(the rule uses the ESS of the draws kept) but not the algorithm. ``benchmarks/reference_suite.py`` runs the same
matrix with every default and reports each engine's errors and fit time (``docs/reference_suite.md``).
"""

from __future__ import annotations

import warnings

import pytest
from reference.posteriors import ALL, BNN_REFERENCES, biased_off, exact_off, judge

import bnn_pyro as bp
from bnn_pyro.infer.registry import REGISTRY, Method
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

MCMC_DRAWS = 250
"""``num_samples`` of the MCMC engines here (their default warm-up rule, as many warm-up iterations as draws, and 4
chains kept): an ESS in the hundreds on these posteriors, so a bias of 0.3 sd is > 4 MCSEs."""

_CAN = {m.value: d.capabilities for m, d in REGISTRY.items()}
SAMPLERS = [m for m, c in _CAN.items() if c.markov_chain and not c.minibatches and m != "nuts"]
SG_MCMC = [m for m, c in _CAN.items() if c.markov_chain and c.minibatches]
BNN_ENGINES = [m for m, c in _CAN.items() if not c.function_model]
LAYER_ENGINES = [m for m, c in _CAN.items() if c.layers]


MATCHES, SILENT = "matches", "silent miss"


def _warns(says: str) -> str:
    return f"warns: {says}"


NARROW, NOT_POSTERIOR = _warns("too narrow"), _warns("spread is not this model's posterior")
SUBSPACE_SHORT = _warns("holds too little of the posterior's spread")
"""Subspace inference whose ``k`` directions cannot hold some weight's spread (``check_subspace``): structural, so
said at fit time with the fraction held and the ``subspace_dim`` that would hold it."""


def _assert_outcome(expected: str, method: str, name: str, bad: list, messages: list[str]) -> None:
    """The fit's outcome is the pinned one (module docstring)."""
    where = f"{method} on {name}"
    own = [m for m in messages if m.startswith(f"{method}: ")]
    if expected == MATCHES:
        assert not bad, (
            f"{where}: pinned as matching, but off (name, error, sd error or ratio): {bad}; said: {messages}"
        )
    elif expected == SILENT:
        assert bad, f"{where}: pinned as a silent miss, but it matches now: update the table"
        assert not own, f"{where}: pinned as a silent miss, but it warns now ({own}): update the table"
    else:
        says = expected.removeprefix("warns: ")
        assert bad, f"{where}: pinned as off (warned: {says!r}), but it matches now: update the table ({messages})"
        assert any(says in m for m in own), (
            f"{where}: off ({bad}), and no warning of {method} says {says!r}: {messages}"
        )


def _fit(ref, method, **kw):
    if method in SAMPLERS:
        kw = {"num_samples": MCMC_DRAWS, **kw}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(ref.model, ref.x, ref.y, method=method, seed=0, progress=False, **kw)
    messages = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    # the one-chain note (R-hat undefined) is said of every one-chain fit, whatever its draws: it does not count as
    # a warning about this fit (SG-MCMC runs one chain by default)
    return post, [m for m in messages if not m.startswith(f"{method}: with one chain R-hat is undefined")]


FEW_DRAWS = _warns("bulk ESS")
"""An MCMC fit whose draws are too few for the rule: the effective-sample-size check says so (its Monte Carlo errors
exceed 10% of the posterior sd), naming the worst coordinate."""

SAMPLER_OUTCOMES = {
    **{(m, n): MATCHES for m in SAMPLERS + SG_MCMC for n in ALL},
    ("metropolis", "eight_schools"): FEW_DRAWS,  # mu's sd 4.3 MCSEs off; bulk ESS 9
    ("mala", "eight_schools"): FEW_DRAWS,  # theta_tilde[6]'s mean 4.4 MCSEs off; bulk ESS 35
}
"""What the samplers do at their defaults (``num_samples=MCMC_DRAWS``) on the Pyro-function references."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("method", SAMPLERS + SG_MCMC)
def test_samplers_at_their_defaults_match_the_references_or_warn(method, name):
    ref = ALL[name]()
    post, messages = _fit(ref, method)
    bad = exact_off(ref, post) if method in SAMPLERS else biased_off(ref, post)
    _assert_outcome(SAMPLER_OUTCOMES[method, name], method, name, bad, messages)


BNN_OUTCOMES = {
    ("swa", "linear"): NOT_POSTERIOR,
    ("swa", "logistic"): NOT_POSTERIOR,
    ("swag", "linear"): NARROW,
    ("swag", "logistic"): NARROW,
    ("mc_dropout", "linear"): NOT_POSTERIOR,
    ("mc_dropout", "logistic"): NOT_POSTERIOR,
    ("variational_dropout", "linear"): MATCHES,  # (and says its draws are too narrow: 0.57 of the Laplace sd)
    ("variational_dropout", "logistic"): NARROW,
    ("sparse_vd", "linear"): MATCHES,  # (the same note)
    ("sparse_vd", "logistic"): NARROW,
    ("ensemble", "linear"): MATCHES,
    ("ensemble", "logistic"): NARROW,
    ("laplace", "linear"): MATCHES,
    ("laplace", "logistic"): MATCHES,
    ("snapshot", "linear"): MATCHES,  # (and says its 5 draws are too narrow)
    ("snapshot", "logistic"): _warns("diverged"),
    ("subspace", "linear"): SUBSPACE_SHORT,  # subspace_dim=2 of 3 weights: weight[1]'s sd 0.36 of the exact one (a
    # silent miss before check_subspace: 13% of its variance lies in the subspace, exactly the draws' 0.36^2)
    ("subspace", "logistic"): MATCHES,  # (and says the subspace holds 40-45% of bias[0]'s and weight[0]'s Laplace
    # variance, sds 0.64-0.67: the draws' 0.67-0.72 of the exact sds sit just inside the 1.5 bound)
}
"""What every engine that takes a ``bp.BNN`` does at its defaults on the two BNN references (subspace with
``subspace_dim=2``: at its default it uses all 3 weights, the whole weight space, so it is NUTS with an SWA run in
front; a given ``subspace_dim=10`` is refused)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BNN_REFERENCES))
@pytest.mark.parametrize("method", BNN_ENGINES)
def test_bnn_engines_at_their_defaults_match_the_references_or_warn(method, name):
    ref = BNN_REFERENCES[name]()
    if method == "subspace":  # a given subspace_dim=10 exceeds these models' 3 weights: a clear refusal, then
        with pytest.raises(ValueError, match=r"subspace_dim=10 exceeds the number of weights with a prior \(3\)"):
            _fit(ref, method, subspace_dim=10)
        post, messages = _fit(ref, method, subspace_dim=2)  # a true subspace (2 of 3), the other defaults kept
    else:
        post, messages = _fit(ref, method)
    _assert_outcome(BNN_OUTCOMES[method, name], method, f"{name} (BNN)", biased_off(ref, post), messages)


POINT_FITS = [m for m, c in _CAN.items() if not c.function_model and not c.layers]
"""The engines that take a ``bp.BNN`` or a Pyro function alike, with no layers to act on (SWA, SWAG, ensembles,
Laplace, snapshot ensembles, subspace): each must match, warn about, or clearly refuse the plain-model references."""


POINT_FIT_OUTCOMES = {
    **{("swa", n): NOT_POSTERIOR for n in ALL},
    **{("swag", n): MATCHES for n in ALL},  # (eight schools: and says too narrow, chains disagree)
    **{("ensemble", n): MATCHES for n in ALL},  # (eight schools: and says the draws are far from the mass)
    ("laplace", "eight_schools"): _warns("far from the fitted Gaussian"),  # (LAPLACE_ON_FUNCTIONS, below)
    ("laplace", "kidiq"): MATCHES,
    ("laplace", "logistic"): MATCHES,
    **{("snapshot", n): MATCHES for n in ALL},
    **{("subspace", n): "refuses" for n in ALL},
}
"""What the engines that take either kind of model do at their defaults on the Pyro-function references."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("method", POINT_FITS)
def test_point_fit_engines_on_pyro_functions_match_warn_or_refuse_clearly(method, name):
    """Before ``check_typical`` the ensemble (171 posterior sds) and SWAG (4,899) were silently off on kidiq
    (``benchmarks/results/reference_suite/function_defaults.md``). A refusal must name what to use."""
    ref = ALL[name]()
    expected = POINT_FIT_OUTCOMES[method, name]
    if expected == "refuses":  # an engine that needs a network's weights: it says so and what to use, before any work
        with pytest.raises(TypeError, match=rf"method='{method}' needs a bnn_pyro\.BNN .*wrap the net as bp\.BNN"):
            _fit(ref, method)
        return
    post, messages = _fit(ref, method)
    _assert_outcome(expected, method, name, biased_off(ref, post), messages)


LAPLACE_ON_FUNCTIONS = {"eight_schools": "warns", "kidiq": "matches", "logistic": "matches"}
"""What Laplace at its defaults does on each Pyro-function reference (``docs/reference_suite.md``). Before the exact
Hessian and ``check_gaussian``: eight schools' ``tau`` 16 posterior sds off (the empirical Fisher's sd 23x the exact
one), silently; kidiq a ``RuntimeError`` from L-BFGS's line search (a step size past float range)."""


@pytest.mark.parametrize("name", list(ALL))
def test_laplace_on_the_pyro_function_references_matches_or_says_the_posterior_is_not_gaussian(name):
    """Laplace at its defaults on a Pyro function (``structure="full"``, ``hessian="exact"``, from the prior
    median): on kidiq (an IQ-like covariate near 100) and the logistic regression the Gaussian at the mode matches
    the exact posterior, and no warning says otherwise; on eight schools the joint mode of the non-centered model
    sits at ``tau`` ~29 where the posterior mean is 3.6, the Gaussian there is 14 posterior sds off, and the fit says
    so (PSIS ``k_hat`` > 0.7), naming ``tau`` and what to use (the sds of ``theta_tilde`` are 0.4-0.6 of the exact
    ones too)."""
    ref = ALL[name]()
    post, messages = _fit(ref, "laplace")
    assert post.config["hessian"] == "exact" and post.config["structure"] == "full", post.config
    bad = biased_off(ref, post)
    gaussian = [m for m in messages if "far from the fitted Gaussian" in m]
    if LAPLACE_ON_FUNCTIONS[name] == "matches":
        assert not bad and not messages, (bad, messages)
    else:
        off = {b[0]: b[1] for b in bad}  # the check below is not vacuous: the fit is off, tau above all
        assert abs(off.get("tau", 0.0)) > 10 and max(off, key=lambda k: abs(off[k])) == "tau", bad
        assert len(gaussian) == 1 and "tau (unconstrained)" in gaussian[0] and "method='nuts'" in gaussian[0], messages


def test_laplace_from_a_prior_draw_on_badly_scaled_covariates_refuses_clearly():
    """kidiq from a draw of its N(0, 100) priors (``init="prior"``, the default before): the first-order search
    ends ~1e6 nats above the mode and L-BFGS's line search overflows; that raised an unexplained ``RuntimeError``
    ("value cannot be converted to type float without overflow"). Now the polish keeps its start and the fit stops
    with an error that names the start and what to pass."""
    ref = ALL["kidiq"]()
    with pytest.raises(ValueError, match=r"exact Hessian.*not positive definite.*hessian='fisher'.*init='median'"):
        bp.fit(ref.model, ref.x, ref.y, method="laplace", init="prior", seed=0, progress=False)


@pytest.mark.parametrize("method", LAYER_ENGINES + ["subspace"])
def test_engines_that_need_a_bnn_refuse_a_pyro_function_clearly(method):
    """A Pyro function model has no layers (dropout, variational dropout) and no weight vector to span a subspace:
    the fit stops before any work with an error that names bp.BNN and what to use instead."""
    ref = ALL["kidiq"]()
    with pytest.raises(TypeError, match=r"bp\.BNN|bnn_pyro\.BNN") as err:
        bp.fit(ref.model, ref.x, ref.y, method=method, seed=0, progress=False)
    assert "method=" in str(err.value) or "wrap" in str(err.value).lower(), str(err.value)


def test_the_bnn_references_are_the_plain_models_posteriors():
    """The BNN logistic regression is the plain model's posterior: at any weights, the BNN's log joint equals the
    plain model's (same priors, same likelihood), so the quadrature reference applies to both."""
    import pyro
    import torch
    from pyro import poutine

    plain, net = ALL["logistic"](), BNN_REFERENCES["logistic"]()
    beta = torch.tensor([-2.5, 0.7, 0.06])
    values = {"weight": beta[1:].reshape(1, 2), "bias": beta[:1]}
    with pyro.get_param_store().scope():
        t_net = poutine.trace(poutine.condition(net.model, values)).get_trace(net.x, net.y)
        t_plain = poutine.trace(poutine.condition(plain.model, {"beta": beta})).get_trace(plain.x, plain.y)
    assert torch.allclose(t_net.log_prob_sum(), t_plain.log_prob_sum(), rtol=1e-6), (
        t_net.log_prob_sum(),
        t_plain.log_prob_sum(),
    )
    assert set(Method) >= {Method(m) for m in BNN_ENGINES} and len(BNN_ENGINES) == 9, BNN_ENGINES


@pytest.mark.parametrize(
    "method, options, says",
    [
        ("swa", dict(num_steps=40), "one draw per chain"),
        ("mc_dropout", dict(num_steps=20, num_samples=10), "set by p"),
    ],
)
def test_engines_whose_spread_is_not_the_posterior_say_so_at_fit_time(method, options, says):
    """SWA (one point per chain) and MC dropout (masks at a fixed rate) were silently off on Bayesian linear regression
    (SWA's sd 0; MC dropout's means 6 sd off): every fit now says that its spread is not the posterior's, at the
    user's line, with what to use instead."""
    ref = BNN_REFERENCES["linear"]()
    with pytest.warns(DiagnosticWarning, match="spread is not this model's posterior") as record:
        bp.fit(ref.model, ref.x, ref.y, method=method, seed=0, progress=False, **options)
    (w,) = [w for w in record if "spread is not" in str(w.message)]
    text = str(w.message)
    assert text.startswith(f"{method}: ") and says in text and "method='nuts'" in text, text
    assert w.filename == __file__


def test_a_mean_field_bnn_fit_too_narrow_for_its_curvature_says_so_and_a_full_rank_one_does_not():
    """Mean-field SVI on the linear BNN (coefficients correlated at -0.82) has sds 0.57 of the exact ones, which no
    amount of fitting changes (1 / sqrt(H_ii) against sqrt(cov_ii)); it was silent. A full-rank guide is not flagged."""
    ref = BNN_REFERENCES["linear"]()
    post, messages = _fit(ref, "svi", num_steps=1500, num_samples=400)
    assert judge(ref, post)["ratio"].min() < 0.62, judge(ref, post)["ratio"]
    assert any("too narrow" in m and "weight[" in m and "full_rank" in m for m in messages), messages
    post, messages = _fit(ref, "svi", guide="full_rank", num_steps=1500, num_samples=400)
    assert not biased_off(ref, post) and not any("too narrow" in m for m in messages), messages


def test_a_diverged_sgd_run_says_so():
    """SGLD at its defaults on the logistic BNN (an age-like covariate near 40: uneven curvature) ended 10^5 posterior
    sds away, silently; the fit now says its potential ended above its start."""
    ref = BNN_REFERENCES["logistic"]()
    post, messages = _fit(ref, "sgld", num_samples=100, num_warmup=400)
    assert biased_off(ref, post), judge(ref, post)["z"]  # the run diverged: the check below is not vacuous
    assert any("diverged" in m and "Standardize the inputs" in m for m in messages), messages
