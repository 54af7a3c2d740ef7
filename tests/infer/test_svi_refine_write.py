"""How the refinement (bnn_pyro/infer/svi_refine.py) writes its result into the guide (review 12, findings 8 and 10):
a low-rank step that Pyro could not factor in the guide's float32 is not taken (``_storable``), and a write that
fails halfway leaves every parameter as it was, so that "skipped" means untouched."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import autoguide
from test_svi_refine import _early_guide  # the modules beside this file
from test_svi_refine_low_rank import _data, _low_rank, _model

from bnn_pyro.infer import svi_refine
from bnn_pyro.infer.training_data import Data

W = torch.tensor([[1.0], [0.5], [0.5], [0.2]], dtype=torch.float64)


def _pair(d0: float, w=W):
    d = torch.ones(w.shape[0], dtype=torch.float64)
    d[0] = d0
    return w, d


@pytest.mark.parametrize(
    "pair, storable",
    [
        (_pair(1.0), True),  # healthy
        (_pair(1e-3), True),  # a small D_0, well inside float32
        (_pair(1e-42), False),  # F_0 = 1e21 is finite, the capacitance 1 + F^T F = 1e42 is not: Cholesky gives inf
        (_pair(1e-50), False),  # D_0 = scale_0^2 underflows to 0 in float32
    ],
    ids=["healthy", "small D", "capacitance overflows", "D underflows"],
)
def test_storable_is_whether_pyro_can_factor_the_pair_in_float32(pair, storable):
    """The guard: large ``W / sqrt(D)`` (tiny ``D``) gives a capacitance that a float32 guide cannot factor, or a
    ``D`` it cannot hold. Before, the overflowing capacitances passed: ``cholesky_ex`` of ``[[inf]]`` reports no
    error."""
    w, d = pair
    with pyro.get_param_store().scope():
        guide = autoguide.AutoLowRankMultivariateNormal(_model, rank=w.shape[1])
        guide(*_data())
        assert svi_refine._storable(guide, w, d) is storable
        if storable:  # what it promises: Pyro factors the pair once written
            svi_refine._write_low_rank(guide, torch.zeros(4, dtype=torch.float64), w, d)
            with torch.no_grad():
                assert bool(torch.isfinite(guide.get_posterior().log_prob(torch.zeros(4))))


def test_a_capacitance_whose_cholesky_fails_is_not_storable(monkeypatch):
    """A finite capacitance that float32 cannot factor (one that loses its rank in rounding: whether a given one does
    depends on the platform's Cholesky, a lent GPU machine's CPU factored one that this CPU did not) is refused: the
    guard reads the factorization's ``info``, checked here by a Cholesky that reports failure."""
    w, d = _pair(1.0)
    with pyro.get_param_store().scope():
        guide = autoguide.AutoLowRankMultivariateNormal(_model, rank=w.shape[1])
        guide(*_data())
        assert svi_refine._storable(guide, w, d)
        real = torch.linalg.cholesky_ex

        def failing(a):
            factor, info = real(a)
            return torch.return_types.linalg_cholesky_ex((factor, torch.ones_like(info)))  # as when it breaks down

        monkeypatch.setattr(torch.linalg, "cholesky_ex", failing)
        assert not svi_refine._storable(guide, w, d)


@pytest.mark.parametrize(
    "d0",
    [lambda w0_squared: w0_squared * 1e-40, lambda w0_squared: torch.full_like(w0_squared, 1e-50)],
    ids=["capacitance overflows", "D underflows"],
)
def test_an_unstorable_projection_is_not_taken(monkeypatch, d0):
    """A projection returning a pair Pyro cannot factor (its own answer with ``D_0`` set tiny: ``W_0^2 / D_0 = 1e40``
    overflows float32, or ``D_0 = 1e-50`` underflows it; the ELBO in float64 is higher there, so without the guard
    the step is taken and written): no step is kept, the guide is bit-identical to before and its ``log_prob``
    finite. With ``_storable`` mutated to ``return True`` this fails (the steps are taken and written; at ``D_0 =
    1e-50`` the guide's ``get_posterior()`` then raises, its ``cov_diag`` 0 in float32), and so it did with the
    ``_storable`` of 18d9acb."""
    real = svi_refine.project_low_rank

    def unstorable(precision, w, d):
        w1, d1 = real(precision, w, d)
        return w1, torch.cat([d0(w1[0].square().sum())[None], d1[1:]])

    monkeypatch.setattr(svi_refine, "project_low_rank", unstorable)
    x, y = _data()
    with pyro.get_param_store().scope():
        torch.manual_seed(0)
        guide = _early_guide(_model, x, y, 10, _low_rank(1))
        before = [p.detach().clone() for p in guide.parameters()]
        result = svi_refine.refine(guide, _model, Data(x, y))
        after = [p.detach().clone() for p in guide.parameters()]
        with torch.no_grad():
            log_prob = guide.get_posterior().log_prob(guide.loc)
    assert result.accepted == 0 and result.stopped == "no better step", result
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and bool(torch.isfinite(log_prob))


@pytest.mark.parametrize(
    "make",
    [autoguide.AutoMultivariateNormal, _low_rank(1), autoguide.AutoNormal],
    ids=["full_rank", "low_rank", "mean_field"],
)
def test_a_write_that_fails_halfway_leaves_the_guide_as_it_was(monkeypatch, make):
    """A refinement that keeps a step, whose write raises at its second copy into a guide parameter: "skipped" with
    the error, and every parameter bit-identical to before (before: the mean was written, the scale not)."""
    x, y = _data()
    with pyro.get_param_store().scope():
        torch.manual_seed(0)
        guide = _early_guide(_model, x, y, 10, make)
        params = list(guide.parameters())
        before = [p.detach().clone() for p in params]
        copies, copy = [], torch.Tensor.copy_

        def failing_copy(self, *args, **kwargs):
            if any(self is p for p in params):
                copies.append(1)
                if len(copies) == 2:
                    raise RuntimeError("the second copy failed (test)")
            return copy(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", failing_copy)
        result = svi_refine.refine(guide, _model, Data(x, y))
        monkeypatch.undo()
        after = [p.detach().clone() for p in params]
    assert result == svi_refine.Refinement(0, 0.0, "skipped: RuntimeError: the second copy failed (test)"), result
    assert all(torch.equal(a, b) for a, b in zip(before, after))
