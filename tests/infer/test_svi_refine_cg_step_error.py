"""The Monte Carlo error of the mean's step past the dense bounds (bnn_pyro/infer/svi_refine_cg.py) and its record
(``"step_se"`` in ``post.config["guide_refinement"]``): the step lands on the optimum of the objective on its own
draws, so across step seeds its mean scatters by that error, which the gap after it, on the same draws, cannot see as
a gap but gives as its batch-means standard error. On the non-Gaussian logistic regression of test_svi_refine_cg.py
(110 coefficients, 100 rows, a mean-field guide)."""

from __future__ import annotations

import pyro
import torch
from pyro.infer import autoguide
from scipy import stats
from test_svi_gap_cg import _guide_sd, _logistic  # the module beside this file

import bnn_pyro as bp
from bnn_pyro.infer import _health, svi, svi_gap, svi_refine_cg
from bnn_pyro.infer.training_data import Data

DIM = 110
SEEDS = 16


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, DIM, generator=g) * 2 / DIM**0.5
    return x, torch.bernoulli(torch.sigmoid(x @ torch.randn(DIM, generator=g)), generator=g)


def test_the_step_s_seed_to_seed_spread_is_the_gap_s_standard_error():
    """One guide after 300 Adam steps, stepped at 16 seeds: the variance over the seeds of the stepped mean (in guide
    sds), averaged over the coordinates, over the mean squared standard error of the gap at the same seeds, is 1 up to
    its own Monte Carlo error (a pooled variance on ``15 x 110`` degrees of freedom where the coordinates are
    independent: 4 of its sds, 0.14, allowed from the chi-square's quantiles; measured 0.96). So the standard error
    the record keeps is the step's own error."""
    x, y = _data()
    with pyro.get_param_store().scope():
        torch.manual_seed(0)
        guide = autoguide.AutoNormal(_logistic)
        fit = pyro.infer.SVI(_logistic, guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
        for _ in range(300):
            fit.step(x, y)
        fitted = {k: v.detach().clone() for k, v in guide.state_dict().items()}
        sd = _guide_sd(guide)
        means, ses = [], []
        for seed in range(SEEDS):
            guide.load_state_dict(fitted)
            step = svi_refine_cg.refine_mean(guide, _logistic, Data(x, y), seed=seed)
            assert step.stopped == "fixed point", (seed, step)
            gap = svi_gap.newton_gap(guide, _logistic, Data(x, y), seed=seed)
            means.append(guide.locs.b.detach().double() / sd)
            ses.append(gap.se)
    ratio = float(torch.stack(means).var(0).mean() / (torch.stack(ses) ** 2).mean())
    df = (SEEDS - 1) * DIM
    low, high = stats.chi2.ppf([stats.norm.cdf(-4), stats.norm.cdf(4)], df) / df
    assert low < ratio < high, (ratio, low, high)


def test_the_engine_records_the_step_s_error():
    """Through ``bp.fit`` (a mean-field guide, 300 steps: the conjugate-gradient path), the chain's refinement record
    gives the step's error: the largest standard error of the gap on the step's draws."""
    x, y = _data()
    post = bp.fit(
        _logistic, x, y, method="svi", guide="mean_field", num_steps=300, num_samples=5, seed=0, progress=False
    )
    (record,) = post.config["guide_refinement"]
    assert record["stopped"] == "fixed point" and post.config["guide_gap"][0]["method"] == "cg", record
    assert record[svi.STEP_SE] == float(post.history[_health.GAP_SE][0].max()) > 0, record
