"""Tests for bnn_pyro/infer/sgmcmc_step.py: the SG-MCMC update as a torch optimizer (its exact recursion on a
quadratic, its state_dict, its argument checks) and a resume that is bit-identical when the stability guard acts.

The engines' laws (the draws of sgld, sghmc and csgmcmc against the exact law of their discretization) are
tested in tests/infer/test_sgmcmc.py; this file tests the optimizer alone."""

from __future__ import annotations

import json
import math

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod
from bnn_pyro.infer import sgmcmc_step
from bnn_pyro.infer.sgmcmc_step import SGMCMC, Plan

A = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))  # U(z) = z^T A z / 2, gradient A z


def _plan(scale, noisy, adapt=None, friction=0.3) -> Plan:
    n = len(scale)
    return Plan(
        scale=torch.tensor(scale, dtype=torch.float64),
        noisy=torch.tensor(noisy),
        keep=torch.zeros(n, dtype=torch.bool),
        adapt=torch.tensor(adapt) if adapt is not None else torch.zeros(n, dtype=torch.bool),
        friction=friction,
        fraction=(2.0 - friction) / 2.0,
    )


def _run(opt: SGMCMC, z: torch.Tensor, steps: int) -> list[float]:
    """``steps`` optimizer steps on the quadratic; the step sizes used."""
    used = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        (0.5 * z @ A @ z).backward()
        opt.step()
        used.append(opt.step_size)
    return used


def test_one_step_is_momentum_sgd_plus_gaussian_noise_on_the_plans_step():
    """``v <- (1 - alpha) v - eta s_t grad + sqrt(2 alpha eta s_t) xi`` (xi only in noisy steps), ``z <- z + v``,
    with xi from the optimizer's own generator (seeded ``seed + 7919``; its first draw is the power iteration's
    start vector), written out here in plain tensor algebra."""
    plan = _plan([1.0, 0.5, 0.25, 1.0, 0.75], [False, True, True, False, True])
    z = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    opt = SGMCMC([z], plan=plan, lr=0.1, seed=4)
    used = _run(opt, z, 5)

    gen = torch.Generator().manual_seed(4 + 7919)
    torch.randn(3, generator=gen, dtype=torch.float64)  # the power iteration's start vector
    w, v, alpha = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 0.3
    for s, noisy in zip(plan.scale.tolist(), plan.noisy.tolist()):
        eta = 0.1 * s
        xi = torch.randn(3, generator=gen, dtype=torch.float64) if noisy else torch.zeros(3, dtype=torch.float64)
        v = (1 - alpha) * v - eta * (A @ w) + math.sqrt(2 * alpha * eta) * xi
        w = w + v
    torch.testing.assert_close(z.detach(), w, rtol=1e-13, atol=1e-13)
    assert used == pytest.approx([0.1 * s for s in plan.scale.tolist()], rel=1e-15)


def test_auto_step_and_guard_follow_the_curvature():
    """``lr=None``: before an ``adapt`` step ``eta = fraction / lambda_max`` (here exact: ``lambda_max = 3``);
    the guard of the noise-free steps calls the curvature once it has a previous point to compare with."""
    calls = []

    def curvature(z, start, iters):
        calls.append(iters)
        return 3.0, start

    plan = _plan([1.0] * 4, [False, False, True, True], adapt=[True, False, False, False], friction=0.1)
    z = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    opt = SGMCMC([z], plan=plan, lr=None, seed=0, curvature=curvature)
    used = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        (0.5 * z @ A @ z).backward()
        opt.adapt()
        opt.step()
        used.append(opt.step_size)
    assert used == pytest.approx([0.95 / 3.0] * 4, rel=1e-15)
    assert calls == [30]  # the secant curvature (at most 3 on this quadratic) keeps the guard quiet


@pytest.mark.parametrize("full_batch", [True, False])
def test_warm_up_guard_catches_curvature_that_outgrew_the_first_estimate_on_full_batch_gradients(full_batch):
    """sghmc's warm-up (noisy steps): the first estimate says lambda = 0.03 but U = 50 z^2 has curvature 100 (a
    learned noise that fell). eta * 100 = 3,167 times the aim: on full-batch gradients the guard sees the secant
    curvature 100 at the second step, re-estimates (100) and lowers eta to fraction / 100; between minibatches
    (``guard_noisy=False``) the secant is not trusted and the step stays until the next planned estimate."""
    estimates = iter([0.03] + [100.0] * 10)

    def curvature(z, start, iters):
        return next(estimates), start

    plan = sgmcmc_step.langevin_plan(num_warmup=20, num_samples=5, thin=1, polynomial=False, friction=0.1)
    z = torch.tensor([1e-3], dtype=torch.float64, requires_grad=True)
    opt = SGMCMC([z], plan=plan, lr=None, seed=0, curvature=curvature, guard_noisy=full_batch)
    used = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        (50.0 * z @ z).backward()
        opt.adapt()
        opt.step()
        used.append(opt.step_size)
    fraction = sgmcmc_step.auto_fraction(0.1)
    later = fraction / 100.0 if full_batch else fraction / 0.03  # the guard acts at the first step with a secant
    assert used == pytest.approx([fraction / 0.03, later, later])


