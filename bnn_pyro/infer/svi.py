"""Stochastic variational inference: ``bp.fit(model, x, y, method="svi", ...)``.

Maximizes the evidence lower bound ``ELBO(q) = E_q[log p(y, w | x)] - E_q[log q(w)]`` over a guide
``q`` with a torch optimizer, on minibatches scaled by ``dataset_size / batch`` (unbiased).

Guides (``guide=``): ``"mean_field"`` (``AutoNormal``: independent Gaussians), ``"low_rank"``
(``AutoLowRankMultivariateNormal``, ``guide_rank=``), ``"full_rank"`` (``AutoMultivariateNormal``),
``"map"`` (``AutoDelta``: a point mass, i.e. MAP), an ``AutoGuide`` class, or any guide callable. The default
(``guide=None``) is ``"full_rank"`` for a Pyro function model of at most :data:`FULL_RANK_MAX_DIM` latent coordinates
on full-batch tensors, ``"mean_field"`` otherwise (a ``BNN``, a loader, minibatches, a larger model;
:func:`~bnn_pyro.infer.svi_lr.default_guide`): such a model starts at the Laplace approximation, which a full-rank guide
holds exactly, while a mean-field guide is several times too narrow wherever the coefficients correlate (on the
reference suite's regressions: sds 0.13-0.21 of the exact ones; full-rank 0.96-1.0, ``docs/reference_suite.md``). A
guide given is used as given; ``post.config["guide"]`` holds the one used.

ELBOs (``elbo=``):

- ``"trace"``: reparameterized Monte Carlo gradients (``Trace_ELBO``); the default.
- ``"mean_field"``: the KL term in closed form where one exists
  (:class:`~bnn_pyro.infer.reparam.MeanFieldELBO`; with ``guide="mean_field"`` every real-valued site's
  Gaussian is compared with its prior in closed form). The default with a local ``estimator``.
- ``"reinforce"``: the score-function (REINFORCE / black-box VI, Ranganath et al. 2014) estimator
  ``grad = E_q[(log p - log q - b) grad log q]``, forced on every site even when a reparameterized
  gradient exists (:mod:`bnn_pyro.infer.score`): per-site Rao-Blackwellization with a mean-field
  guide and a leave-one-out baseline ``b`` over ``num_particles`` draws (16 by default with this
  ELBO; a decaying average of past costs with one particle). Still noisier than ``"trace"``, and each
  step costs 16 particles: it exists for non-reparameterizable models and for comparison, not for speed.

Learning rate (``lr_schedule=``): ``"cosine"`` by default, from ``lr`` down to 1% of it over the run's
``num_steps`` (or ``epochs`` converted to steps). A constant rate leaves Adam's stationary noise in
the answer: on exact Bayesian linear regression (200 points, 3 inputs, ``num_steps=4000``,
``lr=1e-2``) the fitted means ended 0.13-0.30 posterior sd from the exact ones with
``lr_schedule="constant"`` and 0.03-0.05 with ``"cosine"`` (3 seeds each, full-rank and mean-field
guides; tests/infer/test_svi.py checks the default). ``lr_schedule="constant"`` keeps the old behaviour.

Estimators (``estimator=``, with ``guide="mean_field"`` on a ``BNN``; see
:mod:`bnn_pyro.infer.reparam`): ``"sample"`` draws one weight per step for the whole minibatch (the
default); ``"local_reparam"`` (Kingma et al. 2015) samples a ``Linear`` layer's pre-activations per
example, ``"flipout"`` (Wen et al. 2018) decorrelates one shared weight perturbation per example by
random signs. Both are unbiased for the same ELBO with a lower-variance gradient; convolutions (and a
``Linear`` on inputs with more than two dimensions) share weights within an example, so there
``"local_reparam"`` uses flipout.

Empirical Bayes (``empirical_bayes=True`` or ``"shared"``; see :mod:`bnn_pyro.infer.empirical_bayes`):
the weight priors' scales become hyperparameters learned by the ELBO (type-II maximum likelihood), one
per parameter tensor or one shared; ``post.config["prior_scales"]`` holds the learned values.

The fast path (``fast_path=True``, the default): with ``elbo="trace"``, ``estimator="sample"`` and a
mean-field or MAP guide on a ``BNN`` without hierarchical priors or BatchNorm, the ELBO is computed
directly in torch (:mod:`bnn_pyro.infer._logjoint`) instead of by tracing the model and guide: the
same estimator, the same draws for the same seed (``elbo="mean_field"`` with a MAP guide is the same
estimator, and takes it too); for a mean-field guide on a stack of ``nn.Linear`` layers
and elementwise activations with Normal priors and a Gaussian likelihood its gradient is analytic
(:mod:`bnn_pyro.infer._analytic`) and the chain runs the flat path (:mod:`bnn_pyro.infer._svi_flat`: the guide's
means and scales as two flat tensors, no autograd, Adam's fused kernel, a loop without per-step Pyro work; the
values go back to the parameter store at checkpoints and at the end; not with ``distributed=True``). With
``elbo="mean_field"`` and a mean-field guide the flat path computes the closed-form KL of
:class:`~bnn_pyro.infer.reparam.MeanFieldELBO` (the same estimator and draws; learned noise by Monte Carlo) and is
the only fast path: where it does not cover the model (or with ``distributed=True``) Pyro's path runs. Fused Adam
rounds differently from Pyro's path's multi-tensor Adam, so seeded losses and draws differ from
``fast_path=False`` by float rounding (timings in ``benchmarks/results/fast_path/results.md``). ``config["fast_path"]``
says whether it ran.

Start (``init=``): a ``BNN``'s guide starts at its layers' fresh initialization (``"reset"``); a Pyro function model's
at the Laplace approximation (``"laplace"``, :mod:`bnn_pyro.infer.svi_start`: the mode by L-BFGS and Newton steps,
the guide's scales from the Hessian there), because its parameters may live on any scale and Adam moves each by about
``lr`` per step: from a prior draw, a regression on a covariate near 100 ended hundreds of posterior sds from the
exact answer after 1,000 steps (``tests/infer/test_reference_posteriors.py``). ``config["init_converged"]`` says
whether the mode was found; a mean-field guide too narrow for the posterior's correlations there is warned about.

Convergence (a full-rank guide on a Pyro function of at most :data:`FULL_RANK_MAX_DIM` coordinates on full-batch
tensors): under the cosine schedule the parameters freeze at the end wherever they are, so the ELBO trace cannot show
a run that stopped short (eight schools at the defaults stopped 0.10-0.19 guide sds short at four seeds of five). So
the fit ends, for such a guide or a mean-field or low-rank one within :data:`~bnn_pyro.infer.svi_refine.MAX_DIM`
coordinates and :data:`~bnn_pyro.infer.svi_refine.MAX_WORK` coordinates x rows, with damped fixed-point iterations of
Gaussian VI from exact Hessians at 1,000 fixed draws (:mod:`bnn_pyro.infer.svi_refine`), kept only where the ELBO on
those draws does not fall; ``post.config["guide_refinement"]`` says per chain how many steps were kept, the ELBO's
change and why they stopped (or why it was skipped: the guide is then left as trained; where the fit's own cost
leaves no room for it, where the model cannot be batched by ``torch.func.vmap``, or where the model raises). The refinement and the gap, on either path, spend at most
:data:`~bnn_pyro.infer.svi_gap_cg.FIT_SHARE` of the fit's own gradient passes
(:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`): a short fit gets fewer refinement evaluations, or none, or no
check, and the records name that bound. Past those
bounds (up to :data:`~bnn_pyro.infer.svi_gap_cg.MAX_WORK` coordinates x rows, any number of coordinates) a mean-field
guide's sds are first taken to their fixed point ``1 / s_i^2 = E_q[-d2 log p / dz_i^2]`` by one damped step from
Hessian-vector products with the unit vectors (:mod:`bnn_pyro.infer.svi_refine_scale`, where its cost leaves the
solves after it :data:`~bnn_pyro.infer.svi_gap_cg.SCALE_KEEP` iterations of the check's share of the fit, or all
they have where fewer; recorded as ``"scale"`` inside the chain's record,
with the passes it spent, which the mean's step and the gap are charged), then a mean-field or low-rank guide's
mean by damped Newton steps solved by conjugate gradients (after a rejected candidate with ``H`` from more draws, as
the fit's share allows: the record's ``escalated_hessian_draws``, with the ``passes`` it spent; past the evaluations
the cost rule charges, more while what it spent leaves that share room: ``"share spent"`` where it ran out), a
low-rank guide's covariance left as trained
(:mod:`bnn_pyro.infer.svi_refine_cg`), recorded in the same list with the step's own Monte Carlo error
(:data:`STEP_SE`). A full-rank guide past those bounds (up to :data:`FULL_RANK_MAX_DIM` coordinates) gets the same
mean's step, its covariance left as trained, and then the dense gap on the step's own draws (its standard error from
their antithetic pairs: :mod:`bnn_pyro.infer.svi_gap`), where that cost rule leaves room;
where it does not, the record says the step was skipped and why (the dense gap alone then runs, as before). It runs only
where the flat fast path did not (the engine's condition reads both: that path is for a ``BNN`` and the refinement for
a Pyro function, so a ``BNN``'s guide is never refined, whichever path trained it), and not on a guide given as an
``AutoGuide`` class or a callable, which is used as given (where the refinement would otherwise run, the record says
so: :data:`GIVEN_GUIDE`). Then, for the full-rank and low-rank guides, the ELBO's gradient in the guide's mean,
turned into the Newton step to the optimum of the guide's family in the guide's own sds
(:mod:`bnn_pyro.infer.svi_gap`; a low-rank guide's with the expected Hessian, since its covariance is not the inverse
curvature at its optimum), is stored per chain in ``post.history["guide_gap"]`` (unconstrained coordinates, named in
``post.config["guide_coordinates"]``) and warned about past :data:`~bnn_pyro.infer._health.GAP_MAX`. Past the
refinement's bounds a mean-field or low-rank guide's gap (on a Pyro function on full-batch tensors, of any size up to
:data:`~bnn_pyro.infer.svi_gap_cg.MAX_WORK` coordinates x rows and a share of the fit's own cost) is taken by
conjugate gradients without dense Hessians (:mod:`bnn_pyro.infer.svi_gap_cg`). Which path, from the guide's
unconstrained coordinates, is decided by one rule (:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`) for the engine,
the refinements and the gap; the refinement and the gap of a chain take its seed (``seed + index``), so the gap
measures on the refinement's draws. ``post.config["guide_gap"]`` holds one record per chain wherever the gap was
considered, of one shape (:attr:`bnn_pyro.infer.svi_gap.Gap.record`): ``method`` (``"dense"``, ``"cg"``, or ``None``
where none was taken), ``reason`` (why there is no verdict, or ``"not checked: ..."`` past the cost bounds, or
``None``), and the path's figures (draws; the conjugate-gradient path's batches, Hessian draws, iterations, residual).
Where the gap cannot be evaluated the fit still returns, with NaN gaps and the reason there. Within the refinement's
bounds a mean-field guide is not checked (its diagonal covariance is not the inverse curvature where the posterior
correlates, and there the refinement runs).

``num_chains`` independent restarts (seeds ``seed``, ``seed + 1``, ...) each give ``num_samples``
draws from their guide; as chains of one :class:`~bnn_pyro.Posterior` they make R-hat meaningful.
Each fit runs in its own scope of Pyro's parameter store, so fits never interfere.

Example
-------
>>> post = bp.fit(model, x, y, method="svi", guide="low_rank", num_steps=3000, lr=1e-2, seed=0)
>>> post.history["loss"]          # (chains, steps): the negative ELBO, per step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import ClassVar

import pyro
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, autoguide

from bnn_pyro.infer import (
    _density,
    _logjoint,
    _svi_flat,
    svi_gap,
    svi_gap_cg,
    svi_refine,
    svi_refine_cg,
    svi_refine_scale,
    svi_start,
)
from bnn_pyro.infer import distributed as dp
from bnn_pyro.infer._common import Data, call_model, clean_config, init_strategy, is_latent, point_values, traced
from bnn_pyro.infer._health import GAP, GAP_SE, check_svi
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer.checkpoint import Checkpoint, open_chains, restore_svi, save_svi
from bnn_pyro.infer.contract import Engine, Loop, LossInfo, PotentialRunOptions, drive, entry
from bnn_pyro.infer.driver import ChainRun
from bnn_pyro.infer.empirical_bayes import LearnedPriorScales
from bnn_pyro.infer.empirical_bayes import resolve as resolve_empirical_bayes
from bnn_pyro.infer.guide_density import unconstrained_size
from bnn_pyro.infer.health_off_data import check_gaussian_guide_off_data
from bnn_pyro.infer.health_spread import check_narrow
from bnn_pyro.infer.kl_warmup import KLWeight, warmup_steps
from bnn_pyro.infer.optim import DEFAULT_SCHEDULE, Optimizer, Schedule, check_lr, make_optimizer, make_schedule  # noqa: F401 (re-exported)
from bnn_pyro.infer.reparam import Estimator, GaussianSites, MeanFieldELBO, WeightNoise, check_estimator
from bnn_pyro.infer.score import ScoreFunction, ScoreFunctionELBO
from bnn_pyro.infer.svi_lr import DEFAULT_LR, FACTOR_ROW_FREE, FULL_RANK_MAX_DIM, default_guide, default_lr
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, flag, positive, positive_int

__all__ = [
    "fit",
    "SVIConfig",
    "GuideKind",
    "ElboKind",
    "REINFORCE_PARTICLES",
    "DEFAULT_STEPS",
    "LAPLACE",
    "DEFAULT_LR",
    "FACTOR_ROW_FREE",
    "default_lr",
    "default_guide",
    "FULL_RANK_MAX_DIM",
]

DEFAULT_STEPS = 5000  # num_steps' default (fit's docstring says why)
LAPLACE = "laplace"  # init= value: start at the Laplace approximation (svi_start; the default for a Pyro function)
REINFORCE_PARTICLES = 16  # num_particles' default with elbo="reinforce" (measured on exact BLR: see score.py)


class GuideKind(str, Enum):
    MEAN_FIELD = "mean_field"
    LOW_RANK = "low_rank"
    FULL_RANK = "full_rank"
    MAP = "map"


class ElboKind(str, Enum):
    TRACE = "trace"
    MEAN_FIELD = "mean_field"
    REINFORCE = "reinforce"


@dataclass(frozen=True)
class SVIConfig(PotentialRunOptions):
    """The options of ``method="svi"`` and their defaults (documented in :func:`fit`)."""

    RENAMED: ClassVar[dict[str, str]] = {"rank": "guide_rank"}  # deprecated alias, one release (contract.entry)

    guide: object = None
    elbo: str | None = None
    estimator: str = "sample"
    empirical_bayes: bool | str = False
    num_steps: int | None = None
    epochs: int | None = None
    lr: float | None = None
    optimizer: object = "adam"
    lr_schedule: object = DEFAULT_SCHEDULE
    num_particles: int | None = None
    vectorize_particles: bool | None = None
    num_chains: int = 1
    num_samples: int | None = None
    guide_rank: int | None = None
    init: object = None
    init_scale: float = 0.01
    kl_warmup: float = 0.0
    baseline_beta: float = 0.9
    distributed: bool = False


@entry(SVIConfig)
def fit(model, data: Data, cfg: SVIConfig) -> Posterior:
    """Fit ``model`` by SVI and return a :class:`~bnn_pyro.Posterior` (see the module docstring).

    Parameters
    ----------
    guide, elbo:
        See the module docstring (``guide=None``, the default: ``"full_rank"`` on a small Pyro function with
        full-batch tensors, ``"mean_field"`` otherwise). ``guide_rank`` sets the low-rank guide's rank (default ``sqrt(dim)``; formerly
        ``rank``, still taken with a ``FutureWarning``).
        ``elbo`` defaults to ``"trace"``, or ``"mean_field"`` with a local ``estimator``.
    estimator:
        ``"sample"`` (default), ``"local_reparam"`` or ``"flipout"`` (``guide="mean_field"`` and a
        ``BNN`` only; particles are then evaluated one after another).
    empirical_bayes:
        ``False`` (default), ``True`` (one learned prior scale per parameter tensor) or ``"shared"``
        (one learned multiplier of every prior scale).
    num_steps, epochs:
        Length of the run in optimizer steps, or in passes over the data (one of the two; default 5,000
        steps). Why 5,000: with 1,000 a mean-field guide on a small, low-noise regression set still underfits (its
        learned noise too large; ``benchmarks/results/svi_defaults/results.md``: test LL well below Laplace's and the
        ensemble's, a gap that 5,000 steps closes), and from the Laplace start the non-centered eight schools
        posterior needs more than 1,000 steps at ``lr=1e-2`` to move its scale ``tau`` from the joint mode to the
        posterior's bulk (``tests/infer/test_reference_posteriors.py``). Re-measured at 5,000 steps: level with or
        above Laplace and the ensemble on diabetes, friedman1 and the low-noise set
        (``benchmarks/results/svi_defaults/current_defaults.md``).
    lr, optimizer, lr_schedule:
        Learning rate (default 1e-2, :data:`DEFAULT_LR`; for ``"full_rank"`` and ``"low_rank"`` guides whose
        covariance factor has more than :data:`FACTOR_ROW_FREE` free entries per row, ``1e-2 * sqrt(10 / m)``:
        :func:`default_lr` says why; a quarter of that for a full-rank guide that starts at the Laplace approximation of a Pyro
        function (where the mode search converged), :data:`~bnn_pyro.infer.svi_lr.CONVERGED_START_LR_FACTOR`; ``post.config["lr"]`` holds the rate used; what ``lr`` means:
        :mod:`bnn_pyro.infer.optim`, where ``"auto"`` is refused for Adam); ``"adam"`` (default), ``"adamw"``, ``"sgd"`` or a callable
        ``params -> torch.optim.Optimizer``; ``"cosine"`` (the default: to 1% of ``lr`` at the last step,
        see the module docstring), ``"constant"``,
        ``"exponential"`` (to 1% of ``lr``) or a callable ``optimizer -> LRScheduler``.
    num_particles, vectorize_particles:
        Monte Carlo samples per ELBO estimate (default 1; 16 with ``elbo="reinforce"``), evaluated as one
        batch (the default for a ``BNN``).
    num_chains, num_samples:
        Independent restarts, and draws per restart from the fitted guide (default 1,000; 1 for MAP).
    init, init_scale:
        Initial guide location: ``"reset"`` (the default for a ``BNN``: every layer's
        ``reset_parameters()`` under chain ``c``'s seed ``seed + c``), ``"net"`` (the net's current
        weights: pass a pretrained net to start from it), ``"laplace"`` (the posterior mode by L-BFGS and the
        Laplace covariance there as the guide's location and scales: the default for a Pyro function, whose
        parameters may live on any scale; see :mod:`bnn_pyro.infer.svi_start`), ``"prior"`` (a prior draw),
        ``"median"``, a dict of site values, or a :class:`Posterior` (its mean); see :mod:`bnn_pyro.infer._init`.
        ``init_scale`` is the initial guide standard deviation (with ``"laplace"``, where no Laplace scales are
        set: a guide callable, or more than ``svi_start.MAX_DIM`` coordinates).
    kl_warmup:
        KL annealing: the fraction of ``num_steps`` over which the weight of the KL term rises linearly from
        ``1 / W`` to 1 (Blundell et al. 2015; Sønderby et al. 2016; :mod:`bnn_pyro.infer.kl_warmup`), in ``[0, 1)``;
        after it the objective is the ELBO itself. Default 0 (none), because a warm-up stops short of the ELBO's
        optimum rather than finding a better one: on 90 training rows of friedman1 a warm-up over half the run ended
        at a worse ELBO with a better test LL, and at 4x the steps both runs end at the same ELBO and test LL
        (``benchmarks/results/svi_defaults/warmup_elbo.md``). With ``elbo="mean_field"`` a warm-up runs Pyro's path
        (the flat fast path weighs the Monte Carlo KL only).
    baseline_beta:
        With ``elbo="reinforce"`` and ``num_particles=1`` only: the decay of the average past cost used as
        the baseline (with several particles the baseline is leave-one-out; see :mod:`bnn_pyro.infer.score`).
    seed, progress:
        Random seed, and a progress bar (``progress=False`` turns it off).
    distributed:
        Data-parallel SVI over the ranks of an initialized ``torch.distributed`` process group (see
        :mod:`bnn_pyro.infer.distributed`): ``x``, ``y`` are this rank's shard (or its own loader,
        with ``dataset_size`` the total), gradients are averaged over ranks at every step, and every
        rank returns the same ``Posterior``.
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps and
        after the last; ``resume=True`` continues each chain from its file, bit-identically (see
        :mod:`bnn_pyro.infer.checkpoint`). Not with ``empirical_bayes``.
    fast_path:
        Evaluate the ELBO of a mean-field or MAP guide with ``elbo="trace"`` (or ``"mean_field"``, see the module
        docstring) directly in torch (:mod:`bnn_pyro.infer._logjoint`: the same estimator as Pyro's path, faster per
        step) where the model allows it; ``False`` forces Pyro's path. ``config["fast_path"]`` says which ran.
    """
    if cfg.num_steps is not None and cfg.epochs is not None:
        raise ValueError("svi: give num_steps= or epochs=, not both.")
    num_steps, epochs, reduce = cfg.num_steps, cfg.epochs, None
    if cfg.distributed:
        data, reduce = dp.prepare(data), dp.average_gradients
    if epochs is not None:
        epochs = positive_int("epochs", epochs)
        if cfg.distributed:
            raise ValueError(
                "epochs: not with distributed=True (the ranks' shards may need different numbers of "
                "steps per epoch); give num_steps= instead."
            )
        if data.loader is not None and not hasattr(data.loader, "__len__"):
            raise ValueError(
                "epochs: needs a loader with a length (len(loader)); with a generator or an "
                "IterableDataset give num_steps= instead."
            )
        steps_per_epoch = (
            math.ceil(data.size / (data.batch_size or data.size)) if data.loader is None else len(data.loader)
        )
        num_steps = epochs * steps_per_epoch
    num_steps = positive_int("num_steps", DEFAULT_STEPS if num_steps is None else num_steps)
    warmup = warmup_steps(cfg.kl_warmup, num_steps)
    num_chains = positive_int("num_chains", cfg.num_chains)
    estimator = choice("estimator", cfg.estimator, Estimator)
    sharing = resolve_empirical_bayes(cfg.empirical_bayes)
    elbo = cfg.elbo
    if elbo is None:
        elbo = "trace" if estimator is Estimator.SAMPLE else "mean_field"
    elbo_kind = choice("elbo", elbo, ElboKind)
    x0, y0 = data.first()
    sites = {
        n: s
        for n, s in traced(partial(call_model, model, dataset_size=data.size), x0, y0).nodes.items()
        if is_latent(s)
    }
    names = list(sites)
    dim = sum(s["value"].numel() for s in sites.values())
    guide = cfg.guide
    if guide is None:  # full-rank on a small Pyro function, mean-field otherwise (default_guide says why)
        full_batch = data.loader is None and (data.batch_size is None or data.batch_size >= data.size)
        guide = default_guide(
            plain_function=not isinstance(model, BNN),
            dim=dim,
            full_batch=full_batch and not cfg.distributed,
            elbo=elbo_kind.value,
            estimator=estimator.value,
        )
    guide_kind = guide if not isinstance(guide, str) else choice("guide", guide, GuideKind)
    num_particles = cfg.num_particles
    if num_particles is None:  # the score-function ELBO needs several draws for its leave-one-out baseline
        num_particles = REINFORCE_PARTICLES if elbo_kind is ElboKind.REINFORCE else 1
    num_particles = positive_int("num_particles", num_particles)
    vectorize_particles = cfg.vectorize_particles
    if estimator is not Estimator.SAMPLE:
        check_estimator(
            model,
            guide_is_mean_field=guide_kind is GuideKind.MEAN_FIELD,
            reinforce=elbo_kind is ElboKind.REINFORCE,
            vectorize_particles=vectorize_particles,
        )
        vectorize_particles = False
    if sharing is not None and guide_kind is GuideKind.MAP:
        raise ValueError(
            "empirical_bayes needs a guide with spread (mean_field, low_rank, full_rank): with "
            "guide='map' the joint maximum over weights and prior scale is degenerate (both go to 0)."
        )
    if elbo_kind is ElboKind.REINFORCE and guide_kind is GuideKind.MAP:
        raise ValueError(
            "elbo='reinforce' needs a guide with a density, but guide='map' is a point mass (its score is "
            "zero). Use elbo='trace' with guide='map', or guide='mean_field' with elbo='reinforce'."
        )
    num_samples = cfg.num_samples
    if num_samples is None:
        num_samples = 1 if guide_kind is GuideKind.MAP else 1000
    num_samples = positive_int("num_samples", num_samples)
    # a Pyro function model starts at the Laplace approximation by default (svi_start's docstring says why)
    laplace = (cfg.init is None and not isinstance(model, BNN)) or (isinstance(cfg.init, str) and cfg.init == LAPLACE)
    init = LAPLACE if laplace else resolve_init(model, cfg.init, data)
    if vectorize_particles is None:
        vectorize_particles = isinstance(model, BNN) and not _has_batchnorm(model)
    # a Pyro function's Laplace start, once for every chain (deterministic: svi_start.laplace_start); a BNN's per chain
    shared_start = None
    if laplace and not isinstance(model, BNN):
        with pyro.get_param_store().scope():
            shared_start = svi_start.laplace_start(model, data)
    if cfg.lr is None:  # a guide with a covariance factor gets a lower rate on a large model (default_lr says why)
        converged = shared_start is not None and shared_start.converged and shared_start.cov is not None
        lr = default_lr(guide_kind, dim, cfg.guide_rank, converged_start=converged)
    else:
        lr = check_lr(cfg.lr, method="svi")
    optimizer, lr_schedule = cfg.optimizer, cfg.lr_schedule
    config = clean_config(
        dict(
            guide=getattr(guide_kind, "value", guide_kind),
            elbo=elbo_kind.value,
            num_steps=num_steps,
            lr=lr,
            optimizer=getattr(optimizer, "value", optimizer),
            lr_schedule=getattr(lr_schedule, "value", lr_schedule),
            num_particles=num_particles,
            vectorize_particles=vectorize_particles,
            num_chains=num_chains,
            num_samples=num_samples,
            guide_rank=cfg.guide_rank,
            estimator=estimator.value,
            empirical_bayes=False if sharing is None else sharing.value,
            init=init if isinstance(init, str) else type(init).__name__,
            init_scale=cfg.init_scale,
            kl_warmup=cfg.kl_warmup,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=cfg.seed,
            **(dp.config() if cfg.distributed else {}),
        )
    )
    if cfg.checkpoint is not None and sharing is not None:
        raise ValueError(
            "checkpoint: not supported with empirical_bayes yet; pass checkpoint=None or empirical_bayes=False."
        )
    # elbo="mean_field" with a mean-field guide (closed-form KL) only where the flat path computes it; with a MAP
    # guide it is Trace_ELBO's estimator (no KL of a point mass)
    closed_kl = elbo_kind is ElboKind.MEAN_FIELD and guide_kind is GuideKind.MEAN_FIELD
    fast = (
        flag("fast_path", cfg.fast_path)
        and elbo_kind is not ElboKind.REINFORCE
        and estimator is Estimator.SAMPLE
        and sharing is None
        and not (warmup and closed_kl)
        and guide_kind in (GuideKind.MEAN_FIELD, GuideKind.MAP)
    )
    joint = _logjoint.build(model, data.size) if fast else None
    # the closed-form KL and the KL warm-up only on the flat path (_logjoint's loss has neither)
    fast = joint is not None and (
        not (closed_kl or warmup) or not cfg.distributed and _svi_flat.FlatMeanField.covers(joint, x0, y0)
    )
    config["fast_path"] = fast
    warm_starts: list[svi_start.LaplaceStart] = []
    # a Pyro function on full-batch tensors: its full-rank guide's Newton gap is checked (up to FULL_RANK_MAX_DIM), a
    # low-rank one's with the dense expected Hessian within svi_refine's bounds, and past them any of the three's by
    # conjugate gradients up to svi_gap_cg.MAX_WORK coordinates x rows and the fit's share (svi_gap; a full-rank
    # guide's dense gap where that share leaves no room)
    function_full_batch = (
        not isinstance(model, BNN)
        and not fast
        and data.loader is None
        and (data.batch_size is None or data.batch_size >= data.size)
        and not cfg.distributed
        and sharing is None
        and not warmup
    )
    # the path (dense, conjugate gradients, none) from the guide's unconstrained coordinates, which newton_gap and
    # refine_mean count too (an LKJCholesky or simplex site has fewer than its constrained elements): one rule,
    # svi_gap_cg.choose_path, bounded by the fit's own gradient passes
    coords = unconstrained_size(sites)
    fit_passes = _fit_passes(num_steps, num_particles, data.size, vectorized=vectorize_particles and num_particles > 1)
    path = svi_gap_cg.choose_path(
        coords,
        data.size,
        fit_passes=fit_passes,
        full_rank=guide_kind is GuideKind.FULL_RANK,
        gap=guide_kind is not GuideKind.MEAN_FIELD,  # within svi_refine's bounds its gap is not taken (gap_checked)
    )
    small_function = function_full_batch and coords <= FULL_RANK_MAX_DIM
    factored = function_full_batch and guide_kind in (GuideKind.MEAN_FIELD, GuideKind.LOW_RANK)
    full_rank = small_function and guide_kind is GuideKind.FULL_RANK
    by_cg = (factored or full_rank) and path.kind == "cg"  # a full-rank guide's: past svi_refine's bounds only
    gap_checked = (
        small_function and guide_kind in (GuideKind.FULL_RANK, GuideKind.LOW_RANK) and path.kind == "dense" or by_cg
    )
    # and its Gaussian guides within svi_refine's bounds are refined (svi_refine), in the evaluations the fit's cost
    # leaves (choose_path; none: the record names that bound, review 15); a guide given as a class or callable is used
    # as given, and the record says so
    refine_guide = small_function and guide_kind in (GuideKind.FULL_RANK, GuideKind.MEAN_FIELD, GuideKind.LOW_RANK)
    # (a full-rank guide past those bounds gets the mean's step by conjugate gradients where the cost rule leaves room
    # for it, and otherwise the same record naming the bound: choose_path's reason)
    refine_skipped = (
        refine_guide
        and (coords <= svi_refine.MAX_DIM or full_rank)
        and (path.kind == "none" or path.kind == "dense" and path.reason is not None)
    )
    gap_skipped = path.kind == "none" and (factored or full_rank)
    given_guide = small_function and coords <= svi_refine.MAX_DIM and not isinstance(guide_kind, GuideKind)
    ckpts = open_chains(
        cfg.checkpoint,
        every=cfg.checkpoint_every,
        resume=cfg.resume,
        num_chains=num_chains,
        run=dict(method="svi", **config),
    )

    def init_state(fitted, info) -> _State:
        if laplace:
            start = shared_start if shared_start is not None else svi_start.laplace_start(fitted, data)
            q = _make_guide(fitted, guide_kind, start.init_loc_fn(), cfg.init_scale, cfg.guide_rank)
            start.set_scales(q, x0, y0)
            warm_starts.append(start)
        else:
            q = _make_guide(
                fitted,
                guide_kind,
                init_strategy(fitted, chain_start(fitted, init, info.seed)),
                cfg.init_scale,
                cfg.guide_rank,
            )
        q_train, wrap = _handlers(q, elbo_kind, estimator)
        eb = None if sharing is None else LearnedPriorScales(fitted, x0, y0, data.size, sharing)
        if eb is not None:
            wrap = _compose(wrap, eb)
        kl = KLWeight(warmup) if warmup else None
        if kl is not None:  # the KL weight on the model's and the guide's latent sites (kl_warmup's docstring)
            wrap, q_train = _compose(wrap, kl), kl(q_train)
        loss = (
            _logjoint.svi_loss(_logjoint.build(fitted, data.size), q, num_particles)
            if fast and not (closed_kl or warmup)
            else None
        )
        objective = _loss_fn(
            elbo_kind,
            num_particles,
            vectorize_particles,
            baseline_beta=cfg.baseline_beta,
            independent_sites=isinstance(q, autoguide.AutoNormal),
        )
        state = _state(fitted, q, q_train, data, objective, wrap, loss, eb, kl)
        state.seed = info.seed
        return state

    def draws(state: _State, history) -> ChainRun:
        # one seed per chain (the chain's own, seed + index) for the refinement and the gap: the gap measures on the
        # refinement's draws, and the chains do not share the step's Monte Carlo error
        step_record, spent = None, 0
        same_draws = dict(num_draws=svi_gap.GAP_DRAWS, seed=state.seed, fit_passes=fit_passes)  # the step's and gap's
        if by_cg:  # past svi_refine's bounds: a mean-field guide's sds (svi_refine_scale), then the mean's Newton steps
            # (any of the three Gaussian guides: svi_refine_cg)
            scaled = svi_refine_scale.refine_scale(
                state.guide, state.model, data, seed=state.seed, fit_passes=fit_passes
            )
            spent = 0 if scaled is None else scaled.passes  # what it took of the check's share, charged after it
            # on the gap's draws: the gap after it is measured on the same ones
            refined = svi_refine_cg.refine_mean(state.guide, state.model, data, **same_draws, spent_passes=spent)
            if refined is None and scaled is not None:  # the mean's step not covered: the scale step's record alone
                refined = svi_refine.Refinement(0, 0.0, NO_MEAN_STEP)
            if refined is not None:
                step_record = refined.record() if scaled is None else {**refined.record(), "scale": scaled.record()}
                # the cap from the fit's cost on the step's solves, as refine_mean met it (after the scale step's
                # passes): more num_steps lift it (check_guide_gap), as EVALUATIONS_CAP on the dense path
                solves = svi_gap_cg.choose_path(
                    coords, data.size, fit_passes=fit_passes, full_rank=full_rank, spent_passes=spent
                )
                if refined.stopped != NO_MEAN_STEP and solves.max_iterations < svi_gap_cg.MAX_ITERATIONS:
                    step_record[ITERATIONS_CAP] = solves.max_iterations
                config.setdefault("guide_refinement", []).append(step_record)
        elif refine_skipped:  # the fit's cost bound (choose_path) leaves no room for it: the record says so
            reason = path.reason.replace("not checked", "skipped", 1)
            config.setdefault("guide_refinement", []).append(svi_refine.Refinement(0, 0.0, reason).record())
        elif refine_guide:  # the rest of the way to the guide's optimum, by fixed-point iterations (svi_refine)
            refined = svi_refine.refine(
                state.guide, state.model, data, seed=state.seed, max_evaluations=path.max_evaluations
            )
            if refined is not None:  # a cap from the fit's cost is recorded: more num_steps lift it (check_guide_gap)
                capped = path.max_evaluations < svi_refine.MAX_EVALUATIONS
                record = {**refined.record(), **({EVALUATIONS_CAP: path.max_evaluations} if capped else {})}
                config.setdefault("guide_refinement", []).append(record)
        elif given_guide:
            config.setdefault("guide_refinement", []).append(svi_refine.Refinement(0, 0.0, GIVEN_GUIDE).record())
        samples, log_q = _draw(state.guide, names, num_samples, x0, y0, data.size, state.model)
        if gap_checked:  # how far the guide's mean stopped short of the ELBO's optimum (svi_gap)
            gap = svi_gap.newton_gap(state.guide, state.model, data, **same_draws, spent_passes=spent)
            if gap is not None:  # no verdict: NaN (every chain's history has the same keys) and the reason
                nan = torch.full((len(gap.labels) or coords,), math.nan, dtype=torch.float64, device="cpu")
                history = {
                    **history,
                    GAP: nan if gap.gap is None else gap.gap,
                    GAP_SE: nan if gap.se is None else gap.se,
                }
                if gap.labels:
                    config.setdefault("guide_coordinates", gap.labels)
                if step_record is not None and not step_record["stopped"].startswith("skipped") and gap.se is not None:
                    # the step's own Monte Carlo error: the gap's batch means or pairs, on the same draws (STEP_SE)
                    step_record[STEP_SE] = float(gap.se.max())
                config.setdefault("guide_gap", []).append(gap.record)  # per chain, one shape (svi_gap.Gap.record)
        elif gap_skipped:  # past the cost bounds: the record says which
            config.setdefault("guide_gap", []).append(dict(method=None, draws=0, reason=path.reason))  # one shape
        return ChainRun(
            state.model,
            samples,
            point_values(state.model, x0, y0, data.size),
            history={**({} if state.eb is None else state.eb.history), **history},
            stats={} if log_q is None else {"log_q": log_q},
        )  # log_q: for post.psis()

    def record_scales(state: _State, step: int, info: LossInfo) -> LossInfo:
        state.eb.record(step, num_steps)
        return info

    engine = Engine(
        init=init_state,
        step=_step,
        draws=draws,
        after=None if sharing is None else record_scales,
        checkpoint=lambda state, ckpt, records: _Resumable(ckpt),
    )
    loop = Loop(
        num_steps=num_steps,
        lr=lr,
        method="svi",
        desc="svi chain {index}",
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        quantity="ELBO",
        hint=", a smaller init_scale",
        progress=cfg.progress,
        reduce=reduce,
    )
    if fast and not cfg.distributed:  # a mean-field guide on the analytic potential: the flat path (_svi_flat)

        def flat_of(state: _State):
            return _svi_flat.FlatMeanField.of(
                _logjoint.build(state.model, data.size),
                state.guide,
                num_particles,
                x0,
                y0,
                analytic_kl=closed_kl,
                warmup_steps=warmup,
            )

        post = _svi_flat.drive(
            model,
            data,
            engine,
            loop,
            flat_of=flat_of,
            num_chains=num_chains,
            seed=cfg.seed,
            config=config,
            checkpoints=ckpts,
        )
    else:
        post = drive(model, data, engine, loop, num_chains=num_chains, seed=cfg.seed, config=config, checkpoints=ckpts)
    if sharing is not None:  # the learned scales at the last step, per chain
        config["prior_scales"] = {
            k[len("prior_scale[") : -1]: v[:, -1].tolist()
            for k, v in post.history.items()
            if k.startswith("prior_scale[")
        }
    if warm_starts:
        config["init_converged"] = all(s.converged for s in warm_starts)
        if isinstance(guide_kind, GuideKind):
            svi_start.check_start(warm_starts[0], guide_kind.value)
    return check_gaussian_guide_off_data(check_narrow(check_svi(post), cause=NARROW))


@dataclass
class _State:
    """One SVI chain: its model copy, the guide (and the guide as trained), the loss ``loss(model, guide, x, y)
    -> (surrogate, value)`` on the (wrapped) model, the optimized tensors, the empirical-Bayes scales and the KL weight (``kl_warmup``)."""

    model: object
    guide: object
    trained: object
    fit_model: object
    loss: object
    params: list
    eb: object = None
    kl: KLWeight | None = None
    seed: int = 0
    """The chain's seed (``seed + index``): its refinement's and gap's draws."""


