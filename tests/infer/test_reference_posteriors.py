"""The reference suite: posteriordb-style posteriors (``tests/reference``: eight schools non-centered, a regression on
badly scaled covariates, a logistic regression) with exact means and sds computed by quadrature, independently of
this library (``tests/reference/generate.py``). NUTS must match them within Monte Carlo error; SVI at its defaults
must match them within what its Gaussian guide can represent, or warn.

Tolerances. NUTS: each mean within :data:`Z_MAX` Monte Carlo standard errors (the ESS of the draws, ArviZ), each sd
too (ArviZ's MCSE of the sd): 4 is a two-sided 6e-5 tail per comparison, 2e-3 for the 34 comparisons together.
SVI is not a sampler: its error is the guide's bias plus the Monte Carlo error of its draws. A full-rank guide is
checked against what a correct full-rank guide gives (the KL-optimal Gaussian in the engine's unconstrained
coordinates, computed here from the model's density, ``reference/kl_optimum.py``) within 4 Monte Carlo standard errors
of its draws (:func:`_optimum_off` states the derivation): on kidiq and logistic that optimum is within 0.01 sd and
1% of the exact moments, so a guide 30% too wide fails there (the old factor 1.5 let it pass). The other guides keep
:data:`APPROX_MEAN` (0.25 posterior sd) and :data:`APPROX_SD` (a factor 1.5 either way): there the question is whether
the fit is close enough to the exact posterior to go unwarned, a judgement of usefulness rather than a derived Monte
Carlo bound (a mean-field guide on a correlated Gaussian is, by its own optimum, 1 / sqrt(Sigma_ii Lambda_ii) too
narrow: ~7x on kidiq, so its rule is "warn"). Eight schools' other guides are checked like the full-rank one,
against their own family's optimum (:data:`OTHER_GUIDES`).
"""

from __future__ import annotations

import warnings

import arviz as az
import numpy as np
import pyro
import pytest
import torch
from reference.kl_optimum import kl_optimum, laplace_moments, log_joint, positive
from reference.posteriors import ALL, flat_draws, kidiq

import bnn_pyro as bp
from bnn_pyro.infer import health_spread, svi_refine, svi_start
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

Z_MAX = 4.0
APPROX_MEAN = 0.25
APPROX_SD = 1.5


def _errors(ref, post):
    d = flat_draws(post)
    mean = d.mean((0, 1))
    sd = d.reshape(-1, d.shape[-1]).std(0)
    return (mean - ref.mean) / ref.sd, sd / ref.sd, d


