"""The batched derivatives of a fitted guide's log density (bnn_pyro/infer/guide_density.py): a failure of the batched
Hessian pass is reported as ``torch.func.vmap cannot batch the model`` (NotBatchable) only where vmap itself refuses
the model; the model's own error (raised at every draw, or at some draws even when batched) comes out as it is, and
the refinement and the low-rank gap name it (review 12, finding 9)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide
from test_svi_gap import _data, _guide_at  # the conjugate regression (the test module beside this file)

from bnn_pyro.infer import guide_density, svi_gap, svi_refine
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.training_data import Data

# Each equals b[1] row by row, and each is a pattern torch.func.vmap refuses to batch (guide_density.VMAP_MESSAGES).
REFUSED = {
    "float() of a latent": lambda b: b[1] if float(b[1].detach()) > -1e9 else -b[1],
    "Python branch on a latent": lambda b: b[1] if b[1] > -1e9 else -b[1],
    "random draw of its own": lambda b: b[1] + 0.0 * torch.randn(()),
    "boolean mask (dynamic shape)": lambda b: b[b > -1e9][1],
    "nonzero (dynamic shape)": lambda b: b[1] + 0.0 * b.nonzero().sum(),
    ".numpy() of a latent": lambda b: b[1] * float(b.detach().numpy()[0] * 0.0 + 1.0),
}


def _regression(slope=lambda b: b[1], state=None):
    """y_i ~ N(b0 + slope(b) x_i, 1); raises ValueError while ``state["raise"]`` (the model's own error, every draw)."""

    def model(x, y=None):
        b = pyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
        if state is not None and state["raise"]:
            raise ValueError("the model's own check failed")
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal(b[0] + slope(b) * x, 1.0), obs=y)

    return model


def _correlated(x, y=None):
    """A model whose Cholesky factor fails where ``|r| >= 1`` (some of a wide guide's draws), batched or not."""
    b = pyro.sample("b", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    r = pyro.sample("r", dist.Normal(0.0, 0.3))
    one = torch.ones_like(r)
    tril = torch.linalg.cholesky(torch.stack([torch.stack([one, r]), torch.stack([r, one])]))
    pyro.factor("pd", -tril.diagonal().log().sum())
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(b[0] + b[1] * x, 1.0), obs=y)


