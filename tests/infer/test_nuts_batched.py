"""NUTS's one transition (bnn_pyro/infer/_nuts.py) for C chains in lockstep, against exact answers and one chain.

- One transition from exact draws: C chains started at independent exact draws of a correlated 3-D Gaussian
  (closed-form potential and gradient) and ONE ``nuts_transition`` at a fixed step size are again C independent
  exact draws if the kernel leaves the target invariant. Each mean coordinate, covariance entry and marginal
  quantile (the fraction of draws below the exact quantile, a binomial proportion) gets a z-score with the exact
  standard deviation; ``|z| < 4`` (as tests/infer/test_nuts.py) fails with probability ~6e-5 each.
- Several transitions on a banana (non-Gaussian, closed-form moments).
- One chain run unbatched (``(D,)`` vectors, a float step: what ``method="nuts"`` runs per chain) and batched
  (``(1, D)``) give the same draw and statistics from the same generator.
- The statistics' distribution (steps, acceptance, divergences, tree depth) of C chains in lockstep equals that
  of single chains, within Monte Carlo error (two-sample z-scores): the masking of finished chains is exact.
"""

import math

import pytest
import torch

from bnn_pyro.infer._analytic_batched import OneChain, leapfrog_from
from bnn_pyro.infer._batched import TransitionStats
from bnn_pyro.infer._nuts import nuts_transition

Z_MAX = 4.0
DT = torch.float64
MEAN = torch.tensor([0.5, -1.0, 2.0], dtype=DT)
COV = torch.tensor([[1.0, 0.8, 0.1], [0.8, 1.0, 0.0], [0.1, 0.0, 4.0]], dtype=DT)
PREC = torch.linalg.inv(COV)
TWIST = torch.tensor([[1.0, 0.2, 0.0], [0.0, 1.0, 0.3], [0.1, 0.0, 1.0]], dtype=DT)
# diagonal: twice the marginal variances (M is neither I nor the covariance); dense: near the covariance, twisted
MASSES = {"diagonal": 2.0 * COV.diagonal(), "dense": 1.5 * TWIST @ COV @ TWIST.T}


def gaussian(theta):
    d = theta - MEAN
    grad = d @ PREC
    return 0.5 * (d * grad).sum(-1), grad


def banana(theta, b=1.0, s=0.5):
    """``x ~ N(0, 1)``, ``y | x ~ N(b x^2, s^2)``."""
    x, y = theta[..., 0], theta[..., 1]
    r = (y - b * x**2) / s**2
    u = 0.5 * x**2 + 0.5 * (y - b * x**2) ** 2 / s**2
    return u, torch.stack([x - 2.0 * b * x * r, r], -1)


def _limit(minv: torch.Tensor) -> float:
    """The largest stable leapfrog step on the Gaussian: 2 / sqrt(largest eigenvalue of M^-1 P)."""
    full = torch.diag(minv) if minv.dim() == 1 else minv
    return 2.0 / float(torch.linalg.eigvals(full @ PREC).real.max().sqrt())


