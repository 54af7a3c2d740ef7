"""The dense path's bound from the fit's own cost (svi_gap_cg.choose_path, dense_passes; review 15 nit 7): the dense
refinement and gap, like the conjugate-gradient ones, spend at most FIT_SHARE of the fit's gradient passes, a default
fit of every bundled posteriordb-style reference keeps its whole check, and a skipped refinement's record names the
bound that skipped it."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from reference.posteriors import ALL  # tests/ is on sys.path (pytest puts conftest.py's folder there)

import bnn_pyro as bp
from bnn_pyro.infer import svi, svi_gap, svi_gap_cg, svi_refine
from bnn_pyro.infer._common import is_latent
from bnn_pyro.infer.guide_density import unconstrained_size


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("guide", ["full_rank", "low_rank", "mean_field"])
def test_a_default_fit_of_every_reference_keeps_its_whole_check(name, guide):
    """At the default 5,000 steps (one particle) the dense path is taken with every refinement evaluation
    (svi_refine.MAX_EVALUATIONS): eight schools (10 coordinates x 8 rows), kidiq and the logistic regression."""
    ref = ALL[name]()
    trace = pyro.poutine.trace(ref.model).get_trace(ref.x, ref.y)
    coords = unconstrained_size({n: s for n, s in trace.nodes.items() if is_latent(s)})
    path = svi_gap_cg.choose_path(coords, len(ref.y), fit_passes=svi.DEFAULT_STEPS, full_rank=guide == "full_rank")
    assert path[:4] == ("dense", None, svi_gap_cg.MAX_ITERATIONS, svi_refine.MAX_EVALUATIONS), (coords, path)


@pytest.mark.parametrize("full_rank", [False, True])
def test_the_dense_check_never_models_more_than_fit_share_of_the_fit(full_rank):
    """Over a grid of coordinates, rows and steps within the dense bounds: where a path is given, the gap and the
    evaluations it allows cost at most FIT_SHARE of the fit's passes (each over the rows plus STEP_ROWS); where
    the refinement is skipped, its first step (two evaluations) would not have fit; where nothing is checked, the gap
    alone would not have."""
    for dim in (2, 10, 50, 100):
        for rows in (1, 8, 100, 1000, 5000):
            if dim * rows > svi_refine.MAX_WORK:
                continue
            for steps in (10, 50, 300, 1000, 5000):
                budget = svi_gap_cg.FIT_SHARE * steps * (rows + svi_gap_cg.STEP_ROWS) / rows
                path = svi_gap_cg.choose_path(dim, rows, fit_passes=steps, full_rank=full_rank)
                gap = svi_gap_cg.dense_passes(dim, 0, hessian_gap=not full_rank)
                case = (dim, rows, steps, path)
                if path.kind == "none":
                    assert gap > budget and "FIT_SHARE" in path.reason, case
                    continue
                assert path.kind == "dense", case
                if path.reason is None:
                    assert 2 <= path.max_evaluations <= svi_refine.MAX_EVALUATIONS, case
                    spent = svi_gap_cg.dense_passes(dim, path.max_evaluations, hessian_gap=not full_rank)
                    assert spent <= budget, case
                else:
                    assert path.reason.startswith("skipped:") and "FIT_SHARE" in path.reason, case
                    assert svi_gap_cg.dense_passes(dim, 2, hessian_gap=not full_rank) > budget >= gap, case


def _regression(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def test_a_short_fit_skips_the_refinement_for_its_cost_and_says_so():
    """10 coefficients x 1,000 rows, 300 steps (``benchmarks/results/svi_convergence/dense_check_cost.md``: unbounded,
    the full-rank check took 7 evaluations, 2.1 times the rest of such a fit): 15,300 passes allowed, the full-rank
    gap's 1,000 fit but no refinement evaluation (30,000 each), so the gap runs and the refinement's record names the
    fit's cost; a low-rank guide's gap (30,000 passes with Hessians) is not taken either, and both records say why."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 10, generator=g)
    y = x @ torch.randn(10, generator=g) + torch.randn(1000, generator=g)
    for guide in ("full_rank", "low_rank"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            post = bp.fit(_regression, x, y, method="svi", guide=guide, num_steps=300, num_samples=5, seed=0,
                          progress=False)  # fmt: skip
        (refined,) = post.config["guide_refinement"]
        assert refined["accepted"] == 0 and refined["stopped"].startswith("skipped: "), refined
        assert "svi_gap_cg.FIT_SHARE" in refined["stopped"] and "MAX_WORK" not in refined["stopped"], refined
        (record,) = post.config["guide_gap"]
        if guide == "full_rank":
            assert record == {"method": "dense", "draws": svi_gap.GAP_DRAWS, "reason": None}, record
        else:
            assert record["method"] is None and "svi_gap_cg.FIT_SHARE" in record["reason"], record


def _logistic(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 3.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Bernoulli(logits=x @ b), obs=y)


def test_a_refinement_capped_by_the_fit_s_cost_advises_more_num_steps_not_nuts():
    """10 coefficients x 100 rows, 200 steps from the prior at lr=1e-4 (the guide left far off): the fit's cost allows
    the refinement 3 of its 30 evaluations (choose_path), it accepts a step and stops at that limit, and the gap still
    warns. The record carries the cap (svi.EVALUATIONS_CAP), and the advice is more num_steps, which give the refinement
    more evaluations, not "more num_steps would not ... method='nuts'" (review 17, finding 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 10, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ (2 * torch.randn(10, generator=g))), generator=g)
    assert svi_gap_cg.choose_path(10, 100, fit_passes=200, full_rank=True).max_evaluations == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(_logistic, x, y, method="svi", guide="full_rank", num_steps=200, lr=1e-4, init="prior",
                      num_samples=5, seed=0, progress=False)  # fmt: skip
    (refined,) = post.config["guide_refinement"]
    assert refined["accepted"] >= 1 and refined["stopped"] == "evaluation limit", refined
    assert refined[svi.EVALUATIONS_CAP] == 3, refined
    (message,) = [str(w.message) for w in caught if "stopped short" in str(w.message)]
    assert "Try num_steps=800: the refinement after the fit stopped at the 3 evaluations" in message, message
    assert "would not" not in message and "nuts" not in message, message


def test_an_uncapped_refinement_records_no_cap():
    """At the default steps the eight-schools-sized check keeps all 30 evaluations: no cap in the record."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g)
    y = x @ torch.randn(3, generator=g) + torch.randn(8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_regression, x, y, method="svi", guide="full_rank", num_steps=500, num_samples=5, seed=0,
                      progress=False)  # fmt: skip
    assert svi_gap_cg.choose_path(3, 8, fit_passes=500, full_rank=True).max_evaluations == svi_refine.MAX_EVALUATIONS
    (refined,) = post.config["guide_refinement"]
    assert svi.EVALUATIONS_CAP not in refined, refined


def test_a_mean_field_guide_within_the_dense_bounds_is_charged_no_gap():
    """Within svi_refine's bounds a mean-field guide's gap is never taken (review 17, finding 2): choose_path charges
    none (gap=False), so at 1,200 steps on 10 coefficients x 1,000 rows (61,200 passes allowed) the refinement gets
    its 2 evaluations (60,000) where a phantom low-rank gap (30,000) left it 1 and skipped it; and a 300-step fit
    writes no guide_gap record promising a check that more num_steps would never bring."""
    assert svi_gap_cg.choose_path(10, 1000, fit_passes=1200, gap=False)[:4] == ("dense", None, 300, 2)
    assert svi_gap_cg.choose_path(10, 1000, fit_passes=1200).reason.startswith("skipped:")
    short = svi_gap_cg.choose_path(10, 1000, fit_passes=300, gap=False)
    assert short.kind == "dense" and short.reason.startswith("skipped:") and "the gap's" not in short.reason, short
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 10, generator=g)
    y = x @ torch.randn(10, generator=g) + torch.randn(1000, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_regression, x, y, method="svi", guide="mean_field", num_steps=300, num_samples=5, seed=0,
                      progress=False)  # fmt: skip
    assert "guide_gap" not in post.config and "guide_gap" not in post.history, post.config
    (refined,) = post.config["guide_refinement"]
    assert refined["stopped"].startswith("skipped: the refinement's first step"), refined
    assert "the gap's" not in refined["stopped"], refined


