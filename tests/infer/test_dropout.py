"""Tests for bnn_pyro/infer/dropout.py: MC dropout (fixed, REINFORCE and Concrete rates).

Known answers come from linear regression with dropout on its inputs, ``f = X diag(z) m + b``,
Gaussian noise ``SIGMA``, ``Normal(0, 1)`` priors on ``m`` and ``b``, ``K = 3`` inputs, so ``2^3``
masks can be enumerated. Its expected objective is closed form (Wager et al. 2013 for the
dropout penalty; the module docstring for the prior term):

    F(m, b, p) = [ ||y - (1 - p) X m - b||^2 + p (1 - p) sum_j m_j^2 ||x_j||^2 ] / (2 SIGMA^2)
                 + ((1 - p) ||m||^2 + b^2) / 2 + N log(SIGMA sqrt(2 pi)) + (K + 1) log sqrt(2 pi) - K H(p).

Tolerances:

- Enumeration tests (fixed rate, REINFORCE): the expectation of the engine's estimator over all
  masks is a finite sum, so it must equal the closed form up to float32 rounding: ``1e-5`` of the
  largest value (rounding of epsilon 1.2e-7 accumulated like a random walk over <= 64 masks x 40
  data points: sqrt(2560) * 1.2e-7 = 6e-6; measured 4e-8 for the fixed rate).
- Concrete: its gradient is unbiased for the *relaxed* objective, which is closed form given the
  moments ``E[z~]``, ``E[z~^2]`` of a binary Concrete variable (1-D quadrature over ``u``, error
  < 1e-6). The mean of ``n`` independent gradient estimates is compared with it by
  ``z = (mean - exact) / (sd / sqrt(n))``, ``sd`` the sample standard deviation; by the CLT
  ``|z| < 4`` fails with probability ~6e-5 per coordinate (5 coordinates).
- End to end (fixed rate, SGD): with SGD the parameter ``theta_t = (m, b)`` follows the linear
  recursion ``theta' = theta - lr_t (G_z theta - r_z)`` (``G_z``, ``r_z`` per mask), so the exact mean
  and covariance of the final iterate follow by enumerating the masks at each step. The mean over
  ``C`` chains is compared by ``z = (mean - E theta_T) / sqrt(Var theta_T / C)``; ``theta_T`` sums
  many independent step noises (near Gaussian), so ``|z| < 4`` fails with probability ~1e-4 per
  coordinate. ``E theta_T`` itself equals the closed-form minimizer of ``F`` to 1e-6.
"""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import dropout
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential

SIGMA, P, K, N, Z_MAX = 0.5, 0.3, 3, 40, 4.0


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g)
    y = x @ torch.tensor([1.0, -0.5, 0.8]) + 0.3 + SIGMA * torch.randn(N, generator=g)
    return x, y


def _linear_model():
    torch.manual_seed(0)
    return bp.BNN(
        torch.nn.Linear(K, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=SIGMA)
    )


def _closed_form(x, y, m, b, p):
    """F(m, b, p) of the module docstring, in float64 (differentiable in all arguments)."""
    x, y = x.double(), y.double()
    resid = y - (1 - p) * (x @ m) - b
    data = (resid.pow(2).sum() + p * (1 - p) * (m.pow(2) * x.pow(2).sum(0)).sum()) / (2 * SIGMA**2)
    prior = ((1 - p) * m.pow(2).sum() + b.pow(2)) / 2
    const = N * math.log(SIGMA * math.sqrt(2 * math.pi)) + (K + 1) * math.log(math.sqrt(2 * math.pi))
    entropy = -(p * torch.log(p) + (1 - p) * torch.log1p(-p))
    return data + prior + const - K * entropy


def _setup(rate_learning: bool, p: float = P):
    x, y = _data()
    model = _linear_model()
    data = Data(x=x, y=y)
    sites = dropout.dropout_sites(model, data, None)
    pot = Potential(model, data)
    guide = dropout.DropoutGuide(pot, sites, p, learn=rate_learning)
    g = torch.Generator().manual_seed(3)  # a point away from the optimum
    with torch.no_grad():
        guide.values["weight"].copy_(torch.randn(1, K, generator=g))
        guide.values["bias"].copy_(torch.randn(1, generator=g))
    return x, y, pot, guide


