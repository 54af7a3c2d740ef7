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
(``lr_schedule="polynomial"`` lets it decay as ``(1 + t / num_warmup)^-0.55``, Welling & Teh's
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

Stability guard (``lr="auto"``: noise-free steps, and sgld's and sghmc's warm-up steps on full-batch
gradients). An exploration stage is SGD with momentum at the largest steps of the cycle, and a learned noise scale
can fall fast there: the curvature, which grows as ``1 / sigma^2``, can outgrow the last estimate before the next one,
and the chain diverges. So each exploration step compares its step with the curvature along its last move,
``|grad_t - grad_t-1| / |z_t - z_t-1|`` (free: the gradients are computed anyway; on a quadratic it never exceeds
``lambda_max``, so the guard never fires there), and when ``eta_t`` times it exceeds ``2 f`` the curvature is
re-estimated and the peak step lowered to ``f / lambda``. sgld's and sghmc's warm-up has the same hazard between its
estimates 100 steps apart (the step is set at the start, where the net has not fitted and a learned noise sits at its
prior's scale, and the curvature grows as ``1 / sigma^2`` while the noise falls), so the guard runs in their warm-up
steps too when the gradients are full-batch (the default; between minibatches the secant measures gradient noise,
not curvature). The draws after warm-up keep one step. The guard catches curvature that grows; a curvature that has
collapsed is the opposite hazard, and a re-estimate may raise the step at most ``RISE = 2`` times over the step it
replaces (falls are taken at once), so a larger step needs later estimates to confirm it. Why: the estimate is local.
A net that fits separable classes drives the softmax to saturation, where the likelihood's curvature is about
``exp(-margin)`` and only the prior's is left, so a step set there is far too large once the first step leaves the flat
region, where the curvature comes back. The runs that showed each hazard (diabetes, make_friedman1, wine) are in
``docs/sgmcmc_measurements.md``. Should a chain still diverge under ``lr="auto"`` it recovers: it goes back to its
last finite state with a step 4 times smaller (at most 8 times), the fit warns, and
``post.config["divergence_recovery"]`` lists the steps and the smaller step sizes
(:meth:`~bnn_pyro.infer.sgmcmc_step.SGMCMC.recover`). A number ``lr`` is the user's: a divergence stops the
fit with an error that suggests a smaller one.

Pyro functions (sgld, sghmc, csgmcmc; :mod:`bnn_pyro.infer.sg_metric`). On a small plain Pyro function (tensor
data, no ``pyro.param`` sites, at most 2,000 latent coordinates) under ``lr="auto"``, the chains run in the
coordinates whitened by the Hessian at the mode of ``U``, ``u = L^T z`` with
``L L^T = H``: the update above on ``u``, i.e. ``z`` moves by ``-eta M grad U~`` plus noise ``N(0, 2 alpha eta M)``,
``M = H^{-1}``, preconditioned SG-HMC with a constant metric, whose stationary law is still the posterior up to the
same ``O(eta)`` bias. Why: in the raw coordinates the flat direction of a posterior with condition number ``kappa``
mixes in about ``kappa`` steps, and the reference posteriors whose covariates lie near 40 and 100 are conditioned so
badly that the raw draws stayed far from the posterior, where the whitened ones match it (the reference suite's figures:
``docs/sgmcmc_measurements.md``).
``lr="auto"`` measures the curvature in ``u`` (about 1 near the mode), so sgld's and sghmc's step is about
``(2 - alpha) / 4`` whatever ``kappa``, and on a Gaussian posterior their stationary law is the posterior with every sd
widened by ``sqrt(8/7)`` (the law above with ``A = I``). Where they start, with the default ``init``: csgmcmc at the
mode (its exploration stages descend, and a prior draw of kidiq diverged); sgld and sghmc, which have no such stage,
each chain at its own draw from ``N(mode, 4 H^{-1})`` (:func:`~bnn_pyro.infer.sg_metric.dispersed_start`), the
Laplace approximation widened 2-fold in sd: over-dispersed starts, so that R-hat can flag chains that have not
forgotten them (Gelman & Rubin 1992), near enough to the mode for the metric's curvature to hold. With a given
``init`` every method starts there, still whitened (sgld and sghmc before and after: ``docs/sgmcmc_measurements.md``).
A ``BNN`` fit is unchanged (no metric).
The mode and the metric are computed once per fit, before the chains (:func:`fit_metric`: its prior-median start
under a seed of its own, so the metric is deterministic in ``seed`` and the same for every chain), shared by every
chain and by the refit on all rows after held-out rows chose the stops (it replays that fit, so it keeps its metric
and start), and recorded once: ``config["preconditioner"]``, ``config["preconditioner_damping"]`` (``d`` of
:func:`~bnn_pyro.infer.sg_metric.mode_metric`) and ``config["start"]``, which are also in each checkpoint's run
record. A checkpoint whose run record names no preconditioner (written unwhitened, or whitened by a metric searched
per chain) is refused on resume (:func:`refuse_unwhitened`): continuing it whitened would change its chains' update
mid-run.

Held-out rows (csgmcmc, ``validation=``; :mod:`bnn_pyro.infer.holdout`). Without noise, an exploration stage
runs to the joint mode of the weights and a learned noise, where an over-parameterized net fits the training
rows and the noise collapses to their residual (the curvature grows many-fold, the noise ends far below the
posterior's and the predictive is overconfident), and the short sampling stages at the cosine's
small steps cannot climb back out. By default, when the model has a learned Gaussian noise and 10% of the
rows make at least 20, those rows are held out: each exploration stage scores its state on them every
``SCORE_EVERY`` steps (noise profiled out) and the sampling stage starts from the best one (momentum reset;
``history["exploration_stop"]``: the step of each stage's best state), and the draws' noise is then chosen to
maximize the held-out log predictive density, as for the engines that start from a point fit. The chain
samples the other 90%. The diabetes runs without and with the held-out rows: ``docs/sgmcmc_measurements.md``.
``validation=None``: the previous behaviour.

Chains: ``num_chains`` independent runs, chain ``c`` seeded with ``seed + c`` (minibatch order and
noise from generators of its own), one after another, each in its own copy of the model
(:func:`~bnn_pyro.infer.contract.drive` runs :func:`sgmcmc_engine`, whose update is the optimizer
:class:`~bnn_pyro.infer.sgmcmc_step.SGMCMC`). With ``init="reset"`` (the default for a
``BNN``) every chain starts from its own re-draw of the layers' initializers (``reset_parameters()``
under seed ``seed + c``); with ``init="prior"`` (the default for a Pyro function) from its own prior
draw, so that chains start apart and R-hat can flag chains that have not forgotten their start or
sit in different modes (on a small Pyro function under ``lr="auto"`` with the default ``init``, csgmcmc starts every
chain at the mode instead, where the metric's curvature holds, and its chains part by their noise, so R-hat no longer
tests forgetting an overdispersed start; sgld and sghmc start each chain at its own draw from ``N(mode, 4 H^{-1})``,
over-dispersed and near the mode: see "Pyro functions"). With ``init="net"`` chain 0 starts from the net's weights and every other
chain from its own prior draw; any other ``init`` (``"median"``, a dict of site values, a
:class:`~bnn_pyro.Posterior`) starts every chain there (:mod:`bnn_pyro.infer._init`). Deterministic
parameters of a ``BNN`` stay fixed at chain 0's start (every chain's copy gets them), as in
:mod:`bnn_pyro.infer.mcmc`.

Per-draw statistics (``(chains, draws)``): ``lp`` (``-U~`` of the draw on its minibatch) and
``step_size`` (``eta_t``). History (``(chains, steps)``): ``potential`` (``U~`` at every step) and
``step_size``. A non-finite ``U~`` or gradient stops the fit with a ``FloatingPointError`` naming
the chain and the step: the chain diverged, so pass a smaller ``lr``. Each step costs one Pyro
potential evaluation and its gradient (measured: ``benchmarks/results/docstring_figures/results.md``); the
defaults run 10,000 steps per chain.

Example
-------
>>> post = bp.fit(model, x, y, method="sghmc", num_chains=4, seed=0)
>>> post = bp.fit(model, x, y, method="csgmcmc", batch_size=32, num_cycles=8, num_samples=400)
>>> post.history["potential"]          # (chains, steps): U~ at every step
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar, NamedTuple

import torch

from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init, set_points
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.anchor import weighted
from bnn_pyro.infer.checkpoint import CheckpointError, StepCheckpoint, open_chains, read
from bnn_pyro.infer.contract import Engine, Loop, PotentialRunOptions, drive, entry
from bnn_pyro.infer.driver import ChainInfo, ChainRun, chain
from bnn_pyro.infer.health_mixing import check_mixing
from bnn_pyro.infer.health_spread import check_descent
from bnn_pyro.infer.holdout import (
    DEFAULT,
    BestOnHoldout,
    Holdout,
    describe,
    heldout_score,
    noise_site,
    refit,
    refit_config,
    select_noise,
    split,
)
from bnn_pyro.infer.map_fit import estimate_points
from bnn_pyro.infer.sg_metric import Metric, dispersed_start, mode_metric
from bnn_pyro.infer.sgmcmc_step import (
    SGMCMC,
    SHRINK,
    Plan,
    check_friction,  # noqa: F401
    check_lr,
    cosine_cycle,
    cyclical_plan,
    langevin_plan,
    largest_curvature,
)
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, positive_int
from bnn_pyro.utils.user_warnings import warn

__all__ = [
    "fit_sgld",
    "fit_sghmc",
    "fit_csgmcmc",
    "Schedule",
    "Plan",
    "SGMCMC",
    "run_plan",
    "cosine_cycle",
    "SGLDConfig",
    "SGHMCConfig",
    "CSGMCMCConfig",
    "SGOptions",
    "SGInfo",
]


SCORE_EVERY = 50  # csgmcmc with held-out rows: exploration steps between held-out scores


class Schedule(str, Enum):
    """Step-size schedules of ``"sgld"`` and ``"sghmc"`` (``"csgmcmc"`` is always cyclical)."""

    CONSTANT = "constant"  # one step size (stationary draws: ESS and R-hat apply as usual)
    POLYNOMIAL = "polynomial"  # times (1 + t / num_warmup)^-0.55 (Welling & Teh 2011's a (b + t)^-gamma)


# ---------------------------------------------------------------------- options (frozen, checked by bp.fit)
@dataclass(frozen=True)
class SGOptions(PotentialRunOptions):
    """The options every SG-MCMC method and snapshot ensembles take (see :func:`fit_sgld`)."""

    REFUSED: ClassVar[dict[str, str]] = {
        "optimizer": "does not apply: the update is the sampler's own (Langevin or SGHMC step on U); choose its step "
        "with lr= (bnn_pyro.infer.optim says what lr means).",
        "lr_schedule": "does not apply: csgmcmc and snapshot follow their built-in cyclical cosine (num_cycles=, "
        "and exploration= for csgmcmc); lr= sets its peak.",
    }

    lr: float | str = "auto"
    num_chains: int = 1
    init: object = None


@dataclass(frozen=True)
class SGLDConfig(SGOptions):
    """The options of ``method="sgld"`` and their defaults (see :func:`fit_sgld`)."""

    REFUSED: ClassVar[dict[str, str]] = {"optimizer": SGOptions.REFUSED["optimizer"]}
    RENAMED: ClassVar[dict[str, str]] = {"schedule": "lr_schedule"}  # deprecated alias, one release (contract.entry)

    num_samples: int = 500
    num_warmup: int | None = None
    thin: int = 10
    lr_schedule: str = "constant"


@dataclass(frozen=True)
class SGHMCConfig(SGLDConfig):
    """The options of ``method="sghmc"``: those of sgld and ``friction`` (see :func:`fit_sghmc`)."""

    friction: float = 0.1


@dataclass(frozen=True)
class CSGMCMCConfig(SGOptions):
    """The options of ``method="csgmcmc"`` and their defaults (see :func:`fit_csgmcmc`)."""

    num_cycles: int = 4
    exploration: float = 0.8
    num_samples: int = 200
    thin: int = 10
    friction: float = 0.1
    validation: object = "default"


class SGInfo(NamedTuple):
    """What a step records (``post.history``): the potential energy ``U~`` of the state entering the step on
    its minibatch, and the step size ``eta_t`` on ``U`` that the update took."""

    potential: float
    step_size: float


# ---------------------------------------------------------------------- public engines
@entry(SGLDConfig)
def fit_sgld(model, data: Data, cfg: SGLDConfig) -> Posterior:
    """Stochastic gradient Langevin dynamics: ``z <- z - eta grad U~(z) + N(0, 2 eta I)``.

    Welling, M. & Teh, Y. W. (2011). Bayesian learning via stochastic gradient Langevin dynamics. ICML.
    See the module docstring for the shared update, the step size, chains and statistics. On a small Pyro function
    under ``lr="auto"`` the update is preconditioned by ``M = H^{-1}``, the inverse Hessian at the mode,
    ``z <- z - eta M grad U~(z) + N(0, 2 eta M)``, and each chain starts at a draw from ``N(mode, 4 H^{-1})`` (module
    docstring, "Pyro functions"): a badly conditioned posterior (a covariate near 100) mixes as a well-conditioned one.

    Parameters
    ----------
    lr:
        ``"auto"`` (default; see the module docstring) or the learning rate on the mean loss
        ``U / N``: the step on ``U`` is then ``eta = lr / N`` (as stated for every engine in
        :mod:`bnn_pyro.infer.optim`).
    num_samples, num_warmup, thin:
        Draws kept per chain, burn-in steps before the first one (default ``num_samples * thin``),
        and steps between kept draws: ``num_warmup + num_samples * thin`` steps per chain.
    num_chains:
        Independent chains (seeds ``seed + c``); see the module docstring for their starting points.
    lr_schedule:
        ``"constant"`` (default: one step size, so that the kept draws form one stationary Markov chain whose ESS
        and R-hat mean what they do for any MCMC) or ``"polynomial"``: the step times ``(1 + t / num_warmup)^-0.55``
        (Welling & Teh 2011). Formerly ``schedule``, still taken with a ``FutureWarning``. The optimizing
        engines' ``"cosine"`` default (:mod:`bnn_pyro.infer.optim`) is not offered: a step annealed to 1% freezes
        a sampler's chain.
    init:
        ``"reset"`` (default for a ``BNN``), ``"net"``, ``"prior"`` (default for a Pyro function),
        ``"median"``, a dict of site values or a ``Posterior`` (see the module docstring).
    seed, progress:
        Random seed, and a progress bar (``False``: off).
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps and after
        the last; ``resume=True`` continues each chain from its file, bit-identically (see
        :mod:`bnn_pyro.infer.checkpoint`); a whitened run refuses a file that names no preconditioner (module
        docstring, "Pyro functions").
    fast_path:
        ``True`` (default): the potential is evaluated without tracing Pyro where the model allows it
        (:class:`~bnn_pyro.infer._potential.Potential`; same values); ``False`` forces Pyro's traced potential.
        ``config["fast_path"]`` says which ran, ``config["potential"]`` the path.
    """
    plan, settings = _plan(cfg, model, friction=1.0)
    return _checked(run_plan(model, data, plan, "sgld", settings, cfg, metric=fit_metric(model, data, plan, cfg)))


@entry(SGHMCConfig)
def fit_sghmc(model, data: Data, cfg: SGHMCConfig) -> Posterior:
    """Stochastic gradient HMC: ``v <- (1 - alpha) v - eta grad U~(z) + N(0, 2 alpha eta I)``, ``z <- z + v``.

    Chen, T., Fox, E. B. & Guestrin, C. (2014). Stochastic gradient Hamiltonian Monte Carlo. ICML
    (eq. 15 with ``beta_hat = 0``). ``friction`` is ``alpha`` in (0, 1] (default 0.1, i.e. SGD
    momentum 0.9; ``friction=1`` is SGLD). Other parameters as in :func:`fit_sgld`. On a small Pyro function under
    ``lr="auto"`` the momentum, friction and noise live in the coordinates whitened by the Hessian at the mode,
    ``u = L^T z`` (``L L^T = H``), i.e. the noise is ``N(0, 2 alpha eta M)`` in ``z`` with ``M = H^{-1}``, and each chain
    starts at a draw from ``N(mode, 4 H^{-1})``, as :func:`fit_sgld`.
    """
    plan, settings = _plan(cfg, model, friction=check_friction("friction", cfg.friction))
    return _checked(run_plan(model, data, plan, "sghmc", settings, cfg, metric=fit_metric(model, data, plan, cfg)))


@entry(CSGMCMCConfig)
def fit_csgmcmc(model, data: Data, cfg: CSGMCMCConfig) -> Posterior:
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
        ``Gaussian(scale=<prior>)``), the data are tensors of at least 40 rows (then at least 20 rows are held out); the same
        rows for every chain. See the module docstring. A fraction, an ``(x_val, y_val)`` pair (all rows
        are then sampled on), or ``None`` (no early stopping: the exploration stages run to the joint mode).
    num_chains, init, seed, progress, checkpoint, checkpoint_every, resume, fast_path:
        As in :func:`fit_sgld`.
    """
    check_lr(cfg.lr)
    num_cycles = positive_int("num_cycles", cfg.num_cycles)
    num_samples = positive_int("num_samples", cfg.num_samples)
    thin = positive_int("thin", cfg.thin)
    alpha, exploration, validation = check_friction("friction", cfg.friction), cfg.exploration, cfg.validation
    if isinstance(exploration, bool) or not (isinstance(exploration, (int, float)) and 0.0 <= exploration < 1.0):
        raise ValueError(f"exploration must be a fraction in [0, 1), got {exploration!r}; try 0.8 (Zhang et al.).")
    if num_samples % num_cycles:
        nearest = num_cycles * max(1, num_samples // num_cycles)
        raise ValueError(
            f"num_samples ({num_samples}) must be a multiple of num_cycles ({num_cycles}): every cycle "
            f"gives num_samples / num_cycles draws; try num_samples={nearest}."
        )
    plan = cyclical_plan(num_cycles, num_samples, thin, exploration, alpha)
    if not isinstance(model, BNN):  # a Pyro function: whitened cycles from its mode (sg_metric; module docstring)
        plan = replace(plan, metric="mode" if cfg.init is None else "start")
    settings = dict(
        num_cycles=num_cycles,
        exploration=float(exploration),
        cycle_length=len(plan.scale) // num_cycles,
        num_samples=num_samples,
        thin=thin,
        friction=alpha,
    )
    full = data
    if isinstance(validation, str) and validation == "default" and noise_site(model) is None:
        holdout, why = None, "no learned Gaussian noise (pass validation=0.1 to stop the exploration stages early)"
    else:
        data, holdout, why = split(full, validation, seed=cfg.seed, method="csgmcmc", convert=full.convert, model=model)
    settings["validation"] = describe(holdout, validation if validation != "default" else DEFAULT, why)
    metric = fit_metric(model, data, plan, cfg)  # once per fit: every chain's, and the refit's
    post = run_plan(model, data, plan, "csgmcmc", settings, cfg, holdout=holdout, full=full, metric=metric)
    # then every row, each exploration stage stopped where the held-out rows stopped it (holdout.refit): the whole
    # plan reruns, so each stop falls in the cyclical schedule that chose it (no Horizon needed)
    return _checked(
        refit(
            post,
            lambda chosen: run_plan(
                model, full, plan, "csgmcmc", settings, refit_config(cfg), stops=chosen.stops, metric=metric
            ),
        )
    )


def _checked(post: Posterior) -> Posterior:
    """``post`` after the health checks of a finished SG-MCMC fit: a diverged chain (its potential ended above its
    start) and the mixing of its draws (ESS, and R-hat with several chains: they are Markov chains, as MCMC's; on
    kidiq's badly scaled covariates SGLD's and SG-HMC's draws were off the exact posterior with nothing said)."""
    check_descent(post)
    classifier = getattr(getattr(post.model, "likelihood", None), "task", None) == "classification"
    check_mixing(post, advice=mixing_advice(post.num_chains, classifier=classifier))
    return post


MIXING_ADVICE = (
    "Such estimates were right about f in the SG-MCMC measurements: over independent seeds the posterior mean of f "
    "varied as its ESS said (docs/sgmcmc_measurements.md, 'Mixing').{classifier} Each chain adds its own effective "
    "draws: try num_chains={suggested} (now {chains}; {factor:g} times the steps, and R-hat then checks that the "
    "chains agree), or a longer run (more num_samples at the same thin: the ESS grows with the steps), or "
    "method='nuts' on a model this small"
)
"""What :func:`_checked`'s mixing warning tells an SG-MCMC fit to try (``{chains}``: the fit's ``num_chains``;
``{suggested}``, ``{factor}``: :func:`mixing_advice`'s; ``{classifier}``: :data:`CLASSIFIER_NOTE` for a
classifier, else empty). Measured figures stay in ``docs/sgmcmc_measurements.md``, cited by path."""


def mixing_advice(chains: int, *, classifier: bool) -> str:
    """:data:`MIXING_ADVICE` for a fit of ``chains`` chains: it suggests ``max(4, 2 * chains)`` chains (at least 4,
    the fewest R-hat checks well; at least twice the fit's, so the suggestion always adds effective draws, which
    grow in proportion to the chains), and says how many times the steps that costs."""
    suggested = max(4, 2 * chains)
    return MIXING_ADVICE.format(
        suggested=suggested,
        chains=chains,
        factor=suggested / chains,
        classifier=CLASSIFIER_NOTE if classifier else "",
    )


CLASSIFIER_NOTE = (
    " The predictive probabilities' Monte Carlo error is smaller than f's (the slow directions move logits where "
    "the softmax saturates; measured in the same section), so a classifier's predictions can be usable while f has "
    "not mixed."
)
"""Said to classifiers: the slow directions move logits where the softmax is saturated (measured there)."""


def _plan(cfg: SGLDConfig, model, *, friction: float) -> tuple[Plan, dict]:
    """sgld's and sghmc's :class:`Plan` and its settings; on a Pyro function (never a ``BNN``) the whitened update
    started at an over-dispersed Laplace draw (``init`` left at its default) or at ``init``'s start (module
    docstring, "Pyro functions")."""
    check_lr(cfg.lr)
    num_samples = positive_int("num_samples", cfg.num_samples)
    thin = positive_int("thin", cfg.thin)
    num_warmup = positive_int(
        "num_warmup", num_samples * thin if cfg.num_warmup is None else cfg.num_warmup, allow_zero=True
    )
    kind = choice("lr_schedule", cfg.lr_schedule, Schedule)
    plan = langevin_plan(num_warmup, num_samples, thin, kind is Schedule.POLYNOMIAL, friction)
    if not isinstance(model, BNN):  # a Pyro function: whitened by the curvature at its mode (sg_metric)
        plan = replace(plan, metric="dispersed" if cfg.init is None else "start")
    return plan, dict(
        num_samples=num_samples, num_warmup=num_warmup, thin=thin, lr_schedule=kind.value, friction=friction
    )


# ---------------------------------------------------------------------- the engine
def run_plan(
    model,
    data: Data,
    plan: Plan,
    method: str,
    settings: dict,
    cfg: SGOptions,
    holdout: Holdout | None = None,
    full: Data | None = None,
    stops: list[list[int]] | None = None,
    metric: Metric | None | str = "compute",
) -> Posterior:
    """Fit ``model`` by ``plan`` (the shared update of the module docstring) on ``data``: the engine of
    :func:`sgmcmc_engine` driven by :func:`~bnn_pyro.infer.contract.drive` (``num_chains`` chains, each in its own
    copy of the model). ``settings`` go into ``post.config``; ``holdout`` (rows held out of ``data``, ``full`` the
    whole set) scores csgmcmc's exploration stages and a snapshot ensemble's cycles (:mod:`bnn_pyro.infer.snapshot`
    runs its plan here too), and then selects a learned noise on them. ``stops`` (per chain, the step of each
    noise-free stage's kept state, chosen so on held-out rows before) replays those stops on every row
    (:func:`~bnn_pyro.infer.holdout.refit`). ``metric``: the whitening every chain shares (:func:`fit_metric`, computed
    once per fit and passed again to its refit; ``"compute"``: computed here on ``data``; ``None``: unwhitened)."""
    if isinstance(metric, str):
        metric = fit_metric(model, data, plan, cfg)
    lr, seed = cfg.lr, cfg.seed
    num_chains = positive_int("num_chains", cfg.num_chains)
    init = resolve_init(model, cfg.init, data)
    # a BNN's deterministic parameters: fixed at the joint MAP (or init's values), never at a random start
    point_estimate, points = estimate_points(model, data, init, seed=seed, progress=cfg.progress, method=method)
    config = clean_config(
        dict(
            lr=lr,
            **settings,
            num_steps=len(plan.scale),
            num_chains=num_chains,
            init=init if isinstance(init, str) else type(init).__name__,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=seed,
            **({} if point_estimate is None else {"point_estimate": point_estimate}),
        )
    )
    if metric is not None:  # what config["init"] does not say: the chains run whitened, from where (sg_metric)
        config.update(
            preconditioner="hessian_at_mode", preconditioner_damping=metric.damping, start=WHITENED_START[plan.metric]
        )
    ckpts = open_chains(
        cfg.checkpoint,
        every=cfg.checkpoint_every,
        resume=cfg.resume,
        num_chains=num_chains,
        run=dict(method=method, **config),
    )  # all checked before any chain runs
    if metric is not None and cfg.resume:
        refuse_unwhitened(ckpts, method)
        if "scheme" in config.get("observation_weights", {}):  # a snapshot run of a Pyro function whose cycles weigh
            refuse_unweighted(ckpts, method)
    loop = Loop(
        num_steps=len(plan.scale),
        lr=lr,
        method=method,
        desc=method + " chain {index}",
        quantity="potential energy",
        progress=cfg.progress,
    )
    paths, recoveries = Potentials(cfg.fast_path), {}
    engine = sgmcmc_engine(plan, lr, method, data, init, seed, holdout, paths, recoveries, stops, points, metric)
    post = drive(
        model,
        data,
        engine,
        loop,
        num_chains=num_chains,
        seed=seed,
        config=config,
        checkpoints=ckpts,
        posterior_data=full,
    )
    paths.record(post.config)
    _report_recoveries(post, method, recoveries)
    return select_noise(post, holdout)


WHITENED_START = {"dispersed": "laplace", "mode": "mode", "start": "init"}
"""``config["start"]`` of a chain run whitened by the curvature at the mode: a draw of ``N(mode, 4 H^-1)``, the mode,
or the given ``init``."""


METRIC_SEED_OFFSET = 15485863
"""The mode search's seed offset (:func:`fit_metric`): its prior-median draws come from ``seed + METRIC_SEED_OFFSET``,
a stream apart from every chain's (``seed + c``), its noise (``seed + c + 7919``) and its dispersed start
(``seed + c + 104729``)."""


def fit_metric(model, data: Data, plan: Plan, cfg: SGOptions) -> Metric | None:
    """The metric that whitens every chain of one fit (:func:`~bnn_pyro.infer.sg_metric.mode_metric` on ``data``), or
    ``None`` where the plan is not whitened (a ``BNN``, a number ``lr``) or the metric does not apply. Computed once per
    fit, before the chains, in a parameter store of its own under seed ``cfg.seed + METRIC_SEED_OFFSET``: so it is
    deterministic given the seed, the same for every chain (a per-chain search from each chain's stream gave each a
    slightly different metric and repeated the search), and a resumed run recomputes it to the bit. The refit on all
    rows (:func:`~bnn_pyro.infer.holdout.refit`) takes the held-out fit's metric: it replays that fit's stops, so it
    runs the same update from the same start (any fixed positive definite metric keeps the target)."""
    if plan.metric is None or cfg.lr != "auto":
        return None
    with chain(model, cfg.seed + METRIC_SEED_OFFSET) as fitted:
        return mode_metric(fitted, Potentials(cfg.fast_path), data)


def refuse_unwhitened(ckpts: list, method: str) -> None:
    """Refuse to resume a whitened run (a Pyro function) from a checkpoint whose run record has no
    ``preconditioner``: it was written before SG-MCMC recorded its metric, by a run that was either unwhitened (its
    momentum and step size in the plain coordinates) or whitened by a metric searched per chain. Its chains cannot
    continue under this update without mixing two samplers in one chain, unannounced."""
    _refuse_without(
        ckpts,
        method,
        "preconditioner",
        "a preconditioner (an older bnn_pyro: its chains ran unwhitened, or whitened by a metric searched per chain), "
        "while this run is whitened by the Hessian at the mode (post.config['preconditioner'])",
    )


def refuse_unweighted(ckpts: list, method: str) -> None:
    """Refuse to resume a whitened snapshot run of a Pyro function from a checkpoint whose run record has no
    ``observation_weights``: it was written before its cycles weighted the observations
    (:mod:`bnn_pyro.infer.snapshot`, "Pyro functions"), so its cycles minimized the unweighted potential, and the
    cycles left would minimize another objective than those kept, unannounced."""
    _refuse_without(
        ckpts,
        method,
        "observation_weights",
        "its cycles' observation weights (an older bnn_pyro: its cycles weighted every observation 1), while this "
        "run's cycles weight them by their own draws (post.config['observation_weights'])",
    )


def _refuse_without(ckpts: list, method: str, key: str, what: str) -> None:
    """Raise :class:`CheckpointError` for the first checkpoint of a ``method`` run whose run record lacks ``key``
    (``what``: what it did not record, and what this run does instead)."""
    for ckpt in ckpts:
        if ckpt is None or not ckpt.path.exists():
            continue
        saved = read(ckpt.path)[1].get("run", {})
        if saved.get("method") == method and key not in saved:
            raise CheckpointError(
                f"resume: {str(ckpt.path)!r} was written by a {method} run of this Pyro function that did not record "
                f"{what}. Resuming it would continue its chains under another update. Start afresh with another "
                "(empty) checkpoint folder, or finish that run with the bnn_pyro version that wrote it."
            )


def _report_recoveries(post, method: str, recoveries: dict[int, list[tuple[int, float]]]) -> None:
    """``post.config["divergence_recovery"]`` (per chain that recovered: the steps and the smaller step sizes on
    ``U`` it went on with) and a warning, for chains that diverged under ``lr="auto"`` and recovered
    (:meth:`~bnn_pyro.infer.sgmcmc_step.SGMCMC.recover`)."""
    from bnn_pyro.posterior.diagnostics import DiagnosticWarning

    events = {c: r for c, r in sorted(recoveries.items()) if r}
    if not events:
        return
    post.config["divergence_recovery"] = {
        str(c): [{"step": t, "step_size": eta} for t, eta in r] for c, r in events.items()
    }
    where = "; ".join(
        f"chain {c} at step{'s' if len(r) > 1 else ''} {', '.join(str(t) for t, _ in r)} "
        f"(step size on U now {r[-1][1]:.3g})"
        for c, r in events.items()
    )
    if post.config.get("preconditioner"):  # steps in whitened coordinates: no plain-coordinate lr matches them
        advice = (
            "the steps above are in the coordinates whitened by the Hessian at the mode (post.config"
            "['preconditioner']); a number lr runs unwhitened, where this model's stable step is far smaller: keep "
            "lr='auto', or use method='nuts'."
        )
    else:
        advice = (
            "for one step size throughout pass a number, e.g. "
            f"lr={min(r[-1][1] for r in events.values()) * post.config['dataset_size']:.3g} (the step on U is lr / N)."
        )
    warn(
        f"{method}: lr='auto' diverged ({where}): each time the chain went back to its last finite state "
        f"and went on with a step {1 / SHRINK:g} times smaller (post.config['divergence_recovery']). Draws "
        "kept before a recovery used the larger step; " + advice,
        DiagnosticWarning,
    )  # the user's bp.fit call


def sgmcmc_engine(
    plan: Plan,
    lr,
    method: str,
    data: Data,
    init,
    seed: int,
    holdout: Holdout | None,
    paths: Potentials | None = None,
    recoveries: dict | None = None,
    stops: list[list[int]] | None = None,
    points: dict[str, torch.Tensor] | None = None,
    metric: Metric | None = None,
) -> Engine:
    """The :class:`~bnn_pyro.infer.contract.Engine` of ``plan``: its state is a :class:`_Chain` (the position ``z``
    in unconstrained coordinates, updated by its :class:`SGMCMC` optimizer), a step evaluates ``U~`` on the batch
    (first the held-out early stopping and the curvature estimate the plan marks, and keeping the draw the plan
    marks), ``after`` checks the gradient and records the step size taken, and the kept draws become the chain's.
    ``paths`` builds the potentials (default: the fast path where the model allows it); ``recoveries[chain]``
    receives the chain's divergence recoveries under ``lr="auto"``; ``stops[chain]`` replays stops chosen before
    (:meth:`_Chain.replay_stop`); ``points`` are the values of a BNN's deterministic parameters
    (:func:`~bnn_pyro.infer.map_fit.estimate_points`), set in every chain over those of its start;
    ``metric`` whitens every chain (:func:`fit_metric`; ``plan.metric`` says where the chains start)."""
    paths = Potentials() if paths is None else paths

    def init_state(fitted, info: ChainInfo) -> _Chain:
        if info.index > 0:  # the deterministic parameters of chain 0's start: they stay fixed (module docstring)
            chain_start(fitted, init, seed, points=True)
        start = "prior" if isinstance(init, str) and init == "net" and info.index > 0 else init  # module docstring
        begin = chain_start(fitted, start, info.seed, points=info.index == 0)
        if points:
            set_points(fitted, points)
        pot = paths(fitted, data, init=begin)
        if pot.dim == 0:
            raise ValueError(
                f"{method}: the model has no latent sample sites, so there is nothing to sample; give "
                "some parameters a prior (BNN(prior=..., bayesian=...)) or use method='svi'."
            )
        walk = _Chain(pot, plan, f"{method} chain {info.index}", data.size, fitted, holdout)
        if metric is not None:  # a small Pyro function: whitened by the curvature at its mode (sg_metric)
            walk.metric = metric.chol
            if plan.metric in ("mode", "dispersed"):
                start = metric.mode if plan.metric == "mode" else dispersed_start(metric, info.seed, like=walk.z)
                with torch.no_grad():
                    walk.z.copy_(start)
        if plan.anchors is not None:  # a per-step linear tilt of U~ (snapshot ensembles' anchored cycles)
            walk.tilts = plan.anchors(fitted, pot, data.first(), info.seed)
        if plan.weights is not None:  # per-step observation weights of U~ (snapshot ensembles' weighted cycles)
            walk.weights = plan.weights(fitted, pot, data.first(), info.seed)
        walk.index = info.index
        walk.replay = None if stops is None else list(stops[info.index])
        walk.opt = SGMCMC(
            walk.params,
            plan=plan,
            lr=None if lr == "auto" else lr / data.size,
            seed=info.seed,
            curvature=walk.curvature if lr == "auto" else None,
            fallback=1.0 / data.size,
            guard_noisy=data.loader is None and (data.batch_size or data.size) >= data.size,
            metric=walk.metric,
        )
        return walk

    def draws(walk: _Chain, history: dict[str, torch.Tensor]) -> ChainRun:
        samples = walk.pot.constrain(walk.pot.unflatten(torch.stack(walk.draws)))
        if recoveries is not None:
            recoveries[walk.index] = list(walk.opt.recoveries)
        if holdout is not None or stops is not None:  # chosen on held-out rows, or replayed
            history["exploration_stop"] = torch.tensor(walk.stops, dtype=torch.long)
        stats = dict(lp=-history["potential"][plan.keep], step_size=history["step_size"][plan.keep])
        if walk.weights is not None:  # the cycles' objectives differ by their weights: lp is the log joint itself
            with torch.no_grad():
                lp = [-walk.pot(walk.pot.unflatten(z), data.first()) for z in walk.draws]
            stats["lp"] = torch.stack(lp).to(stats["lp"])
        return ChainRun(
            walk.model,
            {k: v.detach().clone() for k, v in samples.items()},
            point_values(walk.model, *data.first(), data.size),
            history,
            stats,
        )

    return Engine(
        init=init_state,
        step=_Chain.step,
        draws=draws,
        info=SGInfo,
        after=_Chain.after,
        checkpoint=lambda walk, ckpt, records: StepCheckpoint(ckpt, walk.params, records, extra=walk),
        optimizer=lambda walk: walk.opt,
        record_dtype=torch.float64,
    )


def _evaluate(pot: Potential, z: dict[str, torch.Tensor], batch) -> torch.Tensor:
    return pot(z, batch)


class _Chain:
    """One chain's state: the position ``z`` (``params``), its optimizer, the potential ``U~``, the kept draws, the
    divergence stop, and the held-out early stopping of noise-free stages. As the checkpoint's ``extra`` state it
    saves the draws and the early-stopping state (the optimizer saves the rest)."""

    def __init__(self, pot: Potential, plan: Plan, name: str, size: int, model, holdout: Holdout | None):
        self.pot, self.plan, self.name, self.size, self.model, self.holdout = pot, plan, name, size, model, holdout
        self.z = pot.flatten(pot.init).detach().clone().requires_grad_(True)
        self.params = [self.z]
        self._keep, self._noisy = plan.keep.tolist(), plan.noisy.tolist()
        self.draws, self.stops, self.best = [], [], None
        self.opt, self.batch, self.t, self.u, self.index = None, None, 0, math.nan, 0
        self.replay, self.saved, self.in_stage = None, None, False
        self.tilts, self.metric, self.weights = None, None, None

    def curvature(self, z: torch.Tensor, start: torch.Tensor, iters: int):
        """``|lambda|_max`` of ``U~``'s Hessian at ``z`` (:func:`largest_curvature`), of the weighted ``U~`` of step
        ``self.t`` where the plan weights the observations (the tilt is linear: no curvature)."""

        def power(pot, at, batch):
            return largest_curvature(pot, at, batch, start, iters, self.metric)

        return weighted(power, self._weights(self.t))(self.pot, z, self.batch)

    def _weights(self, t: int) -> dict:
        return {} if self.weights is None else self.weights(t)

    def step(self, batch, t: int) -> tuple[torch.Tensor, SGInfo]:
        self.batch, self.t = batch, t
        if self.holdout is not None:
            self._early_stop(t)
        elif self.replay is not None:
            self.replay_stop(t)
        self.opt.adapt()
        u = self._energy(batch, t)
        self.u = float(u.detach())
        if not math.isfinite(self.u):
            planned = self.opt.planned_step
            if self.opt.recover() is None:  # a fixed lr, or lr="auto" out of recoveries (SGMCMC.recover)
                raise self._diverged(planned)
            u = self._energy(batch, t)  # the last finite point, on the same batch
            self.u = float(u.detach())
        if self._keep[t]:  # the state at the start of the step
            self.draws.append(self.z.detach().clone())
        return u, SGInfo(self.u, math.nan)

    def _energy(self, batch, t: int) -> torch.Tensor:
        """``U~`` on ``batch``, its observations weighted by the plan's weights of step ``t`` and plus the plan's tilt
        ``<z, g_t>`` at step ``t``, where it has them."""
        u = weighted(_evaluate, self._weights(t))(self.pot, self.pot.unflatten(self.z), batch)
        return u if self.tilts is None else u + self.z @ self.tilts(t)

    def after(self, t: int, info: SGInfo) -> SGInfo:
        if not torch.isfinite(self.z.grad).all():
            raise self._diverged(self.opt.step_size)
        return info._replace(step_size=self.opt.step_size)

    def _diverged(self, step: float) -> FloatingPointError:
        if self.metric is not None:  # whitened: the step is in u = L^T z, and a number lr would run unwhitened
            return FloatingPointError(
                f"{self.name} diverged at step {self.t}: the potential energy or its gradient is not finite (U = "
                f"{self.u:.3g}, step size {step:.3g} in the coordinates whitened by the Hessian at the mode). A "
                "number lr runs unwhitened, where this model's stable step is far smaller; use method='nuts', or "
                "standardize the inputs."
            )
        return FloatingPointError(
            f"{self.name} diverged at step {self.t}: the potential energy or its gradient is not finite (U = "
            f"{self.u:.3g}, step size on U {step:.3g}). The step is too large for the curvature of the posterior; "
            f"pass a smaller lr, e.g. lr={step * self.size / 10:.3g} (the step on U is lr / N)."
        )

    def _early_stop(self, t: int) -> None:
        """With held-out rows: score the states of a noise-free stage, and end the stage at its best one: csgmcmc's
        sampling stage starts from it (module docstring); a snapshot ensemble's snapshot is it (a noise-free kept
        step ends a cycle, :mod:`bnn_pyro.infer.snapshot`), and the next cycle starts from it."""
        noisy = self._noisy[t]
        snapshot = self._keep[t] and not noisy
        first = not noisy and self.best is None  # a noise-free stage starts here
        if first:
            self.best = BestOnHoldout(every=SCORE_EVERY, patience=None)
        if self.best is None or (first and not snapshot and not self.plan.score_start):
            return  # a snapshot cycle's start (the previous snapshot) is no candidate for its snapshot
        if noisy or snapshot or t % SCORE_EVERY == 0 or (self.best.state is None and self.plan.score_start):
            z = self.z.detach()
            self.best.record(t, heldout_score(self.model, self.pot.constrain(self.pot.unflatten(z)), self.holdout), [z])
        if noisy or snapshot:  # the stage has ended: go on from its best state
            if self.best.best_step != t:
                with torch.no_grad():
                    self.z.copy_(self.best.state[0])
                self.opt.restart()
            self.stops.append(self.best.best_step)
            self.best = None

    def replay_stop(self, t: int) -> None:
        """Without held-out rows, the stops a fit with them chose (``self.replay``: the step of each noise-free
        stage's kept state, in order): keep the state at the start of that step and end the stage from it, as
        :meth:`_early_stop` did (the refit on all rows, :func:`~bnn_pyro.infer.holdout.refit`)."""
        noisy = self._noisy[t]
        snapshot = self._keep[t] and not noisy
        if not noisy and not self.in_stage:
            self.in_stage, self.saved = True, None
        if self.in_stage and self.replay and self.replay[0] == t:
            self.saved = self.z.detach().clone()
        if self.in_stage and (noisy or snapshot):  # the stage has ended: go on from its replayed state
            stop = self.replay.pop(0) if self.replay else t
            if stop != t and self.saved is not None:
                with torch.no_grad():
                    self.z.copy_(self.saved)
                self.opt.restart()
            self.stops.append(stop)
            self.in_stage, self.saved = False, None

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
            self.best.load_state_dict(
                {k[len("best/") :]: v for k, v in tensors.items() if k.startswith("best/")}, meta["best"]
            )