def _state(model, guide, trained, data: Data, elbo, wrap=None, loss=None, eb=None, kl=None) -> _State:
    """An SVI chain's state for the ELBO ``elbo(model, guide, x, y) -> (surrogate, value)`` (see :func:`_loss_fn`),
    or ``loss(x, y) -> (surrogate, value)`` in its place (the fast path). The parameters are found by running
    the loss once on the first batch."""
    loss_fn = elbo if loss is None else (lambda m, g, x, y: loss(x, y))
    fit_model = partial(call_model, model, dataset_size=data.size)
    if wrap is not None:  # effect handlers around the model (estimator, empirical Bayes)
        fit_model = wrap(fit_model)
    with poutine.trace(param_only=True) as param_capture:
        loss_fn(fit_model, trained, *data.first())
    params = [site["value"].unconstrained() for site in param_capture.trace.nodes.values()]
    return _State(model, guide, trained, fit_model, loss_fn, params, eb, kl)


def _step(state: _State, batch, index: int):
    if state.kl is not None:
        state.kl.at(index)
    loss, value = state.loss(state.fit_model, state.trained, *batch)
    return loss, LossInfo(value)


def _handlers(q, elbo_kind: ElboKind, estimator: Estimator):
    """The guide as trained, and a wrapper for the model: the score-function handler for
    ``elbo="reinforce"``; for ``elbo="mean_field"`` with an ``AutoNormal`` guide, its sites as
    Gaussians (closed-form KL), plus the estimator's function mode on the model."""
    if elbo_kind is ElboKind.REINFORCE:
        return ScoreFunction()(q), None
    if not isinstance(q, autoguide.AutoNormal) or (elbo_kind is ElboKind.TRACE and estimator is Estimator.SAMPLE):
        return q, None
    sites = GaussianSites(q)
    wrap = None if estimator is Estimator.SAMPLE else WeightNoise(estimator, sites).wrap
    return sites(q), wrap


