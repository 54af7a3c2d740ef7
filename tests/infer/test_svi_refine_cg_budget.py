"""The conjugate-gradient mean step's account (bnn_pyro/infer/svi_refine_cg.py, svi_gap_cg.choose_path's
``step_passes``): past its charged evaluations the step goes on while the fit's share pays, and never past it."""

from __future__ import annotations

import pytest
from test_svi_refine_cg import _default_fit  # the module beside this file

from bnn_pyro.infer import _health, svi, svi_gap, svi_gap_cg, svi_refine, svi_refine_cg
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning


@pytest.mark.parametrize("full_rank", [False, True], ids=["factored", "full_rank"])
def test_the_step_s_account_keeps_the_whole_check_within_the_fit_s_share(full_rank):
    """On every size and fit length the conjugate-gradient path takes, the step's account (``step_passes``) with the
    gap's gradients and its solve at the cap (a factored guide's) and what a scale step spent is at most FIT_SHARE of
    the fit's passes, and it pays for the charged worst case (CHARGED_EVALUATIONS evaluations, STEP_SOLVES solves at
    max_iterations over step_hessian_draws), so the first evaluations keep every iteration the old rule gave them;
    past them up to svi_refine.MAX_EVALUATIONS evaluations. The old rule had no account (the step stopped at 5)."""
    gap_per_iteration = 0 if full_rank else 2 * svi_gap_cg.HESSIAN_DRAWS * svi_gap_cg.BATCHES
    seen = 0
    for dim in (120, 400):
        for rows in (100, 400, 2000):
            for steps in (60, 300, 1000, 5000, 20000):
                for spent in (0, 500):
                    path = svi_gap_cg.choose_path(dim, rows, fit_passes=steps, full_rank=full_rank, spent_passes=spent)
                    if path.kind != "cg":
                        continue
                    seen += 1
                    where = (dim, rows, steps, spent, path)
                    budget = svi_gap_cg.FIT_SHARE * steps * (rows + svi_gap_cg.STEP_ROWS) / rows
                    gap = svi_gap.GAP_DRAWS + path.max_iterations * gap_per_iteration
                    assert spent + gap + path.step_passes <= budget * (1 + 1e-12), where
                    charged = svi_refine_cg.CHARGED_EVALUATIONS * svi_refine.DRAWS + svi_gap_cg.STEP_SOLVES * (
                        path.max_iterations * 2 * path.step_hessian_draws
                    )
                    assert charged <= path.step_passes, where
                    assert path.max_evaluations == svi_refine.MAX_EVALUATIONS, where
    assert seen >= 20, seen
    assert svi_gap.GAP_DRAWS == svi_refine.DRAWS  # the engine's step draws are what the charge counts


@pytest.mark.parametrize("step_passes", [11_000, 14_500], ids=["at_an_evaluation", "in_a_solve"])
def test_a_step_that_spends_its_account_stops_there_and_says_so(monkeypatch, step_passes):
    """The step's passes as they are spent (its evaluations' gradients: one pass per draw; its solves' Hessian-vector
    products: two per draw and iteration; the batchability probe's one product), counted at the library's own calls,
    never exceed its account, and where the account pays for no more the record says "share spent": the full-rank
    logistic regression of 110 x 100 after 300 steps (the step switched off in the fit), its H kept at 10 draws. With
    an account of the charged worst case alone (5 evaluations, 5 solves at 60 iterations over 10 draws: 11,000 passes)
    it stops before an evaluation (4 kept; unbounded it runs to its 30 evaluations, 13 kept); with 3,500 more (14,500)
    the account runs out inside a later solve, which is cut at the iterations left (a solve that had its 60 spent
    14,900: review 24), and the step stops there with "share spent", not "no solve at the new mean". The old rule had
    no account; before review 24 the probe was spent outside it."""
    step, spent, solves = _counted_step(monkeypatch, step_passes)
    assert step.stopped == svi_refine_cg.SHARE_SPENT and step.accepted >= 1, (step, solves)
    assert 0 < spent <= step_passes, (spent, step_passes)
    assert step.record()["passes"] == spent, (step.record(), spent)  # its record says what it spent (review 24)
    charged, later = solves[: svi_gap_cg.STEP_SOLVES], solves[svi_gap_cg.STEP_SOLVES :]
    assert all(cap == 60 for cap, _ in charged), solves  # the charge pays for all their iterations
    if step_passes == 14_500:  # the last solve cut: its cap under max_iterations, and all of it taken
        assert later and later[-1][0] < 60 and later[-1][1] == later[-1][0], solves
    else:
        assert not later, solves


