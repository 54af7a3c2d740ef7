r"""Monte Carlo dropout as variational inference: ``bp.fit(model, x, y, method="mc_dropout", ...)``.

The guide family (Gal & Ghahramani 2016, "Dropout as a Bayesian Approximation: Representing Model
Uncertainty in Deep Learning"). Every Bayesian weight of an ``nn.Linear`` layer, shaped
``(out, in)``, is ``W = M diag(z)`` with one Bernoulli variable per input unit,
``z_j ~ Bernoulli(1 - p)`` (``p`` is the drop rate, no ``1 / (1 - p)`` rescaling: ``W`` itself is
the weight the prior sees). Convolutions drop whole input channels (``ConvNd``: the mask of channel
``c`` scales ``weight[:, c]`` within its group; ``ConvTransposeNd``: ``weight[c]``). Every other
latent site (biases, hyper sites, a learned noise scale) is a point mass at a variational parameter
in Pyro's unconstrained coordinates (the limit of a Gaussian of vanishing width there: MAP with the
log-Jacobian), and a ``BNN``'s deterministic parameters are fitted alongside (type-II ML). The
first ``Linear``/``Conv`` module in registration order reads the raw inputs; dropping those is Gal's
UCI setting (``dropout_inputs=True``), but with few input features a dropped feature deletes the
signal, so by default (``None``) the input layer is kept whole unless it is the only layer.

The objective, with the model's own prior. :class:`~bnn_pyro.infer._potential.Potential` gives
``U(w) = -log p(w) - (N / B) sum_{i in B} log p(y_i | x_i, w)``. Gal's ``q`` is the limit
``sigma -> 0`` of a mixture, per input column, of ``N(0, sigma^2)`` (dropped, probability ``p``)
and ``N(M_:j, sigma^2)`` (kept). Its entropy is ``sum_layers K_l H(p_l) + c(sigma)``
(``K_l`` input units, ``H(p) = -p log p - (1 - p) log(1 - p)``; the components stop overlapping as
``sigma -> 0``), so the negative ELBO is

    L(M, p) = E_z[ U(M diag z) ] - sum_l K_l H(p_l) - c(sigma),   c(sigma) ~ (#weights / 2) log sigma^2.

For a ``Normal(0, s^2)`` prior, ``E_z[-log p(M diag z)] = (1 - p) ||M||^2 / (2 s^2) + const``: Gal's
weight decay, ``lambda = (1 - p) / (2 s^2 N)`` per datum next to the mean negative log-likelihood.
Other priors enter the same way (``(1 - p)(-log p(M)) + p(-log p(0))`` per weight), so ``U`` is never
rewritten here. What is not a proper ELBO: ``c(sigma)`` diverges (the KL from a point-mass-like ``q``
to a continuous prior is infinite), and Gal drops it. It depends on neither ``M`` nor ``p``, so the
gradients and the optimum are those of the ``sigma -> 0`` limit; but the value (``history["loss"]``,
an estimate of ``L`` without ``c``) is no bound on the evidence, and it cannot be compared between
models with different numbers of weights or with other methods' ELBOs.

Each step draws masks (``num_particles``, one mask per weight tensor shared by the whole batch, as
the ``q`` over weights says; Gal's per-example masks estimate the same expectation) and minimizes
``L`` by ``optimizer``. The rate ``p`` per layer (``rate=``, a :class:`RateLearning`):

- ``"fixed"``: ``p`` stays; ``grad_M = E_z[ grad_M U(M diag z) ]`` by Monte Carlo.
- ``"reinforce"``: ``p = sigmoid(theta)`` learned by the score function (Williams 1992, "Simple
  statistical gradient-following algorithms for connectionist reinforcement learning"):
  ``grad_theta L = E_z[(U - b) grad_theta log q(z)] - K grad_theta H(p)`` with
  ``log q(z) = sum_j z_j log(1 - p) + (1 - z_j) log p``; the baseline ``b`` is the mean of the other
  particles (``num_particles > 1``, default 4: Kool, van Hoof & Welling 2019, "Buy 4 REINFORCE
  samples, get a baseline for free!") or a decaying average of past ``U`` (``baseline_beta``);
  neither depends on the current mask, so the estimate stays unbiased.
- ``"concrete"``: a relaxed mask (Gal, Hron & Kendall 2017, "Concrete Dropout"),
  ``z~ = sigmoid((log(1 - p) - log p + log u - log(1 - u)) / t)``, ``u ~ U(0, 1)``, and the pathwise
  gradient of ``E_u[U(M diag z~)] - sum_l K_l H(p_l)``: the entropy term is Gal et al.'s dropout
  regularizer (``K H(p)`` per layer; ``K H(p) / N`` per datum). It is biased by the relaxation
  (temperature ``t``, default 0.1) and has far lower variance than REINFORCE. Draws use hard masks.

In practice a fixed ``p`` trades fit for noise: on ``bp.datasets.toy_gap`` (1-50-1 tanh net,
``sigma = 0.1``) the default ``p = 0.1`` gives a test RMSE of 0.31 with epistemic sd ~0.22, while
both learned rates fall to ``p ~ 1e-3`` (RMSE 0.12, sd ~0.08); in neither case does the sd grow
inside the gap between the clusters (the known weakness of dropout and mean-field posteriors for
"in-between" uncertainty: Foong, Li, Hernandez-Lobato & Turner 2019, "'In-Between' Uncertainty
in Bayesian Neural Networks"). Measured on ``toy_gap`` with a 1-50-1 tanh net (epistemic sd in the gap,
|x| < 0.3, over that on the clusters, |x| >= 0.5; NUTS: 6.6x): 0.89x at the defaults, and 0.90x with three
restarts mixed (``num_chains=3``) at ``p = 0.1`` and at ``p = 0.01``; 0.87x at ``p = 0.3`` and 0.88x at
``p = 0.5``; a ReLU net: 0.30x; the zoo's ``mlp_regression`` (the same net with the noise learned as a point
mass, no held-out rows at 80 points): 0.28x. This is structural for one hidden layer: only the hidden units'
masks act (the input layer is kept whole by default), so ``Var f(x) = p (1 - p) sum_j M_j^2 h_j(x)^2`` with
``h_j(x) = act(w_j x + b_j)``; each ``h_j^2`` of a monotone activation (tanh, ReLU) is quasi-convex in ``x``,
so at any ``x`` between two inputs ``a`` and ``b`` it is at most ``max(h_j(a)^2, h_j(b)^2)`` and
``Var f(x) <= Var f(a) + Var f(b)``: in-gap sd at most ``sqrt(2)`` times the larger one at the gap's edges,
whatever ``p``, the prior or the rate learning (the argument of Foong et al. 2019 for factorized Gaussians).
Neither the rate nor restarts fix it, so the defaults stay one chain at ``p = 0.1``; use ``method="ensemble"``
or ``method="swag"`` (five chains by default) when in-between uncertainty matters.

Off-data inputs (classification; issue 26, ``docs/ood.md``). With the input layer kept whole (the default), a
one-hidden-layer net's masks act on its hidden units: ``f_z(x) = M_2 (z * h(x)) + b_2`` with
``h = act(W_1 x + b_1)``. The margin between two classes ``a, b``, ``m_z(x) = sum_j z_j c_j h_j(x) + beta``
(``c_j = M_2[a, j] - M_2[b, j]``), has mean ``(1 - p) S(x) + beta`` and sd ``sqrt(p (1 - p)) R(x)``, where
``S = sum_j c_j h_j`` and ``R = (sum_j c_j^2 h_j^2)^(1/2)`` are the sum and the root-sum-square of the fitted
units' own contributions. The masks can only make the predicted class uncertain where those contributions
cancel (``|S| <~ sqrt(p / (1 - p)) R``: near the fitted decision boundary), never because ``x`` is far from the
data: for a ReLU net with the biases small against ``W_1 x`` (far from the origin), ``h(t x) = t h(x)``, so the
whole distribution of every margin scales by ``t`` along a ray, each mask grows more confident, and the fraction
of masks that flip the class stays what it was. A fixed ``p`` only sets the spread's scale; neither its value nor
learning it changes this. Measured (``benchmarks/classification.py`` protocol, split 0, 13-50-3 and 4-50-3 ReLU
nets, ``Normal(0, 1)`` prior): the AUROC of the predictive entropy / mutual information separating Gaussian
noise inputs (sd 3) from test rows was 0.45 / 0.49 (wine) and 0.35 / 0.34 (iris) at ``p = 0.1``, 0.46 / 0.50 and
0.36 / 0.34 at ``p = 0.3``, 0.48 / 0.52 and 0.37 / 0.39 at ``p = 0.5``, 0.48 / 0.54 and 0.34 / 0.36 with the
concrete rate. Dropping the inputs as well (``dropout_inputs=True``, Gal's UCI setting) lets the masks remove
input directions, so that inputs off the data's pattern of features get disagreeing masks: at ``p = 0.5``
0.78 / 0.95 (wine) and 0.72 / 0.96 (iris), at a test log loss of 0.18 and 0.34 against 0.08 and 0.04 at the
defaults, which therefore stay. A classification fit with the inputs kept whole says so
(:func:`~bnn_pyro.infer.health_off_data.check_off_data`, :data:`OFF_DATA`).

Held-out rows (``validation=``, default 10% of tensor data, at least 20 rows, of at least 40 rows;
:mod:`bnn_pyro.infer.holdout`): training is early-stopped on the held-out likelihood of the
weight-averaged net ``(1 - p) M`` and a learned Gaussian noise is chosen on them at the end, for the
MC-dropout predictive. On scikit-learn's diabetes (random 90/10 splits 0-2, standardized, 10-50-1 ReLU
net, ``Normal(0, 1)`` prior, ``Gaussian(scale=HalfNormal(1))``) the mean test log-likelihood per point
went from -5.76 to -5.43 (deep ensembles with the same rule: -5.37).

Draws: ``num_samples`` per chain of every latent site, ``W = M diag(z)`` with fresh hard masks (the
point-mass sites repeat their value); ``num_chains`` independent restarts (seeds ``seed + c``) are
the chains. ``sample_stats["dropout_rate[<site>]"]`` holds each draw's rate and, for learned rates,
``history["dropout_rate[<site>]"]`` its trajectory. The fit is an :class:`~bnn_pyro.infer.contract.Engine`
(:func:`dropout_engine`, state :class:`DropoutState`) run by :func:`~bnn_pyro.infer.contract.drive`.

Examples
--------
>>> post = bp.fit(model, x, y, method="mc_dropout", seed=0)                 # p = 0.1 on hidden units
>>> post = bp.fit(model, x, y, method="mc_dropout", rate="concrete", num_chains=4)
>>> post.history["dropout_rate[2.weight]"][:, -1]                          # fitted rate per chain
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

import pyro
import torch
from pyro import poutine
from torch import nn
from torch.distributions import constraints

from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.checkpoint import Checkpoint, ExtraState, StepCheckpoint, open_chains
from bnn_pyro.infer.contract import Engine, Loop, LossInfo, PotentialRunOptions, drive, entry
from bnn_pyro.infer.driver import ChainRun
from bnn_pyro.infer.health_off_data import check_off_data
from bnn_pyro.infer.health_spread import check_spread
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
from bnn_pyro.infer.optim import DEFAULT_SCHEDULE, check_lr
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, positive, positive_int

__all__ = ["fit_mc_dropout", "RateLearning", "MCDropoutConfig", "DropoutState", "dropout_engine"]

_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)
_EPS = 1e-6  # uniforms are kept in [eps, 1 - eps] so that the logistic noise stays finite


class RateLearning(str, Enum):
    FIXED = "fixed"
    REINFORCE = "reinforce"
    CONCRETE = "concrete"


@dataclass
class _Site:
    """A dropout site: ``units`` (long, broadcastable to the weight) maps each weight entry to
    the input unit whose mask scales it; ``size`` is the number of input units."""

    name: str
    units: torch.Tensor
    size: int


@dataclass(frozen=True)
class MCDropoutConfig(PotentialRunOptions):
    """The options of ``method="mc_dropout"`` and their defaults (documented in :func:`fit_mc_dropout`)."""

    p: float = 0.1
    rate: str = "fixed"
    temperature: float | None = None
    baseline_beta: float | None = None
    dropout_inputs: bool | None = None
    num_steps: int | None = None
    epochs: int | None = None
    lr: float = 1e-2
    optimizer: object = "adam"
    lr_schedule: object = DEFAULT_SCHEDULE
    num_particles: int | None = None
    num_chains: int = 1
    num_samples: int = 1000
    init: object = None
    validation: object = "default"


@entry(MCDropoutConfig)
def fit_mc_dropout(model, data: Data, cfg: MCDropoutConfig) -> Posterior:
    """Fit ``model`` by MC dropout and return a :class:`~bnn_pyro.Posterior` (see the module docstring).

    Parameters
    ----------
    p, rate:
        Drop rate in (0, 1) (the initial one when learned), and how it is learned: ``"fixed"``
        (default), ``"reinforce"`` or ``"concrete"``; one rate per layer.
    temperature, baseline_beta:
        Concrete relaxation temperature (``rate="concrete"``, default 0.1); decaying-average
        baseline weight (``rate="reinforce"`` with one particle, default 0.9).
    dropout_inputs:
        Also drop the input units of the first ``Linear``/``Conv`` layer (the raw features). Default:
        only when that layer is the only one.
    num_steps, epochs:
        Run length in optimizer steps or passes over the data (one of the two; default 3,000 steps).
    lr, optimizer, lr_schedule:
        The optimizer, learning rate and schedule, with the choices and defaults of :func:`bnn_pyro.infer.svi.fit`:
        Adam at 1e-2, its rate annealed to 1% on a cosine (every optimizing engine's default; why, and what ``lr``
        means: :mod:`bnn_pyro.infer.optim`).
    num_particles:
        Masks per step (the loss is their mean). Default 1, and 4 for ``rate="reinforce"``, whose
        leave-one-out baseline needs at least 2 (with one particle the decaying-average baseline
        lags a falling loss and the rate random-walks).
    num_chains, num_samples:
        Independent restarts, and draws per restart.
    init:
        Initial ``M`` and point values: ``"reset"`` (default: the layers' ``reset_parameters()`` under
        chain ``c``'s seed ``seed + c``), ``"net"`` (the net's weights), ``"prior"``, ``"median"``, a dict
        of site values or a :class:`Posterior` (see :mod:`bnn_pyro.infer._init`).
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`): by default 10% of the training rows when the model has a
        learned Gaussian noise (a ``BNN`` with ``Gaussian(scale=<prior>)``), at least 20 rows (none below 40) and the
        data are tensors; the same rows for every chain. Without a noise to choose (classification, a known
        noise) the default holds nothing out: early stopping alone did not pay for the rows it took (two moons,
        200 points, 16 tanh units: test accuracy 0.94 with 20 rows held out, above 0.95 without). Each chain keeps its state
        with the best held-out likelihood of the weight-averaged net ``(1 - p) M`` (scored every
        ``num_steps // 50`` steps: early stopping), and a learned Gaussian noise is then set to the value that
        maximizes the held-out log predictive density of the MC-dropout predictive (all chains' draws). Then
        the chains are trained again on every row for the chosen number of epochs (the median best step, scaled
        to all rows), their schedule annealed over those steps, and the chosen noise replaces theirs
        (:func:`~bnn_pyro.infer.holdout.refit`). Unlike the point-fit engines, the refit does not rerun the schedule
        of the fit that chose stopped at the chosen step: the masks make each state a noisy one, the state scored
        best among 50 noisy ones is not the one a refit reaches, and on benchmarks/uci.py's diabetes and friedman1
        (5 splits each) that refit lost 0.03 nats of test log-likelihood per point (8 of 10 splits worse). A
        fraction, an ``(x_val, y_val)`` pair (no refit: every row is fitted already), or ``None`` (all rows
        trained on for all ``num_steps``, the noise at its fitted point value: overconfident on small data).
        Costs a second fit and one forward pass over the held-out rows per score.
    seed, progress:
        Random seed (chain ``c`` uses ``seed + c``), and a progress bar (``False``: off).
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps and after the
        last; ``resume=True`` continues each chain from its file, bit-identically (the masks' generator, the
        REINFORCE baseline and early stopping included; see :mod:`bnn_pyro.infer.checkpoint`).
    fast_path:
        ``True`` (default): the potential is evaluated without tracing Pyro where the model allows it (same
        values); ``False`` forces Pyro's traced potential (see :class:`~bnn_pyro.infer._potential.Potentials`).
        ``config["fast_path"]`` says which ran, ``config["potential"]`` the path.
    """
    # chosen on held-out rows (stopping point, noise), then fitted on every row with them (holdout.refit)
    post = refit(
        _fit(model, data, cfg),
        lambda chosen: _fit(model, data, refit_config(replace(cfg, epochs=None), chosen)),
        budget=None,  # the schedule annealed over the chosen steps, not the scored run's (validation=, above)
    )
    check_spread(post, SPREAD)
    return post if _inputs_dropped(model, post) else check_off_data(post, OFF_DATA)


def _inputs_dropped(model, post: Posterior) -> bool:
    """Whether the masks reach the raw inputs (the first layer's weight is among ``config["dropout_sites"]``)."""
    first = next(
        (f"{path}.weight" if path else "weight" for path, m in model.net.named_modules() if isinstance(m, _LAYERS)),
        None,
    )
    return first in str(post.config.get("dropout_sites", "")).split(",")


OFF_DATA = (
    "with the input layer kept whole (dropout_inputs=None, the default) its spread comes from dropping the "
    "fitted net's own hidden units at a fixed rate p, so each logit's spread is a fixed fraction of its "
    "units' own contributions wherever the input is, and grows away from the data no faster than the logit "
    "itself (for a ReLU net, exactly so along every ray from the origin, biases aside), whatever p; "
    "dropout_inputs=True lets the masks reach the input directions, at a cost in test log loss."
)
"""The structural limit :func:`~bnn_pyro.infer.health_off_data.check_off_data` states for classification (module
docstring: "Off-data inputs")."""


SPREAD = (
    "its draws are the fitted weights M with units dropped at the rate p (W = M diag(z)), so their spread is set "
    "by p and the weights' own sizes, not by the data: on an exact Bayesian linear regression the draws' means were "
    "6 posterior sds off and their sds 0 to 4.5 times the exact ones."
)
"""The structural limit :func:`~bnn_pyro.infer.health_spread.check_spread` states for every MC dropout fit (Gal &
Ghahramani 2016 read dropout as variational inference for a different model: a Gaussian prior on M, a
spike-and-slab-like posterior; the draws of ``W`` are not this model's posterior)."""


def _fit(model, data: Data, cfg: MCDropoutConfig) -> Posterior:
    kind = choice("rate", cfg.rate, RateLearning)
    p = cfg.p
    if not (isinstance(p, (int, float)) and 0.0 < p < 1.0):
        raise ValueError(
            f"p: the drop rate must be a number in (0, 1), got {p!r}; try p=0.1 (p=0 is MAP: "
            "method='svi', guide='map')."
        )
    for name, value, owner in (
        ("temperature", cfg.temperature, RateLearning.CONCRETE),
        ("baseline_beta", cfg.baseline_beta, RateLearning.REINFORCE),
    ):
        if value is not None and kind is not owner:
            raise ValueError(f"{name}= applies to rate={owner.value!r} only, not {kind.value!r}; drop it.")
    temperature = positive("temperature", 0.1 if cfg.temperature is None else cfg.temperature)
    beta = 0.9 if cfg.baseline_beta is None else cfg.baseline_beta
    if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
        raise ValueError(f"baseline_beta must be in [0, 1), got {beta!r}; try 0.9.")
    num_steps, epochs = cfg.num_steps, cfg.epochs
    if num_steps is not None and epochs is not None:
        raise ValueError("mc_dropout: give num_steps= or epochs=, not both.")
    if epochs is not None:
        per_epoch = (
            len(data.loader) if data.loader is not None else math.ceil(data.size / (data.batch_size or data.size))
        )
        num_steps = positive_int("epochs", epochs) * per_epoch
    num_particles = cfg.num_particles if cfg.num_particles is not None else 4 if kind is RateLearning.REINFORCE else 1
    s = replace(
        cfg,
        rate=kind,
        temperature=temperature,
        baseline_beta=beta,
        epochs=None,
        num_steps=positive_int("num_steps", 3000 if num_steps is None else num_steps),
        num_particles=positive_int("num_particles", num_particles),
        num_chains=positive_int("num_chains", cfg.num_chains),
        num_samples=positive_int("num_samples", cfg.num_samples),
        lr=check_lr(cfg.lr, method="mc_dropout"),
    )
    full, validation = data, cfg.validation
    if isinstance(validation, str) and validation == "default" and noise_site(model) is None:
        data, holdout, why = full, None, "no learned Gaussian noise to choose (pass validation=0.1 to early-stop)"
    else:
        data, holdout, why = split(
            full, validation, seed=s.seed, method="mc_dropout", convert=full.convert, model=model
        )
    sites = dropout_sites(model, data, s.dropout_inputs)
    init = resolve_init(model, s.init, data)
    config = clean_config(
        dict(
            p=float(p),
            rate=kind.value,
            temperature=temperature if kind is RateLearning.CONCRETE else None,
            baseline_beta=beta if kind is RateLearning.REINFORCE else None,
            dropout_sites=",".join(sites),
            num_steps=s.num_steps,
            lr=s.lr,
            optimizer=getattr(s.optimizer, "value", s.optimizer),
            lr_schedule=getattr(s.lr_schedule, "value", s.lr_schedule),
            num_particles=s.num_particles,
            num_chains=s.num_chains,
            num_samples=s.num_samples,
            init=init if isinstance(init, str) else type(init).__name__,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=s.seed,
            validation=describe(holdout, validation if validation != "default" else DEFAULT, why),
        )
    )
    ckpts = open_chains(
        s.checkpoint,
        every=s.checkpoint_every,
        resume=s.resume,
        num_chains=s.num_chains,
        run=dict(method="mc_dropout", **config),
    )
    loop = Loop(
        num_steps=s.num_steps,
        lr=s.lr,
        method="mc_dropout",
        desc="mc_dropout chain {index}",
        optimizer=s.optimizer,
        lr_schedule=s.lr_schedule,
        progress=s.progress,
    )
    paths = Potentials(s.fast_path)
    post = drive(
        model,
        data,
        dropout_engine(data, sites, init, s, holdout, paths),
        loop,
        num_chains=s.num_chains,
        seed=s.seed,
        config=config,
        checkpoints=ckpts,
        posterior_data=full,
    )
    paths.record(post.config)
    return select_noise(post, holdout)


def dropout_sites(model, data: Data, dropout_inputs: bool | None) -> dict[str, _Site]:
    """The Bayesian ``Linear``/``Conv`` weights of ``model`` whose input units get masks, or a
    ``TypeError``/``ValueError`` saying why there are none and which method fits instead."""
    if not isinstance(model, BNN):
        raise TypeError(
            f"mc_dropout: needs a bp.BNN whose Bayesian weights sit in nn.Linear or nn.Conv layers (the masks "
            f"drop their input units); got {type(model).__name__} {getattr(model, '__name__', '')!r}, a Pyro "
            "function model, which has no layers to drop. Use method='svi' (on a small Pyro function its default "
            "guide is full-rank, started at the Laplace approximation) or method='nuts' for it, or wrap a torch net "
            "as bp.BNN(net, prior=..., likelihood=...)."
        )
    x0, y0 = data.first()
    with torch.no_grad(), pyro.get_param_store().scope():
        trace = poutine.trace(model).get_trace(x0[:2], None if y0 is None else y0[:2])
    layers = [(path, m) for path, m in model.net.named_modules() if isinstance(m, _LAYERS)]
    found = {}
    for i, (path, module) in enumerate(layers):
        name = f"{path}.weight" if path else "weight"
        if name not in model.sample_names:
            continue
        support = trace.nodes[name]["fn"].support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        if support is not constraints.real:
            raise ValueError(
                f"mc_dropout: the prior of {name!r} has support {support}, but W = M diag(z) puts "
                "dropped weights at 0; give the weights a prior on the real line (e.g. "
                "bp.priors.Normal(0., 1.))."
            )
        found[name] = (i == 0, _site(name, module))
    if not found:
        raise ValueError(
            f"mc_dropout: this BNN has no Bayesian weight of an nn.Linear or nn.Conv layer (Bayesian sites: "
            f"{model.sample_names or 'none'}; layers: {[p for p, _ in layers] or 'none'}), so there are no "
            "input units to drop. Give those weights a prior (bayesian='all' or 'weights'), or use "
            "method='svi' with guide='mean_field' for this model."
        )
    only_input = all(first for first, _ in found.values())
    keep_inputs = only_input if dropout_inputs is None else bool(dropout_inputs)
    sites = {n: s for n, (first, s) in found.items() if keep_inputs or not first}
    if not sites:
        raise ValueError(
            f"mc_dropout: dropout_inputs=False leaves no layer to drop: {list(found)} reads the raw "
            "inputs and is the only Bayesian Linear/Conv weight. Pass dropout_inputs=True (or None)."
        )
    return sites


def _site(name: str, module: nn.Module) -> _Site:
    w = module.weight
    if isinstance(module, nn.Linear):
        return _Site(name, torch.arange(w.shape[1]).reshape(1, -1), w.shape[1])
    trailing = (1,) * (w.dim() - 2)
    if module.transposed:  # weight (in, out / groups, *kernel)
        return _Site(name, torch.arange(w.shape[0]).reshape((-1, 1) + trailing), w.shape[0])
    out, per_group = w.shape[0], w.shape[1]  # weight (out, in / groups, *kernel)
    group = torch.arange(out) // (out // module.groups)
    units = group[:, None] * per_group + torch.arange(per_group)[None, :]
    return _Site(name, units.reshape((out, per_group) + trailing), module.in_channels)


class DropoutGuide:
    """The variational parameters of one run: ``values`` (``M`` for dropout sites, the unconstrained
    point values of the other sites) and one rate logit per dropout site (``p = sigmoid(logit)``)."""

    def __init__(self, pot: Potential, sites: dict[str, _Site], p: float, *, learn: bool):
        self.pot = pot
        self.values = {k: v.clone().requires_grad_() for k, v in pot.init.items()}
        like = next(iter(self.values.values()))  # the model's device and dtype
        self.device = like.device
        self.sites = {k: _Site(k, s.units.to(self.device), s.size) for k, s in sites.items()}
        self.logits = {k: like.new_tensor(math.log(p / (1 - p))).requires_grad_(learn) for k in sites}

    def parameters(self) -> list[torch.Tensor]:
        return list(self.values.values()) + [t for t in self.logits.values() if t.requires_grad]

    def rates_float(self) -> dict[str, float]:
        return {k: float(torch.sigmoid(t.detach())) for k, t in self.logits.items()}

    def noise(self, shape: tuple, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Uniforms ``(*shape, units)`` per site: unit ``j`` is kept when ``u_j > p`` (hard masks)."""
        like = next(iter(self.values.values()))  # drawn by the CPU generator, used on the model's device and dtype
        return {
            k: torch.rand(shape + (s.size,), generator=generator).clamp(_EPS, 1 - _EPS).to(like)
            for k, s in self.sites.items()
        }

    def keep(self, noise: dict[str, torch.Tensor], temperature: float | None = None) -> dict[str, torch.Tensor]:
        """Keep masks from uniforms: hard ``1[u > p]`` (no gradient to ``p``), or relaxed (Concrete)."""
        out = {}
        for k, u in noise.items():
            logit = torch.log(u) - torch.log1p(-u) - self.logits[k]  # logistic noise + log((1 - p) / p)
            out[k] = (logit > 0).to(u.dtype) if temperature is None else torch.sigmoid(logit / temperature)
        return out

    def weights(self, keep: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unconstrained values of every site with ``W = M diag(z)`` at the dropout sites."""
        out = dict(self.values)
        for k, z in keep.items():
            out[k] = self.values[k] * z[..., self.sites[k].units]
        return out

    def log_q(self, keep: dict[str, torch.Tensor]) -> torch.Tensor:
        """``log q(z)`` of hard masks, summed over sites and units."""
        return sum(
            (
                z * torch.nn.functional.logsigmoid(-self.logits[k])
                + (1 - z) * torch.nn.functional.logsigmoid(self.logits[k])
            ).sum(-1)
            for k, z in keep.items()
        )

    def entropy(self) -> torch.Tensor:
        """``sum_l K_l H(p_l)``: the mask entropy (the finite part of ``q``'s entropy)."""
        return sum(
            s.size * torch.distributions.Bernoulli(logits=self.logits[k]).entropy() for k, s in self.sites.items()
        )

    @torch.no_grad()
    def draw(self, num_samples: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``num_samples`` draws of every latent site (constrained), with fresh hard masks."""
        keep = self.keep(self.noise((num_samples,), generator))
        values = self.weights(keep)
        values = {
            k: v.detach() if k in keep else v.detach().expand((num_samples,) + v.shape).clone()
            for k, v in values.items()
        }
        return self.pot.constrain(values)


def objective(
    guide: DropoutGuide,
    pot: Potential,
    batch,
    noise: list[dict],
    kind: RateLearning,
    temperature: float,
    baseline: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(surrogate, loss, energy)`` for one step: ``loss`` estimates ``L`` (mean over the particles
    in ``noise``), ``energy`` the mean ``U``; ``surrogate``'s gradient is the estimator of ``grad L``
    for ``kind`` (see the module docstring). ``baseline`` is REINFORCE's with one particle (with
    several, leave-one-out; with none given, the particle's own ``U``: a zero first step)."""
    relaxed = temperature if kind is RateLearning.CONCRETE else None
    energies, log_qs = [], []
    for u in noise:
        keep = guide.keep(u, relaxed)
        energies.append(pot(guide.weights(keep), batch))
        if kind is RateLearning.REINFORCE:
            log_qs.append(guide.log_q(keep))
    energy = torch.stack(energies)
    loss = energy.mean() - guide.entropy()
    n, e = len(noise), energy.detach()
    if kind is not RateLearning.REINFORCE:
        return loss, loss.detach(), float(e.mean())
    b = (e.sum() - e) / (n - 1) if n > 1 else torch.as_tensor(e[0] if baseline is None else baseline)
    return loss + ((e - b) * torch.stack(log_qs)).mean(), loss.detach(), float(e.mean())


@torch.no_grad()
def _score(model, guide: DropoutGuide, pot: Potential, holdout: Holdout) -> float:
    """Held-out score of the weight-averaged net ``W = (1 - p) M`` (the dropout predictive's mean rule)."""
    keep = {k: torch.sigmoid(-t).expand(s.size) for (k, t), s in zip(guide.logits.items(), guide.sites.values())}
    return heldout_score(model, pot.constrain(guide.weights(keep)), holdout)


@dataclass
class DropoutState:
    """One chain of MC dropout: its model copy and potential, the guide, the optimized tensors ``params`` (``M`` and
    the point values, learned rate logits, the model's deterministic parameters), the masks' generator (seeded by the
    chain's ``seed``, which also seeds its draws), REINFORCE's decaying baseline, early stopping's ``best`` record of
    ``kept`` (values, every rate logit, deterministic parameters) and each dropout site's rate per step."""

    model: object
    pot: Potential
    guide: DropoutGuide
    params: list[torch.Tensor]
    kept: list[torch.Tensor]
    masks: torch.Generator
    baseline: list
    best: BestOnHoldout
    rates: dict[str, torch.Tensor]
    seed: int


def dropout_engine(
    data: Data,
    sites: dict[str, _Site],
    init,
    s: MCDropoutConfig,
    holdout: Holdout | None,
    paths: Potentials | None = None,
) -> Engine:
    """MC dropout as an :class:`~bnn_pyro.infer.contract.Engine`, for the resolved options ``s`` (``rate`` a
    :class:`RateLearning`, no ``None`` left but ``dropout_inputs``): a step minimizes :func:`objective` on a batch,
    ``after`` records the rates and early stopping, ``draws`` goes back to the best held-out state and draws
    ``num_samples`` with fresh masks; a checkpoint adds the rates, the masks' generator, the baseline and early
    stopping to the optimized tensors. ``paths`` builds the potentials (by default with ``s.fast_path``)."""
    kind = s.rate
    paths = Potentials(s.fast_path) if paths is None else paths

    def init_state(fitted, chain) -> DropoutState:
        pot = paths(fitted, data, init=chain_start(fitted, init, chain.seed))
        guide = DropoutGuide(pot, sites, s.p, learn=kind is not RateLearning.FIXED)
        with poutine.trace(param_only=True) as capture:  # a BNN's deterministic parameters are fitted too
            pot(guide.values, data.first())
        points = [site["value"].unconstrained() for site in capture.trace.nodes.values()]
        return DropoutState(
            fitted,
            pot,
            guide,
            guide.parameters() + points,
            list(guide.values.values()) + list(guide.logits.values()) + points,
            torch.Generator().manual_seed(chain.seed),
            [],
            BestOnHoldout(every=max(1, s.num_steps // 50), patience=None),
            {k: torch.empty(s.num_steps) for k in guide.sites},
            chain.seed,
        )

    def step(state: DropoutState, batch, index: int):
        noise = [state.guide.noise((), state.masks) for _ in range(s.num_particles)]
        last = state.baseline[0] if state.baseline else None  # REINFORCE's decaying average of the energy
        surrogate, loss, energy = objective(state.guide, state.pot, batch, noise, kind, s.temperature, last)
        state.baseline[:] = [energy if last is None else s.baseline_beta * last + (1 - s.baseline_beta) * energy]
        return surrogate, LossInfo(float(loss))

    def after(state: DropoutState, index: int, info: LossInfo) -> LossInfo:
        for k, r in state.guide.rates_float().items():
            state.rates[k][index] = r
        if holdout is not None and (state.best.due(index) or index == s.num_steps - 1):
            state.best.record(
                index, _score(state.model, state.guide, state.pot, holdout), [t.detach() for t in state.kept]
            )
        return info

    def draws(state: DropoutState, history: dict[str, torch.Tensor]) -> ChainRun:
        if holdout is not None:  # early stopping: back to the best-scoring state
            with torch.no_grad():
                for t, kept in zip(state.kept, state.best.state):
                    t.copy_(kept)
            history["best_step"] = torch.tensor([state.best.best_step])
        if kind is not RateLearning.FIXED:
            history.update({f"dropout_rate[{k}]": v for k, v in state.rates.items()})
        samples = state.guide.draw(s.num_samples, torch.Generator().manual_seed(state.seed))
        rates = {f"dropout_rate[{n}]": torch.full((s.num_samples,), r) for n, r in state.guide.rates_float().items()}
        return ChainRun(state.model, samples, point_values(state.model, *data.first(), data.size), history, stats=rates)

    def checkpoint(state: DropoutState, ckpt: Checkpoint, records) -> StepCheckpoint:
        extra = ExtraState(masks=state.masks, baseline=state.baseline, best=state.best)
        return StepCheckpoint(ckpt, state.params, state.rates, extra)

    return Engine(init=init_state, step=step, draws=draws, after=after, checkpoint=checkpoint)
