"""Pieces every engine shares: the latent sites of a model, progress bars, seeds (the training data and its
minibatches: :mod:`bnn_pyro.infer.training_data`, re-exported here as ``Data``)."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import initialization as init_fns
from pyro.poutine.util import site_is_subsample

from bnn_pyro.infer.progress import progress_bar  # noqa: F401 - its former home; engines import it from here
from bnn_pyro.infer.training_data import Data  # noqa: F401 - its former home; engines import it from here
from bnn_pyro.model import BNN
from bnn_pyro.utils.upstream_private import set_validates_args, validates_args

__all__ = [
    "Data",
    "traced",
    "is_latent",
    "latent_sites",
    "call_model",
    "progress_bar",
    "clean_config",
    "init_strategy",
    "point_values",
    "quiet_model",
    "torch_threads",
    "unvalidated",
]


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
        raise ValueError(
            f"model: a prior cannot be sampled ({err}); every engine draws from the prior to find the "
            "sites and initialize them, so improper priors are not supported. Use a proper, wide prior "
            "instead, e.g. dist.Normal(0., 100.)."
        ) from None


def is_latent(site: dict) -> bool:
    """Whether a trace site is an unobserved, non-deterministic sample site (what engines infer)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("_deterministic", False)
        and not site["infer"].get("is_auxiliary", False)
    )


def check_observed_shapes(trace) -> None:
    """Refuse an observed site whose value and distribution broadcast each other to a larger shape, e.g. targets
    ``(N, 1)`` against predictions ``(N,)``: torch then sums an ``(N, N)`` log density, every prediction against every
    target, a wrong likelihood that no engine notices. A value that only broadcasts the distribution (one scalar
    distribution over ``N`` values) or is broadcast by it is left alone."""
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"] or not isinstance(site["value"], torch.Tensor):
            continue
        d = site["fn"]
        own, value = tuple(d.batch_shape + d.event_shape), tuple(site["value"].shape)
        try:
            both = tuple(torch.broadcast_shapes(own, value))
        except RuntimeError:
            continue  # torch's own shape error follows at the first log density
        if both not in (own, value):
            raise ValueError(
                f"y: the model's observed site {name!r} has a distribution shaped {own}, but its value has shape "
                f"{value}; together they broadcast to {both}, which pairs every prediction with every target "
                f"instead of giving one term per observation. Pass y shaped like the site's distribution, e.g. "
                f"y.reshape{own} (y.squeeze(-1) for a column), or give the model's output the shape of y."
            )


def latent_sites(model: Callable, x, y) -> list[str]:
    """Names of the unobserved, non-deterministic sample sites of one run of ``model(x, y)``."""
    return [name for name, site in traced(model, x, y).nodes.items() if is_latent(site)]


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
    if hasattr(init, "samples") and hasattr(
        init, "point"
    ):  # a Posterior (bnn_pyro.posterior imports this module's users)
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
    raise ValueError(
        f"init: unknown value {init!r}; choose 'reset', 'net', 'prior', 'median' ('laplace' too under svi), a dict of site values, "
        "or a Posterior (e.g. of an SVI or MAP fit)."
    )


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
