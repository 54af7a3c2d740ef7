"""The MAP (posterior mode) search that point-fit engines share: deep ensembles (one per member) and Laplace.

:func:`minimize` runs a first-order optimizer on the potential energy of a
:class:`~bnn_pyro.infer._potential.Potential` (on minibatches when ``batch_size`` is set), with, optionally,
early stopping on held-out rows (:class:`~bnn_pyro.infer.holdout.BestOnHoldout`), the fast-gradient-sign
adversarial term of Lakshminarayanan et al. (2017), and an L-BFGS polish on the full data.
:func:`fit_map` is one complete MAP fit of a model from a fresh start (its own copy and parameter store).
:func:`estimate_points` uses it to set a BNN's deterministic parameters (those its prior leaves out) before the
samplers (MCMC, SG-MCMC) run, which sample only the Bayesian ones: at the joint MAP, never at a random start.
Both run :func:`map_engine`, the search as an :class:`~bnn_pyro.infer.contract.Engine`, which deep ensembles
drive one chain per member (:func:`~bnn_pyro.infer.contract.drive`).

Coordinates. With ``jacobian=True`` (the default, as an ensemble member) the loss is
``U_c(w) = U(z) + log|det dw/dz|``: ``-log p`` in each latent site's own (constrained) coordinates, so that a
learned noise scale goes to the mode of ``p(sigma | ...)``; with ``jacobian=False`` it is ``U(z)`` itself
(Laplace: the curvature is taken in ``z``). For real-valued sites (weights) the two agree.

Example
-------
>>> fit = fit_map(model, Data(x, y), init="reset", num_steps=1000, lr=1e-2, seed=0)
>>> fit.sample["0.weight"], fit.loss.shape, fit.best_step
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from pyro import poutine

from bnn_pyro.infer._common import Data, point_values
from bnn_pyro.infer._init import chain_start
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.anchor import FreeDirections, anchor, free_start, target_noise, tilt, weighted
from bnn_pyro.infer.checkpoint import StepCheckpoint
from bnn_pyro.infer.contract import Engine, Loop, LossInfo, run
from bnn_pyro.infer.driver import ChainInfo, chain
from bnn_pyro.infer.holdout import BestOnHoldout, Holdout, heldout_score
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__all__ = [
    "fit_map",
    "map_engine",
    "map_state",
    "finish",
    "map_fit",
    "minimize",
    "MapFit",
    "MapRun",
    "MapState",
    "energy",
    "adversarial_loss",
    "estimate_points",
    "POINT_MAP_STEPS",
    "POINT_MAP_LR",
    "POINT_MAP_POLISH",
    "converge",
    "CONVERGE_POLISH",
    "CONVERGE_NEWTON",
    "CONVERGE_MAX_DIM",
    "damped_newton",
]


@dataclass
class MapRun:
    """What :func:`minimize` found: the unconstrained site values ``z`` (detached), the loss per step, and the
    step whose state was kept (the last one without held-out rows)."""

    z: dict[str, torch.Tensor]
    loss: torch.Tensor
    best_step: int


@dataclass
class MapFit:
    """One MAP fit (:func:`fit_map`): the fitted copy of the model, its latent site values ``sample``
    (constrained), its deterministic parameters ``point``, the loss trace, the log joint ``lp`` at the mode
    (full data; the first batch, scaled, for a loader) and the step kept by early stopping."""

    model: object
    sample: dict[str, torch.Tensor]
    point: dict[str, torch.Tensor]
    loss: torch.Tensor
    lp: torch.Tensor
    best_step: int


@dataclass
class MapState:
    """A MAP search in progress: the potential, the unconstrained site values ``z`` (optimized unless
    ``fixed``), the optimized tensors ``params`` (``z`` and the model's deterministic parameters), the loss
    on a batch, and the early-stopping record on held-out rows."""

    model: object
    pot: Potential
    z: dict[str, torch.Tensor]
    params: list[torch.Tensor]
    loss_fn: object
    best: BestOnHoldout
    num_steps: int
    data: Data | None = None  # the rows this search fits when they are its own (perturbed targets), else None
    seed: int = 0  # the chain's seed: its minibatch order


def map_state(
    pot: Potential,
    z: dict[str, torch.Tensor],
    data: Data,
    *,
    model,
    num_steps: int,
    jacobian: bool = True,
    fixed=(),
    tilted: dict[str, torch.Tensor] | None = None,
) -> MapState:
    """The state of a MAP search from ``z``; the parameters are found by running the loss once on the first
    batch (with ``jacobian=True`` the loss is :func:`energy`, else the potential itself; ``tilted``, a prior
    anchor from :func:`~bnn_pyro.infer.anchor.anchor`, adds ``<z, g>`` to it)."""
    z = {k: v.detach().clone().requires_grad_(k not in fixed) for k, v in z.items()}
    base = energy if jacobian else (lambda p, zz, batch: p(zz, batch))
    loss_fn = base if not tilted else (lambda p, zz, batch: base(p, zz, batch) + tilt(zz, tilted))
    with poutine.trace(param_only=True) as capture:
        loss_fn(pot, z, data.first())
    params = [v for k, v in z.items() if k not in fixed] + [
        site["value"].unconstrained() for site in capture.trace.nodes.values()
    ]
    return MapState(
        model, pot, z, params, loss_fn, BestOnHoldout(every=max(1, num_steps // 50), patience=None), num_steps
    )


def map_engine(
    data: Data,
    *,
    init,
    num_steps: int,
    holdout: Holdout | None = None,
    adversarial_eps: float = 0.0,
    draws=None,
    paths: Potentials | None = None,
    anchored: bool = False,
    perturb_targets: bool = False,
    free: FreeDirections | None = None,
) -> Engine:
    """The MAP search as an :class:`~bnn_pyro.infer.contract.Engine`: each chain starts from ``init`` (resolved
    by :func:`~bnn_pyro.infer._init.resolve_init`) under its seed; ``draws(state, history)`` makes the chain's
    result (:func:`finish` first gives the kept state). ``paths`` builds the potentials (default: the fast path
    where the model allows it). ``anchored=True``: each chain's objective is tilted toward its own prior draw
    (:mod:`bnn_pyro.infer.anchor`, drawn under the chain's seed); it starts where ``init`` says, except that with
    ``free`` (:func:`~bnn_pyro.infer.anchor.free_directions` of the rows it fits) the first layer's weight starts at its
    anchor along the free input directions (:func:`~bnn_pyro.infer.anchor.free_start`). With
    ``perturb_targets=True`` as well, each chain fits its own targets ``y + delta``
    (:func:`~bnn_pyro.infer.anchor.target_noise`: a Gaussian likelihood of fixed scale and tensor data; other models
    and loaders fit ``y`` itself), the randomize-then-optimize draw; the held-out rows and ``lp`` stay unperturbed."""
    paths = Potentials() if paths is None else paths

    def init_state(fitted, chain) -> MapState:
        pot = paths(fitted, data, init=chain_start(fitted, init, chain.seed))
        g, w0 = anchor(fitted, pot, data.first(), seed=chain.seed) if anchored else (None, {})
        z = free_start(pot.init, w0, free) if anchored else pot.init
        state = map_state(pot, z, data, model=fitted, num_steps=num_steps, tilted=g)
        state.seed = chain.seed
        delta = target_noise(fitted, data.y, seed=chain.seed) if perturb_targets and data.loader is None else None
        if delta is not None:
            state.data = replace(data, y=data.y + delta)
        return state

    def batches(state: MapState, start: int):
        """The chain's batches (its own rows when its targets are perturbed), as the default stream orders them."""
        stream = (data if state.data is None else state.data).batches(torch.Generator().manual_seed(state.seed))
        for _ in range(start):  # replay up to a restored step, as driver.descend does
            next(stream)
        return stream

    def step(state: MapState, batch, index: int):
        if adversarial_eps > 0:
            loss = adversarial_loss(state.pot, state.z, batch, adversarial_eps, state.loss_fn)
        else:
            loss = state.loss_fn(state.pot, state.z, batch)
        return loss, LossInfo(loss.item())

    def after(state: MapState, index: int, info: LossInfo) -> LossInfo:
        if holdout is not None and (state.best.due(index) or index == state.num_steps - 1):
            with torch.no_grad():
                state.best.record(
                    index,
                    heldout_score(state.model, state.pot.constrain(state.z), holdout),
                    [p.detach() for p in state.params],
                )
        return info

    return Engine(
        init=init_state,
        step=step,
        draws=draws,
        after=after,
        checkpoint=lambda state, ckpt, records: StepCheckpoint(ckpt, state.params, extra=state.best),
        batches=batches if perturb_targets else None,
    )


def finish(
    state: MapState, data: Data, losses: torch.Tensor, *, holdout: Holdout | None, polish_steps: int = 0
) -> MapRun:
    """The result of a MAP search that recorded ``losses``: the best state on the held-out rows (the last one without), then
    ``polish_steps`` L-BFGS iterations on the full data (not for a loader; kept only when they lower the loss)."""
    num_steps = state.num_steps
    if holdout is not None and num_steps:
        with torch.no_grad():
            for p, kept in zip(state.params, state.best.state):
                p.copy_(kept)
    if polish_steps and data.loader is None:
        _polish(lambda: state.loss_fn(state.pot, state.z, (data.x, data.y)), state.params, polish_steps)
    best_step = state.best.best_step if holdout is not None and num_steps else num_steps - 1
    return MapRun(z={k: v.detach() for k, v in state.z.items()}, loss=losses, best_step=best_step)


def map_fit(state: MapState, run: MapRun, data: Data) -> MapFit:
    """The :class:`MapFit` of a finished search (``lp`` on the full data, or the first batch of a loader)."""
    with torch.no_grad():
        lp = -energy(state.pot, run.z, data.first()).detach()
        sample = {k: v.detach().clone() for k, v in state.pot.constrain(run.z).items()}
        x0, y0 = data.first()
        point = point_values(state.model, x0, y0, data.size)
    return MapFit(model=state.model, sample=sample, point=point, loss=run.loss, lp=lp, best_step=run.best_step)


def fit_map(
    model,
    data: Data,
    *,
    init,
    num_steps: int,
    lr: float,
    optimizer="adam",
    lr_schedule="constant",
    seed: int = 0,
    progress: bool = True,
    holdout: Holdout | None = None,
    adversarial_eps: float = 0.0,
    polish_steps: int = 0,
    method: str = "map",
    ckpt=None,
    paths: Potentials | None = None,
) -> MapFit:
    """One MAP fit of a copy of ``model`` under ``seed`` (initial weights and minibatch order), in its own
    parameter store (:func:`~bnn_pyro.infer.driver.chain`); ``init`` as resolved by
    :func:`~bnn_pyro.infer._init.resolve_init`, ``paths`` as :func:`map_engine`, the rest (``ckpt`` too) as
    :func:`minimize`."""
    engine = map_engine(
        data, init=init, num_steps=num_steps, holdout=holdout, adversarial_eps=adversarial_eps, paths=paths
    )
    loop = Loop(
        num_steps=num_steps,
        lr=lr,
        method=method,
        desc=method,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        progress=progress,
    )
    with chain(model, seed) as fitted:
        state = engine.init(fitted, ChainInfo(0, seed))
        losses = run(engine, state, data, loop, seed=seed, ckpt=ckpt)["loss"]
        return map_fit(state, finish(state, data, losses, holdout=holdout, polish_steps=polish_steps), data)


def minimize(
    pot: Potential,
    z: dict[str, torch.Tensor],
    data: Data,
    *,
    model,
    num_steps: int,
    lr: float,
    optimizer="adam",
    lr_schedule="constant",
    seed: int = 0,
    progress: bool = True,
    desc: str = "map",
    holdout: Holdout | None = None,
    adversarial_eps: float = 0.0,
    polish_steps: int = 0,
    jacobian: bool = True,
    fixed=(),
    method: str = "map",
    ckpt=None,
) -> MapRun:
    """Minimize the potential energy from ``z`` (unconstrained site values); the model's deterministic
    parameters (``pyro.param`` sites) move along.

    ``optimizer``/``lr_schedule`` as in :func:`bnn_pyro.infer.svi.fit`. With ``holdout`` the state is scored
    on the held-out rows every ``num_steps // 50`` steps (:func:`~bnn_pyro.infer.holdout.heldout_score`) and
    the best one kept (early stopping; the budget ``num_steps`` is run in full). ``polish_steps`` L-BFGS
    iterations on the full data follow (not for a loader; the result is kept only when it lowers the loss).
    Sites named in ``fixed`` keep their values. ``method`` names the engine in the error raised for a
    non-finite loss. ``ckpt``: a :class:`~bnn_pyro.infer.checkpoint.Checkpoint` to save the run to and resume
    it from (with the early-stopping state).
    """
    state = map_state(pot, z, data, model=model, num_steps=num_steps, jacobian=jacobian, fixed=fixed)
    engine = map_engine(data, init=None, num_steps=num_steps, holdout=holdout, adversarial_eps=adversarial_eps)
    loop = Loop(
        num_steps=num_steps,
        lr=lr,
        method=method,
        desc=desc,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        progress=progress,
    )
    losses = run(engine, state, data, loop, seed=seed, ckpt=ckpt)["loss"]
    return finish(state, data, losses, holdout=holdout, polish_steps=polish_steps)


def energy(pot: Potential, z: dict[str, torch.Tensor], batch) -> torch.Tensor:
    """``U_c = U(z) + log|det dw/dz|``: ``-log p`` in ``w``'s own coordinates (its mode is the constrained MAP)."""
    u = pot(z, batch)
    for name, t in pot.transforms.items():
        w = t.inv(z[name])
        if w is not z[name]:  # identity maps (real-valued sites, e.g. weights) return their input and add nothing
            u = u + t.inv.log_abs_det_jacobian(z[name], w).sum()
    return u


def adversarial_loss(pot: Potential, z, batch, eps: float, loss_fn=None) -> torch.Tensor:
    """``(U_c(x) + U_c(x')) / 2`` with the fast-gradient-sign input ``x' = x + eps * sign(grad_x U_c)``."""
    loss_fn = energy if loss_fn is None else loss_fn
    x, y = batch
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"adversarial_eps > 0 perturbs the inputs, which must be floating point; got {x.dtype}. "
            "Use adversarial_eps=0 for integer (e.g. token) inputs."
        )
    x = x.detach().requires_grad_()
    clean = loss_fn(pot, z, (x, y))
    (grad,) = torch.autograd.grad(clean, x, retain_graph=True)
    return 0.5 * (clean + loss_fn(pot, z, ((x + eps * grad.sign()).detach(), y)))


def _polish(loss, params, max_iter: int) -> None:
    """L-BFGS on the full data; the first-order result is kept when L-BFGS does not lower the loss (or fails:
    its strong-Wolfe line search can overflow on badly scaled coordinates, kidiq's IQ-like covariate near 100)."""
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-10,
        tolerance_change=1e-12,
    )

    def closure():
        opt.zero_grad(set_to_none=True)
        u = loss()
        u.backward()
        return u

    with torch.no_grad():
        before = loss().item()
    try:
        opt.step(closure)
    except (RuntimeError, ValueError):  # a line search that overflowed (a step size past float range: badly scaled
        after = float("nan")  # coordinates) or left the model's support: keep the first-order result
    else:
        with torch.no_grad():
            after = loss().item()
    with torch.no_grad():
        if not after <= before:  # also when NaN
            for p, v in zip(params, saved):
                p.copy_(v)


