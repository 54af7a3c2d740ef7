"""The analytic fast path (bnn_pyro/infer/_analytic.py) against Pyro's log density and autograd.

Float64 throughout: the hand-written forward and backward must give Pyro's potential energy and
autograd's gradient to rounding (1e-10 relative to the size of the terms), on several stacks,
activations, depths and noise models, unbatched and batched over a leading axis; the mean-field
ELBO and its gradient must equal Pyro's ``Trace_ELBO`` at the same seed (the same draws). And the
engines must use it at their defaults.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO, autoguide
from pyro.infer.mcmc.util import initialize_model
from torch import nn
from torch.distributions import biject_to

import bnn_pyro as bp
from bnn_pyro.infer import _analytic, _analytic_elbo, _logjoint, _svi_flat
from bnn_pyro.infer._common import call_model, quiet_model
from bnn_pyro.utils.linear_stack import linear_stack, run_linear_stack

TOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_default")  # tests/conftest.py


def _data(n=30, d=3, out=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.sin(x.sum(1, keepdim=True) + torch.arange(out)) + 0.1 * torch.randn(n, out, generator=g)
    return x, y[:, 0] if out == 1 else y


def _net(act, hidden, d=3, out=1):
    torch.manual_seed(0)
    widths, layers = [d, *hidden], []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), act]
    return nn.Sequential(*layers, nn.Linear(widths[-1], out))


def _frozen(net):
    net[0].requires_grad_(False)  # constants for every engine
    return net


NOISE = {
    "fixed": lambda: bp.likelihoods.Gaussian(scale=0.3),
    "sigma": lambda: bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    "sigma-lognormal": lambda: bp.likelihoods.Gaussian(scale=dist.LogNormal(-1.0, 0.5)),
    "precision": lambda: bp.likelihoods.Gaussian(precision=dist.Gamma(2.0, 0.5)),
}
ACTS = {
    "tanh": nn.Tanh(),
    "relu": nn.ReLU(),
    "sigmoid": nn.Sigmoid(),
    "gelu": nn.GELU(),
    "gelu-tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(),
    "softplus": nn.Softplus(beta=2.0),
    "elu": nn.ELU(0.7),
    "leaky": nn.LeakyReLU(0.1),
}
CASES = {  # name -> (net, likelihood, prior, bayesian, outputs)
    **{
        f"{a}-1-{noise}": (lambda a=a: _net(ACTS[a], [7]), noise, None, "all", 1)
        for a in ACTS
        for noise in ("fixed", "sigma")
    },
    "blr-bare-linear": (lambda: (torch.manual_seed(0), nn.Linear(3, 1))[1], "fixed", None, "all", 1),
    "tanh-2-precision": (lambda: _net(nn.Tanh(), [6, 5]), "precision", None, "all", 1),
    "relu-3-lognormal": (lambda: _net(nn.ReLU(), [5, 4, 6]), "sigma-lognormal", None, "all", 1),
    "tanh-1-two-outputs": (lambda: _net(nn.Tanh(), [7], out=2), "sigma", None, "all", 2),
    "tanh-1-layerwise-prior": (lambda: _net(nn.Tanh(), [7]), "fixed", bp.priors.LayerwiseNormal(), "all", 1),
    "tanh-1-shifted-prior": (lambda: _net(nn.Tanh(), [7]), "sigma", bp.priors.Normal(0.5, 2.0), "all", 1),
    "tanh-1-deterministic-biases": (lambda: _net(nn.Tanh(), [7]), "fixed", None, "weights", 1),
    "tanh-1-frozen-first-layer": (lambda: _frozen(_net(nn.Tanh(), [7])), "fixed", None, "all", 1),
    "tanh-1-no-bias": (
        lambda: (
            torch.manual_seed(0),
            nn.Sequential(nn.Linear(3, 4, bias=False), nn.Tanh(), nn.Linear(4, 1, bias=False)),
        )[1],
        "fixed",
        None,
        "all",
        1,
    ),
}


def _model(case):
    net, noise, prior, bayesian, out = CASES[case]
    return bp.BNN(net(), prior=prior or bp.priors.Normal(0.0, 1.0), likelihood=NOISE[noise](), bayesian=bayesian), out


def _pyro_potential(model, x, y, dataset_size):
    init, potential, _, _ = initialize_model(lambda: quiet_model(model, dataset_size)(x, y), model_args=())
    return init, potential


def _close(found, expected, scale):
    assert float((found - expected).abs().max()) <= TOL * scale


@pytest.mark.parametrize("case", list(CASES))
def test_potential_and_gradient_equal_pyro_and_autograd(case):
    model, out = _model(case)
    x, y = _data(out=out)
    dataset_size = 75  # 30 rows of 75: the likelihood is scaled by 2.5
    init, potential = _pyro_potential(model, x, y, dataset_size)
    names = sorted(init)
    pot = _analytic.build(_logjoint.build(model, dataset_size), names, {n: init[n].shape for n in names}, x, y)
    assert isinstance(pot, _analytic.StackPotential)
    g = torch.Generator().manual_seed(1)
    thetas = []
    for _ in range(3):
        z = {k: (v + 0.5 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in init.items()}
        u = potential(z)
        grad = torch.cat([d.reshape(-1) for d in torch.autograd.grad(u, [z[n] for n in names])])
        theta, u = torch.cat([z[n].detach().reshape(-1) for n in names]), u.detach()
        found_u, found_grad = pot(theta)
        scale = 1.0 + float(u.abs()) + float(grad.abs().max())
        _close(found_u, u, scale)
        _close(found_grad, grad, scale)
        thetas.append((theta, found_u, found_grad))
    # batched over a leading axis (chains, particles): each row as the unbatched call
    batch_u, batch_grad = pot(torch.stack([t for t, _, _ in thetas]))
    for i, (_, u, grad) in enumerate(thetas):
        scale = 1.0 + float(u.abs()) + float(grad.abs().max())
        _close(batch_u[i], u, scale)
        _close(batch_grad[i], grad, scale)


def test_a_minibatch_is_scaled_and_a_diverged_point_gives_nan():
    model, _ = _model("tanh-1-sigma")
    x, y = _data(n=40)
    init, potential = _pyro_potential(model, x[:10], y[:10], 40)
    names = sorted(init)
    pot = _analytic.build(_logjoint.build(model, 40), names, {n: init[n].shape for n in names}, x, y)
    theta = torch.cat([init[n].reshape(-1) for n in names])
    u, _ = pot(theta, x[:10], y[:10])  # another batch than the bound data: scaled by 40 / 10
    _close(u, potential(init), 1.0 + float(u.abs()))
    u, grad = pot(torch.full_like(theta, float("nan")))
    assert torch.isnan(u) and torch.isnan(grad).all()


@pytest.mark.parametrize(
    "case",
    ["laplace-prior", "classifier", "hierarchical", "layer-norm", "hardtanh", "uniform-noise", "heteroscedastic"],
)
def test_models_outside_it_are_declined(case):
    net = _net(nn.Tanh(), [7])
    kwargs = dict(prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    if case == "laplace-prior":
        kwargs["prior"] = bp.priors.Laplace(0.0, 1.0)
    elif case == "classifier":
        net, kwargs["likelihood"] = _net(nn.Tanh(), [7], out=3), bp.likelihoods.Categorical()
    elif case == "hierarchical":
        kwargs["prior"] = bp.priors.HierarchicalNormal()
    elif case == "layer-norm":
        net = nn.Sequential(nn.Linear(3, 7), nn.LayerNorm(7), nn.Linear(7, 1))
    elif case == "hardtanh":
        net = nn.Sequential(nn.Linear(3, 7), nn.Hardtanh(), nn.Linear(7, 1))
    elif case == "uniform-noise":
        kwargs["likelihood"] = bp.likelihoods.Gaussian(scale=dist.Uniform(0.01, 2.0))
    else:
        net, kwargs["likelihood"] = _net(nn.Tanh(), [7], out=2), bp.likelihoods.HeteroscedasticGaussian()
    model = bp.BNN(net, **kwargs)
    joint = _logjoint.build(model, 30)
    if joint is None:  # refused already by the generic fast path
        assert case == "hierarchical"
        return
    x, y = _data()
    y = (y > 0).long() if case == "classifier" else y
    init, _ = _pyro_potential(model, x, y, 30)
    names = sorted(init)
    assert _analytic.build(joint, names, {n: init[n].shape for n in names}, x, y) is None


def test_one_activation_module_used_twice_counts_twice():
    """``named_children`` lists a module registered twice once; Sequential runs it twice (a shared Tanh)."""
    tanh = nn.Tanh()
    net = nn.Sequential(nn.Linear(3, 5), tanh, nn.Linear(5, 4), tanh, nn.Linear(4, 1))
    layers = linear_stack(net)
    assert [type(a).__name__ if a is not None else "Linear" for _, a in layers] == [
        "Linear",
        "Tanh",
        "Linear",
        "Tanh",
        "Linear",
    ]
    x = torch.randn(6, 3)
    params = {k: v.detach()[None] for k, v in net.named_parameters()}
    torch.testing.assert_close(run_linear_stack(layers, params, x, net)[0], net(x), rtol=TOL, atol=TOL)


def _perturbed_guide(model, x, y):
    """An ``AutoNormal`` of ``model`` in the current param store, its parameters moved off their initial values
    (seeded), the model's log joint, and the guide's flat ``loc`` and unconstrained scale tensors."""
    guide = autoguide.AutoNormal(model)
    guide(x, y, dataset_size=100)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in pyro.get_param_store().named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    joint = _logjoint.build(model, 100)
    return (guide, joint) + tuple(_analytic_elbo.store_params(list(joint.priors)))


@pytest.mark.parametrize("num_particles", [1, 8])
@pytest.mark.parametrize("case", ["tanh-1-sigma", "relu-3-lognormal", "tanh-1-two-outputs"])
def test_mean_field_elbo_and_gradient_equal_pyro(case, num_particles):
    model, out = _model(case)
    x, y = _data(out=out)
    with pyro.get_param_store().scope():
        guide = _perturbed_guide(model, x, y)[0]
        params = list(dict(pyro.get_param_store().named_parameters()).values())
        elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1)
        pyro.set_rng_seed(3)
        expected = elbo.differentiable_loss(
            lambda a, b: call_model(model, a, b, 100), lambda a, b: guide(a, b, dataset_size=100), x, y
        )
        grads_pyro = torch.autograd.grad(expected, params)
        calls = []
        loss = _logjoint.svi_loss(_logjoint.build(model, 100), guide, num_particles)
        original = _analytic_elbo._NegativeELBO.forward
        pyro.set_rng_seed(3)
        try:
            _analytic_elbo._NegativeELBO.forward = lambda *a: calls.append(1) or original(*a)
            actual, value = loss(x, y)
        finally:
            _analytic_elbo._NegativeELBO.forward = original
        grads_fast = torch.autograd.grad(actual, params)
    assert calls  # the analytic estimator ran
    scale = 1.0 + abs(float(expected.detach()))
    _close(actual.detach(), expected.detach(), scale)
    assert value == pytest.approx(float(expected), rel=TOL, abs=TOL)
    for a, b in zip(grads_fast, grads_pyro):
        _close(a, b, 1.0 + float(b.abs().max()))


@pytest.mark.parametrize("num_particles", [1, 8])
@pytest.mark.parametrize("case", ["tanh-1-sigma", "relu-3-lognormal", "tanh-1-two-outputs"])
def test_flat_mean_field_step_equals_pyro(case, num_particles):
    """SVI's flat path (bnn_pyro/infer/_svi_flat.py): one step gives Pyro's ``Trace_ELBO`` value at the same seed
    and its gradient in every site's ``loc`` and unconstrained scale, written as ``loc.grad`` / ``rho.grad``."""
    model, out = _model(case)
    x, y = _data(out=out)
    with pyro.get_param_store().scope():
        guide, joint, locs, scales = _perturbed_guide(model, x, y)
        elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1)
        pyro.set_rng_seed(3)
        expected = elbo.differentiable_loss(
            lambda a, b: call_model(model, a, b, 100), lambda a, b: guide(a, b, dataset_size=100), x, y
        )
        grads = torch.autograd.grad(expected, locs + scales)
        flat = _svi_flat.FlatMeanField.of(joint, guide, num_particles, x, y)
        assert flat is not None
        pyro.set_rng_seed(3)
        value = flat.step(x, y)
    sizes = [t.numel() for t in locs]
    found = list(flat.loc.grad.split(sizes)) + list(flat.rho.grad.split(sizes))
    _close(value, expected.detach(), 1.0 + abs(float(expected)))
    for a, b in zip(found, grads):
        _close(a, b.reshape(-1), 1.0 + float(b.abs().max()))


