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

and appends the deviation ``z_i - mean_i`` to ``D``, which keeps the last ``rank`` (``K``) of them.

- ``"swa"`` (Izmailov et al. 2018): the answer is the point ``z_SWA = mean_m``, one draw per chain.
  SWA is an estimate of a (wide) mode, not a distribution: ``predict`` gives the plug-in prediction
  (no epistemic spread within a chain), ``summary`` shows the spread between independent chains.
- ``"swag"`` (Maddox et al. 2019): a Gaussian with mean ``z_SWA`` and covariance
  ``scale * (Sigma_diag + D^T D / (K - 1)) / 2``, ``Sigma_diag = diag(sq_m - mean_m^2)``. Draws are

    ``z = z_SWA + sqrt(scale) * (Sigma_diag^(1/2) e1 / sqrt(2) + D^T e2 / sqrt(2 (K - 1)))``,
    ``e1 ~ N(0, I_d)``, ``e2 ~ N(0, I_K)``,

  then mapped to each site's support (e.g. a positive noise scale).

Minibatches are drawn independently (with replacement, ``B`` points each; ``B`` is ``batch_size``
of ``bp.fit``, by default ``min(N, 128)``), the assumption under which constant-rate SGD has a
stationary law whose covariance ``Sigma`` solves ``A Sigma + Sigma A = (lr / B) C`` (Mandt, Hoffman
& Blei 2017; ``A`` the Hessian of ``L``, ``C`` the covariance of one datum's gradient). Random
reshuffling would make the gradient noise of an epoch sum to zero and shrink ``Sigma`` most in the
flat directions SWAG is meant to find. A ``DataLoader`` is used in its own order.

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

Deterministic (non-Bayesian) parameters of a ``BNN`` and ``pyro.param`` sites of a Pyro function are
trained and averaged with the latent sites, and fixed at their average in every draw (``post.point``).
``num_chains`` independent runs (seeds ``seed``, ``seed + 1``, ...) become chains, so R-hat applies;
SWAG's predictive mixes them (MultiSWAG; three by default, see :func:`fit_swag`), SWA's gives the spread
between the chains' points (one by default).

Held-out rows (``validation=``, default 10% of tensor data of at least 200 rows;
:mod:`bnn_pyro.infer.holdout`): pre-training is early-stopped on them and a learned Gaussian noise is
chosen on them at the end, for the engine's own predictive. On scikit-learn's diabetes (random 90/10
splits 0-2, standardized, 10-50-1 ReLU net, ``Normal(0, 1)`` prior, ``Gaussian(scale=HalfNormal(1))``)
the mean test log-likelihood per point went from -11.8 (SWA) and about -11.5 (SWAG, one chain) without
them to -5.54 (SWA) and -5.53 (SWAG, three chains) with them: the SWA-phase noise estimate of an
overfitted net (sd ~0.5 in standardized units) is replaced by the held-out one (~0.75-0.9).

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
from enum import Enum

import torch
from pyro import poutine

from bnn_pyro._checks import choice, positive, positive_int
from bnn_pyro.infer import _density
from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.checkpoint import ExtraState, StepCheckpoint, open_chains
from bnn_pyro.infer.driver import ChainInfo, ChainRun, assemble, descend, run_chains
from bnn_pyro.infer.holdout import DEFAULT, BestOnHoldout, Holdout, describe, heldout_score, select_noise, split
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__all__ = ["fit_swa", "fit_swag", "fit_moments", "SWAGMoments", "PretrainOptimizer"]

_CURVATURE_POINTS, _POWER_ITERATIONS = 2048, 30


class PretrainOptimizer(str, Enum):
    ADAM = "adam"
    SGD = "sgd"


@dataclass
class SWAGMoments:
    """Running moments of the collected iterates (flat unconstrained vectors) of one run."""

    mean: torch.Tensor
    sq_mean: torch.Tensor
    deviations: torch.Tensor  # (k, dim): the last ``rank`` deviations z_i - mean_i, oldest first
    count: int = 0
    rank: int = 0

    @classmethod
    def empty(cls, like: torch.Tensor, rank: int) -> SWAGMoments:
        """No snapshot yet, for flat vectors like ``like``. Moments are kept in float64:
        ``sq_mean - mean^2`` cancels digits."""
        zeros = torch.zeros(like.numel(), dtype=torch.float64, device=like.device)
        return cls(zeros, zeros.clone(), zeros.new_zeros((0, like.numel())), 0, rank)

    def collect(self, z: torch.Tensor) -> None:
        z, n = z.detach().to(torch.float64), self.count
        self.mean = (n * self.mean + z) / (n + 1)
        self.sq_mean = (n * self.sq_mean + z * z) / (n + 1)
        self.count = n + 1
        if self.rank:
            self.deviations = torch.cat([self.deviations, (z - self.mean)[None]])[-self.rank :]

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """For a checkpoint (:class:`~bnn_pyro.infer.checkpoint.ExtraState`): the moments and deviations."""
        return {"mean": self.mean, "sq_mean": self.sq_mean, "deviations": self.deviations}, {"count": self.count}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        device = self.mean.device
        self.mean, self.sq_mean = tensors["mean"].to(device), tensors["sq_mean"].to(device)
        self.deviations, self.count = tensors["deviations"].to(device), meta["count"]

    @property
    def variance(self) -> torch.Tensor:
        return (self.sq_mean - self.mean**2).clamp_min(0.0)

    def sample(self, num_samples: int, scale: float, generator: torch.Generator) -> torch.Tensor:
        """``(num_samples, dim)`` SWAG draws (see the module docstring)."""
        k = self.deviations.shape[0]
        e1 = torch.randn((num_samples, self.mean.numel()), generator=generator, dtype=self.mean.dtype)
        e2 = torch.randn((num_samples, k), generator=generator, dtype=self.mean.dtype)
        e1, e2 = e1.to(self.mean.device), e2.to(self.mean.device)  # the generator lives on the CPU
        noise = self.variance.sqrt() * e1 / math.sqrt(2.0) + e2 @ self.deviations / math.sqrt(2.0 * (k - 1))
        return self.mean + math.sqrt(scale) * noise


@dataclass(frozen=True)
class _Settings:
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


def fit_swa(model, data: Data, **config) -> Posterior:
    """``bp.fit(..., method="swa")``: the SWA point, one draw per chain. Options as :func:`fit_swag`
    except ``rank``, ``num_samples`` and ``scale``; ``num_chains`` defaults to 1."""
    for name in ("rank", "num_samples", "scale"):
        if name in config:
            raise ValueError(f"{name}= applies to method='swag' only: SWA keeps the averaged point, not a "
                             "distribution. Drop it, or use method='swag'.")
    return _fit(model, data, swag=False, **config)[0]


def fit_swag(model, data: Data, *, rank: int = 20, num_samples: int = 1000, scale: float = 1.0, num_chains: int = 3,
             **config) -> Posterior:
    """Fit ``model`` by SWAG and return ``num_samples`` draws per chain (see the module docstring).

    Parameters
    ----------
    rank, num_samples, scale:
        ``K``, the number of deviations kept (at least 2); draws per chain (each costs one pass over
        the data when the net has BatchNorm); the factor on the covariance. ``scale=1`` here is Maddox
        et al.'s recommended ``scale=0.5``: their code draws ``mean + sqrt(scale) (diag part + low-rank
        part)``, whose covariance is ``scale (Sigma_diag + D^T D / (K - 1))``; ours already halves the sum.
    pretrain_steps, pretrain_optimizer, pretrain_lr:
        Pre-training (default 2,000 steps of ``"adam"``, learning rate ``3e-2`` decaying to 1% of
        it; 0 skips it, e.g. with a pretrained net and ``init="net"``, or ``init=`` a MAP posterior).
    num_steps, burn_in, collect_every:
        SWA phase: SGD steps (default 200 epochs of ``ceil(N / B)`` steps), steps before the first
        snapshot (default ``num_steps // 10``), steps between snapshots (default one epoch).
    lr, momentum:
        The constant SWA learning rate (``"auto"`` or a positive float) and SGD momentum (0.9).
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain, written every ``checkpoint_every`` steps (counted over both
        phases) and after the last; ``resume=True`` continues each chain from its file, bit-identically (phase and
        optimizer, moments, early stopping, the chain's generator; see :mod:`bnn_pyro.infer.checkpoint`).
    num_chains, init, seed, progress:
        Independent runs (seeds ``seed + c``; default 3 for SWAG: MultiSWAG, see below; 1 for SWA);
        initial values (``"reset"``: the default for a BNN,
        its layers' ``reset_parameters()`` under the run's seed; ``"net"``: a BNN's weights; ``"prior"``,
        ``"median"``, a dict or a :class:`Posterior`; see :mod:`bnn_pyro.infer._init`); a progress bar
        (``False``: off).
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`; default 10% of the rows when that is at least 20 rows
        and the data are tensors, the same rows for every chain): pre-training keeps its state with the best
        held-out likelihood (scored every ``pretrain_steps // 50`` steps: early stopping) and the SWA phase
        starts from it; at the end a learned Gaussian noise is set to the value that maximizes the held-out log
        predictive density of the SWAG predictive (every chain's draws). A fraction, an ``(x_val, y_val)``
        pair, or ``None`` (every row trained on, the noise at its SWA value: overconfident on small data).
        Costs 10% of the rows and a forward pass over the held-out rows per score.

    Why three chains by default (MultiSWAG; Wilson & Izmailov 2020, "Bayesian Deep Learning and a
    Probabilistic Perspective of Generalization"): one SWAG run describes one basin, and its spread is
    the SGD noise around it, which does not grow away from the data. On ``bp.datasets.toy_gap`` (1-50-1
    tanh net, ``sigma = 0.1``, seed 0) one chain's epistemic sd in the gap (|x| < 0.3) was 1.06x that on the
    clusters (|x| >= 0.5), and raising the collection learning rate made it worse (3x, 10x, 19x the
    ``"auto"`` rate: 0.83x, 0.60x, 0.50x); three chains gave 3.95x (NUTS: 6.6x), because restarts land in
    different basins that agree on the data and part ways in the gap. Cost: three times one run;
    ``num_chains=1`` is the single-basin SWAG of Maddox et al.
    """
    return _fit(model, data, swag=True, rank=rank, num_samples=num_samples, scale=scale, num_chains=num_chains,
                **config)[0]


def fit_moments(model, data: Data, **config) -> tuple[Posterior, list[SWAGMoments]]:
    """The SWA/SWAG posterior (``swag=True|False`` and the options of :func:`fit_swag`) and each chain's
    :class:`SWAGMoments`: the iterates' mean and deviations that subspace inference builds on."""
    return _fit(model, data, **config)


def _fit(model, data: Data, *, swag: bool, rank: int = 0, num_samples: int = 1, scale: float = 1.0,
         pretrain_steps: int = 2000, pretrain_optimizer="adam", pretrain_lr: float = 3e-2, num_steps: int | None = None,
         burn_in: int | None = None, collect_every: int | None = None, lr: float | str = "auto",
         momentum: float = 0.9, num_chains: int = 1, init=None, validation="default", seed: int = 0,
         progress: bool = True, checkpoint: str | None = None, checkpoint_every: int | None = None,
         resume: bool = False) -> tuple[Posterior, list[SWAGMoments]]:
    """The posterior and each chain's :class:`SWAGMoments` (what the tests check against theory)."""
    method = "swag" if swag else "swa"
    full = data
    data, holdout, why = split(full, validation, seed=seed, method=method, convert=full.convert)
    if data.loader is not None:
        batch = data.batch_size
        epoch = len(data.loader) if hasattr(data.loader, "__len__") else math.ceil(data.size / batch)
    else:
        batch = data.batch_size or min(data.size, 128)
        epoch = math.ceil(data.size / batch)
    collect_every = positive_int("collect_every", epoch if collect_every is None else collect_every)
    num_steps = positive_int("num_steps", 200 * epoch if num_steps is None else num_steps)
    burn_in = positive_int("burn_in", num_steps // 10 if burn_in is None else burn_in, allow_zero=True)
    snapshots = (num_steps - burn_in) // collect_every if burn_in < num_steps else 0
    if swag:
        rank = positive_int("rank", rank)
        if rank < 2:
            raise ValueError(f"rank must be at least 2 (the low-rank part divides by rank - 1), got {rank}; the "
                             "default is 20. For the averaged point alone use method='swa'.")
    needed = max(rank, 1)
    if snapshots < needed:
        raise ValueError(
            f"collect schedule: num_steps={num_steps}, burn_in={burn_in}, collect_every={collect_every} collect "
            f"{snapshots} snapshot(s), but {method} needs at least {needed}" + (f" (rank={rank})" if swag else "")
            + ". Lengthen num_steps, shorten burn_in or collect_every" + (", or lower rank." if swag else "."))
    if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}; the default is 0.9.")
    if not (isinstance(lr, str) and lr == "auto"):
        if isinstance(lr, str):
            raise ValueError(f"lr: expected 'auto' or a positive number, got {lr!r}.")
        lr = positive("lr", lr)
    settings = _Settings(
        batch_size=batch, pretrain_steps=positive_int("pretrain_steps", pretrain_steps, allow_zero=True),
        pretrain_optimizer=choice("pretrain_optimizer", pretrain_optimizer, PretrainOptimizer),
        pretrain_lr=positive("pretrain_lr", pretrain_lr), num_steps=num_steps, burn_in=burn_in,
        collect_every=collect_every, lr=lr, momentum=float(momentum), rank=rank,
        num_samples=positive_int("num_samples", num_samples), scale=positive("scale", scale),
        init=resolve_init(model, init, data))
    num_chains = positive_int("num_chains", num_chains)
    config = clean_config(dict(
        pretrain_steps=settings.pretrain_steps, pretrain_optimizer=settings.pretrain_optimizer.value,
        pretrain_lr=settings.pretrain_lr, num_steps=num_steps, burn_in=burn_in, collect_every=collect_every,
        snapshots=snapshots, lr=lr, momentum=settings.momentum, num_chains=num_chains,
        init=settings.init if isinstance(settings.init, str) else type(settings.init).__name__, batch_size=batch, sampling=(
            "loader order" if data.loader is not None else "independent minibatches (with replacement)"),
        dataset_size=data.size, seed=seed,
        validation=describe(holdout, validation if validation != "default" else DEFAULT, why),
        **(dict(rank=rank, num_samples=settings.num_samples, scale=settings.scale) if swag else {})))
    ckpts = open_chains(checkpoint, every=checkpoint_every, resume=resume, num_chains=num_chains,
                        run=dict(method=method, **config))
    moments, buffers = {}, {}  # per chain, beside its ChainRun (the chains run one after another, in this process)

    def one_chain(fitted, info):
        run, moments[info.index], buffers[info.index] = _chain(fitted, data, settings, info, progress, method, holdout,
                                                               ckpts[info.index])
        return run

    runs = run_chains(model, num_chains, seed, one_chain)
    draw_buffers = {k: torch.stack([buffers[c][k] for c in range(num_chains)]) for k in buffers[0]}
    post = assemble(runs, method=method, config=config, data=full, draw_buffers=draw_buffers)
    return select_noise(post, holdout), [moments[c] for c in range(num_chains)]


def _chain(fitted, data: Data, s: _Settings, info: ChainInfo, progress: bool, method: str,
           holdout: Holdout | None, ckpt) -> tuple[ChainRun, SWAGMoments, dict[str, torch.Tensor]]:
    """One chain: pre-training and the SWA phase in one :func:`descend` loop (:class:`_PhasedOptimizer`), the
    snapshots collected after its steps. One generator draws the pre-training minibatches, ``lr="auto"``'s
    probe, the SWA-phase minibatches and the SWAG draws, in that order; a checkpoint keeps its state."""
    desc = f"{method} chain {info.index}"
    generator = torch.Generator().manual_seed(info.seed)
    start = chain_start(fitted, s.init, info.seed)
    if isinstance(fitted, BNN):
        fitted.train()  # BatchNorm and dropout behave as in training
    pot = Potential(fitted, data, init=start)
    z = pot.flatten(pot.init).clone().requires_grad_()
    with poutine.trace(param_only=True) as capture:
        pot(pot.unflatten(z), data.first())
    point_params = [site["value"].unconstrained() for site in capture.trace.nodes.values()]
    params = [z] + point_params
    n, pretrain = data.size, s.pretrain_steps

    def loss(batch):
        return pot(pot.unflatten(z), batch) / n

    opt = _PhasedOptimizer(params, s)
    lrs = torch.empty(pretrain + s.num_steps)
    moments = SWAGMoments.empty(z, s.rank)
    point_sum = [torch.zeros_like(p) for p in point_params]
    best = BestOnHoldout(every=max(1, pretrain // 50), patience=None)

    def start_swa():
        if holdout is not None and best.state is not None:  # early stopping: the best pre-trained state
            with torch.no_grad():
                for p, kept in zip(params, best.state):
                    p.copy_(kept)
        opt.start_swa(_auto_lr(loss, params, data, s, generator) if s.lr == "auto" else s.lr)

    def objective(batch, step):
        lrs[step] = opt.param_groups[0]["lr"]
        value = loss(batch)
        return value, value.item()

    def on_step(step, value):
        if step < pretrain:
            if holdout is not None and (best.due(step) or step == pretrain - 1):
                with torch.no_grad():
                    score = heldout_score(fitted, pot.constrain(pot.unflatten(z.detach())), holdout)
                best.record(step, score, [p.detach() for p in params])
            if step == pretrain - 1:
                start_swa()
            return
        swa_step = step + 1 - pretrain
        if swa_step > s.burn_in and (swa_step - s.burn_in) % s.collect_every == 0:
            moments.collect(z)
            for acc, p in zip(point_sum, point_params):
                acc += p.detach()

    def where(step):
        phase = "pre-training" if step < pretrain else "the SWA phase"
        return f"step {step} ({phase}, lr {opt.param_groups[0]['lr']:.3g}) of {desc}"

    if pretrain == 0:
        start_swa()
    extra = ExtraState(generator=generator, moments=moments, point_sum=point_sum, best=best)
    losses = descend(objective, params, data, num_steps=pretrain + s.num_steps, lr=s.pretrain_lr, seed=info.seed,
                     method=method, desc=desc, progress=progress, quantity="loss U/N",
                     hint=": a smaller pretrain_lr or lr", on_step=on_step, opt=opt, where=where,
                     batches=lambda first: _minibatches(data, s.batch_size, generator, first),
                     resumable=None if ckpt is None else StepCheckpoint(ckpt, params, {"lr": lrs}, extra))
    with torch.no_grad():
        for acc, p in zip(point_sum, point_params):
            p.copy_(acc / moments.count)  # deterministic parameters at their SWA average
        mean = moments.mean[None].to(z.dtype)
        average = {k: v.detach() for k, v in pot.constrain(pot.unflatten(mean)).items()}
        flat = moments.sample(s.num_samples, s.scale, generator).to(z.dtype) if s.rank else mean
        log_q = _density.swag(moments, flat, s.scale) if s.rank else None  # for post.psis()
        samples = {k: v.detach() for k, v in pot.constrain(pot.unflatten(flat)).items()}
        point = point_values(fitted, *data.first(), n)
    draw_buffers = _batchnorm_statistics(fitted, samples, average, data, s.batch_size)
    run = ChainRun(fitted, samples, point, {"loss": losses, "lr": lrs}, {} if log_q is None else {"log_q": log_q})
    return run, moments, draw_buffers


class _PhasedOptimizer:
    """Both phases' optimizer: pre-training's (Adam, or SGD with momentum; rate on a cosine from ``pretrain_lr``
    to 1% of it), then, from :meth:`start_swa`, SGD with heavy-ball momentum at a constant rate."""

    def __init__(self, params: list[torch.Tensor], s: _Settings):
        self.params, self.momentum, self.swa_lr = params, s.momentum, None
        if s.pretrain_optimizer is PretrainOptimizer.ADAM:
            self.inner = torch.optim.Adam(params, lr=s.pretrain_lr)
        else:
            self.inner = torch.optim.SGD(params, lr=s.pretrain_lr, momentum=s.momentum)
        self.decay = torch.optim.lr_scheduler.CosineAnnealingLR(self.inner, max(s.pretrain_steps, 1),
                                                                s.pretrain_lr / 100)

    def start_swa(self, lr: float) -> None:
        self.inner, self.decay, self.swa_lr = torch.optim.SGD(self.params, lr=lr, momentum=self.momentum), None, lr

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.inner.step()
        if self.decay is not None:
            self.decay.step()

    def state_dict(self) -> dict:
        return {"swa_lr": self.swa_lr, "inner": self.inner.state_dict(),
                "decay": None if self.decay is None else self.decay.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["swa_lr"] is not None:
            self.start_swa(state["swa_lr"])
        self.inner.load_state_dict(state["inner"])
        if self.decay is not None:
            self.decay.load_state_dict(state["decay"])


def _minibatches(data: Data, batch_size: int, generator: torch.Generator, start: int = 0):
    """The batches from step ``start`` on: minibatches drawn with replacement (tensors; a checkpoint restores the
    generator), or the loader's own batches replayed up to ``start``."""
    if data.loader is not None:
        batches = data.batches(generator)
        for _ in range(start):
            next(batches)
        yield from batches
    while True:
        idx = torch.randint(data.x.shape[0], (batch_size,), generator=generator).to(data.x.device)
        yield data.x[idx], data.y[idx]


def _auto_lr(loss, params: list[torch.Tensor], data: Data, s: _Settings, generator: torch.Generator) -> float:
    """``lr = x / lambda`` (module docstring): ``lambda`` the largest |eigenvalue| of the Hessian of
    ``U / N`` over all trained tensors, by power iteration on Hessian-vector products."""
    if data.loader is not None:
        batch = data.first()
    elif data.x.shape[0] <= _CURVATURE_POINTS:
        batch = (data.x, data.y)
    else:
        idx = torch.randperm(data.x.shape[0], generator=generator)[:_CURVATURE_POINTS].to(data.x.device)
        batch = (data.x[idx], data.y[idx])
    grads = torch.autograd.grad(loss(batch), params, create_graph=True)
    v = [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params]
    curvature = 0.0
    for _ in range(_POWER_ITERATIONS):
        norm = torch.sqrt(sum((u * u).sum() for u in v))
        v = [u / norm for u in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        curvature = abs(float(sum((a * b).sum() for a, b in zip(hv, v))))
        v = [h.detach() for h in hv]
    if not (math.isfinite(curvature) and curvature > 0.0):
        raise FloatingPointError(f"lr='auto': the curvature of the loss at the end of pre-training is {curvature}, so "
                                 "no step size follows from it. Pass lr= a positive number (e.g. 1e-3).")
    b, n, beta = s.batch_size, data.size, s.momentum
    return 2 * b * (1 - beta) * (1 + beta) / ((1 + beta) * n + b * (1 - beta)) / curvature


def _batchnorm_statistics(model, samples: dict[str, torch.Tensor], average: dict[str, torch.Tensor], data: Data,
                          batch_size: int) -> dict[str, torch.Tensor]:
    """BatchNorm statistics of each draw, ``(draws, *shape)`` (empty without BatchNorm); the model's
    own buffers get those of the SWA average."""
    if not isinstance(model, BNN) or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and
                                             m.track_running_stats for m in model.net.modules()):
        return {}
    if data.loader is not None:
        inputs = [xb for xb, _ in data._loader_batches()]
    else:  # near-equal chunks: none of size 1, which training-mode BatchNorm refuses
        inputs = list(torch.tensor_split(data.x, math.ceil(data.x.shape[0] / batch_size)))
    was_training = model.training
    model.eval()  # only the BatchNorm layers run in training mode (dropout stays off)
    try:
        def refresh(values, i):
            return model.batchnorm_statistics({k: values[k][i] for k in model.sample_names}, inputs)

        per_draw = [refresh(samples, i) for i in range(next(iter(samples.values())).shape[0])]
        own = refresh(average, 0)
    finally:
        model.train(was_training)
    with torch.no_grad():
        for name, b in model.net.named_buffers():
            if name in own:
                b.copy_(own[name])
    return {k: torch.stack([d[k] for d in per_draw]) for k in per_draw[0]}
