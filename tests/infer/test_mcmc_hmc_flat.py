"""``method="hmc"`` runs the library's flat-vector kernel (``FlatHMC``) wherever the fast path builds a log joint, as
NUTS does: on the generic compiled potential where the analytic one does not apply (a classification likelihood),
and Pyro's ``HMC`` only without a log joint. Exactness on that path: a Bernoulli logistic regression, whose
posterior moments are computed by quadrature on a grid."""

import math
import warnings

import arviz as az
import pytest
import torch
from conftest import forks_chains
from pyro.infer.mcmc.util import initialize_model

import bnn_pyro as bp
from bnn_pyro.infer import _batched, _kernels, _logjoint, _one_chain, mcmc
from bnn_pyro.infer.checkpoint import CheckpointError

Z_MAX = 4.0  # |estimate - exact| in Monte Carlo standard errors (ESS-based), as tests/infer/test_mcmc.py


def _spy(monkeypatch, cls) -> list:
    used, original = [], cls.setup
    monkeypatch.setattr(cls, "setup", lambda self, *a, **k: used.append(1) or original(self, *a, **k))
    return used


def _classifier(likelihood, outputs: int):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, outputs))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)


@pytest.mark.parametrize("kind", ["bernoulli", "categorical"])
def test_hmc_on_a_classifier_runs_the_flat_kernel_on_the_generic_potential(monkeypatch, kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, generator=g)
    if kind == "bernoulli":
        model, y = _classifier(bp.likelihoods.Bernoulli(), 1), (x[:, 0] > 0).float()
    else:
        model, y = _classifier(bp.likelihoods.Categorical(), 3), torch.randint(3, (20,), generator=g)
    joint = _logjoint.build(model, 20)
    assert joint is not None and not _one_chain.analytic_applies(joint, x, y)  # the generic potential's case
    flat, pyro_hmc = _spy(monkeypatch, _one_chain.FlatHMC), _spy(monkeypatch, _kernels.PyroHMC)
    post = bp.fit(model, x, y, method="hmc", num_samples=4, num_warmup=4, num_chains=1, seed=0, progress=False)
    assert flat and not pyro_hmc and post.config["fast_path"] is True
    counts = post.sample_stats["n_steps"]  # FlatHMC's jitter around the default 32 steps
    assert ((counts >= 16) & (counts <= 48)).all()


def test_hmc_without_a_log_joint_keeps_pyros_kernel(monkeypatch):
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).float()
    flat, pyro_hmc = _spy(monkeypatch, _one_chain.FlatHMC), _spy(monkeypatch, _kernels.PyroHMC)
    bp.fit(
        _classifier(bp.likelihoods.Bernoulli(), 1),
        x,
        y,
        method="hmc",
        num_samples=2,
        num_warmup=2,
        num_chains=1,
        num_leapfrog=2,
        seed=0,
        progress=False,
        fast_path=False,
    )
    assert pyro_hmc and not flat


# ---------------------------------------------------------------------- where each chain's step came from
def _spy_aims(monkeypatch) -> list:
    """Every :class:`~bnn_pyro.infer._aimed_step.AimedStep` the flat kernels compute, in this process."""
    seen, aim = [], _batched.aimed_step
    monkeypatch.setattr(_batched, "aimed_step", lambda *a, **k: seen.append(found := aim(*a, **k)) or found)
    return seen


def _assert_origins_match_steps(post, seen) -> None:
    """Each chain's recorded rule is the one whose aimed step it runs at after warm-up (the kept draws' step)."""
    for c, origin in enumerate(post.config["step_size_origin"]):
        step = float(post.sample_stats["step_size"][c, 0])
        assert [a.origin for a in seen if a is not None and a.step == pytest.approx(step, rel=1e-6)][:1] == [origin]