def _forced(mask, p):
    """Uniforms that make the hard mask equal ``mask`` (unit kept iff u > p)."""
    return {"weight": torch.tensor([(1 + p) / 2 if z else p / 2 for z in mask])}


def _grads(guide, surrogate):
    params = [guide.values["weight"], guide.values["bias"]] + [t for t in guide.logits.values() if t.requires_grad]
    grads = torch.autograd.grad(surrogate, params)
    return torch.cat([g.reshape(-1) for g in grads]).double()


def _exact_grads(x, y, guide, with_logit: bool):
    m = guide.values["weight"].detach().double().reshape(-1).requires_grad_()
    b = guide.values["bias"].detach().double().reshape(()).requires_grad_()
    a = guide.logits["weight"].detach().double().requires_grad_()
    f = _closed_form(x, y, m, b, torch.sigmoid(a))
    params = [m, b] + ([a] if with_logit else [])
    return f.detach(), torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, params)])


def _masks():
    return list(itertools.product([0, 1], repeat=K))


def _q(mask, p):
    return math.prod((1 - p) if z else p for z in mask)


# ------------------------------------------------------------------ estimators, exactly
def test_fixed_rate_objective_and_gradient_equal_closed_form_in_expectation():
    x, y, pot, guide = _setup(rate_learning=False)
    value, grad = 0.0, 0.0
    for mask in _masks():
        surrogate, loss, _ = dropout.objective(guide, pot, (x, y), [_forced(mask, P)], dropout.RateLearning.FIXED, 0.1)
        value = value + _q(mask, P) * float(loss)
        grad = grad + _q(mask, P) * _grads(guide, surrogate)
    exact_value, exact_grad = _exact_grads(x, y, guide, with_logit=False)
    assert value == pytest.approx(float(exact_value), rel=1e-5)
    torch.testing.assert_close(grad, exact_grad, rtol=0, atol=1e-5 * float(exact_grad.abs().max()))
    # The weight decay of the expected objective is (1 - p) ||m||^2 / 2: without the (1 - p) factor
    # (the prior applied to M instead of W = M diag z) the gradient would differ by p * m.
    assert (P * guide.values["weight"].detach().abs()).max() > 100 * 1e-5 * exact_grad.abs().max()


