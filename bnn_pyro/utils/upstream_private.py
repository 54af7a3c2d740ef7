"""The private API of torch, Pyro and ArviZ that bnn_pyro relies on, in one place.

Each entry says why no public API serves and the versions it was checked against (torch 2.13.0, pyro-ppl
1.9.2, ArviZ 0.23.4). ``tests/test_upstream_private.py`` fails loudly, naming the entry, when an upgrade
removes one. The MCMC kernels (``bnn_pyro.infer._kernels``) read Pyro's per-draw state through its public hooks,
except the one value listed here (:func:`mean_accept_prob`); their checkpoints read Pyro's warm-up and kernel
state (:func:`warmup_adapter_state`, :func:`hmc_state`). ``BNN`` overrides ``nn.Module._apply``,
through which torch routes ``to``, ``double``, ``cuda`` and ``cpu``, to move its initial values and priors
(unregistered state) with the net; no public hook exists for that. Checked by the same test.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager

import torch
from torch import nn

PARETO_MIN_DRAWS = 21
"""The fewest ratios from which ArviZ's Pareto smoothing (``arviz.psislw``, ``az.loo``; ArviZ 0.23.4) estimates a
shape ``k``: it fits the largest ``M = ceil(min(0.2 S, 3 sqrt(S)))`` of ``S`` and needs ``M >= 5`` (``k = inf`` with
fewer, an IndexError with one), so ``S >= 21``: per chain for :func:`bnn_pyro.posterior.psis.psis`, in all for
``az.loo`` (which pools chains). A fact of ArviZ's algorithm both read, kept here beside the other upstream facts
(``tests/posterior/test_psis.py`` and ``test_diagnostics.py`` check it at 20 and 21)."""

__all__ = [
    "PARETO_MIN_DRAWS",
    "reparametrize_module",
    "function_mode_active",
    "global_module_hooks",
    "module_hooks",
    "fan_in_and_fan_out",
    "validates_args",
    "set_validates_args",
    "pyro_context",
    "autoguide_setup",
    "autoguide_loc_scale",
    "elbo_traces",
    "mean_accept_prob",
    "warmup_adapter_state",
    "load_warmup_adapter_state",
    "hmc_state",
    "load_hmc_state",
    "restart_step_size_search",
    "arviz_logger",
    "arviz_log_level",
]


# ------------------------------------------------------------------------------------------------ torch
def reparametrize_module(module: nn.Module, values: dict[str, torch.Tensor]) -> AbstractContextManager:
    """``torch.nn.utils.stateless._reparametrize_module``: run ``module`` with ``values`` in place of its
    parameters and buffers. Why: ``torch.func.functional_call`` (the public wrapper of this context manager)
    refuses to run under ``torch.jit.trace``, which Pyro's ``jit_compile=True`` MCMC uses."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, values)


def function_mode_active() -> bool:
    """Whether a torch function mode is active (``torch.overrides._get_current_function_mode_stack``). Why:
    a mode that intercepts ``F.linear`` must see the ops of ``functional_call``; the batched-matrix fast path
    would bypass it. No public query exists."""
    from torch.overrides import _get_current_function_mode_stack

    return bool(_get_current_function_mode_stack())


def module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (``Module._forward_hooks`` etc.). Why: the
    batched fast path skips ``Module.__call__``, so hooks would silently not run; no public query exists."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def global_module_hooks() -> bool:
    """Whether global module hooks are registered (``torch.nn.modules.module._global_*_hooks``); same why."""
    from torch.nn.modules import module as state

    return bool(
        state._global_forward_hooks
        or state._global_forward_pre_hooks
        or state._global_backward_hooks
        or state._global_backward_pre_hooks
    )


def fan_in_and_fan_out(tensor: torch.Tensor) -> tuple[int, int]:
    """``torch.nn.init._calculate_fan_in_and_fan_out``: a weight's fan-in and fan-out as torch's initializers
    count them (convolution kernels included). Why: the fan-scaled priors (``bnn_pyro.priors``) must match
    torch's own initialization scales; no public function returns the two numbers."""
    from torch.nn.init import _calculate_fan_in_and_fan_out

    return _calculate_fan_in_and_fan_out(tensor)


def validates_args(d: torch.distributions.Distribution) -> bool:
    """``Distribution._validate_args``: whether ``d`` checks its arguments and sample values. Why: a
    distribution keeps the validation setting it was built with (``pyro.enable_validation`` later does not
    change it); rebuilding or copying one must keep it, and no public getter exists."""
    return bool(getattr(d, "_validate_args", False))