@pytest.mark.filterwarnings("ignore:hmc. the bulk ESS")  # a handful of draws per fit
def test_each_chain_records_which_rule_gave_its_step_after_warm_up(monkeypatch, tmp_path):
    """``config["step_size_origin"]``, one per chain (review 21 finding 5): the aimed step's ``"crossing"`` or
    ``"capped"``; ``"dual_average"`` where there was no curve to fit (a 2-pair end window: ``num_warmup`` 20-29) and on
    Pyro's kernel; saved and loaded with the posterior; an extension keeps the extended chains' origins
    (``"extended"`` for a posterior without the record). Seed 5 at 30 warm-up iterations: one chain of each rule."""
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).float()
    run = dict(method="hmc", num_samples=4, num_chains=2, num_leapfrog=3, progress=False, chain_method="sequential")
    seen = _spy_aims(monkeypatch)
    post = bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, num_warmup=30, seed=5, **run)
    assert post.config["step_size_origin"] == ["capped", "crossing"]
    _assert_origins_match_steps(post, seen)
    short = bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, num_warmup=25, seed=5, **run)
    assert short.config["step_size_origin"] == ["dual_average"] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pyro's kernel on 4 draws: the health checks' warnings
        pyro_path = bp.fit(
            _classifier(bp.likelihoods.Bernoulli(), 1), x, y, num_warmup=4, seed=5, fast_path=False, **run
        )
    assert pyro_path.config["step_size_origin"] == ["dual_average"] * 2
    loaded = bp.load(post.save(tmp_path / "post"))
    assert loaded.config["step_size_origin"] == ["capped", "crossing"]
    extend = dict(run, num_samples=2, seed=11)
    more = bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, resume=post, **extend)
    assert more.config["step_size_origin"] == ["capped", "crossing"]
    del post.config["step_size_origin"]  # as a posterior of a version before the record
    older = bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, resume=post, **extend)
    assert older.config["step_size_origin"] == ["extended"] * 2


# ---------------------------------------------------------------------- exactness on the generic path
def _logistic_data(n: int = 30):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, generator=g)
    y = torch.bernoulli(torch.sigmoid(1.5 * x[:, 0] - 0.5), generator=g)
    return x, y


def _quadrature(x, y, half_width: float = 6.0, points: int = 601):
    """Exact (to grid error ~1e-10 here) posterior mean, covariance and the variances of the centred products of
    ``w = [weight, bias]`` under ``N(0, 1)`` priors and a Bernoulli likelihood, by a Riemann sum on a grid."""
    grid = torch.linspace(-half_width, half_width, points, dtype=torch.float64)
    w, b = torch.meshgrid(grid, grid, indexing="ij")
    logits = w[..., None] * x[:, 0].double() + b[..., None]
    ll = (y.double() * logits - torch.nn.functional.softplus(logits)).sum(-1)
    log_p = ll - 0.5 * (w**2 + b**2)
    p = torch.softmax(log_p.reshape(-1), 0).reshape(log_p.shape)
    pts = torch.stack([w, b], -1)
    mean = (p[..., None] * pts).sum((0, 1))
    c = pts - mean
    cov = (p[..., None, None] * c[..., :, None] * c[..., None, :]).sum((0, 1))
    prod_var = (p[..., None, None] * (c[..., :, None] * c[..., None, :] - cov) ** 2).sum((0, 1))
    return mean, cov, prod_var


@pytest.mark.slow  # ~6 s idle on a 2-core machine
def test_flat_hmc_on_the_generic_potential_recovers_the_exact_logistic_posterior(monkeypatch):
    x, y = _logistic_data()
    model = bp.BNN(torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Bernoulli())
    flat = _spy(monkeypatch, _one_chain.FlatHMC)
    post = bp.fit(  # in this process (the spy sees it); defaults otherwise: 32 jittered leapfrog steps per draw
        model,
        x,
        y,
        method="hmc",
        num_samples=600,
        num_warmup=300,
        num_chains=2,
        seed=0,
        progress=False,
        chain_method="sequential",
    )
    assert flat and post.sample_stats["diverging"].sum() == 0
    c, n = post.num_chains, post.num_draws
    draws = torch.cat([post.samples[k].reshape(c, n, -1) for k in ("weight", "bias")], -1).double()
    mean, cov, prod_var = _quadrature(x, y)
    z = {}
    for i in range(2):
        ess = float(az.ess(draws[..., i].numpy(), method="mean"))
        assert ess > 200  # the check below is informative only with a fair ESS
        z[f"mean[{i}]"] = float((draws[..., i].mean() - mean[i]) / math.sqrt(cov[i, i] / ess))
    centred = draws - mean
    for i in range(2):
        for j in range(i, 2):
            prod = centred[..., i] * centred[..., j]
            ess = float(az.ess(prod.numpy(), method="mean"))
            z[f"cov[{i},{j}]"] = float((prod.mean() - cov[i, j]) / math.sqrt(prod_var[i, j] / ess))
    print("z:", {k: round(v, 2) for k, v in z.items()})  # shown with pytest -s
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"estimates off by more than {Z_MAX} MCSE: {bad} (all: { {k: round(v, 2) for k, v in z.items()} })"


