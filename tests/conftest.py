"""Shared test set-up: a headless matplotlib backend and small fitted posteriors (session-scoped,
so every test module reuses the same few fits)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot: tests never open windows

import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import driver  # noqa: E402

# forked chains: where torch sees an accelerator a backward pass in this process makes them impossible
# (driver.autograd_survives_fork), so tests that ask for them by name run on machines without one (CI's)
forks_chains = pytest.mark.skipif(
    driver._accelerator_visible(), reason="torch sees an accelerator: forked chains cannot carry autograd's threads"
)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One torch thread, as ``bp.fit`` uses by default: the tests' tensors are tiny, and on a busy
    machine OpenMP threads spinning for them made steps 10-100x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (torch's own seed differs per process), so a
    test that builds a net with random initial weights behaves the same in every run."""
    pyro.set_rng_seed(0)


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for the test (exact comparisons at 1e-10), restored after it; a module takes it
    for every test with ``pytestmark = pytest.mark.usefixtures("float64_default")``."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _linear_data(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    y = 0.8 * x[:, 0] - 0.3 + 0.1 * torch.randn(n, generator=g)
    return x, y


@pytest.fixture(scope="session")
def linear_data():
    return _linear_data()


@pytest.fixture(scope="session")
def blr_model():
    """Bayesian linear regression as a BNN: a Normal prior on the weight; the bias stays a point
    estimate (``bayesian="weights"``), so posteriors carry ``point`` values too."""
    torch.manual_seed(0)
    return bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
        bayesian="weights",
    )


@pytest.fixture(scope="session")
def svi_post(blr_model, linear_data):
    x, y = linear_data
    return bp.fit(
        blr_model, x, y, method="svi", num_chains=2, num_steps=200, num_samples=100, lr=0.05, progress=False, seed=0
    )


