"""Pieces every engine shares: the latent sites of a model, minibatches, progress bars, seeds."""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Callable, Iterator

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import initialization as init_fns
from pyro.poutine.util import site_is_subsample
from tqdm.auto import tqdm

from bnn_pyro._upstream_private import set_validates_args, validates_args
from bnn_pyro.model import BNN

__all__ = ["Data", "traced", "is_latent", "latent_sites", "call_model", "progress_bar", "clean_config", "init_strategy",
           "point_values", "quiet_model", "torch_threads", "unvalidated"]


@dataclass
class Data:
    """Training data for one fit: full tensors (``x``, ``y``) or a loader of ``(x, y)`` batches.

    A loader is either *re-iterable* (a ``DataLoader``, an ``IterableDataset`` yielding batches, any
    object whose ``__iter__`` starts a new pass): every pass is an epoch, and the fit goes round as
    often as it needs; or *one-shot* (an iterator, e.g. a generator): its batches are consumed once,
    in order, by all steps (and chains) of the fit, and running out of them is an error. Nothing
    keeps more than the current batch (and the first one, for tracing the model) in memory.
    """

    x: torch.Tensor | None
    y: torch.Tensor | None
    loader: object | None = None
    dataset_size: int | None = None
    batch_size: int | None = None
    convert: Callable | None = None  # validates and converts each loader batch (and a given held-out pair)

    def __post_init__(self):
        self._first = None  # the first batch (tracing the model), taken once
        self._first_unused = False  # a one-shot stream's first batch, still to be trained on
        self._taken = 0  # batches taken from a one-shot stream

    @property
    def one_shot(self) -> bool:
        """Whether the loader is an iterator whose batches can be consumed only once."""
        return self.loader is not None and isinstance(self.loader, collections.abc.Iterator)

    def _convert(self, batch):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            what = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
            raise ValueError(f"x: each batch must be an (x, y) pair, got {what}; make the loader yield inputs and "
                             "targets, e.g. a DataLoader over TensorDataset(x, y).")
        xb, yb = batch
        return self.convert(xb, yb) if self.convert is not None else (xb, yb)

    def _loader_batches(self):
        for batch in self.loader:
            yield self._convert(batch)

    @property
    def size(self) -> int:
        return self.dataset_size if self.dataset_size is not None else self.x.shape[0]

    def first(self):
        """A small batch for tracing the model once (site discovery, guide set-up)."""
        if self.loader is None:
            return self.x, self.y
        if self._first is None:
            source = self.loader if self.one_shot else iter(self.loader)
            try:
                self._first = self._convert(next(source))
            except StopIteration:
                raise ValueError("x: the iterable of batches is empty; expected (x, y) batches.") from None
            self._first_unused = self.one_shot
            self._taken += self.one_shot
        return self._first

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """An endless stream of minibatches (reshuffled every epoch) or of the full batch."""
        if self.one_shot:
            yield from self._stream()
        while True:
            if self.loader is not None:
                count = 0
                for batch in self._loader_batches():
                    count += 1
                    yield batch
                if count == 0:
                    raise ValueError("x: a pass over the loader gave no batches; expected (x, y) batches.")
            elif self.batch_size is None or self.batch_size >= self.x.shape[0]:
                yield self.x, self.y
            else:
                perm = torch.randperm(self.x.shape[0], generator=generator).to(self.x.device)
                for i in range(0, len(perm), self.batch_size):
                    j = perm[i : i + self.batch_size]
                    yield self.x[j], None if self.y is None else self.y[j]

    def _stream(self):
        self.first()
        if self._first_unused:
            self._first_unused = False
            yield self._first
        for batch in self.loader:
            self._taken += 1
            yield self._convert(batch)
        raise ValueError(
            f"x: the one-shot iterable of batches (an iterator or generator) ran out after {self._taken} batches, "
            "but the fit asked for more. Give fewer steps (num_steps=, num_samples=), a generator that never "
            "ends, or a re-iterable source (a DataLoader, an IterableDataset, an object whose __iter__ starts "
            "a new pass over the data).")


def call_model(model: Callable, x, y, dataset_size: int | None):
    """``model(x, y)`` with the minibatch scale: a ``BNN`` (or any model taking ``dataset_size``)
    gets it as a keyword; a plain function has the sites inside its ``"data"`` plate scaled."""
    if isinstance(model, BNN) or "dataset_size" in _parameters(model):
        return model(x, y, dataset_size=dataset_size)
    if dataset_size is None or dataset_size == x.shape[0]:
        return model(x, y)
    with _DataPlateScale(dataset_size / x.shape[0]):
        return model(x, y)


def _parameters(fn) -> dict:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


