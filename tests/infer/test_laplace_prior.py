"""Tests for bnn_pyro/infer/laplace/factorized.py: the prior part of ``U`` in closed form (factorized Normal
priors) equals the Hessian-vector-product path of :func:`bnn_pyro.infer.laplace.curvature.prior_terms` for every
structure, and a prior that is not factorized Normal keeps that path, whose Hessian is checked against the dense
autograd Hessian of the prior part.

Tolerance: 1e-10 relative, in float64. The closed form and the products are the same sums in a different order
(rounding ~1e-16 per term over a few hundred terms), so a wrong or missing term (~1) is far above it.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.approximation import Hessian, Settings, Structure
from bnn_pyro.infer.laplace.curvature import prior_terms
from bnn_pyro.infer.laplace.priors import PriorPart, normal_sites, potentials
from bnn_pyro.infer.laplace.structure import make_layout

TOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


def _per_element(name, module, param):
    """A Normal prior with its own loc and scale per entry (fixed by the parameter's name)."""
    g = torch.Generator().manual_seed(len(name) + param.numel())
    loc = 0.3 * torch.randn(param.shape, generator=g)
    scale = 0.2 + torch.rand(param.shape, generator=g)
    return dist.Normal(loc, scale).to_event(param.dim())


NOISES = {
    "fixed": lambda: bp.likelihoods.Gaussian(scale=0.3),
    "sigma": lambda: bp.likelihoods.Gaussian(scale=dist.LogNormal(-1.0, 0.5)),
    "precision": lambda: bp.likelihoods.Gaussian(precision=dist.Gamma(2.0, 0.5)),
}


def _setup(prior, noise="sigma", structure="diag"):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    )
    x, y = torch.randn(30, 3, generator=g), torch.randn(30, generator=g)
    model = bp.BNN(net, prior=prior, likelihood=NOISES[noise]())
    data = Data(x=x, y=y)
    base = Potential(model, data)
    z = base.flatten(base.init)
    z = z + 0.5 * torch.randn(z.shape, generator=g)  # away from the init (noise sites at their median)
    return model, data, base, z, make_layout(model, base, Structure(structure))


def _settings(structure):
    return Settings(
        structure=Structure(structure),
        hessian=Hessian.GGN,
        prior_precision="model",
        num_steps=0,
        lr=1e-2,
        polish_steps=None,
        marglik_rounds=1,
        init="net",
    )


def _close(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max()) <= TOL * (1.0 + float(b.abs().max()))


def _check_equal(prior: PriorPart, z, layout, data, structure):
    assert prior.closed is not None
    s = _settings(structure)
    closed, products = (
        prior_terms(prior, z, layout, s, data),
        prior_terms(PriorPart(prior.pot, None), z, layout, s, data),
    )
    assert closed.hess.shape == products.hess.shape
    assert closed.hess.dtype == closed.grad.dtype == torch.float64
    assert _close(closed.value, products.value), (closed.value, products.value)
    assert _close(closed.grad, products.grad)
    assert _close(closed.hess, products.hess), float((closed.hess - products.hess).abs().max())


@pytest.mark.parametrize("structure", ["diag", "kron", "full", "last_layer"])
@pytest.mark.parametrize("noise", ["fixed", "sigma", "precision"])
def test_closed_form_equals_hessian_vector_products(structure, noise):
    """Per-element Normal priors, with the likelihood's noise site (covered by diag and full) or without."""
    model, data, base, z, layout = _setup(_per_element, noise, structure)
    _, prior = potentials(model, data, base, z, None, None)
    _check_equal(prior, z, layout, data, structure)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_closed_form_of_the_default_prior_and_of_a_prior_precision(structure):
    """bp.priors.Normal (the default a user writes), as the model's prior and rewritten to a precision delta per
    layer (what prior_precision='marglik_layerwise' evaluates)."""
    model, data, base, z, layout = _setup(bp.priors.Normal(0.0, 1.0), "sigma", structure)
    _, prior = potentials(model, data, base, z, None, None)
    _check_equal(prior, z, layout, data, structure)
    normal = normal_sites(model, base, layout, data)
    delta = {group: 0.5 + i for i, group in enumerate(sorted(set(normal.layer.values())))}
    _, prior = potentials(model, data, base, z, normal, delta)
    _check_equal(prior, z, layout, data, structure)
    expected = torch.cat([torch.full((len(layout.coords[n]),), delta[normal.layer[n]]) for n in normal.locs])
    hess = prior_terms(prior, z, layout, _settings(structure), data).hess
    hess = hess if hess.dim() == 1 else hess.diagonal()
    assert _close(hess[layout.where[torch.cat([layout.coords[n] for n in normal.locs])]], expected)  # delta^-1/2 ^-2


