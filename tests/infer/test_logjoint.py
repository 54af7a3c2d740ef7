"""The fast path (bnn_pyro/infer/_logjoint.py) against Pyro's own ELBO and potential energy.

Same model, same site values (and, for the ELBO, the same seed so that the guide draws the same
noise): the values and the gradients must agree to float rounding. Float32 throughout, so the
tolerance (1e-5 relative and absolute) is far below any modelling difference and above rounding.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, autoguide
from pyro.infer.mcmc.util import initialize_model

import bnn_pyro as bp
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._common import call_model, quiet_model

RTOL = 1e-5
ATOL = 1e-5


def _data(n=40, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(n, generator=g)
    return x, y


def _model(likelihood, bayesian="all", prior=None, out=1):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Tanh(), torch.nn.Linear(7, out))
    return bp.BNN(net, prior=prior or bp.priors.Normal(0.0, 1.0), likelihood=likelihood, bayesian=bayesian)


CASES = {
    "fixed-noise": lambda: _model(bp.likelihoods.Gaussian(scale=0.3)),
    "learned-noise": lambda: _model(bp.likelihoods.Gaussian(scale=dist.HalfNormal(torch.tensor(1.0)))),
    "biases-deterministic": lambda: _model(bp.likelihoods.Gaussian(scale=0.3), bayesian="weights"),
    "laplace-prior": lambda: _model(bp.likelihoods.Gaussian(scale=0.3), prior=bp.priors.Laplace(0.0, 0.5)),
    "classifier": lambda: _model(bp.likelihoods.Categorical(), out=3),
    "layerwise-prior": lambda: _model(bp.likelihoods.Gaussian(scale=0.3), prior=bp.priors.LayerwiseNormal()),
}


def _target(case, y):
    return (y > 0).long() + (y > 0.5).long() if case == "classifier" else y


@pytest.mark.parametrize("case", list(CASES))
def test_potential_and_gradient_equal_pyro(case):
    model, (x, y) = CASES[case](), _data()
    y = _target(case, y)
    dataset_size = 100  # a minibatch of 40 of 100 rows: the likelihood is scaled by 2.5
    run = quiet_model(model, dataset_size)
    init, pyro_u, transforms, _ = initialize_model(lambda: run(x, y), model_args=())
    joint = _logjoint.build(model, dataset_size)
    assert joint is not None and set(joint.priors) == set(init)
    fast_u = _logjoint.potential(joint, transforms, x, y)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        z = {k: (v + 0.3 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in init.items()}
        u_pyro, u_fast = pyro_u(z), fast_u(z)
        torch.testing.assert_close(u_fast, u_pyro, rtol=RTOL, atol=ATOL)
        g_pyro = torch.autograd.grad(u_pyro, list(z.values()))
        g_fast = torch.autograd.grad(u_fast, list(z.values()))
        for a, b in zip(g_fast, g_pyro):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_flat_potential_and_gradient_equal_pyro(case, compile):
    """NUTS's fast path: value and gradient over one flat vector, compiled or eager, equal Pyro's."""
    model, (x, y) = CASES[case](), _data()
    y = _target(case, y)
    init, pyro_u, transforms, _ = initialize_model(lambda: quiet_model(model, 100)(x, y), model_args=())
    names = sorted(init)
    shapes = {n: init[n].shape for n in names}
    fn = _logjoint.flat_potential_and_grad(_logjoint.build(model, 100), transforms, x, y, shapes, compile=compile)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        z = {k: (v + 0.3 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in init.items()}
        u_pyro = pyro_u(z)
        g_pyro = torch.cat([d.reshape(-1) for d in torch.autograd.grad(u_pyro, [z[n] for n in names])])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # compiled: no fallback to the eager gradient
            u_flat, g_flat = fn(torch.cat([z[n].detach().reshape(-1) for n in names]))
        torch.testing.assert_close(u_flat, u_pyro.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(g_flat, g_pyro, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("case", ["learned-noise", "biases-deterministic"])
def test_compiled_leapfrog_step_equals_the_eager_one(case, dense):
    """NUTS's fused step: velocity Verlet with the compiled gradient, against the same step eagerly."""
    model, (x, y) = CASES[case](), _data()
    init, _, transforms, _ = initialize_model(lambda: quiet_model(model, 40)(x, y), model_args=())
    shapes = {n: init[n].shape for n in sorted(init)}
    z = torch.cat([init[n].reshape(-1) for n in shapes])

    def make(compile):
        return _logjoint.flat_potential_and_grad(_logjoint.build(model, 40), transforms, x, y, shapes, compile=compile)

    compiled, eager = make(True), make(False)
    g = torch.Generator().manual_seed(3)
    minv = torch.rand(len(z), generator=g) + 0.5
    if dense:
        a = torch.randn(len(z), len(z), generator=g) / len(z)
        minv = torch.diag(minv) + a @ a.T
    p = torch.randn(len(z), generator=g)
    u0, g0 = eager(z)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # compiled: no fallback
        for step in (0.01, -0.02):
            out = compiled.leapfrog(z, p, g0, torch.tensor(step), minv)
            ref = eager.leapfrog(z, p, g0, torch.tensor(step), minv)
            for a, b in zip(out, ref):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # and by hand: p half step, z full step, p half step
    p_half = p - 0.005 * g0
    z1 = z + 0.01 * (minv @ p_half if dense else minv * p_half)
    u1, g1 = eager(z1)
    out = eager.leapfrog(z, p, g0, torch.tensor(0.01), minv)
    p1 = p_half - 0.005 * g1
    torch.testing.assert_close(out[0], z1)
    torch.testing.assert_close(out[1], p1)
    torch.testing.assert_close(out[4], torch.stack([u1, 0.5 * p1 @ (minv @ p1 if dense else minv * p1)]))