class _DataPlateScale(poutine.messenger.Messenger):
    """Scale the log-density of sites inside the plate named ``"data"`` (minibatch correction for
    Pyro function models that do not take ``dataset_size``)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def _pyro_sample(self, msg):
        if any(frame.name == "data" for frame in msg["cond_indep_stack"]):
            msg["scale"] = msg["scale"] * self.scale


def traced(model: Callable, x, y):
    """One run of ``model(x, y)`` traced (no gradients, in a scoped parameter store)."""
    try:
        with torch.no_grad(), pyro.get_param_store().scope():
            return poutine.trace(model).get_trace(x, y)
    except NotImplementedError as err:  # e.g. ImproperUniform: engines draw every site once to find it
        raise ValueError(f"model: a prior cannot be sampled ({err}); every engine draws from the prior to find the "
                         "sites and initialize them, so improper priors are not supported. Use a proper, wide prior "
                         "instead, e.g. dist.Normal(0., 100.).") from None


def is_latent(site: dict) -> bool:
    """Whether a trace site is an unobserved, non-deterministic sample site (what engines infer)."""
    return (site["type"] == "sample"
            and not site["is_observed"]
            and not site_is_subsample(site)
            and not site["infer"].get("_deterministic", False)
            and not site["infer"].get("is_auxiliary", False))


def latent_sites(model: Callable, x, y) -> list[str]:
    """Names of the unobserved, non-deterministic sample sites of one run of ``model(x, y)``."""
    return [name for name, site in traced(model, x, y).nodes.items() if is_latent(site)]


def progress_bar(total: int, desc: str, enabled: bool, position: int | None = None):
    """A tqdm bar (a no-op when ``enabled`` is False); ``position``: its terminal line, for bars drawn
    side by side by several processes (parallel MCMC chains)."""
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True, position=position)


def clean_config(config: dict) -> dict:
    """A JSON-friendly copy of an engine's configuration (callables and objects as their repr; dicts of such
    values, e.g. ``config["validation"]``, kept as dicts)."""
    def clean(v):
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: clean(u) for k, u in v.items()}
        return repr(v)

    return {k: clean(v) for k, v in config.items()}


def init_strategy(model, init):
    """Pyro init strategy for one chain's resolved ``init=`` (see :mod:`bnn_pyro.infer._init`, whose
    ``chain_start`` turns ``"reset"`` into a dict of values): ``"net"`` (a BNN's current weights; a prior
    draw for a Pyro function), ``"prior"``, ``"median"``, a dict of site values, or a ``Posterior`` (its
    mean; its chain-0 deterministic values for sites it did not sample). Sites without a value (hyper and
    noise sites) start at their prior median."""
    median = init_fns.init_to_median(num_samples=15)
    if hasattr(init, "samples") and hasattr(init, "point"):  # a Posterior (bnn_pyro.posterior imports this module's users)
        values = {k: v[0] for k, v in init.point.items()}
        values.update({k: v.mean((0, 1)) for k, v in init.samples.items()})
        return init_fns.init_to_value(values=values, fallback=median)
    if isinstance(init, dict):
        return init_fns.init_to_value(values=init, fallback=median)
    if init == "net" and isinstance(model, BNN):
        return init_fns.init_to_value(values={n: model.init_values[n] for n in model.sample_names}, fallback=median)
    if init in ("net", "prior"):
        return init_fns.init_to_sample
    if init == "median":
        return median
    raise ValueError(f"init: unknown value {init!r}; choose 'reset', 'net', 'prior', 'median', a dict of site values, "
                     "or a Posterior (e.g. of an SVI or MAP fit).")


def point_values(model, x, y, dataset_size: int | None) -> dict[str, torch.Tensor]:
    """Deterministic parameters after a fit: a BNN's, or a Pyro function's ``pyro.param`` sites."""
    if isinstance(model, BNN):
        return {k: v.clone() for k, v in model.point_values().items()}
    with torch.no_grad(), poutine.trace(param_only=True) as capture:
        call_model(model, x, y, dataset_size)
    return {name: site["value"].detach().clone() for name, site in capture.trace.nodes.items()}


# ---------------------------------------------------------------------- validation off, NaN-safe
class _NoValidation(poutine.messenger.Messenger):
    """Switch argument validation off for distributions that were built with it (a ``BNN``'s
    ``PyroSample`` priors), so that a NaN from a diverging trajectory gives a NaN potential energy
    (a rejected, divergent proposal) instead of a ``ValueError``."""

    def _pyro_sample(self, msg):
        msg["fn"] = unvalidated(msg["fn"])


def unvalidated(d):
    if not validates_args(d) and not hasattr(d, "base_dist"):
        return d
    d = copy.copy(d)
    set_validates_args(d, False)
    if hasattr(d, "base_dist"):
        d.base_dist = unvalidated(d.base_dist)
    return d


def quiet_model(model, dataset_size):
    """``model(x, y)`` with minibatch scaling and argument validation off (NaN-safe potentials)."""

    def run(x, y):
        with pyro.validation_enabled(False), _NoValidation():
            return call_model(model, x, y, dataset_size)

    return run


@contextlib.contextmanager
def torch_threads(num: int | None):
    """Run the block with ``num`` torch intra-op threads (``None``: leave the setting alone)."""
    before = torch.get_num_threads()
    if num is not None:
        torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def global_rng_kept():
    """Run the block and then restore the global random states of torch (CPU), numpy and Python.

    The engines seed those generators (``pyro.set_rng_seed``) for their own draws; the caller's
    random streams continue afterwards as if no fit had run."""
    import random

    import numpy as np

    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