def _compose(wrap, handler):
    return handler if wrap is None else (lambda fn: wrap(handler(fn)))


def _has_batchnorm(model: BNN) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.net.modules())


def _make_guide(model, kind, init_loc_fn, init_scale, rank):
    init_scale = positive("init_scale", init_scale)
    if kind is GuideKind.MEAN_FIELD:
        return autoguide.AutoNormal(model, init_loc_fn=init_loc_fn, init_scale=init_scale)
    if kind is GuideKind.LOW_RANK:
        return autoguide.AutoLowRankMultivariateNormal(model, init_loc_fn=init_loc_fn, init_scale=init_scale, rank=rank)
    if kind is GuideKind.FULL_RANK:
        return autoguide.AutoMultivariateNormal(model, init_loc_fn=init_loc_fn, init_scale=init_scale)
    if kind is GuideKind.MAP:
        return autoguide.AutoDelta(model, init_loc_fn=init_loc_fn)
    if isinstance(kind, type) and issubclass(kind, autoguide.AutoGuide):
        return kind(model, init_loc_fn=init_loc_fn)
    if callable(kind):
        return kind
    raise TypeError(
        f"guide: expected one of {[g.value for g in GuideKind]}, an AutoGuide class or a callable, got {kind!r}."
    )


def _loss_fn(
    kind: ElboKind, num_particles: int, vectorize: bool, *, independent_sites: bool = False, baseline_beta: float = 0.9
):
    """``loss(model, guide, x, y) -> (surrogate to differentiate, ELBO value)`` for ``elbo=kind``."""
    common = dict(
        num_particles=num_particles,
        vectorize_particles=vectorize and num_particles > 1,
        max_plate_nesting=1 if vectorize else float("inf"),
    )
    if kind is ElboKind.REINFORCE:
        return ScoreFunctionELBO(
            num_particles, vectorize=vectorize, independent_sites=independent_sites, baseline_beta=baseline_beta
        )
    elbo = (MeanFieldELBO if kind is ElboKind.MEAN_FIELD else Trace_ELBO)(**common)

    def loss(model, guide, *args, **kwargs):
        value = elbo.differentiable_loss(model, guide, *args, **kwargs)
        return value, value.detach().item()

    return loss


