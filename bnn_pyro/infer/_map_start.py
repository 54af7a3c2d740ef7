"""Where the Metropolis and MALA chains of a ``BNN`` start at the default ``init``: chain ``c`` at a short MAP fit
from its own layers' initialization.

A ``BNN``'s chains would otherwise start at ``init="reset"``, the layers' ``reset_parameters()`` under the chain's
seed ``seed + c``: far from the posterior's mass, so the warm-up both travels to it and adapts the metric on the
way. Random-walk Metropolis and MALA take small steps (one gradient or none per draw), so part of that transient
stays in the kept draws. The Laplace start of a small Pyro function (:mod:`bnn_pyro.infer._mode_start`) does not
apply (a BNN's posterior is not near-Gaussian at its mode). Instead each chain first runs
:func:`~bnn_pyro.infer.map_fit.fit_map` from its own reset start, seeded ``seed + c``:
:data:`~bnn_pyro.infer.map_fit.POINT_MAP_STEPS` full-batch Adam steps (lr
:data:`~bnn_pyro.infer.map_fit.POINT_MAP_LR`) and an L-BFGS polish of at most
:data:`~bnn_pyro.infer.map_fit.POINT_MAP_POLISH` iterations, the search that sets a BNN's deterministic
parameters before sampling. Each chain ends at the mode its own start descends to, so chains start at different
modes (over-dispersed between modes, as Gelman & Rubin 1992 ask, so that R-hat still sees chains that do not mix);
the warm-up then moves them out into the mass around it and adapts the metric there. The search runs inside the
chain's own process, with the chain's random streams (torch, ``random``, NumPy) restored after it, so the chain
draws what it would draw from any start. ``benchmarks/results/classification/mstart_wine.md`` has the measurement.

Example
-------
>>> values = map_start(fitted, data, "reset", seed=seed + c, method="mala")   # chain c's start (sample sites)
>>> strategy = init_strategy(fitted, values)
"""

from __future__ import annotations

import torch
from pyro.util import get_rng_state, set_rng_state

from bnn_pyro.infer._common import Data
from bnn_pyro.infer.map_fit import POINT_MAP_LR, POINT_MAP_POLISH, POINT_MAP_STEPS, fit_map

__all__ = ["map_start"]


def map_start(fitted, data: Data, init, *, seed: int, method: str) -> dict[str, torch.Tensor]:
    """The start of the chain seeded ``seed``: the constrained values of ``fitted``'s latent sites at the MAP fitted
    from ``init`` (resolved by :func:`~bnn_pyro.infer._init.resolve_init`; ``"reset"``) under ``seed`` (module
    docstring). ``fitted`` is not changed (the search fits its own copy), and the global random streams are as
    they were before the call."""
    state = get_rng_state()
    try:
        fit = fit_map(
            fitted,
            data,
            init=init,
            num_steps=POINT_MAP_STEPS,
            lr=POINT_MAP_LR,
            seed=seed,
            progress=False,
            polish_steps=POINT_MAP_POLISH,
            method=f"{method} start (map)",
        )
    finally:
        set_rng_state(state)
    return dict(fit.sample)
