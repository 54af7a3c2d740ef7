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

import dataclasses
import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, NamedTuple, Protocol, TypeVar

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer.checkpoint import Checkpoint, StepCheckpoint
from bnn_pyro.infer.driver import ChainInfo, ChainRun, Resumable, assemble, descend, run_chains
from bnn_pyro.posterior import Posterior

__all__ = ["Capabilities", "Declaration", "Engine", "LossInfo", "Loop", "State", "drive", "run", "entry", "RunOptions",
           "PotentialRunOptions"]


@dataclass(frozen=True)
class Capabilities:
    """What an engine can serve; ``bp.fit`` refuses the rest before fitting, naming the methods that can.

    minibatches: it takes ``batch_size=`` and loaders of ``(x, y)`` batches.
    one_shot: it consumes a one-shot iterator (a generator) of batches, in order, once.
    multi_pass: it reads the data more than once (fit, then curvature or statistics): no one-shot streams.
    jacobian_rows: its curvature takes per-example Jacobians of ``(N, out)`` outputs of one input tensor.
    checkpoint: it takes ``checkpoint=`` / ``checkpoint_every=`` / ``resume=``.
    chains: it runs several independent chains (restarts, members) as one posterior's chains.
    data_parallel: it averages gradients over the ranks of a ``torch.distributed`` group (``distributed=``).
    layers: it acts on the ``nn.Linear``/``nn.Conv`` layers of a :class:`~bnn_pyro.BNN` (dropout masks, per-weight
    variances), so a Pyro function model, which has no layers, is not for it.
    markov_chain: its draws are the states of Markov chains (MCMC, SG-MCMC), not draws from an approximation ``q``
    with a density: PSIS (:mod:`bnn_pyro.psis`) has no ratio ``p / q`` to check, and R-hat/ESS judge it instead.
    accept_reject: each draw is one proposal accepted or rejected whole (random-walk Metropolis, MALA): the health
    check flags a chain that (almost) never moved after warm-up.
    function_model: it fits a Pyro function ``model(x, y=None)`` with only its latent sites (no network, no
    ``pyro.param`` point fit), so it can be subspace inference's inner engine (over the subspace's coordinates).

    Facts about a method are read from here (or its config type), never from lists of method names.
    """

    minibatches: bool = False
    one_shot: bool = False
    multi_pass: bool = False
    jacobian_rows: bool = False
    checkpoint: bool = False
    chains: bool = True
    data_parallel: bool = False
    layers: bool = False
    markov_chain: bool = False
    accept_reject: bool = False
    function_model: bool = False

    def __post_init__(self):
        if self.one_shot and (self.multi_pass or not self.minibatches):
            raise ValueError("Capabilities: one_shot needs minibatches and a single pass (multi_pass=False).")


@dataclass(frozen=True)
class Declaration:
    """One registered method: where its fit function lives (``bnn_pyro.infer.<module>.<function>``, imported on
    first use) and its capabilities. Its configuration is the fit function's ``config_type`` (a frozen dataclass
    of options and defaults, set by :func:`entry`); a fit function not made by :func:`entry` has its options
    read from its keyword-only signature (and may not take ``**config``).
    """

    module: str
    function: str
    capabilities: Capabilities

    def fit_function(self) -> Callable[..., Posterior]:
        return getattr(importlib.import_module(f"bnn_pyro.infer.{self.module}"), self.function)

    def refused(self) -> frozenset:
        """Names bp.fit hands over although they are not options, because the engine refuses them with a message
        of its own or takes them as former names: its config dataclass's ``REFUSED`` (e.g. SWAG's ``rank`` given to
        SWA) and ``RENAMED`` (see :func:`entry`)."""
        config = getattr(self.fit_function(), "config_type", None)
        return frozenset(getattr(config, "REFUSED", {})) | frozenset(getattr(config, "RENAMED", {}))

    def options(self) -> dict[str, object]:
        """The engine's own keyword options with their defaults (``bp.fit``'s keywords not included)."""
        fn = self.fit_function()
        if hasattr(fn, "config_type"):
            return {f.name: _default(f) for f in _ordered_fields(fn.config_type)}
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
            raise LookupError(f"{self.module}.{self.function} takes **config: make it an engine with a config "
                              "dataclass (contract.entry), so that its options can be listed and checked.")
        return _keywords(fn)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty


