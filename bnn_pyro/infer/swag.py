"""Stochastic weight averaging: ``bp.fit(model, x, y, method="swa" | "swag", ...)``.

Both methods run stochastic gradient descent on the per-datum potential energy ``L(z) = U(z) / N``
(:class:`~bnn_pyro.infer._potential.Potential`: ``U = -log p(z) - (N / B) sum_batch log p(y | x, z)``
in unconstrained coordinates ``z``, minibatch likelihood scaled to the full data) and summarize the
iterates that a constant learning rate keeps bouncing around a mode.

Schedule (``post.history["lr"]`` records it step by step):

1. pre-training: ``pretrain_steps`` steps of Adam (or SGD with momentum) whose learning rate
   decays from ``pretrain_lr`` to 1% of it on a cosine, to reach a mode from the initial weights;
2. the SWA phase: ``num_steps`` steps of SGD with heavy-ball momentum ``beta`` at a constant
   ``lr``: ``v <- beta v + grad L(z)``, ``z <- z - lr v`` (PyTorch's convention). After
   ``burn_in`` of these steps, every ``collect_every``-th iterate is collected (default: once per
   epoch, ``ceil(N / B)`` steps), ``m = (num_steps - burn_in) // collect_every`` snapshots in all.

Each collected ``z_i`` (``i = 1..m``) updates the running moments

    ``mean_i = ((i - 1) mean_{i-1} + z_i) / i``,  ``sq_i = ((i - 1) sq_{i-1} + z_i^2) / i``,

and appends the deviation ``z_i - mean_i`` to ``D``, which keeps the last ``swag_rank`` (``K``) of them.

- ``"swa"`` (Izmailov et al. 2018): the answer is the point ``z_SWA = mean_m``, one draw per chain.
  SWA is an estimate of a (wide) mode, not a distribution: ``predict`` gives the plug-in prediction
  (no epistemic spread within a chain), ``summary`` shows the spread between independent chains.
- ``"swag"`` (Maddox et al. 2019): a Gaussian with mean ``z_SWA`` and covariance
  ``scale * (Sigma_diag + D^T D / (K - 1)) / 2``, ``Sigma_diag = diag(sq_m - mean_m^2)``. Draws are

    ``z = z_SWA + sqrt(scale) * (Sigma_diag^(1/2) e1 / sqrt(2) + D^T e2 / sqrt(2 (K - 1)))``,
    ``e1 ~ N(0, I_d)``, ``e2 ~ N(0, I_K)``,

  then mapped to each site's support (e.g. a positive noise scale).

The SWA phase draws its minibatches independently (with replacement, ``B`` points each; ``B`` is
``batch_size`` of ``bp.fit``, by default ``min(N, 128)``), the assumption under which constant-rate SGD
has a stationary law whose covariance ``Sigma`` solves ``A Sigma + Sigma A = (lr / B) C`` (Mandt, Hoffman
& Blei 2017; ``A`` the Hessian of ``L``, ``C`` the covariance of one datum's gradient). Random
reshuffling would make the gradient noise of an epoch sum to zero and shrink ``Sigma`` most in the
flat directions SWAG is meant to find. Pre-training only has to reach a mode, and takes the data's own
batches, as the MAP engines do: the full data (``batch_size`` unset: each step costs a pass over the
data), or epochs of ``batch_size`` rows reshuffled by the chain's seed. Drawn with replacement, as
before, its bootstrap batches (80 rows of 80 on the zoo's ``mlp_regression``: 1-50-1 tanh, learned
noise, seed 0) left the net underfit: train ``U/N`` 2.06 at the end of pre-training, SWA sigma 0.23,
test RMSE 0.29, test NLL +0.24; now 1.19, 0.096, 0.101, -0.87 (seeds 1, 2: RMSE 0.131, 0.111 -> 0.118,
0.108), and SWAG (three chains) RMSE 0.146 -> 0.103, NLL -0.57 -> -0.84, 95% coverage 0.97 -> 0.95.
A ``DataLoader`` is used in its own order in both phases.

``lr="auto"`` (the default) sets ``lr = x / lambda``, ``lambda`` the largest curvature of ``L`` at the
end of pre-training (power iteration on Hessian-vector products over up to 2,048 points), and
``x = 2 B (1 - beta)(1 + beta) / ((1 + beta) N + B (1 - beta))``: for a quadratic whose gradient noise
is ``C = A / B`` per step (Fisher = Hessian) the stationary variance of heavy-ball SGD along a
direction of curvature ``a``, ``lr (1 + beta) c / (a (1 - beta)(2 (1 + beta) - lr a))`` with
``c = a / B``, then equals the posterior variance ``1 / (N a)`` along the stiffest direction. It
adapts to the scale of the likelihood (no tuning between a noise scale of 0.01 and classification)
and is far from the stability limit ``lr a < 2 (1 + beta)``. Caution: with that noise the SGD law is
nearly isotropic, so flatter directions are under-dispersed relative to the posterior; SWAG
describes where SGD wanders, which equals the posterior only when the gradient noise is isotropic.

BatchNorm: the running statistics of every draw (the SWA mean for ``"swa"``) are recomputed by one
pass over the training data (:meth:`~bnn_pyro.BNN.batchnorm_statistics`) and stored per draw in
``post.draw_buffers``, which ``predict`` and function-space diagnostics use.

A small plain Pyro function (tensor data, no ``pyro.param`` sites, at most ``CONVERGE_MAX_DIM`` coordinates, a
Laplace approximation with PSIS ``k_hat <= 0.7``, ``lr="auto"``; never a ``BNN``) takes its own collection
(:mod:`bnn_pyro.infer.swag_function`): every chain starts at the mode and each step uses every row with fresh
observation weights (``n Dirichlet(1, ..., 1)``, the weighted likelihood bootstrap) and a fresh prior anchor,
preconditioned by ``M = H^{-1}`` (the Hessian at the mode) at ``lr = 1 - momentum^2`` (momentum 0 there by default):
the rate at which the discrete heavy-ball recursion's stationary covariance, ``H^{-1} C H^{-1}`` for a gradient noise
of covariance ``C ~ H``, is the posterior's (Mandt et al. 2017's continuous-time rate, 2, is the discrete recursion's
stability edge); its moments are kept in the whitened coordinates ``L^T (z - mode)``. Why: on all its rows such a
model has no minibatch noise, so plain SGD's iterates sat at the mode (kidiq's sds 0.014 of the posterior's, its
chains' R-hat 2.37: ``benchmarks/results/reference_suite/function_swag_mode.md``), and the unwhitened diagonal half
would halve kidiq's -0.95 correlation. Nothing is held out and nothing pre-trained (nothing is chosen);
``post.config["collection"]`` records the rule, or why it was skipped. Where it is skipped (the non-centered eight
schools: ``k_hat`` 1.03, where unit whitened steps left the mode's region within 8 steps) the chain's pre-training
ends with damped Newton steps to the minimum of its objective (:func:`~bnn_pyro.infer.map_fit.damped_newton`), so that
the plain SWA phase starts at its mode (on badly scaled covariates SGD's steps end far from it: kidiq 4,899 posterior
sds), and its narrow spread is said at fit time.

Deterministic (non-Bayesian) parameters of a ``BNN`` and ``pyro.param`` sites of a Pyro function are
trained and averaged with the latent sites, and fixed at their average in every draw (``post.point``).
``num_chains`` independent runs (seeds ``seed``, ``seed + 1``, ...) become chains, so R-hat applies;
SWAG's predictive mixes them (MultiSWAG; five by default, see :func:`fit_swag`), SWA's gives the spread
between the chains' points (one by default).

Off-data inputs and anchoring (issue 26, ``docs/ood.md``). SWAG's spread within a chain is SGD's minibatch
gradient noise, whose covariance is that of the per-datum gradients: in a weight direction that no training
row's gradient reaches (a dead ReLU unit's weights, input directions the data do not span) it is zero, and
only the prior's pull moves the iterates there, deterministically, so SWAG's variance there is ~0 where the
posterior keeps the prior's. Between chains (MultiSWAG) the runs differ there only by their starts: the layers'
initializers, whose scale is ``1 / sqrt(fan_in)``, not the prior's. So a classifier's plain SWAG is as sure on
inputs far from the data as on test rows: the AUROC of the predictive entropy / mutual information separating
Gaussian-noise inputs (sd 3, standardized) from test rows was 0.44 / 0.52 on wine and 0.54 / 0.62 on
breast_cancer (``benchmarks/classification.py``, split 0). ``anchored=True`` (SWAG's default; SWA's is
``False``, its one point per chain is an estimate of a mode) tilts chain ``c``'s objective, in both phases, by
``<z, grad log p(w_0^(c))>`` for its own prior draw ``w_0^(c)`` (:mod:`bnn_pyro.infer.anchor`, Pearce et al.
2020, as the deep ensemble's members): for a Gaussian prior the weight decay ``|w|^2 / (2 s^2)`` becomes
``|w - w_0^(c)|^2 / (2 s^2)``, so each chain averages around a randomized MAP (for a linear-Gaussian model the closed form of
:mod:`bnn_pyro.infer.anchor`, tested: the posterior's spread in the free directions, narrower where the data
constrain the weights), and the chains spread in the free directions as the prior does. Measured on
the same splits: 0.67 / 0.73 (wine) and 0.84 / 0.87 (breast_cancer), at a test log loss of 0.198 against 0.079
(wine) and 0.198 against 0.186 (breast_cancer): wider members, as the anchored ensemble's
(``benchmarks/results/classification/``). Regression: ``benchmarks/results/classification/README.md`` gives
scikit-learn's diabetes before and after. A classification fit without anchoring says so
(:func:`~bnn_pyro.infer.health_off_data.check_off_data`, :data:`OFF_DATA`).

Held-out rows (``validation=``, default 10% of tensor data of at least 200 rows, with a learned noise at least 20 rows of at least 40;
:mod:`bnn_pyro.infer.holdout`): pre-training is early-stopped on them and a learned Gaussian noise is
chosen on them at the end, for the engine's own predictive. On scikit-learn's diabetes (random 90/10
splits 0-2, standardized, 10-50-1 ReLU net, ``Normal(0, 1)`` prior, ``Gaussian(scale=HalfNormal(1))``)
the mean test log-likelihood per point went from -11.8 (SWA) and about -11.5 (SWAG, one chain) without
them to -5.54 (SWA) and -5.53 (SWAG, three chains) with them: the SWA-phase noise estimate of an
overfitted net (sd ~0.5 in standardized units) is replaced by the held-out one (~0.75-0.9). Pre-training on
the full batch instead of minibatches drawn with replacement left that unchanged within its standard error
(-5.540 ± 0.033 and -5.543 ± 0.054; 95% coverage 0.92 and 0.91; ``benchmarks/results/uci/diabetes.md``).

References: P. Izmailov, D. Podoprikhin, T. Garipov, D. Vetrov, A. G. Wilson (2018), "Averaging
Weights Leads to Wider Optima and Better Generalization"; W. J. Maddox, T. Garipov, P. Izmailov,
D. Vetrov, A. G. Wilson (2019), "A Simple Baseline for Bayesian Uncertainty in Deep Learning";
S. Mandt, M. D. Hoffman, D. M. Blei (2017), "Stochastic Gradient Descent as Approximate Bayesian
Inference".

Example
-------
>>> post = bp.fit(model, x, y, method="swag", num_chains=2, seed=0)
>>> post.predict(x_test).std
>>> post.history["loss"]          # (chains, steps): U / N on each minibatch
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from pyro import poutine

from bnn_pyro.infer import _density
from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.anchor import anchor, flat_tilt
from bnn_pyro.infer.checkpoint import ExtraState, StepCheckpoint, open_chains
from bnn_pyro.infer.contract import Engine, Loop, PotentialRunOptions, drive, entry, renamed_options
from bnn_pyro.infer.driver import ChainInfo, ChainRun
from bnn_pyro.infer.health_off_data import check_anchored_log_loss, check_off_data
from bnn_pyro.infer.health_spread import check_narrow, check_spread
from bnn_pyro.infer.holdout import (
    DEFAULT,
    BestOnHoldout,
    Holdout,
    describe,
    heldout_score,
    refit,
    refit_config,
    select_noise,
    split,
)
from bnn_pyro.infer.map_fit import CONVERGE_MAX_DIM, CONVERGE_NEWTON, damped_newton
from bnn_pyro.infer.optim import check_lr
from bnn_pyro.infer.swag_function import FunctionCollection, function_collection
from bnn_pyro.infer.swag_state import PhasedOptimizer, PretrainOptimizer, SWAGMoments, auto_lr, batchnorm_statistics
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, flag, positive, positive_int

__all__ = [
    "fit_swa",
    "fit_swag",
    "fit_moments",
    "SWAConfig",
    "SWAGConfig",
    "SWAInfo",
    "SWAGMoments",
    "PretrainOptimizer",
]

_SWAG_ONLY = (
    "applies to method='swag' only: SWA keeps the averaged point, not a distribution. Drop it, or use method='swag'."
)
_BUILT_IN = {  # options of the other optimizing engines that SWA's two phases fix
    "optimizer": "does not apply: the collection phase is SGD with momentum by definition (Izmailov et al. 2018; "
    "momentum=); pretrain_optimizer= chooses the pre-training's.",
    "lr_schedule": "does not apply: pre-training anneals pretrain_lr on a cosine, the collection phase keeps lr "
    "constant (SWA's schedule).",
}


@dataclass(frozen=True)
class SWAConfig(PotentialRunOptions):
    """The options of ``method="swa"`` and their defaults (see :func:`fit_swag`; SWAG's ``swag_rank`` (formerly
    ``rank``), ``num_samples`` and ``scale`` are refused)."""

    REFUSED: ClassVar[dict[str, str]] = {
        **{name: _SWAG_ONLY for name in ("swag_rank", "num_samples", "scale")},
        "rank": "(SWAG's swag_rank=) " + _SWAG_ONLY,
        **_BUILT_IN,
    }

    pretrain_steps: int = 2000
    pretrain_optimizer: object = "adam"
    pretrain_lr: float = 3e-2
    num_steps: int | None = None
    burn_in: int | None = None
    collect_every: int | None = None
    lr: float | str = "auto"
    momentum: float | None = None
    num_chains: int = 1
    init: object = None
    validation: object = "default"
    anchored: bool = False


@dataclass(frozen=True)
class SWAGConfig(SWAConfig):
    """The options of ``method="swag"`` and their defaults (see :func:`fit_swag`)."""

    REFUSED: ClassVar[dict[str, str]] = _BUILT_IN
    RENAMED: ClassVar[dict[str, str]] = {"rank": "swag_rank"}  # deprecated alias, one release (contract.entry)

    swag_rank: int = 20
    num_samples: int = 1000
    scale: float = 1.0
    num_chains: int = 5
    anchored: bool = True


class SWAInfo(NamedTuple):
    """What a step records: ``U / N`` on its batch and the learning rate it was taken at (``post.history``)."""

    loss: float
    lr: float


@entry(SWAConfig)
def fit_swa(model, data: Data, cfg: SWAConfig) -> Posterior:
    """``bp.fit(..., method="swa")``: the SWA point, one draw per chain. Options as :func:`fit_swag`
    except ``swag_rank``, ``num_samples`` and ``scale``; ``num_chains`` defaults to 1."""
    return _checked(_run(model, data, cfg)[0], cfg)


@entry(SWAGConfig)
def fit_swag(model, data: Data, cfg: SWAGConfig) -> Posterior:
    """Fit ``model`` by SWAG and return ``num_samples`` draws per chain (see the module docstring).

    Parameters
    ----------
    swag_rank, num_samples, scale:
        ``K``, the number of deviations kept (at least 2; the rank of the covariance's low-rank part; formerly
        ``rank``, still taken with a ``FutureWarning``); draws per chain (each costs one pass over
        the data when the net has BatchNorm); the factor on the covariance. ``scale=1`` here is Maddox
        et al.'s recommended ``scale=0.5``: their code draws ``mean + sqrt(scale) (diag part + low-rank
        part)``, whose covariance is ``scale (Sigma_diag + D^T D / (K - 1))``; ours already halves the sum.
    pretrain_steps, pretrain_optimizer, pretrain_lr:
        Pre-training (default 2,000 steps of ``"adam"``, learning rate ``3e-2`` decaying to 1% of
        it, on the full data or reshuffled epochs of ``bp.fit``'s ``batch_size``; 0 skips it, e.g. with a
        pretrained net and ``init="net"``, or ``init=`` a MAP posterior).
    num_steps, burn_in, collect_every:
        SWA phase: SGD steps (default 200 epochs of ``ceil(N / B)`` steps), steps before the first
        snapshot (default ``num_steps // 10``), steps between snapshots (default one epoch). A small Pyro function's
        whitened collection (without ``init=``) takes every row each step (an epoch is one step; it starts at the
        mode, so ``pretrain_steps`` and ``batch_size`` do not apply and are recorded as 0 and all rows).
    lr, momentum:
        The constant SWA learning rate (``"auto"`` or a positive float: what ``lr`` means is stated once in
        :mod:`bnn_pyro.infer.optim`) and SGD momentum (``None``: 0.9, Izmailov et al.'s; on a small Pyro function's
        whitened collection 0, where ``lr="auto"`` is ``1 - momentum^2`` and each step a Newton step of its
        randomized objective, so the iterates of a quadratic are independent: :mod:`bnn_pyro.infer.swag_function`).
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps (counted over both
        phases) and after the last; ``resume=True`` continues each chain from its file, bit-identically (phase and
        optimizer, moments, early stopping, the chain's generator; see :mod:`bnn_pyro.infer.checkpoint`).
    anchored:
        ``True`` (SWAG's default): each chain's objective is anchored at its own prior draw (seed ``seed + c``;
        module docstring, "Off-data inputs and anchoring"); ``False`` (SWA's default): the plain objective.
    num_chains, init, seed, progress:
        Independent runs (seeds ``seed + c``; default 5 for SWAG: MultiSWAG, see below; 1 for SWA);
        initial values (``"reset"``: the default for a BNN,
        its layers' ``reset_parameters()`` under the run's seed; ``"net"``: a BNN's weights; ``"prior"``,
        ``"median"``, a dict or a :class:`Posterior`; see :mod:`bnn_pyro.infer._init`); a progress bar
        (``False``: off).
    fast_path:
        ``True`` (default): the potential is evaluated without tracing Pyro where the model allows it (same
        values); ``False`` forces Pyro's traced potential (see :class:`~bnn_pyro.infer._potential.Potentials`).
        ``config["fast_path"]`` says which ran, ``config["potential"]`` the path.
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`; default 10% of the rows when that is at least 20 (with a learned noise at
        least 20 rows of at least 40) and the data are tensors, the same rows for every chain): pre-training keeps its state with the best
        held-out likelihood (scored every ``pretrain_steps // 50`` steps: early stopping) and the SWA phase
        starts from it; at the end a learned Gaussian noise is set to the value that maximizes the held-out log
        predictive density of the SWAG predictive (every chain's draws). Then the whole run is repeated on every
        row, pre-training for the chosen number of epochs (the median best step, scaled to all rows) on a cosine
        annealed over them, and the chosen noise replaces the SWA one (:func:`~bnn_pyro.infer.holdout.refit`).
        Unlike ensemble and laplace, the refit does not rerun the pre-training's cosine over all
        ``pretrain_steps`` stopped at the chosen step: its state there is taken near the full ``pretrain_lr``,
        and on benchmarks/uci.py's diabetes (5 splits) that refit lost 0.024 +- 0.008 nats of test log-likelihood
        per point on every split (friedman1: +0.020 +- 0.014), and 0.026 of noise AUROC by MI on breast_cancer
        (3 of 3 splits). A fraction, an ``(x_val,
        y_val)`` pair (no refit: every row is trained on already), or ``None`` (every row trained on, the noise
        at its SWA value: overconfident on small data). Costs a second run and a forward pass over the held-out
        rows per score.

    Why several chains (MultiSWAG; Wilson & Izmailov 2020, "Bayesian Deep Learning and a
    Probabilistic Perspective of Generalization"): one SWAG run describes one basin, and its spread is
    the SGD noise around it, which does not grow away from the data. On ``bp.datasets.toy_gap`` (1-50-1
    tanh net, ``sigma = 0.1``, seed 0) one chain's epistemic sd in the gap (|x| < 0.3) is 0.55-0.66x that on
    the clusters (|x| >= 0.5; chains 0-2), three chains give 2.03x (NUTS: 6.6x), because restarts land in
    different basins that agree on the data and part ways in the gap. With the earlier pre-training on
    minibatches drawn with replacement, which stopped short of the mode, one chain gave 1.06x and three 3.95x
    (and raising the collection learning rate made one chain worse: 3x, 10x, 19x the ``"auto"`` rate gave
    0.83x, 0.60x, 0.50x). ``num_chains=1`` is the single-basin SWAG of Maddox et al.
    These figures are for plain chains (``anchored=False``: 2.03x, 1.39x, 0.61x at seeds 0, 1, 2); with three
    anchored chains the gap's sd is 5.6x, 8.1x and 9.1x that on the clusters (the prior's spread, which the
    data leave free in the gap, is kept between chains).

    Why five (issue 26; ``docs/ood.md``, "SWAG with five chains"): with anchored chains the spread off the data is
    mostly between the chains' modes (``scale=2.0``, each chain's Gaussian twice as wide, moved iris's noise AUROC
    by +0.001), so the predictive's mutual information there is an estimate over ``num_chains`` modes, biased low
    where a few chains agree by chance. Through ``benchmarks/classification.py`` (splits 0-9, 2,000 noise rows),
    five chains against three raised the noise AUROC by mutual information on every split of iris (0.770 ->
    0.849), wine (0.793 -> 0.866) and breast_cancer (0.900 -> 0.936), the splits meeting issue 26's joint target
    from 13 to 17 of 30, at a test log loss change of +0.007 +- 0.003 (iris), -0.003 +- 0.008 (wine) and
    -0.005 +- 0.003 (breast_cancer), and +0.000 +- 0.007 of test log-likelihood on diabetes (splits 0-2). Cost:
    the chains run one after another, each a full run.
    """
    return _checked(_run(model, data, cfg)[0], cfg)


OFF_DATA = (
    "its spread is SGD's minibatch gradient noise around one mode per chain, which is zero in the weight "
    "directions that no training row's gradient reaches, where the posterior keeps the prior's spread, and "
    "its chains differ there only by their initializers' small draws (anchored=True tilts each chain "
    "toward its own prior draw)."
)
"""The structural limit :func:`~bnn_pyro.infer.health_off_data.check_off_data` states for a classification fit without
anchoring (module docstring: "Off-data inputs")."""


POINT = (
    "SWA returns the average of one SGD trajectory per chain, an estimate of a mode, as one draw per chain, so with "
    "one chain (the default) every sd is zero, and with several the spread is that of the chains' averages."
)
"""The structural limit :func:`~bnn_pyro.infer.health_spread.check_spread` states for every SWA fit."""


def _checked(post: Posterior, cfg: SWAConfig) -> Posterior:
    """``post``, after the off-data note of a classification fit without anchoring and, for SWA, the note that its
    points are not posterior draws (stack: this function <- fit_swag <- contract.entry's wrapper <- bp.fit <- the
    user's line)."""
    if not isinstance(cfg, SWAGConfig):
        check_spread(post, POINT)
    else:  # a Pyro function's chains start at their mode (start_swa)
        record = post.config.get("collection") or {}
        cause = (
            NARROW_FUNCTION.format(skipped=record["skipped"])
            if "skipped" in record
            else NARROW_WHITENED
            if record
            else NARROW
        )
        check_narrow(post, cause=cause, functions=True)
    return check_anchored_log_loss(post, units="chains") if cfg.anchored else check_off_data(post, OFF_DATA)


def fit_moments(model, data: Data, *, swag: bool, **options) -> tuple[Posterior, list[SWAGMoments]]:
    """The SWA/SWAG posterior (``swag=True|False`` and the options of :func:`fit_swag`; ``num_chains`` defaults
    to 1 and ``anchored`` to ``False`` here: one plain SGD trajectory) and each chain's :class:`SWAGMoments`: the
    iterates' mean and deviations that subspace inference builds on (and that the tests check against theory)."""
    config_type = SWAGConfig if swag else SWAConfig  # old option names as bp.fit takes them (contract.entry)
    options = renamed_options(options, getattr(config_type, "RENAMED", {}))
    # the plain SGD collection in every case: subspace inference builds on these moments in the model's coordinates
    return _run(model, data, config_type(**{"num_chains": 1, "anchored": False, **options}), functions=False)


@dataclass(frozen=True)
class _Settings:
    """The validated schedule of one fit (every chain's)."""

    batch_size: int
    pretrain_steps: int
    pretrain_optimizer: PretrainOptimizer
    pretrain_lr: float
    num_steps: int
    burn_in: int
    collect_every: int
    lr: float | str
    momentum: float
    rank: int  # 0 for SWA
    num_samples: int  # draws per chain (1 for SWA)
    scale: float
    init: object
    anchored: bool
    pretrain_schedule: object = "cosine"  # pre-training's rate (the held-out refit's: holdout.Chosen.schedule)
    function: FunctionCollection | None = None  # a small Pyro function's collection (swag_function), else None


def _run(model, data: Data, cfg: SWAConfig, *, functions: bool = True) -> tuple[Posterior, list[SWAGMoments]]:
    """The posterior and each chain's :class:`SWAGMoments`: chosen on held-out rows (the pre-training's stopping
    point, the noise), then fitted on every row with them (:func:`~bnn_pyro.infer.holdout.refit`). ``functions``:
    whether a small Pyro function takes its own collection (:mod:`bnn_pyro.infer.swag_function`)."""
    first = _run_once(model, data, cfg, functions=functions)
    final = []

    def again(chosen) -> Posterior:  # the pre-training's stop, its cosine annealed over the chosen steps
        refit_cfg = refit_config(cfg, chosen, steps="pretrain_steps", schedule=None)
        final.append(
            _run_once(model, data, refit_cfg, pretrain_schedule=chosen.schedule("cosine"), functions=functions)
        )
        return final[0][0]

    # the pre-training was scored: its steps are full-batch or bp.fit's batch_size (config["batch_size"] is the
    # SWA phase's minibatch); budget=None: no horizon (validation=, in fit_swag's docstring)
    post = refit(first[0], again, budget=None, batch_size=data.batch_size)
    return (post, final[0][1]) if final else first


NO_HOLDOUT = (
    "nothing is chosen on held-out rows: a small Pyro function's collection starts at the mode and its rate follows "
    "from the whitened rule (bnn_pyro.infer.swag_function)"
)


def _run_once(
    model, data: Data, cfg: SWAConfig, pretrain_schedule="cosine", *, functions: bool = True
) -> tuple[Posterior, list[SWAGMoments]]:
    swag = isinstance(cfg, SWAGConfig)
    method = "swag" if swag else "swa"
    full = data
    momentum = cfg.momentum
    if not (momentum is None or (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0)):
        raise ValueError(
            f"momentum must be a number in [0, 1), got {momentum!r}; the default is 0.9 (0 on a small Pyro function)."
        )
    lr = check_lr(cfg.lr, method=method, auto=True)
    anchored = flag("anchored", cfg.anchored)
    paths = Potentials(cfg.fast_path)

    def collection(rows: Data) -> tuple[FunctionCollection | None, dict | None]:
        if not functions:
            return None, None
        return function_collection(
            model, paths, rows, momentum=momentum, anchored=anchored, lr=lr, seed=cfg.seed, init=cfg.init
        )

    function, record = collection(full)
    default = isinstance(cfg.validation, str) and cfg.validation == "default"
    if function is not None and default:  # nothing to choose, so nothing held out (swag_function)
        holdout, why = None, NO_HOLDOUT
    else:
        data, holdout, why = split(
            full, cfg.validation, seed=cfg.seed, method=method, convert=full.convert, model=model
        )
        if function is not None and holdout is not None and holdout.rows is not None:
            function, record = collection(data)  # the mode and curvature of the rows fitted
    if function is not None:
        batch, epoch = data.size, 1  # every row, weighted afresh, each step
    elif data.loader is not None:
        batch = data.batch_size
        epoch = len(data.loader) if hasattr(data.loader, "__len__") else math.ceil(data.size / batch)
    else:
        batch = data.batch_size or min(data.size, 128)
        epoch = math.ceil(data.size / batch)
    collect_every = positive_int("collect_every", epoch if cfg.collect_every is None else cfg.collect_every)
    num_steps = positive_int("num_steps", 200 * epoch if cfg.num_steps is None else cfg.num_steps)
    burn_in = positive_int("burn_in", num_steps // 10 if cfg.burn_in is None else cfg.burn_in, allow_zero=True)
    snapshots = (num_steps - burn_in) // collect_every if burn_in < num_steps else 0
    rank, num_samples, scale = (cfg.swag_rank, cfg.num_samples, cfg.scale) if swag else (0, 1, 1.0)
    if swag:
        rank = positive_int("swag_rank", rank)
        if rank < 2:
            raise ValueError(
                f"swag_rank must be at least 2 (the low-rank part divides by swag_rank - 1), got {rank}; "
                "the default is 20. For the averaged point alone use method='swa'."
            )
    needed = max(rank, 1)
    if snapshots < needed:
        raise ValueError(
            f"collect schedule: num_steps={num_steps}, burn_in={burn_in}, collect_every={collect_every} collect "
            f"{snapshots} snapshot(s), but {method} needs at least {needed}"
            + (f" (swag_rank={rank})" if swag else "")
            + ". Lengthen num_steps, shorten burn_in or collect_every"
            + (", or lower swag_rank." if swag else ".")
        )
    pretrain_steps = positive_int("pretrain_steps", cfg.pretrain_steps, allow_zero=True)
    if function is not None:  # starts at the mode (no pre-training) at the rule's rate and momentum
        pretrain_steps, lr, momentum = 0, function.lr, function.momentum
    momentum = 0.9 if momentum is None else momentum
    s = _Settings(
        batch_size=batch,
        pretrain_steps=pretrain_steps,
        pretrain_optimizer=choice("pretrain_optimizer", cfg.pretrain_optimizer, PretrainOptimizer),
        pretrain_lr=positive("pretrain_lr", cfg.pretrain_lr),
        num_steps=num_steps,
        burn_in=burn_in,
        collect_every=collect_every,
        lr=lr,
        momentum=float(momentum),
        rank=rank,
        num_samples=positive_int("num_samples", num_samples),
        scale=positive("scale", scale),
        init=resolve_init(model, cfg.init, data),
        anchored=anchored,
        pretrain_schedule=pretrain_schedule,
        function=function,
    )
    num_chains = positive_int("num_chains", cfg.num_chains)
    config = clean_config(
        dict(
            pretrain_steps=s.pretrain_steps,
            pretrain_optimizer=s.pretrain_optimizer.value,
            pretrain_lr=s.pretrain_lr,
            num_steps=num_steps,
            burn_in=burn_in,
            collect_every=collect_every,
            snapshots=snapshots,
            lr=lr,
            momentum=s.momentum,
            num_chains=num_chains,
            init=s.init if isinstance(s.init, str) else type(s.init).__name__,
            batch_size=batch,
            sampling="loader order" if data.loader is not None else _sampling(data, batch, function),
            dataset_size=data.size,
            seed=cfg.seed,
            anchored=s.anchored,
            validation=describe(holdout, cfg.validation if cfg.validation != "default" else DEFAULT, why),
            **(dict(swag_rank=rank, num_samples=s.num_samples, scale=s.scale) if swag else {}),
            **(dict(collection=record) if record is not None else {}),
        )
    )
    ckpts = open_chains(
        cfg.checkpoint,
        every=cfg.checkpoint_every,
        resume=cfg.resume,
        num_chains=num_chains,
        run=dict(method=method, **config),
    )
    moments: dict[int, SWAGMoments] = {}  # per chain (drive runs the chains one after another, in this process)
    loop = Loop(
        num_steps=s.pretrain_steps + num_steps,
        lr=s.pretrain_lr,
        method=method,
        desc=method + " chain {index}",
        quantity="loss U/N",
        hint=": a smaller pretrain_lr or lr",
        progress=cfg.progress,
    )
    densities: dict[int, torch.Tensor | None] = {}
    post = drive(
        model,
        data,
        _engine(data, s, holdout, moments, method, paths, densities),
        loop,
        num_chains=num_chains,
        seed=cfg.seed,
        config=config,
        checkpoints=ckpts,
        posterior_data=full,
    )
    paths.record(post.config)
    log_q = [densities.get(c) for c in range(num_chains)]
    if all(q is not None for q in log_q):  # for post.psis(); absent when one chain's q is degenerate (a coordinate
        post.sample_stats["log_q"] = torch.stack(log_q)  # that never moved: an anchored dead unit's weights)
    return select_noise(post, holdout), [moments[c] for c in range(num_chains)]


def _sampling(data: Data, batch: int, function: FunctionCollection | None = None) -> str:
    """How tensor data are batched (``config["sampling"]``; :func:`_batches`)."""
    if function is not None:
        return "no pre-training; SWA phase: every row each step, with fresh observation weights"
    whole = data.batch_size is None or data.batch_size >= data.size
    pre = "full batch" if whole else f"reshuffled epochs of {data.batch_size} rows"
    return f"pre-training: {pre}; SWA phase: independent minibatches of {batch} rows (with replacement)"


@dataclass
class _Chain:
    """One chain's state: its model copy and potential, the flat unconstrained latent values ``z`` and the model's
    deterministic parameters (``params``: both), the two-phase optimizer, the chain's generator (the SWA-phase
    minibatches, ``lr="auto"``'s probe, the SWAG draws), the moments, the deterministic parameters' running sum
    and early stopping's record."""

    model: object
    index: int
    seed: int
    pot: Potential
    z: torch.Tensor
    point_params: list[torch.Tensor]
    params: list[torch.Tensor]
    opt: PhasedOptimizer
    generator: torch.Generator
    moments: SWAGMoments
    point_sum: list[torch.Tensor]
    best: BestOnHoldout
    size: int  # N, the training rows
    tilt: torch.Tensor | None = None  # the flat prior anchor g (anchored=True; zero on constrained sites)

    def loss(self, batch) -> torch.Tensor:
        """``U / N`` on ``batch`` (the likelihood scaled to the full data), plus ``<z, g> / N`` when anchored."""
        u = self.pot(self.pot.unflatten(self.z), batch)
        return (u if self.tilt is None else u + self.z @ self.tilt) / self.size


def _to_mode(model, point_params, z: torch.Tensor, data: Data) -> bool:
    """Whether a chain's pre-training ends with damped Newton steps to the minimum of its objective
    (:func:`~bnn_pyro.infer.map_fit.damped_newton`): a Pyro function (never a ``BNN``) on tensor data, with no
    ``pyro.param`` sites and at most :data:`~bnn_pyro.infer.map_fit.CONVERGE_MAX_DIM` coordinates. Why: SGD's
    first-order steps on badly scaled covariates (kidiq's near 100) end far from the mode (the chains 4,899 posterior
    sds off), and the SWA phase at ``lr="auto"`` (set by the largest curvature) cannot move along the flat
    directions; Newton's step does not depend on the coordinates' scales."""
    return not isinstance(model, BNN) and data.loader is None and not point_params and z.numel() <= CONVERGE_MAX_DIM


def _engine(
    data: Data, s: _Settings, holdout: Holdout | None, moments: dict, method: str, paths: Potentials, densities: dict
) -> Engine:
    """Both phases of one chain as an :class:`~bnn_pyro.infer.contract.Engine`: pre-training, then the SWA phase
    whose snapshots :meth:`after` collects; ``draws`` makes the SWA point or the SWAG draws (and puts their
    ``log q`` in ``densities[chain]``, ``None`` where ``q`` is degenerate)."""
    pretrain, function = s.pretrain_steps, s.function

    def init(fitted, info: ChainInfo) -> _Chain:
        generator = torch.Generator().manual_seed(info.seed)
        start = chain_start(fitted, s.init, info.seed)
        if isinstance(fitted, BNN):
            fitted.train()  # BatchNorm and dropout behave as in training
        pot = paths(fitted, data, init=start)
        z = pot.flatten(pot.init).clone().requires_grad_()
        if function is not None:  # a small Pyro function's chain starts at the mode (swag_function)
            with torch.no_grad():
                z.copy_(function.metric.mode.to(z))
        with poutine.trace(param_only=True) as capture:
            pot(pot.unflatten(z), data.first())
        point_params = [site["value"].unconstrained() for site in capture.trace.nodes.values()]
        params = [z] + point_params
        opt = PhasedOptimizer(
            params,
            pretrain_optimizer=s.pretrain_optimizer,
            pretrain_lr=s.pretrain_lr,
            pretrain_steps=pretrain,
            momentum=s.momentum,
            pretrain_schedule=s.pretrain_schedule,
            precondition=None if function is None else (lambda g: function.precondition(g, data.size)),
        )
        state = _Chain(
            fitted,
            info.index,
            info.seed,
            pot,
            z,
            point_params,
            params,
            opt,
            generator,
            SWAGMoments.empty(z, s.rank),
            [torch.zeros_like(p) for p in point_params],
            BestOnHoldout(every=max(1, pretrain // 50), patience=None),
            data.size,
            flat_tilt(anchor(fitted, pot, data.first(), seed=info.seed)[0], pot)
            if s.anchored and function is None
            else None,
        )
        if pretrain == 0:
            start_swa(state)
        return state

    def start_swa(state: _Chain) -> None:
        if function is not None:  # at the mode already, at the whitened rule's rate
            state.opt.start_swa(function.lr)
            return
        if holdout is not None and state.best.state is not None:  # early stopping: the best pre-trained state
            with torch.no_grad():
                for p, kept in zip(state.params, state.best.state):
                    p.copy_(kept)
        elif _to_mode(state.model, state.point_params, state.z, data):  # a Pyro function: pre-training to its minimum
            full = (data.x, data.y)
            tilt = state.tilt if state.tilt is not None else torch.zeros_like(state.z)
            mode = damped_newton(
                lambda v: state.pot(state.pot.unflatten(v), full) + v @ tilt, state.z, steps=CONVERGE_NEWTON
            )
            with torch.no_grad():
                state.z.copy_(mode)
        lr = (
            s.lr
            if s.lr != "auto"
            else auto_lr(
                state.loss, state.params, data, batch_size=s.batch_size, momentum=s.momentum, generator=state.generator
            )
        )
        state.opt.start_swa(lr)

    def step(state: _Chain, batch, index: int):
        lr = state.opt.param_groups[0]["lr"]
        if function is not None:  # fresh weights and anchor, drawn under a seed from the chain's generator
            seed = int(torch.randint(2**31 - 1, (), generator=state.generator))
            loss = function.loss(state.model, state.pot, state.z, batch, seed, state.size)
        else:
            loss = state.loss(batch)
        return loss, SWAInfo(loss.item(), lr)

    def after(state: _Chain, index: int, info: SWAInfo) -> SWAInfo:
        if index < pretrain:
            if holdout is not None and (state.best.due(index) or index == pretrain - 1):
                with torch.no_grad():
                    score = heldout_score(
                        state.model, state.pot.constrain(state.pot.unflatten(state.z.detach())), holdout
                    )
                state.best.record(index, score, [p.detach() for p in state.params])
            if index == pretrain - 1:
                start_swa(state)
            return info
        swa_step = index + 1 - pretrain
        if swa_step > s.burn_in and (swa_step - s.burn_in) % s.collect_every == 0:
            state.moments.collect(state.z if function is None else function.whiten(state.z))
            for acc, p in zip(state.point_sum, state.point_params):
                acc += p.detach()
        return info

    def where(state: _Chain, index: int) -> str:
        phase = "pre-training" if index < pretrain else "the SWA phase"
        return f"step {index} ({phase}, lr {state.opt.param_groups[0]['lr']:.3g}) of {method} chain {state.index}"

    def checkpoint(state: _Chain, ckpt, records) -> StepCheckpoint:
        extra = ExtraState(generator=state.generator, moments=state.moments, point_sum=state.point_sum, best=state.best)
        return StepCheckpoint(ckpt, state.params, records, extra)

    def draws(state: _Chain, history: dict[str, torch.Tensor]) -> ChainRun:
        m, pot, fitted = state.moments, state.pot, state.model
        moments[state.index] = m
        with torch.no_grad():
            for acc, p in zip(state.point_sum, state.point_params):
                p.copy_(acc / m.count)  # deterministic parameters at their SWA average
            mean = m.mean[None].to(state.z.dtype)
            flat = m.sample(s.num_samples, s.scale, state.generator).to(state.z.dtype) if s.rank else mean
            log_q = _density.swag(m, flat, s.scale) if s.rank else None  # for post.psis()
            if function is not None:  # the moments are of u = L^T (z - mode): z = mode + L^-T u, q(z) = q(u) |L|
                mean, flat = function.unwhiten(mean).to(state.z.dtype), function.unwhiten(flat).to(state.z.dtype)
                log_q = None if log_q is None else log_q + function.log_det
            average = {k: v.detach() for k, v in pot.constrain(pot.unflatten(mean)).items()}
            samples = {k: v.detach() for k, v in pot.constrain(pot.unflatten(flat)).items()}
            point = point_values(fitted, *data.first(), data.size)
        buffers = batchnorm_statistics(fitted, samples, average, data, s.batch_size)
        if holdout is not None and state.best.state is not None:  # the pre-training step kept (holdout.refit)
            history["best_step"] = torch.tensor([state.best.best_step])
        densities[state.index] = log_q
        return ChainRun(fitted, samples, point, history, {}, buffers)

    return Engine(
        init=init,
        step=step,
        draws=draws,
        info=SWAInfo,
        after=after,
        checkpoint=checkpoint,
        optimizer=lambda state: state.opt,
        batches=lambda state, start: _batches(data, s, state, start),
        where=where,
    )


def _batches(data: Data, s: _Settings, state: _Chain, start: int):
    """The batches from step ``start`` on. A loader: its own batches in both phases (replayed up to ``start``).
    Tensors: pre-training on the data's batches (the full batch, or epochs of ``batch_size`` rows reshuffled by
    the chain's seed; replayed up to ``start``), then minibatches of ``B`` rows drawn with replacement by the
    chain's generator (which a checkpoint restores), the noise the SWA phase is built on."""
    if data.loader is not None:
        batches = data.batches(state.generator)
        for _ in range(start):
            next(batches)
        yield from batches
    if s.function is not None:  # every row each step (swag_function); weights drawn in the step
        while True:
            yield data.x, data.y
    pre = data.batches(torch.Generator().manual_seed(state.seed))
    for _ in range(min(start, s.pretrain_steps)):
        next(pre)
    for _ in range(start, s.pretrain_steps):
        yield next(pre)
    while True:
        idx = torch.randint(data.x.shape[0], (s.batch_size,), generator=state.generator).to(data.x.device)
        yield data.x[idx], data.y[idx]


NARROW = (
    "SWAG's covariance is that of SGD's iterates at the SWA learning rate, which matches the posterior's only at "
    "one particular rate (Mandt et al. 2017), not in general. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for SWAG."""

NARROW_FUNCTION = (
    "This Pyro function kept the plain collection ({skipped}; post.config['collection']): on all its rows SGD's "
    "iterates have almost no gradient noise, so they stay near the mode. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for a Pyro function that was not given the
whitened collection (:mod:`bnn_pyro.infer.swag_function`)."""

NARROW_WHITENED = (
    "The whitened collection randomizes the prior half of real-valued sites only: a constrained site (a scale, a "
    "hierarchical sd) that the prior rather than the data sets keeps a narrow spread. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names after the whitened collection."""
