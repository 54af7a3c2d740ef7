"""What a method declares: its options (a frozen config dataclass, :func:`entry`) and its :class:`Capabilities`,
held by a :class:`Declaration` in the registry (:mod:`bnn_pyro.infer.registry`).

A small module of its own, with no import of the engines, the driver or the posterior, so that any layer may ask
the registry a fact about a method (e.g. :mod:`bnn_pyro.psis`: is it a Markov chain?) without an import cycle.
:mod:`bnn_pyro.infer.contract` re-exports its names.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bnn_pyro.utils.user_warnings import warn

if TYPE_CHECKING:  # annotations only: this module imports no engine, driver or posterior
    from bnn_pyro.infer.training_data import Data
    from bnn_pyro.posterior import Posterior

__all__ = [
    "Capabilities",
    "Declaration",
    "RunOptions",
    "PotentialRunOptions",
    "entry",
    "renamed_options",
    "RENAMED_OPTIONS",
]

RENAMED_OPTIONS: set[tuple[str, str]] = set()
"""``(old, new)``: every engine's renamed options (its config's ``RENAMED``, registered by :func:`entry`), so that a
checkpoint written before a rename still resumes (:func:`bnn_pyro.infer.checkpoint.current_names`)."""


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
    weight_sites: it needs the weight sites of a :class:`~bnn_pyro.BNN` (subspace inference spans its subspace by
    them), so a Pyro function model is not for it either.
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
    weight_sites: bool = False
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
        return frozenset(getattr(config, "REFUSED", {})) | frozenset(self.renamed())

    def renamed(self) -> dict[str, str]:
        """The deprecated option names the engine still takes, ``{old: new}`` (its config's ``RENAMED``)."""
        return dict(getattr(getattr(self.fit_function(), "config_type", None), "RENAMED", {}))

    def options(self) -> dict[str, object]:
        """The engine's own keyword options with their defaults (``bp.fit``'s keywords not included)."""
        fn = self.fit_function()
        if hasattr(fn, "config_type"):
            return {f.name: _default(f) for f in _ordered_fields(fn.config_type)}
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
            raise LookupError(
                f"{self.module}.{self.function} takes **config: make it an engine with a config "
                "dataclass (contract.entry), so that its options can be listed and checked."
            )
        return _keywords(fn)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty


def _keywords(fn) -> dict[str, object]:
    """A fit function's keyword options (everything but ``model``, ``data`` and ``**config``)."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if name not in ("model", "data") and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


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
    return [f for f in own if f.name not in _LAST] + sorted(
        (f for f in own if f.name in _LAST), key=lambda f: _LAST.index(f.name)
    )


def renamed_options(options: dict, renamed: dict[str, str]) -> dict:
    """``options`` with each deprecated name of ``renamed = {old: new}`` replaced by its new name, warning once per
    name (a ``FutureWarning`` at the user's line: shown by default, the old name works for one more release).
    Both names at once is an error: the two would silently disagree."""
    out = dict(options)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(
                f"{old}= is the old name of {new}=; pass only {new}= (got both {old}={out[old]!r} and "
                f"{new}={out[new]!r})."
            )
        warn(
            f"{old}= is renamed {new}= (one name per concept across bp.fit: docs/options.md); "
            f"{old}= still works in this release and will be removed in the next. Write {new}={out[old]!r}.",
            FutureWarning,
        )
        out[new] = out.pop(old)
    return out


def entry(config_type: type):
    """Decorate ``fit(model, data, config: config_type) -> Posterior`` into the engine's public function
    ``fit(model, data, **options)``: the options become ``config_type(**options)`` and its signature lists
    them as keyword-only parameters with their defaults (``help()``, ``inspect.signature``). A name in the config
    type's class-level ``REFUSED = {name: why}`` (e.g. a sibling method's option) is refused with
    ``ValueError("{name}= {why}")`` rather than Python's unexpected-keyword error. A name in its class-level
    ``RENAMED = {old: new}`` is a deprecated alias: it is taken as ``new`` with a ``FutureWarning`` at the user's
    line (:func:`renamed_options`), and not listed among the options."""
    refused, renamed = getattr(config_type, "REFUSED", {}), getattr(config_type, "RENAMED", {})
    RENAMED_OPTIONS.update(renamed.items())  # checkpoints written under the old names still resume

    def wrap(fn):
        @functools.wraps(fn)
        def fit(model, data: Data, **options) -> Posterior:
            for name in options:
                if name in refused:
                    raise ValueError(f"{name}= {refused[name]}")
            return fn(model, data, config_type(**renamed_options(options, renamed)))

        params = [
            inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("data", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Data"),
        ]
        params += [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f), annotation=f.type)
            for f in _ordered_fields(config_type)
        ]
        fit.__signature__ = inspect.Signature(params, return_annotation="Posterior")
        fit.config_type = config_type
        return fit

    return wrap
