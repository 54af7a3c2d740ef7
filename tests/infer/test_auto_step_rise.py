"""Tests for the bound on a rise of ``lr="auto"``'s step (:data:`bnn_pyro.infer.sgmcmc_step.RISE`): a curvature
estimate may raise the step at most ``RISE`` times over the step it replaces.

Why (docs/ood.md, "Ten splits"): on wine split 8 a snapshot run at its defaults fitted the separable training rows
until the softmax saturated (training NLL 2.5e-6 nats, 141 of 142 rows at probability 1 in float32); the Hessian there
is the prior's identity, the estimate at step 45 said ``lambda = 1.03`` where the one before said 1,890, the peak step
rose 1,840-fold to 0.92 and the next steps left the flat region and diverged (test NLL 19.7)."""

from __future__ import annotations

import math

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import sgmcmc_step
from bnn_pyro.infer.sgmcmc_step import SGMCMC


def test_an_estimate_raises_the_step_at_most_rise_fold_and_later_estimates_confirm_more():
    """Estimates 1,890 then 1.03 (the curvature collapsed): each estimate may double the step, so the step climbs
    ``fraction / 1890 * 2^k`` until it reaches ``fraction / 1.03``; a fall is taken at once."""
    estimates = iter([1890.0] + [1.03] * 12 + [500.0])

    def curvature(z, start, iters):
        return next(estimates), start

    n = 14
    plan = sgmcmc_step.Plan(
        scale=torch.ones(n, dtype=torch.float64),
        noisy=torch.zeros(n, dtype=torch.bool),
        keep=torch.zeros(n, dtype=torch.bool),
        adapt=torch.ones(n, dtype=torch.bool),
        friction=0.1,
        fraction=0.95,
        guard=torch.zeros(n, dtype=torch.bool),
    )
    z = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = SGMCMC([z], plan=plan, lr=None, seed=0, curvature=curvature)
    used = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        (0.0 * z.sum()).backward()
        opt.adapt()
        opt.step()
        used.append(opt.step_size)
    f = plan.fraction
    climb = [min(f / 1890.0 * 2.0**k, f / 1.03) for k in range(13)]
    assert climb[-1] == f / 1.03 and climb[10] < f / 1.03  # 11 doublings are not enough, 12 are
    assert used == pytest.approx(climb + [f / 500.0], rel=1e-14)


def _wine_split8():
    """benchmarks/classification.py's wine split 8: a permutation from seed 8, 20% test rows, standardized on the
    training rows."""
    x, y = bp.datasets.load_sklearn("wine")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(8))
    train = perm[int(round(0.2 * len(x))) :]
    xs = (x - x[train].mean(0)) / x[train].std(0)
    return xs[train], y[train]


def _wine_model():
    torch.manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Linear(13, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_snapshot_default_step_does_not_blow_up_where_the_softmax_saturates():
    """The wine split 8 case, one cycle of 100 steps at the defaults otherwise: the run descends (the potential never
    exceeds its start, 967) and every step is at most ``RISE`` times the one before. Without the bound
    (``RISE = inf``, the code before) the peak step rose 1,000-fold and the potential reached 23,892 at step 36 and
    ended at 11,948."""
    x, y = _wine_split8()
    post = bp.fit(_wine_model(), x, y, method="snapshot", num_cycles=1, cycle_length=100, seed=8, progress=False)
    u, step = post.history["potential"][0], post.history["step_size"][0]
    assert bool(torch.isfinite(u).all()) and "divergence_recovery" not in post.config
    assert float(u.max()) == float(u[0])
    assert float(u[-1]) < 0.5 * float(u[0])
    assert float((step[1:] / step[:-1]).max()) <= sgmcmc_step.RISE * (1 + 1e-12)


@pytest.mark.parametrize("method", ["sghmc", "csgmcmc", "snapshot"])
def test_a_fit_whose_estimates_never_rise_past_the_bound_is_bit_identical(method, monkeypatch):
    """A BNN on a smooth regression at ``lr="auto"``: the same draws with the bound as without it (``RISE = inf``),
    to the last bit: the bound changes nothing where it does not act."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, generator=g)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(60, generator=g)
    options = dict(num_samples=20, num_cycles=2) if method == "csgmcmc" else {}
    options = dict(num_cycles=2, cycle_length=100) if method == "snapshot" else options
    options = dict(num_warmup=300, num_samples=20) if method == "sghmc" else options

    def draws(rise: float):
        monkeypatch.setattr(sgmcmc_step, "RISE", rise)
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
        post = bp.fit(model, x, y, method=method, seed=0, progress=False, **options)
        return post.samples, post.history["step_size"]

    (bounded, steps), (free, free_steps) = draws(2.0), draws(math.inf)
    assert torch.equal(steps, free_steps)
    assert bounded.keys() == free.keys() and all(torch.equal(bounded[k], free[k]) for k in bounded)