def _points(n: int = 40, scale: float = 1.0):
    return torch.tensor([1.0, 0.5]) + scale * torch.randn(n, 2, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pattern", list(REFUSED))
def test_vmap_refusals_are_not_batchable_and_row_by_row_evaluable(pattern):
    """Each refusal is NotBatchable with Hessians; without, the row-by-row pass gives the plain model's numbers (so
    the model itself is sound and the failure was vmap's). Fails loudly if a torch upgrade changes vmap's messages."""
    x, y = _data()
    z = _points()
    pots = [
        Potential(_regression(slope), Data(x, y), init={"b": torch.tensor([1.0, 0.5])}, fast_path=False)
        for slope in (REFUSED[pattern], lambda b: b[1])
    ]
    with pytest.raises(guide_density.NotBatchable, match="torch.func.vmap cannot batch the model"):
        guide_density.derivatives(pots[0], ["b"], z, hessians=True)
    rows, batched = (guide_density.derivatives(pot, ["b"], z) for pot in pots)
    assert torch.allclose(rows.values, batched.values, rtol=1e-6) and torch.allclose(rows.grads, batched.grads)


def test_the_models_own_errors_come_out_as_they_are():
    """A ValueError the model raises at every draw, and a Cholesky factor that fails at some draws even when batched
    (a RuntimeError, as vmap's refusals are): each comes out as itself, not as NotBatchable (before: both were
    reported as "torch.func.vmap cannot batch the model")."""
    x, y = _data()
    state = {"raise": False}
    pot = Potential(_regression(state=state), Data(x, y), init={"b": torch.tensor([1.0, 0.5])}, fast_path=False)
    state["raise"] = True
    with pytest.raises(ValueError, match="the model's own check failed"):
        guide_density.derivatives(pot, ["b"], _points(), hessians=True)
    init = {"b": torch.tensor([1.0, 0.5]), "r": torch.tensor(0.0)}
    pot = Potential(_correlated, Data(x, y), init=init, fast_path=False)
    z = torch.cat([_points(), torch.linspace(-2.0, 2.0, 40)[:, None]], 1)  # |r| >= 1 at 20 of 40 rows
    with pytest.raises(torch.linalg.LinAlgError, match="cholesky"):
        guide_density.derivatives(pot, ["b", "r"], z, hessians=True)


def _switched_on(state, function):
    """``function`` (a module's ``derivatives``) that turns the model's error on first: at every draw of the pass."""

    def switched(*args, **kwargs):
        state["raise"] = True
        return function(*args, **kwargs)

    return switched


@pytest.mark.parametrize("where", ["refinement", "low-rank gap"])
def test_the_recorded_reason_names_the_models_error_not_vmap(monkeypatch, where):
    """The refinement skips and a low-rank guide's gap has no verdict, as before, but the reason names the model's
    ValueError; a full-rank gap (gradients only) still goes row by row and names it too."""
    x, y = _data()
    state = {"raise": False}
    model = _regression(state=state)
    module = svi_refine if where == "refinement" else svi_gap
    monkeypatch.setattr(module, "derivatives", _switched_on(state, guide_density.derivatives))
    with pyro.get_param_store().scope():
        if where == "refinement":
            guide = _guide_at(model, x, y, [1.0, 0.5], [0.2, 0.05])
            reason = svi_refine.refine(guide, model, Data(x, y)).stopped
        else:
            guide = autoguide.AutoLowRankMultivariateNormal(model, rank=1)
            guide(x, y)
            reason = svi_gap.newton_gap(guide, model, Data(x, y), num_draws=100).reason
    expected = "the log density's Hessian could not be evaluated (ValueError: the model's own check failed"
    assert expected in reason and "vmap" not in reason, reason  # Pyro appends the trace's shapes to the message


def test_a_cholesky_failing_at_some_draws_is_named_by_the_refinement():
    """A wide guide of ``_correlated``: at its draws with ``|r| >= 1`` the model's Cholesky factor fails (batched);
    the refinement is skipped with that LinAlgError as the reason, the guide untouched."""
    x, y = _data()
    with pyro.get_param_store().scope():
        guide = _guide_at(_correlated, x, y, [1.0, 0.5, 0.0], [0.2, 0.05, 1.0])  # P(|r| >= 1) = 0.32 per draw
        before = [p.detach().clone() for p in guide.parameters()]
        result = svi_refine.refine(guide, _correlated, Data(x, y))
        after = list(guide.parameters())
    assert result.stopped.startswith(
        "skipped: the log density's Hessian could not be evaluated (_LinAlgError: linalg.cholesky"
    ), result
    assert "vmap" not in result.stopped and all(torch.equal(a, b) for a, b in zip(before, after))


def _logistic3(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Bernoulli(logits=x @ b), obs=y)


def test_hessian_products_are_the_mean_dense_hessian_times_the_vectors():
    """Off a Gaussian (a logistic regression, whose Hessian changes from draw to draw) the batched reverse-over-reverse
    products averaged over the draws equal the mean of the exact per-draw Hessians times the vectors (float32
    rounding); a model vmap refuses is NotBatchable here too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g)
    y = torch.bernoulli(torch.sigmoid(x @ torch.tensor([1.0, -0.5, 0.3])), generator=g)
    pot = Potential(_logistic3, Data(x, y), init={"b": torch.zeros(3)}, fast_path=False)
    z = torch.randn(12, 3, generator=g)
    vectors = torch.randn(3, 4, generator=g)
    dense = guide_density.derivatives(pot, ["b"], z, hessians=True).hessians.mean(0) @ vectors
    products = guide_density.hessian_products(pot, ["b"], z, vectors, chunk_size=5)
    assert products.shape == (3, 4) and torch.allclose(products, dense, rtol=1e-4, atol=1e-5), (products, dense)
    model = _regression(slope=REFUSED["float() of a latent"])
    x2, y2 = _data()
    pot2 = Potential(model, Data(x2, y2), init={"b": torch.tensor([1.0, 0.5])}, fast_path=False)
    with pytest.raises(guide_density.NotBatchable, match="torch.func.vmap cannot batch the model"):
        guide_density.hessian_products(pot2, ["b"], torch.randn(4, 2, generator=g), torch.randn(2, 1, generator=g))


def test_a_low_rank_guides_factors_give_its_covariance():
    x, y = _data()
    with pyro.get_param_store().scope():
        guide = autoguide.AutoLowRankMultivariateNormal(_regression(), rank=1)
        guide(x, y)
        loc, diag, factor = guide_density.guide_factors(guide, ["b"], {"b": torch.Size([2])})
        q = guide.get_posterior()
        assert torch.allclose(torch.diag(diag) + factor @ factor.T, q.covariance_matrix.double(), rtol=1e-5)
        assert torch.equal(loc, q.loc.detach().double())
        assert guide_density.guide_factors(guide, ["b"], {"b": torch.Size([3])}) is None
