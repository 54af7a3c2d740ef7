"""Tests for bnn_pyro/infer/mcmc.py: NUTS, HMC and adaptive Metropolis against the exact posterior
of Bayesian linear regression, plus chains, initialization, statistics and argument errors.

Exactness tolerance (used by every ``_assert_exact``): for each posterior mean coordinate and each
entry of the posterior covariance we form ``z = (estimate - exact) / MCSE`` where
``MCSE = sd / sqrt(ESS)``. ``sd`` is exact (Gaussian posterior: ``sd(w_i) = sqrt(S_ii)``;
``sd((w_i - m_i)(w_j - m_j)) = sqrt(S_ii S_jj + S_ij^2)``), and ``ESS`` is ArviZ's ``ess(method="mean")``
of the same quantity over all chains. By the Markov chain CLT ``z`` is close to standard normal, so
``|z| < 4`` fails with probability ~6e-5 per quantity, ~6e-4 over the 9 quantities of a 3-parameter
model. Seeds are fixed, so a run either passes or fails deterministically.
"""

import functools
import json
import math
import warnings
from pathlib import Path

import arviz as az
import pandas as pd
import pyro
import pyro.distributions as dist
import pytest
import torch
from blr import BLR  # tests/ is on sys.path (pytest puts conftest.py's folder there)
from blr import mcse_z_scores as _z_scores
from conftest import forks_chains
from pyro import poutine

import bnn_pyro as bp
from bnn_pyro.infer import _kernels, driver, mcmc
from bnn_pyro.infer._common import quiet_model

SIGMA, PRIOR_VAR, Z_MAX = 0.5, 1.0, 4.0


