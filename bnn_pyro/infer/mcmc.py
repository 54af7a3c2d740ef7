"""Markov chain Monte Carlo: ``bp.fit(model, x, y, method="nuts" | "hmc" | "metropolis", ...)``.

Every kernel targets the exact posterior ``p(w | x, y)`` in the unconstrained space of the latent
sites, on the very model object SVI fits. Each chain's kernel (a Pyro ``MCMCKernel``: ``setup``, ``sample``,
``cleanup``) is driven by a short loop of ours that does what Pyro's ``MCMC`` does for one chain (validation
off, draws mapped back to the constrained space) and adds checkpoint/resume, which ``MCMC`` cannot give
(it starts every run at its first warm-up step):

- ``"nuts"``: the No-U-Turn sampler (Hoffman & Gelman 2014), multinomial variant with Stan's
  generalized turning criterion: leapfrog trajectories doubled until they turn back, at most
  ``2**max_tree_depth - 1`` steps per draw. On the fast path it is our own kernel over one flat
  vector (:mod:`bnn_pyro.infer._nuts`); otherwise Pyro's ``NUTS``.
- ``"hmc"``: Hamiltonian Monte Carlo (Neal 2011; Pyro's ``HMC``): ``num_leapfrog`` steps per draw on
  average (default :data:`DEFAULT_NUM_LEAPFROG` = 32), kept through adaptation, or a trajectory of
  fixed length ``trajectory_length``; each draw's count is jittered uniformly within +-``leapfrog_jitter``
  (default 50%) of it, since a fixed count resonates on some posteriors (see ``fit``). Pyro turns a length into ``length / step_size`` steps after
  adaptation, so a length costs more the smaller the adapted step: Stan's ``2 * pi`` (this engine's
  default before) is 3,000-6,000 steps per draw at a BNN's step sizes of 1e-3 to 2e-3, and took 772 s
  for 2 x (50 + 50) on the README's quickstart model (NUTS: 99 s for 2 x (200 + 200)); at the default
  32 steps the same run took 24 s on a busy 2-core machine. Choose HMC over NUTS for a fixed, known
  cost per draw (``num_leapfrog`` gradient evaluations: a time budget, comparing samplers per
  gradient) or when a trajectory length known to suit the posterior is given; otherwise NUTS, which
  chooses each draw's length itself and on the fast path runs a compiled flat-vector kernel. At a
  BNN's small adapted step 32 steps are a short trajectory, so the draws are cheap but strongly
  autocorrelated (that 24 s run: R-hat of f(x) up to 1.4, bulk ESS 5-71 of 100 draws): raise
  ``num_leapfrog`` and the draws, or use NUTS.
- ``"metropolis"``: random-walk Metropolis (a subclass of Pyro's ``RandomWalkKernel``). The proposal
  is ``w' = w + h * s * eps``, ``eps ~ N(0, I)``; during warm-up ``h`` is tuned by dual averaging
  toward acceptance ``target_accept`` (default 0.234, Roberts, Gelman & Gilks 1997) and ``s`` is the
  posterior standard deviation estimated in Stan's windows (``dense_mass=True``: the Cholesky factor
  of the covariance, i.e. adaptive Metropolis, Haario et al. 2001).

NUTS and HMC adapt the step size (dual averaging toward ``target_accept``, default 0.8) and a
diagonal (or, with ``dense_mass``, dense) mass matrix during ``num_warmup`` steps. A diverging
trajectory (energy error > 1000 or NaN) is rejected and counted in ``sample_stats["diverging"]``;
it never raises: the model runs with distribution validation off, including the priors that a
``BNN`` built before the fit (they keep the validation setting they were made with).

The fast path (``fast_path=True``, the default): for a ``BNN`` without hierarchical priors or
BatchNorm the potential energy is computed directly in torch (:mod:`bnn_pyro.infer._logjoint`)
instead of by tracing the model at every leapfrog step. NUTS then runs over one flat vector with
the potential and its gradient recorded as one compiled graph when ``jit=True`` (the default), the
trajectory's bookkeeping in Python floats (per-leapfrog times against Pyro's ``NUTS`` and NumPyro's
compiled sampler: ``benchmarks/performance.py``, ``benchmarks/results/``). HMC and Metropolis keep Pyro's kernels with the
fast potential (compiled with ``torch.jit.trace`` when ``jit=True``). For a stack of ``nn.Linear`` layers
and elementwise activations with Normal priors and a Gaussian likelihood the potential and its gradient
are analytic instead for NUTS and HMC (:mod:`bnn_pyro.infer._analytic`: nothing compiled, ``jit`` is moot),
and HMC runs over one flat vector too (:mod:`bnn_pyro.infer._flat_hmc`: the same algorithm and adaptation as
Pyro's ``HMC``, with its own seeded generator, so its draws differ from those of bnn_pyro before it for the same
seed); Metropolis, which needs no gradient, keeps the generic potential.

Deterministic (non-Bayesian) parameters of a ``BNN`` (those its prior leaves out, e.g. biases under a prior
that returns ``None`` for them) are not sampled: they stay FIXED, the same for every chain, at a point
estimate. Unless ``init`` gives them (a :class:`~bnn_pyro.Posterior`, e.g. of an SVI fit, which learns them:
its chain-0 values; or a dict naming every one), that estimate is the joint MAP of the whole model (weights
and deterministic parameters together, from chain 0's start: :func:`~bnn_pyro.infer.map_fit.estimate_points`,
shared with SG-MCMC) fitted before sampling: MCMC then samples the weights
given the same deterministic parameters SVI would learn, not given the random values ``reset_parameters()``
drew (which shifted the weights' posterior to compensate: on a linear model with a deterministic intercept
of 0.33 +- 0.03 four seeds kept -0.58, -0.14, 0.19 and -0.30). ``Posterior.point`` holds them and
``config["point_estimate"]`` says how they were set (``"map"``, ``"init"``; absent without them).

Chains: :data:`DEFAULT_NUM_CHAINS` = 4 by default, so that R-hat is defined at the defaults (with one chain it
is NaN, and the health check says so). ``chain_method="auto"`` (the default) runs them in parallel, one forked process per core with one torch
thread each (two torch threads per process on two cores oversubscribe the cores: OpenMP threads
spin and steal each other's time, Pyro's own parallel mode ran at 0.48x of one chain), and one after
another, with a warning, when only one core is available. ``config["chain_execution"]`` says which.
Chain ``c`` is seeded with ``seed + c`` either way, so both give the same draws.
``chain_method="vectorized"`` (NUTS and HMC on the analytic path only; never chosen by ``"auto"``) advances all
chains together as ONE batched computation in this process, one torch thread (:mod:`bnn_pyro.infer._vectorized`):
a small net is dispatch-bound, so a few chains cost little more per leapfrog step than one (at 8 chains on a
1-50-1 net, N = 200, about half one chain's time per chain-leapfrog on one core: the batched passes turn
arithmetic-bound; on 2 CPU cores forked processes are as fast or faster, ``benchmarks/results/performance.md``). Each chain starts where
chain ``c`` starts under the other executions and adapts on its own (step size and mass matrix), but the chains
share one random stream seeded by ``seed``: the same seed gives the same draws, not those of the other executions.
NUTS runs the lockstep case of the one transition of :mod:`bnn_pyro.infer._nuts` (the chains double their trajectories
together; a chain that turned or diverged waits, masked, until the last one stops). One progress bar for all chains; ``checkpoint=`` writes ONE file, ``FOLDER/chain0.ckpt``, for the batch.

Per-draw statistics (``Posterior.sample_stats``, shaped ``(chains, draws)``, ArviZ names), recorded per draw
as a typed :class:`~bnn_pyro.infer._kernels.DrawStats` (the kernel's ``stats`` after each kept draw) and
stacked at assembly:
``lp`` (log joint density up to a constant, unconstrained space), ``acceptance_rate``,
``step_size``; NUTS/HMC also ``diverging``, ``n_steps`` (leapfrog steps) and ``energy`` (the
Hamiltonian after the momentum refresh, for BFMI); NUTS also ``tree_depth`` (trajectory doublings
tried, the last one included when it diverged or turned back; Stan's ``treedepth__`` counts only
the kept ones).
NUTS/HMC also keep ``history["inverse_mass_matrix"]``, the adapted (diagonal ``(chains, dim)`` or
dense ``(chains, dim, dim)``) inverse mass matrix (Metropolis: the adapted proposal variances or covariance, which
``step_size**2`` scales), so that ``bp.fit(..., resume=post, num_samples=K)``
can extend the chains: each continues from its last draw with its adapted step size and mass matrix,
without warm-up or step-size search (both adaptations off), and the ``K`` new draws are appended (also
after ``post.save`` / ``bp.load``).

Checkpoint/resume (``checkpoint=FOLDER, checkpoint_every=N, resume=True``; :mod:`bnn_pyro.infer.checkpoint`), for
every kernel, ``fast_path`` or not: every ``N`` iterations (warm-up included) and after the last, each chain
writes ``FOLDER/chain{c}.ckpt`` atomically with its kernel's ``state_dict()`` (position, potential and gradient,
step size, the dual-averaging and mass-matrix adaptation mid-window, counters, NUTS's trajectory generator),
its iteration, the kept draws and statistics so far and the global generators. ``resume=True`` continues each
chain from its file; the draws are bit-identical to an uninterrupted run (``tests/infer/test_checkpoint.py``
crashes runs mid-warm-up and mid-sampling). Pyro's own HMC/NUTS state is read through
:mod:`bnn_pyro._upstream_private` (private attributes; checked by a test).

Example
-------
>>> post = bp.fit(model, x, y, method="nuts", num_samples=500, num_warmup=500, num_chains=2, seed=0)
>>> post.sample_stats["diverging"].sum()
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch
import pyro
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_value

from bnn_pyro._checks import choice, flag, positive, positive_int
from bnn_pyro.infer import _logjoint, _vectorized
from bnn_pyro.infer._health import check_mcmc
from bnn_pyro.infer._kernels import DrawStats, Metropolis, pyro_kernel, sample_stats
from bnn_pyro.infer._flat_hmc import FlatHMC, analytic_applies
from bnn_pyro.infer._nuts import FlatNUTS
from bnn_pyro.infer._common import clean_config, init_strategy, point_values, progress_bar, quiet_model
from bnn_pyro.infer._init import chain_start, resolve_init, set_points
from bnn_pyro.infer.map_fit import estimate_points
from bnn_pyro.model import BNN
from bnn_pyro.infer.checkpoint import Checkpoint, open_chains
from bnn_pyro.infer.training_data import Data
from bnn_pyro.infer.driver import ChainMethod, ChainRun, assemble, chain_execution, run_chains
from bnn_pyro.posterior import Posterior

__all__ = ["fit", "fit_nuts", "fit_hmc", "fit_metropolis", "Kernel", "ChainMethod", "DEFAULT_NUM_CHAINS", "DEFAULT_NUM_LEAPFROG",
           "DEFAULT_LEAPFROG_JITTER"]

DEFAULT_NUM_CHAINS = 4  # chains at the defaults: R-hat needs two or more (Stan runs 4, PyMC at least 2)
DEFAULT_NUM_LEAPFROG = 32  # HMC's leapfrog steps per draw when neither num_leapfrog nor trajectory_length is given
DEFAULT_LEAPFROG_JITTER = 0.5  # HMC: each draw's leapfrog count uniform within +-50% of it (breaks resonance)


class Kernel(str, Enum):
    NUTS = "nuts"
    HMC = "hmc"
    METROPOLIS = "metropolis"


def fit(model, data: Data, *, kernel="nuts", num_samples: int = 1000, num_warmup: int | None = None,
        num_chains: int | None = None, target_accept: float | None = None, step_size: float | None = None,
        trajectory_length: float | None = None, num_leapfrog: int | None = None,
        leapfrog_jitter: float | None = None, max_tree_depth: int | None = None,
        dense_mass: bool = False, jit: bool = True, init=None, chain_method="auto", seed: int = 0,
        progress: bool = True, resume: Posterior | bool | None = None, fast_path: bool = True,
        checkpoint: str | None = None, checkpoint_every: int | None = None) -> Posterior:
    """Sample the posterior of ``model`` by MCMC (see the module docstring).

    Parameters
    ----------
    kernel:
        ``"nuts"``, ``"hmc"`` or ``"metropolis"`` (``bp.fit``'s ``method`` sets it).
    num_samples, num_warmup, num_chains:
        Kept draws per chain, warm-up (adaptation) steps per chain (default ``num_samples``), and chains
        (default :data:`DEFAULT_NUM_CHAINS` = 4, as Stan: R-hat, the chains' agreement, needs at least two and is
        NaN for one; each chain starts from its own point, so chains stuck in different modes show up). On two
        cores ``chain_method="auto"`` runs them two at a time; what four chains cost against one is measured in
        ``benchmarks/mcmc_default_chains.py`` (``benchmarks/results/``).
    target_accept:
        Acceptance probability the step size is tuned toward, in (0, 1): default 0.8 (NUTS, HMC),
        0.234 (Metropolis).
    step_size:
        Initial step size (adapted during warm-up); found by Pyro's heuristic when omitted.
    trajectory_length, num_leapfrog:
        HMC only, one of the two. ``num_leapfrog``: exactly this many leapfrog steps per draw, fixed
        through adaptation (default :data:`DEFAULT_NUM_LEAPFROG` = 32 when neither is given).
        ``trajectory_length``: a fixed length, i.e. ``length / step_size`` steps per draw at the adapted
        step size, unbounded (thousands per draw where the step is small, as in BNNs).
    leapfrog_jitter:
        HMC only: each draw's number of leapfrog steps is drawn uniformly from the integers within
        ``(1 -+ leapfrog_jitter)`` times its count (``num_leapfrog``, or ``length / step size``), so its mean stays
        that count (default :data:`DEFAULT_LEAPFROG_JITTER` = 0.5, e.g. 16-48 steps around 32; ``0``: fixed). A
        fixed count resonates: where the trajectory turns some direction of the posterior by about a multiple of
        pi, draw after draw returns next to its start (on an exact Gaussian posterior some seeds gave a bulk ESS
        of 2 of 500 draws); a count that varies breaks the repetition (Neal 2011, sec. 5.4.2.2). Each draw's count
        is ``sample_stats["n_steps"]``, drawn from the chain's seeded stream (reproducible, checkpointed).
    max_tree_depth:
        NUTS only: at most ``2**max_tree_depth - 1`` leapfrog steps per draw (default 10).
    dense_mass:
        A dense mass matrix (or proposal covariance) instead of a diagonal one.
    jit:
        Compile the potential energy (and, for NUTS on the fast path, its gradient) once per chain:
        faster per step for a fraction of a second of compiling. ``False`` evaluates it eagerly.
    fast_path:
        Evaluate the potential energy of a ``BNN`` directly in torch (:mod:`bnn_pyro.infer._logjoint`:
        the same function as Pyro's, without tracing the model at every leapfrog step) where the model
        allows it, and for NUTS sample with :class:`~bnn_pyro.infer._nuts.FlatNUTS` (HMC on the analytic path:
        :class:`~bnn_pyro.infer._flat_hmc.FlatHMC`); ``False`` forces
        Pyro's path (model tracing and Pyro's kernels). ``config["fast_path"]`` says which ran.
    init:
        Starting point: ``"reset"`` (the default for a ``BNN``: every layer's ``reset_parameters()``
        under chain ``c``'s seed ``seed + c``), ``"net"`` (a BNN's current weights, every chain),
        ``"prior"`` (a prior draw per chain; the default for a Pyro function), ``"median"``, a dict of
        site values, or a :class:`Posterior` (its mean, e.g. of an SVI or MAP fit, and its point
        values); see :mod:`bnn_pyro.infer._init`.
    chain_method:
        ``"auto"``, ``"parallel"`` (forked processes, one torch thread each), ``"sequential"``, or
        ``"vectorized"`` (NUTS/HMC on the analytic fast path: all chains as one batched computation; module docstring).
    seed, progress:
        Random seed (chain ``c`` uses ``seed + c``), and a progress bar per chain, labelled
        ``"nuts chain 0"``, ... like the other engines' (parallel chains: one line each; ``False``: off).
    resume:
        ``True`` (with ``checkpoint=``): continue each chain from its checkpoint file, bit-identically.
        Or a NUTS/HMC :class:`Posterior` of this model to extend: each chain continues from its last
        draw with its adapted step size and inverse mass matrix (``history["inverse_mass_matrix"]``),
        without warm-up (``num_warmup`` must be omitted or 0), and ``num_samples`` new draws are
        appended. Pass a ``seed`` other than the first run's, or the new segment repeats its noise.
    checkpoint, checkpoint_every:
        A folder for one checkpoint file per chain (``chain{c}.ckpt``), written every ``checkpoint_every``
        iterations (warm-up included) and after the last: the kernel's state (position, potential and
        gradient, step size, dual-averaging and mass-matrix adaptation), the iteration, the draws and
        statistics so far and the generators. ``resume=True`` continues every chain from its file; the
        draws are bit-identical to an uninterrupted run's (see :mod:`bnn_pyro.infer.checkpoint`).
    """
    kind = choice("kernel", kernel, Kernel)
    num_samples = positive_int("num_samples", num_samples)
    dense_mass, jit = flag("dense_mass", dense_mass), flag("jit", jit)
    resume_files = resume is True  # resume=True/False: from the checkpoint files; a Posterior: extend it
    if isinstance(resume, bool):
        resume = None
    elif resume is not None and checkpoint is not None:
        raise ValueError("resume: a Posterior to extend cannot be combined with checkpoint=; extend it without "
                         "checkpoint=, or pass resume=True to continue a checkpointed run from its files.")
    if resume is not None:
        # the chains continue from their last draws; the deterministic parameters stay those of the run extended
        num_warmup, init = _check_resume(resume, kind, num_warmup, num_chains, dense_mass), resume
        num_chains = resume.num_chains
    num_warmup = positive_int("num_warmup", num_samples if num_warmup is None else num_warmup,
                              allow_zero=resume is not None)
    num_chains = positive_int("num_chains", DEFAULT_NUM_CHAINS if num_chains is None else num_chains)
    how = choice("chain_method", chain_method, ChainMethod)
    if target_accept is None:
        target_accept = 0.234 if kind is Kernel.METROPOLIS else 0.8
    if not (isinstance(target_accept, (int, float)) and 0.0 < target_accept < 1.0):
        raise ValueError(f"target_accept must be a probability in (0, 1), got {target_accept!r}; try 0.8 "
                         "(NUTS/HMC; 0.9-0.99 when there are divergences) or 0.234 (Metropolis).")
    step_size = None if step_size is None else positive("step_size", step_size)
    _only(kind, Kernel.HMC, trajectory_length=trajectory_length, num_leapfrog=num_leapfrog,
          leapfrog_jitter=leapfrog_jitter)
    _only(kind, Kernel.NUTS, max_tree_depth=max_tree_depth)
    if trajectory_length is not None and num_leapfrog is not None:
        raise ValueError("hmc: give trajectory_length= or num_leapfrog=, not both.")
    trajectory_length = None if trajectory_length is None else positive("trajectory_length", trajectory_length)
    num_leapfrog = None if num_leapfrog is None else positive_int("num_leapfrog", num_leapfrog)
    max_tree_depth = positive_int("max_tree_depth", 10 if max_tree_depth is None else max_tree_depth)
    if kind is Kernel.HMC:
        leapfrog_jitter = DEFAULT_LEAPFROG_JITTER if leapfrog_jitter is None else leapfrog_jitter
        if not (isinstance(leapfrog_jitter, (int, float)) and 0.0 <= leapfrog_jitter < 1.0):
            raise ValueError(f"leapfrog_jitter must be a fraction in [0, 1), got {leapfrog_jitter!r}; try "
                             f"{DEFAULT_LEAPFROG_JITTER} (the default), or 0 for a fixed number of leapfrog steps.")
        leapfrog_jitter = float(leapfrog_jitter)
    if kind is Kernel.HMC and trajectory_length is None and num_leapfrog is None:
        num_leapfrog = DEFAULT_NUM_LEAPFROG  # bounded cost per draw, not 2 * pi / (a BNN's tiny step)
    if data.loader is not None or (data.batch_size is not None and data.batch_size < data.x.shape[0]):
        raise ValueError("mcmc needs the full data set at every step: drop batch_size= and pass tensors, "
                         "or use a stochastic-gradient method for minibatches.")
    init = resolve_init(model, init, data)
    fitted = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    point_estimate, points = estimate_points(fitted, data, init, seed=seed, progress=progress, method=kind.value)
    # one copy for every chain: its deterministic parameters (fixed) come from chain 0's start
    strategies = [init_strategy(fitted, chain_start(fitted, init, seed + c, points=c == 0)) for c in range(num_chains)]
    if points:  # the MAP's deterministic parameters (point_estimate == "map")
        set_points(fitted, points)
    joint = _logjoint.build(fitted, data.size) if flag("fast_path", fast_path) else None
    execution = chain_execution(num_chains, how, kind.value)
    if execution == "vectorized":
        _vectorized.check(kind.value, joint, data.x, data.y)
    settings = KernelSettings(kind=kind, joint=joint, target_accept=float(target_accept), step_size=step_size,
                              dense_mass=dense_mass, trajectory_length=trajectory_length, num_leapfrog=num_leapfrog,
                              max_tree_depth=max_tree_depth, jit=jit, leapfrog_jitter=leapfrog_jitter or 0.0,
                              flat_hmc=kind is Kernel.HMC and analytic_applies(joint, data.x, data.y))

    def chain_settings(c: int) -> KernelSettings:
        return replace(settings, init_strategy=strategies[c]) if resume is None else replace(  # the chain's last draw,
            settings, init_strategy=init_to_value(values={k: v[c, -1] for k, v in resume.samples.items()}),
            resume=(float(resume.sample_stats["step_size"][c, -1]), resume.history["inverse_mass_matrix"][c]))

    def run_chain(fitted, info):
        bar = (f"{kind.value} chain {info.index}", info.line) if progress else None
        return _run_chain(fitted, data, chain_settings(info.index), num_samples, num_warmup, bar, ckpts[info.index])

    config = clean_config(dict(
        kernel=kind.value, num_samples=num_samples, num_warmup=num_warmup, num_chains=num_chains,
        target_accept=float(target_accept), step_size=step_size, trajectory_length=trajectory_length,
        num_leapfrog=num_leapfrog, leapfrog_jitter=leapfrog_jitter,
        max_tree_depth=max_tree_depth if kind is Kernel.NUTS else None,
        dense_mass=dense_mass, jit=jit, fast_path=joint is not None,
        init=init if isinstance(init, str) else type(init).__name__,
        chain_method=how.value, chain_execution=execution, dataset_size=data.size, seed=seed,
        **({} if point_estimate is None else {"point_estimate": point_estimate}),
    ))
    # every chain's file checked before any chain runs; chain_method is not part of the run (same draws either way)
    run = {k: v for k, v in config.items() if k not in ("chain_method", "chain_execution")}
    batched = execution == "vectorized"  # its draws differ from the other executions': part of the run; one file
    ckpts = open_chains(checkpoint, every=checkpoint_every, resume=resume_files, num_chains=1 if batched else num_chains,
                        run=dict(method=kind.value, **run, **({"chain_execution": execution} if batched else {})))
    # one model for every chain: its deterministic parameters (fixed) come from chain 0's start
    runs = (_vectorized.run(fitted, data, [chain_settings(c) for c in range(num_chains)], kind=kind.value,
                            num_samples=num_samples, num_warmup=num_warmup, seed=seed, progress=progress, ckpt=ckpts[0])
            if batched else run_chains(fitted, num_chains, seed, run_chain, how=execution, copy_model=False,
                                       method="mcmc"))
    post = assemble(runs, method=kind.value, config=config, data=data)
    post.samples.update(deterministic_sites(fitted, post.samples, data))
    if resume is not None:  # append the new segment to the draws it continues
        post.samples = {k: torch.cat([resume.samples[k], v], dim=1) for k, v in post.samples.items()}
        post.sample_stats = {k: torch.cat([resume.sample_stats[k].to(v.dtype), v], dim=1)
                             for k, v in post.sample_stats.items()}
        config.update(num_samples=resume.num_draws + num_samples, num_warmup=resume.config.get("num_warmup"),
                      extended_by=num_samples)
    return check_mcmc(post, target_accept=float(target_accept), stacklevel=5)


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
        return {name: site["value"].detach() for name, site in trace.nodes.items()
                if site["type"] == "sample" and site["infer"].get("_deterministic") and name != "f"
                and name not in samples}

    if not replay(0, 0):
        return {}
    rows = [[replay(c, d) for d in range(draws)] for c in range(chains)]
    return {name: torch.stack([torch.stack([row[name] for row in chain]) for chain in rows]) for name in rows[0][0]}


def _size_kwargs(model, data: Data) -> dict:
    return {"dataset_size": data.size} if "dataset_size" in inspect.signature(model).parameters else {}


def _check_resume(resume, kind: Kernel, num_warmup, num_chains, dense_mass) -> int:
    """``resume=``: a NUTS/HMC posterior of the same kernel that stored its adapted mass matrix."""
    if not isinstance(resume, Posterior) or resume.method != kind.value or kind is Kernel.METROPOLIS:
        raise ValueError(f"resume: expected True (continue from the checkpoint= files) or a Posterior of "
                         f"method={kind.value!r} (nuts or hmc) to extend, got "
                         f"{getattr(resume, 'method', type(resume).__name__)!r}; fit one with bp.fit(method='nuts').")
    if "inverse_mass_matrix" not in resume.history:
        raise ValueError("resume: this posterior has no history['inverse_mass_matrix'] (fitted before it was "
                         "stored); refit it to extend it.")
    if num_warmup not in (None, 0):
        raise ValueError(f"num_warmup: must be omitted or 0 with resume= (the chains keep their adapted step size "
                         f"and mass matrix), got {num_warmup!r}.")
    dense = resume.history["inverse_mass_matrix"].dim() == 3
    if num_chains not in (None, resume.num_chains) or dense_mass != dense:
        raise ValueError(f"resume: num_chains and dense_mass must be those of the posterior extended "
                         f"({resume.num_chains} chains, dense_mass={dense}); omit num_chains to keep them.")
    return 0


def fit_nuts(model, data: Data, **config) -> Posterior:
    """``bp.fit(..., method="nuts")``: :func:`fit` with ``kernel="nuts"``."""
    return fit(model, data, kernel=Kernel.NUTS, **config)


def fit_hmc(model, data: Data, **config) -> Posterior:
    """``bp.fit(..., method="hmc")``: :func:`fit` with ``kernel="hmc"``."""
    return fit(model, data, kernel=Kernel.HMC, **config)


def fit_metropolis(model, data: Data, **config) -> Posterior:
    """``bp.fit(..., method="metropolis")``: :func:`fit` with ``kernel="metropolis"``."""
    return fit(model, data, kernel=Kernel.METROPOLIS, **config)


def _only(kind: Kernel, owner: Kernel, **options) -> None:
    for name, value in options.items():
        if value is not None and kind is not owner:
            raise ValueError(f"{name}= applies to method={owner.value!r} only, not {kind.value!r}; drop it.")


# ---------------------------------------------------------------------- running chains
@dataclass(frozen=True)
class KernelSettings:
    """One chain's kernel: the method, the compiled log joint (``None``: Pyro's path), the adaptation target,
    the step size (``None``: found), the mass matrix, HMC's trajectory, NUTS's depth, the start, and
    ``resume``: ``(step size, inverse mass matrix)`` of the chain being extended."""

    kind: Kernel
    joint: object | None
    target_accept: float
    step_size: float | None
    dense_mass: bool
    trajectory_length: float | None
    num_leapfrog: int | None
    max_tree_depth: int
    jit: bool
    init_strategy: Callable | None = None
    resume: tuple[float, torch.Tensor] | None = None
    flat_hmc: bool = False  # HMC on the analytic path: FlatHMC (bnn_pyro.infer._flat_hmc), not Pyro's HMC
    leapfrog_jitter: float = 0.0  # HMC: each draw's leapfrog count varies by this fraction (jittered_steps)


def _make_kernel(model, s: KernelSettings, model_args: tuple):
    """The chain's kernel and, for Pyro's kernels on the fast path, the ``initial_params`` and ``transforms``
    that a kernel given its ``potential_fn`` needs (``None`` otherwise)."""
    if s.kind is Kernel.METROPOLIS:
        return Metropolis(model, init_strategy=s.init_strategy, step_size=s.step_size, target_accept_prob=s.target_accept,
                           dense=s.dense_mass, jit=s.jit, joint=s.joint), None, None
    if s.kind is Kernel.NUTS and s.joint is not None:  # the fast path: NUTS over one flat vector
        kernel = FlatNUTS(model, s.joint, init_strategy=s.init_strategy, step_size=s.step_size,
                          target_accept_prob=s.target_accept, max_tree_depth=s.max_tree_depth,
                          dense_mass=s.dense_mass, jit=s.jit)
        kernel.resume = s.resume
        return kernel, None, None
    if s.flat_hmc:  # the fast path's HMC over one flat vector
        kernel = FlatHMC(model, s.joint, init_strategy=s.init_strategy, step_size=s.step_size,
                         target_accept_prob=s.target_accept, dense_mass=s.dense_mass, num_leapfrog=s.num_leapfrog,
                         trajectory_length=s.trajectory_length, jit=s.jit, leapfrog_jitter=s.leapfrog_jitter)
        kernel.resume = s.resume
        return kernel, None, None
    options = dict(step_size=s.step_size or 1.0, adapt_step_size=True, adapt_mass_matrix=True, full_mass=s.dense_mass,
                   target_accept_prob=s.target_accept)
    if s.kind is Kernel.NUTS:
        options["max_tree_depth"] = s.max_tree_depth
    else:
        options["trajectory_length"] = s.trajectory_length
    kernel, params, transforms = pyro_kernel(s.kind.value, model, joint=s.joint, jit=s.jit, init_strategy=s.init_strategy,
                                             model_args=model_args, resume=s.resume, **options)
    kernel.fixed_num_steps, kernel.leapfrog_jitter = s.num_leapfrog, s.leapfrog_jitter
    return kernel, params, transforms


def _run_chain(model, data: Data, settings: KernelSettings, num_samples: int, num_warmup: int,
               bar: tuple[str, int] | None, ckpt: Checkpoint | None = None):
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
    """Our loop over Pyro's ``MCMCKernel`` interface (``setup``, ``sample``, ``cleanup``): what Pyro's ``MCMC``
    does for one chain (distribution validation off, the draws mapped back to the constrained space), and
    the checkpoint/resume that ``MCMC`` cannot give (it starts every run at its first warm-up step)."""
    kernel, params, transforms = _make_kernel(quiet_model(model, data.size), settings, (data.x, data.y))
    total = num_warmup + num_samples
    label, line = bar or ("", 0)  # our bar, labelled per chain like the other engines' (Pyro's says "Warmup"/"Sample")
    with progress_bar(total, label, bar is not None, position=line) as shown, pyro.validation_enabled(False):
        if params is not None:
            kernel.initial_params = params
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
                shown.set_postfix({"phase": "warmup" if i < num_warmup else "sample", **kernel.logging()},
                                  refresh=False)
                shown.update()
            if ckpt is not None and ckpt.due(i + 1, total):
                _save(ckpt, i + 1, kernel, params, kept, draws)
        mass = getattr(kernel, "inverse_mass_matrix", None)  # the adapted one (NUTS/HMC: for resume=Posterior)
        transforms = transforms or kernel.transforms or {}
        kernel.cleanup()
    samples = {k: torch.stack(v) for k, v in kept.items()}
    samples = {k: transforms[k].inv(v) if k in transforms else v for k, v in samples.items()}
    point = point_values(model, data.x, data.y, data.size)
    history = {} if mass is None else {"inverse_mass_matrix": next(iter(mass.values())).detach().clone()}
    return ChainRun(model, samples, point, history, stats=sample_stats(draws))


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
    part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    kernel.load_state_dict(part("kernel/"), meta["kernel"])
    for k, v in part("draws/").items():
        kept[k][:] = list(v)
    draws[:] = [DrawStats(*d) for d in meta["stats"]]
    return meta["step"], part("position/")
