"""``Potential``'s fast path (bnn_pyro/infer/_potential.py) against Pyro's own potential energy.

Same model, same site values, float64: the value, the gradient and a Hessian-vector product must equal those of
Pyro's traced potential (``fast_path=False``) to float rounding (1e-10 relative), on the full batch and on
minibatches (likelihood scaled by N / B). Then every engine built on ``Potential`` draws the same with the fast path
as with Pyro's forced (a seeded tiny fit each), to float rounding amplified by a few dozen optimizer steps.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer import _potential
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential

TOL = 1e-10  # relative to 1 + |value|: float64 rounding, far below any modelling difference


def _data(n=40, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def _mlp(*layers):
    torch.manual_seed(0)
    return nn.Sequential(*layers).double()


class _Residual(nn.Module):
    """Not a Linear stack: the generic LogJoint path."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)) + x)


def _bnn(net, likelihood, **kwargs):
    kwargs.setdefault("prior", bp.priors.Normal(0.0, 1.0))
    return bp.BNN(net, likelihood=likelihood, **kwargs).double()


FIXED = bp.likelihoods.Gaussian(scale=0.3)
CASES = {  # name -> (model, expected path)
    "tanh-fixed": (lambda: _bnn(_mlp(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 1)), FIXED), "analytic"),
    "relu-learned-sigma": (
        lambda: _bnn(
            _mlp(nn.Linear(3, 7), nn.ReLU(), nn.Linear(7, 1)), bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
        ),
        "analytic",
    ),
    "two-hidden-gelu-silu": (
        lambda: _bnn(_mlp(nn.Linear(3, 6), nn.GELU(), nn.Linear(6, 5), nn.SiLU(), nn.Linear(5, 1)), FIXED),
        "analytic",
    ),
    "softsign-generic": (lambda: _bnn(_mlp(nn.Linear(3, 7), nn.Softsign(), nn.Linear(7, 1)), FIXED), "logjoint"),
    "deterministic-biases": (
        lambda: _bnn(_mlp(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 1)), FIXED, bayesian="weights"),
        "logjoint",
    ),
    "laplace-prior": (
        lambda: _bnn(_mlp(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 1)), FIXED, prior=bp.priors.Laplace(0.0, 0.5)),
        "logjoint",
    ),
    "residual-net": (
        lambda: _bnn(_Residual().double(), bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))),
        "logjoint",
    ),
    "hierarchical-fallback": (
        lambda: _bnn(_mlp(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 1)), FIXED, prior=bp.priors.HierarchicalNormal()),
        "pyro",
    ),
}


def _close(a: torch.Tensor, b: torch.Tensor):
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL * (1.0 + float(b.detach().abs().max())))


