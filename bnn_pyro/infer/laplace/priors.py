"""Prior rewriting for a prior precision ``delta``: the covered Normal priors become ``Normal(loc, delta^-1/2)``."""

from __future__ import annotations

from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from bnn_pyro.infer._common import Data, call_model
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import factorized
from bnn_pyro.infer.laplace.approximation import PriorPrecision
from bnn_pyro.infer.laplace.structure import Layout
from bnn_pyro.model import BNN


class Rewrite(poutine.messenger.Messenger):
    """Chosen sites get ``Normal(loc, scale)`` priors; ``observed=False`` masks the observations out
    (the potential is then the prior part of ``U``)."""

    def __init__(self, scales: dict[str, torch.Tensor], locs: dict[str, torch.Tensor], observed: bool):
        super().__init__()
        self.scales, self.locs, self.observed = scales, locs, observed

    def _pyro_sample(self, msg):
        if msg["is_observed"]:
            if not self.observed:
                msg["mask"] = False
        elif msg["name"] in self.scales:
            loc, event_dims = self.locs[msg["name"]], len(msg["fn"].event_shape)
            normal = dist.Normal(loc, self.scales[msg["name"]].expand_as(loc))
            msg["fn"] = normal.to_event(event_dims) if event_dims else normal


@dataclass
class NormalSites:
    """The covered sites with Normal priors (those a ``delta`` replaces)."""

    locs: dict[str, torch.Tensor]
    layer: dict[str, str]  # site -> layer: a BNN's module path, or a Pyro function's site
    precision: dict[str, torch.Tensor]  # site -> the model's prior precision per entry

    def groups(self, kind) -> list[str]:
        return sorted(set(self.layer.values())) if kind is PriorPrecision.MARGLIK_LAYERWISE else ["all"]

    def group(self, site: str, delta: dict[str, float]) -> str:
        return "all" if "all" in delta else self.layer[site]

    def initial(self, unit: dict[str, float]) -> dict[str, float]:
        """Mean prior precision of the model per group: where the search starts."""
        return {
            g: float(torch.cat([p.reshape(-1) for s, p in self.precision.items() if self.group(s, unit) == g]).mean())
            for g in unit
        }


def normal_sites(model, pot: Potential, layout: Layout, data: Data) -> NormalSites:
    hyper = model.hyper_names if isinstance(model, BNN) else []
    if hyper:
        raise ValueError(
            f"prior_precision: the model has hyper sites {hyper} (a hierarchical prior), but a prior "
            "precision replaces fixed Normal priors. Use prior_precision='model'."
        )
    x0, y0 = data.first()
    with torch.no_grad(), pyro.get_param_store().scope():
        trace = poutine.trace(call_model).get_trace(model, x0[:1], y0[:1], data.size)
    weights = model.sample_names if isinstance(model, BNN) else None
    locs, layer, precision = {}, {}, {}
    for name in layout.covered(pot.shapes):
        fn = trace.nodes[name]["fn"]
        while hasattr(fn, "base_dist"):
            fn = fn.base_dist
        if not isinstance(fn, torch.distributions.Normal):
            if weights is not None and name in weights:
                raise ValueError(
                    f"prior_precision: the prior of {name!r} is {type(fn).__name__}, not Normal; a prior "
                    "precision (and its marginal-likelihood search) is defined for Normal priors only. "
                    "Use bp.priors.Normal, or prior_precision='model'."
                )
            continue  # e.g. a noise scale: it keeps its prior
        shape = pot.shapes[name]
        locs[name] = fn.loc.detach().expand(shape).clone()
        layer[name] = (name.rpartition(".")[0] or "net") if weights is not None else name
        precision[name] = fn.scale.detach().expand(shape) ** -2
    if not locs:
        raise ValueError(
            "prior_precision: no covered site has a Normal prior, so there is no prior precision to set. "
            "Use prior_precision='model'."
        )
    return NormalSites(locs, layer, precision)


@dataclass
class PriorPart:
    """The prior part of ``U``: a :class:`Potential` of the sites alone (a Pyro function: Pyro's path) and, where the
    prior is factorized Normal, its closed form (:mod:`.factorized`, built once; ``None``: Hessian-vector products)."""

    pot: Potential
    closed: factorized.FactorizedNormal | None


def potentials(
    model, data: Data, base: Potential, z, normal: NormalSites | None, delta: dict[str, float] | None, build=Potential
) -> tuple[Potential, PriorPart]:
    """``U`` and its prior part for ``model`` with its Normal priors at precision ``delta`` (per group;
    ``None``: the model's own priors) at ``z``. ``U`` is made by ``build`` (:class:`Potential` or a
    fit's :class:`~bnn_pyro.infer._potential.Potentials`, which records its path); the prior part, a Pyro function
    of the sites alone (Pyro's path), by :class:`Potential`, with its closed form where there is one."""
    scales = (
        {}
        if delta is None
        else {s: loc.new_tensor(delta[normal.group(s, delta)] ** -0.5) for s, loc in normal.locs.items()}
    )
    locs = {} if normal is None else normal.locs
    with torch.no_grad():
        values = {k: v.detach() for k, v in base.constrain(base.unflatten(z)).items()}

    def rewritten(observed, make):
        handler = Rewrite(scales, locs, observed)

        def run(x, y=None, dataset_size=None):
            with handler:
                return call_model(model, x, y, dataset_size)

        pot = make(run, data, init=values)
        if list(pot.shapes) != list(base.shapes):
            raise RuntimeError(f"laplace: the rewritten model has sites {list(pot.shapes)}, not {list(base.shapes)}.")
        return pot, run

    prior, run = rewritten(False, Potential)
    return (
        (base if delta is None else rewritten(True, build)[0]),
        PriorPart(prior, factorized.build(run, data.first(), data.size, prior, values)),
    )
