"""Inference engines, assembled from one registry: ``bp.fit(model, x, y, method=..., **config)``.

Each method family lives in its own module with the same shape: data and configuration in,
:class:`~bnn_pyro.Posterior` out. Adding an engine means adding a module and one registry entry, a
:class:`~bnn_pyro.infer.contract.Declaration` of its capabilities: ``bp.fit`` checks option names against
the engine's declared configuration and the data against its capabilities before fitting.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch

from bnn_pyro.infer._common import Data, check_observed_shapes, global_rng_kept, torch_threads, traced
from bnn_pyro.infer._health import check_noise_collapse, check_targets
from bnn_pyro.infer.checkpoint_folder import guard
from bnn_pyro.infer.declaration import Capabilities, Declaration
from bnn_pyro.infer.health_mixing import check_chains_agree
from bnn_pyro.infer.health_spread import check_typical
from bnn_pyro.infer.registry import REGISTRY, Method
from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN, check_model_data
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, feature_names, flag, owned, positive_int
from bnn_pyro.utils.checks import seed as checked_seed

__all__ = ["fit", "Method", "REGISTRY", "Capabilities", "Declaration", "engine", "options", "unfit_reason"]


_FIT_OPTIONS = ("batch_size", "dataset_size", "num_threads")  # bp.fit's own keywords, for every method


def _check_plain_rows(model: BNN, x, kind: Method) -> None:
    shape = model.output_shape(x)
    why = (
        "x is a tuple or dict of tensors"
        if isinstance(x, Inputs)
        else f"the net returns sequence outputs (N, {', '.join(map(str, shape))})"
        if len(shape) > 1
        else "torch.func.vmap cannot batch the net (recurrent layers, nn.RNN/LSTM/GRU, or a forward whose vmap failed)"
        if not model.vmappable and not model.reads_values  # those loop over rows (laplace.functional.per_row)
        else None
    )
    if why is not None:
        raise ValueError(
            f"method={kind.value!r}: it takes per-example Jacobians of (N, out) outputs of one "
            f"input tensor, batched by torch.func.vmap, but {why}. Use svi, nuts, hmc, metropolis, sgld, "
            "sghmc, csgmcmc, swa, swag or ensemble, which take such models (docs/guide/models.md: 'Sequence and "
            "embedding models')."
        )


def _check_stream(kind: Method) -> None:
    """A one-shot iterator of batches: refused, naming the methods that take one, unless ``kind`` consumes it."""
    can = REGISTRY[kind].capabilities
    if can.one_shot:
        return
    takers = ", ".join(m.value for m in Method if REGISTRY[m].capabilities.one_shot)
    why = (
        "goes over the data more than once (fit, then curvature or statistics)"
        if can.multi_pass
        else "needs the full data set at every step"
    )
    raise ValueError(
        f"x: method={kind.value!r} {why}, but a one-shot iterator or generator gives its batches only "
        "once. "
        + (
            "Pass a re-iterable source (a DataLoader, an IterableDataset, an object whose "
            "__iter__ starts a new pass), or use "
            if can.multi_pass
            else "Pass the data as tensors x, y, or use "
        )
        + f"a method that takes a stream: {takers}."
    )


def unfit_reason(method: str | Method, model, x) -> str | None:
    """Why ``method`` cannot fit ``model`` on inputs ``x`` (a batch of rows), from its declared capabilities, or
    ``None`` when its declaration allows it (the fit itself may still refuse a setting, e.g. a prior). Used to pick
    the methods that apply to a model (``bp.compare(methods=None)``).

    Example
    -------
    >>> [m.value for m in Method if unfit_reason(m, model, x) is None]
    """
    kind = choice("method", method, Method)
    can = REGISTRY[kind].capabilities
    if can.layers and not isinstance(model, BNN):
        return f"method={kind.value!r} acts on the nn.Linear/nn.Conv layers of a bp.BNN; a Pyro function model has none"
    if can.weight_sites and not isinstance(model, BNN):
        return (
            f"method={kind.value!r} spans its subspace by the weight sites of a bp.BNN; a Pyro function model has none"
        )
    if can.jacobian_rows and isinstance(model, BNN):
        try:
            _check_plain_rows(model, x, kind)
        except ValueError as err:
            return str(err)
    return None


def engine(method: str | Method) -> Callable[..., Posterior]:
    """The fitting function registered for ``method``: ``engine_fn(model, data: Data, **config) -> Posterior``."""
    return REGISTRY[choice("method", method, Method)].fit_function()


def options(method: str | Method) -> dict[str, object]:
    """The keyword options ``bp.fit(..., method=method)`` takes, with their defaults, read from the engine's
    declared configuration (e.g. ``options("swag")``: ``{"batch_size": None, ..., "swag_rank": 20, ...}``): exactly
    those, so ``batch_size`` and ``dataset_size`` (minibatches, loaders) only for a method that takes minibatches.
    Renamed options' old names (:func:`~bnn_pyro.infer.contract.entry`'s ``RENAMED``) are taken but not listed."""
    kind = choice("method", method, Method)
    top = inspect.signature(fit).parameters
    own = [k for k in _FIT_OPTIONS if REGISTRY[kind].capabilities.minibatches or k == "num_threads"]
    return {**{k: top[k].default for k in own}, **REGISTRY[kind].options()}


def fit(
    model,
    x,
    y=None,
    *,
    method: str = "svi",
    batch_size: int | None = None,
    dataset_size: int | None = None,
    num_threads: int | None = 1,
    **config,
) -> Posterior:
    """Fit ``model`` to data with the engine named by ``method`` and return a :class:`Posterior`.

    Parameters
    ----------
    model:
        A :class:`~bnn_pyro.BNN`, or a Pyro function ``model(x, y=None)`` that follows the site
        conventions (observations ``"obs"`` inside ``pyro.plate("data", ...)``).
    x, y:
        Inputs ``(N, ...)`` and targets (tensors, numpy arrays or pandas objects), or ``x`` a
        ``torch.utils.data.DataLoader``, an ``IterableDataset`` yielding ``(x, y)`` batches, or any
        iterable of batches (a generator too: data larger than memory) with ``y=None`` and
        ``dataset_size`` (the number of rows the batches are drawn from) given. A re-iterable source is
        gone through again every epoch; a one-shot iterator (generator) is consumed once, in order,
        and an error says so if it runs out before the fit ends. The fitted ``Posterior`` then holds
        no training data (``post.x is None``).
    method:
        The engine: one of :class:`Method` (``"svi"``, ...). Its options go in ``**config``; see
        the engine's module (e.g. :func:`bnn_pyro.infer.svi.fit`).
    batch_size:
        Minibatch size (random reshuffling every epoch); the full data by default.
    num_threads:
        Torch intra-op threads during the fit (restored afterwards). One by default: a typical BNN's
        steps are small tensors dominated by Python overhead, where extra OpenMP threads only contend
        for the cores. ``None`` keeps torch's setting (large nets, many idle cores). MCMC chains in
        worker processes always use one thread each.

    Example
    -------
    >>> post = bp.fit(model, x, y, method="svi", guide="full_rank", num_steps=2000, seed=0)
    """
    kind = choice("method", method, Method)
    example = "bp.BNN(net, prior=bp.priors.Normal(0., 1.), likelihood=bp.likelihoods.Gaussian(scale=0.1))"
    if isinstance(model, torch.nn.Module) and not isinstance(model, BNN):
        raise TypeError(
            f"model: got the plain torch module {type(model).__name__}, which has no prior or likelihood; "
            f"make it a Bayesian model first: model = {example}, with net your module."
        )
    if not (isinstance(model, BNN) or callable(model)):
        raise TypeError(
            f"model: expected a bnn_pyro.BNN or a Pyro function model(x, y=None), got {type(model).__name__}; "
            f"pass e.g. {example}."
        )
    for name, check in (("seed", lambda v: checked_seed("seed", v)), ("progress", lambda v: flag("progress", v))):
        if name in config:
            config[name] = check(config[name])
    _check_resume(config.get("resume", False))
    if isinstance(config.get("resume"), np.bool_):  # numpy's True: a plain bool for the engines' `is True` tests
        config["resume"] = bool(config["resume"])
    known, declared = options(kind), REGISTRY[kind]
    for key in config:
        if key not in known and key not in declared.refused():
            module, name = declared.module, declared.function
            takers = [m.value for m in Method if m is not kind and key in options(m)]
            # another method's option is no misspelling: 'num_steps' for nuts is not 'num_threads'
            close = [] if takers else difflib.get_close_matches(key, list(known), n=1)
            raise TypeError(
                f"{key}: not an option of method={kind.value!r}; drop it"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + (f", use a method that takes it ({', '.join(takers)})" if takers else "")
                + f", or see help(bnn_pyro.infer.{module}.{name}) for the options."
            )
    names = feature_names(x)  # a DataFrame's columns: predict finds them by name
    data = _data(model, x, y, batch_size, dataset_size, kind)
    if data.one_shot:
        _check_stream(kind)
    if isinstance(model, BNN) and declared.capabilities.jacobian_rows:
        _check_plain_rows(model, data.first()[0], kind)
    check_targets(model, data.y)  # raw-unit targets under a too-small fixed noise: said before a long fit
    folder = config.get("checkpoint")  # one writer per folder, and its checkpoints' model and data checked
    held = (
        nullcontext() if folder is None else guard(folder, model=model, data=data, resume=config.get("resume", False))
    )
    with torch_threads(None if num_threads is None else positive_int("num_threads", num_threads)), global_rng_kept():
        if not isinstance(model, BNN):
            check_observed_shapes(traced(model, *data.first()))  # one run: priors it cannot draw, y's shape
        with held:
            post = engine(kind)(model, data, **config)
        if not isinstance(model, BNN) and not declared.capabilities.markov_chain:
            check_chains_agree(check_typical(post))  # approximations and point fits of a Pyro function
        post.feature_names = names
        return check_noise_collapse(post)  # any engine: a learned noise that absorbs the targets' signal


def _check_resume(resume) -> None:
    """``resume=`` is True/False (continue from the ``checkpoint=`` files) or a Posterior to extend; a truthy
    string or number read as True by one part of the fit and as False by another (the folder's guard)."""
    if isinstance(resume, (bool, np.bool_, Posterior)):
        return
    raise ValueError(  # the MCMC engines' own error for it was a ValueError too
        f"resume: expected True or False (continue from the checkpoint= files), or a Posterior of nuts or hmc to "
        f"extend, got {type(resume).__name__} {resume!r}; pass resume=True or resume=False."
    )


def _data(model, x, y, batch_size, dataset_size, kind: Method) -> Data:
    if batch_size is not None:
        batch_size = positive_int("batch_size", batch_size)
    if isinstance(x, torch.utils.data.DataLoader) or (
        hasattr(x, "__iter__") and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict))
    ):
        if y is not None:
            raise ValueError("y: pass y=None when x is a DataLoader of (x, y) batches.")
        size = dataset_size
        if size is None and hasattr(getattr(x, "dataset", None), "__len__"):
            size = len(x.dataset)
        if size is None:
            raise ValueError("dataset_size: required when x is an iterable of batches without a dataset length.")
        data = Data(
            x=None,
            y=None,
            loader=x,
            dataset_size=positive_int("dataset_size", size),
            convert=lambda xb, yb: _checked(model, xb, yb),
        )
        data.batch_size = data.first()[0].shape[0]
        return data
    if y is None:
        raise ValueError(
            f"y: {kind.value} fits the model to targets, but y is None; pass them, as in "
            f"bp.fit(model, x, y, method={kind.value!r}), or x as a DataLoader of (x, y) batches."
        )
    given = (x, y)
    x, y = _checked(model, x, y)
    x, y = owned(x, given[0]), owned(y, given[1])  # the posterior keeps them: never the user's memory
    if dataset_size is not None:
        raise ValueError("dataset_size: only for DataLoader input; with tensors the size is len(x).")
    return Data(x=x, y=y, batch_size=batch_size, convert=lambda xb, yb: _checked(model, xb, yb))  # held-out pairs


def _checked(model, x, y):
    if y is None:  # only a loader's batch gets here without y
        raise ValueError(
            "x: a batch of the loader holds no targets (its y is None); make every batch an (x, y) pair "
            "of tensors, e.g. a DataLoader over TensorDataset(x, y)."
        )
    x, y = check_model_data(model, x, y)
    # training data are constants of the fit: a tensor that requires grad (another net's output) would make
    # the engines' in-place and out= kernels fail ("dot(): functions with out=... don't support autograd")
    x = x.map(lambda _, t: t.detach()) if isinstance(x, Inputs) else x.detach()
    return x, y.detach()