@pytest.mark.parametrize("num_particles", [1, 2])
def test_reinforce_gradient_is_exact_in_expectation(num_particles):
    """REINFORCE with a fixed baseline (one particle) or leave-one-out (two): enumerating every
    mask (pair) gives E[estimate] = the exact gradient in (m, b, logit p)."""
    x, y, pot, guide = _setup(rate_learning=True)
    total = 0.0
    for masks in itertools.product(_masks(), repeat=num_particles):
        noise = [_forced(mask, P) for mask in masks]
        surrogate, _, _ = dropout.objective(
            guide, pot, (x, y), noise, dropout.RateLearning.REINFORCE, 0.1, baseline=123.0
        )
        total = total + math.prod(_q(mask, P) for mask in masks) * _grads(guide, surrogate)
    _, exact = _exact_grads(x, y, guide, with_logit=True)
    torch.testing.assert_close(total, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert abs(exact[-1]) > 1.0  # the rate's gradient is far from zero: the check has teeth


def _concrete_moments(a: torch.Tensor, t: float, n: int = 400_000):
    """E[z~], E[z~^2] for z~ = sigmoid((logistic noise + log((1 - p) / p)) / t), p = sigmoid(a), by
    the midpoint rule over u in (0, 1) (error far below the test tolerances)."""
    u = (torch.arange(n, dtype=torch.double) + 0.5) / n
    z = torch.sigmoid((torch.log(u) - torch.log1p(-u) - a) / t)
    return z.mean(), z.pow(2).mean()


@pytest.mark.slow  # 1,500 gradient draws: ~4 s of CPU
def test_concrete_gradient_is_unbiased_for_the_relaxed_objective():
    t, n = 0.5, 1500
    x, y, pot, guide = _setup(rate_learning=True)
    g = torch.Generator().manual_seed(11)
    draws = []
    for _ in range(n):
        surrogate, _, _ = dropout.objective(guide, pot, (x, y), [guide.noise((), g)], dropout.RateLearning.CONCRETE, t)
        draws.append(_grads(guide, surrogate))
    draws = torch.stack(draws)
    # exact relaxed objective: U is quadratic in z~, so only the first two moments enter
    xd, yd = x.double(), y.double()
    m = guide.values["weight"].detach().double().reshape(-1).requires_grad_()
    b = guide.values["bias"].detach().double().reshape(()).requires_grad_()
    a = guide.logits["weight"].detach().double().requires_grad_()
    mu1, mu2 = _concrete_moments(a, t)
    r, gram = yd - b, xd.T @ xd
    second = mu1**2 * (m[:, None] * m[None, :] * gram).sum() + (mu2 - mu1**2) * (m.pow(2) * gram.diagonal()).sum()
    data = (r.pow(2).sum() - 2 * mu1 * (r @ xd @ m) + second) / (2 * SIGMA**2)
    p = torch.sigmoid(a)
    relaxed = data + (mu2 * m.pow(2).sum() + b**2) / 2 - K * -(p * torch.log(p) + (1 - p) * torch.log1p(-p))
    exact = torch.cat([g.reshape(-1) for g in torch.autograd.grad(relaxed, [m, b, a])])
    z = (draws.mean(0) - exact) / (draws.std(0) / math.sqrt(n))
    assert (z.abs() < Z_MAX).all(), f"z-scores {z.tolist()}"
    # the relaxation's bias against the Bernoulli gradient is visible at this temperature: the
    # estimator really is the relaxed one (and shrinks as t -> 0; reported, not asserted)
    _, bernoulli = _exact_grads(x, y, guide, with_logit=True)
    assert ((exact - bernoulli).abs() / (draws.std(0) / math.sqrt(n))).max() > Z_MAX


# ------------------------------------------------------------------ end to end, exactly
def _sgd_moments(x, y, theta0, lrs, p):
    """Exact mean and covariance of SGD's final iterate on the fixed-rate objective (module docstring)."""
    x, y = x.double(), y.double()
    G, r, q = [], [], []
    for mask in _masks():
        x1 = torch.cat([x * torch.tensor(mask, dtype=torch.double), torch.ones(N, 1, dtype=torch.double)], 1)
        G.append(x1.T @ x1 / SIGMA**2 + torch.diag(torch.tensor(list(mask) + [1], dtype=torch.double)))
        r.append(x1.T @ y / SIGMA**2)
        q.append(_q(mask, p))
    mean, second = theta0.clone(), torch.outer(theta0, theta0)
    eye = torch.eye(K + 1, dtype=torch.double)
    for lr in lrs:
        new_mean, new_second = torch.zeros_like(mean), torch.zeros_like(second)
        for Gz, rz, qz in zip(G, r, q):
            A, c = eye - lr * Gz, lr * rz
            new_mean += qz * (A @ mean + c)
            new_second += qz * (
                A @ second @ A.T + torch.outer(A @ mean, c) + torch.outer(c, A @ mean) + torch.outer(c, c)
            )
        mean, second = new_mean, new_second
    return mean, second - torch.outer(mean, mean)


def test_fixed_rate_fit_matches_exact_sgd_moments_and_closed_form_optimum():
    x, y = _data()
    model = _linear_model()
    steps, lr, chains = 100, 0.004, 4
    post = bp.fit(
        model,
        x,
        y,
        method="mc_dropout",
        p=P,
        optimizer="sgd",
        lr=lr,
        lr_schedule="cosine",
        num_steps=steps,
        num_chains=chains,
        num_samples=200,
        seed=0,
        progress=False,
    )
    w = post.samples["weight"].reshape(chains, -1, K).double()
    m = w.sum(1) / (w != 0).sum(1)  # kept columns equal M exactly, dropped ones are 0
    theta = torch.cat([m, post.samples["bias"][:, 0].double()], 1)
    assert torch.equal(post.samples["bias"], post.samples["bias"][:, :1].expand_as(post.samples["bias"]))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr * 0.01)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    theta0 = torch.cat([model.init_values["weight"].reshape(-1), model.init_values["bias"]]).double()
    mean, cov = _sgd_moments(x, y, theta0, lrs, P)
    z = (theta.mean(0) - mean) / (cov.diagonal() / chains).sqrt()
    assert (z.abs() < Z_MAX).all(), f"z-scores {z.tolist()}"
    # E[theta_T] is the closed-form minimizer of F (a ridge with a data-dependent penalty)
    xd = x.double()
    x1 = torch.cat([(1 - P) * xd, torch.ones(N, 1, dtype=torch.double)], 1)
    penalty = torch.cat([P * (1 - P) * xd.pow(2).sum(0) / SIGMA**2 + (1 - P), torch.ones(1, dtype=torch.double)])
    optimum = torch.linalg.solve(x1.T @ x1 / SIGMA**2 + torch.diag(penalty), x1.T @ y.double() / SIGMA**2)
    torch.testing.assert_close(mean, optimum, rtol=0, atol=1e-6)
    # The test's resolution: the dropout penalty moves the optimum by ~80 standard errors of the chain mean
    ridge = torch.linalg.solve(
        x1.T @ x1 / SIGMA**2 + torch.diag(torch.tensor([1 - P] * K + [1.0], dtype=torch.double)),
        x1.T @ y.double() / SIGMA**2,
    )
    assert ((ridge - optimum).abs() / (cov.diagonal() / chains).sqrt()).max() > 10 * Z_MAX


