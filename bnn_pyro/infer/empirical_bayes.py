r"""Empirical Bayes for SVI: the weight priors' scales learned by the ELBO (type-II maximum likelihood).

``bp.fit(model, x, y, method="svi", empirical_bayes=True)``.

A prior with a scale, ``w ~ p(w | sigma)`` (Normal, Laplace, StudentT, Cauchy: what
``bp.priors.Normal``, ``LayerwiseNormal``, ``Laplace`` and ``StudentT`` return), gets its scale
multiplied by a learned hyperparameter ``c > 0``: ``sigma = c * sigma_0`` with ``sigma_0`` the
prior's own scale and ``c`` starting at 1. The ELBO is maximized over the guide and ``c`` together,

.. math::

    \max_{q, c} \; \mathbb E_q[\log p(y \mid w)] - \mathrm{KL}(q(w) \,\|\, p(w \mid c\,\sigma_0)),

and since ``ELBO(q, c) <= log p(y | c)`` with equality at the exact posterior, a guide family that
contains the posterior (``guide="full_rank"`` for Bayesian linear regression) makes this exactly
type-II maximum likelihood, ``argmax_c log p(y | c)`` (MacKay 1992, "Bayesian interpolation"; the
evidence framework). With a narrower guide it maximizes a lower bound instead.

``empirical_bayes=True`` (or ``"tensor"``) learns one ``c`` per parameter tensor (one prior scale
per layer's weight and per bias); ``"shared"`` learns one ``c`` for every tensor (keeping the
prior's relative scales, e.g. ``LayerwiseNormal``'s fan-in scaling). The handler
(:class:`LearnedPriorScales`) swaps each weight site's prior for its rescaled copy as the model runs,
so the model itself is untouched. The learned scales ``c * sigma_0`` end up in
``post.config["prior_scales"]`` (site -> one value per chain) and, per step, in
``post.history["prior_scale[<site>]"]``.

Hierarchical priors (``HierarchicalNormal``, ``Horseshoe``) already infer their scales, and priors
without a scale (``ScaleMixtureNormal``) have none to learn: both are refused, as is
``guide="map"`` (a point mass makes the joint maximum over weights and scale degenerate: ``w -> 0``,
``sigma -> 0``, the density without bound).

Example
-------
>>> post = bp.fit(model, x, y, guide="mean_field", empirical_bayes=True, num_steps=3000)
>>> post.config["prior_scales"]        # {"0.weight": [0.41], "0.bias": [1.7], ...}
"""

from __future__ import annotations

from enum import Enum

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints

from bnn_pyro.model import BNN
from bnn_pyro.utils.checks import choice

__all__ = ["Sharing", "LearnedPriorScales", "resolve"]

_FAMILIES = {  # torch family -> rebuild with a new scale (pyro's classes subclass torch's)
    torch.distributions.Normal: lambda d, s: dist.Normal(d.loc, s),
    torch.distributions.Laplace: lambda d, s: dist.Laplace(d.loc, s),
    torch.distributions.StudentT: lambda d, s: dist.StudentT(d.df, d.loc, s),
    torch.distributions.Cauchy: lambda d, s: dist.Cauchy(d.loc, s),
}


class Sharing(str, Enum):
    """Which weights share a learned prior scale."""

    TENSOR = "tensor"  # one per parameter tensor (empirical_bayes=True)
    SHARED = "shared"  # one multiplier for every tensor


def resolve(empirical_bayes) -> Sharing | None:
    """``empirical_bayes=`` as a :class:`Sharing` (``None`` when off)."""
    if empirical_bayes is False or empirical_bayes is None:
        return None
    if empirical_bayes is True:
        return Sharing.TENSOR
    if not isinstance(empirical_bayes, (str, Sharing)):
        raise TypeError(f"empirical_bayes: expected True, False, 'tensor' or 'shared', got {empirical_bayes!r}.")
    return choice("empirical_bayes", empirical_bayes, Sharing)