def _exact(n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.distributions.MultivariateNormal(MEAN, COV).sample((n,))


def _quantile_z(w: torch.Tensor, loc, scale) -> dict[str, float]:
    """The fraction of draws below the exact marginal quantile at 0.1/0.5/0.9: a binomial proportion."""
    z, n = {}, w.shape[0]
    for level in (0.1, 0.5, 0.9):
        q = torch.distributions.Normal(loc, scale).icdf(torch.tensor(level, dtype=DT))
        z[f"P(w<q{level})"] = ((w < q).double().mean(0) - level) / math.sqrt(level * (1 - level) / n)
    return {f"{k}[{i}]": float(v[i]) for k, v in z.items() for i in range(len(loc))}


def _moment_z(w: torch.Tensor) -> dict[str, float]:
    n, z = w.shape[0], {}
    for i in range(3):
        z[f"mean[{i}]"] = float((w[:, i].mean() - MEAN[i]) / (COV[i, i].sqrt() / math.sqrt(n)))
    c = w - MEAN
    for i in range(3):
        for j in range(i, 3):
            sd = math.sqrt(COV[i, i] * COV[j, j] + COV[i, j] ** 2)
            z[f"cov[{i},{j}]"] = float(((c[:, i] * c[:, j]).mean() - COV[i, j]) / (sd / math.sqrt(n)))
    return z


class _Unbatched:
    """A potential's unbatched leapfrog (``(D,)`` vectors, a float step, energies as floats), as the analytic
    potential has it: :func:`leapfrog_from` on one chain."""

    def __init__(self, potential):
        self._step = leapfrog_from(potential)

    def leapfrog(self, z, p, g, step, minv):
        z, p, g, sharp, u, kinetic = self._step(z[None], p[None], g[None], torch.tensor([step], dtype=DT), minv[None])
        return z[0], p[0], g[0], sharp[0], (float(u[0]), float(kinetic[0]))


def _as_tensors(stats: TransitionStats) -> TransitionStats:
    return TransitionStats(
        *(torch.tensor(v, dtype=dtype) for v, dtype in zip(stats, (DT, torch.int64, torch.bool, DT, torch.int64)))
    )


def _transition(z, minv, step, seed, potential=gaussian, unbatched=False, **options):
    c = z.shape[0]
    u, g = potential(z)
    leapfrog = OneChain(_Unbatched(potential)) if unbatched else leapfrog_from(potential)
    z, u, g, stats = nuts_transition(
        z,
        u,
        g,
        torch.full((c,), step, dtype=DT),
        minv.expand(c, *minv.shape),
        leapfrog=leapfrog,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    return z, u, g, _as_tensors(stats)


def _assert_tree_shape(stats, max_depth):
    assert ((stats.tree_depth >= 1) & (stats.tree_depth <= max_depth)).all()
    # the last doubling added between 1 and 2**(depth - 1) steps to the 2**(depth - 1) - 1 before it
    assert (stats.n_steps >= 2 ** (stats.tree_depth - 1)).all() and (stats.n_steps < 2**stats.tree_depth).all()
    assert ((stats.accept_prob >= 0) & (stats.accept_prob <= 1)).all()


@pytest.mark.parametrize(
    "scale, max_tree_depth, mass",
    [
        (0.1, 1, "diagonal"),
        (0.1, 6, "diagonal"),
        (0.1, 3, "dense"),
        (0.1, None, "dense"),  # the default max_tree_depth (10)
        (1.15, 3, "diagonal"),
        (1.15, 6, "dense"),  # beyond the stability limit: some trajectories diverge
    ],
)
def test_one_transition_keeps_exact_draws_exact(scale, max_tree_depth, mass):
    n = 4000
    start = _exact(n, seed=0)
    minv = MASSES[mass]
    options = {} if max_tree_depth is None else {"max_tree_depth": max_tree_depth}
    w, u, g, stats = _transition(start, minv, scale * _limit(minv), seed=1, **options)
    u_ref, g_ref = gaussian(w)
    assert torch.allclose(u, u_ref) and torch.allclose(g, g_ref)  # the draw's potential and gradient
    _assert_tree_shape(stats, max_tree_depth or 10)
    assert (w != start).any(1).double().mean() > 0.25  # the draws moved
    if scale < 1:
        assert not stats.diverging.any()
        if max_tree_depth == 6:  # deep trees: some reach the cap
            assert (stats.tree_depth == 6).any() and stats.n_steps.double().mean() > 16
    else:
        assert 0 < stats.diverging.double().mean() < 0.2
    z = {**_moment_z(w), **_quantile_z(w, MEAN, COV.diagonal().sqrt())}
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"one batched NUTS transition moved exact draws off the target: {bad}"


def test_several_transitions_on_a_banana_keep_its_closed_form_moments():
    """x ~ N(0, 1), y = b x^2 + s eps: a curved target whose moments are Gaussian moments (b = 1, s = 0.5).
    Chains start at exact draws; after each of five transitions (default depth) the C draws are exact again."""
    n, b, s = 4000, 1.0, 0.5
    torch.manual_seed(2)
    x = torch.randn(n, dtype=DT)
    w = torch.stack([x, b * x**2 + s * torch.randn(n, dtype=DT)], -1)
    # h: (exact mean, exact variance) from E x^2k = (2k - 1)!!
    exact = {
        "x": (lambda x, y: x, 0.0, 1.0),
        "y": (lambda x, y: y, b, 2 * b**2 + s**2),
        "x^2": (lambda x, y: x**2, 1.0, 2.0),
        "x y": (lambda x, y: x * y, 0.0, 15 * b**2 + s**2),
        "y^2": (lambda x, y: y**2, 3 * b**2 + s**2, 105 * b**4 + 18 * b**2 * s**2 + 3 * s**4 - (3 * b**2 + s**2) ** 2),
        "x^2 y": (lambda x, y: x**2 * y, 3 * b, 105 * b**2 + 3 * s**2 - 9 * b**2),
    }
    minv = torch.tensor([1.0, 2.0], dtype=DT)
    moved, bad = [], {}
    for t in range(5):
        before = w
        w, _, _, stats = _transition(w, minv, 0.3, seed=10 + t, potential=banana)
        _assert_tree_shape(stats, 10)
        moved.append(float((w != before).any(1).double().mean()))
        for name, (h, mean, var) in exact.items():
            z = float((h(w[:, 0], w[:, 1]).mean() - mean) / math.sqrt(var / n))
            if not abs(z) < Z_MAX:
                bad[f"{name} after {t + 1}"] = round(z, 2)
        bad.update(
            {
                f"{k} after {t + 1}": round(v, 2)
                for k, v in _quantile_z(w[:, :1], torch.zeros(1, dtype=DT), torch.ones(1, dtype=DT)).items()
                if not abs(v) < Z_MAX
            }
        )
    assert min(moved) > 0.5  # most draws move at every transition
    assert not bad, f"batched NUTS moments off the banana's exact ones: {bad}"


@pytest.mark.parametrize("mass", ["diagonal", "dense"])
@pytest.mark.parametrize("scale, max_tree_depth", [(0.3, 10), (1.15, 4)])
def test_one_chain_unbatched_equals_batched(mass, scale, max_tree_depth):
    """Deterministic: one chain run on ``(D,)`` vectors with a float step (the per-chain path of method="nuts")
    gives exactly the draw and statistics of the same chain as a ``(1, D)`` batch, from the same generator."""
    minv = MASSES[mass]
    step = scale * _limit(minv)
    for i, z in enumerate(_exact(40, seed=11)):
        one, batch = (
            _transition(z[None], minv, step, seed=i, unbatched=flag, max_tree_depth=max_tree_depth)
            for flag in (True, False)
        )
        for a, b in zip(one[:3], batch[:3]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(one[3], batch[3]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _two_sample_z(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    se = math.sqrt(a.var() / len(a) + b.var() / len(b))
    return 0.0 if se == 0 else float((a.mean() - b.mean()) / se)


@pytest.mark.parametrize(
    "scale, max_tree_depth, mass",
    [
        pytest.param(0.25, 10, "dense", marks=pytest.mark.slow),  # ~10 s: deeper trees, 900 Python-level transitions
        (1.15, 4, "diagonal"),
    ],
)
def test_statistics_equal_single_chains(scale, max_tree_depth, mass):
    """Mean steps, acceptance, divergence rate and tree depth of one batch of 4,000 chains against 600 single-chain
    (C = 1, unbatched: method="nuts"'s path) calls, all from exact draws, within MC error."""
    minv = MASSES[mass]
    step = scale * _limit(minv)
    _, _, _, batch = _transition(_exact(4000, seed=4), minv, step, seed=5, max_tree_depth=max_tree_depth)
    batch = torch.stack(
        [batch.n_steps.double(), batch.accept_prob, batch.diverging.double(), batch.tree_depth.double()]
    )
    single = []
    for i, z in enumerate(_exact(600, seed=7)):
        _, _, _, s = _transition(z[None], minv, step, seed=100 + i, unbatched=True, max_tree_depth=max_tree_depth)
        single.append([float(s.n_steps[0]), float(s.accept_prob[0]), float(s.diverging[0]), float(s.tree_depth[0])])
    single = torch.tensor(single, dtype=DT).T
    names = ("n_steps", "accept_prob", "diverging", "tree_depth")
    z = {f"{name} vs C=1": _two_sample_z(batch[i], single[i]) for i, name in enumerate(names)}
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"lockstep NUTS statistics differ from single chains': {bad}"
    if scale > 1:
        assert single[2].mean() > 0 and batch[2].mean() > 0  # divergences on both sides


def test_same_generator_same_result_and_another_seed_differs():
    start = _exact(50, seed=8)
    runs = [_transition(start, MASSES["dense"], 0.2, seed=s) for s in (0, 0, 1)]
    for a, b in zip(runs[0][:3], runs[1][:3]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][3], runs[1][3]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0][0], runs[2][0])


def test_float32_chains_on_the_analytic_potential_of_a_bnn_model():
    """The case it is built for: a float32 model's analytic potential (``StackPotential`` with theta (C, D)); the
    outputs keep the interface's shapes and dtypes, and the draw's potential and gradient are the potential's."""
    from test_nuts import _correlated, _kernel

    x, y = _correlated()
    pot = _kernel(x, y).chains.leapfrog.pot
    c = 4
    z = pot.x.new_zeros(c, 3) + 0.1 * torch.randn(c, 3, generator=torch.Generator().manual_seed(0))
    u, g = pot(z)
    step, minv, gen = torch.full((c,), 0.05), torch.ones(c, 3), torch.Generator().manual_seed(1)
    for _ in range(3):
        z, u, g, stats = nuts_transition(z, u, g, step, minv, leapfrog=leapfrog_from(pot), generator=gen)
    assert z.dtype == u.dtype == g.dtype == torch.float32 and z.shape == g.shape == (c, 3) and u.shape == (c,)
    assert [type(v) for v in stats.n_steps + stats.tree_depth] == [int] * 2 * c
    assert all(len(v) == c for v in stats) and all(type(v) is bool for v in stats.diverging)
    stats = _as_tensors(stats)
    u_ref, g_ref = pot(z)
    assert torch.allclose(u, u_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-4, atol=1e-3)
    _assert_tree_shape(stats, 10)


def test_a_diverging_trajectory_is_counted_and_the_draw_kept():
    c = 5
    z = _exact(c, seed=9)
    u, g = gaussian(z)
    nan = float("nan")

    def leapfrog(z, p, g, step, minv):
        return z + nan, p + nan, g + nan, p + nan, u + nan, u + nan

    out = nuts_transition(
        z,
        u,
        g,
        torch.full((c,), 0.1, dtype=DT),
        torch.ones(c, 3, dtype=DT),
        leapfrog=leapfrog,
        generator=torch.Generator().manual_seed(0),
    )
    for found, before in zip(out[:3], (z, u, g)):
        assert torch.equal(found, before)
    stats = _as_tensors(out[3])
    assert stats.diverging.all() and (stats.n_steps == 1).all() and (stats.tree_depth == 1).all()
    assert (stats.accept_prob == 0).all() and stats.energy.isfinite().all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(z=torch.zeros(4)), "z must be a floating"),
        (dict(g=torch.zeros(4, 2)), "g .* must have z's shape"),
        (dict(u=torch.zeros(3)), "u .* must be shaped"),
        (dict(step=0.1), "step must be a"),
        (dict(step=torch.tensor([0.1, -0.1, 0.1, 0.1])), "every step size must be > 0"),
        (dict(minv=torch.ones(3)), "minv must be"),
        (dict(max_tree_depth=0), "max_tree_depth must be an int >= 1"),
        # what _check's one-comparison fast path must not let through
        (dict(z=torch.zeros(4, 3, dtype=torch.int64)), "z must be a floating"),
        (dict(minv=torch.ones(4, 3, 4)), "minv must be"),
        (dict(step=torch.tensor([0.1, float("nan"), 0.1, 0.1])), "every step size must be > 0"),
        (dict(max_tree_depth=True), "max_tree_depth must be an int >= 1"),
        (dict(max_tree_depth=2.0), "max_tree_depth must be an int >= 1"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    args = dict(
        z=torch.zeros(4, 3), u=torch.zeros(4), g=torch.zeros(4, 3), step=torch.full((4,), 0.1), minv=torch.ones(4, 3)
    )
    options = dict(max_tree_depth=change.pop("max_tree_depth", 10))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        nuts_transition(*args.values(), leapfrog=leapfrog_from(gaussian), generator=torch.Generator(), **options)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(z=torch.zeros(3, dtype=torch.int64)), "z must be a floating \\(D,\\) tensor"),
        (dict(g=torch.zeros(2)), "z must be a floating \\(D,\\) tensor .* and g of its shape"),
        (dict(step=torch.tensor(0.1)), "u \\(potential\\) and step must be Python floats"),
        (dict(step=-0.1), "step size must be > 0"),
        (dict(step=float("nan")), "step size must be > 0"),
        (dict(minv=torch.ones(1, 3)), "minv must be a \\(D,\\) = \\(3,\\) diagonal or \\(D, D\\)"),
        (dict(leapfrog=leapfrog_from(gaussian)), "needs a leapfrog with an unbatched step"),
        (dict(max_tree_depth=0), "max_tree_depth must be an int >= 1"),
    ],
)
def test_bad_input_of_one_unbatched_chain_names_the_argument(change, match):
    """One chain passed unbatched ((D,) vectors, float potential and step: what method="nuts"'s kernel holds)."""
    z = MEAN.clone()
    u, g = gaussian(z)
    args = dict(z=z, u=float(u), g=g, step=0.1, minv=MASSES["diagonal"], leapfrog=OneChain(_Unbatched(gaussian)))
    options = dict(max_tree_depth=change.pop("max_tree_depth", 10))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        nuts_transition(**args, generator=torch.Generator().manual_seed(0), **options)
    good = dict(z=z, u=float(u), g=g, step=0.1, minv=MASSES["diagonal"], leapfrog=OneChain(_Unbatched(gaussian)))
    z1, u1, g1, stats = nuts_transition(**good, generator=torch.Generator().manual_seed(0), max_tree_depth=3)
    assert z1.shape == z.shape and type(u1) is float and g1.shape == g.shape and len(stats.n_steps) == 1
