"""Tests for bnn_pyro/infer/laplace/layerwise.py: the layer-wise fast path of the GGN and empirical Fisher gives
the same matrices as the general ``vmap(jacrev)`` / ``vmap(grad)`` path and as an independent dense GGN, and
falls back where it does not apply.

Tolerance: 1e-6 relative to the largest entry, in float64. Both paths sum the same products of float64
numbers in different orders (rounding ~1e-16 per term, ~1e-14 over the few hundred terms here), so 1e-6 only
fails when a term is wrong or missing.
"""

from __future__ import annotations

import pyro.distributions as dist
import pytest
import torch
from torch.func import vmap

import bnn_pyro as bp
from bnn_pyro.infer import laplace as lap
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import layerwise
from bnn_pyro.infer.laplace.approximation import Structure
from bnn_pyro.infer.laplace.fisher import fisher
from bnn_pyro.infer.laplace.functional import (
    hessian_sqrt,
    nll,
    output_gradients,
    output_hessians,
    psd,
    second_derivative,
    site_values,
    softmax_cholesky,
)
from bnn_pyro.infer.laplace.ggn import ggn
from bnn_pyro.infer.laplace.structure import make_layout

TOL = 1e-6


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


class _Tempered(bp.likelihoods.Categorical):
    """``Categorical(logits=f / 2)``: Hessian ``(diag(q) - q q^T) / 4`` at ``q = softmax(f / 2)``."""

    def distribution(self, f, noise):
        return dist.Categorical(logits=f / 2)


def _mlp(out):
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, out)
    )


def _conv():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(72, 3)
    )


def _case(name):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "gaussian":
        x, y = torch.randn(40, 3, generator=g), torch.randn(40, generator=g)
        return _mlp(1), bp.likelihoods.Gaussian(scale=0.3), x, y
    if name == "learned_noise":
        x, y = torch.randn(40, 3, generator=g), torch.randn(40, generator=g)
        return _mlp(1), bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)), x, y
    if name == "categorical":
        x, y = torch.randn(40, 3, generator=g), torch.randint(0, 4, (40,), generator=g)
        return _mlp(4), bp.likelihoods.Categorical(), x, y
    if name == "tempered":  # a K-class likelihood whose output Hessian is not the softmax Hessian at f
        x, y = torch.randn(40, 3, generator=g), torch.randint(0, 4, (40,), generator=g)
        return _mlp(4), _Tempered(), x, y
    if name == "bernoulli":
        x, y = torch.randn(40, 3, generator=g), torch.randint(0, 2, (40,), generator=g).double()
        return _mlp(1), bp.likelihoods.Bernoulli(), x, y
    x, y = torch.randn(20, 1, 6, 6, generator=g), torch.randint(0, 3, (20,), generator=g)
    return _conv(), bp.likelihoods.Categorical(), x, y


def _setup(net, likelihood, x, y, structure):
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    data = Data(x=x, y=y)
    pot = Potential(model, data)
    z = pot.flatten(pot.init)
    model.eval()
    return model, data, pot, z, make_layout(model, pot, Structure(structure))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("structure", ["full", "diag", "last_layer"])
@pytest.mark.parametrize("case", ["gaussian", "learned_noise", "categorical", "tempered", "bernoulli", "conv"])
@pytest.mark.parametrize("backend", [ggn, fisher])
def test_layerwise_path_equals_the_general_path(case, structure, backend, monkeypatch):
    model, data, pot, z, layout = _setup(*_case(case), structure)
    diag = structure == "diag"
    gram, returned = layerwise.gram, []

    def recording_gram(*args):  # what the default call's fast path gave (None: it did not apply)
        returned.append(gram(*args))
        return returned[-1]

    with monkeypatch.context() as m:
        m.setattr(layerwise, "gram", recording_gram)
        fast = backend(model, pot, z, data, layout, diag)
    general = backend(model, pot, z, data, layout, diag, layerwise_path=False)
    assert fast.shape == general.shape
    assert _rel(fast, general) < TOL, _rel(fast, general)
    # the fast path was taken (gram was called once and gave the matrix), everywhere but the empirical Fisher with
    # a covered noise coordinate, which goes straight to the general path (per-example gradients of the noise)
    noise_covered = case == "learned_noise" and structure != "last_layer"
    if backend is fisher and noise_covered:
        assert returned == []
    else:
        assert len(returned) == 1 and isinstance(returned[0], torch.Tensor), returned


