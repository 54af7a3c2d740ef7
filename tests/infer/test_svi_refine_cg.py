"""The mean's Newton step past svi_refine's bounds (bnn_pyro/infer/svi_refine_cg.py), on the conjugate regression of
test_svi_gap_cg.py (120 coefficients, 400 rows: past MAX_DIM and MAX_WORK), whose posterior is Gaussian: there ``H``
is its precision at every draw and the antithetic draws' mean gradient is exact, so one step puts a guide's mean on
the exact posterior mean (every Gaussian family's optimal mean) up to float32 rounding, with the covariance left as
it was. Off a Gaussian the ELBO on its draws never falls and the gap, measured on other draws, shrinks."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide
from test_svi_gap_cg import (  # the module beside this file
    CALLS,
    DIM,
    MOVE,
    _branching,
    _data,
    _full_rank,
    _guide_sd,
    _logistic,
    _low_rank,
    _mean_field,
    _model,
    _posterior,
    _raising,
    _two_coefficients,
)

import bnn_pyro as bp
from bnn_pyro.infer import _health, svi, svi_gap, svi_gap_cg, svi_refine_cg
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning


def _mean(guide):
    return (guide.locs.b if isinstance(guide, autoguide.AutoNormal) else guide.loc).detach().double()


def _moved(make, x, y, mean, precision, by):
    guide = make(x, y, mean, precision.diagonal() ** -0.5)
    with torch.no_grad():
        (guide.locs.b_unconstrained if isinstance(guide, autoguide.AutoNormal) else guide.loc).add_(
            (by * _guide_sd(guide)).float()
        )
    return guide


@pytest.mark.parametrize("make", [_mean_field, _low_rank, _full_rank], ids=["mean_field", "low_rank", "full_rank"])
def test_a_moved_guide_is_stepped_to_the_exact_mean_and_its_covariance_kept(make):
    x, y = _data()
    mean, precision = _posterior(x, y)
    with pyro.get_param_store().scope():
        guide = _moved(make, x, y, mean, precision, MOVE)
        sd = _guide_sd(guide)
        result = svi_refine_cg.refine_mean(guide, _model, Data(x, y))
        assert result.accepted == 1 and result.stopped == "fixed point" and result.elbo_change > 0, result
        assert float(((_mean(guide) - mean) / sd).abs().max()) < 1e-3  # float32 rounding and the solver's TOL
        assert torch.equal(_guide_sd(guide), sd)


def test_a_step_whose_last_evaluation_reaches_the_fixed_point_says_fixed_point(monkeypatch):
    """Where the evaluations run out at the one whose solve finds the fixed point (the Gaussian posterior's two: the
    step, then a solve that moves no coordinate by svi_refine.TOL), the record says "fixed point", not "evaluation
    limit" (review 24 finding 5: the loop ended before that solve's step was tested, and a warned fit got the
    evaluation limit's advice)."""
    x, y = _data()
    mean, precision = _posterior(x, y)
    path = svi_gap_cg.GapPath("cg", max_evaluations=2, step_hessian_draws=10, step_passes=1e12)
    monkeypatch.setattr(svi_gap_cg, "choose_path", lambda *args, **kwargs: path)
    with pyro.get_param_store().scope():
        guide = _moved(_full_rank, x, y, mean, precision, MOVE)
        result = svi_refine_cg.refine_mean(guide, _model, Data(x, y), fit_passes=1)
    assert result.accepted == 1 and result.stopped == "fixed point", result


