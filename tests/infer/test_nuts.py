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
from blr import BLR
from test_mcmc import PRIOR_VAR, SIGMA, Z_MAX, _assert_exact, _blr

import bnn_pyro as bp
from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._analytic import StackPotential
from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._nuts import FlatNUTS

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
    assert isinstance(kernel.chains.leapfrog.pot, StackPotential)  # the exact checks run on the analytic path
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


def _stay_bound(start, mean, cov, inverse_mass, step_size, *, num_momenta: int = 64) -> float:
    """An upper bound on the fraction of exact draws that one NUTS transition leaves where they were, plus
    ``Z_MAX`` binomial standard errors of the fraction over ``len(start)`` draws. The kernel's top-level doublings are
    biased progressive sampling (``bnn_pyro/infer/_nuts.py``: the new subtree's draw replaces the current one with
    probability ``min(1, w_new / w_old)``), so the first doubling (one leapfrog leaf, weight ``exp(-dH)`` against the
    start's 1; a divergent leaf is dropped) moves a draw with probability ``min(1, exp(-dH))``, and a later doubling
    keeps the current point or moves to a new one, never back to the start. Hence P(stay) <= E[1 - min(1, exp(-dH))]
    over the start draws and momenta ``p ~ N(0, M)``, either direction alike for a Gaussian: ``dH`` is the energy
    error of one leapfrog step on the exact Gaussian posterior's potential (a non-finite one counts as a stay);
    ``num_momenta`` momenta per draw make the Monte Carlo error of that expectation negligible against the binomial
    error of the observed fraction. An identity kernel (nothing moves) fails it."""
    precision = torch.linalg.inv(cov.double())
    inv_m = inverse_mass.double()
    z0 = start.double().repeat(num_momenta, 1)
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(z0.shape, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(torch.linalg.inv(inv_m)).T

    def energy(z, p):
        d = z - mean.double()
        return 0.5 * ((d @ precision) * d).sum(1) + 0.5 * ((p @ inv_m) * p).sum(1)

    p = p0 - 0.5 * step_size * (z0 - mean.double()) @ precision
    z = z0 + step_size * p @ inv_m
    p = p - 0.5 * step_size * (z - mean.double()) @ precision
    d_h = torch.nan_to_num(energy(z, p) - energy(z0, p0), nan=math.inf)
    bound = float((1 - torch.exp(-d_h.clamp(min=0.0))).mean())
    return bound + Z_MAX * math.sqrt(bound * (1 - bound) / len(start))


@pytest.mark.parametrize(
    "step_size, max_tree_depth, mass",
    [
        (0.05, 10, "identity"),
        (0.1, 10, "identity"),
        (0.05, 2, "identity"),
        (0.2, 10, "diagonal"),  # twice the posterior variances: M is not I, and not the covariance either
        (0.5, 10, "dense"),  # a dense M^-1 near the posterior covariance (scaled, with a twist)
    ],
)
def test_one_transition_keeps_exact_draws_exact(step_size, max_tree_depth, mass):
    x, y = _correlated()
    exact = BLR(x=x, y=y, noise=SIGMA, prior_scale=math.sqrt(PRIOR_VAR))
    torch.manual_seed(0)
    start = torch.distributions.MultivariateNormal(exact.mean, exact.cov).sample((N_START,)).float()
    kernel = _kernel(x, y, max_tree_depth=max_tree_depth, dense_mass=mass == "dense")
    chains = kernel.chains
    adapter = chains._adapters[0]
    adapter.step_size = step_size
    assert kernel._names == ("bias", "weight")  # the flat vector: bias first, then the weights
    order = [2, 0, 1]  # exact.cov is (weight, weight, bias)
    cov = exact.cov[order][:, order].float()
    inverse_mass = torch.eye(3)
    if mass == "diagonal":
        inverse_mass = torch.diag(2.0 * cov.diagonal())
        adapter.mass_matrix_adapter.inverse_mass_matrix = {kernel._names: 2.0 * cov.diagonal()}
    elif mass == "dense":
        twist = torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.0, 0.3], [0.1, 0.0, 1.0]])
        inverse_mass = 1.5 * twist @ cov @ twist.T
        adapter.mass_matrix_adapter.inverse_mass_matrix = {kernel._names: inverse_mass}
    out, steps = [], []
    for w in start:
        z = torch.cat([w[-1:], w[:-1]])[None]
        u, g = chains.leapfrog.pot.batch(1)(z)
        chains.z, chains.u, chains.g = z, u.clone(), g.clone()
        params = kernel.sample(None)
        out.append(torch.cat([params["weight"].reshape(-1), params["bias"].reshape(-1)]))
        steps.append(kernel.stats.n_steps)
    w = torch.stack(out).double()
    stayed = float((w == start.double()).all(1).float().mean())  # the draws moved: no more stay than one step allows
    flat = start[:, order].double()  # the kernel's order (bias, weights)
    bound = _stay_bound(flat, exact.mean[order].double(), cov, inverse_mass, step_size)
    assert stayed <= bound, (stayed, bound)
    assert max(steps) <= 2**max_tree_depth - 1
    z = _iid_z(w, exact.mean, exact.cov)
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"one NUTS transition moved exact draws off the posterior: {bad}"


