"""Pareto-smoothed importance sampling (bnn_pyro/posterior/psis.py) against exact posteriors.

Bayesian linear regression (tests/blr.py) has a Gaussian posterior N(m, C) in closed form, so a q built
from it, too narrow or slightly off, has a known answer; a Gamma precision with Normal observations is
conjugate, so the Jacobian of a constrained site can be checked exactly.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from blr import make_blr

import bnn_pyro as bp
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.posterior.diagnostics import DiagnosticWarning
from bnn_pyro.posterior.psis import _log_joint, resample

S = 1000


def _gaussian_posterior(blr, mean, cov, *, seed=0, method="svi"):
    """A Posterior whose draws come from N(mean, cov) over (weights, bias), with that density recorded."""
    q = dist.MultivariateNormal(mean, covariance_matrix=cov)
    w = q.sample(torch.Size([S])) if seed is None else _sample(q, seed)
    d = blr.x.shape[1]
    samples = {"weight": w[:, :d].float().reshape(1, S, 1, d), "bias": w[:, d:].float().reshape(1, S, 1)}
    return bp.Posterior(
        samples=samples, model=blr.model(), method=method, sample_stats={"log_q": q.log_prob(w)[None]}, x=blr.x, y=blr.y
    )


def _sample(q, seed):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return q.sample(torch.Size([S]))


@pytest.mark.slow
def test_full_rank_guide_on_blr_has_small_k_hat():
    blr = make_blr(n=20, d=2)
    post = bp.fit(
        blr.model(),
        blr.x,
        blr.y,
        method="svi",
        guide="full_rank",
        num_steps=1500,
        lr_schedule="cosine",
        progress=False,
        seed=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        result = post.psis()
    assert result.k_hat < 0.5
    assert result.num_draws == S and result.ess > 0.5 * S
    assert torch.allclose(result.weights.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_a_too_narrow_q_has_a_large_k_hat_and_warns():
    blr = make_blr(n=20, d=2)
    post = _gaussian_posterior(blr, blr.mean, blr.cov / 10.0)  # the exact posterior, covariance shrunk 10x
    with pytest.warns(DiagnosticWarning, match="k_hat"):
        result = post.psis()
    assert result.k_hat > 0.7 and not result.reliable
    with pytest.raises(ValueError, match="k_hat"):
        result.predict(blr.x)


def test_exact_q_gives_equal_weights():
    """q = the exact posterior: every ratio p(w, y) / q(w) is the evidence, so the weights are uniform."""
    blr = make_blr(n=20, d=2)
    result = _gaussian_posterior(blr, blr.mean, blr.cov).psis()
    assert torch.allclose(result.weights, torch.full((1, S), 1.0 / S, dtype=torch.float64), rtol=1e-3)


def test_reweighting_corrects_a_slightly_off_q():
    """q with its mean 0.5 posterior sd off (Mahalanobis distance 0.5) and its covariance 1.5x: the reweighted
    predictive mean is closer to the exact one, X1 m, than q's own, and within 4 Monte Carlo standard errors of it."""
    blr = make_blr(n=20, d=2)
    shift = torch.linalg.cholesky(blr.cov) @ torch.ones(3, dtype=torch.double) / math.sqrt(3.0)
    post = _gaussian_posterior(blr, blr.mean + 0.5 * shift, 1.5 * blr.cov)
    result = post.psis()
    assert result.k_hat < 0.5
    x_test = torch.linspace(-2, 2, 9).unsqueeze(-1).expand(9, 2).contiguous()
    X1 = torch.cat([x_test, torch.ones(9, 1)], dim=1).double()
    exact = X1 @ blr.mean
    f_sd = ((X1 @ blr.cov) * X1).sum(-1).sqrt()  # posterior sd of f(x)
    plain = post.predict(x_test, interval=None).mean.double()
    reweighted = result.predict(x_test, interval=None, seed=0).mean.double()
    assert ((reweighted - exact).abs() < 4 * f_sd / math.sqrt(result.ess) + f_sd / S).all()
    assert (reweighted - exact).norm() < 0.5 * (plain - exact).norm()


