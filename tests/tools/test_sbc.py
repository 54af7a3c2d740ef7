"""Simulation-based calibration (bnn_pyro/tools/sbc.py) of nuts, hmc, metropolis and sgld.

The model is Bayesian linear regression with one input, ``K`` outputs and fixed noise: ``Linear(1, K)``
with ``Normal(0, 1)`` priors. Its ``K`` outputs are independent under the prior and the likelihood, so
one fit is ``K`` independent regression problems (weight and bias each): an SBC replication costs a
K-th of a fit. The ``K`` problems share the sampler's adaptation and its accept/reject decisions, which
can correlate ranks within a fit; several fits (and ``K`` small for Metropolis, whose random walk slows
with the dimension) keep that weak. Ranks of 9 evenly thinned draws: 10 possible values, uniform
under a correct sampler; Pearson's chi-square at the pre-declared level ALPHA = 0.01, fixed seeds.

Each test also runs the negative control on its own fits: the same draws squeezed to half their spread
around their mean (a posterior too narrow by 2x) must be rejected, so the check can fail.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from blr import BLR

import bnn_pyro as bp
from bnn_pyro import sbc

ALPHA = 0.01
NUM_DRAWS = 9
X = torch.linspace(-1.0, 1.0, 10).unsqueeze(-1)


def _model(outputs: int) -> bp.BNN:
    return bp.BNN(
        torch.nn.Linear(1, outputs), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5)
    )


def _too_narrow(result: sbc.SBCResult) -> torch.Tensor:
    mean = result.draws.mean(1, keepdim=True)
    return sbc.ranks(mean + 0.5 * (result.draws - mean), result.truth)


def _check(result: sbc.SBCResult) -> None:
    assert result.ranks.numel() >= 200
    for site in ("weight", "bias"):
        assert sbc.chi_square(result.ranks[:, result.columns(site)], NUM_DRAWS) > ALPHA, site
    assert sbc.chi_square(_too_narrow(result), NUM_DRAWS) < ALPHA


def test_exact_posterior_draws_pass_and_too_narrow_ones_fail():
    """The machinery on its own: draws from the closed-form posterior give uniform ranks; the same draws
    squeezed to half their spread do not."""
    model = _model(1)
    truth, draws = [], []
    g = torch.Generator().manual_seed(0)
    for r in range(300):
        theta, y = sbc.simulate(model, X, seed=r)
        blr = BLR(x=X, y=y, noise=0.5, prior_scale=1.0)
        chol = torch.linalg.cholesky(blr.cov)
        draws.append((blr.mean + torch.randn(NUM_DRAWS, 2, generator=g, dtype=torch.double) @ chol.T).float())
        truth.append(torch.cat([theta["weight"].reshape(-1), theta["bias"].reshape(-1)]))
    result = sbc.SBCResult(truth=torch.stack(truth), draws=torch.stack(draws), names=[("weight", 1), ("bias", 1)])
    _check(result)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bins"):
        sbc.chi_square(torch.zeros(10, dtype=torch.long), NUM_DRAWS, bins=3)
    with pytest.raises(ValueError, match="num_draws"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5 draws: the engine rightly warns that the chain barely moved
        sbc.run(
            _model(1),
            X,
            method="metropolis",
            num_chains=1,
            num_replications=1,
            num_draws=20,
            num_warmup=10,
            num_samples=5,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, outputs, fits, config",
    [
        ("nuts", 50, 2, dict(num_warmup=100, num_samples=90)),
        ("hmc", 50, 2, dict(num_warmup=100, num_samples=90)),
        ("metropolis", 5, 20, dict(num_warmup=300, num_samples=900)),
        # sgld at its default (automatic) step size and thinning; only the run length is shortened
        ("sgld", 50, 2, dict(num_warmup=200, num_samples=90)),
    ],
)
def test_sampler_is_calibrated(method, outputs, fits, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short runs: the engines' low-ESS advice is expected
        result = sbc.run(_model(outputs), X, method=method, num_replications=fits, num_draws=NUM_DRAWS, **config)
    _check(result)