@pytest.mark.parametrize("dense_mass, jit", [(False, False), (True, True)])
def test_fit_recovers_exact_posterior(dense_mass, jit):
    x, y = _correlated(n=30, d=2, seed=1)
    post = bp.fit(
        _blr(2),
        x,
        y,
        method="nuts",
        num_chains=1,
        num_samples=800,
        num_warmup=200,
        seed=4,
        progress=False,
        dense_mass=dense_mass,
        jit=jit,
    )
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
    log_p = (
        -0.5 * (w1**2 + w2**2)
        - 0.5 * ((y.double() - w2[..., None] * torch.tanh(w1[..., None] * x[:, 0].double())) ** 2).sum(-1) / 0.09
    )
    p = (log_p - log_p.max()).exp()
    p = p / p.sum()
    stats = {
        "|w1|": lambda a, b: a.abs(),
        "w1^2": lambda a, b: a**2,
        "w2^2": lambda a, b: b**2,
        "w1 w2": lambda a, b: a * b,
        "f(1)": lambda a, b: b * torch.tanh(a),
        "f(1)^2": lambda a, b: (b * torch.tanh(a)) ** 2,
    }
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
    fast = bp.fit(model, x, y, method="nuts", num_chains=1, num_samples=5, num_warmup=40, seed=0, progress=False)
    plain = bp.fit(model, x, y, method="nuts", resume=fast, num_samples=5, seed=1, progress=False, fast_path=False)
    again = bp.fit(model, x, y, method="nuts", resume=plain, num_samples=5, seed=2, progress=False)
    assert [p.config["fast_path"] for p in (fast, plain, again)] == [True, False, True]
    assert again.num_draws == 15 and torch.equal(
        again.history["inverse_mass_matrix"], fast.history["inverse_mass_matrix"]
    )
    assert torch.equal(again.sample_stats["step_size"][:, 5:], fast.sample_stats["step_size"][:, -1:].expand(1, 10))


def test_a_diverging_trajectory_is_counted_and_the_draw_kept():
    x, y = _correlated()
    kernel = _kernel(x, y)
    z0 = kernel.chains.z[0]
    before = {k: v.clone().reshape(kernel._shapes[k]) for k, v in zip(kernel._names, z0.split(kernel.chains.sizes))}
    nan = float("nan")
    kernel.chains.leapfrog.unbatched = lambda z, p, g, step, minv: (
        z + nan,
        p + nan,
        g + nan,
        p + nan,
        torch.tensor([nan, nan]),
    )
    params = kernel.sample(before)
    assert kernel.stats.diverging and kernel.stats.n_steps == 1 and kernel.stats.tree_depth == 1
    for name, value in before.items():
        assert torch.equal(params[name], value)


def test_same_seed_same_draws_and_adaptation_reaches_the_target():
    x, y = _correlated(n=30)
    model = _blr(2)  # one model: init="net" starts at its weights
    runs = [
        bp.fit(model, x, y, method="nuts", num_chains=1, num_samples=200, num_warmup=200, seed=7, progress=False)
        for _ in range(2)
    ]
    for name in runs[0].samples:
        assert torch.equal(runs[0].samples[name], runs[1].samples[name])
    # dual averaging toward 0.8: the mean acceptance statistic after warm-up lands near it (Stan's
    # multinomial NUTS typically ends a little above the target on Gaussian posteriors)
    assert 0.7 < float(runs[0].sample_stats["acceptance_rate"].mean()) < 0.99


# ---------------------------------------------------------------------- the fast path's pieces, against direct formulas
def _one_input_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _three_input_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1), torch.nn.Sigmoid())