@pytest.mark.parametrize(
    "case, runs",
    [
        ("fixed-noise", [("0.bias", "0.weight", "2.bias", "2.weight")]),  # one Normal(0, 1) over every weight
        ("learned-noise", [("0.bias", "0.weight", "2.bias", "2.weight")]),  # the noise has a transform: per site
        ("layerwise-prior", [("0.bias", "0.weight"), ("2.bias", "2.weight")]),  # one scale per layer
        ("laplace-prior", [("0.bias", "0.weight", "2.bias", "2.weight")]),
    ],
)
def test_adjacent_sites_with_one_scalar_prior_are_scored_together(case, runs):
    model, (x, y) = CASES[case](), _data()
    init, _, transforms, _ = initialize_model(lambda: quiet_model(model, 40)(x, y), model_args=())
    energy = _logjoint.Energy(_logjoint.build(model, 40), transforms, x, y)
    names = sorted(init)
    found = energy.prior_runs(names, [init[n].numel() for n in names])
    assert [r[2] for r in found] == runs
    assert found[0][:2] == (0, sum(init[n].numel() for n in runs[0]))


@pytest.mark.parametrize(
    "prior, groups",
    [
        (dist.Normal(torch.tensor(0.0), torch.tensor(2.0)).expand([3, 4]).to_event(2), True),
        (dist.Normal(torch.arange(4.0), torch.tensor(1.0)).expand([3, 4]).to_event(2), False),  # one loc per column
        (dist.StudentT(torch.tensor(3.0).expand(4), torch.arange(4.0), torch.tensor(1.0).expand(4)).to_event(1), False),
        (dist.MixtureSameFamily(dist.Categorical(torch.ones(2)), dist.Normal(torch.zeros(2), torch.ones(2))), False),
    ],
)
def test_only_priors_with_one_scalar_parameter_set_are_grouped(prior, groups):
    scalar = _logjoint._scalar_prior(prior)
    assert (scalar is not None) == groups
    if groups:
        v = torch.randn(prior.shape())
        torch.testing.assert_close(scalar.log_prob(v).sum(), prior.log_prob(v))


def _flat_problem(model, x, y, n):
    init, _, transforms, _ = initialize_model(lambda: quiet_model(model, n)(x, y), model_args=())
    shapes = {k: init[k].shape for k in sorted(init)}
    joint = _logjoint.build(model, n)
    theta = torch.cat([init[k].reshape(-1) for k in shapes])
    return (lambda compile: _logjoint.flat_potential_and_grad(joint, transforms, x, y, shapes, compile=compile)), theta