def _dense_prior_hessian(prior: PriorPart, z, layout, data):
    """The dense Hessian of the prior part on the covered coordinates, by autograd (no Hessian-vector products)."""
    x0, y0 = data.first()
    fn = prior.pot.flat_fn((x0[:1], y0[:1]))
    full = torch.autograd.functional.hessian(lambda w: fn(z.index_copy(0, layout.active, w)), z[layout.active])
    return full


@pytest.mark.parametrize(
    "prior",
    [bp.priors.StudentT(3.0, 0.0, 0.7), bp.priors.Laplace(0.1, 0.5), bp.priors.HierarchicalNormal()],
    ids=["studentt", "laplace", "hierarchical"],
)
@pytest.mark.parametrize("structure", ["diag", "full"])
def test_other_priors_keep_hessian_vector_products(prior, structure):
    model, data, base, z, layout = _setup(prior, "sigma", structure)
    _, part = potentials(model, data, base, z, None, None)
    assert part.closed is None
    terms = prior_terms(part, z, layout, _settings(structure), data)
    dense = _dense_prior_hessian(part, z, layout, data)
    if structure == "diag":
        dense = dense.diagonal()
    assert _close(terms.hess, dense), float((terms.hess - dense).abs().max())
    if isinstance(prior, bp.priors.HierarchicalNormal) and structure == "full":
        assert float((dense - dense.diagonal().diag()).abs().max()) > 1e-3  # the hyper sites couple the weights


def _function_model(kind: str):
    def model(x, y=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        loc = {
            "constant": torch.zeros(3) + 0.2,
            "hierarchical": mu,
            "param": pyro.param("w_loc", lambda: torch.full((3,), 0.2)),
        }[kind]
        w = pyro.sample("w", dist.Normal(loc, 0.5 + torch.arange(3.0)).expand([3]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w + mu, sigma), obs=y)

    return model


@pytest.mark.parametrize("kind", ["constant", "hierarchical", "param"])
def test_pyro_function_model(kind):
    """A Pyro function model: closed form where every prior is constant, none where a site's prior depends on
    another site (``w ~ Normal(mu, .)``: no hyper_names to tell, the traced graph does) or on a trainable
    ``pyro.param`` (whose value the closed form would not follow); both right."""
    with pyro.get_param_store().scope():  # the model's pyro.param stays out of the global store
        g = torch.Generator().manual_seed(1)
        x = torch.randn(20, 3, generator=g)
        y = x @ torch.tensor([0.5, -1.0, 0.3]) + 0.1 * torch.randn(20, generator=g)
        model, data = _function_model(kind), Data(x=x, y=y)
        base = Potential(model, data, init="prior")
        z = base.flatten(base.init) + 0.3 * torch.randn(base.dim, generator=g)
        layout = make_layout(model, base, Structure.FULL)
        _, part = potentials(model, data, base, z, None, None)
        assert (part.closed is None) == (kind != "constant")
        dense = _dense_prior_hessian(part, z, layout, data)
        assert _close(prior_terms(part, z, layout, _settings("full"), data).hess, dense)
        if kind == "constant":
            _check_equal(part, z, layout, data, "full")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_likelihood_terms_are_the_deterministic_nets_with_dropout_in_train_mode(structure):
    """A net left in train mode with a Dropout layer: the value, gradient and curvature at the MAP are those of the
    net in eval mode (dropout off), the same on every call, and the net's mode is restored."""
    from bnn_pyro.infer.laplace.curvature import likelihood_terms

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(6, 1))
    x, y = torch.randn(30, 3, generator=g), torch.randn(30, generator=g)
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    data = Data(x=x, y=y)
    base = Potential(model, data)
    z = base.flatten(base.init)
    layout = make_layout(model, base, Structure(structure))
    pots = potentials(model, data, base, z, None, None)
    s = _settings(structure)
    model.eval()
    reference = likelihood_terms(model, pots, z, data, layout, s)
    model.train()
    for _ in range(2):
        terms = likelihood_terms(model, pots, z, data, layout, s)
        assert model.training
        assert _close(terms.value, reference.value) and _close(terms.grad, reference.grad)
        hess = terms.hess.dense() if hasattr(terms.hess, "dense") else terms.hess
        ref = reference.hess.dense() if hasattr(reference.hess, "dense") else reference.hess
        assert _close(hess, ref)