def test_laplace_on_blr_is_exact_so_its_weights_are_uniform():
    """Laplace's Gaussian is the BLR posterior (up to the optimizer's float32 rounding): its recorded
    log q agrees with the model's log joint up to a constant."""
    blr = make_blr(n=20, d=2)
    post = bp.fit(blr.model(), blr.x, blr.y, method="laplace", structure="full", num_samples=S, progress=False, seed=0)
    result = post.psis()
    assert result.k_hat < 0.5
    assert result.ess > 0.99 * S


def _gamma_model(x, y=None):
    tau = pyro.sample("precision", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(0.0, tau.rsqrt()), obs=y)


def test_constrained_site_uses_the_log_jacobian():
    """Conjugate: precision ~ Gamma(2, 1), y_i ~ N(0, precision^-1/2) gives Gamma(2 + n/2, 1 + sum y^2 / 2).
    q is that posterior written in z = log(precision) (density Gamma(e^z) e^z): the ratios are constant
    only when psis adds log |d precision / dz| = z to the log joint."""
    g = torch.Generator().manual_seed(0)
    y = 0.7 * torch.randn(30, generator=g)
    x = torch.zeros(30, 1)
    exact = dist.Gamma(2.0 + 15.0, 1.0 + 0.5 * (y**2).sum())
    with torch.random.fork_rng():
        torch.manual_seed(1)
        tau = exact.sample(torch.Size([S]))
    log_q = exact.log_prob(tau) + tau.log()
    post = bp.Posterior(
        samples={"precision": tau[None]},
        model=_gamma_model,
        method="svi",
        sample_stats={"log_q": log_q[None]},
        x=x,
        y=y,
    )
    result = post.psis()
    assert torch.allclose(result.weights, torch.full((1, S), 1.0 / S, dtype=torch.float64), rtol=1e-3)


