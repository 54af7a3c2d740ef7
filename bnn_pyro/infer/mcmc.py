"""Markov chain Monte Carlo: ``bp.fit(model, x, y, method="nuts" | "hmc" | "metropolis", ...)``, and the chain
runner every MCMC engine shares (a new kernel plugs in as described in ``docs/adding_an_engine.md``).

Every kernel targets the exact posterior ``p(w | x, y)`` in the unconstrained space of the latent sites, on the
very model object SVI fits. Each engine declares a frozen config (a subclass of :class:`MCMCConfig`) that says
which :class:`ChainKernel` to build; :func:`sample` runs the chains: for each, a short loop of ours that does
what Pyro's ``MCMC`` does (validation off, draws mapped back to the constrained space) and adds
checkpoint/resume, which ``MCMC`` cannot give (it starts every run at its first warm-up step).

- ``"nuts"``: the No-U-Turn sampler (Hoffman & Gelman 2014), multinomial variant with Stan's generalized
  turning criterion: trajectories doubled until they turn back, at most ``2**max_tree_depth - 1`` leapfrog steps
  per draw. Fast path: our kernel over one flat vector (:mod:`bnn_pyro.infer._nuts`); otherwise Pyro's ``NUTS``.
- ``"hmc"``: Hamiltonian Monte Carlo (Neal 2011): ``num_leapfrog`` steps per draw on average (default
  :data:`DEFAULT_NUM_LEAPFROG` = 32: a bounded cost per draw), or a fixed ``trajectory_length``, i.e.
  ``length / step_size`` steps at the adapted step size; each draw's count is jittered uniformly within
  +-``leapfrog_jitter`` (default 50%) of it, because a fixed count resonates (Neal 2011, sec. 5.4.2.2). Choose it
  over NUTS for a fixed, known cost per draw; at a BNN's small adapted step 32 steps are a short trajectory, so
  raise ``num_leapfrog`` (or use NUTS) when the draws are strongly autocorrelated. Fast path: our kernel over one
  flat vector (:mod:`bnn_pyro.infer._one_chain`), as NUTS's; otherwise Pyro's ``HMC``.
- ``"metropolis"``: random-walk Metropolis, ``w' = w + h * s * eps``, ``eps ~ N(0, I)``; ``h`` is tuned by dual
  averaging toward ``target_accept`` (default 0.234, Roberts, Gelman & Gilks 1997) and ``s`` is the posterior
  standard deviation estimated in Stan's windows (``dense_mass=True``: the Cholesky factor of the covariance,
  i.e. adaptive Metropolis, Haario et al. 2001).

Metropolis, MALA, NUTS and HMC on a small Pyro function, at the default ``init``: where
:func:`~bnn_pyro.infer.sg_metric.mode_metric` applies (tensor data, no ``pyro.param`` sites, at most
``CONVERGE_MAX_DIM`` coordinates) and the Laplace approximation ``N(z*, H^{-1})`` at the mode describes the posterior
(PSIS ``k_hat`` <= 0.7), chain ``c`` starts at a draw of ``N(z*, 4 H^{-1})`` (over-dispersed, so R-hat can still see
chains that do not mix) and the metric adaptation is dense and starts at ``H^{-1}``
(:mod:`bnn_pyro.infer._mode_start`): from prior draws of wide priors (kidiq's ``N(0, 100)``, a covariate near 100,
Hessian condition number 5e5) a 1,000-step warm-up adapted its metric to the descent, not the posterior.
``config["laplace_k_hat"]`` records the check and ``config["start"] = "laplace"`` the start; elsewhere (a ``BNN``,
``init=`` given, ``k_hat`` > 0.7) the start is ``init``'s. NUTS does the same (14x the bulk ESS per second on kidiq
and on the logistic regression of ``tests/reference``: its trees shrink from 31 and 17 to 5-6 leapfrog steps per
draw). HMC does the same with a trajectory of length pi in that metric unless ``num_leapfrog`` or
``trajectory_length`` is given (:meth:`HMCConfig.laplace_started`: its fixed 32 steps per draw turned each direction
by ~19 radians there, no better mixed than by pi). Each config's ``MODE_START`` says which.

NUTS and HMC adapt the step size (dual averaging toward ``target_accept``, default 0.8, Stan's) and a diagonal
(``dense_mass``: dense) mass matrix during ``num_warmup`` steps. HMC's flat kernel then keeps the step at which a
curve fitted to the last window's (step, acceptance) pairs crosses ``target_accept``
(:mod:`bnn_pyro.infer._aimed_step`), not the dual average of Stan and Pyro, which ran at an acceptance of 0.93-0.97
for the 0.8 target: with a fixed number of leapfrog steps the aimed step is a longer trajectory at the same cost
(with ``trajectory_length``, the same length in fewer steps). It realizes more than the target, by the fitted
curve's form (:mod:`bnn_pyro.infer._aimed_step`): 0.87 on the tests' exact Gaussian, 0.835 over BNN chains
(0.73-0.90). Pyro's ``HMC``, where there is no log joint, keeps the dual average.
``config["step_size_origin"]`` says per chain which rule gave HMC's step: ``"crossing"`` (the fitted curve's),
``"capped"`` (a fit that did not converge, its steps accepted and rejected cleanly apart: the largest step that
reached the target), ``"dual_average"`` (``exp(x_bar)``: no falling curve in the window's pairs, or fewer than 3 of
them, as ``num_warmup`` 20-29 leaves; Pyro's ``HMC``; a checkpoint written before the aim), or, extending a posterior,
its chains' (``"extended"`` where it has no record). A diverging trajectory
(energy error > 1000 or NaN) is rejected and counted in ``sample_stats["diverging"]``; it never raises: the model
runs with distribution validation off, including the priors a ``BNN`` built before the fit.

Fast path (``fast_path=True``, the default): for a ``BNN`` without hierarchical priors or BatchNorm the
potential energy is computed directly in torch (:mod:`bnn_pyro.infer._logjoint`) instead of by tracing the model
at every step, compiled when ``jit=True``; for a stack of ``nn.Linear`` layers and elementwise activations with
Normal priors and a Gaussian likelihood it is analytic (:mod:`bnn_pyro.infer._analytic`). On either potential
NUTS and HMC run our kernels over one flat vector (:mod:`bnn_pyro.infer._one_chain`, where Pyro's kernels step
dicts of site tensors through autograd): on the analytic potential each leapfrog step is the analytic one; on the
generic potential NUTS's whole leapfrog step is one compiled graph and HMC's is a few vector updates around one
compiled call of the gradient; where the gradient cannot be recorded as a graph (e.g. a ``Conv1d`` or ``LayerNorm``
layer) both differentiate the energy traced by TorchScript by autograd, with a warning
(:func:`~bnn_pyro.infer._logjoint.flat_potential_and_grad`). Pyro's ``NUTS`` and ``HMC`` run where there is no log
joint (a Pyro function, a hierarchical prior, BatchNorm, ``fast_path=False``: Pyro's tracing path).

Deterministic (non-Bayesian) parameters of a ``BNN`` are not sampled: they stay fixed, the same for every chain,
at the values ``init`` gives (a :class:`~bnn_pyro.Posterior`'s chain-0 values, or a dict naming every one), else
at the joint MAP fitted from chain 0's start before sampling (:func:`~bnn_pyro.infer.map_fit.estimate_points`),
so that the weights are sampled given the parameters SVI would learn, not given a random initialization.
``Posterior.point`` holds them and ``config["point_estimate"]`` says how they were set.

Chains: :data:`DEFAULT_NUM_CHAINS` = 4, so that R-hat is defined at the defaults. ``chain_method="auto"`` runs
them in forked processes, one torch thread each (more threads per process oversubscribe the cores), and one
after another, with a warning, on one core; ``config["chain_execution"]`` says which. Chain ``c`` is seeded
with ``seed + c`` either way, so both give the same draws. ``chain_method="vectorized"`` (NUTS and HMC on the
analytic path only; never chosen by ``"auto"``) advances all chains as one batched computation in this process
(:mod:`bnn_pyro.infer._vectorized`); the chains share one random stream seeded by ``seed``, so its draws differ
from the other executions', and ``checkpoint=`` writes one file, ``FOLDER/chain0.ckpt``, for the batch.

Per-draw statistics (``Posterior.sample_stats``, shaped ``(chains, draws)``) are the kernel's typed
:class:`~bnn_pyro.infer._kernels.DrawStats` after each kept draw, whose field names are ArviZ's: ``lp``,
``acceptance_rate``, ``step_size``; NUTS/HMC also ``diverging``, ``n_steps``, ``energy``; NUTS also
``tree_depth`` (doublings tried, the last one included when it diverged or turned back). A kernel with an
adapted mass matrix keeps it in ``history["inverse_mass_matrix"]`` so that ``bp.fit(..., resume=post,
num_samples=K)`` can extend the chains (NUTS, HMC): each continues from its last draw with its adapted step
size and mass matrix, without warm-up, and the ``K`` new draws are appended.

Checkpoint/resume (``checkpoint=FOLDER, checkpoint_every=N, resume=True``; :mod:`bnn_pyro.infer.checkpoint`):
every ``N`` iterations (warm-up included) and after the last, each chain writes ``FOLDER/chain{c}.ckpt``
atomically with its kernel's ``state_dict()``, its iteration, the kept draws and statistics so far and the
global generators; ``resume=True`` continues each chain from its file, bit-identically to an uninterrupted run.

Example
-------
>>> post = bp.fit(model, x, y, method="nuts", num_samples=500, num_warmup=500, num_chains=2, seed=0)
>>> post.sample_stats["diverging"].sum()
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_value

from bnn_pyro.infer import _logjoint, _old_kernel, _vectorized
from bnn_pyro.infer._common import clean_config, init_strategy, point_values, progress_bar, quiet_model
from bnn_pyro.infer._init import chain_start, resolve_init, set_points
from bnn_pyro.infer._kernels import DrawStats, Metropolis, pyro_kernel, sample_stats
from bnn_pyro.infer._mode_start import ModeStart, mode_start
from bnn_pyro.infer._nuts import FlatNUTS
from bnn_pyro.infer._one_chain import FlatHMC, refuse_old_checkpoints
from bnn_pyro.infer.checkpoint import Checkpoint, open_chains
from bnn_pyro.infer.contract import PotentialRunOptions, entry
from bnn_pyro.infer.driver import ChainMethod, ChainRun, assemble, chain_execution, run_chains
from bnn_pyro.infer.guide_density import unconstrained_size
from bnn_pyro.infer.health_mixing import check_mcmc, random_walk_advice
from bnn_pyro.infer.map_fit import estimate_points
from bnn_pyro.infer.registry import REGISTRY, Method
from bnn_pyro.infer.training_data import Data
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, flag, positive, positive_int
from bnn_pyro.utils.user_warnings import warn

__all__ = [
    "sample",
    "fit_nuts",
    "fit_hmc",
    "fit_metropolis",
    "MCMCConfig",
    "NUTSConfig",
    "HMCConfig",
    "MetropolisConfig",
    "ChainKernel",
    "KernelSettings",
    "extendable_methods",
    "ChainMethod",
    "DEFAULT_NUM_CHAINS",
    "DEFAULT_NUM_LEAPFROG",
    "DEFAULT_LEAPFROG_JITTER",
    "LAPLACE_TRAJECTORY_LENGTH",
]

DEFAULT_NUM_CHAINS = 4  # chains at the defaults: R-hat needs two or more (Stan runs 4, PyMC at least 2)
DEFAULT_NUM_LEAPFROG = 32  # HMC's leapfrog steps per draw when neither num_leapfrog nor trajectory_length is given
# HMC from the Laplace start: a trajectory of half the period of a unit-sd Gaussian in the adapted metric (HMCConfig)
LAPLACE_TRAJECTORY_LENGTH = math.pi
DEFAULT_LEAPFROG_JITTER = 0.5  # HMC: each draw's leapfrog count uniform within +-50% of it (breaks resonance)


# ---------------------------------------------------------------------- the kernel interface
class ChainKernel(Protocol):
    """What the chain runner (:func:`sample`) reads from one chain's kernel; a new MCMC engine implements it.

    A kernel holds its own state (position-independent: the potential, step size, adaptation, counters) and is
    driven as ``setup`` (init), then ``sample`` once per iteration: warm-up iterations adapt (step size, mass
    matrix) inside ``sample``, kept ones do not. Pyro's ``MCMCKernel`` subclasses fit it as they are.

    initial_params:
        The chain's start, ``{site: unconstrained tensor}``, set by ``setup`` (or before it, for a kernel built on
        a potential function, by the factory that returns it).
    transforms:
        ``{site: constrained-to-unconstrained transform}`` after ``setup`` (``None``/empty: the identity).
    stats:
        The last draw's :class:`~bnn_pyro.infer._kernels.DrawStats` (ArviZ's ``sample_stats`` names; ``None``
        fields are left out of the posterior).
    setup(warmup_steps, x, y):
        Build the potential on the data, the start and the adaptation schedule of ``warmup_steps`` iterations.
    sample(params) -> params:
        One iteration from ``params`` (a dict like ``initial_params``); returns the next state's position.
    logging() -> dict:
        A few strings for the progress bar (step size, acceptance).
    state_dict() -> (tensors, meta); load_state_dict(tensors, meta):
        Everything but the position needed to continue bit-identically (checkpoints); ``meta`` is JSON.
    cleanup():
        Release what ``setup`` built.
    inverse_mass_matrix (optional):
        ``{sites: tensor}`` of the adapted metric, kept in ``history`` so that ``resume=Posterior`` can extend.
    step_size_origin (optional):
        A string naming the rule that gave the step after warm-up, kept in ``config["step_size_origin"]`` (HMC's).
    """

    initial_params: dict
    transforms: dict | None
    stats: DrawStats

    def setup(self, warmup_steps: int, *args) -> None: ...
    def sample(self, params: dict) -> dict: ...
    def logging(self) -> dict: ...
    def state_dict(self) -> tuple[dict, dict]: ...
    def load_state_dict(self, tensors: dict, meta: dict) -> None: ...
    def cleanup(self) -> None: ...


@dataclass(frozen=True)
class KernelSettings:
    """One chain's kernel: the engine's validated ``config``, the compiled log joint ``joint`` (``None``: Pyro's
    tracing path), the chain's start ``init_strategy``, ``resume``: ``(step size, inverse mass matrix)`` of
    the chain being extended (``None``: adapt from scratch), and ``metric``: the Laplace start of a small Pyro
    function (:mod:`bnn_pyro.infer._mode_start`), whose ``H^{-1}`` the (dense) metric adaptation starts from
    (``None``: from the identity)."""

    config: MCMCConfig
    joint: object | None
    init_strategy: Callable | None = None
    resume: tuple[float, torch.Tensor] | None = None
    metric: ModeStart | None = None


# ---------------------------------------------------------------------- the configs
@dataclass(frozen=True)
class MCMCConfig(PotentialRunOptions):
    """The options every MCMC engine takes; an engine subclasses it with its own options, its ``METHOD`` and
    :meth:`kernel` (and, where it has extra checks or records, :meth:`checked` and :meth:`recorded`).

    Attributes
    ----------
    num_samples, num_warmup, num_chains:
        Kept draws per chain; warm-up (adaptation) iterations per chain (default ``num_samples``); chains
        (default :data:`DEFAULT_NUM_CHAINS` = 4, as Stan: R-hat needs at least two; each chain starts from its own
        point, so chains stuck in different modes show up).
    target_accept:
        The acceptance probability the step size is tuned toward, in (0, 1) (the engine's default, with its
        reference, is its config's).
    step_size:
        Initial step size (adapted during warm-up); found by a heuristic when omitted.
    dense_mass:
        A dense mass matrix (or proposal covariance) instead of a diagonal one.
    jit:
        Compile the potential energy once per chain (``False``: evaluate it eagerly).
    init:
        Starting point: ``"reset"`` (a ``BNN``'s default: every layer's ``reset_parameters()`` under chain ``c``'s
        seed), ``"net"``, ``"prior"`` (a Pyro function's default), ``"median"``, a dict of site values, or a
        :class:`Posterior` (its mean and point values); see :mod:`bnn_pyro.infer._init`.
    chain_method:
        ``"auto"``, ``"parallel"`` (forked processes, one torch thread each), ``"sequential"``, or
        ``"vectorized"`` (NUTS/HMC on the analytic fast path; module docstring).
    seed, progress:
        Chain ``c`` uses ``seed + c``; a progress bar per chain (``False``: off).
    resume:
        ``True`` (with ``checkpoint=``): continue each chain from its file, bit-identically. Or a
        :class:`Posterior` of the same method to extend (engines whose ``EXTENDS`` is true): each chain
        continues from its last draw with its adapted step size and inverse mass matrix, without warm-up
        (``num_warmup`` omitted or 0), and ``num_samples`` new draws are appended; pass another ``seed``.
    fast_path:
        Evaluate the potential directly in torch where the model allows it (module docstring); ``False``:
        Pyro's path. ``config["fast_path"]`` says which ran.
    checkpoint, checkpoint_every:
        A folder for one file per chain (``chain{c}.ckpt``), written every ``checkpoint_every`` iterations
        (warm-up included) and after the last (:mod:`bnn_pyro.infer.checkpoint`).
    """

    METHOD: ClassVar[str] = ""  # the registered method name: config["kernel"], progress bars, messages
    EXTENDS: ClassVar[bool] = False  # resume=Posterior extends its chains (its kernel honours KernelSettings.resume)
    # at the default init, a small Pyro function's chains start over-dispersed around its mode and the dense metric
    # adaptation starts at H^-1 there (bnn_pyro.infer._mode_start; the kernel honours KernelSettings.metric)
    MODE_START: ClassVar[bool] = False
    # a random walk: its mixing warning adds the dimension's bound (health_mixing.random_walk_advice)
    RANDOM_WALK: ClassVar[bool] = False

    num_samples: int = 1000
    num_warmup: int | None = None
    num_chains: int | None = None
    target_accept: float | None = 0.8
    step_size: float | None = None
    dense_mass: bool = False
    jit: bool = True
    init: Any = None
    chain_method: str = "auto"
    resume: Any = False

    def checked(self) -> MCMCConfig:
        """The config with this engine's own options validated and their ``None`` defaults resolved."""
        return self

    def laplace_started(self, given: MCMCConfig) -> MCMCConfig:
        """The checked config for chains that take the Laplace start (or extend chains that took it); ``given``: the
        options as the user gave them. Default: unchanged."""
        return self

    def recorded(self) -> dict:
        """This engine's own entries of ``Posterior.config`` (the shared ones are written by :func:`sample`)."""
        return {}

    def flat_options(self, chain: KernelSettings) -> dict:
        """The options every flat-vector kernel (FlatNUTS, FlatHMC, MALA) takes from this config and ``chain``, as
        :func:`_pyro_options` are Pyro's kernels'."""
        return dict(
            init_strategy=chain.init_strategy,
            step_size=self.step_size,
            target_accept_prob=self.target_accept,
            dense_mass=self.dense_mass,
            jit=self.jit,
        )

    def kernel(self, model, chain: KernelSettings) -> ChainKernel:
        """One chain's kernel on ``model`` (validation off); its ``setup`` finds the start and the transforms. (The
        previous release's ``kernel(model, chain, model_args) -> (kernel, initial_params, transforms)`` still runs in
        this one, with a ``DeprecationWarning``: :mod:`bnn_pyro.infer._old_kernel`.)"""
        raise NotImplementedError(f"{type(self).__name__}.kernel: an MCMC engine's config builds its kernel.")


def _default(config, name: str):
    value = getattr(config, name)
    return type(config).__dataclass_fields__[name].default if value is None else value


# the entries that NUTS, HMC and Metropolis recorded before each engine had a config of its own (kept so that
# their checkpoints' run identities, and their posteriors' config, are unchanged)
_SHARED_RECORD = dict(trajectory_length=None, num_leapfrog=None, leapfrog_jitter=None, max_tree_depth=None)


@dataclass(frozen=True)
class NUTSConfig(MCMCConfig):
    """NUTS's options (:class:`MCMCConfig`'s and ``max_tree_depth``: at most ``2**max_tree_depth - 1`` leapfrog
    steps per draw, default 10 as Stan and Pyro). ``target_accept`` 0.8: Stan's default."""

    METHOD: ClassVar[str] = "nuts"
    EXTENDS: ClassVar[bool] = True
    MODE_START: ClassVar[bool] = True
    max_tree_depth: int | None = 10

    def checked(self) -> NUTSConfig:
        return replace(self, max_tree_depth=positive_int("max_tree_depth", _default(self, "max_tree_depth")))

    def recorded(self) -> dict:
        return dict(_SHARED_RECORD, max_tree_depth=self.max_tree_depth)

    def kernel(self, model, chain):
        if chain.joint is not None:  # the fast path: NUTS over one flat vector
            kernel = FlatNUTS(model, chain.joint, **self.flat_options(chain), max_tree_depth=self.max_tree_depth)
            kernel.resume = chain.resume
            return kernel
        return pyro_kernel(
            "nuts",
            model,
            jit=self.jit,
            init_strategy=chain.init_strategy,
            resume=chain.resume,
            metric=chain.metric,
            **_pyro_options(self),
            max_tree_depth=self.max_tree_depth,
        )


@dataclass(frozen=True)
class HMCConfig(MCMCConfig):
    """HMC's options: :class:`MCMCConfig`'s and

    trajectory_length, num_leapfrog:
        One of the two. ``num_leapfrog``: this many leapfrog steps per draw on average, fixed through adaptation
        (default :data:`DEFAULT_NUM_LEAPFROG` = 32 when neither is given: a bounded cost per draw; on a small Pyro
        function started from its Laplace approximation, ``trajectory_length = pi`` instead:
        :meth:`laplace_started`). ``trajectory_length``: a fixed length, i.e. ``length / step_size`` steps per draw at the adapted step size
        (unbounded: thousands per draw where the step is small, as in BNNs).
    leapfrog_jitter:
        Each draw's number of leapfrog steps is uniform over the integers within ``(1 -+ leapfrog_jitter)`` times
        its count, so its mean stays that count (default :data:`DEFAULT_LEAPFROG_JITTER` = 0.5, e.g. 16-48 around
        32; ``0``: fixed): a fixed count resonates where the trajectory turns a direction of the posterior by about
        a multiple of pi (Neal 2011, sec. 5.4.2.2). Each draw's count is ``sample_stats["n_steps"]``.

    ``target_accept`` 0.8: Stan's default; the realized acceptance lands near it (the module docstring: the step
    after warm-up is aimed at it, not the dual average, on the fast path).
    """

    METHOD: ClassVar[str] = "hmc"
    EXTENDS: ClassVar[bool] = True
    MODE_START: ClassVar[bool] = True
    trajectory_length: float | None = None
    num_leapfrog: int | None = None
    leapfrog_jitter: float | None = DEFAULT_LEAPFROG_JITTER

    def checked(self) -> HMCConfig:
        length, steps, jitter = self.trajectory_length, self.num_leapfrog, _default(self, "leapfrog_jitter")
        if length is not None and steps is not None:
            raise ValueError("hmc: give trajectory_length= or num_leapfrog=, not both.")
        if not (isinstance(jitter, (int, float)) and not isinstance(jitter, bool) and 0.0 <= jitter < 1.0):
            raise ValueError(
                f"leapfrog_jitter must be a fraction in [0, 1), got {jitter!r}; try "
                f"{DEFAULT_LEAPFROG_JITTER} (the default), or 0 for a fixed number of leapfrog steps."
            )
        length = None if length is None else positive("trajectory_length", length)
        steps = (
            (DEFAULT_NUM_LEAPFROG if length is None else None) if steps is None else positive_int("num_leapfrog", steps)
        )
        return replace(self, trajectory_length=length, num_leapfrog=steps, leapfrog_jitter=float(jitter))

    def laplace_started(self, given: HMCConfig) -> HMCConfig:
        """Unless ``given`` sets ``num_leapfrog`` or ``trajectory_length``: a trajectory of length
        :data:`LAPLACE_TRAJECTORY_LENGTH` = pi, i.e. ``pi / step_size`` leapfrog steps per draw (jittered as usual).

        From the Laplace start the dense metric is adapted from ``H^{-1}``, so in it the posterior has sds near 1
        and, to leading order (a Gaussian), every direction turns by about ``T`` radians along a trajectory of length
        ``T``. ``T = pi`` is half a period: jittered by +-50% it is uniform over ``[pi / 2, 3 pi / 2]``, so each
        draw moves at least a quarter period and never a whole one (no resonance), and a Gaussian's lag-1
        autocorrelation is ``E[cos T] = -2 / pi`` (antithetic draws). The default's 32 steps per draw are a
        trajectory of 15-19 radians there at the adapted step (0.46-0.6 on the references): 5-8 times the steps
        of ``T = pi`` for draws no less correlated (``docs/reference_suite.md``)."""
        if given.num_leapfrog is None and given.trajectory_length is None:
            return replace(self, trajectory_length=LAPLACE_TRAJECTORY_LENGTH, num_leapfrog=None)
        return self

    def recorded(self) -> dict:
        return dict(
            _SHARED_RECORD,
            trajectory_length=self.trajectory_length,
            num_leapfrog=self.num_leapfrog,
            leapfrog_jitter=self.leapfrog_jitter,
        )

    def kernel(self, model, chain):
        if chain.joint is not None:  # the fast path: HMC over one flat vector (analytic or generic potential, as NUTS)
            kernel = FlatHMC(
                model,
                chain.joint,
                **self.flat_options(chain),
                num_leapfrog=self.num_leapfrog,
                trajectory_length=self.trajectory_length,
                leapfrog_jitter=self.leapfrog_jitter,
            )
            kernel.resume = chain.resume
            return kernel
        kernel = pyro_kernel(
            "hmc",
            model,
            jit=self.jit,
            init_strategy=chain.init_strategy,
            resume=chain.resume,
            metric=chain.metric,
            **_pyro_options(self),
            trajectory_length=self.trajectory_length,
        )
        kernel.fixed_num_steps, kernel.leapfrog_jitter = self.num_leapfrog, self.leapfrog_jitter
        return kernel


@dataclass(frozen=True)
class MetropolisConfig(MCMCConfig):
    """Random-walk Metropolis's options (:class:`MCMCConfig`'s); ``target_accept`` 0.234: the optimal acceptance
    of a random walk in many dimensions (Roberts, Gelman & Gilks 1997)."""

    METHOD: ClassVar[str] = "metropolis"
    MODE_START: ClassVar[bool] = True
    RANDOM_WALK: ClassVar[bool] = True
    target_accept: float | None = 0.234

    def recorded(self) -> dict:
        return dict(_SHARED_RECORD)

    def kernel(self, model, chain):
        return Metropolis(
            model,
            init_strategy=chain.init_strategy,
            step_size=self.step_size,
            target_accept_prob=self.target_accept,
            dense=self.dense_mass,
            jit=self.jit,
            joint=chain.joint,
            metric=chain.metric,
        )


def _pyro_options(config: MCMCConfig) -> dict:
    """Pyro's HMC/NUTS options shared by both kernels."""
    return dict(
        step_size=config.step_size or 1.0,
        adapt_step_size=True,
        adapt_mass_matrix=True,
        full_mass=config.dense_mass,
        target_accept_prob=config.target_accept,
    )


@entry(NUTSConfig)
def fit_nuts(model, data: Data, config: NUTSConfig) -> Posterior:
    """``bp.fit(..., method="nuts")``: sample the posterior of ``model`` by NUTS (module docstring; options:
    :class:`NUTSConfig`)."""
    return sample(model, data, config)


@entry(HMCConfig)
def fit_hmc(model, data: Data, config: HMCConfig) -> Posterior:
    """``bp.fit(..., method="hmc")``: sample the posterior of ``model`` by HMC (module docstring; options:
    :class:`HMCConfig`, e.g. ``num_leapfrog``, default :data:`DEFAULT_NUM_LEAPFROG` = 32, or a trajectory of length
    pi from the Laplace start of a small Pyro function: :meth:`HMCConfig.laplace_started`)."""
    return sample(model, data, config)


@entry(MetropolisConfig)
def fit_metropolis(model, data: Data, config: MetropolisConfig) -> Posterior:
    """``bp.fit(..., method="metropolis")``: sample the posterior of ``model`` by random-walk Metropolis (module
    docstring; options: :class:`MetropolisConfig`)."""
    return sample(model, data, config)


_DROPOUT = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def _refuse_random_forward(model, method: str) -> None:
    """Raise where a ``BNN``'s net holds a dropout module in training mode with ``p > 0``: its forward draws fresh masks
    at every call, so the log density an MCMC kernel evaluates is random, and neither the accept step nor a gradient
    trajectory targets any posterior (review 20: HMC ran on such a net with only a compile warning). Predictions run the
    net in eval mode (dropout off, ``predictive_draws.evaluating``), as Laplace's curvature does; the refusal asks the
    user to choose rather than switching the mode behind their back."""
    net = getattr(model, "net", None) if isinstance(model, BNN) else None
    if net is None:
        return
    on = [
        name or type(net).__name__
        for name, m in net.named_modules()
        if isinstance(m, _DROPOUT) and m.training and m.p > 0
    ]
    if on:
        raise ValueError(
            f"model: {method} needs a log density that is the same at every call, but the net's dropout module(s) "
            f"{', '.join(repr(n) for n in on)} are in training mode and draw new masks at every forward pass. Call "
            "model.eval() (or .eval() on those modules) to sample the network as it predicts (dropout off), or use "
            "method='mc_dropout' for dropout's own approximate posterior."
        )


def _eager_where_values_are_read(model, config: MCMCConfig, method: str) -> MCMCConfig:
    """``config`` with ``jit=False`` where the model's net reads tensor values (:attr:`BNN.reads_values`; subspace's
    model forwards its BNN's): a
    recorded graph or a trace would freeze the branch the recording took (review 25: a branch on a boolean mask's
    size compiled with no error and gave a wrong gradient at 6 of 20 points), so the eager gradient runs, and the
    user is told here, in this process (forked chains' own warnings do not reach the caller)."""
    if not (config.jit and getattr(model, "reads_values", False)):
        return config
    warn(
        f"{method}: the net's forward reads tensor values (a branch on a tensor, .item(), a boolean-mask index), "
        "which a compiled graph would freeze at the branch it recorded; so the log density and its gradient run "
        "eagerly (jit=False: the same values, slower). Write such branches as tensor operations (torch.where, a mask "
        "multiplied in) to get the compiled path. (The shape check cannot tell a value read from a tensor pinned to "
        "one device, e.g. torch.tensor(..., device='cpu') or a plain tensor attribute: make those on the input's "
        "device or register them as buffers.)",
        RuntimeWarning,
    )
    return replace(config, jit=False)


def sample(model, data: Data, config: MCMCConfig) -> Posterior:
    """Run the chains of the MCMC engine ``config`` declares (its :meth:`MCMCConfig.kernel`) on ``model`` and
    ``data`` and return them as a :class:`Posterior` (module docstring), after the MCMC health checks that the
    method's declaration asks for (:class:`~bnn_pyro.infer.contract.Capabilities`)."""
    method, c = type(config).METHOD, config
    num_samples = positive_int("num_samples", c.num_samples)
    dense_mass, jit = flag("dense_mass", c.dense_mass), flag("jit", c.jit)
    resume, init, num_warmup, num_chains = c.resume, c.init, c.num_warmup, c.num_chains
    resume_files = resume is True  # resume=True/False: from the checkpoint files; a Posterior: extend it
    laplace_started = False  # extending a posterior whose chains took the Laplace start (its metric is dense)
    if isinstance(resume, bool):
        resume = None
    elif resume is not None and c.checkpoint is not None:
        raise ValueError(
            "resume: a Posterior to extend cannot be combined with checkpoint=; extend it without "
            "checkpoint=, or pass resume=True to continue a checkpointed run from its files."
        )
    if resume is not None:
        # the chains continue from their last draws; the deterministic parameters stay those of the run extended
        laplace_started = isinstance(resume, Posterior) and resume.config.get("start") == "laplace"
        dense_mass = dense_mass or laplace_started  # its metric was dense
        num_warmup, init = _check_resume(resume, config, num_warmup, num_chains, dense_mass), resume
        num_chains = resume.num_chains
    num_warmup = positive_int(
        "num_warmup", num_samples if num_warmup is None else num_warmup, allow_zero=resume is not None
    )
    num_chains = positive_int("num_chains", DEFAULT_NUM_CHAINS if num_chains is None else num_chains)
    how = choice("chain_method", c.chain_method, ChainMethod)
    target_accept = _default(c, "target_accept")
    if not (isinstance(target_accept, (int, float)) and 0.0 < target_accept < 1.0):
        raise ValueError(
            f"target_accept must be a probability in (0, 1), got {target_accept!r}; try "
            f"{type(c).__dataclass_fields__['target_accept'].default} (the {method} default; "
            "0.9-0.99 for NUTS/HMC when there are divergences)."
        )
    step_size = None if c.step_size is None else positive("step_size", c.step_size)
    config = replace(
        c, target_accept=float(target_accept), step_size=step_size, dense_mass=dense_mass, jit=jit
    ).checked()
    if data.loader is not None or (data.batch_size is not None and data.batch_size < data.x.shape[0]):
        raise ValueError(
            f"{method} needs the full data set at every step: drop batch_size= and pass tensors, "
            "or use a stochastic-gradient method for minibatches."
        )
    _refuse_random_forward(model, method)
    config = _eager_where_values_are_read(model, config, method)
    _old_kernel.warn_if_old(config)  # an engine written to the previous release's kernel interface still runs
    seed, progress = c.seed, c.progress
    init = resolve_init(model, init, data)
    fitted = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    point_estimate, points = estimate_points(fitted, data, init, seed=seed, progress=progress, method=method)
    laplace = None  # a small Pyro function at the default init: starts and metric from the mode (_mode_start)
    if type(config).MODE_START and c.init is None and resume is None and not isinstance(fitted, BNN):
        laplace = mode_start(fitted, data, num_chains=num_chains, seed=seed, fast_path=flag("fast_path", c.fast_path))
    k_hat = None if laplace is None else round(laplace.k_hat, 3)  # recorded: why the Laplace start was (not) taken
    laplace = laplace if laplace is not None and laplace.usable else None
    if laplace is not None or laplace_started:
        config = config.laplace_started(c)
    if laplace is not None:
        dense_mass, config = True, replace(config, dense_mass=True)
        strategies = [init_strategy(fitted, laplace.values[c]) for c in range(num_chains)]
    else:  # one copy for every chain: its deterministic parameters (fixed) come from chain 0's start
        strategies = [
            init_strategy(fitted, chain_start(fitted, init, seed + c, points=c == 0)) for c in range(num_chains)
        ]
    if points:  # the MAP's deterministic parameters (point_estimate == "map")
        set_points(fitted, points)
    joint = _logjoint.build(fitted, data.size) if flag("fast_path", c.fast_path) else None
    execution = chain_execution(num_chains, how, method)
    if execution == "vectorized":
        _vectorized.check(method, joint, data.x, data.y)
    settings = KernelSettings(config=config, joint=joint, metric=laplace)

    def chain_settings(c: int) -> KernelSettings:
        return (
            replace(settings, init_strategy=strategies[c])
            if resume is None
            else replace(  # the chain's last draw,
                settings,
                init_strategy=init_to_value(values={k: v[c, -1] for k, v in resume.samples.items()}),
                resume=(float(resume.sample_stats["step_size"][c, -1]), resume.history["inverse_mass_matrix"][c]),
            )
        )

    def run_chain(fitted, info):
        bar = (f"{method} chain {info.index}", info.line) if progress else None
        return _run_chain(fitted, data, chain_settings(info.index), num_samples, num_warmup, bar, ckpts[info.index])

    record = clean_config(
        dict(
            kernel=method,
            num_samples=num_samples,
            num_warmup=num_warmup,
            num_chains=num_chains,
            target_accept=config.target_accept,
            step_size=step_size,
            **config.recorded(),
            dense_mass=dense_mass,
            jit=config.jit,  # False where the net reads values (_eager_where_values_are_read)
            fast_path=joint is not None,
            init=init if isinstance(init, str) else type(init).__name__,
            chain_method=how.value,
            chain_execution=execution,
            dataset_size=data.size,
            seed=seed,
            **({} if point_estimate is None else {"point_estimate": point_estimate}),
            **({} if k_hat is None else {"laplace_k_hat": k_hat}),
            **({} if laplace is None and not laplace_started else {"start": "laplace"}),
        )
    )
    # every chain's file checked before any chain runs; chain_method is not part of the run (same draws either way)
    run = {k: v for k, v in record.items() if k not in ("chain_method", "chain_execution")}
    batched = execution == "vectorized"  # its draws differ from the other executions': part of the run; one file
    ckpts = open_chains(
        c.checkpoint,
        every=c.checkpoint_every,
        resume=resume_files,
        num_chains=1 if batched else num_chains,
        run=dict(method=method, **run, **({"chain_execution": execution} if batched else {})),
    )
    if resume_files and joint is not None:  # refused here, before any chain (or its process) starts
        refuse_old_checkpoints(ckpts, method)
    # one model for every chain: its deterministic parameters (fixed) come from chain 0's start
    runs = (
        _vectorized.run(
            fitted,
            data,
            [chain_settings(c) for c in range(num_chains)],
            kind=method,
            num_samples=num_samples,
            num_warmup=num_warmup,
            seed=seed,
            progress=progress,
            ckpt=ckpts[0],
        )
        if batched
        else run_chains(
            fitted, num_chains, seed, run_chain, how=execution, copy_model=False, method="mcmc", decided=True
        )
    )
    post = assemble(runs, method=method, config=record, data=data)
    note = (
        random_walk_advice(
            walk_size(fitted, post.samples, data),
            post.num_chains,
            post.num_draws + (resume.num_draws if resume is not None else 0),
        )
        if config.RANDOM_WALK
        else ""
    )
    post.samples.update(deterministic_sites(fitted, post.samples, data))
    if resume is not None:  # append the new segment to the draws it continues
        post.samples = {k: torch.cat([resume.samples[k], v], dim=1) for k, v in post.samples.items()}
        post.sample_stats = {
            k: torch.cat([resume.sample_stats[k].to(v.dtype), v], dim=1) for k, v in post.sample_stats.items()
        }
        record.update(
            num_samples=resume.num_draws + num_samples,
            num_warmup=resume.config.get("num_warmup"),
            extended_by=num_samples,
        )
        if "step_size_origin" in resume.config:  # the step is the extended chains': so is its origin ("extended":
            record["step_size_origin"] = resume.config["step_size_origin"]  # that of a posterior without the record)
    can = REGISTRY[Method(method)].capabilities
    return check_mcmc(post, target_accept=config.target_accept, acceptance=can.accept_reject, note=note)


def deterministic_sites(model, samples: dict[str, torch.Tensor], data: Data) -> dict[str, torch.Tensor]:
    """The ``pyro.deterministic`` sites of a Pyro function model other than ``"f"`` (e.g. eight schools' ``theta =
    mu + tau * eta``) at every draw of ``samples``, shaped ``(chains, draws, *shape)``, as Pyro's ``MCMC`` and
    ArviZ users expect beside the sampled sites. Each draw replays the model on the training data with its
    sites conditioned. A ``BNN`` has none but ``"f"`` (its network output, ``N`` values per draw, which
    ``post.predict`` and ``summary(space="function")`` compute), so it is skipped."""
    if isinstance(model, BNN) or not samples:
        return {}
    first = next(iter(samples.values()))
    chains, draws = first.shape[:2]

    def replay(c: int, d: int) -> dict[str, torch.Tensor]:
        with torch.no_grad(), pyro.validation_enabled(False), pyro.get_param_store().scope():
            conditioned = poutine.condition(model, data={k: v[c, d] for k, v in samples.items()})
            trace = poutine.trace(conditioned).get_trace(data.x, data.y, **_size_kwargs(model, data))
        return {
            name: site["value"].detach()
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and site["infer"].get("_deterministic") and name != "f" and name not in samples
        }

    if not replay(0, 0):
        return {}
    rows = [[replay(c, d) for d in range(draws)] for c in range(chains)]
    return {name: torch.stack([torch.stack([row[name] for row in chain]) for chain in rows]) for name in rows[0][0]}


def walk_size(model, samples: dict[str, torch.Tensor], data: Data) -> int:
    """The unconstrained coordinates the chains of ``samples`` (the sampled sites) moved in: a ``BNN``'s weights, or
    a Pyro function's sites mapped to the reals (an ``LKJCholesky(10)`` site 45 of its 100 elements; one run of the
    model at the first draw)."""
    if isinstance(model, BNN) or not samples:
        return sum(v[0, 0].numel() for v in samples.values())
    with torch.no_grad(), pyro.validation_enabled(False), pyro.get_param_store().scope():
        conditioned = poutine.condition(model, data={k: v[0, 0] for k, v in samples.items()})
        trace = poutine.trace(conditioned).get_trace(data.x, data.y, **_size_kwargs(model, data))
    return unconstrained_size({k: site for k, site in trace.nodes.items() if k in samples and site["type"] == "sample"})


def _size_kwargs(model, data: Data) -> dict:
    return {"dataset_size": data.size} if "dataset_size" in inspect.signature(model).parameters else {}


def _check_resume(resume, config: MCMCConfig, num_warmup, num_chains, dense_mass) -> int:
    """``resume=``: a posterior of the same method, one that extends (``EXTENDS``), which stored its adapted mass
    matrix."""
    method = type(config).METHOD
    if not isinstance(resume, Posterior) or resume.method != method or not type(config).EXTENDS:
        takers = list(extendable_methods())
        raise ValueError(
            f"resume: expected True (continue from the checkpoint= files) or a Posterior of "
            f"method={method!r} ({' or '.join(takers)}) to extend, got "
            f"{getattr(resume, 'method', type(resume).__name__)!r}; fit one with bp.fit(method='nuts')."
        )
    if "inverse_mass_matrix" not in resume.history:
        raise ValueError(
            "resume: this posterior has no history['inverse_mass_matrix'] (fitted before it was "
            "stored); refit it to extend it."
        )
    if num_warmup not in (None, 0):
        raise ValueError(
            f"num_warmup: must be omitted or 0 with resume= (the chains keep their adapted step size "
            f"and mass matrix), got {num_warmup!r}."
        )
    dense = resume.history["inverse_mass_matrix"].dim() == 3
    if num_chains not in (None, resume.num_chains) or dense_mass != dense:
        raise ValueError(
            f"resume: num_chains and dense_mass must be those of the posterior extended "
            f"({resume.num_chains} chains, dense_mass={dense}); omit num_chains to keep them."
        )
    return 0


def extendable_methods() -> dict[str, type]:
    """The MCMC methods whose chains ``resume=Posterior`` extends, from their configs' ``EXTENDS``."""
    found = {}
    for method, declared in REGISTRY.items():
        config = getattr(declared.fit_function(), "config_type", None) if declared.capabilities.markov_chain else None
        if isinstance(config, type) and issubclass(config, MCMCConfig) and config.EXTENDS:
            found[method.value] = config
    return found


# ---------------------------------------------------------------------- running chains
def _run_chain(
    model,
    data: Data,
    settings: KernelSettings,
    num_samples: int,
    num_warmup: int,
    bar: tuple[str, int] | None,
    ckpt: Checkpoint | None = None,
):
    """One chain (inside the driver's :func:`~bnn_pyro.infer.driver.chain`): its draws ``(num_samples, *shape)``,
    per-draw statistics and the fixed point values. ``bar``: the progress bar's label and terminal line
    (``None``: no bar); ``ckpt``: the chain's checkpoint file (``None``: none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one draw's tensors are small: extra intra-op threads only oversubscribe the cores
    try:
        return _run_chain_1(model, data, settings, num_samples, num_warmup, bar, ckpt)
    finally:
        torch.set_num_threads(threads)


def _run_chain_1(model, data, settings, num_samples, num_warmup, bar, ckpt):
    """Our loop over a :class:`ChainKernel` (Pyro's ``MCMCKernel`` interface): what Pyro's ``MCMC`` does for one chain (distribution validation off, the draws mapped back to the constrained space), and
    the checkpoint/resume that ``MCMC`` cannot give (it starts every run at its first warm-up step)."""
    # old_transforms: an engine written to the previous release's interface (_old_kernel) may return its own
    kernel, old_transforms = _old_kernel.build(
        settings.config, quiet_model(model, data.size), settings, (data.x, data.y)
    )
    total = num_warmup + num_samples
    label, line = bar or ("", 0)  # our bar, labelled per chain like the other engines' (Pyro's says "Warmup"/"Sample")
    with progress_bar(total, label, bar is not None, position=line) as shown, pyro.validation_enabled(False):
        with _logjoint.recording():  # Pyro's jit_compile (a traced model) records its graph at the first call, in setup
            kernel.setup(num_warmup, data.x.detach(), data.y.detach())
        params = kernel.initial_params
        kept, draws, start = {k: [] for k in sorted(params)}, [], 0
        if ckpt is not None and (saved := ckpt.load()) is not None:
            start, params = _restore(kernel, saved, kept, draws, next(iter(params.values())))
            shown.update(start)
        for i in range(start, total):
            params = kernel.sample(params)
            if i >= num_warmup:
                draws.append(kernel.stats)
                for k, v in kept.items():
                    v.append(params[k].detach().clone())
            if bar is not None:
                shown.set_postfix(
                    {"phase": "warmup" if i < num_warmup else "sample", **kernel.logging()}, refresh=False
                )
                shown.update()
            if ckpt is not None and ckpt.due(i + 1, total):
                _save(ckpt, i + 1, kernel, params, kept, draws)
        mass = getattr(kernel, "inverse_mass_matrix", None)  # the adapted one (NUTS/HMC: for resume=Posterior)
        origin = getattr(kernel, "step_size_origin", None)  # HMC: which rule gave its step after warm-up
        transforms = old_transforms or kernel.transforms or {}
        kernel.cleanup()
    samples = {k: torch.stack(v) for k, v in kept.items()}
    samples = {k: transforms[k].inv(v) if k in transforms else v for k, v in samples.items()}
    point = point_values(model, data.x, data.y, data.size)
    history = {} if mass is None else {"inverse_mass_matrix": next(iter(mass.values())).detach().clone()}
    record = {} if origin is None else {"step_size_origin": origin}
    return ChainRun(model, samples, point, history, stats=sample_stats(draws), record=record)


def _save(ckpt, step: int, kernel, params: dict, kept: dict, draws: list[DrawStats]) -> None:
    """The chain after ``step`` iterations (warm-up included): the kernel's state, the position, the kept draws
    (unconstrained) and their statistics; the checkpoint adds the generators."""
    tensors, meta = kernel.state_dict()
    tensors = {f"kernel/{k}": v for k, v in tensors.items()}
    tensors.update({f"position/{k}": v for k, v in params.items()})
    tensors.update({f"draws/{k}": torch.stack(v) for k, v in kept.items() if v})
    ckpt.save(step, tensors, {"kernel": meta, "stats": [list(d) for d in draws]})


def _restore(kernel, saved, kept: dict, draws: list[DrawStats], like: torch.Tensor) -> tuple[int, dict]:
    """Load what :func:`_save` wrote into a kernel set up for the same run; returns the step and the position."""
    tensors, meta = saved
    tensors = {k: v.to(like.device) for k, v in tensors.items()}
    part = lambda prefix: {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    kernel.load_state_dict(part("kernel/"), meta["kernel"])
    for k, v in part("draws/").items():
        kept[k][:] = list(v)
    draws[:] = [DrawStats(*d) for d in meta["stats"]]
    return meta["step"], part("position/")