@pytest.mark.parametrize("num_draws", [2000, 3000])
def test_a_step_on_more_draws_than_the_charge_counts_stays_within_its_account(monkeypatch, num_draws):
    """The charge counts svi_refine.DRAWS draws per evaluation (the engine passes svi_gap.GAP_DRAWS, as many); a
    direct call with more pays for its charged evaluations from the account as well, and stops where it runs out,
    "share spent", never past it (review 24: the account of 11,000 above was overspent by 880 and 5,800 passes at
    2,000 and 3,000 draws, the charged evaluations unchecked)."""
    step, spent, solves = _counted_step(monkeypatch, 11_000, num_draws=num_draws)
    assert step.stopped == svi_refine_cg.SHARE_SPENT, (step, solves)
    assert 0 < spent <= 11_000, spent


def test_a_step_skipped_after_it_spent_passes_records_them(monkeypatch):
    """An account that pays the batchability probe (20 passes) but not a first evaluation (1,000): the step is
    skipped, "share spent" before its first evaluation, and its record gives the probe's passes it took (review 27:
    the skips after a spend returned a plain Refinement, with no passes)."""
    step, spent, _ = _counted_step(monkeypatch, 500)
    assert step.stopped.startswith("skipped: " + svi_refine_cg.SHARE_SPENT), step
    assert step.record()["passes"] == spent == 20, (step.record(), spent)


def test_a_direct_call_without_the_fit_s_passes_stops_at_the_charged_evaluations(monkeypatch):
    """refine_mean with no fit_passes (no fit bounds the step: no account) stops after CHARGED_EVALUATIONS
    evaluations, its bound before the account (review 24 finding 4: up to svi_refine.MAX_EVALUATIONS, 30; here, the
    110 x 100 fit with a direct call's own path, H from all 1,000 draws after a rejection, 8 to its fixed point)."""
    post, (guide,), x, y, _ = _fit_110x100()
    evaluations, derivatives = [0], svi_refine_cg.derivatives

    def counted_derivatives(pot, order, points):
        evaluations[0] += 1
        return derivatives(pot, order, points)

    monkeypatch.setattr(svi_refine_cg, "derivatives", counted_derivatives)
    assert svi_gap_cg.choose_path(110, 100, full_rank=True).step_passes is None  # the path it takes: no account
    step = svi_refine_cg.refine_mean(guide, _logistic_model(), Data(x, y), seed=0)
    assert evaluations[0] == svi_refine_cg.CHARGED_EVALUATIONS, (evaluations, step)
    assert step.stopped == "evaluation limit" and 1 <= step.accepted < svi_refine_cg.CHARGED_EVALUATIONS, step


def test_the_old_name_of_the_charged_evaluations_warns_and_gives_them():
    """svi_refine_cg.MAX_EVALUATIONS, renamed CHARGED_EVALUATIONS by the account, keeps working for one release with a
    DeprecationWarning that names the new one (DESIGN; review 24 finding 4: it raised AttributeError); other missing
    names still raise."""
    with pytest.warns(DeprecationWarning, match="CHARGED_EVALUATIONS"):
        assert svi_refine_cg.MAX_EVALUATIONS == svi_refine_cg.CHARGED_EVALUATIONS == 5
    with pytest.raises(AttributeError, match="NO_SUCH_NAME"):
        svi_refine_cg.NO_SUCH_NAME  # noqa: B018