def _compare(fast: Potential, slow: Potential, z0: dict, batch):
    """Value, gradient and Hessian-vector product of both potentials at ``z0`` on ``batch``."""
    out = []
    v = {k: torch.randn(t.shape, generator=torch.Generator().manual_seed(5), dtype=t.dtype) for k, t in z0.items()}
    for pot in (fast, slow):
        z = {k: t.clone().requires_grad_() for k, t in z0.items()}
        u = pot(z, batch)
        grads = torch.autograd.grad(u, list(z.values()), create_graph=True)
        dot = sum((g * v[k]).sum() for g, k in zip(grads, z))
        hv = torch.autograd.grad(dot, list(z.values()), allow_unused=True)
        hv = [torch.zeros_like(t) if h is None else h for h, t in zip(hv, z.values())]
        out.append((u.detach(), [g.detach() for g in grads], hv))
    (uf, gf, hf), (us, gs, hs) = out
    _close(uf, us)
    for a, b in zip(gf + hf, gs + hs):
        _close(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_potential_gradient_and_hvp_equal_pyro(case):
    make, path = CASES[case]
    model, (x, y) = make(), _data()
    data = Data(x=x, y=y, dataset_size=100)  # the first batch of 40 stands for 100 rows: likelihood x 2.5
    fast, slow = Potential(model, data), Potential(model, data, fast_path=False)
    assert (fast.path, fast.fast_path) == (path, path != "pyro")
    assert (slow.path, slow.fast_path) == ("pyro", False)
    g = torch.Generator().manual_seed(1)
    for rows in (slice(None), slice(0, 7), slice(13, 38)):  # the full batch and two minibatches
        z0 = {k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in fast.init.items()}
        _compare(fast, slow, z0, (x[rows], y[rows]))
    flat = fast.flatten(fast.init)
    _close(fast.flat_fn((x[:5], y[:5]))(flat), slow.flat_fn((x[:5], y[:5]))(flat))


@pytest.mark.parametrize("case", ["tanh-fixed", "softsign-generic"])
def test_gradient_in_the_inputs_equals_pyro(case):
    """Adversarial training differentiates ``U`` in ``x``: the fast path gives Pyro's gradient there too."""
    model, (x, y) = CASES[case][0](), _data()
    grads = []
    for fast_path in (True, False):
        pot = Potential(model, Data(x=x, y=y), fast_path=fast_path)
        xr = x[:9].clone().requires_grad_()
        grads.append(torch.autograd.grad(pot(pot.init, (xr, y[:9])), xr)[0])
    _close(grads[0], grads[1])


@pytest.mark.parametrize("learned", [False, True])
def test_float32_defaults_take_the_analytic_path(learned):
    """A user's float32 model on 1,000 rows: the build-time check accepts the analytic path (rounding stays inside
    its tolerance), and value and gradient equal Pyro's to float32 rounding."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 20), nn.Tanh(), nn.Linear(20, 1))
    model = bp.BNN(
        net,
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0) if learned else 0.1),
    )
    x, y = (t.float() for t in _data(n=1000))
    fast, slow = Potential(model, Data(x=x, y=y)), Potential(model, Data(x=x, y=y), fast_path=False)
    assert fast.path == "analytic"
    results = []
    for pot in (fast, slow):
        z = {k: v.clone().requires_grad_() for k, v in fast.init.items()}  # (a noise site's start is drawn)
        u = pot(z, (x[:100], y[:100]))
        results.append([u.detach(), *torch.autograd.grad(u, list(z.values()))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * (1.0 + float(b.abs().max())))


def test_function_model_keeps_pyros_path():
    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    x, y = _data()
    pot = Potential(model, Data(x=x, y=y))
    assert (pot.path, pot.fast_path) == ("pyro", False)


def test_deterministic_parameters_are_pyro_params_with_the_same_gradients():
    """Deterministic parameters are read as Pyro reads them: a caller's param capture finds the same sites, and
    their gradients equal Pyro's."""
    model, (x, y) = CASES["deterministic-biases"][0](), _data()
    data = Data(x=x, y=y)
    grads = []
    for fast_path in (True, False):
        pyro.clear_param_store()
        pot = Potential(model, data, fast_path=fast_path)
        with pyro.poutine.trace(param_only=True) as capture:
            u = pot(pot.init, (x[:9], y[:9]))
        params = {n: s["value"].unconstrained() for n, s in capture.trace.nodes.items()}
        assert sorted(params) == ["0.bias", "2.bias"]
        grads.append(dict(zip(params, torch.autograd.grad(u, list(params.values())))))
    for name in grads[0]:
        _close(grads[0][name], grads[1][name])


def test_dropout_module_masks_still_apply():
    """A net with ``nn.Dropout`` in training mode: the generic path draws the same masks from the same generator."""
    net = _mlp(nn.Linear(3, 7), nn.Tanh(), nn.Dropout(0.5), nn.Linear(7, 1))
    model, (x, y) = _bnn(net, FIXED), _data()
    fast, slow = Potential(model, Data(x=x, y=y)), Potential(model, Data(x=x, y=y), fast_path=False)
    assert fast.path == "logjoint"
    values = []
    for pot in (fast, slow):
        torch.manual_seed(3)
        values.append(torch.stack([pot(pot.init, (x, y)) for _ in range(3)]))
    _close(values[0], values[1])
    assert values[0].unique().numel() == 3  # the masks differ between calls: dropout is on


def test_a_disagreeing_fast_path_warns_and_falls_back(monkeypatch):
    model, (x, y) = CASES["tanh-fixed"][0](), _data()
    monkeypatch.setattr(_potential._FastEnergy, "__call__", lambda self, z, batch: self._generic(z, batch) + 1.0)
    with pytest.warns(RuntimeWarning, match="disagrees with Pyro"):
        pot = Potential(model, Data(x=x, y=y))
    assert pot.path == "pyro"


# ------------------------------------------------------------------ every engine on Potential: same draws either way
ENGINES = {
    "sgld": dict(num_warmup=10, num_samples=5, thin=1),
    "sghmc": dict(num_warmup=10, num_samples=5, thin=1),
    "csgmcmc": dict(num_cycles=2, num_samples=4),
    "snapshot": dict(num_cycles=2, cycle_length=10),
    "swa": dict(pretrain_steps=20, num_steps=20, burn_in=0),
    "swag": dict(pretrain_steps=20, num_steps=20, burn_in=0, swag_rank=2, num_samples=5),
    "ensemble": dict(num_chains=2, num_steps=30),
    # no L-BFGS polish: it runs to a change of 1e-12 in U, so rounding decides its last iterations (~3e-8 apart)
    "laplace": dict(num_steps=30, structure="diag", num_samples=5, polish_steps=0),
    "mc_dropout": dict(num_steps=30, num_samples=5),
}


@pytest.mark.parametrize("learned", [False, True], ids=["fixed-noise", "learned-noise"])
@pytest.mark.parametrize("method", list(ENGINES))
def test_engine_draws_equal_with_the_fast_path_forced_off(method, learned):
    """The default (fast path, recorded in the config) and ``bp.fit(..., fast_path=False)`` (Pyro's path) draw the
    same, on a Linear stack where the fast path is the analytic one."""
    x, y = _data(n=30)
    likelihood = bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0) if learned else 0.3)
    fits = []
    for off in ({}, dict(fast_path=False)):  # the default a user gets, then Pyro's path forced
        model = _bnn(_mlp(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)), likelihood)
        fits.append(bp.fit(model, x, y, method=method, seed=0, progress=False, **off, **ENGINES[method]))
    on, off = fits
    assert on.config["fast_path"] is True and on.config["potential"] == "analytic"
    assert off.config["fast_path"] is False and off.config["potential"] == "pyro"
    assert sorted(on.samples) == sorted(off.samples)
    for name in on.samples:
        torch.testing.assert_close(on.samples[name], off.samples[name], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(
    "method", ["sgld", "sghmc", "csgmcmc", "snapshot", "swa", "swag", "ensemble", "laplace", "mc_dropout", "subspace"]
)
def test_every_engine_on_potential_declares_fast_path(method):
    assert bp.infer.options(method)["fast_path"] is True
    with pytest.raises(TypeError, match="fast_path must be True or False"):
        bp.fit(
            _bnn(_mlp(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)), FIXED),
            *_data(n=10),
            method=method,
            fast_path="no",
            progress=False,
            **ENGINES.get(method, {}),
        )


