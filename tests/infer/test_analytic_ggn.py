"""Tests for bnn_pyro/infer/_analytic_ggn.py: Laplace's one-pass likelihood value, gradient and diagonal GGN on the
analytic potential equal the general path (the potential's value and gradient minus the prior's, and the layer-wise
GGN of bnn_pyro/infer/laplace/layerwise.py), and the path is taken exactly where it applies.

Tolerance: 1e-10 relative, in float64: the same sums of float64 products in another order (rounding ~1e-16 per
term over at most a few hundred terms), so a wrong or missing term (~1) is far above it.
"""

from __future__ import annotations

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import curvature
from bnn_pyro.infer.laplace.approximation import Hessian, Settings, Structure
from bnn_pyro.infer.laplace.priors import potentials
from bnn_pyro.infer.laplace.structure import make_layout

TOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


CASES = {  # net, outputs, likelihood
    "tanh_fixed": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(3, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        ),
        1,
        lambda: bp.likelihoods.Gaussian(scale=0.3),
    ),
    "relu_sigma_two_outputs": (
        lambda: torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)),
        2,
        lambda: bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    ),
    "gelu_precision_no_bias": (
        lambda: torch.nn.Sequential(torch.nn.Linear(3, 6, bias=False), torch.nn.GELU(), torch.nn.Linear(6, 1)),
        1,
        lambda: bp.likelihoods.Gaussian(precision=dist.Gamma(2.0, 0.5)),
    ),
}


def _settings(structure="diag", hessian="ggn"):
    return Settings(
        structure=Structure(structure),
        hessian=Hessian(hessian),
        prior_precision="model",
        num_steps=0,
        lr=1e-2,
        polish_steps=None,
        marglik_rounds=1,
        init="net",
    )


def _setup(case, batch_size=None):
    make_net, out, likelihood = CASES[case]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = torch.randn(40, 3, generator=g), torch.randn(40, out, generator=g)
    model = bp.BNN(make_net(), prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood())
    data = Data(x=x, y=y if out > 1 else y[:, 0], batch_size=batch_size)
    base = Potential(model, data)
    assert base.path == "analytic" and base.stack is not None
    z = base.flatten(base.init)
    noise = [n for n in model.likelihood.sites() if n in base.shapes]
    z[base.dim - 1 :] = 0.4 if noise else z[base.dim - 1 :]  # a noise away from its prior median
    layout = make_layout(model, base, Structure.DIAG, exclude=noise)
    return model, data, base, z, layout


def _close(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max()) <= TOL * (1.0 + float(b.abs().max()))


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_equals_the_general_path(case, monkeypatch):
    model, data, base, z, layout = _setup(case)
    pots = potentials(model, data, base, z, None, None)
    s = _settings()
    fused = curvature.analytic_diagonal(base, z, data, layout, s)
    assert fused is not None
    taken = curvature.likelihood_terms(model, pots, z, data, layout, s)  # the path the fit takes
    assert taken.value == fused.value and torch.equal(taken.grad, fused.grad) and torch.equal(taken.hess, fused.hess)
    monkeypatch.setattr(curvature, "analytic_diagonal", lambda *args: None)
    general = curvature.likelihood_terms(model, pots, z, data, layout, s)
    assert fused.hess.dtype == fused.grad.dtype == torch.float64
    assert _close(fused.value, general.value), (fused.value, general.value)
    assert _close(fused.grad, general.grad)
    assert _close(fused.hess, general.hess)
    assert float(fused.hess.min()) >= 0.0 and float(fused.hess.max()) > 0.0


def test_minibatches_give_the_same_terms():
    """Data in batches of 7 (the curvature's chunks follow them): the sums over the batches are the full data's."""
    model, data, base, z, layout = _setup("tanh_fixed")
    whole = curvature.analytic_diagonal(base, z, data, layout, _settings())
    batched = curvature.analytic_diagonal(base, z, Data(x=data.x, y=data.y, batch_size=7), layout, _settings())
    assert _close(batched.value, whole.value) and _close(batched.grad, whole.grad) and _close(batched.hess, whole.hess)


@pytest.mark.parametrize("why", ["structure", "fisher", "noise_covered", "not_analytic"])
def test_other_settings_take_the_general_path(why):
    model, data, base, z, layout = _setup("relu_sigma_two_outputs")
    s = _settings("full" if why == "structure" else "diag", "fisher" if why == "fisher" else "ggn")
    if why == "noise_covered":
        layout = make_layout(model, base, Structure.DIAG)
    if why == "not_analytic":
        base = Potential(model, data, fast_path=False)
    assert curvature.analytic_diagonal(base, z, data, layout, s) is None