def _counted_step(monkeypatch, step_passes, num_draws=svi_refine.DRAWS):
    """The step on the 110 x 100 fit with an account of ``step_passes`` (H at 10 draws, 60 iterations a solve): its
    record, the passes it spent counted at the library's own calls, and each solve's (cap, iterations)."""
    post, (guide,), x, y, _ = _fit_110x100()
    path = svi_gap_cg.GapPath(
        "cg", max_iterations=60, step_hessian_draws=svi_gap_cg.HESSIAN_DRAWS, step_passes=step_passes
    )
    monkeypatch.setattr(svi_gap_cg, "choose_path", lambda *args, **kwargs: path)
    spent, solves = [0], []
    derivatives, products, solve = (
        svi_refine_cg.derivatives,
        svi_gap_cg.hessian_products,
        svi_gap_cg.conjugate_gradients,
    )

    def counted_derivatives(pot, order, points):
        spent[0] += points.shape[0]
        return derivatives(pot, order, points)

    def counted_products(pot, order, points, vectors, **kwargs):
        spent[0] += 2 * points.shape[0] * vectors.shape[1]
        return products(pot, order, points, vectors, **kwargs)

    def counted_solve(*args, **kwargs):  # each solve's cap and the iterations it took
        out = solve(*args, **kwargs)
        solves.append((kwargs["max_iterations"], out[1]))
        return out

    monkeypatch.setattr(svi_refine_cg, "derivatives", counted_derivatives)
    monkeypatch.setattr(svi_gap_cg, "hessian_products", counted_products)
    monkeypatch.setattr(svi_gap_cg, "conjugate_gradients", counted_solve)
    data = Data(x, y)
    step = svi_refine_cg.refine_mean(guide, _logistic_model(), data, seed=0, fit_passes=1, num_draws=num_draws)
    return step, spent[0], solves


def test_a_step_that_spent_the_share_advises_more_num_steps():
    """A warned fit whose step stopped at "share spent" was stopped by the fit's length: the advice is more
    num_steps, in its own words, not "more num_steps would not ... method='nuts'"."""
    from test_svi_gap_path import _post

    post = _post(1.0, 0.01, {"method": "dense", "pairs": 500, "reason": None})
    post.config["guide_refinement"] = [{"accepted": 6, "elbo_change": 0.3, "stopped": svi_refine_cg.SHARE_SPENT}]
    with pytest.warns(DiagnosticWarning, match="stopped short") as caught:
        _health.check_guide_gap(post)
    message = str(caught[0].message)
    assert "Try num_steps=400: the refinement after the fit stopped where it had spent the share" in message, message
    assert "would not" not in message, message


def test_a_step_whose_re_solve_failed_says_so_not_that_the_family_cannot_match():
    """A warned fit whose step stopped at "no solve with more Hessian draws" (its re-solve after a rejected candidate
    ran out of svi_gap_cg.MAX_ITERATIONS) is told what stopped it, not "the posterior is far from what the guide's
    family can match" (review 23 finding 7: the generic last branch took it)."""
    from test_svi_gap_path import _post

    post = _post(1.0, 0.01, {"method": "dense", "pairs": 500, "reason": None})
    stopped = "no solve with more Hessian draws"
    post.config["guide_refinement"] = [{"accepted": 1, "elbo_change": 0.3, "stopped": stopped}]
    with pytest.warns(DiagnosticWarning, match="stopped short") as caught:
        _health.check_guide_gap(post)
    message = str(caught[0].message)
    assert "its conjugate-gradient solve with more Hessian draws" in message and "MAX_ITERATIONS" in message, message
    assert "family can match" not in message, message