def test_bnn_log_joint_equals_pyros_potential_with_a_learned_noise():
    """The batched BNN path (priors, likelihood, log-Jacobian of sigma) equals -U(z), Pyro's potential energy."""
    blr = make_blr(n=15, d=2)
    model = bp.BNN(
        torch.nn.Linear(2, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )
    g = torch.Generator().manual_seed(0)
    samples = {
        "weight": torch.randn(1, 5, 1, 2, generator=g),
        "bias": torch.randn(1, 5, 1, generator=g),
        "sigma": torch.rand(1, 5, generator=g) + 0.3,
    }
    post = bp.Posterior(samples=samples, model=model, method="svi", x=blr.x, y=blr.y)
    found = _log_joint(post, blr.x, blr.y, torch.arange(5))
    pot = Potential(model, Data(blr.x, blr.y))
    flat = post.sample()
    expected = [-pot(pot.unconstrain({k: v[i] for k, v in flat.items()})).item() for i in range(5)]
    assert torch.allclose(found, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "method, words",
    [
        ("ensemble", "mixture of point masses"),
        ("nuts", "Markov chain"),
        ("swa", "point mass"),
        ("sgld", "Markov chain"),
    ],
)
def test_methods_without_a_density_are_refused_with_the_reason(method, words):
    blr = make_blr(n=10, d=2)
    post = bp.Posterior(
        samples={"weight": torch.zeros(1, 3, 1, 2), "bias": torch.zeros(1, 3, 1)},
        model=blr.model(),
        method=method,
        x=blr.x,
        y=blr.y,
    )
    with pytest.raises(ValueError, match=words):
        post.psis()


def test_bad_arguments():
    blr = make_blr(n=10, d=2)
    post = _gaussian_posterior(blr, blr.mean, blr.cov)
    with pytest.raises(ValueError, match="both x= and y="):
        post.psis(x=blr.x)
    with pytest.raises(ValueError, match="weights: expected one per stored draw"):
        post.predict(blr.x, weights=torch.ones(3))
    with pytest.raises(ValueError, match="non-negative"):
        resample(-torch.ones(4), 4)


def test_systematic_resampling_reproduces_the_weights():
    w = torch.tensor([0.5, 0.0, 0.25, 0.25])
    counts = torch.bincount(resample(w, 100, seed=3), minlength=4)
    assert counts.tolist() == [50, 0, 25, 25]


def test_swag_records_the_density_of_its_gaussian():
    """SWAG's log q equals N(z_SWA, scale (Sigma_diag + D^T D / (K - 1)) / 2) of its draws, built densely here."""
    from blr import flat_draws

    from bnn_pyro.infer._common import Data
    from bnn_pyro.infer.swag import fit_moments

    blr = make_blr(n=20, d=2)
    post, moments = fit_moments(
        blr.model(),
        Data(blr.x, blr.y),
        swag=True,
        swag_rank=5,
        num_samples=200,
        pretrain_steps=100,
        num_steps=120,
        burn_in=20,
        collect_every=10,
        progress=False,
    )
    m, k = moments[0], moments[0].deviations.shape[0]
    cov = post.config["scale"] * (torch.diag(m.variance) + m.deviations.T @ m.deviations / (k - 1)) / 2
    expected = dist.MultivariateNormal(m.mean, covariance_matrix=cov).log_prob(flat_draws(post.samples))
    torch.testing.assert_close(post.sample_stats["log_q"][0], expected, rtol=1e-6, atol=1e-6)
    assert math.isfinite(post.psis(warn=False).k_hat)


def _chains_of(blr, draws: int, chains: int = 1) -> bp.Posterior:
    """The exact posterior's draws as ``chains`` chains of ``draws`` each, with their density recorded."""
    post = _gaussian_posterior(blr, blr.mean, blr.cov)
    n = chains * draws
    return bp.Posterior(
        samples={k: v[0, :n].reshape(chains, draws, *v.shape[2:]) for k, v in post.samples.items()},
        model=post.model,
        method="svi",
        sample_stats={"log_q": post.sample_stats["log_q"][0, :n].reshape(chains, draws)},
        x=blr.x,
        y=blr.y,
    )


@pytest.mark.parametrize("draws", [1, 2, 20])
def test_too_few_draws_per_chain_are_refused_with_what_to_do(draws):
    """One draw failed inside ArviZ (IndexError); 2-20 gave k_hat = inf and the warning that q misses mass, for an
    exact q: the Pareto fit needs 5 tail ratios, ceil(min(0.2 S, 3 sqrt(S))) >= 5, so S >= 21."""
    blr = make_blr(n=20, d=2)
    post = _chains_of(blr, draws, chains=5)  # more chains do not help: each is smoothed on its own
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticWarning)
        with pytest.raises(ValueError, match=rf"undefined from {draws} draws? of a chain.*num_samples >= 21"):
            post.psis()
    exact = _chains_of(blr, 21)
    assert exact.psis().k_hat < 0.7  # 21 draws: a finite k_hat, and an exact q is judged fine
    with pytest.raises(ValueError, match=r"num_samples=10 over 1 chains leaves a chain with 10 draws.*>= 21.*omit it"):
        _gaussian_posterior(blr, blr.mean, blr.cov).psis(num_samples=10)


def test_a_subset_of_draws_is_stratified_by_chain_so_seed_does_not_decide_whether_it_runs():
    """num_samples=100 of 4 chains x 250 draws used to be a subset across chains, leaving one chain below 21 draws at
    some seeds (seed 3 was refused with advice to refit with >= 21 draws per chain, which the fit had)."""
    blr = make_blr(n=20, d=2)
    post = _chains_of(blr, 250, chains=4)
    for seed in range(10):
        result = post.psis(num_samples=100, seed=seed, warn=False)
        used = torch.isfinite(result.log_weights).sum(1)
        assert used.tolist() == [25, 25, 25, 25]
    for seed in range(10):  # 20 per chain: refused at every seed, naming the subset and what to pass
        with pytest.raises(ValueError, match=r"num_samples=80 over 4 chains leaves a chain with 20 draws.*>= 84"):
            post.psis(num_samples=80, seed=seed)
