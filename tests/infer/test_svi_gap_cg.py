"""The Newton gap of mean-field and low-rank guides past the dense path's bounds (bnn_pyro/infer/svi_gap_cg.py:
conjugate gradients on Hessian-vector products), on a conjugate Bayesian linear regression with 120 coefficients and
400 rows (past svi_refine's MAX_DIM and MAX_WORK): its posterior is Gaussian with precision ``Lambda = X^T X + I``, so
``H = Lambda`` at every draw, the Newton step is exact and the gap of a guide whose mean is moved by a known vector is
that move in the guide's sds, up to float32 rounding of the gradients and the solver's tolerance. Before this module
neither guide was checked there (a mean-field guide at no size; a low-rank one only within the dense bounds)."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide
from torch.distributions import transform_to

import bnn_pyro as bp
from bnn_pyro.infer import _health, svi_gap, svi_gap_cg, svi_refine, svi_refine_cg
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

DIM, ROWS = 120, 400


def _model(x, y=None):
    """y_i ~ N(x_i . b, 1), b ~ N(0, I): a Gaussian posterior in closed form."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([DIM]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, DIM, generator=g) + 0.3 * torch.randn(ROWS, 1, generator=g)  # correlated coefficients
    return x, x @ torch.randn(DIM, generator=g) + torch.randn(ROWS, generator=g)


def _posterior(x, y):
    design = x.double()
    precision = design.T @ design + torch.eye(DIM, dtype=torch.float64)
    return torch.linalg.solve(precision, design.T @ y.double()), precision


MOVE = torch.linspace(-0.5, 0.5, DIM, dtype=torch.float64)  # the guide's mean moved by this many of its own sds


def _mean_field(x, y, mean, sd):
    guide = autoguide.AutoNormal(_model)
    guide(x, y)
    with torch.no_grad():
        guide.locs.b_unconstrained.copy_(mean.float())
        guide.scales.b_unconstrained.copy_(transform_to(guide.scale_constraint).inv(sd.float()))
    return guide


def _low_rank(x, y, mean, sd):
    guide = autoguide.AutoLowRankMultivariateNormal(_model, rank=2)
    guide(x, y)
    with torch.no_grad():
        guide.loc.copy_(mean.float())
        guide.scale = sd.float()
        guide.cov_factor.copy_(0.3 * torch.randn(DIM, 2, generator=torch.Generator().manual_seed(1)))
    return guide


def _full_rank(x, y, mean, sd):
    """An ``AutoMultivariateNormal`` at ``mean`` with sds near ``sd`` and a correlating unit-triangular factor: past
    the dense bounds its mean's step and gap take the conjugate-gradient path as factors ``D = 0``, ``W = L``."""
    guide = autoguide.AutoMultivariateNormal(_model)
    guide(x, y)
    noise = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        guide.loc.copy_(mean.float())
        guide.scale = sd.float()
        guide.scale_tril = torch.eye(DIM) + 0.05 * noise.tril(-1)
    return guide


def _guide_sd(guide):
    if isinstance(guide, autoguide.AutoNormal):
        return guide.scales.b.detach().double()
    return guide.get_posterior().variance.detach().double().sqrt()


@pytest.mark.parametrize("make", [_mean_field, _low_rank, _full_rank], ids=["mean_field", "low_rank", "full_rank"])
def test_the_gap_is_zero_at_the_optimum_and_the_known_move_off_it(make):
    """A mean-field guide at its family's optimum (the exact mean, sds ``1 / sqrt(Lambda_ii)``) and a low-rank or
    full-rank one at the exact mean: gap ~0 (float32 rounding) with a standard error of rounding size; the same guides moved by ``MOVE``
    of their sds: the gap is ``-MOVE`` to a relative 1e-3 (rounding and the solver's TOL) and beyond both of the
    check's thresholds. The record says how it was computed. A full-rank guide's gap is the dense statistic on the
    mean step's antithetic draws (``S E_q[grad log p]``, its standard error from the pairs: no conjugate gradients),
    so with this guide's ``S``, not the posterior's, it is exactly ``S Lambda (-MOVE sd) / sd``."""
    x, y = _data()
    mean, precision = _posterior(x, y)
    assert DIM > svi_refine.MAX_DIM and DIM * ROWS > svi_refine.MAX_WORK
    sd = precision.diagonal() ** -0.5
    for move in (torch.zeros(DIM, dtype=torch.float64), MOVE):
        with pyro.get_param_store().scope():
            guide = make(x, y, mean, sd)
            guide_sd = _guide_sd(guide)
            with torch.no_grad():  # the move in the guide's own sds
                (guide.locs.b_unconstrained if isinstance(guide, autoguide.AutoNormal) else guide.loc).add_(
                    (move * guide_sd).float()
                )
            result = svi_gap.newton_gap(guide, _model, Data(x, y))
        exact = -move  # H^-1 E_q[grad log p] = mean - loc = -move * guide_sd, in guide sds
        if make is _full_rank:  # S E_q[grad log p] = S Lambda (mean - loc), in guide sds
            assert result.record == dict(
                method="dense", draws=svi_gap.GAP_DRAWS, pairs=svi_gap.GAP_DRAWS // 2, reason=None
            ), result.record
            cov = guide.get_posterior().covariance_matrix.detach().double()
            exact = cov @ precision.double() @ (exact * guide_sd) / guide_sd
        else:
            assert result.reason is None and result.record["method"] == "cg", result.record
            assert result.record["draws"] == svi_gap.GAP_DRAWS and result.record["batches"] == svi_gap_cg.BATCHES
            assert result.record["residual"] <= svi_gap_cg.TOL and result.record["iterations"] >= 1
        assert float((result.gap - exact).abs().max()) < 1e-3 * max(1.0, float(exact.abs().max())), result.gap
        assert float(result.se.max()) < 1e-4, result.se  # the antithetic pairs cancel a Gaussian's whole noise
        flagged = (result.gap.abs() > _health.GAP_MAX) & (result.gap.abs() > _health.GAP_Z * result.se)
        assert bool(flagged.any()) == bool(move.abs().max() > 0)