@pytest.mark.parametrize(
    "reason",
    [
        "the expected Hessian of -log p is not positive definite at the guide",
        "the log density's Hessian-vector products are not finite at some guide draw",
    ],
)
def test_a_re_solve_that_failed_for_a_reason_quotes_it_not_non_convergence(reason):
    """Where the re-solve with more Hessian draws stopped on a reason (svi_gap_cg's ValueError: H not positive
    definite, or its products not finite), the advice quotes it and does not claim the solve ran out of
    MAX_ITERATIONS (review 24 finding 6: every "no solve with more Hessian draws: <reason>" got that claim)."""
    from test_svi_gap_path import _post

    post = _post(1.0, 0.01, {"method": "dense", "pairs": 500, "reason": None})
    stopped = f"no solve with more Hessian draws: {reason}"
    post.config["guide_refinement"] = [{"accepted": 1, "elbo_change": 0.3, "stopped": stopped}]
    with pytest.warns(DiagnosticWarning, match="stopped short") as caught:
        _health.check_guide_gap(post)
    message = str(caught[0].message)
    assert f"more Hessian draws (taken after a rejected step, post.config['guide_refinement']) found {reason}:" in (
        message
    ), message
    assert "MAX_ITERATIONS" not in message and "did not converge" not in message, message


@pytest.mark.slow  # ~30 s: SVI's defaults (5,000 full-rank steps on 300 coefficients x 2,000 rows)
def test_a_default_full_rank_logistic_fit_on_2000_rows_ends_at_its_optimum_and_is_silent(load_benchmark):
    """Issue 26 item 9 on a few thousand rows: the logistic regression of benchmarks/svi_full_rank_cg.py with 300
    coefficients on 2,000 rows, at the defaults. The step's ``H`` from 10 draws misjudges it by a little, so its full
    steps are kept but converge linearly: the old step stopped at its 5 evaluations, 4 kept, 0.15 guide sds from the
    optimum below, 7.4 combined standard errors at b[246], and the fit did not warn (its gap, 0.107, under the check's
    threshold at 300 coordinates: ``benchmarks/results/svi_convergence/fullcg_budget.md``). With the account it goes
    on (a rejected candidate, then ``H`` from 40 draws) to its fixed point after 8 kept steps (4.3 at b[208]), at about
    a fifth of the share's passes. The reference and the tolerance as in test_svi_refine_cg's 110 x 100 case: the
    optimum of the mean with the covariance as trained on 20,000 antithetic draws; every coordinate within 5 of the
    combined standard errors of the step's and the reference's Monte Carlo errors (chance 1.7e-4 over 300 normal
    ones), and the fit silent."""
    post, (guide,), x, y, messages = _default_fit(2000, dim=300, logistic=True)
    tril = guide.get_posterior().scale_tril.detach().double()  # Pyro's: scale[:, None] * scale_tril
    sd = tril.pow(2).sum(1).sqrt()
    optimum = load_benchmark("svi_full_rank_cg").logistic_optimum(x, y, guide.loc.detach(), tril, seed=1)
    se = post.history[_health.GAP_SE][0] * (1 + 1 / 20) ** 0.5
    z = ((guide.loc.detach().double() - optimum) / sd).abs() / se
    (record,) = post.config["guide_refinement"]
    assert float(z.max()) < 5, (float(z.max()), int(z.argmax()), record)
    assert not any("stopped short" in m for m in messages), messages
    assert record["stopped"] == "fixed point" and record["accepted"] > svi_refine_cg.CHARGED_EVALUATIONS, record
    assert svi.ITERATIONS_CAP not in record, record


def _logistic_model():
    from test_svi_refine_cg import _logistic

    return _logistic


_FIT = {}


def _fit_110x100():
    """The 110 x 100 logistic default fit (test_svi_refine_cg's), its guide moved back to where the engine handed it
    to the step: the fit's own step is undone by refitting with the step switched off."""
    if not _FIT:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(svi_refine_cg, "refine_mean", lambda *args, **kwargs: None)
            _FIT["fit"] = _default_fit(100, dim=110, logistic=True, num_steps=300)
        _FIT["state"] = {k: v.detach().clone() for k, v in _FIT["fit"][1][0].state_dict().items()}
    _FIT["fit"][1][0].load_state_dict(_FIT["state"])  # as handed over, whatever a step before moved
    return _FIT["fit"]