def _normal_guide(joint, locs, scales):
    """The ``AutoNormal`` of the store as a guide of Normal sites (a learned noise: a Normal pushed through its
    support's transform), drawn in the same order: Pyro's ``TraceMeanField_ELBO`` then takes each weight's KL in
    closed form (with an ``AutoNormal`` it sees ``Delta`` sites and takes none)."""

    def guide(x, y):
        for (name, prior), loc, rho in zip(joint.priors.items(), locs, scales):
            q = dist.Normal(loc, torch.nn.functional.softplus(rho))
            if name in joint.model.likelihood.sites():
                q = dist.TransformedDistribution(q, biject_to(prior.support))
            pyro.sample(name, q.to_event(loc.dim()))

    return guide


@pytest.mark.parametrize("num_particles", [1, 8])
@pytest.mark.parametrize(
    "case",
    [
        "tanh-1-fixed",
        "tanh-1-sigma",
        "relu-3-lognormal",
        "tanh-2-precision",
        "tanh-1-two-outputs",
        "tanh-1-layerwise-prior",
        "tanh-1-shifted-prior",
    ],
)
def test_flat_step_with_closed_form_kl_equals_pyro_trace_mean_field(case, num_particles):
    """``elbo="mean_field"`` on the flat path (``analytic_kl=True``): one step gives Pyro's ``TraceMeanField_ELBO``
    (closed-form KL of each Normal weight, Monte Carlo likelihood and learned noise) at the same draws, and its
    gradient in every site's ``loc`` and unconstrained scale; and it is not the ``Trace_ELBO`` value."""
    model, out = _model(case)
    x, y = _data(out=out)
    with pyro.get_param_store().scope():
        guide, joint, locs, scales = _perturbed_guide(model, x, y)
        elbo = TraceMeanField_ELBO(
            num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1
        )
        pyro.set_rng_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no mean-field requirement warning: the guide is a proper mean field
            expected = elbo.differentiable_loss(
                lambda a, b: call_model(model, a, b, 100), _normal_guide(joint, locs, scales), x, y
            )
        grads = torch.autograd.grad(expected, locs + scales)
        flat = _svi_flat.FlatMeanField.of(joint, guide, num_particles, x, y, analytic_kl=True)
        monte_carlo = _svi_flat.FlatMeanField.of(joint, guide, num_particles, x, y)
        pyro.set_rng_seed(3)
        value = flat.step(x, y)
        pyro.set_rng_seed(3)
        other = monte_carlo.step(x, y)
    sizes = [t.numel() for t in locs]
    found = list(flat.loc.grad.split(sizes)) + list(flat.rho.grad.split(sizes))
    expected = expected.detach()
    _close(value, expected, 1.0 + abs(float(expected)))
    for a, b in zip(found, grads):
        _close(a, b.reshape(-1), 1.0 + float(b.abs().max()))
    # Trace_ELBO's estimator at the same draws is 1e5 tolerances away: the check above tells the two apart
    assert abs(float(other - expected)) > 1e5 * TOL * (1.0 + abs(float(expected)))


def _spy(monkeypatch):
    calls = []
    original = _analytic.StackPotential.__call__

    def call(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(_analytic.StackPotential, "__call__", call)
    return calls


@pytest.mark.parametrize(
    "method, options",
    [
        ("nuts", dict(num_warmup=10, num_chains=1)),
        ("hmc", dict(num_warmup=10, num_chains=1)),  # a spy in this process
        ("svi", dict(num_steps=5, num_samples=3)),
        ("svi", dict(num_steps=5, num_samples=3, num_particles=4)),
    ],
)
def test_the_engines_use_it_at_their_defaults(monkeypatch, method, options):
    torch.set_default_dtype(torch.float32)
    x, y = _data(n=20)
    x, y = x.float(), y.float()
    torch.manual_seed(0)
    model = bp.BNN(
        nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )
    calls = _spy(monkeypatch)
    steps = dict(num_samples=3) if method != "svi" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fit-health warnings of a 3-draw run
        post = bp.fit(model, x, y, method=method, seed=0, progress=False, **steps, **options)
    assert post.config["fast_path"] is True and calls