def test_the_precision_diagonal_of_a_full_rank_guide_s_factors():
    """A full-rank guide's factors (``D = 0``, ``W = L``) have no Woodbury form (it divides by ``D``): the diagonal of
    ``(L L^T)^-1`` by a triangular solve equals the dense inverse's to float64 rounding; a low-rank guide's keeps
    Woodbury's, the same check."""
    g = torch.Generator().manual_seed(2)
    tril = (torch.eye(30) + 0.3 * torch.randn(30, 30, generator=g).tril(-1)).double() * 0.5
    dense = torch.linalg.inv(tril @ tril.T).diagonal()
    full = svi_gap_cg.precision_diagonal(torch.zeros(30, dtype=torch.float64), tril)
    assert torch.allclose(full, dense, rtol=1e-10, atol=0), (full - dense).abs().max()
    diag, factor = torch.rand(30, generator=g).double() + 0.5, torch.randn(30, 2, generator=g).double()
    dense = torch.linalg.inv(torch.diag(diag) + factor @ factor.T).diagonal()
    assert torch.allclose(svi_gap_cg.precision_diagonal(diag, factor), dense, rtol=1e-10, atol=0)


def _two_coefficients(x, y=None):
    """A model of 2 coefficients: within the dense bounds, so the conjugate-gradient steps do not cover it."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x[:, :2] @ b, 1.0), obs=y)


def _seed_spy(calls: list, name: str, function):
    """``function``, appending ``(name, seed=)`` to ``calls`` at each call (which step ran, on which chain's seed)."""

    def wrapped(*args, **kwargs):
        calls.append((name, kwargs.get("seed")))
        return function(*args, **kwargs)

    return wrapped


def _logistic(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Bernoulli(logits=x @ b), obs=y)


def test_off_a_gaussian_the_gap_agrees_with_the_dense_one_within_its_standard_errors(monkeypatch):
    """A logistic regression with 110 coefficients (past MAX_DIM), a rank-2 guide after 100 Adam steps (gaps up to ~0.7
    guide sds): the conjugate-gradient gap (H from 10 draws, standard error by batch means) and the dense one (H from
    the exact Hessians at 1,000 other draws, control variate H (z - m); the bounds lifted for it) are two independent
    estimates of the same step, so they differ per coordinate by at most 4 of their combined standard errors (measured:
    2.3 at most over the 110)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 110, generator=g) * 2 / 110**0.5
    y = torch.bernoulli(torch.sigmoid(x @ torch.randn(110, generator=g)), generator=g)
    with pyro.get_param_store().scope():
        torch.manual_seed(0)
        guide = autoguide.AutoLowRankMultivariateNormal(_logistic, rank=2)
        svi = pyro.infer.SVI(_logistic, guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
        for _ in range(100):
            svi.step(x, y)
        cg = svi_gap.newton_gap(guide, _logistic, Data(x, y))
        monkeypatch.setattr(svi_refine, "MAX_DIM", 1000)
        monkeypatch.setattr(svi_refine, "MAX_WORK", 10**6)
        dense = svi_gap.newton_gap(guide, _logistic, Data(x, y))
    assert cg.record["method"] == "cg" and cg.reason is None and dense.record["method"] == "dense", (
        cg.record,
        dense.record,
    )
    assert float(cg.gap.abs().max()) > 0.3  # short of the optimum: a step to measure
    z = (cg.gap - dense.gap) / (cg.se**2 + dense.se**2).sqrt()
    assert float(z.abs().max()) < 4, z


def _fit(x, y, guide, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(_model, x, y, method="svi", guide=guide, num_samples=5, seed=0, progress=False, **options)
    return post, [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


@pytest.mark.parametrize("guide", ["mean_field", "low_rank"])
def test_a_fit_stopped_short_is_checked_and_warned(guide, monkeypatch):
    """Through ``bp.fit``: 30 steps from a prior draw leave the guide's mean many sds from the optimum (Adam moves each
    coordinate by about ``lr`` per step): with the mean's Newton step (svi_refine_cg, which would take it there) off,
    as where it stops short, the gap is recorded per chain, with the solver's record, and the check warns. (At the
    optimum it is silent: the test above.) The bound on the fit's own cost is lifted (svi_gap_cg.FIT_SHARE: the
    check would cost more than a 30-step fit; a test below keeps it)."""
    monkeypatch.setattr(svi_refine_cg, "refine_mean", lambda *args, **kwargs: None)
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)  # a 30-step fit is otherwise too short to be checked
    x, y = _data()
    post, messages = _fit(x, y, guide, init="prior", num_steps=30)
    assert post.history[_health.GAP].shape == (1, DIM), post.history.keys()
    (record,) = post.config["guide_gap"]
    assert record["method"] == "cg" and record["reason"] is None, record
    assert float(post.history[_health.GAP].abs().max()) > 1
    assert any("stopped short of its best fit" in m for m in messages), messages


def _raising(x, y=None):
    """The regression with a factor of zero that raises where ``b[0] < -5`` (a Cholesky factor of ``[[b_0 + 5]]``; a
    prior draw, which Pyro's set-up takes, is there with a chance of 3e-7)."""
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([DIM]).to_event(1))
    pyro.factor("root", 0.0 * torch.linalg.cholesky((b[:1] + 5.0).reshape(1, 1)).sum())
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def test_a_model_that_raises_gets_no_verdict_and_the_fit_returns_with_the_reason(monkeypatch):
    """A model that raises at some guide draws (a LinAlgError of its own, at ``b[0] < -5``, which the guide straddles):
    no verdict, its error named. Through ``bp.fit``, whatever the products raise leaves the fit with NaN gaps and the
    reason in its record, and no warning. The record has the one shape of ``Gap.record``, with 0 draws (review 17,
    finding 8: no ``draws`` on this path)."""
    x, y = _data()
    mean, precision = _posterior(x, y)
    with pyro.get_param_store().scope():
        guide = _mean_field(x, y, torch.cat([torch.tensor([-4.98]).double(), mean[1:]]), precision.diagonal() ** -0.5)
        result = svi_gap.newton_gap(guide, _raising, Data(x, y), num_draws=100)
    assert result.gap is None and "could not be evaluated (_LinAlgError: linalg.cholesky" in result.reason, (
        result.reason
    )
    assert result.record == {"method": "cg", "draws": 0, "reason": result.reason}, result.record

    def broken(*args, **kwargs):
        raise ValueError("the model's own error (test)")

    monkeypatch.setattr(svi_gap_cg, "hessian_products", broken)
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)  # a 5-step fit is otherwise too short to be checked
    post, messages = _fit(x, y, "mean_field", num_steps=5)
    (record,) = post.config["guide_gap"]
    assert record == {"method": "cg", "draws": 0, "reason": record["reason"]}, record
    assert "the model's own error (test)" in record["reason"], record
    assert bool(post.history[_health.GAP].isnan().all()) and not any("stopped short" in m for m in messages)
    assert post.samples["b"].shape == (1, 5, DIM)