# ------------------------------------------------------------------ smoke tests
def _mlp(hidden=20, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


# Point-mass sites (biases, the input layer) are constant within a chain: ArviZ's MCSE and R-hat of
# constants divide by zero (NaN in the table, which is the honest answer) and warn about it.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_mlp_regression_masks_predict_summary_idata_save_load(tmp_path):
    x, y = bp.datasets.toy_gap()
    model = _mlp()
    post = bp.fit(
        model, x, y, method="mc_dropout", num_steps=100, num_chains=2, num_samples=100, seed=1, progress=False
    )
    assert post.method == "mc_dropout" and set(post.samples) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert post.samples["2.weight"].shape == (2, 100, 1, 20)
    assert post.config["dropout_sites"] == "2.weight" and post.config["rate"] == "fixed"
    # hidden units dropped whole (W = M diag z); the input layer and the biases are point masses
    w = post.samples["2.weight"][0, :, 0]
    kept = w != 0
    assert torch.equal(
        torch.where(kept, w, w[kept.float().argmax(0), torch.arange(20)]),
        w[kept.float().argmax(0), torch.arange(20)].expand_as(w),
    )
    drop_rate = 1 - kept.double().mean()
    assert abs(drop_rate - 0.1) < 4 * math.sqrt(0.1 * 0.9 / kept.numel())  # Bernoulli(0.1) masks
    assert torch.equal(post.samples["0.weight"][0], post.samples["0.weight"][0, :1].expand(100, 20, 1))
    assert post.sample_stats["dropout_rate[2.weight]"].shape == (2, 100) and set(post.history) == {"loss"}
    assert post.history["loss"].shape == (2, 100) and torch.isfinite(post.history["loss"]).all()
    assert post.history["loss"][:, -20:].mean() < post.history["loss"][:, :20].mean()
    pred = post.predict(x, seed=0)
    assert pred.mean.shape == (80,) and (pred.epistemic_std > 0).all()
    table = post.summary(warn=False)
    assert "r_hat" in table.columns and len(table) == 20 + 20 + 20 + 1
    idata = post.to_inference_data()
    assert idata.posterior["2.weight"].shape == (2, 100, 1, 20) and "log_likelihood" in idata
    path = post.save(tmp_path / "dropout.bnn")
    again = bp.load(path, model=model)
    assert again.method == "mc_dropout" and again.config == post.config
    torch.testing.assert_close(again.predict(x, seed=0).mean, pred.mean)


@pytest.mark.slow  # defaults: 3,000 steps, ~15 s of CPU
def test_toy_gap_regression_with_defaults():
    """Only method= changes: test RMSE well below the targets' sd (0.73; measured 0.31), and the 95%
    predictive interval covers most test points (16 points; measured 14; a loose check)."""
    x_tr, y_tr, x_te, y_te = bp.datasets.train_test_split(*bp.datasets.toy_gap(), test_fraction=0.2, seed=0)
    post = bp.fit(_mlp(50), x_tr, y_tr, method="mc_dropout", progress=False)
    pred = post.predict(x_te, seed=0)
    assert (pred.mean - y_te).pow(2).mean().sqrt() < 0.4
    assert ((y_te >= pred.lower) & (y_te <= pred.upper)).sum() >= 13


@pytest.mark.slow  # defaults: 3,000 steps, ~12 s of CPU
def test_two_moons_classifier_with_defaults():
    x, y = bp.datasets.two_moons(n=200, noise=0.1, seed=0)
    x_te, y_te = bp.datasets.two_moons(n=200, noise=0.1, seed=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    post = bp.fit(model, x, y, method="mc_dropout", progress=False)
    pred = post.predict(x_te, seed=0)
    assert (pred.predicted == y_te).double().mean() > 0.95
    assert (pred.mutual_information >= 0).all() and pred.mutual_information.max() > 0


@pytest.mark.slow  # ~2 s (concrete) and ~6 s (reinforce, 4 particles) of CPU
@pytest.mark.parametrize("rate", ["reinforce", "concrete"])
def test_learned_rate_is_recorded_and_moves(rate):
    x, y = bp.datasets.toy_gap()
    # lr_schedule="constant": the estimators' drift over a fixed 150-step budget (the cosine default, which halves
    # the budget's summed step, left the concrete rate at 0.157 by step 150; long runs end near 0.0015 either way)
    post = bp.fit(
        _mlp(),
        x,
        y,
        method="mc_dropout",
        rate=rate,
        p=0.3,
        lr=0.05,
        num_steps=150,
        num_samples=50,
        lr_schedule="constant",
        seed=0,
        progress=False,
    )
    history = post.history["dropout_rate[2.weight]"]
    assert history.shape == (1, 150)
    # With sigma = 0.1 the likelihood outweighs the mask entropy and the rate falls from 0.3 (long runs
    # end near 0.0015 with either estimator); REINFORCE with one particle and a lagging decaying-average
    # baseline instead wandered up to 0.69 here, which this would catch.
    assert history[0, -1] < 0.1
    assert torch.allclose(post.sample_stats["dropout_rate[2.weight]"], history[:, -1:].expand(1, 50))


def test_seed_reproducible_and_learned_noise_is_a_point_mass():
    x, y = bp.datasets.toy_gap()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model = bp.BNN(
        net,
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
        bayesian="weights",
    )
    runs = [
        bp.fit(
            model,
            x,
            y,
            method="mc_dropout",
            rate="reinforce",
            num_steps=20,
            num_samples=20,
            batch_size=40,
            seed=5,
            progress=False,
        )
        for _ in range(2)
    ]
    rate = runs[0].history["dropout_rate[2.weight]"]
    assert rate.shape == (1, 20) and runs[0].config["num_particles"] == 4
    assert torch.allclose(runs[0].sample_stats["dropout_rate[2.weight]"], rate[:, -1:].expand(1, 20))
    for name in runs[0].samples:
        assert torch.equal(runs[0].samples[name], runs[1].samples[name])
    sigma = runs[0].samples["sigma"]
    assert (sigma > 0).all() and torch.equal(sigma, sigma[:, :1].expand_as(sigma))
    assert set(runs[0].point) == {"0.bias", "2.bias"}  # deterministic biases are fitted alongside
    assert not torch.equal(runs[0].point["2.bias"][0], model.init_values["2.bias"])


def test_conv_masks_drop_whole_input_channels_within_groups():
    conv = torch.nn.Conv2d(4, 6, 3, groups=2)
    site = dropout._site("w", conv)
    assert site.size == 4 and site.units.shape == (6, 2, 1, 1)
    assert site.units[:, :, 0, 0].tolist() == [[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [2, 3]]
    tconv = dropout._site("w", torch.nn.ConvTranspose1d(3, 5, 2))
    assert tconv.size == 3 and tconv.units.reshape(-1).tolist() == [0, 1, 2]
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(2, 3, 3), torch.nn.Tanh(), torch.nn.Conv1d(3, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 1)
    )
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 2, 8, generator=g), torch.randn(16, generator=g)
    post = bp.fit(model, x, y, method="mc_dropout", p=0.5, num_steps=5, num_samples=30, progress=False)
    assert post.config["dropout_sites"] == "2.weight,4.weight"
    w = post.samples["2.weight"][0]  # (30, 2, 3, 3): input channel c is w[:, :, c]
    zero = (w == 0).all(-1)
    assert torch.equal(zero, zero[:, :1].expand_as(zero)) and zero.any() and (~zero).any()
    assert post.predict(x).mean.shape == (16,)


# ------------------------------------------------------------------ bad input
def test_function_model_says_which_method_fits():
    def linreg(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(w * x[:, 0], 0.1), obs=y)

    x, y = bp.datasets.toy_gap()
    with pytest.raises(TypeError, match="(?s)Pyro function model.*method='svi'.*full-rank.*method='nuts'"):
        bp.fit(linreg, x, y, method="mc_dropout", progress=False)


def test_bnn_without_bayesian_layer_weights_says_so():
    x, y = bp.datasets.toy_gap()
    model = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
        bayesian=["bias"],
    )
    with pytest.raises(ValueError, match="(?s)no Bayesian weight of an nn.Linear.*bias.*method='svi'"):
        bp.fit(model, x, y, method="mc_dropout", progress=False)
    with pytest.raises(ValueError, match="dropout_inputs=True"):
        bp.fit(_linear_model(), *_data(), method="mc_dropout", dropout_inputs=False, progress=False)
    positive = bp.BNN(torch.nn.Linear(1, 1), prior=dist.HalfNormal(1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    with pytest.raises(ValueError, match="real line"):
        bp.fit(positive, x, y, method="mc_dropout", progress=False)


@pytest.mark.parametrize(
    "config, error, match",
    [
        (dict(p=0.0), ValueError, "p: the drop rate"),
        (dict(p=1.5), ValueError, "p: the drop rate"),
        (dict(rate="gumbel"), ValueError, "rate: unknown value 'gumbel'"),
        (dict(temperature=0.5), ValueError, "temperature= applies to rate='concrete'"),
        (dict(rate="concrete", baseline_beta=0.5), ValueError, "baseline_beta= applies to rate='reinforce'"),
        (dict(rate="reinforce", baseline_beta=1.0), ValueError, "baseline_beta must be in"),
        (dict(rate="concrete", temperature=-1.0), ValueError, "temperature must be a positive"),
        (dict(num_steps=10, epochs=1), ValueError, "num_steps= or epochs="),
        (dict(num_particles=0), ValueError, "num_particles must be a positive int"),
    ],
)
def test_bad_config(config, error, match):
    x, y = bp.datasets.toy_gap()
    with pytest.raises(error, match=match):
        bp.fit(_mlp(4), x, y, method="mc_dropout", progress=False, **config)


# ------------------------------------------------------------------ held-out rows (bnn_pyro.infer.holdout)
def _sine_with_learned_noise(n=240):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.2 * torch.randn(n, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return (
        x,
        y,
        bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))),
    )


