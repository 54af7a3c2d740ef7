"""Nets whose forward reads tensor values (a Python branch on a tensor, a boolean-mask index): the shape check runs
them on real rows (tests/test_model.py) and records ``BNN.reads_values``; then MCMC runs their eager gradient (a
compiled graph froze a branch on a mask's size and gave a wrong gradient with no warning: review 25), and per-row
Jacobians (Laplace's GGN, GLM predictive and Fisher; subspace's check) loop over the rows, where vmap cannot batch
the branch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer.laplace import functional


class _MaskBranch(nn.Module):
    """tanh where most of the hidden units are positive, else identity: a branch on a boolean mask's size, which
    make_fx records (its size is a shape) with the branch taken at recording time."""

    def forward(self, h):
        return torch.tanh(h) if h[h > 0].numel() > 0.6 * h.numel() else h


def _net(body=()):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), *body, _MaskBranch(), nn.Linear(4, 1))


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    return x, (x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(n, generator=g))


def _model(body=(), likelihood=None):
    return bp.BNN(_net(body), prior=bp.priors.Normal(), likelihood=likelihood or bp.likelihoods.Gaussian(scale=0.3))


def test_the_shape_check_records_a_value_reading_forward():
    x, _ = _data()
    model, plain = (
        _model(),
        bp.BNN(nn.Linear(2, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.3)),
    )
    assert not model.reads_values and model.output_shape(x) == (1,) and model.reads_values
    assert plain.output_shape(x) == (1,) and not plain.reads_values


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # short chains
@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis"])
def test_mcmc_runs_a_value_reading_net_eagerly_and_says_so(monkeypatch, method):
    """At the default jit=True the fit warns once, at the user's line, compiles nothing, and its draws equal
    jit=False's (the eager log density: exact)."""
    x, y = _data()
    compiled = []
    monkeypatch.setattr(_logjoint, "_compiled", lambda *a, **k: compiled.append(a) or a[2])
    run = dict(method=method, num_samples=20, num_warmup=20, num_chains=2, chain_method="sequential", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(_model(), x, y, progress=False, **run)
    said = [w for w in caught if "reads tensor values" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__ and "jit=False" in str(said[0].message)
    assert not compiled
    eager = bp.fit(_model(), x, y, progress=False, jit=False, **run)
    for name, value in eager.samples.items():
        assert torch.equal(post.samples[name], value), name


def test_per_row_jacobians_loop_where_the_net_reads_values_with_vmaps_values():
    """The loop gives vmap's Jacobian on a net vmap can batch (the flag forced), and runs where vmap cannot."""
    x, _ = _data(6)
    model = bp.BNN(
        nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2)),
        prior=bp.priors.Normal(),
        likelihood=bp.likelihoods.Categorical(),
    )
    z = torch.randn(17, generator=torch.Generator().manual_seed(1))
    shapes = {"0.weight": (3, 2), "0.bias": (3,), "2.weight": (2, 3), "2.bias": (2,)}

    def one(w, xi):
        parts = dict(zip(shapes, w.split([6, 3, 6, 2])))
        return model.forward_draws({n: p.reshape(shapes[n]) for n, p in parts.items()}, xi[None])[0]

    batched = functional.per_row(torch.func.jacrev(one), model)(z, x)
    object.__setattr__(model, "_reads_values", True)
    looped = functional.per_row(torch.func.jacrev(one), model)(z, x)
    assert batched.shape == (6, 2, 17) and torch.allclose(looped, batched, atol=1e-6)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
@pytest.mark.parametrize(
    "options",
    [
        dict(structure="full"),  # GGN through the net (LayerNorm: not the layerwise path) and the GLM predictive
        dict(structure="diag", hessian="fisher"),
    ],
)
def test_laplace_takes_per_row_jacobians_of_a_value_reading_net(options):
    """vmap(jacrev) over rows raised torch's own error on these nets (review 25): now the rows are looped."""
    x, y = _data()
    post = bp.fit(
        _model(body=(nn.LayerNorm(4),)),
        x,
        y,
        method="laplace",
        num_steps=30,
        num_samples=10,
        seed=0,
        progress=False,
        **options,
    )
    assert torch.isfinite(post.predict(x).mean).all()


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_predictions_of_a_value_reading_net_with_batchnorm_repeat_under_a_seed():
    """The shape check runs at every predict: in eval mode it moves no BatchNorm statistic and draws nothing, so a
    seeded prediction repeats (review 25: up to 0.17 apart)."""
    x, y = _data()
    post = bp.fit(_model(body=(nn.BatchNorm1d(4),)), x, y, method="svi", num_steps=20, seed=0, progress=False)
    first, second = post.predict(x, seed=0).mean, post.predict(x, seed=0).mean
    assert torch.equal(first, second)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_subspace_checks_its_subspace_on_a_value_reading_net():
    """Subspace's check of the variance its subspace holds takes per-row Jacobians (review 25: torch's vmap error
    after the SWA stage)."""
    x, y = _data()
    post = bp.fit(
        _model(),
        x,
        y,
        method="subspace",
        seed=0,
        progress=False,
        subspace_dim=2,
        num_samples=10,
        swa=dict(pretrain_steps=20, num_steps=30, collect_every=1),
        inner_options=dict(num_warmup=10, max_tree_depth=3),
    )
    assert torch.isfinite(post.predict(x).mean).all()