class _Resumable:
    """An SVI chain's checkpoint (:func:`~bnn_pyro.infer.checkpoint.save_svi`: the parameter store,
    optimizer, scheduler and losses) for :func:`~bnn_pyro.infer.contract.run`."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def restore(self, opt, sched, losses) -> int:
        return restore_svi(self.ckpt, opt, sched, losses)

    def due(self, step: int, num_steps: int) -> bool:
        return self.ckpt.due(step, num_steps)

    def save(self, step: int, opt, sched, losses) -> None:
        save_svi(self.ckpt, step, opt, sched, losses)


@torch.no_grad()
def _draw(guide, names, num_samples, x, y, dataset_size, model):
    """``num_samples`` draws of every latent site from the fitted guide: one vectorized pass for
    an AutoGuide, one pass per draw for a hand-written guide; and ``log q`` of each draw in
    unconstrained coordinates (:func:`bnn_pyro.infer._density.autoguide`; ``None`` without a density)."""
    args = (x, y)
    kwargs = dict(dataset_size=dataset_size) if isinstance(model, BNN) else {}
    if isinstance(guide, autoguide.AutoGuide):
        with pyro.plate("_draws", num_samples, dim=-2):
            trace = poutine.trace(guide).get_trace(*args, **kwargs)
        draws = {
            n: trace.nodes[n]["value"].detach().reshape((num_samples,) + trace.nodes[n]["value"].shape[2:])
            for n in names
        }
        return draws, _density.autoguide(guide, trace, num_samples)
    traces = [poutine.trace(guide).get_trace(*args, **kwargs) for _ in range(num_samples)]
    return {n: torch.stack([t.nodes[n]["value"].detach() for t in traces]) for n in names}, None


GIVEN_GUIDE = "skipped: a guide given as a class or callable is used as given"
"""``post.config["guide_refinement"]``'s record, per chain, where the refinement would have run but the guide was
given as an ``AutoGuide`` class or a callable (an instance): the engine trains it and does not change it after."""

NO_MEAN_STEP = "skipped: the mean's step does not cover this guide (svi_refine_cg.refine_mean returned None)"
"""A chain's ``post.config["guide_refinement"]`` record where the mean-field scale step ran
(:mod:`bnn_pyro.infer.svi_refine_scale`, its record under ``"scale"``) but the mean's step after it did not cover the
guide: the scale step is recorded all the same (review 16: no path to this was found, the record guards it)."""

STEP_SE = "step_se"
"""The key, in a chain's ``post.config["guide_refinement"]`` record where the mean's step past the dense bounds
(:mod:`bnn_pyro.infer.svi_refine_cg`) ran (was not skipped), of that step's own Monte Carlo error: the largest over the
coordinates of the gap's standard error (batch means; a full-rank guide's antithetic pairs), in the guide's sds, of
where it put the mean. The step lands on the
optimum of the objective on its 1,000 draws, so it is off the true optimum by those draws' error, about
``H^-1 (mean gradient - its expectation)``; the gap after it (same seed, same draws: :mod:`bnn_pyro.infer.svi_gap_cg`
with the same batches; a full-rank guide's dense statistic over the same antithetic pairs, :mod:`bnn_pyro.infer.svi_gap`) has that
spread over its batches or pairs, so its standard error is the step's, read at no extra cost. The gap
itself, on the same draws, cannot see this error (:func:`~bnn_pyro.infer._health.check_guide_gap`). The dense
refinement has no batches (its antithetic pairs make one estimate) and no such record."""
EVALUATIONS_CAP = "max_evaluations"
"""The key, in a chain's ``post.config["guide_refinement"]`` record of the dense refinement
(:mod:`bnn_pyro.infer.svi_refine`), of the evaluations the fit's cost allowed it where that is fewer than
``svi_refine.MAX_EVALUATIONS`` (:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`, ``max_evaluations``; absent where it
had them all). Why recorded: a refinement that stopped at ``"evaluation limit"`` under this cap was stopped by the fit's
length, so more num_steps give it more evaluations, and the gap check advises them rather than another method
(:func:`~bnn_pyro.infer._health.check_guide_gap`; review 17)."""
ITERATIONS_CAP = "max_iterations"
"""The key, in a chain's ``post.config["guide_refinement"]`` record of the mean's step past the dense bounds
(:mod:`bnn_pyro.infer.svi_refine_cg`), of the conjugate-gradient iterations the fit's cost allowed each of its solves
where that is fewer than ``svi_gap_cg.MAX_ITERATIONS`` (:func:`~bnn_pyro.infer.svi_gap_cg.choose_path`'s
``max_iterations``, after what the scale step spent; absent where they had them all or the step did not cover the
guide, :data:`NO_MEAN_STEP`). Why recorded: a step that stopped at ``"no solve at the new mean"`` (its solve there ran
out of iterations) under this cap was stopped by the fit's length, so more num_steps give the solve more iterations,
and the gap check advises them rather than another method (:func:`~bnn_pyro.infer._health.check_guide_gap`; review
18), as for :data:`EVALUATIONS_CAP`."""


def _fit_passes(num_steps: int, num_particles: int, rows: int, *, vectorized: bool) -> int:
    """The fit's cost as :func:`~bnn_pyro.infer.svi_gap_cg.choose_path` counts it, in gradient passes over the rows
    plus ``svi_gap_cg.STEP_ROWS`` (Pyro's fixed cost of a step): ``num_steps x num_particles``, where each particle
    pays that fixed cost; with ``vectorized`` particles a step pays it once, so the fit costs ``num_steps x
    (num_particles x rows + STEP_ROWS)`` rows, counted in those passes (rounded down). Why: counting the fixed cost per
    particle let the check spend up to ``num_particles`` times its share of a vectorized fit (review 17, finding 3:
    8 particles, 20 coordinates x 40 rows, the check at 1.7-9 times the rest of the fit)."""
    if not vectorized:
        return num_steps * num_particles
    step_rows = svi_gap_cg.STEP_ROWS
    return num_steps * (num_particles * rows + step_rows) // (rows + step_rows)


NARROW = (
    "A mean-field guide cannot hold correlated weights (its sds are 1/sqrt(H_ii), not the posterior's): try "
    "guide='full_rank' or 'low_rank'. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for a BNN fit by SVI."""