@pytest.mark.parametrize("traceable", [True, False])
def test_a_model_that_cannot_be_recorded_warns_and_uses_the_traced_else_the_eager_gradient(monkeypatch, traceable):
    def refuse(*args, **kwargs):
        raise RuntimeError("not recordable")

    # a stage after make_fx fails (TorchScript's freeze, as on a Conv1d graph): the traced energy where it traces,
    # else eager; make_fx itself refusing goes straight to eager (the next test)
    monkeypatch.setattr(torch.jit, "freeze", refuse)
    if not traceable:
        monkeypatch.setattr(torch.jit, "trace", refuse)
    model, (x, y) = CASES["fixed-noise"](), _data()
    make, theta = _flat_problem(model, x, y, 40)
    used = "the traced energy differentiated by autograd" if traceable else "the eager version"
    with pytest.warns(
        RuntimeWarning, match=f"could not compile the potential's gradient.*not recordable.*using {used}"
    ):
        u, grad = make(True)(theta)
    u_eager, grad_eager = make(False)(theta)
    torch.testing.assert_close(u, u_eager, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, grad_eager, rtol=RTOL, atol=ATOL)
    if not traceable:
        assert torch.equal(u, u_eager) and torch.equal(grad, grad_eager)


class _Gate(torch.nn.Module):
    """A forward that branches on a tensor's value: make_fx refuses it, and a TorchScript trace would freeze the branch
    taken at the start point."""

    def forward(self, h):
        return 3.0 * h if h.abs().mean() > 1.0 else h