def _keywords(fn) -> dict[str, object]:
    """A fit function's keyword options (everything but ``model``, ``data`` and ``**config``)."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if name not in ("model", "data") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


@dataclass(frozen=True)
class RunOptions:
    """The options every optimization engine takes besides its own, the base of its config dataclass; :func:`entry`
    lists them last in the engine's signature (its own options first, in their order): the seed, the progress bar
    and checkpoint/resume (:mod:`bnn_pyro.infer.checkpoint`)."""

    seed: int = 0
    progress: bool = True
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False

    def keywords(self) -> dict[str, Any]:
        """The options as keywords, ``{field: value}`` (shallow: an ``init`` Posterior is passed, not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class PotentialRunOptions(RunOptions):
    """:class:`RunOptions` of an engine built on :class:`~bnn_pyro.infer._potential.Potential`, which also takes
    ``fast_path`` (the analytic or torch potential where the model allows it; ``False``: Pyro's trace)."""

    fast_path: bool = True


_LAST = tuple(f.name for f in dataclasses.fields(PotentialRunOptions))


def _ordered_fields(config_type: type) -> list[dataclasses.Field]:
    """The config's fields with the shared :class:`RunOptions` ones last (a dataclass lists a base's first)."""
    own = dataclasses.fields(config_type)
    return [f for f in own if f.name not in _LAST] + sorted((f for f in own if f.name in _LAST),
                                                             key=lambda f: _LAST.index(f.name))


def entry(config_type: type):
    """Decorate ``fit(model, data, config: config_type) -> Posterior`` into the engine's public function
    ``fit(model, data, **options)``: the options become ``config_type(**options)`` and its signature lists
    them as keyword-only parameters with their defaults (``help()``, ``inspect.signature``). A name in the config
    type's class-level ``REFUSED = {name: why}`` (e.g. a sibling method's option) is refused with
    ``ValueError("{name}= {why}")`` rather than Python's unexpected-keyword error; one in ``RENAMED = {old: new}``
    (an option renamed, kept one release) is passed on as ``new`` with a ``DeprecationWarning``."""
    refused, renamed = getattr(config_type, "REFUSED", {}), getattr(config_type, "RENAMED", {})

    def wrap(fn):
        @functools.wraps(fn)
        def fit(model, data: Data, **options) -> Posterior:
            for name in list(options):
                if name in refused:
                    raise ValueError(f"{name}= {refused[name]}")
                if name in renamed:  # a former name, kept one release
                    new = renamed[name]
                    if new in options:
                        raise TypeError(f"{name}: the former name of {new}=; pass {new}= only.")
                    warnings.warn(f"{name}= is deprecated; its name is now {new}= (the old name goes in the next "
                                  "release).", DeprecationWarning, stacklevel=3)  # the user's bp.fit(...) line
                    options[new] = options.pop(name)
            return fn(model, data, config_type(**options))

        params = [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  inspect.Parameter("data", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Data")]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f), annotation=f.type)
                   for f in _ordered_fields(config_type)]
        fit.__signature__ = inspect.Signature(params, return_annotation="Posterior")
        fit.config_type = config_type
        return fit
    return wrap


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
    step: Callable[[S, tuple, int], "tuple[torch.Tensor, Info]"]
    draws: Callable[[S, "dict[str, torch.Tensor]"], ChainRun]
    info: type = LossInfo
    after: Callable[[S, int, Info], Info] | None = None
    checkpoint: Callable[[S, Checkpoint, "dict[str, torch.Tensor]"], Resumable] | None = None
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


def run(engine: Engine, state, data: Data, loop: Loop, *, seed: int, index: int = 0,
        ckpt: Checkpoint | None = None) -> dict[str, torch.Tensor]:
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
        resumable = (engine.checkpoint(state, ckpt, records) if engine.checkpoint is not None
                     else StepCheckpoint(ckpt, state.params, records=records))
    own = {name: functools.partial(getattr(engine, name), state) for name in ("batches", "where")
           if getattr(engine, name) is not None}
    losses = descend(objective, state.params, data, num_steps=loop.num_steps, lr=loop.lr, optimizer=loop.optimizer,
                     lr_schedule=loop.lr_schedule, seed=seed, method=loop.method, desc=loop.desc.format(index=index),
                     progress=loop.progress, quantity=loop.quantity, hint=loop.hint, on_step=on_step,
                     reduce=loop.reduce, resumable=resumable, record_dtype=engine.record_dtype,
                     opt=None if engine.optimizer is None else engine.optimizer(state), **own)
    return {fields[0]: losses, **records}


def drive(model, data: Data, engine: Engine, loop: Loop, *, num_chains: int, seed: int, config: dict,
          checkpoints: list[Checkpoint | None] | None = None, posterior_data: Data | None = None) -> Posterior:
    """Fit ``model``: ``num_chains`` chains (seeds ``seed + c``, each in its own model copy and parameter store),
    each ``engine.init`` -> :func:`run` -> ``engine.draws``, stacked into one :class:`~bnn_pyro.Posterior`
    (method ``loop.method``, ``config``; its ``x``/``y`` from ``posterior_data``, by default ``data``).
    ``checkpoints``: one :class:`~bnn_pyro.infer.checkpoint.Checkpoint` (or ``None``) per chain."""
    def one_chain(fitted, info: ChainInfo) -> ChainRun:
        state = engine.init(fitted, info)
        history = run(engine, state, data, loop, seed=info.seed, index=info.index,
                      ckpt=None if checkpoints is None else checkpoints[info.index])
        return engine.draws(state, history)

    runs = run_chains(model, num_chains, seed, one_chain, method=loop.method)
    return assemble(runs, method=loop.method, config=config, data=data if posterior_data is None else posterior_data)
