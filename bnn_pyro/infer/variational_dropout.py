r"""Variational dropout and sparse variational dropout: ``method="variational_dropout"`` / ``"sparse_vd"``.

Both fit a factorized Gaussian ``q(w_ij) = N(theta_ij, sigma_ij^2)``, ``alpha_ij = sigma_ij^2 / theta_ij^2``,
to every Bayesian weight of the net's ``nn.Linear`` and ``nn.Conv1d/2d/3d`` layers (the *VD weights*)
under the improper **log-uniform prior** ``p(|w|) ∝ 1 / |w|``. That prior REPLACES the model's own prior
on those weights (it is what makes ``KL(q || p)`` a function of ``alpha`` alone; Kingma et al. 2015,
sec. 3.3): the model's prior on them is not used, and ``post.config["prior"]`` says ``"log-uniform"``.
Every other latent site (biases, hyper and noise sites) gets a mean-field Gaussian in unconstrained
space under the model's own prior (Monte Carlo KL); deterministic parameters are point estimates, as in SVI.

Update rule: one Adam step (learning rate ``lr`` with a cosine decay to 1 %) per minibatch ``B`` of
``N`` on the negative of

.. math::

    \mathcal L = \frac{N}{B}\sum_{i\in B} \log p(y_i \mid x_i, \tilde w_i)
                 - \beta_t \sum_{ij} \mathrm{KL}(\alpha_{ij}) + \log p(\tilde z) - \log q(\tilde z)

(``z``: the other sites, one draw per step; ``beta_t`` rises linearly from 0 to 1 over the first
``kl_warmup`` of the run, then stays 1, so the end point maximizes the ELBO). The likelihood is the model's own, its
``N / B`` scale Pyro's data plate. Its weight noise is drawn by the **local reparameterization trick**
(:class:`~bnn_pyro.infer.reparam.WeightNoise`): a ``Linear`` layer on ``(B, in)`` inputs samples its
pre-activations ``b = x theta + sqrt(x^2 sigma^2) * eps`` with ``eps ~ N(0, 1)`` per example and unit,
the exact marginal of an example-specific weight draw, so the gradient's variance falls as ``1 / B``.
Convolutions share a weight across positions within an example, where independent noise per
position (as Molchanov et al. used) is not the ELBO of ``q``; they get flipout instead (Wen et al. 2018).

- ``"variational_dropout"`` (Kingma, Salimans & Welling 2015, variant B): per-weight ``alpha``,
  learned as ``log alpha`` with ``sigma^2 = alpha theta^2`` and projected onto ``alpha <= 1`` after each
  step (the paper's bound; its KL approximation is fitted there),
  ``-KL ≈ 0.5 log alpha + c1 alpha + c2 alpha^2 + c3 alpha^3 + C``, ``c = (1.16145124, -1.50204118,
  0.58629921)``. Nothing is pruned (``alpha <= 1``): it is Gaussian dropout with learned rates.
- ``"sparse_vd"`` (Molchanov, Ashukha & Vetrov 2017): unbounded ``alpha``, the **additive
  reparameterization** ``w = theta + sigma eps`` learned through ``(theta, log sigma^2)`` (the gradient
  wrt ``theta`` carries no ``alpha``-sized noise), ``log alpha = log sigma^2 - log theta^2``,
  ``-KL ≈ k1 sigmoid(k2 + k3 log alpha) - 0.5 log1p(1 / alpha) - k1``, ``k = (0.63576, 1.87320, 1.48695)``
  (max. error 0.0094 against quadrature on ``log alpha`` in [-8, 8]). A weight with
  ``log alpha > threshold`` (default 3: ``alpha > 20``, its posterior is noise) is pruned: exactly zero
  in every posterior draw. :func:`sparsity_report` counts what is left, per layer.

Off the data (classification). The log-uniform prior has no scale: its KL is a function of ``alpha`` alone, so a
weight the training rows leave free gets no gradient in ``theta`` and keeps its starting value, with sd
``sqrt(alpha) |theta| <= |theta|`` (variational dropout) or is pruned (sparse VD), where the model's posterior keeps its
prior's spread (``docs/ood.md`` derives it and measures it). A classification fit says so
(:func:`~bnn_pyro.infer.health_off_data.check_scale_free_off_data`). Too-narrow sds on a small model are judged on
``q``'s own sd, which needs no allowance for few draws (:func:`~bnn_pyro.infer.health_spread.check_narrow`).

Posterior draws: ``theta + sigma eps`` per VD weight (pruned ones 0 for ``sparse_vd``) and the other
sites from their Gaussians; ``num_chains`` restarts (seeds ``seed + c``) are the chains. A Pyro
function model, or a ``BNN`` without Bayesian Linear/Conv weights, is refused with a pointer to
``method="svi"``.

References: Kingma, D. P., Salimans, T. & Welling, M. (2015). Variational dropout and the local
reparameterization trick. NeurIPS. Molchanov, D., Ashukha, A. & Vetrov, D. (2017). Variational
dropout sparsifies deep neural networks. ICML. Wen, Y., Vicol, P., Ba, J., Tran, D. & Grosse, R.
(2018). Flipout: efficient pseudo-independent weight perturbations on mini-batches. ICLR.

Example
-------
>>> post = bp.fit(model, x, y, method="sparse_vd", seed=0)
>>> sparsity_report(post)          # per layer: total, kept, sparsity, compression = |W| / |W != 0|
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import ClassVar, NamedTuple

import pandas as pd
import torch
import torch.nn.functional as F
from pyro import poutine
from torch import nn

from bnn_pyro.infer._common import Data, call_model, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.checkpoint import open_chains
from bnn_pyro.infer.contract import Engine, Loop, RunOptions, drive, entry
from bnn_pyro.infer.driver import ChainRun
from bnn_pyro.infer.health_off_data import check_scale_free_off_data
from bnn_pyro.infer.health_spread import check_narrow
from bnn_pyro.infer.kl_warmup import kl_weight
from bnn_pyro.infer.optim import DEFAULT_SCHEDULE, Schedule, check_lr
from bnn_pyro.infer.reparam import Estimator, RecordedGaussian, WeightNoise
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, positive, positive_int
from bnn_pyro.utils.user_warnings import warn

__all__ = [
    "fit_variational_dropout",
    "fit_sparse_vd",
    "sparsity_report",
    "kl_log_uniform",
    "vd_weight_names",
    "Variant",
    "VariationalDropoutConfig",
    "SparseVDConfig",
    "VDInfo",
    "SparseVDInfo",
]

KINGMA_C = (1.16145124, -1.50204118, 0.58629921)
MOLCHANOV_K = (0.63576, 1.87320, 1.48695)
_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_EPS = 1e-8


class Variant(str, Enum):
    VARIATIONAL_DROPOUT = "variational_dropout"
    SPARSE_VD = "sparse_vd"


def kl_log_uniform(log_alpha: torch.Tensor, variant: Variant | str = "sparse_vd") -> torch.Tensor:
    """``KL(N(theta, alpha theta^2) || log-uniform)`` per weight by the variant's approximation, up to
    the constant of the improper prior: Molchanov et al.'s ``k1``, which makes the KL vanish as
    ``alpha -> inf``; Kingma et al. give no constant, and their polynomial (fitted for ``alpha <= 1``
    only) takes the same one."""
    if Variant(variant) is Variant.SPARSE_VD:
        k1, k2, k3 = MOLCHANOV_K
        return k1 - k1 * torch.sigmoid(k2 + k3 * log_alpha) + 0.5 * F.softplus(-log_alpha)
    c1, c2, c3 = KINGMA_C
    alpha = log_alpha.exp()
    return MOLCHANOV_K[0] - (0.5 * log_alpha + c1 * alpha + c2 * alpha**2 + c3 * alpha**3)


class _VDWeights(nn.Module):
    """Variational parameters of the VD weights: ``theta`` and ``log sigma^2`` (sparse_vd) or
    ``log alpha`` (variational_dropout), per weight."""

    def __init__(self, init: dict[str, torch.Tensor], variant: Variant, init_log_sigma2: float):
        super().__init__()
        self.names, self.variant = list(init), variant
        self.theta = nn.ParameterList([nn.Parameter(v.detach().clone()) for v in init.values()])
        logs = [torch.full_like(v, init_log_sigma2) for v in init.values()]
        if variant is Variant.VARIATIONAL_DROPOUT:  # one log alpha per tensor: sigma^2 = exp(init) on average
            logs = [(v - (t.detach() ** 2).mean().add(_EPS).log()).clamp(max=0.0) for v, t in zip(logs, init.values())]
        self.log_scale = nn.ParameterList([nn.Parameter(v) for v in logs])

    def scale(self, i: int) -> torch.Tensor:
        """``sigma``: ``exp(log sigma^2 / 2)``, or ``sqrt(alpha) |theta|``."""
        if self.variant is Variant.SPARSE_VD:
            return (0.5 * self.log_scale[i]).exp()
        return (0.5 * self.log_scale[i]).exp() * self.theta[i].abs()

    def draw(self) -> tuple[dict[str, torch.Tensor], SimpleNamespace]:
        """One weight draw ``theta + sigma eps`` per VD weight, and its registry for
        :class:`~bnn_pyro.infer.reparam.WeightNoise` (which samples the layers' pre-activations instead)."""
        values, registry = {}, {}
        for i, name in enumerate(self.names):
            loc, scale = self.theta[i], self.scale(i)
            values[name] = loc + scale * torch.randn_like(loc)
            registry[id(values[name])] = RecordedGaussian(name, values[name], loc, scale)
        return values, SimpleNamespace(registry=registry)

    def log_alpha(self, i: int) -> torch.Tensor:
        if self.variant is Variant.SPARSE_VD:
            return self.log_scale[i] - (self.theta[i] ** 2 + _EPS).log()
        return self.log_scale[i]

    def kl(self) -> torch.Tensor:
        return sum(kl_log_uniform(self.log_alpha(i), self.variant).sum() for i in range(len(self.names)))

    @torch.no_grad()
    def project(self) -> None:
        if self.variant is Variant.VARIATIONAL_DROPOUT:
            for p in self.log_scale:
                p.clamp_(max=0.0)


def vd_weight_names(model, variant: Variant | str = Variant.SPARSE_VD) -> list[str]:
    """The VD weights of ``model``: the Bayesian ``weight`` of each ``nn.Linear``/``nn.Conv1d/2d/3d``
    layer of a :class:`~bnn_pyro.BNN`; a clear error for any other model."""
    if not isinstance(model, BNN):
        raise TypeError(
            f"model: {Variant(variant).value} works on the nn.Linear/nn.Conv layers of a bp.BNN; got a "
            f"{type(model).__name__} (a Pyro function model has no layers to act on). Wrap the net in "
            "bp.BNN(net, prior=..., likelihood=...), or use method='svi' (on a small Pyro function its default guide "
            "is full-rank, started at the Laplace approximation) or method='nuts' for a Pyro function."
        )
    names = [
        n
        for n in model.sample_names
        if n.rpartition(".")[2] == "weight" and isinstance(model.net.get_submodule(n.rpartition(".")[0]), _LAYER_TYPES)
    ]
    if not names:
        raise ValueError(
            f"model: {Variant(variant).value} needs Bayesian weights of nn.Linear or nn.Conv1d/2d/3d layers; this "
            f"BNN's Bayesian parameters are {model.sample_names}. Use method='svi' (guide='mean_field') for "
            "these parameters, or make the layers' weights Bayesian (BNN(..., bayesian='all'))."
        )
    return names


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class VariationalDropoutConfig(RunOptions):
    """The options of ``method="variational_dropout"`` and their defaults (see :func:`fit_variational_dropout`)."""

    REFUSED: ClassVar[dict[str, str]] = {
        "fast_path": "does not apply: variational dropout always evaluates its ELBO by its own local "
        "reparameterization of each layer's pre-activations (Kingma et al. 2015), with no Pyro trace "
        "to fall back to."
    }

    num_steps: int | None = None
    epochs: int | None = None
    lr: float = 1e-2
    optimizer: object = "adam"
    lr_schedule: object = DEFAULT_SCHEDULE
    init_log_sigma2: float = -10.0
    kl_warmup: float = 0.0
    num_chains: int = 1
    num_samples: int = 200
    init_scale: float = 0.01
    init: object = None


@dataclass(frozen=True)
class SparseVDConfig(VariationalDropoutConfig):
    """The options of ``method="sparse_vd"``: those of variational dropout with a KL warm-up by default, and the
    pruning ``threshold`` (see :func:`fit_sparse_vd`)."""

    kl_warmup: float = 0.3
    threshold: float = 3.0


class VDInfo(NamedTuple):
    """What a variational-dropout step records: the negative ELBO and the KL term of the VD weights."""

    loss: float
    kl: float


class SparseVDInfo(NamedTuple):
    """What a sparse-VD step records: the negative ELBO, the KL term and the pruned fraction after the update."""

    loss: float
    kl: float
    sparsity: float


@entry(VariationalDropoutConfig)
def fit_variational_dropout(model, data: Data, cfg: VariationalDropoutConfig) -> Posterior:
    """Variational dropout, per-weight ``alpha <= 1`` (Kingma et al. 2015, variant B); see the module docstring.

    Parameters
    ----------
    num_steps, epochs:
        Length of the run in Adam steps, or passes over the data (one of the two; default 2,000 steps).
    lr, optimizer, lr_schedule:
        The learning rate (what ``lr`` means: :mod:`bnn_pyro.infer.optim`), the optimizer (``"adam"``, the
        default, ``"adamw"``, ``"sgd"`` or a callable ``params -> Optimizer``, as in SVI) and its schedule:
        ``"cosine"`` (default, as every optimizing engine's: to 1% of ``lr``, so that Adam's own jitter, about
        ``lr`` per step, ends well below the posterior's spread), ``"constant"``, ``"exponential"`` or a callable
        ``optimizer -> LRScheduler`` (as in SVI). No ``fast_path``: the local reparameterization is the only path.
    kl_warmup:
        Fraction of the run over which the KL term's weight rises linearly from 0 to 1 (annealing;
        0 = the ELBO throughout). ``history["loss"]`` is always the full negative ELBO.
    init_log_sigma2:
        Initial ``log sigma^2`` of every VD weight (Molchanov et al.'s -10: start nearly deterministic;
        ``variational_dropout`` starts each tensor at the one ``log alpha`` that gives this ``sigma^2``
        on average over its weights, capped at 0).
    num_chains, num_samples:
        Independent restarts (the chains), and draws from each fitted ``q``.
    init_scale:
        Initial standard deviation of the Gaussians of the other latent sites (biases, noise, hypers).
    init:
        Where the means ``theta`` (and the other sites' Gaussians) start: ``"reset"`` (default: the
        layers' ``reset_parameters()`` under chain ``c``'s seed ``seed + c``), ``"net"`` (the net's
        current weights: pass a pretrained net to start from it), ``"prior"``, ``"median"``, a dict of
        site values or a :class:`~bnn_pyro.Posterior` (see :mod:`bnn_pyro.infer._init`).
    seed, progress:
        Random seed (chain ``c`` uses ``seed + c``); ``progress=False`` hides the progress bar.
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps and after the
        last; ``resume=True`` continues each chain from its file, bit-identically (see
        :mod:`bnn_pyro.infer.checkpoint`).
    """
    post, sd = _fit(model, data, Variant.VARIATIONAL_DROPOUT, cfg, threshold=None)
    return check_scale_free_off_data(check_narrow(post, cause=NARROW, sd=sd), OFF_DATA[Variant.VARIATIONAL_DROPOUT])


@entry(SparseVDConfig)
def fit_sparse_vd(model, data: Data, cfg: SparseVDConfig) -> Posterior:
    """Sparse variational dropout (Molchanov et al. 2017); see the module docstring.

    Parameters are those of :func:`fit_variational_dropout`, plus ``threshold``: weights with
    ``log alpha > threshold`` are pruned (zero in every draw); ``post.history["sparsity"]`` is the
    pruned fraction of the VD weights per step. ``kl_warmup`` defaults to 0.3 here: from a random
    start the KL of thousands of weights outweighs a small data set's likelihood, and without the
    ramp the net prunes itself into a worse optimum (digits, 64-100-10 MLP: test accuracy 0.936 and
    -ELBO 768 without it, 0.981 and 745 with it).
    """
    threshold = cfg.threshold
    if not _is_number(threshold) or not math.isfinite(threshold):
        raise ValueError(
            f"threshold must be a finite number, the log alpha above which a weight is pruned "
            f"(default 3.0), got {threshold!r}."
        )
    post, sd = _fit(model, data, Variant.SPARSE_VD, cfg, threshold=float(threshold))
    return check_scale_free_off_data(check_narrow(post, cause=NARROW, sd=sd), OFF_DATA[Variant.SPARSE_VD])


def _fit(
    model, data: Data, variant: Variant, cfg: VariationalDropoutConfig, threshold: float | None
) -> tuple[Posterior, dict[str, torch.Tensor]]:
    """The posterior, and the sd per latent site (unconstrained) of the fitted ``q``: of the chains' mixture, whose
    variance is the chains' mean variance plus the variance of their means (pruned weights: 0)."""
    vd_names = vd_weight_names(model, variant)
    num_steps, epochs, lr_schedule = cfg.num_steps, cfg.epochs, cfg.lr_schedule
    if num_steps is not None and epochs is not None:
        raise ValueError(f"{variant.value}: give num_steps= or epochs=, not both.")
    if epochs is not None:
        batch = data.batch_size or data.size
        per_epoch = len(data.loader) if data.loader is not None else math.ceil(data.size / batch)
        num_steps = positive_int("epochs", epochs) * per_epoch
    if not _is_number(cfg.init_log_sigma2) or not math.isfinite(cfg.init_log_sigma2):
        raise ValueError(f"init_log_sigma2 must be a finite number (e.g. -10.0), got {cfg.init_log_sigma2!r}.")
    if not _is_number(cfg.kl_warmup) or not 0 <= cfg.kl_warmup <= 1:
        raise ValueError(f"kl_warmup must be a fraction of the run in [0, 1] (e.g. 0.3), got {cfg.kl_warmup!r}.")
    if isinstance(lr_schedule, str):
        choice("lr_schedule", lr_schedule, Schedule)
    num_steps = positive_int("num_steps", 2000 if num_steps is None else num_steps)
    lr, num_samples = check_lr(cfg.lr, method=variant.value), positive_int("num_samples", cfg.num_samples)
    init_scale, init_log_sigma2, kl_warmup = (
        positive("init_scale", cfg.init_scale),
        float(cfg.init_log_sigma2),
        float(cfg.kl_warmup),
    )
    num_chains = positive_int("num_chains", cfg.num_chains)
    init = resolve_init(model, cfg.init, data)
    hypers = [h for h in model.hyper_names if any(h.startswith(n + "_") for n in vd_names)]
    if hypers:
        warn(
            f"{variant.value}: the log-uniform prior replaces the model's prior on {vd_names}, so the "
            f"hyper sites {hypers} no longer touch the data; their posterior is their prior.",
            UserWarning,
        )
    pot = Potential(model, data, init="net")  # the latent sites and their transforms
    missing = [n for n in vd_names if n not in pot.init]
    if missing:  # e.g. a module used twice in the net: its sites are named after another path
        raise ValueError(
            f"model: the Bayesian weights {missing} are not sample sites of the traced model (latent "
            f"sites: {list(pot.init)}); is a layer shared? {variant.value} needs each Linear/Conv "
            "weight once per forward pass; use method='svi' (guide='mean_field') for this net."
        )
    config = clean_config(
        dict(
            num_steps=num_steps,
            lr=lr,
            optimizer=getattr(cfg.optimizer, "value", cfg.optimizer),
            lr_schedule=getattr(lr_schedule, "value", lr_schedule),
            init_log_sigma2=init_log_sigma2,
            kl_warmup=kl_warmup,
            threshold=threshold,
            num_chains=num_chains,
            num_samples=num_samples,
            init_scale=init_scale,
            init=init if isinstance(init, str) else type(init).__name__,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=cfg.seed,
            prior="log-uniform",
            local_reparameterization=True,
            vd_weights=",".join(vd_names),
        )
    )
    ckpts = open_chains(
        cfg.checkpoint,
        every=cfg.checkpoint_every,
        resume=cfg.resume,
        num_chains=num_chains,
        run=dict(method=variant.value, **config),
    )
    others = [n for n in pot.init if n not in vd_names]
    warmup_steps = round(kl_warmup * num_steps)
    x0, y0 = data.first()

    def init_state(fitted, chain) -> _State:
        start = Potential(fitted, data, init=chain_start(fitted, init, chain.seed)).init  # unconstrained
        weights = _VDWeights({n: start[n] for n in vd_names}, variant, init_log_sigma2)
        loc = {n: start[n].clone().requires_grad_() for n in others}
        log_sd = {n: torch.full_like(start[n], math.log(init_scale)).requires_grad_() for n in others}
        state = _State(fitted, pot, data, weights, loc, log_sd, vd_names, others, [])
        try:
            with poutine.trace(param_only=True) as capture:
                state.neg_elbo(x0, y0)
        except ValueError as err:  # a layer the local reparameterization cannot serve (e.g. a tied weight)
            raise ValueError(
                f"model: {variant.value} cannot fit this net ({err}). Variational dropout needs each "
                "Linear/Conv weight used once per forward pass by its own layer; use method='svi' "
                "(guide='mean_field') for this net."
            ) from err
        point_params = [s["value"].unconstrained() for s in capture.trace.nodes.values()]
        state.params = list(weights.parameters()) + list(loc.values()) + list(log_sd.values()) + point_params
        return state

    def step(state: _State, batch, index: int):
        rest, kl = state.neg_elbo(*batch)
        loss = rest + kl
        info = VDInfo(loss.item(), kl.item()) if threshold is None else SparseVDInfo(loss.item(), kl.item(), math.nan)
        return (rest + kl_weight(index, warmup_steps) * kl if warmup_steps else loss), info

    def after(state: _State, index: int, info):
        state.weights.project()
        return info if threshold is None else info._replace(sparsity=_pruned_fraction(state.weights, threshold))

    fitted = []  # each chain's q: (means, sds) per latent site, unconstrained (the chains run in this process)

    def draws(state: _State, history) -> ChainRun:
        fitted.append(_moments(state, threshold))
        samples = _draw(state.weights, threshold, num_samples)
        with torch.no_grad():
            z = {
                n: state.loc[n]
                + state.log_sd[n].exp() * state.loc[n].new_empty((num_samples,) + state.loc[n].shape).normal_()
                for n in others
            }
            samples.update({n: v.detach() for n, v in pot.constrain(z).items()})
        return ChainRun(state.model, samples, point_values(state.model, x0, y0, data.size), history)

    engine = Engine(
        init=init_state, step=step, draws=draws, info=VDInfo if threshold is None else SparseVDInfo, after=after
    )
    loop = Loop(
        num_steps=num_steps,
        lr=lr,
        method=variant.value,
        desc=variant.value + " chain {index}",
        optimizer=cfg.optimizer,
        lr_schedule=lr_schedule,
        quantity="ELBO",
        progress=cfg.progress,
    )
    post = drive(model, data, engine, loop, num_chains=num_chains, seed=cfg.seed, config=config, checkpoints=ckpts)
    means = {k: torch.stack([m[k] for m, _ in fitted]) for k in fitted[0][0]}
    variances = {k: torch.stack([v[k] for _, v in fitted]).pow(2).mean(0) for k in fitted[0][1]}
    return post, {k: (variances[k] + means[k].var(0, unbiased=False)).sqrt() for k in means}


@dataclass
class _State:
    """One restart: its model copy, ``q`` of the VD weights and the Gaussians ``loc``/``log_sd`` of the other
    latent sites (unconstrained), and the optimized tensors."""

    model: object
    pot: Potential
    data: Data
    weights: _VDWeights
    loc: dict
    log_sd: dict
    vd_names: list
    others: list
    params: list

    def neg_elbo(self, x, y):
        """The negative ELBO on a batch less the VD weights' KL term, and that term."""
        others = self.others
        z = {n: self.loc[n] + self.log_sd[n].exp() * torch.randn_like(self.loc[n]) for n in others}
        draws, sites = self.weights.draw()
        values = {**self.pot.constrain(z), **draws}
        run = WeightNoise(Estimator.LOCAL_REPARAM, sites).wrap(
            lambda x, y: call_model(self.model, x, y, self.data.size)
        )
        with poutine.trace() as tr, poutine.condition(data=values):
            run(x, y)
        log_joint = tr.trace.log_prob_sum(lambda name, site: name not in self.vd_names)  # likelihood scaled N / B
        log_jac = sum(
            (-self.pot.transforms[n].log_abs_det_jacobian(values[n], z[n])).sum()
            for n in others
            if n in self.pot.transforms
        )
        entropy = sum(s.sum() for s in self.log_sd.values())  # of q(other), up to a constant
        return -(log_joint + log_jac + entropy), self.weights.kl()


@torch.no_grad()
def _pruned_fraction(weights: _VDWeights, threshold: float | None) -> float:
    if threshold is None:
        return 0.0
    pruned = sum(int((weights.log_alpha(i) > threshold).sum()) for i in range(len(weights.names)))
    return pruned / sum(t.numel() for t in weights.theta)


@torch.no_grad()
def _moments(state: _State, threshold: float | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The fitted ``q``'s mean and sd per latent site, in unconstrained space (a pruned weight's are 0)."""
    weights, means, sds = state.weights, {}, {}
    for i, name in enumerate(weights.names):
        keep = 1.0 if threshold is None else (weights.log_alpha(i) <= threshold).to(weights.theta[i].dtype)
        means[name], sds[name] = weights.theta[i] * keep, weights.scale(i) * keep
    for name in state.others:
        means[name], sds[name] = state.loc[name].detach().clone(), state.log_sd[name].exp().detach()
    return means, sds


@torch.no_grad()
def _draw(weights: _VDWeights, threshold: float | None, num_samples: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(weights.names):
        theta, sd = weights.theta[i], weights.scale(i)
        w = theta + sd * theta.new_empty((num_samples,) + theta.shape).normal_()
        if threshold is not None:
            w = w.masked_fill(weights.log_alpha(i) > threshold, 0.0)
        out[name] = w
    return out


def sparsity_report(posterior: Posterior) -> pd.DataFrame:
    """Per VD layer weight: ``total`` weights, ``kept`` (non-zero in some draw; mean over chains, which
    prune independently), ``sparsity = 1 - kept / total`` and ``compression = total / kept``
    (``|W| / |W != 0|``), plus an ``"all"`` row for the whole set of VD weights.

    Example
    -------
    >>> sparsity_report(bp.fit(model, x, y, method="sparse_vd"))["compression"]["all"]
    """
    names = str(posterior.config.get("vd_weights", "")).split(",")
    if posterior.method not in {v.value for v in Variant} or not all(n in posterior.samples for n in names):
        raise ValueError(
            f"posterior: sparsity_report needs a posterior fitted with method='sparse_vd' or "
            f"'variational_dropout', got method={posterior.method!r}."
        )
    rows = {}
    for n in names:
        w = posterior.samples[n]
        kept = (w != 0).reshape(w.shape[0], w.shape[1], -1).any(1).sum(-1).double().mean().item()
        rows[n] = {"total": w[0, 0].numel(), "kept": kept}
    rows["all"] = {"total": sum(r["total"] for r in rows.values()), "kept": sum(r["kept"] for r in rows.values())}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table["sparsity"] = 1.0 - table["kept"] / table["total"]
    table["compression"] = table["total"] / table["kept"]  # inf for a layer pruned away entirely
    return table


NARROW = (
    "Its posterior is factorized (one Gaussian per weight), which cannot hold correlated weights (its sds are "
    "1/sqrt(H_ii), not the posterior's). "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for variational and sparse VD."""

OFF_DATA = {
    Variant.VARIATIONAL_DROPOUT: "each weight's Gaussian has sd sqrt(alpha) |theta| <= |theta| (alpha <= 1), and the "
    "KL to its log-uniform prior is a function of alpha alone, so in weight directions the training rows leave free "
    "nothing moves theta from where it started and the spread stays at most that initial |theta| (the layers' "
    "reset: about 1 / sqrt(3 fan_in)), not the model's prior's.",
    Variant.SPARSE_VD: "the KL to its log-uniform prior falls as alpha grows, so a weight the training rows leave free "
    "is driven to a large alpha and pruned: exactly 0 in every draw, where the posterior keeps the prior's spread.",
}
"""The structural limit :func:`~bnn_pyro.infer.health_off_data.check_scale_free_off_data` states for a classification
fit, per variant (derived in ``docs/ood.md``)."""