CONVERGE_POLISH = 100  # L-BFGS iterations of :func:`converge` (Laplace's POLISH_STEPS)
CONVERGE_NEWTON = 100  # at most this many Newton steps after them (each stops the search when it cannot lower the loss)
CONVERGE_MAX_DIM = 2000  # Newton only up to this many coordinates (a dense Hessian: one gradient pass per coordinate)


def converge(state: MapState, data: Data, *, weights: dict[str, torch.Tensor] | None = None) -> bool:
    """Finish a Pyro function's MAP search at the minimum of its own objective (``state.loss_fn`` on every row, the
    member's perturbed targets when it has them): :data:`CONVERGE_POLISH` L-BFGS iterations (:func:`_polish`), then
    up to :data:`CONVERGE_NEWTON` damped Newton steps with the exact Hessian (:func:`damped_newton`;
    at most :data:`CONVERGE_MAX_DIM` coordinates, none held fixed by ``pyro.param`` sites). Why: Adam's steps are
    first order, so on a badly conditioned posterior (a coefficient of a covariate near 100 beside an intercept)
    they end far from the minimum however many are taken; Newton's step does not depend on the coordinates'
    scales (Laplace finishes its search the same way). ``weights`` (a member's observation weights,
    :func:`~bnn_pyro.infer.anchor.bootstrap_weights`) weight the observed sites' log-densities of the objective it
    minimizes (:func:`~bnn_pyro.infer.anchor.weighted`). Returns whether it ran (tensor data, a Pyro function)."""
    if isinstance(state.model, BNN) or data.loader is not None:
        return False
    rows = data if state.data is None else state.data
    batch = (rows.x, rows.y)
    loss_fn = weighted(state.loss_fn, weights or {})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Encountered NaN")  # line-search trials past float range: rejected
        _polish(lambda: loss_fn(state.pot, state.z, batch), state.params, CONVERGE_POLISH)
    names = list(state.pot.shapes)
    trainable = [p for p in state.params if not any(p is state.z[n] for n in names)]
    flat = state.pot.flatten({n: state.z[n].detach() for n in names})
    if trainable or flat.numel() > CONVERGE_MAX_DIM:
        return True

    def fn(v):
        return loss_fn(state.pot, state.pot.unflatten(v), batch)

    z = damped_newton(fn, flat, steps=CONVERGE_NEWTON)
    with torch.no_grad():
        for name, value in state.pot.unflatten(z).items():
            state.z[name].copy_(value)
    return True