def test_off_a_gaussian_the_elbo_on_its_draws_does_not_fall_and_the_gap_shrinks():
    """A logistic regression with 110 coefficients, a mean-field guide after 100 Adam steps (gaps up to ~0.5 guide
    sds): the step keeps the ELBO on its own draws, and the gap on the check's draws (seed 0, not the step's seed 1)
    falls to within a fifth of what it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 110, generator=g) * 2 / 110**0.5
    y = torch.bernoulli(torch.sigmoid(x @ torch.randn(110, generator=g)), generator=g)
    with pyro.get_param_store().scope():
        torch.manual_seed(0)
        guide = autoguide.AutoNormal(_logistic)
        svi = pyro.infer.SVI(_logistic, guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
        for _ in range(100):
            svi.step(x, y)
        before = svi_gap.newton_gap(guide, _logistic, Data(x, y)).gap
        result = svi_refine_cg.refine_mean(guide, _logistic, Data(x, y))
        after = svi_gap.newton_gap(guide, _logistic, Data(x, y)).gap
    assert result.accepted >= 1 and result.elbo_change >= 0, result
    assert float(before.abs().max()) > 0.3 and float(after.abs().max()) < float(before.abs().max()) / 5, (
        before.abs().max(),
        after.abs().max(),
    )


def test_a_default_fit_ends_at_the_optimum_and_is_silent():
    """Through ``bp.fit`` at its defaults for this model but 300 steps (the Laplace start, a mean-field guide): Adam
    left the mean 0.23 guide sds from the exact optimum (measured with the step switched off: the gap check warned);
    the step takes it there, its record says so, and the check, which ran, is silent. The fit's cost capped the step's
    solves at 63 iterations ((300 x 50,400 / 400 - 6,000) / 500; the scale step skipped, so nothing spent), and the
    record carries the cap (svi.ITERATIONS_CAP), as the dense refinement's carries its evaluations' (review 18)."""
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(
            _model, x, y, method="svi", guide="mean_field", num_steps=300, num_samples=5, seed=0, progress=False
        )
    (record,) = post.config["guide_refinement"]
    assert record["stopped"] == "fixed point" and record["accepted"] >= 1, record
    assert record["scale"]["passes"] == 0 and svi_gap_cg.choose_path(DIM, len(y), fit_passes=300).max_iterations == 63
    assert record[svi.ITERATIONS_CAP] == 63, record
    assert post.history[_health.GAP].shape == (1, DIM) and float(post.history[_health.GAP].abs().max()) < 1e-3
    assert not any("stopped short" in str(w.message) for w in caught)


def test_a_model_that_raises_leaves_the_guide_as_it_was_with_the_reason():
    x, y = _data()
    mean, precision = _posterior(x, y)
    with pyro.get_param_store().scope():
        start = torch.cat([torch.tensor([-4.98]).double(), mean[1:]])
        guide = _mean_field(x, y, start, precision.diagonal() ** -0.5)
        before = _mean(guide).clone()
        result = svi_refine_cg.refine_mean(guide, _raising, Data(x, y), num_draws=100)
        assert result.accepted == 0 and result.stopped.startswith("skipped: _LinAlgError"), result
        assert torch.equal(_mean(guide), before)


def test_a_guide_within_the_dense_bounds_or_of_another_family_is_not_covered():
    x, y = _data()
    with pyro.get_param_store().scope():
        guide = autoguide.AutoDelta(_model)
        guide(x, y)
        assert svi_refine_cg.refine_mean(guide, _model, Data(x, y)) is None

    with pyro.get_param_store().scope():
        guide = autoguide.AutoNormal(_two_coefficients)
        guide(x[:100], y[:100])
        assert svi_refine_cg.refine_mean(guide, _two_coefficients, Data(x[:100], y[:100])) is None


def test_a_model_vmap_cannot_batch_is_skipped_before_its_gradients():
    x, y = _data()
    mean, precision = _posterior(x, y)
    with pyro.get_param_store().scope():
        guide = _moved(_mean_field, x, y, mean, precision, MOVE)
        before = _mean(guide).clone()
        CALLS.clear()
        result = svi_refine_cg.refine_mean(guide, _branching, Data(x, y))
        assert result.accepted == 0 and "torch.func.vmap cannot batch the model" in result.stopped, result
        assert torch.equal(_mean(guide), before) and len(CALLS) < 50, len(CALLS)


def _regression(x, y=None):
    """``_model`` at any width: y_i ~ N(x_i . b, 1), b ~ N(0, I)."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def _default_fit(rows: int, *, dim: int = 150, logistic: bool = False, **options):
    """``bp.fit`` at its defaults (the full-rank guide of a Pyro function, the Laplace start) of a conjugate regression
    of ``dim`` coefficients (150: past svi_refine.MAX_DIM) on ``rows`` rows, or (``logistic``) the logistic regression
    of ``benchmarks/svi_full_rank_cg.py``, with the guide it ended with (spied at the gap)."""
    g = torch.Generator().manual_seed(0)
    if logistic:
        x = torch.randn(rows, dim, generator=g) * 2.0
        y = torch.bernoulli(torch.sigmoid(x @ (0.3 * torch.randn(dim, generator=g))), generator=g)
    else:
        x = torch.randn(rows, dim, generator=g) + 0.3 * torch.randn(rows, 1, generator=g)
        y = x @ torch.randn(dim, generator=g) + torch.randn(rows, generator=g)
    guides = []
    original = svi_gap.newton_gap

    def keep(guide, *args, **kwargs):
        guides.append(guide)
        return original(guide, *args, **kwargs)

    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("always", DiagnosticWarning)
        patch.setattr(svi_gap, "newton_gap", keep)
        model = _logistic if logistic else _regression
        post = bp.fit(model, x, y, method="svi", num_samples=5, seed=0, progress=False, **options)
    return post, guides, x, y, [str(w.message) for w in caught]


