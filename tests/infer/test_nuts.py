"""The fast path's NUTS (bnn_pyro/infer/_nuts.py) against exact Gaussian posteriors.

Two kinds of check:

- one transition from exact draws: start ``n`` independent copies at exact posterior draws of a
  Bayesian linear regression and apply ONE NUTS transition (fixed step size, no adaptation) to each.
  A correct kernel leaves the posterior invariant, so the results are again ``n`` independent exact
  draws: each mean coordinate and covariance entry has a z-score ``(estimate - exact) / (sd / sqrt(n))``
  with exact ``sd`` (see tests/infer/test_mcmc.py), and ``|z| < 4`` fails with probability ~6e-5 each.
  This isolates the transition (multinomial sampling, turning checks) from adaptation.
- whole fits through ``bp.fit`` (adaptation included), with the MCSE z-scores of test_mcmc.py.
"""

import math

import pyro
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._analytic import StackPotential
from bnn_pyro.infer._nuts import FlatNUTS
from blr import BLR
from test_mcmc import SIGMA, PRIOR_VAR, Z_MAX, _assert_exact, _blr

N_START = 1500


def _correlated(n: int = 12, d: int = 2, seed: int = 0):
    """Few rows with correlated columns: a posterior with correlations of ~0.8 and unequal scales."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, generator=g)
    x = base + 0.4 * torch.randn(n, d, generator=g)
    x[:, -1] *= 3.0
    y = x @ torch.linspace(1.0, -1.0, d) + 0.3 + SIGMA * torch.randn(n, generator=g)
    return x, y


def _kernel(x, y, **options):
    model = quiet_model(_blr(x.shape[1]), len(x))
    joint = _logjoint.build(_blr(x.shape[1]), len(x))
    kernel = FlatNUTS(model, joint, init_strategy=pyro.infer.autoguide.init_to_median, **options)
    kernel.setup(0, x, y)
    assert isinstance(kernel._potential, StackPotential)  # the exact checks run on the analytic path
    return kernel


def _iid_z(w: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor) -> dict[str, float]:
    n, z = w.shape[0], {}
    for i in range(len(mean)):
        z[f"mean[{i}]"] = float((w[:, i].mean() - mean[i]) / (cov[i, i].sqrt() / math.sqrt(n)))
    centered = w - mean
    for i in range(len(mean)):
        for j in range(i, len(mean)):
            sd = math.sqrt(cov[i, i] * cov[j, j] + cov[i, j] ** 2)
            z[f"cov[{i},{j}]"] = float(((centered[:, i] * centered[:, j]).mean() - cov[i, j]) / (sd / math.sqrt(n)))
    return z


@pytest.mark.parametrize("step_size, max_tree_depth, mass", [
    (0.05, 10, "identity"), (0.1, 10, "identity"), (0.05, 2, "identity"),
    (0.2, 10, "diagonal"),  # twice the posterior variances: M is not I, and not the covariance either
    (0.5, 10, "dense"),  # a dense M^-1 near the posterior covariance (scaled, with a twist)
])
def test_one_transition_keeps_exact_draws_exact(step_size, max_tree_depth, mass):
    x, y = _correlated()
    exact = BLR(x=x, y=y, noise=SIGMA, prior_scale=math.sqrt(PRIOR_VAR))
    torch.manual_seed(0)
    start = torch.distributions.MultivariateNormal(exact.mean, exact.cov).sample((N_START,)).float()
    kernel = _kernel(x, y, max_tree_depth=max_tree_depth, dense_mass=mass == "dense")
    kernel._adapter.step_size = step_size
    assert kernel._names == ("bias", "weight")  # the flat vector: bias first, then the weights
    order = [2, 0, 1]  # exact.cov is (weight, weight, bias)
    cov = exact.cov[order][:, order].float()
    if mass == "diagonal":
        kernel._adapter.mass_matrix_adapter.inverse_mass_matrix = {kernel._names: 2.0 * cov.diagonal()}
    elif mass == "dense":
        twist = torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.0, 0.3], [0.1, 0.0, 1.0]])
        kernel._adapter.mass_matrix_adapter.inverse_mass_matrix = {kernel._names: 1.5 * twist @ cov @ twist.T}
    out, steps = [], []
    for w in start:
        z = torch.cat([w[-1:], w[:-1]])
        u, g = kernel._potential(z)
        kernel._state = (z, float(u), g)
        params = kernel.sample(None)
        out.append(torch.cat([params["weight"].reshape(-1), params["bias"].reshape(-1)]))
        steps.append(kernel.stats.n_steps)
    w = torch.stack(out).double()
    assert not (w == start.double()).all(1).float().mean() > 0.5  # the draws moved
    assert max(steps) <= 2**max_tree_depth - 1
    z = _iid_z(w, exact.mean, exact.cov)
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"one NUTS transition moved exact draws off the posterior: {bad}"


@pytest.mark.parametrize("dense_mass, jit", [(False, False), (True, True)])
def test_fit_recovers_exact_posterior(dense_mass, jit):
    x, y = _correlated(n=30, d=2, seed=1)
    post = bp.fit(_blr(2), x, y, method="nuts", num_samples=800, num_warmup=200, seed=4, progress=False,
                  dense_mass=dense_mass, jit=jit)
    assert post.config["fast_path"] is True
    mass = post.history["inverse_mass_matrix"]
    assert mass.shape == ((1, 3, 3) if dense_mass else (1, 3))
    _assert_exact(post, x, y)
    stats = post.sample_stats
    assert (stats["n_steps"] >= 1).all() and (stats["n_steps"] <= 2 ** stats["tree_depth"] - 1).all()
    assert not stats["diverging"].any() and 0.6 < float(stats["acceptance_rate"].mean()) <= 1.0


@pytest.mark.slow  # ~7 s
def test_fit_matches_quadrature_on_a_non_gaussian_two_weight_net():
    """``f(x) = w2 tanh(w1 x)`` with Normal(0, 1) priors: a curved, two-mode posterior (``(w1, w2)`` and
    ``(-w1, -w2)``) whose moments a 2,401 x 2,401 grid gives exactly (the prior's mass beyond |w| = 6 is
    ~1e-9). Sign-symmetric quantities need no mixing between the modes. z = (estimate - exact) / MCSE
    (ArviZ, both chains); |z| < 4 as in test_mcmc.py."""
    import arviz as az

    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, 12)[:, None]
    y = 1.5 * torch.tanh(1.2 * x[:, 0]) + 0.3 * torch.randn(12, generator=g)
    grid = torch.linspace(-6, 6, 2401, dtype=torch.float64)
    w1, w2 = torch.meshgrid(grid, grid, indexing="ij")
    log_p = -0.5 * (w1**2 + w2**2) - 0.5 * ((y.double() - w2[..., None] * torch.tanh(w1[..., None] * x[:, 0].double())) ** 2).sum(-1) / 0.09
    p = (log_p - log_p.max()).exp()
    p = p / p.sum()
    stats = {"|w1|": lambda a, b: a.abs(), "w1^2": lambda a, b: a**2, "w2^2": lambda a, b: b**2, "w1 w2": lambda a, b: a * b,
             "f(1)": lambda a, b: b * torch.tanh(a), "f(1)^2": lambda a, b: (b * torch.tanh(a)) ** 2}
    net = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Tanh(), torch.nn.Linear(1, 1, bias=False))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    post = bp.fit(model, x, y, method="nuts", num_samples=4000, num_warmup=500, num_chains=2, seed=0, progress=False)
    assert post.config["fast_path"] is True
    a, b = post.samples["0.weight"].reshape(2, -1).double(), post.samples["2.weight"].reshape(2, -1).double()
    z = {}
    for name, h in stats.items():
        draws = h(a, b)
        z[name] = (float(draws.mean()) - float((p * h(w1, w2)).sum())) / float(az.mcse(draws.numpy(), method="mean"))
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"NUTS moments off the quadrature ones: {bad} (all: { {k: round(v, 2) for k, v in z.items()} })"


def test_resume_across_the_fast_and_the_plain_path():
    """Both NUTS kernels lay out the mass matrix alike (sites in sorted order), so either extends the other."""
    x, y = _correlated(n=30)
    model = _blr(2)
    fast = bp.fit(model, x, y, method="nuts", num_samples=5, num_warmup=40, seed=0, progress=False)
    plain = bp.fit(model, x, y, method="nuts", resume=fast, num_samples=5, seed=1, progress=False, fast_path=False)
    again = bp.fit(model, x, y, method="nuts", resume=plain, num_samples=5, seed=2, progress=False)
    assert [p.config["fast_path"] for p in (fast, plain, again)] == [True, False, True]
    assert again.num_draws == 15 and torch.equal(again.history["inverse_mass_matrix"], fast.history["inverse_mass_matrix"])
    assert torch.equal(again.sample_stats["step_size"][:, 5:], fast.sample_stats["step_size"][:, -1:].expand(1, 10))


def test_a_diverging_trajectory_is_counted_and_the_draw_kept():
    x, y = _correlated()
    kernel = _kernel(x, y)
    z0, _, _ = kernel._state
    before = {k: v.clone() for k, v in kernel._unflatten(z0).items()}
    nan = float("nan")
    kernel._potential.leapfrog = lambda z, p, g, step, minv: (z + nan, p + nan, g + nan, p + nan, torch.tensor([nan, nan]))
    params = kernel.sample(before)
    assert kernel.stats.diverging and kernel.stats.n_steps == 1 and kernel.stats.tree_depth == 1
    for name, value in before.items():
        assert torch.equal(params[name], value)


def test_same_seed_same_draws_and_adaptation_reaches_the_target():
    x, y = _correlated(n=30)
    model = _blr(2)  # one model: init="net" starts at its weights
    runs = [bp.fit(model, x, y, method="nuts", num_samples=200, num_warmup=200, seed=7, progress=False)
            for _ in range(2)]
    for name in runs[0].samples:
        assert torch.equal(runs[0].samples[name], runs[1].samples[name])
    # dual averaging toward 0.8: the mean acceptance statistic after warm-up lands near it (Stan's
    # multinomial NUTS typically ends a little above the target on Gaussian posteriors)
    assert 0.7 < float(runs[0].sample_stats["acceptance_rate"].mean()) < 0.99