class _Stop(Exception):
    pass


def _pyro_hmc_kernel(x, y):
    """``HMCConfig.kernel`` as it routed a classifier before 0158693: Pyro's HMC on the compiled generic potential."""

    def kernel(self, model, chain):
        params, _, transforms, _ = initialize_model(
            model, model_args=(x, y), init_strategy=chain.init_strategy, skip_jit_warnings=True
        )
        pyro_hmc = _kernels.PyroHMC(
            potential_fn=_logjoint.potential(chain.joint, transforms, x, y, jit=self.jit),
            transforms=transforms,
            step_size=1.0,
            adapt_step_size=True,
            adapt_mass_matrix=True,
            full_mass=False,
            target_accept_prob=self.target_accept,
        )
        pyro_hmc.initial_params, pyro_hmc.resume, pyro_hmc.metric = params, None, None
        pyro_hmc.fixed_num_steps, pyro_hmc.leapfrog_jitter = self.num_leapfrog, self.leapfrog_jitter
        return pyro_hmc

    return kernel


@pytest.mark.parametrize("chain_method", ["sequential", pytest.param("parallel", marks=forks_chains)])
def test_a_checkpoint_of_pyros_hmc_is_refused_before_any_chain_runs_naming_the_file(
    tmp_path, monkeypatch, chain_method
):
    """A folder where the old routing's chain 0 wrote its file and chain 1 none yet (interrupted): resuming is
    refused in this process, naming the file, and the folder is left as it was (no new chain1.ckpt beside it)."""
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(2))
    y = (x[:, 0] > 0).float()
    run = dict(method="hmc", num_samples=4, num_warmup=4, num_chains=2, num_leapfrog=2, seed=0, progress=False)
    run.update(checkpoint=tmp_path, checkpoint_every=2)
    sample, calls = _kernels.PyroHMC.sample, []

    def interrupted(self, params):
        calls.append(1)
        if len(calls) > 5:
            raise _Stop
        return sample(self, params)

    with monkeypatch.context() as patch:
        patch.setattr(mcmc.HMCConfig, "kernel", _pyro_hmc_kernel(x, y))
        patch.setattr(_kernels.PyroHMC, "sample", interrupted)
        with pytest.raises(_Stop):
            bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, chain_method="sequential", **run)
    files = {p.name: p.read_bytes() for p in tmp_path.glob("*.ckpt")}
    assert "chain0.ckpt" in files and "chain1.ckpt" not in files
    with pytest.raises(CheckpointError, match=r"chain0\.ckpt' was written by Pyro's HMC kernel.*0158693") as error:
        bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, chain_method=chain_method, resume=True, **run)
    assert "chain1.ckpt" not in str(error.value)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.ckpt")} == files


def test_a_fast_path_false_checkpoint_resumed_on_the_fast_path_names_the_option_not_an_old_version(tmp_path):
    """Today's ``fast_path=False`` HMC (Pyro's kernel) writes the same kernel key as the old routing did; resumed with
    the default fast path, the refusal is the run identity's ("differs in ['fast_path']"), which says what to change,
    not that an older bnn_pyro wrote the file (review 20)."""
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).float()
    run = dict(method="hmc", num_samples=4, num_warmup=4, num_chains=1, num_leapfrog=3, seed=0, progress=False)
    run.update(checkpoint=tmp_path, checkpoint_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, fast_path=False, **run)
    with pytest.raises(CheckpointError, match=r"fast_path") as error:
        bp.fit(_classifier(bp.likelihoods.Bernoulli(), 1), x, y, resume=True, **run)
    assert "0158693" not in str(error.value), str(error.value)
