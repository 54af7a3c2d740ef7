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
noise from generators of its own), one after another. With ``init="reset"`` (the default for a
``BNN``) every chain starts from its own re-draw of the layers' initializers (``reset_parameters()``
under seed ``seed + c``); with ``init="prior"`` (the default for a Pyro function) from its own prior
draw, so that chains start apart and R-hat can flag chains that have not forgotten their start or
sit in different modes. With ``init="net"`` chain 0 starts from the net's weights and every other
chain from its own prior draw; any other ``init`` (``"median"``, a dict of site values, a
:class:`~bnn_pyro.Posterior`) starts every chain there (:mod:`bnn_pyro.infer._init`). Deterministic
parameters of a ``BNN`` stay fixed at chain 0's start, as in :mod:`bnn_pyro.infer.mcmc`.

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

import copy
import math
from dataclasses import dataclass
from enum import Enum

import pyro
import torch

from bnn_pyro._checks import choice, positive, positive_int
from bnn_pyro.infer._common import Data, clean_config, point_values, progress_bar
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.checkpoint import Checkpoint, restore_sgmcmc, save_sgmcmc
from bnn_pyro.infer.holdout import (DEFAULT, BestOnHoldout, Holdout, describe, heldout_score, noise_site, select_noise,
                                    split)
from bnn_pyro.posterior import Posterior

__all__ = ["fit_sgld", "fit_sghmc", "fit_csgmcmc", "Schedule", "Plan", "run_plan", "cosine_cycle"]


ADAPT_EVERY = 100  # lr="auto": steps between curvature estimates while the step may change
SCORE_EVERY = 50  # csgmcmc with held-out rows: exploration steps between held-out scores
GUARD = 2.0  # lr="auto", exploration: re-estimate the curvature when eta_t * (secant curvature) > GUARD * fraction


def auto_fraction(friction: float) -> float:
    """``eta * lambda_max`` chosen by ``lr="auto"`` for sgld and sghmc: ``(2 - alpha) / 4``, at which
    the stiffest direction's stationary variance is 8/7 of the exact one (full batch; see the module
    docstring) and the step is 8 times below the stability limit ``2 (2 - alpha)``."""
    return (2.0 - friction) / 4.0


class Schedule(str, Enum):
    """Step-size schedules of ``"sgld"`` and ``"sghmc"`` (``"csgmcmc"`` is always cyclical)."""

    CONSTANT = "constant"  # one step size (stationary draws: ESS and R-hat apply as usual)
    POLYNOMIAL = "polynomial"  # times (1 + t / num_warmup)^-0.55 (Welling & Teh 2011's a (b + t)^-gamma)


