"""The Laplace start of a small plain Pyro function (bnn_pyro/infer/_mode_start.py) on Pyro's NUTS / HMC kernels and
its seeding: the initial step-size search runs under the metric the warm-up starts from, and a chain's start is not
drawn from the chain's own stream.

The posterior is the exact Gaussian of ``test_mcmc_function_start`` (linear regression, a covariate near 100, known
noise): ``H^{-1}`` is its covariance, so in the metric ``H^{-1}`` the posterior is ``N(0, I)``. Pyro's search doubles
or halves the step until one leapfrog step's acceptance crosses 0.8; on a unit-scale Gaussian that happens at steps
of order one (leapfrog is stable below 2), while under the identity metric leapfrog is unstable above twice the
smallest posterior sd (0.014 here), and the search's last doubling can overshoot that by 2: at most ~0.06.
``STEP_MIN`` = 0.25 sits a factor of 4 or more from both.
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer.autoguide.initialization import init_to_value
from test_mcmc_function_start import N, _data, _exact, _model

from bnn_pyro.infer._kernels import pyro_kernel
from bnn_pyro.infer._mode_start import SPREAD, mode_start
from bnn_pyro.infer.training_data import Data

STEP_MIN = 0.25
CHAINS = 4


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(scope="module")
def start(data):
    x, y = data
    return mode_start(_model, Data(x, y, dataset_size=N), num_chains=CHAINS, seed=0, fast_path=True)


def _setup_step(kind, data, start, c, metric):
    x, y = data
    pyro.set_rng_seed(c)
    kernel = pyro_kernel(
        kind,
        _model,
        jit=False,
        init_strategy=init_to_value(values=start.values[c]),
        metric=metric,
        step_size=1.0,
        adapt_step_size=True,
        adapt_mass_matrix=True,
        full_mass=True,
        target_accept_prob=0.8,
    )
    kernel.setup(100, x, y)
    return kernel


@pytest.mark.parametrize("kind", ["nuts", "hmc"])
def test_the_initial_step_size_is_searched_under_the_laplace_metric(kind, data, start):
    """Before the fix the search ran under the identity only (steps 0.016-0.031 here), then ``H^{-1}`` was set."""
    _, cov = _exact(*data)
    assert float(4 * torch.linalg.eigvalsh(cov).min().sqrt()) < STEP_MIN / 4  # the identity's bound is far below
    for c in range(CHAINS):
        kernel = _setup_step(kind, data, start, c, start)
        ((_, inverse_mass),) = kernel.inverse_mass_matrix.items()
        assert torch.allclose(inverse_mass.double(), cov, rtol=1e-3)
        assert kernel.step_size >= STEP_MIN, (c, kernel.step_size)
        plain = _setup_step(kind, data, start, c, None)  # the same start without the metric: the identity's step
        assert plain.step_size < STEP_MIN / 4, (c, plain.step_size)


def test_a_chain_start_is_not_drawn_from_the_chain_stream(data, start):
    """Chain ``c``'s stream is seeded ``seed + c`` (the driver's ``pyro.set_rng_seed``); its start's standard normals
    ``eps_c = L^T (z_c - mode) / SPREAD`` (``H = L L^T``) must be other draws (before: the same, to the bit)."""
    x, y = data
    mean, cov = _exact(x, y)
    chol = torch.linalg.cholesky(torch.linalg.inv(cov))  # L with H = L L^T
    for c in range(CHAINS):
        eps = chol.T @ (start.values[c]["beta"].double() - mean) / SPREAD
        stream = torch.Generator().manual_seed(0 + c)
        first = torch.randn(2, generator=stream, dtype=torch.float64)
        assert not torch.allclose(eps, first, atol=1e-3), (c, eps, first)