def _vectorizable(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=x.shape[0]):
        return pyro.sample("obs", dist.Normal((x * b.unsqueeze(-2)).sum(-1), 1.0), obs=y)


@pytest.mark.parametrize("vectorize", [False, True])
def test_vectorized_particles_pay_the_step_s_fixed_cost_once(vectorize):
    """20 coefficients x 40 rows, 100 steps of 8 particles (review 17, finding 3): unvectorized, each particle pays
    Pyro's fixed cost of a step (STEP_ROWS), so the fit counts 800 passes and the refinement gets 16 evaluations;
    vectorized, a step pays it once, 100 x (8 x 40 + 50,000) rows = 100 passes, so the refinement gets what a
    one-particle fit's does (2), the cap the record carries (svi.EVALUATIONS_CAP)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 20, generator=g)
    y = x @ torch.randn(20, generator=g) * 0.3 + torch.randn(40, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_vectorizable, x, y, method="svi", guide="full_rank", num_steps=100, num_particles=8,
                      vectorize_particles=vectorize, num_samples=5, seed=0, progress=False)  # fmt: skip
    (refined,) = post.config["guide_refinement"]
    expected = svi_gap_cg.choose_path(20, 40, fit_passes=100 if vectorize else 800, full_rank=True).max_evaluations
    assert expected == (2 if vectorize else 16) and refined[svi.EVALUATIONS_CAP] == expected, refined