def set_validates_args(d: torch.distributions.Distribution, value: bool) -> None:
    """Set ``Distribution._validate_args`` on ``d`` (a copy the caller owns). Why: a BNN's priors are built
    before the fit with validation on; a diverging MCMC trajectory must give a NaN density there, not raise
    (``MCMC(disable_validation=True)`` does not reach them), and no public setter exists."""
    d._validate_args = value


# ------------------------------------------------------------------------------------------------- Pyro
def pyro_context(module) -> AbstractContextManager:
    """``PyroModule._pyro_context``: the context in which a ``PyroModule``'s ``PyroSample`` attributes are
    sampled once per model run and cached. Why: reading every site of a ``BNN`` inside one such context
    gives one draw per site (reading attributes outside it re-samples each read)."""
    return module._pyro_context


def autoguide_setup(guide, *args, **kwargs) -> None:
    """``AutoGuide._setup_prototype(*args, **kwargs)``: build an autoguide's parameters without running it.
    Why: the compiled SVI loss evaluates the guide's ``loc``/``scale`` directly and must create them once
    before the first step; the public path (calling the guide) would also sample."""
    guide._setup_prototype(*args, **kwargs)


def autoguide_loc_scale(guide, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``AutoNormal._get_loc_and_scale(name)``: the unconstrained ``loc`` and positive ``scale`` of one site.
    Why: ``AutoNormal`` has no public per-site accessor (``median``/``quantiles`` give constrained values)."""
    return guide._get_loc_and_scale(name)


def elbo_traces(elbo, model, guide, args, kwargs):
    """``ELBO._get_traces``: the ``(model_trace, guide_trace)`` pairs of one ELBO evaluation with their
    log-densities computed (one vectorized pair, or one per particle). Why: the score-function ELBO
    (``bnn_pyro.infer.score``) needs each site's log-density per particle, exactly as Pyro's ELBOs trace them
    (plates, particle vectorization, scaling); no public API returns the traces."""
    return elbo._get_traces(model, guide, args, kwargs)


def mean_accept_prob(kernel) -> float:
    """``HMC._mean_accept_prob`` (also NUTS): Pyro's running mean of the acceptance probabilities of the draws
    so far (restarted after warm-up). Why: the per-draw acceptance probability (ArviZ's ``acceptance_rate``)
    is a local of ``HMC.sample``/``NUTS.sample``; the public ``logging()`` gives the mean rounded to 3
    digits and ``diagnostics()`` the fraction of accepted draws. ``bnn_pyro.infer._kernels`` recovers each
    draw's value from two consecutive means."""
    return kernel._mean_accept_prob


def warmup_adapter_state(adapter) -> tuple[dict[str, torch.Tensor], dict]:
    """The state of Pyro's ``WarmupAdapter`` mid-warm-up as ``(tensors, JSON meta)``: the step size, the
    adaptation window it is in (``_current_window``), the dual-averaging scheme (``DualAveraging.prox_center``,
    ``_x_avg``, ``_g_avg``, ``_t``), and per mass-matrix block the inverse mass matrix and its Welford
    estimator (``BlockMassMatrix._adapt_scheme``: ``_mean``, ``_m2``, ``n_samples``). Why: checkpointing an
    MCMC chain mid-warm-up (``bnn_pyro.infer.mcmc``) must store the adaptation exactly; Pyro's public surface
    gives only the step size and the inverse mass matrix."""
    meta, tensors = {"step_size": adapter.step_size, "window": adapter._current_window, "blocks": []}, {}
    scheme = getattr(adapter, "_step_size_adapt_scheme", None)  # absent when the step size is not adapted
    meta["dual_averaging"] = (
        None if scheme is None else [scheme.prox_center, float(scheme._x_avg), float(scheme._g_avg), scheme._t]
    )
    masses = adapter.mass_matrix_adapter
    for i, (names, minv) in enumerate(masses.inverse_mass_matrix.items()):
        tensors[f"minv/{i}"] = minv
        welford, block = masses._adapt_scheme.get(names), {"names": list(names)}
        if welford is not None:
            block["n"] = welford.n_samples
            for key in ("_mean", "_m2"):
                value = getattr(welford, key)
                if torch.is_tensor(value):
                    tensors[f"welford/{i}/{key}"] = value
                else:  # 0.0 before the first update
                    block[key] = value
        meta["blocks"].append(block)
    return tensors, meta


def load_warmup_adapter_state(adapter, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore what :func:`warmup_adapter_state` returned into an adapter configured for the same run (the
    inverse mass matrix through Pyro's public setter, which recomputes its square roots and resets the
    Welford estimator, then the estimator's running sums)."""
    masses = adapter.mass_matrix_adapter
    for i, block in enumerate(meta["blocks"]):
        names = tuple(block["names"])
        masses.inverse_mass_matrix = {names: tensors[f"minv/{i}"]}
        if "n" in block:
            welford = masses._adapt_scheme[names]
            welford.n_samples = block["n"]
            for key in ("_mean", "_m2"):  # a copy: Pyro adds to _m2 in place
                value = tensors.get(f"welford/{i}/{key}")
                setattr(welford, key, block.get(key) if value is None else value.clone())
    adapter.step_size, adapter._current_window = meta["step_size"], meta["window"]
    if meta["dual_averaging"] is not None:
        scheme = adapter._step_size_adapt_scheme
        scheme.prox_center, scheme._x_avg, scheme._g_avg, scheme._t = meta["dual_averaging"]


_HMC_COUNTERS = ("_t", "_accept_cnt", "_mean_accept_prob", "_divergences")


def hmc_state(kernel) -> tuple[dict[str, torch.Tensor], dict]:
    """The per-iteration state of Pyro's ``HMC``/``NUTS`` as ``(tensors, JSON meta)``: the cached position,
    potential energy and gradient (``_z_last``, ``_potential_energy_last``, ``_z_grads_last``), the counters
    ``_t``, ``_accept_cnt``, ``_mean_accept_prob``, ``_divergences`` and the adapter
    (:func:`warmup_adapter_state`). Why: as for the adapter; Pyro keeps these private and its ``MCMC`` cannot
    start mid-run."""
    tensors, adapter = warmup_adapter_state(kernel._adapter)
    tensors = {f"adapter/{k}": v for k, v in tensors.items()}
    tensors["potential"] = kernel._potential_energy_last
    tensors.update({f"z/{k}": v for k, v in kernel._z_last.items()})
    tensors.update({f"grad/{k}": v for k, v in kernel._z_grads_last.items()})
    return tensors, {"adapter": adapter, **{k: getattr(kernel, k) for k in _HMC_COUNTERS}}


def load_hmc_state(kernel, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore what :func:`hmc_state` returned into a kernel set up for the same run."""
    load_warmup_adapter_state(
        kernel._adapter, {k[8:]: v for k, v in tensors.items() if k.startswith("adapter/")}, meta["adapter"]
    )
    part = lambda prefix: {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    kernel._cache(part("z/"), tensors["potential"], part("grad/"))
    for key in _HMC_COUNTERS:
        setattr(kernel, key, meta[key])


def restart_step_size_search(kernel, step_size: float, z: dict[str, torch.Tensor]) -> None:
    """Set Pyro's ``HMC``/``NUTS`` step size back to ``step_size`` and rerun its initial step-size search from ``z``
    under the current inverse mass matrix (``WarmupAdapter.reset_step_size_adaptation``: the step doubled or halved
    until one leapfrog step's acceptance crosses 0.8, then dual averaging restarted around 10 times it). Why: Pyro
    searches once, in ``setup``, under the identity metric, and its adapter (``HMC._adapter``) is private; a metric
    set after ``setup`` needs the search rerun, as Pyro itself does after each warm-up window."""
    kernel._adapter.step_size = step_size
    kernel._adapter.reset_step_size_adaptation(z)


# ------------------------------------------------------------------------------------------------ ArviZ
def arviz_logger() -> logging.Logger:
    """ArviZ 0.23 logs through its own ``Logger`` instance ``arviz._log``, not ``logging.getLogger("arviz")``;
    silencing its informational messages (e.g. while summarizing) needs that instance."""
    import arviz

    return getattr(arviz, "_log", None) or logging.getLogger("arviz")


@contextlib.contextmanager
def arviz_log_level(level: int):
    """ArviZ's own log messages below ``level`` silenced inside the block (e.g. its "Shape validation failed"
    line for one chain, which our summaries replace by a note)."""
    logger = arviz_logger()
    old = logger.level
    logger.setLevel(level)
    # ``Logger.isEnabledFor`` caches its answer per level in ``Logger._cache`` (Python 3.7+, checked on 3.11), and
    # ``setLevel`` clears that cache only for the loggers registered with ``logging``'s manager; ``arviz._log`` is
    # constructed directly, so its stale answers would survive both level changes (ArviZ's warnings then stay
    # silenced after the block, or are not silenced inside it)
    logger.__dict__.get("_cache", {}).clear()
    try:
        yield
    finally:
        logger.setLevel(old)
        logger.__dict__.get("_cache", {}).clear()