class LearnedPriorScales(poutine.messenger.Messenger):
    """Around the model: every Bayesian weight site's prior gets its scale multiplied by a
    ``pyro.param`` (positive, initially 1); see the module docstring. Use as ``handler(model)``.

    Parameters
    ----------
    model:
        The ``BNN`` (its sites are checked here: each needs a non-hierarchical prior with a scale
        that is the same for every entry of the tensor).
    x, y, dataset_size:
        One batch to trace the model with (to read the priors).
    sharing:
        :class:`Sharing`.
    """

    def __init__(self, model, x, y, dataset_size: int | None, sharing: Sharing):
        super().__init__()
        if not isinstance(model, BNN):
            raise ValueError(
                f"empirical_bayes: needs a bp.BNN, whose weight sites and priors are known; got a "
                f"{type(model).__name__}. In a Pyro function model, make the prior scale a "
                "pyro.param(..., constraint=constraints.positive) yourself: SVI learns it."
            )
        self.sharing = sharing
        self.base_scales = _base_scales(model, x, y, dataset_size)
        self._multipliers: dict[str, torch.Tensor] = {}
        self.history: dict[str, torch.Tensor] = {}  # "prior_scale[<site>]" -> per-step learned scale

    def param_name(self, site: str) -> str:
        return "prior_scale" if self.sharing is Sharing.SHARED else f"prior_scale[{site}]"

    def __enter__(self):
        one = torch.tensor(1.0)
        self._multipliers = {
            s: pyro.param(self.param_name(s), one, constraint=constraints.positive) for s in self.base_scales
        }
        return super().__enter__()

    def _pyro_sample(self, msg):
        c = self._multipliers.get(msg["name"])
        if c is not None and not msg["is_observed"]:
            msg["fn"] = _rescaled(msg["fn"], c)

    def record(self, step: int, num_steps: int) -> None:
        """Store the current scales as step ``step`` of :attr:`history` (called after each SVI step)."""
        for site, value in self.scales().items():
            self.history.setdefault(f"prior_scale[{site}]", torch.empty(num_steps))[step] = value

    @torch.no_grad()
    def scales(self) -> dict[str, float]:
        """The current learned prior scale of every site, ``c * sigma_0`` (read from the param store)."""
        return {s: float(pyro.param(self.param_name(s))) * s0 for s, s0 in self.base_scales.items()}


def _rescaled(fn, c: torch.Tensor):
    dims = []
    while isinstance(fn, torch.distributions.Independent):
        dims.append(fn.reinterpreted_batch_ndims)
        fn = fn.base_dist
    new = _FAMILIES[_family(fn)](fn, fn.scale * c)
    for k in reversed(dims):
        new = new.to_event(k)
    return new


def _family(d):
    return next((f for f in _FAMILIES if isinstance(d, f)), None)


def _base_scales(model: BNN, x, y, dataset_size) -> dict[str, float]:
    """Each Bayesian site's prior scale, or a clear error why it has none to learn."""
    with torch.no_grad(), pyro.get_param_store().scope():
        trace = poutine.trace(model).get_trace(x, y, dataset_size=dataset_size)
    scales = {}
    for name in model.sample_names:
        hyper = [h for h in model.hyper_names if h.startswith(f"{name}_")]
        if hyper:
            raise ValueError(
                f"empirical_bayes: the prior of {name!r} is hierarchical (hyper sites {hyper}), so its "
                "scale is already inferred. Use empirical_bayes=False, or a non-hierarchical prior "
                "such as bp.priors.Normal."
            )
        fn = trace.nodes[name]["fn"]
        while isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        if _family(fn) is None:
            raise ValueError(
                f"empirical_bayes: the prior of {name!r} is {type(fn).__name__}, which has no scale to "
                "learn. Use a prior with one (bp.priors.Normal, LayerwiseNormal, Laplace, StudentT), "
                "or empirical_bayes=False."
            )
        scale = fn.scale.reshape(-1)
        if not torch.all(scale == scale[0]):
            raise ValueError(
                f"empirical_bayes: the prior scale of {name!r} varies within the tensor; it learns one "
                "scale per tensor. Use a prior with one scale per tensor, or empirical_bayes=False."
            )
        scales[name] = float(scale[0])
    return scales
