"""Optimizers, learning rates and learning-rate schedules of the engines with their own optimization loop.

``make_optimizer`` turns ``optimizer=`` (``"adam"``, ``"adamw"``, ``"sgd"`` or a callable) into a torch
optimizer; ``make_schedule`` turns ``lr_schedule=`` (``"constant"``, ``"cosine"``, ``"exponential"`` or a
callable) into a scheduler stepped once per optimizer step. Shared by svi, ensemble, MC dropout,
variational dropout and distillation.

What ``lr`` means (the one statement every engine's docstring points to)
-----------------------------------------------------------------------
``lr`` is the step size of the engine's update on the **mean loss per datum** ``U / N``, with ``U`` the negative
log joint (minus the ELBO for variational engines) and ``N`` the number of training rows:

* SGD-type updates (sgld, sghmc, csgmcmc, snapshot, and the collection phase of swa/swag) move ``z`` by
  ``lr`` times the gradient of ``U / N``, i.e. by ``eta = lr / N`` times the gradient of ``U``; so ``lr`` is the
  learning rate SGD would use on the mean training loss, whatever ``N``.
* Adam (svi, variational_dropout, sparse_vd, mc_dropout, ensemble; ``optimizer="adam"``/``"adamw"``) divides the
  gradient by its running RMS, so its step is invariant to the loss's scale: ``lr`` is then roughly each
  parameter's step per iteration, the same on ``U`` or ``U / N``. ``optimizer="sgd"`` on these engines is plain
  SGD on their loss as each engine states it.

``lr="auto"`` sets the step from a curvature estimate: ``lambda``, the largest eigenvalue of the loss's Hessian
(power iteration on Hessian-vector products), sets a step ``f / lambda`` a safe factor below SGD's stability
limit (the factor ``f`` and its reason: sgld/sghmc/csgmcmc/snapshot in :mod:`bnn_pyro.infer.sgmcmc`, swa/swag in
:mod:`bnn_pyro.infer.swag`). It is
accepted where the update is SGD-type, whose stability limit curvature sets (``lr * lambda < 2`` for gradient
descent); it is refused, with the one message :data:`AUTO_LR_REFUSED`, where the update is Adam's, whose step
the curvature does not bound.

Schedule default
----------------
``lr_schedule="cosine"`` (:data:`DEFAULT_SCHEDULE`) for every engine whose loop is an optimizer's (svi,
variational_dropout, sparse_vd, mc_dropout, ensemble): the rate goes from ``lr`` down to 1% of it on a half
cosine (Loshchilov & Hutter 2017, SGDR; the annealing of Robbins-Monro step sizes to a point estimate), so that
the optimizer's own jitter, about ``lr`` per step for Adam, ends well below the posterior's spread.
The samplers sgld and sghmc take the same ``lr_schedule=`` name with their own choices (``"constant"``: a
stationary chain whose draws ESS and R-hat describe; ``"polynomial"``: Welling & Teh 2011's decay), not a cosine
to 1%, which would freeze the chain at its end; csgmcmc, snapshot and swa/swag have their schedules built in.

A schedule's horizon
--------------------
A schedule is laid over a run's ``num_steps`` (its horizon): the cosine of a 1,000-step run is at 91% of ``lr``
after 200 steps, that of a 200-step run at 1%. :class:`Horizon` lays ``lr_schedule`` over a given number of steps
instead and the run stops before its end: the first ``k`` rates of a ``steps``-step run. The held-out refit uses it
(:func:`~bnn_pyro.infer.holdout.refit`): the fit on every row runs the schedule of the scored run, stopped at the
step the held-out rows chose, so that it reproduces the state they scored, not a fit annealed over fewer steps.

Example
-------
>>> opt = make_optimizer("adam", params, lr=1e-2)
>>> sched = make_schedule("cosine", opt, num_steps=1000)   # 1e-2 -> 1e-4 over 1,000 steps
>>> sched = make_schedule(Horizon("cosine", 1000), opt, num_steps=200)   # its first 200 rates: 1e-2 -> 9.1e-3
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from bnn_pyro.utils.checks import choice, positive

__all__ = [
    "Optimizer",
    "Schedule",
    "make_optimizer",
    "make_schedule",
    "Horizon",
    "FINAL_LR_FRACTION",
    "DEFAULT_SCHEDULE",
    "AUTO_LR_REFUSED",
    "check_lr",
]

FINAL_LR_FRACTION = 0.01  # "cosine" and "exponential" end at this fraction of the initial rate
DEFAULT_SCHEDULE = "cosine"  # every optimizing engine's lr_schedule default (see the module docstring)
AUTO_LR_REFUSED = (
    "lr: 'auto' sets an SGD step from the loss's curvature (methods sgld, sghmc, csgmcmc, snapshot, "
    "swa, swag); method={method!r} steps with its optimizer= (Adam by default, whose step the curvature "
    "does not bound). Pass a number, e.g. lr=1e-2 (what lr means: bnn_pyro.infer.optim)."
)


class Optimizer(str, Enum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"


class Schedule(str, Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    EXPONENTIAL = "exponential"


def check_lr(lr: float | str, *, method: str, auto: bool = False) -> float | str:
    """``lr=`` (see the module docstring): a positive finite number, or ``"auto"`` where ``auto`` (an engine with
    a curvature-set step); ``"auto"`` elsewhere is refused with :data:`AUTO_LR_REFUSED`."""
    if isinstance(lr, str):
        if lr != "auto":
            raise ValueError(
                f"lr: unknown value {lr!r}; pass a positive number (e.g. 1e-2)"
                + (" or 'auto' (a step from the curvature)." if auto else ".")
            )
        if not auto:
            raise ValueError(AUTO_LR_REFUSED.format(method=method))
        return lr
    return positive("lr", lr)


def make_optimizer(optimizer, params, lr):
    """A torch optimizer from ``optimizer=``: ``"adam"``, ``"adamw"``, ``"sgd"`` or a callable
    ``params -> Optimizer`` (shared by the engines that run their own optimization loop)."""
    if callable(optimizer) and not isinstance(optimizer, str):
        return optimizer(params)
    kind = choice("optimizer", optimizer, Optimizer)
    cls = {Optimizer.ADAM: torch.optim.Adam, Optimizer.ADAMW: torch.optim.AdamW, Optimizer.SGD: torch.optim.SGD}[kind]
    return cls(params, lr=lr, foreach=True)  # one multi-tensor update over all parameters, not a Python loop


@dataclass(frozen=True)
class Horizon:
    """``lr_schedule=`` laid over ``steps`` optimizer steps whatever the run's ``num_steps`` (at most ``steps``): the
    run takes the first ``num_steps`` rates of a ``steps``-step run (module docstring, "A schedule's horizon").

    ``schedule`` is any ``lr_schedule=`` value: ``"cosine"`` and ``"exponential"`` reach 1% of ``lr`` at ``steps``,
    ``"constant"`` is unchanged, and a callable ``opt -> LRScheduler`` sets its own horizon, so it is passed through
    (stepped ``num_steps`` times it gives the rates of the run that built it)."""

    schedule: object
    steps: int

    def __post_init__(self):
        if isinstance(self.schedule, Horizon):
            raise TypeError("Horizon: schedule is already a Horizon; pass its .schedule.")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Horizon: steps must be a positive int (the schedule's length), got {self.steps!r}.")

    def __repr__(self) -> str:  # what post.config records of a run stopped before the horizon
        name = getattr(self.schedule, "value", self.schedule)
        return f"{name if isinstance(name, str) else repr(name)} over {self.steps} steps"


def make_schedule(schedule, opt, num_steps):
    """A learning-rate scheduler from ``lr_schedule=`` (``None`` for ``"constant"``): ``"cosine"`` and
    ``"exponential"`` end at 1% of the initial rate after ``num_steps``; a callable ``opt -> LRScheduler``; a
    :class:`Horizon`: its schedule laid over its ``steps`` (at least ``num_steps``), of which the run takes the
    first ``num_steps``."""
    if isinstance(schedule, Horizon):
        if schedule.steps < num_steps:
            raise ValueError(
                f"lr_schedule: {schedule!r} is shorter than the run's num_steps={num_steps}; a Horizon's steps "
                "must be at least num_steps (the run stops before the schedule's end, never after it)."
            )
        return make_schedule(schedule.schedule, opt, schedule.steps)
    if callable(schedule) and not isinstance(schedule, str):
        return schedule(opt)
    kind = choice("lr_schedule", schedule, Schedule)
    if kind is Schedule.CONSTANT:
        return None
    if kind is Schedule.COSINE:
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=num_steps, eta_min=opt.defaults["lr"] * FINAL_LR_FRACTION
        )
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=FINAL_LR_FRACTION ** (1.0 / num_steps))