def test_function_model_records_pyros_path():
    def model(x, y=None, dataset_size=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=x.dtype), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0], subsample_size=x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w, 0.3), obs=y)

    post = bp.fit(model, *_data(n=20), method="sgld", num_warmup=2, num_samples=2, thin=1, seed=0, progress=False)
    assert post.config["fast_path"] is False and post.config["potential"] == "pyro"


def test_potentials_record_every_path_and_the_stages():
    record = _potential.Potentials()
    record.paths += ["analytic", "pyro", "analytic"]
    assert record.record({}) == {"fast_path": False, "potential": "analytic+pyro"}
    assert _potential.Potentials().record({}) == {"fast_path": False}  # none built: none ran fast
    assert _potential.Potentials().record({}, {"fast_path": True}) == {"fast_path": True}
    assert _potential.Potentials().record({}, {"fast_path": True}, {"fast_path": False}) == {"fast_path": False}


def test_subspace_passes_fast_path_to_every_stage():
    x = torch.linspace(-2, 2, 30, dtype=torch.float64)[:, None]
    y = torch.sin(2 * x[:, 0])
    fits = {}
    for fast in (True, False):
        model = _bnn(_mlp(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1)), FIXED)
        fits[fast] = bp.fit(
            model,
            x,
            y,
            method="subspace",
            subspace_dim=2,
            inner="svi",
            num_samples=5,
            inner_options=dict(num_steps=5),
            swa=dict(rank=4, pretrain_steps=20, num_steps=20),
            seed=0,
            progress=False,
            **({} if fast else dict(fast_path=False)),
        )
    assert fits[True].config["swa"]["potential"] == "analytic" and fits[True].config["swa"]["fast_path"] is True
    assert fits[False].config["swa"]["potential"] == "pyro" and fits[False].config["inner_config"]["fast_path"] is False
    assert fits[False].config["fast_path"] is False
    # the inner engine's model over z is a Pyro function: Pyro's path, so the whole fit is not on the fast path
    assert fits[True].config["inner_config"]["fast_path"] is False and fits[True].config["fast_path"] is False


def test_laplace_records_a_rewritten_prior_on_pyros_path_and_the_gaussian_takes_the_option():
    from bnn_pyro.infer.laplace import laplace_approximation

    x, y = _data(n=20)

    def model():
        return _bnn(_mlp(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), FIXED)

    # a number prior_precision rewrites the prior: the MAP search's U is a Pyro function (Pyro's path)
    post = bp.fit(
        model(),
        x,
        y,
        method="laplace",
        prior_precision=2.0,
        num_steps=5,
        num_samples=3,
        polish_steps=0,
        seed=0,
        progress=False,
    )
    assert post.config["potential"] == "analytic+pyro" and post.config["fast_path"] is False
    for fast, path in ((True, "analytic"), (False, "pyro")):
        approx = laplace_approximation(model(), Data(x=x, y=y), num_steps=5, polish_steps=0, fast_path=fast)
        assert approx.potential.path == path