@pytest.mark.slow  # ~20 s: SVI's defaults (5,000 full-rank steps on 150 coefficients x 400 rows)
def test_a_default_full_rank_fit_past_the_dense_bounds_ends_at_the_exact_mean():
    """A default fit past the dense refinement's bounds (150 coordinates, 150 x 400 > svi_refine.MAX_WORK): Adam left
    the full-rank guide's mean 0.068 exact sds from the exact posterior mean and the gap check warned (0.064 guide sds
    at b[10]); the old code gave such a guide no refinement. The mean's step by conjugate gradients takes it there:
    on this Gaussian posterior its antithetic draws' mean gradient is exact, so its Monte Carlo error (the record's
    step_se, the gap's standard error from the same draws' antithetic pairs) is float rounding, under 1e-4 guide sds,
    and what is left is float32 rounding and the solver's TOL: within 1e-3 exact sds (as the factored guides' test
    above; measured 1e-5). The gap, the dense statistic on the step's draws (its standard error from their 500 pairs,
    the samples the check's Student's t counts), is silent."""
    post, (guide,), x, y, messages = _default_fit(400)
    assert post.config["guide"] == "full_rank" and isinstance(guide, autoguide.AutoMultivariateNormal)
    (record,) = post.config["guide_refinement"]
    assert record["accepted"] >= 1 and record["stopped"] == "fixed point", record
    assert "escalated_hessian_draws" not in record, (
        record
    )  # on a Gaussian posterior no candidate is rejected: 10 draws suffice
    assert record[svi.STEP_SE] < 1e-4, record
    design = x.double()
    precision = design.T @ design + torch.eye(150, dtype=torch.float64)
    mean = torch.linalg.solve(precision, design.T @ y.double())
    sd = torch.linalg.inv(precision).diagonal().sqrt()
    assert float(((guide.loc.detach().double() - mean) / sd).abs().max()) < 1e-3
    (gap,) = post.config["guide_gap"]
    assert gap == dict(method="dense", draws=svi_gap.GAP_DRAWS, pairs=svi_gap.GAP_DRAWS // 2, reason=None), gap
    assert not any("stopped short" in m for m in messages), messages


def test_a_full_rank_guide_past_the_dense_bounds_records_a_skipped_step():
    """Where the fit's cost leaves the mean's step no room (20 steps: 2,520 gradient passes allowed, the step and the
    gap need 6,000 and their solves) the full-rank guide keeps the dense gap alone (gradients only: 1,000 passes) and
    its record says the step was skipped and why, as a skipped refinement within the bounds does; the old code
    recorded nothing. Past svi_gap_cg.MAX_WORK the rule names that bound."""
    post, _, _, _, _ = _default_fit(400, num_steps=20)
    (record,) = post.config["guide_refinement"]
    assert record["accepted"] == 0 and record["stopped"].startswith("skipped: the mean's step and the gap take"), record
    assert "FIT_SHARE" in record["stopped"] and "more num_steps would take the mean's step" in record["stopped"]
    (gap,) = post.config["guide_gap"]
    assert gap["method"] == "dense", gap
    path = svi_gap_cg.choose_path(150, 7_000, fit_passes=svi.DEFAULT_STEPS, full_rank=True)
    assert path.kind == "dense" and path.reason.startswith("skipped: 150 coordinates x 7000 rows is over"), path


@pytest.mark.slow  # ~30 s: SVI's defaults (5,000 full-rank steps on 110 coefficients x 100 rows)
def test_a_default_full_rank_logistic_fit_ends_at_its_optimum_and_is_silent(load_benchmark):
    """The lead's case (issue 26 item 9: no silently wrong default): a logistic regression of 110 coefficients on 100
    rows, past the dense bounds. The old step, its ``H`` from the gap's 10 draws, had its first full step rejected,
    kept one at half the rate and stopped at its 5 evaluations 0.21 guide sds from the optimum below (the gap said
    0.18 and warned; more evaluations at 10 draws closed it only slowly: 0.11 after 10, 0.07 after 20,
    ``benchmarks/results/svi_convergence/fullcg_cause.md``). Now a rejected candidate makes the step average ``H``
    over the draws the fit's share pays for (832 here: ``svi_gap_cg.choose_path``), and it reaches its fixed point.
    The reference: the optimum of the mean with the covariance as trained on 20,000 antithetic draws (exact Newton,
    ``benchmarks/svi_full_rank_cg.py``'s ``logistic_optimum``). The step optimizes the mean of ``log p`` over its own 1,000 draws, whose optimum misses
    that one by the step's Monte Carlo error, per coordinate the gap's standard error on the same draws (``S`` times
    the pairs' mean gradients: the Newton step's error where ``S^-1`` is ``H``), with the reference's own error
    (1 / sqrt(20) of it): every coordinate must be within 5 of their combined standard errors (the chance that any of
    110 normal ones is past 5: 6e-5; the old end: 7.4 at b[36], this one 3.7 at b[19]), and the fit silent."""
    post, (guide,), x, y, messages = _default_fit(100, dim=110, logistic=True)
    assert not any("stopped short" in m for m in messages), messages
    (record,) = post.config["guide_refinement"]
    path = svi_gap_cg.choose_path(110, 100, fit_passes=svi.DEFAULT_STEPS, full_rank=True)
    assert record["stopped"] == "fixed point" and record["escalated_hessian_draws"] == path.step_hessian_draws == 832, (
        record
    )
    (gap,) = post.config["guide_gap"]
    assert gap == dict(method="dense", draws=svi_gap.GAP_DRAWS, pairs=svi_gap.GAP_DRAWS // 2, reason=None), gap
    tril = guide.get_posterior().scale_tril.detach().double()  # Pyro's: scale[:, None] * scale_tril
    sd = tril.pow(2).sum(1).sqrt()
    optimum = load_benchmark("svi_full_rank_cg").logistic_optimum(x, y, guide.loc.detach(), tril, seed=1)
    se = post.history[_health.GAP_SE][0] * (1 + 1 / 20) ** 0.5
    z = ((guide.loc.detach().double() - optimum) / sd).abs() / se
    assert float(z.max()) < 5, (float(z.max()), int(z.argmax()))


def test_at_the_exact_optimum_twenty_step_seeds_give_no_false_alarm():
    """The false-alarm side on the exact case (the conjugate regression, Gaussian posterior): a full-rank guide moved
    off the exact mean by a different random move per seed (0.3 guide sds a coordinate), then the mean's step and the
    gap on its draws at that seed, as the engine runs them, judged by the check itself (``check_guide_gap``, Student's
    t on the record's 500 pairs). The check's chance of warning on a fit at its optimum is that of GAP_Z for the whole
    fit, ``a`` = 6.3e-5, so the chance that any of 20 independent fits warns is ``1 - (1 - a)^20`` = 1.3e-3 and that
    two do 7.6e-7: none may warn (a test failing by chance once in ~800 seeds of the whole test)."""
    x, y = _data()
    mean, precision = _posterior(x, y)
    warned = []
    for seed in range(20):
        move = 0.3 * torch.randn(DIM, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
        with pyro.get_param_store().scope():
            guide = _moved(_full_rank, x, y, mean, precision, move)
            refined = svi_refine_cg.refine_mean(guide, _model, Data(x, y), seed=seed)
            result = svi_gap.newton_gap(guide, _model, Data(x, y), seed=seed)
        assert refined.stopped == "fixed point" and result.record["pairs"] == svi_gap.GAP_DRAWS // 2, (refined, result)
        post = SimpleNamespace(
            method="svi",
            history={_health.GAP: result.gap[None], _health.GAP_SE: result.se[None]},
            config=dict(
                guide="full_rank", num_steps=5000, guide_gap=[result.record], guide_refinement=[refined.record()]
            ),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DiagnosticWarning)
            _health.check_guide_gap(post)
        warned += [seed] * any("stopped short" in str(w.message) for w in caught)
    assert warned == [], warned


@pytest.mark.slow  # ~10 s each: SVI's defaults (5,000 steps) on 110 coefficients x 100 rows
@pytest.mark.parametrize("guide", ["low_rank", "mean_field"])
def test_a_factored_guide_on_the_logistic_case_takes_the_same_step_to_its_fixed_point(guide, load_benchmark):
    """docs/reference_suite.md: mean-field and low-rank guides past the dense bounds take the full-rank guide's step
    and rule (review 23 finding 6: measured by hand, not pinned). On the logistic case of 110 coefficients x 100 rows
    (11,000 coordinates x rows: past svi_refine.MAX_WORK) a candidate is rejected, the step re-solves with ``H`` from
    the draws the fit's share pays for (choose_path's count, after a mean-field guide's scale step has spent its
    passes) and reaches its fixed point, and the gap check is silent. And it is the same step: the mean ends at its
    family's optimum with the covariance as trained, within 5 combined standard errors in every coordinate, as the
    full-rank test above judges it (review 24 finding 9: max z 1.52 low-rank, 1.32 mean-field)."""
    post, (fitted,), x, y, messages = _default_fit(100, dim=110, logistic=True, guide=guide)
    if guide == "low_rank":
        loc, cov = fitted.get_posterior().mean.detach().double(), fitted.get_posterior().covariance_matrix.detach()
    else:
        loc, cov = fitted.locs.b.detach().double(), torch.diag(fitted.scales.b.detach() ** 2)
    tril = torch.linalg.cholesky(cov.double())
    optimum = load_benchmark("svi_full_rank_cg").logistic_optimum(x, y, loc, tril, seed=1)
    se = post.history[_health.GAP_SE][0] * (1 + 1 / 20) ** 0.5
    z = ((loc - optimum) / cov.diagonal().double().sqrt()).abs() / se
    assert float(z.max()) < 5, (float(z.max()), int(z.argmax()))
    (record,) = post.config["guide_refinement"]
    spent = record["scale"]["passes"] if guide == "mean_field" else 0
    path = svi_gap_cg.choose_path(110, 100, fit_passes=svi.DEFAULT_STEPS, spent_passes=spent)
    assert path.kind == "cg" and record["stopped"] == "fixed point", record
    assert record["escalated_hessian_draws"] == path.step_hessian_draws > svi_gap_cg.HESSIAN_DRAWS, record
    assert not any("stopped short" in m for m in messages), messages