def _mixture_lpd(post, x, y, sigma):
    d = post.observation_distribution(x)
    loc = (d.base_dist if isinstance(d, dist.Independent) else d).loc.double()  # (draws, rows)
    lp = dist.Normal(loc, sigma).log_prob(y.double())
    return float((torch.logsumexp(lp, 0) - math.log(loc.shape[0])).mean())


def test_default_holds_rows_out_stops_early_and_sets_the_noise_on_them(monkeypatch):
    from bnn_pyro.infer import dropout, holdout

    x, y, model = _sine_with_learned_noise()
    final = bp.fit(model, x, y, method="mc_dropout", num_steps=200, num_samples=50, seed=0, progress=False)
    assert final.config["validation"]["final_fit_rows"] == 240 and "best_step" not in final.history
    monkeypatch.setattr(
        dropout, "refit", lambda post, again, **_: post
    )  # the fit that chose, before holdout.refit fits every row again (tested in test_holdout.py)
    post = bp.fit(model, x, y, method="mc_dropout", num_steps=200, num_samples=50, seed=0, progress=False)
    assert post.config["validation"] == {"rows": 24, "source": "split", "fraction": 0.1}
    assert post.config["noise"] == final.config["noise"]
    assert post.config["dataset_size"] == 216 and post.x.shape[0] == 240
    assert 0 <= int(post.history["best_step"][0, 0]) < 200  # the kept state is one that was scored
    _, held, _ = holdout.split(Data(x=x, y=y), 0.1, seed=0, method="mc_dropout")
    sigma = post.config["noise"]["sigma"]
    assert post.config["noise"]["selected_on"] == "validation" and torch.all(post.samples["sigma"] == sigma)
    best = _mixture_lpd(post, held.x, held.y, sigma)  # the MC-dropout predictive's held-out density is maximal
    for other in (0.95 * sigma, 1.05 * sigma):
        assert best > _mixture_lpd(post, held.x, held.y, other)

    old = bp.fit(
        model, x, y, method="mc_dropout", num_steps=200, num_samples=50, validation=None, seed=0, progress=False
    )
    assert old.config["validation"] == {"rows": 0} and "noise" not in old.config
    assert old.config["dataset_size"] == 240 and "best_step" not in old.history


