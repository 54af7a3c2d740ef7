"""A Laplace fit factorizes its dense posterior precision ``H`` once: the Cholesky factor that
:func:`~bnn_pyro.infer.laplace.curvature.checked` computes to prove ``H`` positive definite is kept on the
approximation and reused for the Newton step, ``gamma``, the evidence, the draws, their density and the covariance.

The spy counts the factorizations (``torch.linalg.cholesky`` and ``cholesky_ex``) whose input is the fitted ``H``
(the code before this change factorized it five times in ``bp.fit``: the check, the Newton step, the evidence, the
draws and their density). The equalities are exact (``torch.equal``): the kept factor must be the very factor a fresh
``torch.linalg.cholesky(H)`` gives, so every result is what refactorizing gave, bit for bit.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer.laplace import curvature
from bnn_pyro.infer.laplace import fit as lap_fit
from bnn_pyro.infer.laplace.marglik import log_evidence
from bnn_pyro.likelihoods import HALF_LOG_2PI


def _logistic_function(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Bernoulli(logits=x @ w + b), obs=y)


def _classifier_case():
    x, y = bp.datasets.two_moons(n=80, noise=0.1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    return model, x, y, dict(num_steps=40, polish_steps=10)


def _regression_case():
    # a BNN's defaults with a learned noise: last layer, the noise chosen on held-out rows, then the refit on every
    # row (two approximations, each with its own H)
    x, y = bp.datasets.toy_gap()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    lik = bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=lik), x, y, dict(num_steps=40)


def _function_case():
    # logistic, not linear, regression: its Hessian depends on where it is taken (a linear model's is the same H
    # at every point, so the health checks' Hessians at the draws would count as factorizations of the fitted H)
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([1.5, -1.0]) + 0.3 + torch.randn(40, generator=torch.Generator().manual_seed(1)) > 0
    return _logistic_function, x, y.float(), {}


CASES = {
    # the defaults of each kind of model: a BNN's last layer with the GGN (a classifier: gamma is formed too), and a
    # Pyro function's full exact Hessian (its MAP search ends with Newton steps, each a factorization of its own H)
    "bnn_last_layer": _classifier_case,
    "function_full": _function_case,
    "bnn_noise_refit": _regression_case,
}


def _spied_fit(monkeypatch, case: str):
    """``bp.fit`` at the case's defaults with every Cholesky input from the fit's check of ``H`` on recorded (the
    MAP search's Newton steps before it factorize Hessians of their own) and every chain's approximation kept."""
    seen, approxes, started = [], [], []
    for name in ("cholesky", "cholesky_ex"):
        real = getattr(torch.linalg, name)

        def spy(a, *args, _real=real, **kwargs):
            if started:
                seen.append(a.detach().clone())
            return _real(a, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, spy)
    real_checked, real_chain = lap_fit.checked, lap_fit.fit_chain

    def check(*args, **kwargs):
        started.append(True)
        return real_checked(*args, **kwargs)

    monkeypatch.setattr(lap_fit, "checked", check)

    def keep(*args, **kwargs):
        approxes.append(real_chain(*args, **kwargs))
        return approxes[-1]

    monkeypatch.setattr(lap_fit, "fit_chain", keep)
    model, x, y, config = CASES[case]()
    post = bp.fit(model, x, y, method="laplace", num_samples=50, seed=0, progress=False, **config)
    monkeypatch.undo()
    return post, approxes, seen


def _times_factorized(h: torch.Tensor, seen: list[torch.Tensor]) -> int:
    return sum(a.shape == h.shape and a.dtype == h.dtype and torch.equal(a, h) for a in seen)


@pytest.mark.parametrize("case", list(CASES))
def test_a_fit_factorizes_its_precision_once(monkeypatch, case):
    post, approxes, seen = _spied_fit(monkeypatch, case)
    assert len(approxes) == (2 if case == "bnn_noise_refit" else 1)  # the held-out fit and the refit
    for approx in approxes:
        assert approx.precision.dim() == 2  # a dense H: the structure that factorizes
        assert _times_factorized(approx.precision, seen) == 1
    assert post.sample_stats["log_q"].shape == (1, 50)  # the draws' density was computed (from the same factor)


@pytest.mark.parametrize("case", ["bnn_last_layer", "function_full"])
def test_the_kept_factor_gives_what_refactorizing_gave(monkeypatch, case):
    post, (approx,), _ = _spied_fit(monkeypatch, case)
    h = approx.precision
    fresh = torch.linalg.cholesky(h)
    assert torch.equal(approx.cholesky(), fresh)  # cholesky_ex's factor (the check) is cholesky's, bit for bit
    assert torch.equal(approx.covariance(), torch.cholesky_inverse(fresh))
    # the draws, as the code before drew them: a fresh factor, L^-T eps
    eps = torch.randn(50, len(approx.active), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    before = approx.mean.double().expand(50, -1).clone()
    before[:, approx.active] += torch.linalg.solve_triangular(fresh.T, eps.T, upper=True).T
    assert torch.equal(approx.sample_flat(50, seed=0), before.to(approx.mean.dtype))
    flat = approx.potential.flatten(approx.potential.unconstrain(post.samples)).reshape(50, -1)
    assert torch.equal(flat, approx.sample_flat(50, seed=0).to(flat.dtype))  # bp.fit's draws are those (seed + 0)
    # their density, as the code before computed it (bnn_pyro/infer/_density.py): from a fresh factor
    r = flat.double()[:, approx.active] - approx.mean.double()[approx.active]
    log_q = 0.5 * (2.0 * fresh.diagonal().log().sum() - ((r @ fresh) ** 2).sum(-1)) - r.shape[-1] * HALF_LOG_2PI
    assert torch.equal(post.sample_stats["log_q"].reshape(-1), log_q.to(post.sample_stats["log_q"].dtype))
    g = torch.randn(len(approx.active), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.equal(log_evidence(1.5, g, h, chol=approx.cholesky()), log_evidence(1.5, g, h))


def test_a_replaced_precision_is_factorized_afresh(monkeypatch):
    """``dataclasses.replace(approx, precision=...)`` (benchmarks do it) must not reuse the old ``H``'s factor."""
    import dataclasses

    _, (approx,), _ = _spied_fit(monkeypatch, "function_full")
    moved = dataclasses.replace(approx, precision=approx.precision + 3.0 * torch.eye(len(approx.active)).double())
    assert torch.equal(moved.cholesky(), torch.linalg.cholesky(moved.precision))
    approx.precision = moved.precision  # an assignment too
    assert torch.equal(approx.cholesky(), torch.linalg.cholesky(moved.precision))


def test_a_precision_edited_in_place_is_factorized_afresh(monkeypatch):
    """An in-place edit of ``approx.precision`` (same tensor object, new values) must not reuse the old factor."""
    _, (approx,), _ = _spied_fit(monkeypatch, "function_full")
    kept = approx.cholesky().clone()
    approx.precision.mul_(2.0)
    assert torch.equal(approx.cholesky(), torch.linalg.cholesky(approx.precision))
    assert not torch.equal(approx.cholesky(), kept)
    approx.precision[0, 0] += 5.0  # an indexed in-place edit too
    assert torch.equal(approx.cholesky(), torch.linalg.cholesky(approx.precision))
    assert torch.equal(approx.covariance(), torch.cholesky_inverse(torch.linalg.cholesky(approx.precision)))


def _eigh_inputs(monkeypatch) -> list[torch.Tensor]:
    seen = []
    real = torch.linalg.eigh

    def spy(a, *args, **kwargs):
        seen.append(a.detach().clone())
        return real(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    return seen


def test_kron_eigendecomposes_each_factor_once(monkeypatch):
    """``structure="kron"`` with a bias prior wider than the weights' (each layer's block splits into a weight and a
    bias block when the prior is added) and a learned noise chosen on held-out rows (the prior added again at every
    noise candidate): each Kronecker precision the fit forms costs one eigendecomposition per factor, three per layer
    (``G``, shared by the two parts, and the parts' ``A``), however many candidates and draws use it. The code before
    redid the split blocks' at every noise candidate and ``G``'s once per part."""
    x, y = bp.datasets.toy_gap()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    prior = {"*.weight": dist.Normal(0.0, 1.0), "*.bias": dist.Normal(0.0, 3.0)}
    model = bp.BNN(net, prior=prior, likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))
    seen, formed = _eigh_inputs(monkeypatch), []
    real_kfac = curvature.kfac

    def kfac(*args, **kwargs):
        formed.append(real_kfac(*args, **kwargs))
        return formed[-1]

    monkeypatch.setattr(curvature, "kfac", kfac)
    post = bp.fit(model, x, y, method="laplace", structure="kron", num_steps=60, num_samples=20, progress=False)
    monkeypatch.undo()
    assert post.config["noise"]["selected_on"] == "validation"  # the held-out noise search ran
    assert all(len(k.blocks) == 2 for k in formed)  # two layers, each split in two by the prior
    # three precisions: the held-out fit's at the MAP's noise (its noise search) and at the chosen noise, and the
    # refit's (its search held the chosen noise: the curvature there is formed once, not again for the same point)
    assert len(formed) == 3 and len(seen) == 3 * 2 * len(formed), (len(seen), len(formed))


def test_newton_mode_stops_at_a_fixed_point_with_the_same_answer(monkeypatch):
    """:func:`newton_mode` on a logistic regression's ``U`` in float32: once a step leaves ``z`` unchanged (a nonzero
    step below float32's resolution) it stops, instead of recomputing the same Hessian and factor for every step left
    (51 Hessians here before; a Pyro function's Laplace fit allows 5 steps, ``check_typical`` 50). The answer is what
    running on gave: the point returned is a fixed point (a further step from it leaves it unchanged, so every step
    left would have), and the Hessian returned is the Hessian there."""
    from bnn_pyro.infer import _potential

    x = torch.randn(30, 3, generator=torch.Generator().manual_seed(0))
    y = (torch.randn(30, generator=torch.Generator().manual_seed(1)) > 0).float()

    def fn(z):
        f = x @ z
        return torch.nn.functional.softplus(f).sum() - y @ f + 0.5 * z @ z

    calls = []
    real = _potential.dense_precision

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_potential, "dense_precision", counted)
    z, hess = _potential.newton_mode(fn, torch.zeros(3), steps=50)
    assert len(calls) < 10, len(calls)  # a handful of steps to the mode, not 51 Hessians
    grad = torch.func.grad(fn)(z)
    assert float(grad.abs().max()) < 1e-5  # the mode
    calls.clear()
    again, hess_again = _potential.newton_mode(fn, z, steps=50)
    assert torch.equal(again, z) and len(calls) == 1  # a fixed point: one Hessian, and z unchanged
    assert torch.equal(hess, hess_again) and torch.equal(hess, real(fn, z)[0])  # the Hessian at z