def test_a_net_that_branches_on_a_value_runs_the_eager_gradient_not_a_frozen_trace():
    """make_fx refuses a net whose forward branches on a tensor's value; a TorchScript trace of its energy freezes the
    branch the start point takes, and the two-point check near that point cannot see the other branch (review 20: U
    270.9 where the eager energy is 448.7 at a point one prior sd out). Such a net now runs the eager gradient, whose
    values match the eager ones at every point, here at the start and at points on either side of the branch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 4, generator=g)
    y = (x[:, 0] > 0).float()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1), _Gate())
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Bernoulli())
    make, theta = _flat_problem(model, x, y, 100)
    compiled, eager = make(True), make(False)
    with pytest.warns(RuntimeWarning, match="could not compile the potential's gradient.*using the eager version"):
        compiled(0.1 * theta)
    far = torch.randn(theta.shape, generator=torch.Generator().manual_seed(5))
    for point in (0.1 * theta, theta, far):
        u, grad = compiled(point)
        u_eager, grad_eager = eager(point)
        assert torch.equal(u, u_eager) and torch.equal(grad, grad_eager)


def test_a_conv1d_net_falls_back_to_the_traced_energy_for_the_gradient_and_the_leapfrog_step():
    """A ``Conv1d`` layer cannot be recorded as one graph (make_fx): HMC's gradient and NUTS's leapfrog step use
    the energy traced by TorchScript, differentiated by autograd (what Pyro's HMC ran on such nets), with the eager
    values, rather than the eager energy."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 1, 8, generator=g), torch.randint(3, (30,), generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(12, 3))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    make, theta = _flat_problem(model, x, y, 30)
    compiled, eager = make(True), make(False)
    traced = "using the traced energy differentiated by autograd"
    with pytest.warns(RuntimeWarning, match=f"could not compile the potential's gradient.*{traced}"):
        u, grad = compiled(theta)
    u_eager, grad_eager = eager(theta)
    torch.testing.assert_close(u, u_eager, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, grad_eager, rtol=RTOL, atol=ATOL)
    p, minv, step = torch.randn(theta.shape, generator=g), torch.ones_like(theta), torch.tensor(0.01)
    with pytest.warns(RuntimeWarning, match=f"could not compile the leapfrog step.*{traced}"):
        out = compiled.leapfrog(theta, p, grad, step, minv)
    for a, b in zip(out, eager.leapfrog(theta, p, grad_eager, step, minv)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def _guide_with_spread(model, x, y, kind):
    guide = kind(model)
    guide(x, y, dataset_size=100)  # set up, then move the parameters away from their initial values
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _name, p in pyro.get_param_store().named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return guide


@pytest.mark.parametrize("guide_kind", [autoguide.AutoNormal, autoguide.AutoDelta])
@pytest.mark.parametrize("num_particles", [1, 4])
@pytest.mark.parametrize("case", ["learned-noise", "biases-deterministic", "classifier"])
def test_elbo_and_gradient_equal_pyro(case, num_particles, guide_kind):
    model, (x, y) = CASES[case](), _data()
    y = _target(case, y)
    with pyro.get_param_store().scope():
        guide = _guide_with_spread(model, x, y, guide_kind)
        params = dict(pyro.get_param_store().named_parameters())
        elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=1)
        pyro.set_rng_seed(3)
        expected = elbo.differentiable_loss(
            lambda a, b: call_model(model, a, b, 100), lambda a, b: guide(a, b, dataset_size=100), x, y
        )
        grads_pyro = torch.autograd.grad(expected, list(params.values()))
        loss = _logjoint.svi_loss(_logjoint.build(model, 100), guide, num_particles)
        pyro.set_rng_seed(3)
        actual, value = loss(x, y)
        grads_fast = torch.autograd.grad(actual, list(params.values()))
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    assert value == pytest.approx(float(expected.detach()), rel=RTOL)
    for a, b in zip(grads_fast, grads_pyro):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_models_outside_the_fast_path_are_refused():
    hier = _model(bp.likelihoods.Gaussian(scale=0.3), prior=bp.priors.HierarchicalNormal())
    assert _logjoint.build(hier, 10) is None

    def pyro_function(x, y=None):
        return pyro.sample("obs", dist.Normal(pyro.sample("w", dist.Normal(0.0, 1.0)) * x[:, 0], 1.0), obs=y)

    assert _logjoint.build(pyro_function, 10) is None
    guide = autoguide.AutoLowRankMultivariateNormal(_model(bp.likelihoods.Gaussian(scale=0.3)))
    assert _logjoint.svi_loss(_logjoint.build(_model(bp.likelihoods.Gaussian(scale=0.3)), 10), guide) is None


@pytest.mark.parametrize("guide", ["mean_field", "map"])
def test_svi_fit_follows_the_same_trajectory_with_and_without_the_fast_path(guide):
    model, (x, y) = CASES["learned-noise"](), _data(n=120)
    runs = [
        bp.fit(
            model,
            x,
            y,
            method="svi",
            guide=guide,
            num_steps=60,
            batch_size=32,
            num_particles=2,
            seed=0,
            num_samples=4,
            progress=False,
            fast_path=fast,
        )
        for fast in (True, False)
    ]
    assert [r.config["fast_path"] for r in runs] == [True, False]
    fast, plain = runs
    # losses are sums over ~120 scaled terms of size ~10-100: float32 rounding is ~1e-3 absolute
    torch.testing.assert_close(fast.history["loss"], plain.history["loss"], rtol=1e-5, atol=1e-2)
    for name in plain.samples:
        torch.testing.assert_close(fast.samples[name], plain.samples[name], rtol=1e-4, atol=1e-4)


# NUTS and HMC on the fast path (any log joint, analytic or compiled) run the flat kernels of
# bnn_pyro/infer/_one_chain.py, whose random streams differ from Pyro's kernels': their potential is checked against
# Pyro's above (test_flat_potential_and_gradient_equal_pyro) and their draws against exact posteriors
# (tests/infer/test_mcmc_hmc_flat.py, test_batched.py, test_nuts.py); Metropolis keeps one kernel on both paths
@pytest.mark.parametrize("method,options,case", [("metropolis", dict(num_warmup=40), "learned-noise")])
def test_mcmc_draws_agree_with_and_without_the_fast_path(method, options, case):
    # HMC trajectories are chaotic, so rounding differences grow over long runs: a short run only
    model, (x, y) = CASES[case](), _data(n=120)
    runs = [
        bp.fit(model, x, y, method=method, num_samples=5, seed=0, progress=False, fast_path=fast, **options)
        for fast in (True, False)
    ]
    assert [r.config["fast_path"] for r in runs] == [True, False]
    for name in runs[1].samples:
        torch.testing.assert_close(runs[0].samples[name], runs[1].samples[name], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(runs[0].sample_stats["lp"], runs[1].sample_stats["lp"], rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("jit", [False, True])
def test_potential_of_a_diverged_point_is_nan_not_an_error(jit):
    # a diverging leapfrog trajectory reaches NaN weights: the energy must be NaN (the proposal is
    # rejected), not a ValueError from a validating distribution (as on Pyro's path)
    model, (x, y) = CASES["learned-noise"](), _data()
    init, _, transforms, _ = initialize_model(lambda: quiet_model(model, 40)(x, y), model_args=())
    energy = _logjoint.potential(_logjoint.build(model, 40), transforms, x, y, jit=jit)
    assert torch.isfinite(energy(init))
    bad = dict(init, **{"0.weight": torch.full_like(init["0.weight"], float("nan"))})
    assert torch.isnan(energy(bad))