def _data(d: int, n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.linspace(1.0, -1.0, d) + 0.3 + SIGMA * torch.randn(n, generator=g)
    return x, y


def _blr(d: int):
    return BLR(x=torch.zeros(1, d), y=torch.zeros(1), noise=SIGMA, prior_scale=math.sqrt(PRIOR_VAR)).model()


def _exact(x, y):
    """Posterior mean and covariance of w = [weight, bias] (closed form, see tests/blr.py)."""
    exact = BLR(x=x, y=y, noise=SIGMA, prior_scale=math.sqrt(PRIOR_VAR))
    return exact.mean, exact.cov


def _draws(post, names=("weight", "bias")):
    """Draws as (chains, draws, dim) in float64, weight then bias."""
    c, n = post.num_chains, post.num_draws
    return torch.cat([post.samples[k].reshape(c, n, -1) for k in names], -1).double()


def _assert_exact(post, x, y, names=("weight", "bias")):
    mean, cov = _exact(x, y)
    z = _z_scores(_draws(post, names), mean, cov)
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"estimates off by more than {Z_MAX} MCSE: {bad} (all: { {k: round(v, 2) for k, v in z.items()} })"
    return z


# ------------------------------------------------------------------ exactness
@pytest.mark.slow  # ~5 s idle, ~20 s on a loaded 2-core machine
def test_nuts_recovers_exact_posterior():
    x, y = _data(2)
    post = bp.fit(_blr(2), x, y, method="nuts", num_samples=600, num_warmup=200, num_chains=2, seed=1, progress=False)
    _assert_exact(post, x, y)
    assert post.method == "nuts" and post.config["chain_execution"] in ("parallel", "sequential")
    assert post.x is not None and torch.equal(post.y, y)


def test_hmc_with_fixed_leapfrog_count_recovers_exact_posterior():
    x, y = _data(2)
    post = bp.fit(
        _blr(2),
        x,
        y,
        method="hmc",
        num_chains=1,
        num_samples=1000,
        num_warmup=300,
        num_leapfrog=4,
        leapfrog_jitter=0,
        seed=2,
        progress=False,
    )
    assert (post.sample_stats["n_steps"] == 4).all()  # a fixed count, not length / adapted step size
    _assert_exact(post, x, y)


def test_hmc_default_leapfrog_count_is_bounded_and_explicit_settings_win():
    """Trap 3: a fixed trajectory length costs length / step size leapfrog steps per draw, without
    bound as the adapted step shrinks. At its defaults HMC takes the documented DEFAULT_NUM_LEAPFROG
    steps per draw; the user's num_leapfrog= or trajectory_length= still decide when given."""
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(400, 1, generator=g)
    x = torch.cat([x1, x1 + 0.01 * torch.randn(400, 1, generator=g)], 1)  # nearly collinear: a small adapted step
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 + SIGMA * torch.randn(400, generator=g)

    def run(**options):
        return bp.fit(
            _blr(2), x, y, method="hmc", num_chains=1, num_samples=10, num_warmup=30, seed=5, progress=False, **options
        )

    default = run()
    assert f"(default :data:`DEFAULT_NUM_LEAPFROG` = {mcmc.DEFAULT_NUM_LEAPFROG} when" in mcmc.HMCConfig.__doc__
    steps = default.sample_stats["n_steps"]  # jittered within +-50% of the default count (see the ESS test below)
    assert ((steps >= mcmc.DEFAULT_NUM_LEAPFROG // 2) & (steps <= mcmc.DEFAULT_NUM_LEAPFROG * 3 // 2)).all()
    assert default.config["num_leapfrog"] == mcmc.DEFAULT_NUM_LEAPFROG
    assert (run(leapfrog_jitter=0).sample_stats["n_steps"] == mcmc.DEFAULT_NUM_LEAPFROG).all()
    # here Stan's 2 * pi trajectory would cost more than the default: the bound is not vacuous
    assert (2 * math.pi / default.sample_stats["step_size"] > mcmc.DEFAULT_NUM_LEAPFROG).all()
    assert (run(num_leapfrog=5, leapfrog_jitter=0).sample_stats["n_steps"] == 5).all()
    given = run(trajectory_length=1.5, leapfrog_jitter=0)
    steps, expected = given.sample_stats["n_steps"].double(), 1.5 / given.sample_stats["step_size"].double()
    assert ((steps - expected.floor()).abs() <= 1).all(), (steps, expected)  # Pyro's int(length / step size)
    assert (steps != mcmc.DEFAULT_NUM_LEAPFROG).all() and given.config["num_leapfrog"] is None


@functools.cache
def _mixing_fits(fast_path: bool) -> tuple:
    """``(blr, {seed: posterior})``: HMC at its defaults, one chain of 500 draws, on the exact Gaussian posterior of
    the mixing test (Bayesian linear regression, 5 correlated inputs, 200 rows, known noise); seeds 0-4 on the fast
    path, seed 4 on Pyro's (~10 s a seed). Fitted once, read by the mixing and the acceptance tests."""
    from blr import HMC_ACCEPTANCE_FIT, make_blr

    blr = make_blr(**HMC_ACCEPTANCE_FIT["blr"])  # the settings benchmarks/hmc_acceptance_bias.py measured bias.csv at
    seeds = range(5) if fast_path else range(4, 5)  # Pyro's path: the worst seed of the fixed count
    fit = dict(HMC_ACCEPTANCE_FIT["fit"], fast_path=fast_path)
    return blr, {seed: bp.fit(blr.model(), blr.x, blr.y, seed=seed, **fit) for seed in seeds}


@pytest.mark.parametrize("fast_path", [True, False])
def test_hmc_defaults_mix_on_an_exact_gaussian_posterior_for_every_seed(fast_path):
    """A fixed number of leapfrog steps resonates: on this exact Gaussian posterior (Bayesian linear regression,
    5 correlated inputs, 200 rows, known noise) HMC's 32 fixed steps gave a bulk ESS of 22, 38, 15, 24 and 2 of
    500 draws for seeds 0-4 (seed 2's mean 1.1 sd off). The defaults jitter each draw's count (16-48 steps), and
    every seed mixes: bulk ESS >= 50 of 500 for each coordinate (measured 209-540: 209-312 on the fast path since its
    step after warm-up is aimed at target_accept, a longer trajectory), its mean within the MCSE tolerance of the
    exact one, and the mean count near 32 (the cost per draw stays that of 32)."""
    blr, fits = _mixing_fits(fast_path)
    for seed, post in fits.items():
        draws = _draws(post)
        ess = [float(az.ess(draws[..., i].numpy())) for i in range(draws.shape[-1])]
        assert min(ess) >= 50, (seed, ess)
        z = _z_scores(draws, blr.mean, blr.cov)
        assert all(abs(z[f"mean[{i}]"]) < Z_MAX for i in range(6)), (seed, z)
        assert abs(post.sample_stats["n_steps"].double().mean() - mcmc.DEFAULT_NUM_LEAPFROG) < 2


AIMED_REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "hmc_acceptance" / "bias.csv"
AIMED_CONFIG = AIMED_REFERENCE.with_name("bias_config.json")  # what bias.csv was measured under


def test_hmc_realized_acceptance_is_where_the_aimed_step_puts_it():
    """HMC's realized acceptance after warm-up (the kept draws' mean acceptance) is the exact acceptance ``A(h)`` of
    its step (``tests/blr.py``'s ``hmc_acceptance_curve``, 20,000 exact posterior draws in the fit's metric), and that
    step lands where the committed measurement puts it: ABOVE ``target_accept`` (0.8), far below the dual average.

    The aimed step (``bnn_pyro/infer/_aimed_step.py``) fits a logistic curve, symmetric in ``log h``, to an acceptance
    that falls slowly and then over a cliff (the leapfrog's stability limit); its crossing of the target falls short
    of the true one, so the realized acceptance is above the target by design of that form, not by chance: on this
    posterior ``A`` at the aimed step averaged 0.869 over seeds 0-29, at the dual average's ``exp(x_bar)`` 0.954
    (``benchmarks/results/hmc_acceptance/bias.md``; a t-test against 0.8 over 5 seeds, as before, is a test of a
    false null: torch 2.11's seeds gave t = 8.614). Three checks, each against ``Z_MAX`` = 4:

    - per seed, ``(realized - A) / se``, ``se`` from the 500 draws' ESS (ArviZ, mean) and the bound 0.5 / sqrt(20,000)
      on ``A``'s own Monte Carlo error: the chain realizes its step's acceptance;
    - the 5 seeds' mean ``A`` against the reference seeds' (those of ``bias.csv`` not among the test's, independent
      of them): ``z = (m5 - m_ref) / (sd_ref sqrt(1/5 + 1/n_ref))``, a t with ``n_ref - 1`` (24) degrees of freedom,
      ``|t| > 4`` with probability ~5e-4;
    - the same mean against the reference seeds' ``A`` at ``exp(x_bar)``: below it by more than 4 such errors (the
      aimed step in use; the dual average's realized acceptance is not within reach).

    The reference is valid only for the settings it was measured under (``bias_config.json``: the fits' data and
    arguments, tests/blr.py's ``HMC_ACCEPTANCE_FIT``, and their ``post.config``'s ``ACCEPTANCE_CONFIG``): a change
    to either fails here first, saying to rerun the benchmark. The test pins the bias: it catches steps about 20%
    too short or 10% too long (review 24's mutants of the aimed step), and an aim that removes the bias (realizing
    ``target_accept``) is expected to fail it, and ``test_aimed_step``'s cliff test, until ``bias.csv`` is
    regenerated (``benchmarks/hmc_acceptance_bias.py --seeds 0-29``) and that test updated."""
    from blr import ACCEPTANCE_CONFIG, HMC_ACCEPTANCE_FIT, hmc_acceptance_curve

    blr, fits = _mixing_fits(True)
    draws, exact = 20_000, []
    recorded = json.loads(AIMED_CONFIG.read_text())
    stale = (
        f"{AIMED_REFERENCE.name} was measured under {recorded} ({AIMED_CONFIG.name}); these fits differ, so it is "
        "stale: rerun `OMP_NUM_THREADS=1 nice -n 5 python benchmarks/hmc_acceptance_bias.py --seeds 0-29`"
    )
    assert (recorded["fit"], recorded["draws"]) == (HMC_ACCEPTANCE_FIT, draws), stale
    for seed, post in fits.items():
        assert {key: post.config[key] for key in ACCEPTANCE_CONFIG} == recorded["config"], (seed, stale)
    for seed, post in fits.items():
        step = float(post.sample_stats["step_size"][0, -1])
        exact.append(hmc_acceptance_curve(blr, post, draws=draws, seed=seed)(math.log(step)))
        accepts = post.sample_stats["acceptance_rate"].double()
        ess = float(az.ess(accepts.numpy(), method="mean"))
        se = math.sqrt(float(accepts.var()) / ess + 0.25 / draws)
        assert abs(float(accepts.mean()) - exact[-1]) / se < Z_MAX, (seed, float(accepts.mean()), exact[-1], se)
    reference = pd.read_csv(AIMED_REFERENCE)
    reference = reference[~reference["seed"].isin(list(fits))]
    n, mean = len(reference), sum(exact) / len(exact)
    assert n >= 20, f"{AIMED_REFERENCE}: {n} reference seeds"
    sd = float(reference["exact_aimed"].std())
    z = (mean - float(reference["exact_aimed"].mean())) / (sd * math.sqrt(1 / len(exact) + 1 / n))
    assert abs(z) < Z_MAX, (exact, float(reference["exact_aimed"].mean()), z)
    old = reference["exact_xbar"]
    z_old = (mean - float(old.mean())) / math.sqrt(sd**2 / len(exact) + float(old.var()) / n)
    assert z_old < -Z_MAX, (exact, float(old.mean()), z_old)


@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis"])
def test_defaults_run_several_chains_so_that_r_hat_is_defined(method):
    """At the defaults (num_chains, chain_method) R-hat is finite: one chain by default left it NaN with no warning.
    The chains run as chain_method='auto' chooses (forked processes here), with the draws of sequential chains."""
    x, y = _data(2)
    post = bp.fit(_blr(2), x, y, method=method, num_samples=100, seed=0, progress=False)
    assert post.num_chains == mcmc.DEFAULT_NUM_CHAINS == 4 and post.config["chain_method"] == "auto"
    table = post.summary()
    assert len(table) and table["r_hat"].notna().all(), table
    if method != "metropolis":  # 100 + 100 Metropolis draws have not mixed (R-hat ~2: what the chains are for)
        assert (table["r_hat"] < 1.1).all(), table
    assert post.config["chain_execution"] == driver.chain_execution(4, "auto", "mcmc")
    sequential = bp.fit(
        _blr(2), x, y, method=method, num_samples=100, seed=0, progress=False, chain_method="sequential"
    )
    assert all(torch.equal(post.samples[k], v) for k, v in sequential.samples.items())


def _readme_custom_prior_model() -> bp.BNN:
    """The README's custom prior on a linear net: Student-t weights, the bias deterministic, the noise learned."""
    return bp.BNN(
        torch.nn.Linear(2, 1),
        prior=lambda name, module, param: dist.StudentT(3.0, 0.0, 1.0) if param.dim() > 1 else None,
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )


@pytest.mark.parametrize(
    "method, seeds",
    [
        pytest.param("nuts", (0, 1, 2), marks=pytest.mark.slow),  # ~20 s loaded
        ("hmc", (0,)),
        ("metropolis", (1,)),
    ],
)
def test_deterministic_parameters_get_their_point_estimate_not_a_random_start(method, seeds):
    """The README's custom prior leaves the bias deterministic. MCMC kept it at the value reset_parameters()
    drew (four seeds: -0.58, -0.14, 0.19, -0.30 on data whose intercept is 0.33 +- 0.03), and the weights shifted
    to compensate. Now it is the joint MAP's: the least-squares intercept up to the weights' weak prior (within
    0.01 = a third of its sd; measured within 2e-4), for every seed and sampler, and config says so."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=g)
    y = x @ torch.tensor([1.0, -0.5]) + 0.3 + 0.4 * torch.randn(200, generator=g)
    design = torch.cat([x, torch.ones(200, 1)], 1).double()
    least_squares = torch.linalg.lstsq(design, y.double()[:, None]).solution[:, 0]
    for seed in seeds:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # short runs: the health check's ESS warnings
            post = bp.fit(
                _readme_custom_prior_model(),
                x,
                y,
                method=method,
                num_samples=20,
                num_chains=2,
                seed=seed,
                progress=False,
            )
        assert post.config["point_estimate"] == "map"
        bias = post.point["bias"]
        assert bias.shape == (2, 1) and torch.equal(bias[0], bias[1])  # fixed, the same for every chain
        assert abs(float(bias[0, 0]) - float(least_squares[2])) < 0.01, (seed, bias, least_squares)


def test_deterministic_parameters_from_a_posterior_given_as_init_are_kept():
    x, y = _data(2)
    model = _readme_custom_prior_model()
    svi = bp.fit(model, x, y, method="svi", num_steps=300, num_samples=10, seed=0, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(model, x, y, method="nuts", init=svi, num_samples=20, num_chains=1, seed=0, progress=False)
    assert post.config["point_estimate"] == "init" and torch.equal(post.point["bias"][0], svi.point["bias"][0])
    plain = bp.fit(_blr(2), x, y, method="nuts", num_samples=5, num_chains=1, seed=0, progress=False)
    assert "point_estimate" not in plain.config  # no deterministic parameters


def _plain_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", size=len(x)):
        return pyro.sample("obs", dist.Normal(w * x[:, 0], 0.5), obs=y)


@pytest.mark.parametrize("method, options", [("metropolis", {}), ("hmc", dict(fast_path=False, num_leapfrog=3))])
def test_a_traced_model_emits_no_torch_jit_deprecation_warning(method, options):
    """Metropolis on a plain model (and Pyro's kernels on a traced model) compile it with torch.jit.trace, which
    torch 2.13 deprecates: the user saw a DeprecationWarning from torch on every fit. (The test suite's setup.cfg
    filter is overridden here by 'always'.)"""
    x = torch.linspace(-1, 1, 30)[:, None]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = _plain_model if method == "metropolis" else _blr(1)
        bp.fit(
            model,
            x,
            0.5 * x[:, 0],
            method=method,
            num_samples=5,
            num_warmup=5,
            num_chains=1,
            seed=0,
            progress=False,
            **options,
        )
    assert not [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


def _schools_like(x, y=None):
    """Eight schools' non-centred shape: theta = mu + tau * eta, recorded with pyro.deterministic."""
    mu, tau = pyro.sample("mu", dist.Normal(0.0, 5.0)), pyro.sample("tau", dist.HalfNormal(5.0))
    with pyro.plate("data", size=len(x)):
        eta = pyro.sample("eta", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * eta)
        return pyro.sample("obs", dist.Normal(theta, 10.0), obs=y)


def test_deterministic_sites_of_a_plain_model_are_kept_in_samples_and_inference_data():
    """pyro.deterministic sites other than 'f' were dropped from post.samples and the InferenceData."""
    x, y = torch.zeros(8, 1), torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short run: the health warnings
        post = bp.fit(_schools_like, x, y, method="metropolis", num_samples=20, num_chains=2, seed=0, progress=False)
    theta = post.samples["theta"]
    assert theta.shape == (2, 20, 8)
    assert torch.allclose(theta, post.samples["mu"][..., None] + post.samples["tau"][..., None] * post.samples["eta"])
    assert "theta" in post.to_inference_data().posterior and "theta[7]" in post.summary().index
    again = bp.fit(
        _schools_like, x, y, method="metropolis", init=post, num_samples=5, num_chains=1, seed=1, progress=False
    )  # a posterior with deterministic sites is a valid init
    assert again.samples["theta"].shape == (1, 5, 8)


def _metropolis_acceptance(mean, cov, step: float, scale2: torch.Tensor, n: int = 400_000) -> tuple[float, float]:
    """The exact stationary acceptance of the proposal ``w + step * sqrt(scale2) * eps`` on the Gaussian
    posterior ``N(mean, cov)``: ``E[min(1, p(w') / p(w))]`` over ``w ~ N(mean, cov)``, ``eps ~ N(0, I)``, by
    Monte Carlo with ``n`` independent draws (fixed seed); returns it and its standard error."""
    g = torch.Generator().manual_seed(11)
    mean, cov = mean.double(), cov.double()
    w = mean + torch.randn(n, len(mean), generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov).T
    moved = w + step * scale2.double().sqrt() * torch.randn(n, len(mean), generator=g, dtype=torch.float64)
    precision = torch.linalg.inv(cov)
    log_p = lambda v: -0.5 * (((v - mean) @ precision) * (v - mean)).sum(1)  # noqa: E731
    accept = (log_p(moved) - log_p(w)).exp().clamp(max=1.0)
    return accept.mean().item(), accept.std().item() / math.sqrt(n)


@pytest.mark.slow  # ~7 s
def test_metropolis_adapts_and_recovers_exact_posterior():
    """Exact draws, and per chain the recorded acceptance equals the exact stationary acceptance of the proposal
    the warm-up adapted (its step size and the proposal variances in ``history``), within Monte Carlo error:
    ``z = (mean recorded - exact) / sqrt(MCSE^2 + se^2)``, MCSE from ArviZ's ESS of the recorded series, ``|z| < 4``.
    No band around the 0.234 target is asserted: Pyro's warm-up schedule ends with 50 iterations of dual
    averaging restarted after the last mass-matrix window, which guarantees none (measured at this setting, seeds
    0-7: the adapted proposals' exact acceptance ranged 0.09-0.31 over 9 distinct chains, 3 below 0.15)."""
    x, y = _data(1)
    post = bp.fit(
        _blr(1), x, y, method="metropolis", num_samples=6000, num_warmup=1000, num_chains=2, seed=3, progress=False
    )
    _assert_exact(post, x, y)
    mean, cov = _exact(x, y)  # weight, then bias; the proposal's flat vector is in sorted site order
    order = [0, 1] if sorted(post.samples) == ["weight", "bias"] else [1, 0]
    mean, cov = mean[order], cov[order][:, order]
    for c in range(post.num_chains):
        step = post.sample_stats["step_size"][c]
        assert (step == step[0]).all()  # fixed after warm-up
        exact, se = _metropolis_acceptance(mean, cov, float(step[0]), post.history["inverse_mass_matrix"][c])
        recorded = post.sample_stats["acceptance_rate"][c].double()
        mcse = recorded.std().item() / math.sqrt(az.ess(recorded[None].numpy(), method="mean"))
        z = (recorded.mean().item() - exact) / math.sqrt(mcse**2 + se**2)
        assert abs(z) < Z_MAX, (c, recorded.mean().item(), exact, z)


def test_plain_pyro_function_model_with_nuts():
    def blr(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, math.sqrt(PRIOR_VAR)).expand([2]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, math.sqrt(PRIOR_VAR)))
        f = x @ w + b
        with pyro.plate("data", x.shape[0]):
            pyro.deterministic("f", f)
            return pyro.sample("obs", dist.Normal(f, SIGMA), obs=y)

    x, y = _data(2)
    post = bp.fit(blr, x, y, method="nuts", num_chains=1, num_samples=600, num_warmup=200, seed=4, progress=False)
    assert set(post.samples) == {"w", "b"} and post.samples["w"].shape == (1, 600, 2)
    _assert_exact(post, x, y, names=("w", "b"))


# ------------------------------------------------------------------ statistics, jit, init, chains
@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis"])
def test_sample_stats_shapes(method):
    x, y = _data(2)
    extra = dict(num_leapfrog=3) if method == "hmc" else {}
    post = bp.fit(
        _blr(2), x, y, method=method, num_samples=30, num_warmup=30, num_chains=2, seed=0, progress=False, **extra
    )
    expected = {"lp", "acceptance_rate", "step_size"}
    if method != "metropolis":
        expected |= {"diverging", "n_steps", "energy"}
    if method == "nuts":
        expected |= {"tree_depth"}
    assert set(post.sample_stats) == expected
    for name, value in post.sample_stats.items():
        assert value.shape == (2, 30), name
        assert torch.isfinite(value.double()).all(), name
    assert ((post.sample_stats["acceptance_rate"] >= 0) & (post.sample_stats["acceptance_rate"] <= 1)).all()
    if method != "metropolis":
        assert post.sample_stats["diverging"].dtype == torch.bool
    assert post.samples["weight"].shape == (2, 30, 1, 2) and post.samples["bias"].shape == (2, 30, 1)


def test_jit_on_and_off():
    """Both paths run; the model traced by torch.jit computes the same log density as the eager
    model (chains themselves drift apart after a few draws: float rounding differs between the paths)."""
    x, y = _data(2)
    runs = [
        bp.fit(
            _blr(2), x, y, method="nuts", num_chains=1, num_samples=40, num_warmup=40, jit=jit, seed=5, progress=False
        )
        for jit in (True, False)
    ]
    assert runs[0].config["jit"] and not runs[1].config["jit"]
    for post in runs:
        assert torch.isfinite(post.samples["weight"]).all() and post.sample_stats["lp"].shape == (1, 40)
    model = _blr(2)

    def log_density(w, b):
        return poutine.trace(poutine.condition(model, data={"weight": w, "bias": b})).get_trace(x, y).log_prob_sum()

    w, b = torch.tensor([[0.3, -0.7]]), torch.tensor([0.2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(log_density, (w, b), check_trace=False)
    w2, b2 = torch.tensor([[-1.1, 0.4]]), torch.tensor([0.5])  # new values through the traced graph
    torch.testing.assert_close(traced(w2, b2), log_density(w2, b2))


def test_init_posterior_starts_at_its_mean_and_fixes_deterministic_params():
    x, y = _data(2)
    model = bp.BNN(
        torch.nn.Linear(2, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=SIGMA),
        bayesian="weights",
    )  # bias: deterministic
    map_fit = bp.fit(model, x, y, method="svi", guide="map", num_steps=300, lr=0.05, seed=0, progress=False)
    post = bp.fit(
        model,
        x,
        y,
        method="hmc",
        init=map_fit,
        num_leapfrog=3,
        num_samples=20,
        num_warmup=20,
        num_chains=2,
        seed=0,
        progress=False,
    )
    assert post.point["bias"].shape == (2, 1)
    torch.testing.assert_close(post.point["bias"], map_fit.point["bias"][:1].expand(2, 1))
    assert set(post.samples) == {"weight"}
    torch.testing.assert_close(dict(post.model.net.named_parameters())["bias"].detach(), map_fit.point["bias"][0])
    assert post.config["init"] == "Posterior"
    # the chains start at the MAP weights, so even the first draws sit in the posterior bulk: within Z_MAX exact
    # posterior sds of the exact mean (the weights' posterior given the fixed bias b, closed form: precision
    # X^T X / sigma^2 + I / prior_var, mean cov X^T (y - b) / sigma^2), as a posterior draw is but for a 6e-5 chance
    precision = x.T @ x / SIGMA**2 + torch.eye(2) / PRIOR_VAR
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ (y - post.point["bias"][0]) / SIGMA**2
    z = (post.samples["weight"][:, 0].reshape(2, 2) - mean) / cov.diagonal().sqrt()
    assert z.abs().max() < Z_MAX, z


@forks_chains
def test_parallel_and_sequential_chains_give_the_same_draws():
    if driver._cores() < 2:
        pytest.skip("needs 2 cores")
    x, y, model = *_data(2), _blr(2)  # one model: init="net" starts from its (random) weights
    runs = {
        how: bp.fit(
            model,
            x,
            y,
            method="nuts",
            num_samples=30,
            num_warmup=30,
            num_chains=2,
            seed=6,
            chain_method=how,
            progress=False,
        )
        for how in ("parallel", "sequential")
    }
    assert runs["parallel"].config["chain_execution"] == "parallel"
    assert runs["sequential"].config["chain_execution"] == "sequential"
    torch.testing.assert_close(runs["parallel"].samples["weight"], runs["sequential"].samples["weight"])
    assert not torch.equal(runs["parallel"].samples["weight"][0], runs["parallel"].samples["weight"][1])


def test_one_core_runs_chains_sequentially_and_says_so(monkeypatch):
    monkeypatch.setattr(driver, "_cores", lambda: 1)
    x, y = _data(2)
    with pytest.warns(UserWarning, match="one after another"):
        post = bp.fit(_blr(2), x, y, method="metropolis", num_samples=20, num_warmup=20, num_chains=2, progress=False)
    assert post.config["chain_execution"] == "sequential" and post.num_chains == 2


@pytest.mark.parametrize("fast_path", [True, False])  # FlatNUTS / Pyro's NUTS
@pytest.mark.parametrize("how", ["sequential", pytest.param("parallel", marks=forks_chains)])
def test_every_chain_has_a_labelled_progress_bar(fast_path, how, capfd):
    """Like SVI's "svi chain 0", each chain's bar says which chain it is; captured at the file
    descriptor, so that the bars drawn by forked (parallel) chains are seen too."""
    if how == "parallel" and driver._cores() < 2:
        pytest.skip("needs 2 cores")
    x, y = _data(2)
    config = dict(num_samples=5, num_warmup=50, num_chains=2, chain_method=how, fast_path=fast_path, jit=False, seed=1)
    post = bp.fit(_blr(2), x, y, method="nuts", **config)
    err = capfd.readouterr().err
    assert post.config["fast_path"] is fast_path and post.config["chain_execution"] == how
    for chain in (0, 1):
        assert f"nuts chain {chain}:" in err, err
    assert "Warmup" not in err  # no unlabelled bar of Pyro's beside ours
    bp.fit(_blr(2), x, y, method="nuts", progress=False, **config)
    assert capfd.readouterr().err == ""


def test_diverging_trajectory_is_rejected_not_raised():
    """Trap 4: a BNN's priors were built with validation on; a NaN weight must give a NaN potential."""
    x, y = _data(2)
    model = _blr(2)
    nan = {"weight": torch.full((1, 2), float("nan")), "bias": torch.zeros(1)}
    with pytest.raises(ValueError, match="support"), pyro.validation_enabled(False):  # what MCMC alone does
        poutine.trace(poutine.condition(model, data=nan)).get_trace(x, y).log_prob_sum()
    quiet = quiet_model(model, len(x))
    assert torch.isnan(poutine.trace(poutine.condition(quiet, data=nan)).get_trace(x, y).log_prob_sum())
    # end to end: a huge fixed step diverges on every draw; the draws are rejected and counted
    kernel = _kernels.PyroHMC(quiet, step_size=1e3, num_steps=10, adapt_step_size=False, adapt_mass_matrix=False)
    with pyro.get_param_store().scope():
        pyro.set_rng_seed(0)
        pyro.infer.MCMC(kernel, num_samples=5, warmup_steps=1, disable_progbar=True).run(x, y)


# ------------------------------------------------------------------ argument errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_samples=0), "num_samples must be a positive int"),
        (dict(num_warmup=0), "num_warmup must be a positive int"),
        (dict(num_chains=-1), "num_chains must be a positive int"),
        (dict(target_accept=1.0), r"target_accept must be a probability in \(0, 1\)"),
        (dict(target_accept=0.0), r"target_accept must be a probability in \(0, 1\)"),
        (dict(step_size=-0.1), "step_size must be a positive"),
        (dict(init="pretrained"), "init: unknown value 'pretrained'"),
        (dict(chain_method="threads"), "chain_method: unknown value 'threads'"),
    ],
)
def test_bad_arguments(kwargs, match):
    x, y = _data(2)
    with pytest.raises(ValueError, match=match):
        bp.fit(_blr(2), x, y, method="nuts", progress=False, **kwargs)


@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis", "mala"])
def test_a_net_with_dropout_in_training_mode_is_refused_naming_the_module(method):
    """Dropout in training mode draws new masks at every forward pass, so the log density an MCMC kernel evaluates is
    random and no chain targets a posterior (review 20: HMC ran on such a net with only a compile warning). Refused,
    naming the module and the two ways out; in eval mode, or with ``p = 0``, the net samples."""
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    y = x[:, 0] + 0.1 * torch.randn(20, generator=torch.Generator().manual_seed(1))

    def model(p):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Dropout(p), torch.nn.Linear(4, 1))
        return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))

    run = dict(method=method, num_samples=2, num_warmup=2, num_chains=1, seed=0, progress=False)
    with pytest.raises(ValueError, match=r"dropout module\(s\) '2' are in training mode.*model\.eval\(\).*mc_dropout"):
        bp.fit(model(0.3), x, y, **run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two draws: the health checks' warnings are not this test's
        for fitted in (model(0.3).eval(), model(0.0)):
            assert bp.fit(fitted, x, y, **run).num_chains == 1


def test_bad_hmc_and_method_arguments():
    x, y = _data(2)
    with pytest.raises(ValueError, match="trajectory_length= or num_leapfrog=, not both"):
        bp.fit(_blr(2), x, y, method="hmc", num_chains=1, trajectory_length=1.0, num_leapfrog=3)
    with pytest.raises(TypeError, match=r"max_tree_depth: not an option of method='hmc'.*\(nuts\)"):
        bp.fit(_blr(2), x, y, method="hmc", num_chains=1, max_tree_depth=5)
    for method, name in (
        ("nuts", "num_leapfrog"),
        ("metropolis", "num_leapfrog"),
        ("metropolis", "max_tree_depth"),
        ("metropolis", "trajectory_length"),
    ):  # a kernel's options are its own, listed by options()
        assert name not in bp.infer.options(method)
        with pytest.raises(TypeError, match=rf"{name}: not an option of method='{method}'"):
            bp.fit(_blr(2), x, y, method=method, num_chains=1, **{name: 5})
    with pytest.raises(ValueError, match="method: unknown value 'langevin'"):
        bp.fit(_blr(2), x, y, method="langevin")
    with pytest.raises(ValueError, match="nuts needs the full data"):
        bp.fit(_blr(2), x, y, method="nuts", num_chains=1, batch_size=10)


# ------------------------------------------------------------------ R-hat on real runs
@pytest.mark.slow  # ~6 s
def test_mixed_chains_have_rhat_near_one():
    x, y = _data(2)
    post = bp.fit(_blr(2), x, y, method="nuts", num_samples=1000, num_warmup=300, num_chains=2, seed=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no convergence warning at all
        post.summary()
    # the unrounded rank-normalized split R-hat (ArviZ's summary table rounds it to 2 decimals, so "< 1.01" on the
    # table meant < 1.005, which seed 6 missed on an earlier version of the sampler with ESS 1,500-2,100): the
    # 1.01 criterion of Vehtari et al. (2021), several standard errors above 1 at these bulk ESS (1,300-2,100)
    rhat = az.rhat(post.to_inference_data(log_likelihood=False))
    worst = max(float(rhat[name].max()) for name in rhat.data_vars)
    assert worst < 1.01, rhat


def test_chains_started_apart_and_not_mixed_are_flagged():
    """Two well-separated modes (w near -3 or +3, each of width 0.05): chains started from prior
    draws on opposite sides never cross, and the summary must say so."""

    def bimodal(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 3.0))
        with pyro.plate("data", size=len(x)):
            return pyro.sample("obs", dist.Normal((w * w).expand(len(x)), 0.3), obs=y)

    x, y = torch.zeros(40, 1), torch.full((40,), 9.0)
    post = bp.fit(
        bimodal,
        x,
        y,
        method="nuts",
        init="prior",
        num_samples=100,
        num_warmup=100,
        num_chains=2,
        seed=0,
        progress=False,
    )
    means = post.samples["w"].mean(1)
    assert means[0] * means[1] < 0, f"the chains should start in different modes: {means}"
    with pytest.warns(UserWarning, match=r"R-hat > 1.01"):
        table = post.summary()
    assert table["r_hat"].iloc[0] > 1.5


# ------------------------------------------------------------------ extending a posterior
def test_extend_continues_from_the_last_state_without_warmup(tmp_path):
    x, y = _data(2)
    model = _blr(2)
    first = bp.fit(
        model,
        x,
        y,
        method="nuts",
        num_samples=10,
        num_warmup=30,
        num_chains=2,
        seed=0,
        progress=False,
        chain_method="sequential",
        jit=False,
    )
    mass = first.history["inverse_mass_matrix"]
    assert mass.shape == (2, 3) and (mass > 0).all()  # diagonal: weight (2) and bias
    first.save(tmp_path / "first.bnn")
    first = bp.load(tmp_path / "first.bnn", model=model)  # the adapted state survives save/load
    more = bp.fit(
        model,
        x,
        y,
        method="nuts",
        resume=first,
        num_samples=8,
        seed=100,
        progress=False,
        chain_method="sequential",
        jit=False,
    )
    assert more.num_chains == 2 and more.num_draws == 18
    for name, value in first.samples.items():
        assert torch.equal(more.samples[name][:, :10], value)
    adapted = first.sample_stats["step_size"][:, -1:]  # no further adaptation: every new step is the adapted one
    assert torch.equal(more.sample_stats["step_size"][:, 10:], adapted.expand(2, 8))
    assert torch.equal(more.history["inverse_mass_matrix"], mass)
    assert more.config["num_samples"] == 18 and more.config["extended_by"] == 8
    with pytest.raises(ValueError, match="num_warmup"):
        bp.fit(model, x, y, method="nuts", resume=first, num_samples=5, num_warmup=10, progress=False)
    with pytest.raises(ValueError, match="resume"):
        bp.fit(model, x, y, method="hmc", resume=first, num_samples=5, progress=False)


@pytest.mark.slow  # 2 x (300 + 200 + 100) NUTS steps, like test_nuts_recovers_exact_posterior
def test_extended_nuts_draws_recover_exact_posterior():
    x, y = _data(2)
    model = _blr(2)
    first = bp.fit(model, x, y, method="nuts", num_samples=100, num_warmup=200, num_chains=2, seed=1, progress=False)
    more = bp.fit(model, x, y, method="nuts", resume=first, num_samples=300, seed=11, progress=False)
    tail = bp.Posterior(samples={k: v[:, 100:] for k, v in more.samples.items()}, model=more.model, method="nuts")
    _assert_exact(tail, x, y)  # the new segment alone, from the adapted kernel