def _fit(ref, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(ref.model, ref.x, ref.y, seed=0, progress=False, **kw)
    return post, [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_nuts_matches_the_references_within_monte_carlo_error(name):
    ref = ALL[name]()
    post, _ = _fit(ref, method="nuts", num_samples=500, num_warmup=500, num_chains=2)
    with warnings.catch_warnings(record=True) as caught:  # exact draws: check_typical must not flag them (bp.fit runs
        warnings.simplefilter("always", DiagnosticWarning)  # it for approximations only; eight schools is skewed)
        health_spread.check_typical(post)
    assert not caught, [str(w.message) for w in caught]
    _, _, d = _errors(ref, post)
    for i, label in enumerate(ref.names):
        ess = az.ess(d[..., i], method="mean")
        z_mean = (d[..., i].mean() - ref.mean[i]) / (ref.sd[i] / np.sqrt(ess))
        z_sd = (d[..., i].std() - ref.sd[i]) / az.mcse(d[..., i], method="sd")
        assert abs(z_mean) < Z_MAX and abs(z_sd) < Z_MAX, (label, z_mean, z_sd, ess)


def _off(ref, post):
    """The coordinates where the guide does not match the reference (means and sds, module docstring):
    ``(name, mean error in sd, sd ratio)``."""
    z, ratio, _ = _errors(ref, post)
    return [
        (n, round(float(a), 2), round(float(b), 2))
        for n, a, b in zip(ref.names, z, ratio)
        if not (abs(a) <= APPROX_MEAN and 1 / APPROX_SD <= b <= APPROX_SD)
    ]


def _optimum_off(ref, post, optimum):
    """The coordinates where a guide's draws are off what a correct guide of its family gives (the KL-optimal
    Gaussian of the family in the engine's unconstrained coordinates, :func:`reference.kl_optimum.kl_optimum`), ``(name, z, ratio,
    z bound, ratio bound)``. Derivation, per parameter: the reference is exact (quadrature error below 1e-6 sd), so its
    Monte Carlo error is zero; the optimum's own error is the spread of two quasi-Monte Carlo estimates of it (two
    Sobol scramblings, ``optimum["qmc"]``); the engine's N independent draws from its guide put their mean within
    ``Z_MAX * r / sqrt(N)`` exact sds of the guide's mean, and their sd within ``Z_MAX * r * sqrt((kurt - 1) / (4 N))``
    (the delta method on the sample variance, whose sd is ``sd^2 sqrt((kurt - 1) / N)``; kurt is 3 for a Gaussian
    coordinate, the log-normal's for a positive one) of the guide's sd, r being the optimum's sd ratio."""
    z, ratio, d = _errors(ref, post)
    n = d.shape[0] * d.shape[1]
    r, kurt = optimum["ratio"], optimum["kurt"]
    z_bound = Z_MAX * r / np.sqrt(n) + optimum["qmc"]
    r_bound = Z_MAX * r * np.sqrt((kurt - 1) / (4 * n)) + optimum["qmc"]
    return [
        (name, round(float(a), 3), round(float(b), 3), round(float(zb), 3), round(float(rb), 3))
        for name, a, b, a0, b0, zb, rb in zip(ref.names, z, ratio, optimum["z"], r, z_bound, r_bound)
        if not (abs(a - a0) <= zb and abs(b - b0) <= rb)
    ]


def _optimum(ref, family="full_rank"):
    one, two = kl_optimum(ref, family=family, seed=0), kl_optimum(ref, family=family, seed=1)
    qmc = np.maximum(np.abs(one["z"] - two["z"]), np.abs(one["ratio"] - two["ratio"]))
    return {**one, "qmc": qmc}


@pytest.mark.parametrize("name", list(ALL))
def test_the_hand_written_log_joints_are_the_models(name):
    """:func:`reference.kl_optimum.log_joint` (the derivation's density) against Pyro's trace of the model, with the
    log-Jacobian of ``exp`` for the positive parameters, at the exact means and at a point 1 sd off."""
    ref = ALL[name]()
    pos = positive(ref)
    for shift in (0.0, 1.0):
        v = ref.mean + shift * ref.sd * np.where(np.arange(len(ref.names)) % 2, 1, -1)
        u = np.where(pos, np.log(np.abs(v)), v)
        sites, i = {}, 0
        trace = pyro.poutine.trace(ref.model).get_trace(ref.x, ref.y)
        for site, node in trace.nodes.items():
            if node["type"] == "sample" and not node["is_observed"] and site != "data":
                k = node["value"].numel()
                sites[site] = torch.as_tensor(v[i : i + k], dtype=torch.float32).reshape(node["value"].shape)
                i += k
        cond = pyro.poutine.trace(pyro.poutine.condition(ref.model, sites)).get_trace(ref.x, ref.y)
        pyro_lp = float(cond.log_prob_sum()) + float(u[pos].sum())
        ours = float(log_joint(ref, torch.as_tensor(u, dtype=torch.float64)[None])[0])
        assert i == len(ref.names) and abs(pyro_lp - ours) < 1e-4 * abs(ours), (shift, pyro_lp, ours)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
def test_full_rank_svi_at_its_defaults_matches_the_references(name):
    """The defaults a user gets (Laplace start, 5,000 steps): a full-rank guide matches what a correct full-rank guide
    gives (its known error plus the draws' Monte Carlo error, :func:`_optimum_off`) without warnings, or it is off and
    says so with the pinned warning (:data:`FULL_RANK`). Before the Laplace start the regressions ended hundreds of sd
    away (a coefficient of -216 where it is 0.49)."""
    ref = ALL[name]()
    post, messages = _fit(ref, method="svi", guide="full_rank")
    bad = _optimum_off(ref, post, _optimum(ref))
    says = FULL_RANK[name]
    if says == "matches":
        assert not bad and not messages, (bad, messages)
    else:  # off, and the warning that says the guide stopped short (nothing off means fixed: the table must say so)
        assert bad and any(m.startswith("svi: ") and says in m for m in messages), (bad, messages)


FULL_RANK = {
    "eight_schools": "matches",
    "kidiq": "matches",
    "logistic": "matches",
}
"""Full-rank SVI at its defaults against the KL-optimal full-rank Gaussian (:func:`_optimum_off`): ``"matches"``
(nothing off, no warning), or the phrase of the warning that says what is off (pinned, as in :data:`OTHER_GUIDES`).
Eight schools (seed 0) was pinned "stopped short of its best fit": 5,000 steps of one-particle Adam from the joint mode
did not reach the optimum on its funnel (the means of tau and theta_tilde[0, 1, 6] ended 0.24, 0.13, 0.16 and 0.14
exact sds from the optimum's, where the draws' Monte Carlo error allows 0.10-0.13; seeds 1, 3 and 4 missed too; 20,000
steps matched at seed 0), because the cosine schedule freezes the guide wherever it is at the end. The fit now ends
with fixed-point iterations of Gaussian VI from exact Hessians (:mod:`bnn_pyro.infer.svi_refine`), which take the
guide the rest of the way: seeds 0-4 all match, silently (``benchmarks/results/svi_convergence/``). Not loosened: the
bound is derived, and the fit now reaches it."""


OTHER_GUIDES = {
    ("mean_field", "eight_schools"): "matches",  # (and says the guide is up to 1.9x too narrow at the mode)
    ("mean_field", "kidiq"): "too narrow",  # intercept and IQ slope correlate at -0.99: ~7x too narrow
    ("mean_field", "logistic"): "too narrow",  # ~4.7x
    **{("low_rank", n): "matches" for n in ALL},
}
"""What the other guides do at their defaults: ``"matches"`` (nothing off; a note may come), or the phrase of the
warning that says what is off (pinned, so that a warning about something else cannot excuse a fit that is off).
"matches" on eight schools is derived: every parameter within the Monte Carlo error of what a correct guide of that
family gives (:func:`_optimum_off`; that optimum is within 0.04 sd and 5% of the exact moments but for tau, whose
log-normal under a Gaussian in log tau is 23% (mean-field) and 16% (low-rank) too narrow). Low-rank at the defaults
missed that optimum at seeds 1-4 before its refinement (:mod:`bnn_pyro.infer.svi_refine`) and matches at seeds 0-4
with it (``benchmarks/results/svi_convergence/eight_schools_low_rank_refined.md``). On kidiq and logistic
"matches" is :data:`APPROX_MEAN` and :data:`APPROX_SD` against the exact moments: the wide factor stays there, as a
judgement of whether the fit is close enough to go unwarned (a mean-field guide's own optimum on a correlated Gaussian
is 1 / sqrt(Sigma_ii Lambda_ii) too narrow, ~7x on kidiq, so its rule is "warn"); the low-rank optimum of those two is
not derived here (its search in the Laplace-scaled coordinates does not converge within a test's time)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("guide", ["mean_field", "low_rank"])
def test_other_guides_at_their_defaults_match_or_warn(name, guide):
    ref = ALL[name]()
    post, messages = _fit(ref, method="svi", guide=guide)
    if name == "eight_schools":
        bad = _optimum_off(ref, post, _optimum(ref, guide))
    else:
        bad = _off(ref, post)
    says = OTHER_GUIDES[guide, name]
    if says == "matches":
        assert not bad, (bad, messages)
    else:
        assert bad and any(m.startswith("svi: ") and says in m for m in messages), (bad, messages)


def _matches_moments(ref, post, expected):
    """Where the draws are off ``expected`` (:func:`reference.kl_optimum.reported`'s ``z``, ``ratio``, ``kurt``) by
    more than ``Z_MAX`` Monte Carlo standard errors of N independent draws (:func:`_optimum_off`'s derivation, with no
    quadrature term: ``expected`` is in closed form)."""
    return _optimum_off(ref, post, {**expected, "qmc": np.zeros(len(ref.names))})


def test_laplace_start_is_the_guides_start(monkeypatch):
    """With init='laplace' (the default for a Pyro function) a full-rank guide starts at the mode with the inverse
    Hessian as its covariance, and a mean-field guide with 1/sqrt(diag H): checked on the kidiq-style regression
    against the Laplace approximation at the exact mode (:func:`reference.kl_optimum.laplace_moments`: sigma's mean
    0.20 sd low, its sd 2% narrow, a property of the approximation that the SVI steps then correct; the mean-field one
    0.14x and 0.14x the exact sds of the correlated intercept and IQ slope), within 4 MCSE of the 4,000 draws. The
    refinement after the one step (svi_refine) is switched off: it takes the guide to its optimum (sigma's sd then
    read 0.977-0.982 of the Laplace one, outside the 4 MCSE), and this test is of the start."""
    monkeypatch.setattr(svi_refine, "refine", lambda *args, **kwargs: None)
    ref = kidiq()
    one = dict(method="svi", num_steps=1, lr=1e-9, lr_schedule="constant", num_samples=4000)
    full, _ = _fit(ref, guide="full_rank", **one)
    assert full.config["init"] == "laplace" and full.config["init_converged"]
    bad = _matches_moments(ref, full, laplace_moments(ref))
    assert not bad, bad
    mf, messages = _fit(ref, guide="mean_field", **one)
    bad = _matches_moments(ref, mf, laplace_moments(ref, mean_field=True))
    assert not bad, bad
    assert any("too narrow" in m and "full_rank" in m for m in messages), messages


def test_low_rank_starts_with_the_laplace_correlations():
    """A low-rank guide's start holds the Laplace covariance's leading correlation (not W = 0, a saddle of the ELBO):
    on kidiq its draws at the start have the reference sds of the correlated intercept and IQ slope, not the ~7x
    narrower mean-field ones, and no narrowness warning (that is for mean-field guides)."""
    ref = kidiq()
    post, messages = _fit(
        ref, method="svi", guide="low_rank", num_steps=1, lr=1e-9, lr_schedule="constant", num_samples=4000
    )
    z, ratio, _ = _errors(ref, post)
    assert np.abs(z[:3]).max() < 0.15 and np.abs(ratio[:3] - 1).max() < 0.25, (z, ratio)
    assert not any("too narrow" in m for m in messages), messages


def test_the_old_start_is_still_there_and_its_advice_fits_a_pyro_function():
    """init='prior' is the old default: on kidiq it stays far from the posterior after 1,000 steps, and the warning
    gives advice for a Pyro function model (the mean-field wide-net advice does not fit it)."""
    ref = kidiq()
    post, messages = _fit(ref, method="svi", guide="full_rank", init="prior", num_steps=1000, num_samples=200)
    z, _, _ = _errors(ref, post)
    assert np.abs(z).max() > 10
    assert messages and any("init='laplace'" in m and "standardized covariates" in m for m in messages), messages
    assert not any("wide net" in m for m in messages)


def test_laplace_start_bad_input_and_large_models():
    ref = kidiq()
    start = svi_start.laplace_start(ref.model, bp.infer.training_data.Data(ref.x, ref.y))
    assert start.converged and start.cov.shape == (4, 4) and start.mean_field_shrink() > 5
    with pytest.raises(ValueError, match=r"init: unknown value 'laplce'"):
        bp.fit(ref.model, ref.x, ref.y, method="svi", init="laplce", num_steps=1, progress=False)


def test_bnn_defaults():
    """A BNN keeps init='reset' (the Laplace start is opt-in there: a BNN's Hessian at a MAP is rarely positive
    definite in float32) and runs 5,000 steps by default (benchmarks/results/svi_defaults/results.md)."""
    net = torch.nn.Linear(1, 1)
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.5))
    x = torch.linspace(-1, 1, 20)[:, None]
    post = bp.fit(model, x, x[:, 0], method="svi", num_samples=5, progress=False)
    assert post.config["init"] == "reset" and post.config["num_steps"] == 5000
