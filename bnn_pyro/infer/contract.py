"""The engine contract: what a method declares (:class:`Declaration`), what an optimization engine
provides (:class:`Engine`), and the one function that drives it (:func:`drive`).

In the spirit of blackjax's ``SamplingAlgorithm(init, step)`` and posteriors' ``Transform(init, update)``,
adapted to torch, where the optimizer's update is shared by every engine and so belongs to the driver:

* A **declaration** says what ``bp.fit(..., method=...)`` may pass and what the engine can serve: its
  configuration (a frozen dataclass of its options with their defaults) and its :class:`Capabilities`
  (minibatches, one-shot streams, several passes over the data, per-example Jacobian rows, checkpoints,
  chains, data-parallel). ``bp.fit`` checks option names and data against it before any fitting starts.
* An **engine** (:class:`Engine`) is four functions over a state of its own: ``init(model, chain)`` builds
  the state (whose ``params`` the optimizer updates) in a chain's copy of the model; ``step(state, batch,
  index)`` gives the loss to minimize on one ``(x, y)`` batch and what the step records (a NamedTuple, its
  first field ``loss``); ``after(state, index, info)`` runs after the optimizer's update (projections,
  early stopping) and may complete the record; ``draws(state, history)`` turns the final state into the
  chain's :class:`~bnn_pyro.infer.driver.ChainRun` (an engine whose optimizer, batches or step names are its own,
  as SWA's two phases, gives them too: see :class:`Engine`).
* :func:`drive` runs it: :func:`~bnn_pyro.infer.driver.run_chains` (copies, parameter stores, seeds) ->
  :func:`~bnn_pyro.infer.driver.descend` (batches or streams, optimizer, schedule, progress, the non-finite
  stop, data-parallel reduction, checkpoint/resume) -> :func:`~bnn_pyro.infer.driver.assemble`.

Example
-------
>>> engine = Engine(init=lambda fitted, chain: State(...), step=lambda s, batch, i: (loss, LossInfo(loss.item())),
...                 draws=lambda s, history: ChainRun(s.model, samples, history=history))
>>> post = drive(model, data, engine, Loop(num_steps=1000, lr=1e-2, method="svi", desc="svi chain {index}"),
...              num_chains=2, seed=0, config=config)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer.checkpoint import Checkpoint, StepCheckpoint
from bnn_pyro.infer.declaration import (
    Capabilities,
    Declaration,
    PotentialRunOptions,
    RunOptions,
    entry,
    renamed_options,
)
from bnn_pyro.infer.driver import ChainInfo, ChainRun, Resumable, assemble, descend, run_chains
from bnn_pyro.posterior import Posterior

__all__ = [
    "Capabilities",
    "Declaration",
    "Engine",
    "LossInfo",
    "Loop",
    "State",
    "drive",
    "run",
    "entry",
    "RunOptions",
    "PotentialRunOptions",
    "renamed_options",
]


# ------------------------------------------------------------------------------------------ the engine
class State(Protocol):
    """An engine's state: whatever it needs, with the tensors the optimizer updates as ``params``."""

    params: list[torch.Tensor]


class LossInfo(NamedTuple):
    """What a step records when the loss is all: the value of the objective on the step's batch."""

    loss: float


S = TypeVar("S", bound=State)
Info = TypeVar("Info", bound=tuple)


class Engine(NamedTuple, Generic[S, Info]):
    """An optimization engine (see the module docstring). ``info`` is the NamedTuple type ``step`` returns:
    every field becomes a ``history`` entry of shape ``(num_steps,)``; ``checkpoint(state, ckpt, records)``
    gives the :class:`~bnn_pyro.infer.driver.Resumable` (by default the state's ``params``, the optimizer and
    the records, :class:`~bnn_pyro.infer.checkpoint.StepCheckpoint`). Optional: ``optimizer(state)``, an engine's
    own update as a torch optimizer built from its state (e.g. SG-MCMC's, seeded per chain and reading the state's
    curvature; SWA's two phases; default: ``loop.optimizer`` over ``state.params`` at ``loop.lr``);
    ``record_dtype``, the dtype of the history tensors (default torch's default dtype; e.g. ``torch.float64`` to
    keep a float64 model's values exact); ``batches(state, start)``, its batches from step ``start`` on (default
    the data's, reshuffled every epoch by the chain's seed); ``where(state, step)``, the step's name in the error
    raised when the run diverges."""

    init: Callable[[Any, ChainInfo], S]
    step: Callable[[S, tuple, int], tuple[torch.Tensor, Info]]
    draws: Callable[[S, dict[str, torch.Tensor]], ChainRun]
    info: type = LossInfo
    after: Callable[[S, int, Info], Info] | None = None
    checkpoint: Callable[[S, Checkpoint, dict[str, torch.Tensor]], Resumable] | None = None
    optimizer: Callable[[S], torch.optim.Optimizer] | None = None
    record_dtype: torch.dtype | None = None
    batches: Callable[[S, int], Iterator[tuple]] | None = None
    where: Callable[[S, int], str] | None = None