def test_default_holds_nothing_out_without_a_noise_to_choose_but_an_explicit_fraction_does():
    x, y = bp.datasets.two_moons(n=240, seed=0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    post = bp.fit(model, x, y, method="mc_dropout", num_steps=100, num_samples=10, seed=0, progress=False)
    assert post.config["validation"]["rows"] == 0 and post.config["dataset_size"] == 240
    post = bp.fit(
        model, x, y, method="mc_dropout", num_steps=100, num_samples=10, validation=0.1, seed=0, progress=False
    )
    assert post.config["validation"]["rows"] == 24 and post.config["validation"]["final_fit_rows"] == 240
    assert (
        post.config["dataset_size"] == 240
        and post.config["num_steps"] == post.config["validation"]["chosen"]["num_steps"]
    )  # early stopping alone: the chosen stopping point, then every row
    assert "noise" not in post.config  # nothing to choose for a classifier


# ------------------------------------------------------------------ checkpoint/resume
def test_resumed_run_is_bit_identical_with_its_masks_baseline_and_early_stopping(tmp_path, monkeypatch):
    """A run that dies after its checkpoint of step 16 and is resumed equals an uninterrupted one exactly: the
    masks' generator, REINFORCE's decaying baseline (one particle), the learned rates and early stopping's best
    state come back from the file; the shuffled minibatches (32 rows) are replayed."""
    from bnn_pyro.infer import checkpoint as ckpt_mod

    x, y, model = _sine_with_learned_noise()
    cfg = dict(
        method="mc_dropout",
        rate="reinforce",
        num_particles=1,
        num_steps=40,
        num_samples=20,
        num_chains=2,
        batch_size=32,
        seed=2,
        progress=False,
    )
    whole = bp.fit(model, x, y, **cfg)
    save = ckpt_mod.Checkpoint.save

    def crashing(self, step, tensors, meta):
        if self.path.name == "chain0.ckpt" and step == 24:
            raise RuntimeError("crash")
        return save(self, step, tensors, meta)

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.Checkpoint, "save", crashing)
        with pytest.raises(RuntimeError, match="crash"):
            bp.fit(model, x, y, checkpoint=tmp_path, checkpoint_every=8, **cfg)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == 16
    resumed = bp.fit(model, x, y, checkpoint=tmp_path, checkpoint_every=8, resume=True, **cfg)
    assert resumed.config == whole.config and whole.config["validation"]["rows"] == 24
    assert "dropout_rate[2.weight]" in whole.history and whole.config["validation"]["chosen"]["num_steps"] >= 1
    for group in ("samples", "history", "sample_stats", "point"):
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)
