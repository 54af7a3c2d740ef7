"""Stochastic-gradient MCMC: ``bp.fit(model, x, y, method="sgld" | "sghmc" | "csgmcmc", ...)``.

All three methods move the latent sites ``z`` (unconstrained coordinates) with minibatch gradients
of the potential energy ``U~(z) = -log p(z) - (N / B) sum_{i in batch} log p(y_i | x_i, z)`` (Pyro's
own, log-Jacobians included; :class:`~bnn_pyro.infer._potential.Potential`), an unbiased estimate of
the full-data ``U``. They share one update, SGD with momentum plus Gaussian noise:

    v  <-  (1 - alpha) v  -  eta_t grad U~(z)  +  N(0, 2 alpha eta_t I)      (no noise: exploration)
    z  <-  z + v                                                          (v starts at 0)

``eta_t`` is the step on ``U`` and ``alpha`` (``friction``, in (0, 1]) the fraction of the momentum
removed per step (``1 - alpha`` is SGD's momentum).

- ``"sgld"``, Welling & Teh (2011), *Bayesian learning via stochastic gradient Langevin dynamics*,
  ICML: ``alpha = 1``, i.e. ``z <- z - eta grad U~(z) + N(0, 2 eta I)``, the Euler-Maruyama step of
  the Langevin diffusion ``dz = -grad U dt + sqrt(2) dW`` with time step ``eta``.
- ``"sghmc"``, Chen, Fox & Guestrin (2014), *Stochastic gradient Hamiltonian Monte Carlo*, ICML,
  eq. 15 with the gradient-noise estimate ``beta_hat = 0``: ``eta = eps^2 / m`` and
  ``alpha = eps C / m`` for the second-order Langevin dynamics with mass ``m``, friction ``C`` and
  time step ``eps``. Default ``friction=0.1``.
- ``"csgmcmc"``, Zhang, Li, Zhang, Chen & Wilson (2020), *Cyclical stochastic gradient MCMC for
  Bayesian deep learning*, ICLR: ``num_cycles`` cycles of ``K`` steps with the cosine step
  ``eta_k = eta / 2 (cos(pi k / K) + 1)``, ``k = 0..K-1``. The first fraction ``exploration`` (their
  ``beta``, default 0.8) of each cycle is the exploration stage, the update without noise (SGD with
  momentum: it moves to a mode); the rest is the sampling stage, the noisy update (cSGHMC with the
  default ``friction=0.1``; cSGLD with ``friction=1``). ``num_samples / num_cycles`` draws per cycle
  are taken every ``thin`` steps at the end of its sampling stage.

Step size. ``lr="auto"`` (the default) sets ``eta = f / lambda`` from ``lambda``, the largest
absolute eigenvalue of the Hessian of ``U~`` at the current point, found by power iteration (30
Hessian-vector products on the current minibatch, 10 from the last vector when re-estimated). For
sgld and sghmc ``f = (2 - alpha) / 4``, re-estimated every 100 warm-up steps (curvature grows as
the net fits, e.g. 10-fold when a learned noise scale falls from its prior median to the data's
noise) and frozen at the end of warm-up, so that the kept draws come from one homogeneous Markov
chain (ESS and R-hat apply as for any MCMC).
For csgmcmc the peak step uses ``f = (2 - alpha) / 2``, re-estimated at the start of every cycle and
every 100 steps of its exploration stage. A number ``lr`` instead fixes
``eta = lr / N``: ``lr`` is then the learning rate that SGD would use on the mean loss ``U / N``
(``schedule="polynomial"`` lets it decay as ``(1 + t / num_warmup)^-0.55``, Welling & Teh's
``a (b + t)^-gamma``). Why ``f``: for a Gaussian posterior with precision ``A`` the full-batch
recursion above is linear, stable for ``eta lambda_max(A) < 2 (2 - alpha)``, and its stationary law
is ``N(mean, (A (I - eta A / (2 (2 - alpha))))^-1)`` (SGLD: ``(A (I - eta A / 2))^-1``) instead of the
posterior ``N(mean, A^-1)``; the test suite checks this law exactly. The auto step stays 8 times
below the stability limit (curvature may grow after it is set) and widens the stiffest direction's
variance by at most 8/7, flatter directions less. Like every sampler without a Metropolis
correction these methods are biased by ``O(eta)``; minibatch gradient noise, not corrected
(``beta_hat = 0``), adds a further ``O(eta)`` widening. Mixing along flat directions takes about
``1 / (eta lambda_min)`` steps: on a BNN the chains explore a mode's neighbourhood, not the whole
posterior, so use several chains.

Stability guard (``lr="auto"``, noise-free steps only). An exploration stage is SGD with momentum at the
largest steps of the cycle, and a learned noise scale can fall fast there: on scikit-learn's diabetes (the
benchmarks/uci.py protocol, split 0) it fell from 0.91 to 0.53 in 65 steps, the curvature grew 3-fold before
the next estimate and the chain diverged at step 87. So each exploration step compares its step with the
curvature along its last move, ``|grad_t - grad_t-1| / |z_t - z_t-1|`` (free: the gradients are computed
anyway; on a quadratic it never exceeds ``lambda_max``, so the guard never fires there), and when
``eta_t`` times it exceeds ``2 f`` the curvature is re-estimated and the peak step lowered to ``f / lambda``.

Held-out rows (csgmcmc, ``validation=``; :mod:`bnn_pyro.infer.holdout`). Without noise, an exploration stage
runs to the joint mode of the weights and a learned noise, where an over-parameterized net fits the training
rows and the noise collapses to their residual (diabetes split 1: noise sd 0.15 in standardized units after
4 cycles, curvature 80 times its start, against 0.64 in the posterior; test log-likelihood -9.7 nats per point
and 95% coverage 0.46 where the other engines get about -5.5), and the short sampling stages at the cosine's
small steps cannot climb back out. By default, when the model has a learned Gaussian noise and 10% of the
rows make at least 20, those rows are held out: each exploration stage scores its state on them every
``SCORE_EVERY`` steps (noise profiled out) and the sampling stage starts from the best one (momentum reset;
``history["exploration_stop"]``: the step of each stage's best state), and the draws' noise is then chosen to
maximize the held-out log predictive density, as for the engines that start from a point fit. The chain
samples the other 90%. On diabetes splits 0-2 the default went from a divergence and -9.7 to -5.54 +- 0.05
(coverage 0.92; benchmarks/results/uci_diabetes.md). ``validation=None``: the previous behaviour.

Chains: ``num_chains`` independent runs, chain ``c`` seeded with ``seed + c`` (minibatch order and
noise from generators of its own), one after another, each in its own copy of the model
(:func:`~bnn_pyro.infer.driver.run_chains`; its steps run by :func:`~bnn_pyro.infer.driver.descend` with the
update as the optimizer :class:`~bnn_pyro.infer.sgmcmc_step.SGMCMC`). With ``init="reset"`` (the default for a
``BNN``) every chain starts from its own re-draw of the layers' initializers (``reset_parameters()``
under seed ``seed + c``); with ``init="prior"`` (the default for a Pyro function) from its own prior
draw, so that chains start apart and R-hat can flag chains that have not forgotten their start or
sit in different modes. With ``init="net"`` chain 0 starts from the net's weights and every other
chain from its own prior draw; any other ``init`` (``"median"``, a dict of site values, a
:class:`~bnn_pyro.Posterior`) starts every chain there (:mod:`bnn_pyro.infer._init`). Deterministic
parameters of a ``BNN`` stay fixed at chain 0's start (every chain's copy gets them), as in
:mod:`bnn_pyro.infer.mcmc`.

Per-draw statistics (``(chains, draws)``): ``lp`` (``-U~`` of the draw on its minibatch) and
``step_size`` (``eta_t``). History (``(chains, steps)``): ``potential`` (``U~`` at every step) and
``step_size``. A non-finite ``U~`` or gradient stops the fit with a ``FloatingPointError`` naming
the chain and the step: the chain diverged, so pass a smaller ``lr``. Each step costs one Pyro
potential evaluation and its gradient (2-4 ms for a 1-50-1 net on 80 points on one CPU core); the
defaults run 10,000 steps per chain.

Example
-------
>>> post = bp.fit(model, x, y, method="sghmc", num_chains=4, seed=0)
>>> post = bp.fit(model, x, y, method="csgmcmc", batch_size=32, num_cycles=8, num_samples=400)
>>> post.history["potential"]          # (chains, steps): U~ at every step
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from bnn_pyro._checks import choice, positive, positive_int
from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.checkpoint import StepCheckpoint, open_chains
from bnn_pyro.infer.driver import ChainInfo, ChainRun, assemble, descend, run_chains
from bnn_pyro.infer.holdout import (DEFAULT, BestOnHoldout, Holdout, describe, heldout_score, noise_site, select_noise,
                                    split)
from bnn_pyro.infer.sgmcmc_step import SGMCMC, Plan, largest_curvature
from bnn_pyro.posterior import Posterior

__all__ = ["fit_sgld", "fit_sghmc", "fit_csgmcmc", "Schedule", "Plan", "SGMCMC", "run_plan", "cosine_cycle"]


ADAPT_EVERY = 100  # lr="auto": steps between curvature estimates while the step may change
SCORE_EVERY = 50  # csgmcmc with held-out rows: exploration steps between held-out scores


def auto_fraction(friction: float) -> float:
    """``eta * lambda_max`` chosen by ``lr="auto"`` for sgld and sghmc: ``(2 - alpha) / 4``, at which
    the stiffest direction's stationary variance is 8/7 of the exact one (full batch; see the module
    docstring) and the step is 8 times below the stability limit ``2 (2 - alpha)``."""
    return (2.0 - friction) / 4.0


class Schedule(str, Enum):
    """Step-size schedules of ``"sgld"`` and ``"sghmc"`` (``"csgmcmc"`` is always cyclical)."""

    CONSTANT = "constant"  # one step size (stationary draws: ESS and R-hat apply as usual)
    POLYNOMIAL = "polynomial"  # times (1 + t / num_warmup)^-0.55 (Welling & Teh 2011's a (b + t)^-gamma)


# ---------------------------------------------------------------------- public engines
def fit_sgld(model, data: Data, *, lr: float | str = "auto", num_samples: int = 500, num_warmup: int | None = None,
             thin: int = 10, num_chains: int = 1, schedule: str = "constant", init=None, seed: int = 0,
             progress: bool = True,
             checkpoint: str | None = None, checkpoint_every: int | None = None, resume: bool = False) -> Posterior:
    """Stochastic gradient Langevin dynamics: ``z <- z - eta grad U~(z) + N(0, 2 eta I)``.

    Welling, M. & Teh, Y. W. (2011). Bayesian learning via stochastic gradient Langevin dynamics. ICML.
    See the module docstring for the shared update, the step size, chains and statistics.

    Parameters
    ----------
    lr:
        ``"auto"`` (default; see the module docstring) or the learning rate on the mean loss
        ``U / N``: the step on ``U`` is then ``eta = lr / N``.
    num_samples, num_warmup, thin:
        Draws kept per chain, burn-in steps before the first one (default ``num_samples * thin``),
        and steps between kept draws: ``num_warmup + num_samples * thin`` steps per chain.
    num_chains:
        Independent chains (seeds ``seed + c``); see the module docstring for their starting points.
    schedule:
        ``"constant"`` (default) or ``"polynomial"``: the step times ``(1 + t / num_warmup)^-0.55``.
    init:
        ``"reset"`` (default for a ``BNN``), ``"net"``, ``"prior"`` (default for a Pyro function),
        ``"median"``, a dict of site values or a ``Posterior`` (see the module docstring).
    seed, progress:
        Random seed, and a progress bar (``False``: off).
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps and after
        the last; ``resume=True`` continues each chain from its file, bit-identically (see
        :mod:`bnn_pyro.infer.checkpoint`).
    """
    plan, settings = _plan(lr, num_samples, num_warmup, thin, schedule, friction=1.0)
    return run_plan(model, data, plan, lr, "sgld", settings, num_chains, init, seed, progress,
                dict(folder=checkpoint, every=checkpoint_every, resume=resume))


def fit_sghmc(model, data: Data, *, lr: float | str = "auto", friction: float = 0.1, num_samples: int = 500,
              num_warmup: int | None = None, thin: int = 10, num_chains: int = 1, schedule: str = "constant",
              init=None, seed: int = 0, progress: bool = True,
              checkpoint: str | None = None, checkpoint_every: int | None = None, resume: bool = False) -> Posterior:
    """Stochastic gradient HMC: ``v <- (1 - alpha) v - eta grad U~(z) + N(0, 2 alpha eta I)``, ``z <- z + v``.

    Chen, T., Fox, E. B. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte Carlo. ICML
    (eq. 15 with ``beta_hat = 0``). ``friction`` is ``alpha`` in (0, 1] (default 0.1, i.e. SGD
    momentum 0.9; ``friction=1`` is SGLD). Other parameters as in :func:`fit_sgld`.
    """
    alpha = _fraction("friction", friction)
    plan, settings = _plan(lr, num_samples, num_warmup, thin, schedule, friction=alpha)
    return run_plan(model, data, plan, lr, "sghmc", settings, num_chains, init, seed, progress,
                dict(folder=checkpoint, every=checkpoint_every, resume=resume))


def fit_csgmcmc(model, data: Data, *, lr: float | str = "auto", num_cycles: int = 4, exploration: float = 0.8,
                num_samples: int = 200, thin: int = 10, friction: float = 0.1, num_chains: int = 1, init=None,
                validation="default", seed: int = 0, progress: bool = True,
                checkpoint: str | None = None, checkpoint_every: int | None = None, resume: bool = False) -> Posterior:
    """Cyclical SG-MCMC: cosine step-size cycles, each an exploration stage then a sampling stage.

    Zhang, R., Li, C., Zhang, J., Chen, C. & Wilson, A. G. (2020). Cyclical stochastic gradient MCMC
    for Bayesian deep learning. ICLR. Step ``k`` of a cycle of ``K`` steps is
    ``eta_k = eta / 2 (cos(pi k / K) + 1)``; steps with ``k / K < exploration`` run without noise.

    Parameters
    ----------
    lr:
        ``"auto"`` (default: the peak step ``eta`` is set at the start of every cycle, see the module
        docstring) or the peak learning rate on ``U / N`` (``eta = lr / N``).
    num_cycles, exploration:
        Number of cycles, and the fraction ``beta`` of each cycle spent exploring, in [0, 1).
    num_samples, thin:
        Draws per chain, ``num_samples / num_cycles`` per cycle (a multiple of ``num_cycles``), taken
        every ``thin`` steps at the end of the cycle. The sampling stage is exactly that long, so
        ``K = ceil(num_samples / num_cycles * thin / (1 - exploration))`` steps.
    friction:
        ``alpha``: the default 0.1 is cSGHMC with SGD momentum 0.9; 1 is cSGLD.
    validation:
        Held-out rows that stop each exploration stage early (:mod:`bnn_pyro.infer.holdout`): by default
        10% of the training rows when the model has a learned Gaussian noise (a ``BNN`` with
        ``Gaussian(scale=<prior>)``), the data are tensors and at least 20 rows would be held out; the same
        rows for every chain. See the module docstring. A fraction, an ``(x_val, y_val)`` pair (all rows
        are then sampled on), or ``None`` (no early stopping: the exploration stages run to the joint mode).
    num_chains, init, seed, progress, checkpoint, checkpoint_every, resume:
        As in :func:`fit_sgld`.
    """
    _check_lr(lr)
    num_cycles = positive_int("num_cycles", num_cycles)
    num_samples = positive_int("num_samples", num_samples)
    thin = positive_int("thin", thin)
    alpha = _fraction("friction", friction)
    if isinstance(exploration, bool) or not (isinstance(exploration, (int, float)) and 0.0 <= exploration < 1.0):
        raise ValueError(f"exploration must be a fraction in [0, 1), got {exploration!r}; try 0.8 (Zhang et al.).")
    if num_samples % num_cycles:
        nearest = num_cycles * max(1, num_samples // num_cycles)
        raise ValueError(f"num_samples ({num_samples}) must be a multiple of num_cycles ({num_cycles}): every cycle "
                         f"gives num_samples / num_cycles draws; try num_samples={nearest}.")
    sampling = num_samples // num_cycles * thin
    length = math.ceil(sampling / (1.0 - exploration) - 1e-9)  # 500 / (1 - 0.8) is 2500.0000000000005
    k = torch.arange(length, dtype=torch.float64)
    noisy = k >= length - sampling
    keep = noisy & ((length - 1 - k) % thin == 0)
    adapt = (k == 0) | (~noisy & (k % ADAPT_EVERY == 0))  # the start of a cycle, and while exploring
    plan = Plan(scale=cosine_cycle(length).repeat(num_cycles), noisy=noisy.repeat(num_cycles),
                keep=keep.repeat(num_cycles), adapt=adapt.repeat(num_cycles), friction=alpha,
                fraction=(2.0 - alpha) / 2.0)
    settings = dict(num_cycles=num_cycles, exploration=float(exploration), cycle_length=length, num_samples=num_samples,
                    thin=thin, friction=alpha)
    full = data
    if isinstance(validation, str) and validation == "default" and noise_site(model) is None:
        holdout, why = None, "no learned Gaussian noise (pass validation=0.1 to stop the exploration stages early)"
    else:
        data, holdout, why = split(full, validation, seed=seed, method="csgmcmc", convert=full.convert)
    settings["validation"] = describe(holdout, validation if validation != "default" else DEFAULT, why)
    return run_plan(model, data, plan, lr, "csgmcmc", settings, num_chains, init, seed, progress,
                    dict(folder=checkpoint, every=checkpoint_every, resume=resume), holdout=holdout, full=full)


# ---------------------------------------------------------------------- plans and checks
def cosine_cycle(length: int) -> torch.Tensor:
    """``(length,)`` float64 step multipliers of one cycle: ``(cos(pi k / K) + 1) / 2``, ``k = 0..K-1``
    (1 at the start, ``(1 - cos(pi / K)) / 2`` at the last step); csgmcmc and snapshot ensembles repeat it."""
    k = torch.arange(length, dtype=torch.float64)
    return (torch.cos(math.pi * k / length) + 1) / 2


def _check_lr(lr):
    if isinstance(lr, str):
        if lr != "auto":
            raise ValueError(f"lr: unknown value {lr!r}; pass 'auto' or a positive number (e.g. 1e-4).")
        return lr
    return positive("lr", lr)


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}; try 0.1 (SGD momentum 0.9) "
                         "or 1 (no momentum: SGLD).")
    return float(value)


def _plan(lr, num_samples, num_warmup, thin, schedule, *, friction: float) -> tuple[Plan, dict]:
    _check_lr(lr)
    num_samples = positive_int("num_samples", num_samples)
    thin = positive_int("thin", thin)
    num_warmup = positive_int("num_warmup", num_samples * thin if num_warmup is None else num_warmup,
                              allow_zero=True)
    kind = choice("schedule", schedule, Schedule)
    t = torch.arange(num_warmup + num_samples * thin, dtype=torch.float64)
    scale = torch.ones_like(t)
    if kind is Schedule.POLYNOMIAL:
        scale = (1 + t / max(num_warmup, 1)) ** -0.55
    keep = (t >= num_warmup) & ((t - num_warmup) % thin == thin - 1)
    adapt = (t <= num_warmup) & ((t % ADAPT_EVERY == 0) | (t == num_warmup))
    plan = Plan(scale=scale, noisy=torch.ones_like(t, dtype=torch.bool), keep=keep, adapt=adapt, friction=friction,
                fraction=auto_fraction(friction))
    return plan, dict(num_samples=num_samples, num_warmup=num_warmup, thin=thin, schedule=kind.value, friction=friction)


def _chain_init(init, chain: int):
    """Chain 0 starts at ``init``; with ``init="net"`` the other chains start at prior draws."""
    return "prior" if isinstance(init, str) and init == "net" and chain > 0 else init


# ---------------------------------------------------------------------- the sampler
def run_plan(model, data: Data, plan: Plan, lr, method: str, settings: dict, num_chains, init, seed,
             progress, checkpoint: dict, holdout: Holdout | None = None, full: Data | None = None) -> Posterior:
    """Run ``num_chains`` chains of ``plan`` (the shared update of the module docstring) and assemble the
    ``Posterior``; ``lr`` is ``"auto"`` or checked by the caller, ``settings`` go into ``post.config``,
    ``checkpoint`` is ``dict(folder=..., every=..., resume=...)``; ``holdout`` (rows held out of ``data``,
    ``full`` the whole set) scores csgmcmc's exploration stages and a snapshot ensemble's cycles. The engines here and snapshot ensembles
    (:mod:`bnn_pyro.infer.snapshot`) are plans run by it: chains by :func:`~bnn_pyro.infer.driver.run_chains`
    (each in its own copy of the model), their steps by :func:`~bnn_pyro.infer.driver.descend` with the
    :class:`SGMCMC` optimizer, the ``Posterior`` by :func:`~bnn_pyro.infer.driver.assemble`."""
    num_chains = positive_int("num_chains", num_chains)
    init = resolve_init(model, init, data)
    config = clean_config(dict(
        lr=lr, **settings, num_steps=len(plan.scale), num_chains=num_chains,
        init=init if isinstance(init, str) else type(init).__name__, batch_size=data.batch_size,
        dataset_size=data.size, seed=seed,
    ))
    ckpts = open_chains(checkpoint["folder"], every=checkpoint["every"], resume=checkpoint["resume"],
                        num_chains=num_chains, run=dict(method=method, **config))  # all checked before any chain runs

    def body(fitted, info: ChainInfo) -> ChainRun:
        return _run_chain(fitted, info, data=data, plan=plan, lr=lr, method=method, init=init, seed=seed,
                          progress=progress, ckpt=ckpts[info.index], holdout=holdout)

    post = assemble(run_chains(model, num_chains, seed, body, method=method), method=method, config=config,
                    data=data if full is None else full)
    return select_noise(post, holdout)


def _run_chain(fitted, info: ChainInfo, *, data: Data, plan: Plan, lr, method: str, init, seed: int, progress: bool,
               ckpt, holdout: Holdout | None) -> ChainRun:
    """One chain in its own copy ``fitted`` of the model: ``descend`` runs the plan's steps, :class:`SGMCMC`
    makes each update, :class:`_Chain` keeps the draws and records (and stops exploration stages early)."""
    if info.index > 0:  # the deterministic parameters of chain 0's start: they stay fixed (module docstring)
        chain_start(fitted, init, seed, points=True)
    pot = Potential(fitted, data, init=chain_start(fitted, _chain_init(init, info.index), info.seed,
                                                   points=info.index == 0))
    if pot.dim == 0:
        raise ValueError(f"{method}: the model has no latent sample sites, so there is nothing to sample; give "
                         "some parameters a prior (BNN(prior=..., bayesian=...)) or use method='svi'.")
    walk = _Chain(pot, plan, f"{method} chain {info.index}", data.size, fitted, holdout)
    walk.opt = SGMCMC([walk.z], plan=plan, lr=None if lr == "auto" else lr / data.size, seed=info.seed,
                      curvature=walk.curvature if lr == "auto" else None, fallback=1.0 / data.size)
    records = dict(potential=walk.potentials, step_size=walk.steps)
    descend(walk.objective, [walk.z], data, num_steps=len(plan.scale), lr=lr, seed=info.seed, method=method,
            desc=walk.name, progress=progress, quantity="potential energy", on_step=walk.on_step,
            after_step=walk.after_step, opt=walk.opt,
            resumable=None if ckpt is None else StepCheckpoint(ckpt, [walk.z], records, extra=walk))
    return walk.result(fitted, data)


class _Chain:
    """One chain's state outside the optimizer and the hooks :func:`~bnn_pyro.infer.driver.descend` calls: the
    potential ``U~`` of each step's minibatch (``objective``), the kept draws, the records ``potentials`` and
    ``steps``, the divergence stop, and csgmcmc's held-out early stopping of the exploration stages. As the
    checkpoint's ``extra`` state it saves the draws and the early-stopping state."""

    def __init__(self, pot: Potential, plan: Plan, name: str, size: int, model, holdout: Holdout | None):
        self.pot, self.plan, self.name, self.size, self.model, self.holdout = pot, plan, name, size, model, holdout
        self.z = pot.flatten(pot.init).detach().clone().requires_grad_(True)
        self.potentials = torch.empty(len(plan.scale), dtype=torch.float64)
        self.steps = torch.empty(len(plan.scale), dtype=torch.float64)
        self._keep, self._noisy = plan.keep.tolist(), plan.noisy.tolist()
        self.draws, self.stops, self.best = [], [], None
        self.opt, self.batch, self.t, self.u = None, None, 0, math.nan

    def curvature(self, z: torch.Tensor, start: torch.Tensor, iters: int):
        return largest_curvature(self.pot, z, self.batch, start, iters)

    def objective(self, batch, t: int):
        self.batch, self.t = batch, t
        if self.holdout is not None:
            self._early_stop(t)
        self.opt.adapt()
        u = self.pot(self.pot.unflatten(self.z), batch)
        self.u = float(u.detach())
        if not math.isfinite(self.u):
            raise self._diverged(self.opt.planned_step)
        if self._keep[t]:  # the state at the start of the step
            self.draws.append(self.z.detach().clone())
        return u, self.u

    def after_step(self) -> None:
        if not torch.isfinite(self.z.grad).all():
            raise self._diverged(self.opt.step_size)

    def on_step(self, t: int, u: float) -> None:
        self.potentials[t], self.steps[t] = u, self.opt.step_size

    def _diverged(self, step: float) -> FloatingPointError:
        return FloatingPointError(
            f"{self.name} diverged at step {self.t}: the potential energy or its gradient is not finite (U = "
            f"{self.u:.3g}, step size on U {step:.3g}). The step is too large for the curvature of the posterior; "
            f"pass a smaller lr, e.g. lr={step * self.size / 10:.3g} (the step on U is lr / N).")

    def _early_stop(self, t: int) -> None:
        """With held-out rows: score the states of a noise-free stage, and end the stage at its best one: csgmcmc's
        sampling stage starts from it (module docstring); a snapshot ensemble's snapshot is it (a noise-free kept
        step ends a cycle, :mod:`bnn_pyro.infer.snapshot`), and the next cycle starts from it."""
        noisy = self._noisy[t]
        snapshot = self._keep[t] and not noisy
        if not noisy and self.best is None:
            self.best = BestOnHoldout(every=SCORE_EVERY, patience=None)
        if self.best is None:
            return
        if noisy or snapshot or t % SCORE_EVERY == 0 or self.best.state is None:
            z = self.z.detach()
            self.best.record(t, heldout_score(self.model, self.pot.constrain(self.pot.unflatten(z)), self.holdout), [z])
        if noisy or snapshot:  # the stage has ended: go on from its best state
            if self.best.best_step != t:
                with torch.no_grad():
                    self.z.copy_(self.best.state[0])
                self.opt.restart()
            self.stops.append(self.best.best_step)
            self.best = None

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"draws": torch.stack(self.draws)} if self.draws else {}
        meta = {"stops": list(self.stops), "best": None}
        if self.best is not None:
            best, meta["best"] = self.best.state_dict()
            tensors.update({f"best/{k}": v for k, v in best.items()})
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.draws = list(tensors["draws"].clone()) if "draws" in tensors else []
        self.stops, self.best = list(meta["stops"]), None
        if meta["best"] is not None:
            self.best = BestOnHoldout(every=SCORE_EVERY, patience=None)
            self.best.load_state_dict({k[len("best/"):]: v for k, v in tensors.items() if k.startswith("best/")},
                                      meta["best"])

    def result(self, fitted, data: Data) -> ChainRun:
        samples = self.pot.constrain(self.pot.unflatten(torch.stack(self.draws)))
        history = dict(potential=self.potentials, step_size=self.steps)
        if self.holdout is not None:
            history["exploration_stop"] = torch.tensor(self.stops, dtype=torch.long)
        stats = dict(lp=-self.potentials[self.plan.keep], step_size=self.steps[self.plan.keep])
        return ChainRun(fitted, {k: v.detach().clone() for k, v in samples.items()},
                        point_values(fitted, *data.first(), data.size), history, stats)
