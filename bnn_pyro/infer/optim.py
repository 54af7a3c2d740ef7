"""Optimizers and learning-rate schedules of the engines with their own optimization loop.

``make_optimizer`` turns ``optimizer=`` (``"adam"``, ``"adamw"``, ``"sgd"`` or a callable) into a torch
optimizer; ``make_schedule`` turns ``lr_schedule=`` (``"constant"``, ``"cosine"``, ``"exponential"`` or a
callable) into a scheduler stepped once per optimizer step. Shared by svi, ensemble, MC dropout,
variational dropout and distillation (each engine keeps its own default schedule).

Example
-------
>>> opt = make_optimizer("adam", params, lr=1e-2)
>>> sched = make_schedule("cosine", opt, num_steps=1000)   # 1e-2 -> 1e-4 over 1,000 steps
"""

from __future__ import annotations

from enum import Enum

import torch

from bnn_pyro.utils.checks import choice

__all__ = ["Optimizer", "Schedule", "make_optimizer", "make_schedule", "FINAL_LR_FRACTION"]

FINAL_LR_FRACTION = 0.01  # "cosine" and "exponential" end at this fraction of the initial rate


class Optimizer(str, Enum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"


class Schedule(str, Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    EXPONENTIAL = "exponential"


def make_optimizer(optimizer, params, lr):
    """A torch optimizer from ``optimizer=``: ``"adam"``, ``"adamw"``, ``"sgd"`` or a callable
    ``params -> Optimizer`` (shared by the engines that run their own optimization loop)."""
    if callable(optimizer) and not isinstance(optimizer, str):
        return optimizer(params)
    kind = choice("optimizer", optimizer, Optimizer)
    cls = {Optimizer.ADAM: torch.optim.Adam, Optimizer.ADAMW: torch.optim.AdamW, Optimizer.SGD: torch.optim.SGD}[kind]
    return cls(params, lr=lr, foreach=True)  # one multi-tensor update over all parameters, not a Python loop


def make_schedule(schedule, opt, num_steps):
    """A learning-rate scheduler from ``lr_schedule=`` (``None`` for ``"constant"``): ``"cosine"`` and
    ``"exponential"`` end at 1% of the initial rate after ``num_steps``; a callable ``opt -> LRScheduler``."""
    if callable(schedule) and not isinstance(schedule, str):
        return schedule(opt)
    kind = choice("lr_schedule", schedule, Schedule)
    if kind is Schedule.CONSTANT:
        return None
    if kind is Schedule.COSINE:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=num_steps,
                                                          eta_min=opt.defaults["lr"] * FINAL_LR_FRACTION)
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=FINAL_LR_FRACTION ** (1.0 / num_steps))
