"""Nets whose forward reads tensor values (a Python branch on a tensor, a boolean-mask index): the shape check runs
them on real rows (tests/test_model.py) and records ``BNN.reads_values``; then MCMC runs their eager gradient (a
compiled graph froze a branch on a mask's size and gave a wrong gradient with no warning: review 25), and per-row
Jacobians (Laplace's GGN, GLM predictive and Fisher; subspace's check) loop over the rows, where vmap cannot batch
the branch."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import TINY_SUBSPACE
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer.laplace import functional


class _MaskBranch(nn.Module):
    """tanh where most of the hidden units are positive, else identity: a branch on a boolean mask's size, which
    make_fx records (its size is a shape) with the branch taken at recording time."""

    def forward(self, h):
        return torch.tanh(h) if h[h > 0].numel() > 0.6 * h.numel() else h


class _RowRead(nn.Module):
    """tanh on the positive entries, each row on its own: a value read (a boolean-mask index) that vmap cannot batch
    but that splits by rows, as Laplace's per-row Jacobians need (docs/guide/models.md)."""

    def forward(self, h):
        out, positive = h.clone(), h > 0
        out[positive] = torch.tanh(h[positive])
        return out


class _OffDevice(nn.Module):
    """A tensor made without ``device=``: the meta probe fails, but no value is read."""

    def forward(self, h):
        return h + torch.zeros(h.shape[-1])


class _ZerosThenBranch(nn.Module):
    """A tensor made without ``device=`` first (the meta probe stops there), then a value read: still a value read
    (review 27: it was taken for an off-device net alone and compiled, with a wrong gradient)."""

    def forward(self, h):
        return _MaskBranch()(h + torch.zeros(h.shape[-1]))


class _CPUMask(nn.Module):
    """A mask made without ``device=`` applied to the input: torch's message names the devices the other way round
    ("on device meta is not on the expected device cpu"); no value read."""

    def forward(self, h):
        return h.masked_fill(torch.zeros(h.shape, dtype=torch.bool), 0.0)


def _net(body=(), branch=_MaskBranch):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), *body, branch(), nn.Linear(4, 1))


def _data(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    return x, (x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(n, generator=g))


def _model(body=(), likelihood=None, branch=_MaskBranch):
    return bp.BNN(
        _net(body, branch), prior=bp.priors.Normal(), likelihood=likelihood or bp.likelihoods.Gaussian(scale=0.3)
    )


def test_the_shape_check_records_a_value_reading_forward():
    x, _ = _data()
    model, plain = (
        _model(),
        bp.BNN(nn.Linear(2, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.3)),
    )
    assert not model.reads_values and model.output_shape(x) == (1,) and model.reads_values
    assert plain.output_shape(x) == (1,) and not plain.reads_values
    for branch in (_OffDevice, _CPUMask):  # the probe fails on a device, not a value (reviews 26, 27): compiled
        off = _model(branch=branch)
        assert off.output_shape(x) == (1,) and not off.reads_values, branch
    behind = _model(branch=_ZerosThenBranch)  # a value read behind an off-device tensor (review 27)
    assert behind.output_shape(x) == (1,) and behind.reads_values
    assert _model(branch=_RowRead).output_shape(x) == (1,)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # short chains
@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis"])
def test_mcmc_runs_a_value_reading_net_eagerly_and_says_so(monkeypatch, method):
    """At the default jit=True the fit warns once, at the user's line, compiles nothing, and records jit=False (what
    ran); that its draws are the eager ones is tested on a net whose branch flips (below)."""
    x, y = _data()
    compiled = []
    monkeypatch.setattr(_logjoint, "_compiled", lambda *a, **k: compiled.append(a) or a[2])
    traced, trace = [], torch.jit.trace  # Pyro's jit_compile and the traced energies: any other route
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traced.append(a) or trace(*a, **k))
    run = dict(method=method, num_samples=10, num_warmup=10, num_chains=2, chain_method="sequential", seed=0)
    if method == "nuts":
        run["max_tree_depth"] = 4  # eager trajectories: keep the test fast
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(_model(), x, y, progress=False, **run)
    said = [w for w in caught if "reads tensor values" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__ and "jit=False" in str(said[0].message)
    assert not compiled and not traced and post.config["jit"] is False  # what ran, not what was asked


class _Flip(nn.Module):
    """3 tanh(h) where most rows' h is positive, else -2 h: with one weight, which branch the batch takes flips with
    its sign (review 25's e5), so a recorded graph is wrong on half the weight line."""

    def forward(self, h):
        return 3 * torch.tanh(h) if h[h > 0].numel() > 0.5 * h.numel() else -2 * h


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
@pytest.mark.filterwarnings("ignore:nuts. the net's forward reads tensor values:RuntimeWarning")
def test_nuts_draws_of_a_net_whose_branch_flips_are_the_eager_ones():
    """At the default jit=True, the draws equal jit=False's on a net whose branch flips along the chain (before the
    fix the compiled path froze one branch: the draws differed, review 25)."""
    torch.manual_seed(0)
    x = torch.cat([torch.rand(14, 1) * 2, -torch.rand(6, 1) * 2])
    y = torch.randn(20)
    draws = []
    for jit in (True, False):
        net = nn.Sequential(nn.Linear(1, 1, bias=False), _Flip(), nn.Linear(1, 1, bias=False))
        model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=1.0))
        run = dict(method="nuts", num_samples=200, num_warmup=100, num_chains=1, seed=0, progress=False, jit=jit)
        draws.append(bp.fit(model, x, y, **run).samples)
    first = draws[0]["0.weight"].flatten()
    assert (first > 0).any() and (first < 0).any()  # the chain visits both branches
    assert all(torch.equal(draws[0][k], draws[1][k]) for k in draws[0])


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
        _model(body=(nn.LayerNorm(4),), branch=_RowRead),
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
def test_subspace_checks_its_subspace_on_a_value_reading_net(monkeypatch):
    """Subspace's check of the variance its subspace holds takes per-row Jacobians (review 25: torch's vmap error
    after the SWA stage), and its inner NUTS, on a Pyro model of the subspace, traces nothing (review 26: Pyro's
    jit_compile froze the branch, wrong at 2,785 of 4,919 potential calls) and says so."""
    x, y = _data()
    traced = []
    trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traced.append(a) or trace(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(_model(branch=_RowRead), x, y, method="subspace", seed=0, progress=False, **TINY_SUBSPACE)
    assert not traced and post.config["inner_config"]["jit"] is False
    assert [w for w in caught if "reads tensor values" in str(w.message)]
    assert torch.isfinite(post.predict(x).mean).all()


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_laplace_after_another_fit_of_the_same_value_reading_model():
    """A fit that evaluates draws marks the net as one vmap cannot batch over draws (model.vmappable False); the
    per-row check must not then take it for a recurrent net and refuse Laplace (its Jacobians loop over rows)."""
    x, y = _data()
    model = _model(branch=_RowRead)
    post = bp.fit(model, x, y, method="svi", num_steps=20, seed=0, progress=False)
    post.predict(x)  # its vmap over draws fails on the branch: the posterior's model loops from now on
    model = post.model
    assert not model.vmappable and model.reads_values
    post = bp.fit(model, x, y, method="laplace", structure="full", num_steps=30, num_samples=10, seed=0, progress=False)
    assert torch.isfinite(post.predict(x).mean).all()