CALLS = []


def _branching(x, y=None):
    CALLS.append(1)
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([DIM]).to_event(1))
    slope = b if float(b[0].detach()) > -1e9 else -b  # always b: a Python branch on a latent value
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ slope, 1.0), obs=y)


def test_a_model_vmap_cannot_batch_gets_no_verdict_with_the_reason():
    """Its gradients could run draw by draw (as the dense gap's do), but its Hessian-vector products would cost
    ``HESSIAN_DRAWS x BATCHES`` traced passes per iteration: no verdict, vmap named, and found before the gradients
    (a handful of model calls, not one per draw)."""
    x, y = _data()
    mean, precision = _posterior(x, y)
    with pyro.get_param_store().scope():
        guide = _mean_field(x, y, mean, precision.diagonal() ** -0.5)
        CALLS.clear()
        result = svi_gap.newton_gap(guide, _branching, Data(x, y))
    assert result.gap is None and result.record["method"] == "cg", result
    assert "torch.func.vmap cannot batch the model" in result.reason, result.reason
    assert len(CALLS) < 50, len(CALLS)


def test_over_the_cost_bound_the_fit_says_it_was_not_checked(monkeypatch):
    monkeypatch.setattr(svi_gap_cg, "MAX_WORK", DIM * ROWS - 1)
    x, y = _data()
    post, _ = _fit(x, y, "mean_field", num_steps=5)
    assert _health.GAP not in post.history
    (record,) = post.config["guide_gap"]
    assert record == {"method": None, "draws": 0, "reason": record["reason"]}, record  # Gap.record's one shape
    assert record["reason"].startswith("not checked: 120 coordinates x 400 rows is over svi_gap_cg.MAX_WORK"), record