@dataclass(frozen=True)
class Plan:
    """Everything one chain does, step by step (``T`` steps).

    Attributes
    ----------
    scale:
        ``(T,)`` step-size multiplier: the step on ``U`` at step ``t`` is ``eta * scale[t]``.
    noisy:
        ``(T,)`` bool: add the Langevin noise at that step (False: exploration, i.e. SGD).
    keep:
        ``(T,)`` bool: store the state at the start of that step as a draw.
    adapt:
        ``(T,)`` bool: with ``lr="auto"``, set ``eta = fraction / lambda_max`` before that step.
    friction:
        ``alpha`` in (0, 1]: the fraction of the momentum removed per step (1: SGLD).
    fraction:
        ``eta * lambda_max`` that ``lr="auto"`` aims at.
    """

    scale: torch.Tensor
    noisy: torch.Tensor
    keep: torch.Tensor
    adapt: torch.Tensor
    friction: float
    fraction: float


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
    ``full`` the whole set) scores csgmcmc's exploration stages. The engines here and snapshot ensembles
    (:mod:`bnn_pyro.infer.snapshot`) are plans run by it."""
    num_chains = positive_int("num_chains", num_chains)
    folder = checkpoint.pop("folder")
    if folder is None and (checkpoint["every"] is not None or checkpoint["resume"]):
        raise ValueError("checkpoint_every= and resume= need checkpoint=FOLDER (the folder of the checkpoint files).")
    init = resolve_init(model, init, data)
    fitted = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    config = clean_config(dict(
        lr=lr, **settings, num_steps=len(plan.scale), num_chains=num_chains,
        init=init if isinstance(init, str) else type(init).__name__, batch_size=data.batch_size,
        dataset_size=data.size, seed=seed,
    ))
    ckpts = [None if folder is None else Checkpoint(folder, chain=c, run=dict(method=method, **config), **checkpoint)
             for c in range(num_chains)]  # all checked before any chain runs
    runs = []
    for chain in range(num_chains):
        with pyro.get_param_store().scope():
            pyro.set_rng_seed(seed + chain)
            # one copy for every chain: its deterministic parameters (fixed) come from chain 0's start
            pot = Potential(fitted, data, init=chain_start(fitted, _chain_init(init, chain), seed + chain,
                                                           points=chain == 0))
            if pot.dim == 0:
                raise ValueError(f"{method}: the model has no latent sample sites, so there is nothing to sample; give "
                                 "some parameters a prior (BNN(prior=..., bayesian=...)) or use method='svi'.")
            score = None if holdout is None else (
                lambda z, pot=pot: heldout_score(fitted, pot.constrain(pot.unflatten(z)), holdout))
            run = _run_chain(pot, data, plan, lr, seed + chain, f"{method} chain {chain}", progress, ckpts[chain],
                             score)
            run["point"] = point_values(fitted, *data.first(), data.size)
        runs.append(run)
    stack = lambda key: {n: torch.stack([r[key][n] for r in runs]) for n in runs[0][key]}  # noqa: E731
    full = data if full is None else full
    post = Posterior(samples=stack("samples"), model=fitted, method=method, config=config, point=stack("point"),
                     sample_stats=stack("stats"), history=stack("history"), x=full.x, y=full.y)
    return select_noise(post, holdout)


def _largest_curvature(pot: Potential, z: torch.Tensor, batch, start: torch.Tensor, iters: int):
    """``|lambda|_max`` of the Hessian of ``U`` at ``z`` on ``batch`` by power iteration on
    Hessian-vector products (double backward), started from ``start``; returns it and its vector."""
    z = z.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(pot(pot.unflatten(z), batch), z, create_graph=True)
    u, lam = start / start.norm(), 0.0
    for _ in range(iters):
        (hu,) = torch.autograd.grad(grad, z, u, retain_graph=True)
        lam = float(hu @ u)
        if not (math.isfinite(lam) and hu.norm() > 0):
            break
        u = hu.detach() / hu.norm()
    return abs(lam), u.detach()


def _run_chain(pot: Potential, data: Data, plan: Plan, lr, seed: int, name: str, progress: bool,
               ckpt: Checkpoint | None = None, score=None) -> dict:
    """One chain of the shared update (module docstring); returns draws, statistics and history.
    ``score(z)``: the held-out score of a state, which stops noise-free (exploration) stages early."""
    z = pot.flatten(pot.init).detach().clone()
    v = torch.zeros_like(z)
    batches = data.batches(torch.Generator().manual_seed(seed))
    noise_gen = torch.Generator(device=z.device).manual_seed(seed + 7919)  # apart from the batch stream
    direction = torch.randn(z.shape, generator=noise_gen, dtype=z.dtype, device=z.device)
    eta = None if lr == "auto" else lr / data.size
    alpha, num_steps = plan.friction, len(plan.scale)
    scale, keep, noisy, adapt = plan.scale.tolist(), plan.keep.tolist(), plan.noisy.tolist(), plan.adapt.tolist()
    draws, lps, stops = [], [], []
    potentials, steps = torch.empty(num_steps, dtype=torch.float64), torch.empty(num_steps, dtype=torch.float64)
    start, best, secant = 0, None, None
    if ckpt is not None:
        state = dict(noise_gen=noise_gen, potentials=potentials, steps=steps)
        start = restore_sgmcmc(ckpt, state)
        if start:
            z, v, direction, eta, draws, lps = (state[k] for k in ("z", "v", "direction", "eta", "draws", "lps"))
            best, stops = state.get("best"), state.get("stops", [])
    for _ in range(start):  # replay the minibatch stream up to the restored step
        next(batches)
    bar = progress_bar(num_steps, name, progress)
    bar.update(start)
    for t in range(start, num_steps):
        batch = next(batches)
        if score is not None:  # early stopping of the exploration stages on held-out rows
            if not noisy[t] and best is None:
                best = BestOnHoldout(every=SCORE_EVERY, patience=None)
            if best is not None and (noisy[t] or t % SCORE_EVERY == 0 or best.state is None):
                best.record(t, score(z), z)
            if best is not None and noisy[t]:  # the stage has ended: go on from its best state
                if best.best_step != t:
                    z, v, secant = best.state.clone(), torch.zeros_like(v), None
                stops.append(best.best_step)
                best = None
        if lr == "auto" and adapt[t]:
            lam, direction = _largest_curvature(pot, z, batch, direction, iters=30 if eta is None else 10)
            eta = plan.fraction / lam if lam > 0 else (eta or 1.0 / data.size)
        z.requires_grad_(True)
        u = pot(pot.unflatten(z), batch)
        (grad,) = torch.autograd.grad(u, z)
        z, u = z.detach(), float(u.detach())
        if lr == "auto" and not noisy[t]:  # stability guard of the noise-free stages (module docstring)
            if secant is not None and eta * scale[t] * _secant(z, grad, *secant) > GUARD * plan.fraction:
                lam, direction = _largest_curvature(pot, z, batch, direction, iters=10)
                eta = min(eta, plan.fraction / lam) if lam > 0 else eta
            secant = (z.clone(), grad.clone())
        else:
            secant = None
        step = eta * scale[t]
        if not (math.isfinite(u) and torch.isfinite(grad).all()):
            raise FloatingPointError(
                f"{name} diverged at step {t}: the potential energy or its gradient is not finite (U = {u:.3g}, "
                f"step size on U {step:.3g}). The step is too large for the curvature of the posterior; pass a "
                f"smaller lr, e.g. lr={step * data.size / 10:.3g} (the step on U is lr / N).")
        potentials[t], steps[t] = u, step
        if keep[t]:
            draws.append(z.clone())
            lps.append(-u)
        v.mul_(1.0 - alpha).add_(grad, alpha=-step)
        if noisy[t]:
            v.add_(torch.randn(z.shape, generator=noise_gen, dtype=z.dtype, device=z.device),
                   alpha=math.sqrt(2.0 * alpha * step))
        z.add_(v)
        if ckpt is not None and ckpt.due(t + 1, num_steps):
            save_sgmcmc(ckpt, t + 1, dict(z=z, v=v, direction=direction, eta=eta, draws=draws, lps=lps,
                                          noise_gen=noise_gen, potentials=potentials, steps=steps, best=best,
                                          stops=stops))
        if t % 100 == 99 or t == num_steps - 1:
            bar.update(t + 1 - bar.n)
    bar.close()
    samples = {k: val.detach().clone() for k, val in pot.constrain(pot.unflatten(torch.stack(draws))).items()}
    history = dict(potential=potentials, step_size=steps)
    if score is not None:
        history["exploration_stop"] = torch.tensor(stops, dtype=torch.long)
    return dict(samples=samples, stats=dict(lp=torch.tensor(lps, dtype=torch.float64), step_size=steps[plan.keep]),
                history=history)


def _secant(z: torch.Tensor, grad: torch.Tensor, z_prev: torch.Tensor, grad_prev: torch.Tensor) -> float:
    """``|grad - grad_prev| / |z - z_prev|``: the curvature along the last move (at most ``lambda_max``
    on a quadratic), free from the gradients already computed."""
    dz = (z - z_prev).norm()
    return float((grad - grad_prev).norm() / dz) if dz > 0 else 0.0