def damped_newton(fn, z: torch.Tensor, *, steps: int) -> torch.Tensor:
    """Up to ``steps`` Levenberg-Marquardt steps on ``fn`` (a scalar function of one flat vector) from ``z``: the step
    ``(H + lambda I)^{-1} grad`` with the smallest ``lambda`` in ``0, 1e-6 m, 1e-5 m, ...`` (``m`` the largest
    ``|H_ii|``) that makes the matrix positive definite and lowers ``fn`` (Nocedal & Wright 2006, sec. 3.4 and 10.3).
    Far from the mode the Hessian of a learned scale need not be positive definite (pure Newton stops there); the
    damping bends the step toward the gradient until it descends. Stops when no damping lowers ``fn``."""
    z = z.detach().clone()
    for _ in range(steps):
        x = z.clone().requires_grad_()
        value = fn(x)
        (grad,) = torch.autograd.grad(value, x)
        hess = torch.autograd.functional.hessian(fn, z).double()
        hess = (hess + hess.T) / 2
        if not (bool(torch.isfinite(hess).all()) and bool(torch.isfinite(grad).all())):
            break
        scale = float(hess.diagonal().abs().max()) or 1.0
        eye = torch.eye(len(z), dtype=hess.dtype, device=hess.device)
        for damping in [0.0] + [scale * 10.0**k for k in range(-6, 7)]:
            chol, info = torch.linalg.cholesky_ex(hess + damping * eye)
            if int(info) != 0:
                continue
            trial = z - torch.cholesky_solve(grad.double()[:, None], chol)[:, 0].to(z)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a trial past float range: Pyro's NaN note, rejected below
                trial_value = fn(trial)
            if bool(torch.isfinite(trial_value)) and float(trial_value) < float(value.detach()):
                z = trial.detach()
                break
        else:
            break
    return z