def test_state_dict_round_trip_continues_exactly(monkeypatch):
    """Through the checkpoint's JSON + tensors encoding: eta, momentum, step index, the guard's last point and the
    noise generator come back, so 3 more steps from the restored optimizer equal 3 more steps of the original.
    The guard re-estimates at every noise-free step after another (``GUARD = 0``) and the curvature grows as ``z``
    shrinks, so that it lowers eta at steps 1, 2, 9 and 10 (step 9 needs the saved point of step 8)."""
    monkeypatch.setattr(sgmcmc_step, "GUARD", 0.0)
    plan = _plan([1.0, 0.5] * 6, [False, False, False, True] * 3, adapt=[True] + [False] * 11)

    def curvature(z, start, iters):
        return 3.0 + 1.0 / float(z.detach().abs().sum()), start

    z = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    opt = SGMCMC([z], plan=plan, lr=None, seed=1, curvature=curvature)
    opt.adapt()
    _run(opt, z, 9)
    tensors = {}
    saved = json.loads(json.dumps(ckpt_mod.flatten_state("optimizer", opt.state_dict(), tensors)))
    tensors = {k: v.clone() for k, v in tensors.items()}  # state_dict() holds references (checkpoint.write copies)
    z_saved, eta_saved = z.detach().clone(), opt.param_groups[0]["eta"]
    first = _run(opt, z, 3)
    assert eta_saved > first[0] / 0.5 > first[1] / 1.0  # the guard lowered eta at steps 9 and 10 (scales 0.5, 1)

    z2 = z_saved.clone().requires_grad_(True)
    other = SGMCMC([z2], plan=plan, lr=0.5, seed=99, curvature=curvature)  # its own eta and generator: overwritten
    other.load_state_dict(ckpt_mod.unflatten_state(saved, tensors))
    second = _run(other, z2, 3)
    assert torch.equal(z2.detach(), z.detach()) and first == second


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(params="two"), r"one flat tensor: pass params=\[z\]"),
        (dict(lr=None), r"lr=None .* needs curvature="),
        (dict(lr=None, curvature=lambda z, s, i: (1.0, s), first_adapt=False), r"plan whose first step estimates it"),
    ],
)
def test_bad_arguments(kwargs, match):
    z = torch.zeros(3, requires_grad=True)
    params = [z, torch.zeros(2, requires_grad=True)] if kwargs.pop("params", None) else [z]
    plan = _plan([1.0], [True], adapt=[kwargs.pop("first_adapt", True)])
    with pytest.raises(ValueError, match=match):
        SGMCMC(params, plan=plan, seed=0, **{"lr": 0.1, **kwargs})


def test_resume_where_the_stability_guard_acts_is_bit_identical(crash_and_resume, monkeypatch):
    """The guard's last point and gradient are part of the checkpoint. With the guard made to act at every
    noise-free step (``GUARD = 0``), a snapshot run (learned noise, minibatches) that dies after its checkpoint at
    step 12 resumes exactly; without that state the resumed run skipped the guard at step 12 and its step sizes
    differed from step 12 on (by 1.5e-4 in this run, measured on the code before this test)."""
    monkeypatch.setattr(sgmcmc_step, "GUARD", 0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 1, generator=g) * 4 - 2
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(40, generator=g)

    def model():
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        return bp.BNN(
            net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(0.5))
        )

    config = dict(method="snapshot", num_cycles=3, cycle_length=15, batch_size=8, seed=3, progress=False)
    whole = bp.fit(model(), x, y, **config)

    def kept_step_12(folder):  # the save of step 13 died: 12 was kept
        assert ckpt_mod.read(folder / "chain0.ckpt")[1]["step"] == 12

    fit = lambda **extra: bp.fit(model(), x, y, **extra, **config)  # noqa: E731
    crash_and_resume(fit, whole, crash_at=13, every=1, after_crash=kept_step_12)


def test_a_checkpoint_of_another_layout_is_refused_by_name(tmp_path):
    """A chain file without the optimized tensor and optimizer state (the SG-MCMC layout before these engines ran
    on the driver: position ``z``, momentum ``v``, ``eta``) is refused with advice, not a KeyError."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(30, 1, generator=g)
    y = x[:, 0] + 0.1 * torch.randn(30, generator=g)

    def fit(**extra):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(1, 1))
        model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
        return bp.fit(
            model,
            x,
            y,
            method="sgld",
            num_warmup=2,
            num_samples=2,
            thin=1,
            seed=0,
            progress=False,
            checkpoint=tmp_path,
            **extra,
        )

    fit()
    tensors, meta = ckpt_mod.read(tmp_path / "chain0.ckpt")
    old = {("z" if k == "param/0" else k): v for k, v in tensors.items() if not k.startswith("optimizer/")}
    ckpt_mod.write(tmp_path / "chain0.ckpt", old, {k: v for k, v in meta.items() if k != "optimizer"})
    with pytest.raises(ckpt_mod.CheckpointError, match=r"chain0.ckpt.*another bnn_pyro version.*delete it"):
        fit(resume=True)