@pytest.fixture(scope="session")
def classifier_post():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 2, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 0] > 1).long()
    torch.manual_seed(1)
    model = bp.BNN(torch.nn.Linear(2, 3), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    return bp.fit(model, x, y, method="svi", num_chains=2, num_steps=60, num_samples=50, lr=0.1, progress=False)


def linreg(x, y=None):
    """A plain Pyro function model following the site conventions."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        f = pyro.deterministic("f", w * x[:, 0] + b)
        return pyro.sample("obs", dist.Normal(f, 0.1), obs=y)


@pytest.fixture(scope="session")
def function_post(linear_data):
    x, y = linear_data
    return bp.fit(linreg, x, y, method="svi", num_chains=2, num_steps=100, num_samples=20, lr=0.05, progress=False)


def hand_posterior(
    model, x, y, *, chains=2, draws=200, shift=0.0, divergences=0, rho=0.0, seed=0, stat_names=None
) -> bp.Posterior:
    """A Posterior built by hand, as an MCMC engine would return it: AR(1) draws with
    autocorrelation ``rho``, chain ``c`` shifted by ``c * shift``, and HMC-style sample stats."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(chains, draws, 1, 1, generator=g)
    w = torch.empty_like(noise)
    w[:, 0] = noise[:, 0]
    for t in range(1, draws):
        w[:, t] = rho * w[:, t - 1] + (1 - rho**2) ** 0.5 * noise[:, t]
    w = 0.8 + 0.05 * w + shift * torch.arange(chains).reshape(chains, 1, 1, 1)
    diverging = torch.zeros(chains, draws, dtype=torch.bool)
    diverging.view(-1)[:divergences] = True
    names = stat_names or {}
    stats = {
        names.get("diverging", "diverging"): diverging,
        names.get("acceptance_rate", "acceptance_rate"): torch.rand(chains, draws, generator=g),
        "step_size": torch.full((chains, draws), 0.1),
        "tree_depth": torch.full((chains, draws), 3),
        "n_steps": torch.full((chains, draws), 7),
        "energy": torch.randn(chains, draws, generator=g) + 10.0,
    }
    point = {"bias": torch.full((chains, 1), -0.3)}
    return bp.Posterior(
        samples={"weight": w},
        model=model,
        method="nuts",
        config={"num_samples": draws},
        point=point,
        sample_stats=stats,
        x=x,
        y=y,
    )


@pytest.fixture(scope="session")
def make_posterior():
    """The :func:`hand_posterior` factory, for tests that need special draws or stats."""
    return hand_posterior


@pytest.fixture(scope="session")
def mcmc_post(blr_model, linear_data):
    return hand_posterior(blr_model, *linear_data)


def pytest_collection_modifyitems(config, items):
    """The slow statistical checks first (a stable sort): with ``pytest -n auto`` the longest tests
    then start early instead of leaving one worker busy at the end while the others idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def crash_and_resume(tmp_path, monkeypatch):
    """``crash_and_resume(fit, whole, crash_at=, every=, after_crash=None)``: the run ``fit(**extra)`` checkpointed into
    ``tmp_path`` every ``every`` steps and killed when it is about to save step ``crash_at`` (``after_crash(tmp_path)``
    then runs, e.g. to read what was saved), then resumed; asserts that the resumed run read chain 0's state after
    its last save (``crash_at - every`` steps) and took only the steps after it (:class:`resume.ResumeSpy`: a
    seeded run started afresh gives the same bits), that every draw, sample statistic and history trace of the
    resumed run equals ``whole``'s (the uninterrupted run) to the bit, and returns the resumed posterior."""
    from resume import ResumeSpy

    from bnn_pyro.infer import checkpoint as ckpt_mod

    def run(fit, whole, *, crash_at: int, every: int, after_crash=None):
        original = ckpt_mod.Checkpoint.save

        def crash(ckpt, step, *args):
            if step == crash_at:
                raise RuntimeError("crash")
            return original(ckpt, step, *args)

        with monkeypatch.context() as m:
            m.setattr(ckpt_mod.Checkpoint, "save", crash)
            with pytest.raises(RuntimeError, match="crash"):
                fit(checkpoint=tmp_path, checkpoint_every=every)
        if after_crash is not None:
            after_crash(tmp_path)
        with monkeypatch.context() as m:
            spy = ResumeSpy(m)
            resumed = fit(checkpoint=tmp_path, checkpoint_every=every, resume=True)
        spy.check(crash_at - every)
        for group in ("samples", "sample_stats", "history"):
            for name, value in getattr(whole, group).items():
                assert torch.equal(getattr(resumed, group)[name], value), (group, name)
        return resumed

    return run


@pytest.fixture
def tiny_bnn_fit():
    """``tiny_bnn_fit(method, **options)``: ``bp.fit`` of a fresh ``BNN(nn.Linear(2, 1))`` (``Normal(0, 1)`` prior,
    ``Gaussian(scale=0.1)``) on 30 fixed rows, ``seed=0``: the smallest BNN fit, for the tests that a BNN takes none of
    a Pyro function's paths (bit-identical with them turned off)."""
    torch.manual_seed(0)
    x = torch.randn(30, 2)
    y = x @ torch.tensor([1.0, -0.5]) + 0.1 * torch.randn(30)

    def fit(method: str, **options):
        model = bp.BNN(
            torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)
        )
        return bp.fit(model, x, y, method=method, seed=0, progress=False, **options)

    return fit


@pytest.fixture(scope="session")
def load_benchmark():
    """``load_benchmark("uci")``: the script ``benchmarks/uci.py`` as a module (``benchmarks/`` is no package; its
    siblings, e.g. ``_common.py``, are importable while it loads)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        sys.path.insert(0, str(folder))
        try:
            spec = importlib.util.spec_from_file_location(f"benchmarks_{name.lstrip('_')}", folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(folder))
        return module

    return load


TINY_SUBSPACE = dict(
    subspace_dim=2,
    num_samples=10,
    swa=dict(pretrain_steps=20, num_steps=30, collect_every=1),
    inner_options=dict(num_warmup=10, max_tree_depth=3),
)
"""``method="subspace"`` options for a fit that only has to run (a few seconds): two directions, 20 + 30 SWA steps,
10 inner NUTS warm-up steps at tree depth 3, 10 draws."""