POINT_MAP_STEPS = 300  # Adam steps (lr POINT_MAP_LR) of the MAP that sets a BNN's deterministic parameters
POINT_MAP_LR = 1e-2
POINT_MAP_POLISH = 100  # L-BFGS iterations after them (kept only when they lower the loss)


def estimate_points(fitted, data: Data, init, *, seed: int, progress: bool, method: str):
    """How a sampler sets a BNN's deterministic parameters (those its prior leaves out; the sampler keeps them
    fixed): ``(None, {})`` without them; ``("init", {})`` when ``init`` gives them (a Posterior, or a dict naming
    every one); else ``("map", values)``, the joint MAP's values (:data:`POINT_MAP_STEPS` Adam steps and an
    L-BFGS polish from ``init``) of those that ``init`` does not name. A random start would fit another model:
    the Bayesian weights shift to compensate for a bias frozen at a random value."""
    if not isinstance(fitted, BNN) or not fitted.point_names:
        return None, {}
    given = set(init) if isinstance(init, dict) else set()
    if isinstance(init, Posterior) or given >= set(fitted.point_names):
        return "init", {}
    mode = fit_map(
        fitted,
        data,
        init=init,
        num_steps=POINT_MAP_STEPS,
        lr=POINT_MAP_LR,
        seed=seed,
        progress=progress,
        polish_steps=POINT_MAP_POLISH,
        method=f"{method} point estimate (map)",
    )
    return "map", {n: v for n, v in mode.point.items() if n not in given}