@pytest.mark.parametrize("structure", ["full", "diag", "last_layer"])
def test_ggn_of_a_classifier_is_the_dense_ggn(structure):
    """``sum_i J_i^T (diag(p_i) - p_i p_i^T) J_i`` with ``J`` by ``torch.autograd.functional.jacobian`` of the
    plain net, then its diagonal or its last-layer block."""
    net, likelihood, x, y = _case("categorical")
    model, data, pot, z, layout = _setup(net, likelihood, x, y, structure)
    got = ggn(model, pot, z, data, layout, structure == "diag")
    values = site_values(model, pot, z)[0]
    names = list(values)

    def f(flat):
        params, start = {}, 0
        for n in names:
            params[n] = flat[start : start + values[n].numel()].reshape(values[n].shape)
            start += values[n].numel()
        return torch.func.functional_call(net, params, (x,))

    flat = torch.cat([values[n].reshape(-1) for n in names])
    jac = torch.autograd.functional.jacobian(f, flat)  # (N, C, P)
    p = torch.softmax(f(flat), -1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    dense = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    expected = {"full": dense, "diag": dense.diagonal(), "last_layer": dense[-24:, -24:]}[structure]
    assert _rel(got, expected) < TOL, _rel(got, expected)


class _Shared(torch.nn.Module):
    """One Linear layer called twice per forward pass."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class _Tied(torch.nn.Module):
    """A layer's weight also used outside the layer's own call."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)) + x @ self.inner.weight)


class _Scaled(torch.nn.Module):
    """A Bayesian parameter that is not a Linear/Conv2d weight."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)
        self.gain = torch.nn.Parameter(torch.ones(3))
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)) * self.gain)


@pytest.mark.parametrize("net", [_Shared, _Tied, _Scaled])
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_nets_that_are_not_linear_stacks_fall_back_to_the_general_path(net, structure):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 3, generator=g), torch.randn(30, generator=g)
    model, data, pot, z, layout = _setup(net(), bp.likelihoods.Gaussian(scale=0.5), x, y, structure)
    diag = structure == "diag"

    def ones(f, yy):
        return torch.ones(f.shape[0], f.shape[1], 1)

    assert layerwise.gram(model, pot, z, data, layout, diag, ones, 1) is None
    fast, general = ggn(model, pot, z, data, layout, diag), ggn(model, pot, z, data, layout, diag, layerwise_path=False)
    assert torch.equal(fast, general)


@pytest.mark.parametrize(
    "case,target_column",
    [("gaussian", False), ("gaussian", True), ("categorical", False), ("bernoulli", False), ("bernoulli", True)],
)
def test_batched_output_derivatives_are_the_per_row_ones(case, target_column):
    """Output Hessians and gradients of the summed loss equal the per-row ones; a ``(B, 1)`` target (which a
    ``(B,)`` location would broadcast into ``B x B`` terms) takes the per-row way."""
    net, likelihood, x, y = _case(case)
    y = y[:, None] if target_column else y
    model, data, pot, z, _ = _setup(net, likelihood, x, y, "full")
    noise = site_values(model, pot, z)[1]
    f = model.forward_draws(site_values(model, pot, z)[0], x).detach()

    def one(fi, yi):
        return nll(model, fi[None], yi[None], noise)

    hess = vmap(second_derivative(one))(f, y)
    grads = vmap(torch.func.grad(one))(f, y)
    assert _rel(output_hessians(model, f, y, noise), hess) < TOL
    assert _rel(output_gradients(model, f, y, noise), grads) < TOL


def test_the_default_fit_takes_the_fast_path_and_gives_the_general_answer(monkeypatch):
    """``bp.fit``'s default Laplace (last layer, GGN) on an MLP uses the layer-wise path, and its precision is that
    of the general path."""
    net, likelihood, x, y = _case("gaussian")
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    taken = []
    gram = layerwise.gram

    def spy(*args, **kwargs):
        out = gram(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(layerwise, "gram", spy)
    fast = lap.laplace_approximation(model, Data(x=x, y=y), num_steps=20, polish_steps=5)
    assert taken and all(taken)
    from bnn_pyro.infer.laplace import curvature

    monkeypatch.setattr(curvature, "ggn", lambda *a, **k: ggn(*a, **k, layerwise_path=False))
    general = lap.laplace_approximation(model, Data(x=x, y=y), num_steps=20, polish_steps=5)
    assert fast.structure is Structure.LAST_LAYER
    assert _rel(fast.precision, general.precision) < TOL


def test_softmax_cholesky_factors_the_softmax_hessian():
    """``L L^T = diag(p) - p p^T`` with ``L`` lower triangular and its last column zero, also for probabilities with
    exact zeros and for a nearly one-hot row (float64: rounding ~1e-16, so 1e-13 fails only on a wrong term)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, 6, generator=g) * 3, -1)
    p = torch.cat(
        [
            p,
            torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [1.0, 0, 0, 0, 0, 0]]),
            torch.softmax(torch.tensor([[60.0, 0, -5, 0, 0, 1]]), -1),
        ]
    )
    chol = softmax_cholesky(p)
    expected = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    assert torch.isfinite(chol).all()
    assert float((chol @ chol.transpose(1, 2) - expected).abs().max()) < 1e-13
    assert torch.equal(chol, chol.tril()) and torch.equal(chol[..., -1], torch.zeros_like(p))


@pytest.mark.parametrize("case", ["categorical", "tempered", "gaussian"])
def test_hessian_sqrt_is_a_square_root_of_the_output_hessians(case):
    """``L L^T`` is the PSD-projected output Hessian; the closed form (``out - 1`` columns) is taken for the softmax
    Hessian only: the tempered likelihood and a regression get the eigendecomposition (``out`` columns)."""
    net, likelihood, x, y = _case(case)
    model, data, pot, z, _ = _setup(net, likelihood, x, y, "full")
    noise = site_values(model, pot, z)[1]
    f = model.forward_draws(site_values(model, pot, z)[0], x).detach()
    root = hessian_sqrt(model, f, y, noise)
    lam = output_hessians(model, f, y, noise)
    lam = lam.clamp(min=0.0) if lam.shape[-1] == 1 else psd(lam)
    assert root.shape[-1] == (f.shape[1] - 1 if case == "categorical" else f.shape[1])
    assert _rel(root @ root.transpose(1, 2), lam) < TOL