def test_conjugate_gradients_solve_several_systems_and_refuse_an_indefinite_one():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 30, generator=g, dtype=torch.float64)
    spd = a @ a.T + 30 * torch.eye(30, dtype=torch.float64)
    rhs = torch.randn(30, 4, generator=g, dtype=torch.float64)
    x, iterations, residual = svi_gap_cg.conjugate_gradients(
        lambda v: spd @ v, rhs, 1 / spd.diagonal(), tol=1e-10, max_iterations=100
    )
    assert residual <= 1e-10 and 1 <= iterations <= 30
    assert torch.allclose(x, torch.linalg.solve(spd, rhs), rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="not positive definite"):
        svi_gap_cg.conjugate_gradients(lambda v: -v, rhs, torch.ones(30, dtype=torch.float64))


def test_conjugate_gradients_leave_a_zero_right_hand_side_solved():
    """A column that is exactly zero (or solved exactly before the others) has ``p = 0`` and ``p^T A p = 0``: it is
    left at zero, not taken for an ``A`` that is not positive definite (review 14), and the others are solved."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 30, generator=g, dtype=torch.float64)
    spd = a @ a.T + 30 * torch.eye(30, dtype=torch.float64)
    rhs = torch.randn(30, 3, generator=g, dtype=torch.float64)
    rhs[:, 1] = 0.0
    x, _, residual = svi_gap_cg.conjugate_gradients(
        lambda v: spd @ v, rhs, 1 / spd.diagonal(), tol=1e-10, max_iterations=100
    )
    assert residual <= 1e-10 and bool((x[:, 1] == 0).all())
    assert torch.allclose(x, torch.linalg.solve(spd, rhs), rtol=1e-8, atol=1e-10)


def test_the_hessian_draws_come_from_batches_spread_over_all_of_them():
    """The expected Hessian's 5 pairs are the first of 5 batches spread over the 20 (not 5 pairs of batch 0, whose
    mean gradient they would then be correlated with); the mean's step takes the same ones."""
    pairs, batches = svi_gap.GAP_DRAWS // 2, svi_gap_cg.BATCHES
    chosen = svi_gap_cg.hessian_pairs(pairs, batches)
    assert len(chosen) == svi_gap_cg.HESSIAN_DRAWS // 2
    assert (chosen // (pairs // batches)).tolist() == [0, 4, 8, 12, 16], chosen


def _regression(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(x @ b, 1.0), obs=y)


def test_at_the_optimum_of_an_ill_conditioned_posterior_the_solve_stops_at_the_rounding_floor():
    """400 coefficients and 400 rows (condition number ~1.5e4 in the guide's scales), a mean-field guide at its
    family's optimum: the mean gradient is float rounding noise, so the solve is done once its residual is below that
    rounding (svi_gap_cg.ROUNDING): 2 iterations, gap ~0. Measured without the floor: 192 iterations to reach 1e-4 of
    the noise (and no verdict at 1,000 x 1,000)."""
    g = torch.Generator().manual_seed(400)
    x = torch.randn(400, 400, generator=g) + 0.3 * torch.randn(400, 1, generator=g)
    y = x @ torch.randn(400, generator=g) * 0.3 + torch.randn(400, generator=g)
    design = x.double()
    precision = design.T @ design + torch.eye(400, dtype=torch.float64)
    mean = torch.linalg.solve(precision, design.T @ y.double())
    with pyro.get_param_store().scope():
        guide = autoguide.AutoNormal(_regression)
        guide(x, y)
        with torch.no_grad():
            guide.locs.b_unconstrained.copy_(mean.float())
            guide.scales.b_unconstrained.copy_(transform_to(guide.scale_constraint).inv(precision.diagonal() ** -0.5))
        result = svi_gap.newton_gap(guide, _regression, Data(x, y))
    assert result.reason is None and result.record["iterations"] <= 5, result.record
    assert float(result.gap.abs().max()) < 1e-4, result.gap.abs().max()
