"""The MCMC kernel interface of the previous release, kept for one release so that an engine written to it runs.

docs/adding_an_engine.md documented ``MCMCConfig.kernel(self, model, chain, model_args)`` returning ``(kernel,
initial_params, transforms)`` (the last two for a kernel built on a potential function; ``None`` otherwise). Since
7e4976c it is ``kernel(self, model, chain)`` returning the kernel alone, whose ``setup(warmup_steps, x, y)`` gets the
data and finds the start and the transforms. An engine still written the old way (found by its signature: it does
not take ``(model, chain)`` alone) runs as before, its ``initial_params`` set before ``setup`` and its
``transforms`` taking precedence after it, and :func:`warn_if_old` says once per fit, in the caller's process (the
chains may run in forked ones), what to write instead. This module goes in the next release.

Usage::

    warn_if_old(config)                                            # bnn_pyro.infer.mcmc.sample, before any chain
    kernel, transforms = build(config, model, settings, (x, y))    # in each chain; transforms: None or the old ones
"""

from __future__ import annotations

import inspect

from bnn_pyro.utils.user_warnings import warn

__all__ = ["is_old", "warn_if_old", "build"]


def is_old(config) -> bool:
    """Whether ``config.kernel`` is the old interface: it cannot be called as ``kernel(model, chain)``, or it takes
    the old ``model_args`` (with a default, it could be: review 22 found such an engine taken for the new one)."""
    signature = inspect.signature(config.kernel)
    if "model_args" in signature.parameters:
        return True
    try:
        signature.bind(None, None)
    except TypeError:
        return True
    return False


def warn_if_old(config) -> None:
    """A ``DeprecationWarning`` at the user's line where ``config``'s engine is written to the old interface."""
    if is_old(config):
        name = type(config).__name__
        warn(
            f"{name}.kernel(model, chain, model_args) returning (kernel, initial_params, transforms) is the MCMC "
            "kernel interface of the previous release; it still runs in this one and will be removed in the next. "
            f"Write {name}.kernel(self, model, chain) returning the kernel alone: its setup(warmup_steps, x, y) gets "
            "the data and sets initial_params and transforms (docs/adding_an_engine.md, 'The kernel protocol').",
            DeprecationWarning,
        )


def build(config, model, settings, model_args: tuple):
    """``(kernel, transforms)``: ``config.kernel(model, settings)`` and ``None``, or, for the old interface, its
    kernel with the ``initial_params`` it returned set (where not ``None``) and the ``transforms`` it returned."""
    if not is_old(config):
        return config.kernel(model, settings), None
    taken = inspect.signature(config.kernel).parameters.get("model_args")
    if taken is not None and taken.kind is inspect.Parameter.KEYWORD_ONLY:
        kernel, params, transforms = config.kernel(model, settings, model_args=model_args)
    else:
        kernel, params, transforms = config.kernel(model, settings, model_args)
    if params is not None:
        kernel.initial_params = params
    return kernel, transforms
