"""The registry: one :class:`~bnn_pyro.infer.declaration.Declaration` per method, and the :class:`Method` enum built
from it. ``bp.fit`` looks methods up here; every fact about a method (its options, checkpoints, PSIS's Markov-chain
refusal, subspace's inner engines, the health checks) is read from its declaration. Adding an engine: one module and
one line here (``docs/adding_an_engine.md``).
"""

from __future__ import annotations

from dataclasses import replace
from enum import Enum

from bnn_pyro.infer.declaration import Capabilities, Declaration
from bnn_pyro.posterior import psis

__all__ = ["REGISTRY", "Method"]

_STEPS = Capabilities(minibatches=True, one_shot=True)  # a step per batch, one pass over a stream
_POINT_THEN_STATS = Capabilities(minibatches=True, multi_pass=True)  # a fit, then statistics over the data again
_FULL_DATA = Capabilities()  # every step needs the whole data set

_MCMC = replace(_FULL_DATA, checkpoint=True, markov_chain=True, function_model=True)  # the full data at every step
_SG_MCMC = replace(_STEPS, checkpoint=True, markov_chain=True, function_model=True)

# method name -> its declaration: the function under bnn_pyro.infer (imported on first use, so that ``import bnn_pyro``
# stays light and each method family stays in its own module) and its capabilities. One line per method: the
# Method enum, the option lists and every fact about a method (checkpoints, PSIS, subspace's inner engines, health
# checks) are derived from it.
REGISTRY: dict[str, Declaration] = {
    "svi": Declaration("svi", "fit", replace(_STEPS, checkpoint=True, data_parallel=True, function_model=True)),
    "nuts": Declaration("mcmc", "fit_nuts", _MCMC),
    "hmc": Declaration("mcmc", "fit_hmc", _MCMC),
    "metropolis": Declaration("mcmc", "fit_metropolis", replace(_MCMC, accept_reject=True)),
    "mala": Declaration("mala", "fit_mala", replace(_MCMC, accept_reject=True)),
    "sgld": Declaration("sgmcmc", "fit_sgld", _SG_MCMC),
    "sghmc": Declaration("sgmcmc", "fit_sghmc", _SG_MCMC),
    "csgmcmc": Declaration("sgmcmc", "fit_csgmcmc", _SG_MCMC),
    "swa": Declaration("swag", "fit_swa", replace(_POINT_THEN_STATS, checkpoint=True)),
    "swag": Declaration("swag", "fit_swag", replace(_POINT_THEN_STATS, checkpoint=True)),
    "mc_dropout": Declaration("dropout", "fit_mc_dropout", replace(_STEPS, checkpoint=True, layers=True)),
    "variational_dropout": Declaration(
        "variational_dropout", "fit_variational_dropout", replace(_STEPS, checkpoint=True, layers=True)
    ),
    "sparse_vd": Declaration("variational_dropout", "fit_sparse_vd", replace(_STEPS, checkpoint=True, layers=True)),
    "ensemble": Declaration("ensemble", "fit_ensemble", replace(_STEPS, checkpoint=True)),
    "laplace": Declaration("laplace", "fit_laplace", replace(_POINT_THEN_STATS, jacobian_rows=True, checkpoint=True)),
    "snapshot": Declaration("snapshot", "fit_snapshot", replace(_STEPS, checkpoint=True)),
    "subspace": Declaration("subspace", "fit_subspace", replace(_POINT_THEN_STATS, checkpoint=True, weight_sites=True)),
}

Method = Enum("Method", {name.upper(): name for name in REGISTRY}, type=str, module=__name__)
Method.__doc__ = 'The registered methods, one member per :data:`REGISTRY` entry (``Method.NUTS == "nuts"``).'
REGISTRY: dict[Method, Declaration] = {Method(name): declared for name, declared in REGISTRY.items()}


def _is_markov_chain(method: str) -> bool:
    declared = REGISTRY.get(method)
    return declared is not None and declared.capabilities.markov_chain


psis.is_markov_chain = _is_markov_chain  # PSIS's Markov-chain refusal reads the declarations (the posterior layer
# does not import this one)