@dataclass(frozen=True)
class Loop:
    """How :func:`run` descends: ``num_steps`` optimizer steps of ``optimizer`` at ``lr`` under ``lr_schedule``
    (as :func:`~bnn_pyro.infer.optim.make_optimizer` / ``make_schedule`` take them); ``method``, ``desc``
    (``{index}`` becomes the chain), ``quantity`` and ``hint`` name the run in the progress bar and in the
    non-finite stop; ``reduce`` averages gradients over data-parallel ranks."""

    num_steps: int
    lr: float
    method: str
    desc: str
    optimizer: Any = "adam"
    lr_schedule: Any = "constant"
    quantity: str = "loss"
    hint: str = ""
    progress: bool = True
    reduce: Callable | None = field(default=None, compare=False)

    def descend_options(self, index: int = 0) -> dict[str, Any]:
        """The keywords of :func:`~bnn_pyro.infer.driver.descend` that this loop sets, for chain ``index``: every
        caller of ``descend`` that takes a :class:`Loop` passes the same ones."""
        return dict(
            num_steps=self.num_steps,
            lr=self.lr,
            optimizer=self.optimizer,
            lr_schedule=self.lr_schedule,
            method=self.method,
            desc=self.desc.format(index=index),
            progress=self.progress,
            quantity=self.quantity,
            hint=self.hint,
            reduce=self.reduce,
        )


def run(
    engine: Engine, state, data: Data, loop: Loop, *, seed: int, index: int = 0, ckpt: Checkpoint | None = None
) -> dict[str, torch.Tensor]:
    """One chain's descent of ``engine`` from ``state``: ``loop.num_steps`` steps on ``data``'s batches (their
    order seeded by ``seed``); returns the per-step records, one ``(num_steps,)`` tensor per field of
    ``engine.info``."""
    fields = engine.info._fields
    records = {name: torch.empty(loop.num_steps, dtype=engine.record_dtype) for name in fields[1:]}
    last = [None]

    def objective(batch, step):
        loss, info = engine.step(state, batch, step)
        last[0] = info
        return loss, info[0]

    def on_step(step, value):
        info = last[0] if engine.after is None else engine.after(state, step, last[0])
        for name in fields[1:]:
            records[name][step] = getattr(info, name)

    resumable = None
    if ckpt is not None:
        resumable = (
            engine.checkpoint(state, ckpt, records)
            if engine.checkpoint is not None
            else StepCheckpoint(ckpt, state.params, records=records)
        )
    own = {
        name: functools.partial(getattr(engine, name), state)
        for name in ("batches", "where")
        if getattr(engine, name) is not None
    }
    losses = descend(
        objective,
        state.params,
        data,
        seed=seed,
        on_step=on_step,
        resumable=resumable,
        record_dtype=engine.record_dtype,
        opt=None if engine.optimizer is None else engine.optimizer(state),
        **loop.descend_options(index),
        **own,
    )
    return {fields[0]: losses, **records}


def drive(
    model,
    data: Data,
    engine: Engine,
    loop: Loop,
    *,
    num_chains: int,
    seed: int,
    config: dict,
    checkpoints: list[Checkpoint | None] | None = None,
    posterior_data: Data | None = None,
) -> Posterior:
    """Fit ``model``: ``num_chains`` chains (seeds ``seed + c``, each in its own model copy and parameter store),
    each ``engine.init`` -> :func:`run` -> ``engine.draws``, stacked into one :class:`~bnn_pyro.Posterior`
    (method ``loop.method``, ``config``; its ``x``/``y`` from ``posterior_data``, by default ``data``).
    ``checkpoints``: one :class:`~bnn_pyro.infer.checkpoint.Checkpoint` (or ``None``) per chain."""

    def one_chain(fitted, info: ChainInfo) -> ChainRun:
        state = engine.init(fitted, info)
        history = run(
            engine,
            state,
            data,
            loop,
            seed=info.seed,
            index=info.index,
            ckpt=None if checkpoints is None else checkpoints[info.index],
        )
        return engine.draws(state, history)

    runs = run_chains(model, num_chains, seed, one_chain, method=loop.method)
    return assemble(runs, method=loop.method, config=config, data=data if posterior_data is None else posterior_data)