@pytest.mark.parametrize(
    "net, noise, d",
    [
        (_one_input_net, "fixed", 1),  # one input: the first layer is an outer product (addcmul)
        (_three_input_net, "sigma", 3),  # a learned noise; the net ends with an activation
    ],
)
@pytest.mark.parametrize("dense", [False, True])
def test_a_leapfrog_step_equals_verlet_on_pyros_potential(net, noise, d, dense):
    """``StackPotential.leapfrog`` against velocity Verlet written out on Pyro's potential energy and autograd
    (float64): position, momentum, gradient, ``M^-1 p`` and the energies (Python floats) at the new point."""
    from pyro.infer.mcmc.util import initialize_model

    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(20, d, generator=g)
        y = torch.sin(x.sum(1)) + 0.1 * torch.randn(20, generator=g)
        likelihood = bp.likelihoods.Gaussian(scale=0.3 if noise == "fixed" else pyro.distributions.HalfNormal(1.0))
        model = bp.BNN(net(), prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
        init, potential, _, _ = initialize_model(lambda: quiet_model(model, 20)(x, y), model_args=())
        names = sorted(init)
        shapes = {n: init[n].shape for n in names}
        pot = _logjoint.analytic(_logjoint.build(model, 20), names, shapes, x, y)
        assert isinstance(pot, StackPotential)

        def u_and_grad(theta):
            theta = theta.detach().requires_grad_()
            parts = dict(zip(names, theta.split([init[n].numel() for n in names])))
            u = potential({n: parts[n].reshape(shapes[n]) for n in names})
            return float(u), torch.autograd.grad(u, theta)[0]

        size = sum(v.numel() for v in init.values())
        z = torch.cat([init[n].reshape(-1) for n in names]) + 0.3 * torch.randn(size, generator=g)
        p = torch.randn(size, generator=g)
        a = torch.randn(size, size, generator=g)
        minv = a @ a.T / size + torch.eye(size) if dense else torch.rand(size, generator=g) + 0.5
        step = -0.01  # a backward step: the sign is the direction
        _, g0 = u_and_grad(z)
        z1, p1, g1, sharp1, (u1, kinetic1) = pot.leapfrog(z, p, g0, step, minv)
        mul = (lambda v: minv @ v) if dense else (lambda v: minv * v)
        half = p - 0.5 * step * g0
        z_ref = z + step * mul(half)
        u_ref, g_ref = u_and_grad(z_ref)
        p_ref = half - 0.5 * step * g_ref
        for found, expected in ((z1, z_ref), (g1, g_ref), (p1, p_ref), (sharp1, mul(p_ref))):
            assert torch.allclose(found, expected, rtol=1e-10, atol=1e-10)
        assert type(u1) is float and u1 == pytest.approx(u_ref, rel=1e-10, abs=1e-10)
        assert kinetic1 == pytest.approx(0.5 * float(p_ref @ mul(p_ref)), rel=1e-10)
        u_call, g_call = pot(z_ref)  # the call on the bound data agrees with the step's energies
        assert float(u_call) == pytest.approx(u_ref, rel=1e-10, abs=1e-10) and torch.allclose(g_call, g_ref, atol=1e-10)
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_turning_checks_equal_stans_six_inner_products():
    """``_turned`` (sums of one matrix product; one inner product for two single states) against Stan's checks
    written out: ``p_sharp . rho > 0`` at both ends of the whole trajectory, of ``old`` plus ``new``'s first state,
    and of ``old``'s last state plus ``new``, with the summed momenta formed first. One chain unbatched, the same
    merges as ``C`` chains at once, and several merges of one chain at once (turned where any one turns)."""
    from bnn_pyro.infer._nuts import _Node, _turned

    g = torch.Generator().manual_seed(0)
    d = 5
    minv = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    checked, merges, expect = {True: 0, False: 0}, {True: [], False: []}, {True: [], False: []}
    for trial in range(400):
        single = trial % 2 == 0  # two single states, or two longer segments
        ps = [torch.randn(d, generator=g, dtype=torch.float64) + 0.6 for _ in range(2 if single else 6)]
        sharps = [minv * p for p in ps]
        old_states, new_states = (ps[:1], ps[1:]) if single else (ps[:3], ps[3:])
        old_sharps, new_sharps = (sharps[:1], sharps[1:]) if single else (sharps[:3], sharps[3:])
        pp = (lambda p, s: [float(p @ s)]) if single else (lambda p, s: None)
        old = _Node(
            old_states[0],
            old_sharps[0],
            old_states[-1],
            old_sharps[-1],
            sum(old_states),
            pp(old_states[0], old_sharps[0]),
        )
        new = _Node(
            new_states[0],
            new_sharps[0],
            new_states[-1],
            new_sharps[-1],
            sum(new_states),
            pp(new_states[0], new_sharps[0]),
        )
        # new grown from old's far end: old's other end is its near one
        rho = old.rho + new.rho
        products = [
            old.near_sharp @ rho,
            new.far_sharp @ rho,
            old.near_sharp @ (old.rho + new.near_p),
            new.near_sharp @ (old.rho + new.near_p),
            old.far_sharp @ (new.rho + old.far_p),
            new.far_sharp @ (new.rho + old.far_p),
        ]
        if min(abs(float(v)) for v in products) < 1e-9:
            continue  # too close to zero to tell
        expected = not all(float(v) > 0 for v in products)
        assert _turned([(old, new)], True) == [expected]
        checked[expected] += 1
        merges[single].append((old, new))
        expect[single].append(expected)
    assert min(checked.values()) > 20  # both outcomes exercised
    for single in (True, False):  # the same merges as C chains in lockstep
        nodes = merges[single]
        stacked = [
            _Node(
                *(torch.stack([getattr(n[k], f) for n in nodes]) for f in _Node._fields[:5]),
                [n[k].pp[0] for n in nodes] if single else None,
            )
            for k in (0, 1)
        ]
        assert _turned([tuple(stacked)], False) == expect[single]
    some = merges[False][:6]  # several merges of one chain: one check
    for i in range(len(some) - 2):
        assert _turned(some[i : i + 3], True) == [any(expect[False][i : i + 3])]


def test_a_checkpoint_of_the_recursive_kernel_is_refused_naming_the_version(tmp_path):
    """Before the one NUTS builder, a one-chain NUTS checkpoint held the recursive kernel's state (its Python
    generator under "rng"): this version cannot continue it and says which version can, naming the file (the check
    that ``bp.fit(..., resume=True)`` makes before any chain runs; tests/infer/test_compat_files.py runs it on a file
    that version wrote)."""
    from bnn_pyro.infer import _one_chain
    from bnn_pyro.infer.checkpoint import Checkpoint, CheckpointError, write

    old_meta = {"adapter": {}, "u": 0.0, "rng": [3, [0] * 625, None], "counters": [10, 0.8, [], 0.0]}
    ckpts = [Checkpoint(tmp_path, every=None, resume=True, chain=c, run={}) for c in range(2)]
    write(ckpts[0].path, {"kernel/z": torch.zeros(3)}, {"kernel": old_meta})
    _one_chain.refuse_old_checkpoints(ckpts, "hmc")  # another method's kernels: not this marker's
    with pytest.raises(
        CheckpointError,
        match=r"chain0\.ckpt' was written by the recursive NUTS kernel .* a7736d0.*Resume it with the version",
    ):
        _one_chain.refuse_old_checkpoints(ckpts, "nuts")


@pytest.mark.parametrize("dense_mass", [False, True])
def test_the_one_chain_held_unbatched_draws_bit_for_bit_what_its_batch_of_one_draws(dense_mass):
    """method="nuts"'s kernel (the default) holds its chain as (D,) vectors and a float potential; through warm-up
    (dual averaging, a mass-matrix window, the step-size heuristic) and sampling it draws exactly what the same
    chain held as a (1, D) batch draws from the same seed, and its checkpoint has the batch's shapes, so that either
    resumes the other's (a checkpoint of 017d938, which held the batch, included)."""
    from bnn_pyro.infer._nuts import nuts_transition
    from bnn_pyro.infer._one_chain import OneChainKernel

    x, y = _correlated()
    joint = _logjoint.build(_blr(x.shape[1]), len(x))
    model = quiet_model(_blr(x.shape[1]), len(x))
    start = dict(init_strategy=pyro.infer.autoguide.init_to_median, dense_mass=dense_mass)
    kernels = [
        FlatNUTS(model, joint, max_tree_depth=6, **start),
        OneChainKernel(model, joint, transition=nuts_transition, options=dict(max_tree_depth=6), **start),
    ]
    for kernel in kernels:
        torch.manual_seed(3)
        kernel.setup(40, x, y)
    held, batch = kernels
    assert held.chains._one and held.chains._z.dim() == 1 and not batch.chains._one
    for t in range(60):
        if t == 45:  # a checkpoint of each, loaded into the other: the same shapes, the same continuation
            saved = [k.state_dict() for k in kernels]
            for name in ("z", "u", "grad"):
                assert saved[0][0][name].shape == saved[1][0][name].shape == batch.chains.z.shape[: 2 - (name == "u")]
            held.load_state_dict(*saved[1])
            batch.load_state_dict(*saved[0])
        a, b = held.sample(None), batch.sample(None)
        assert all(torch.equal(a[n], b[n]) for n in a), f"draw {t} differs"
        assert held.stats == batch.stats
    assert held.step_size == batch.step_size and torch.equal(
        held.inverse_mass_matrix[held._names], batch.inverse_mass_matrix[batch._names]
    )
