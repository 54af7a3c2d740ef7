"""A fitted Gaussian autoguide's flat unconstrained coordinates and the model's log density over them, with its
derivatives at many points: what the Newton gap (:mod:`bnn_pyro.infer.svi_gap`) and the refinement of a full-rank
guide (:mod:`bnn_pyro.infer.svi_refine`) share.

:func:`guide_target` builds the potential at the guide's own median and reads the guide's mean and covariance over
the same coordinates, in the guide's order (the order of ``AutoMultivariateNormal``'s ``loc``). :func:`derivatives`
evaluates ``log p``, its gradient and, where asked, its Hessian at each row of a ``(n, dim)`` tensor in one batched
pass (``torch.func.vmap``, :data:`VMAP_CHUNK` rows at a time). Where that pass cannot batch the model (a ``float()``
of a latent value, random draws of its own), ``log p`` and its gradient are evaluated one row at a time, with the same
numbers; Hessians are not (:class:`NotBatchable` is raised): one row's Hessian by autograd costs ``dim`` reverse
passes through the traced model, and the refinement's up to 30 evaluations of 1,000 rows would run 30,000 of them
one after another (minutes, where the batched pass takes a fraction of the fit; review 11). :class:`NotBatchable` is
kept for vmap's own refusals (:func:`vmap_refused`): any other error of the batched pass with Hessians is the model's
(a ``ValueError`` it raises, a Cholesky factor that fails at some draw) and is raised as it is, so that the caller's
reason names it rather than vmap (review 12). A row where ``log p`` is not finite gets NaN derivatives, so that a
caller sees it rather than a stale value. Every result is free of autograd graphs (a model's ``pyro.param`` values
require grad; its derivatives here are data).

:func:`hessian_products` gives the expected Hessian's products with a few vectors, ``mean_i hess log p(z_i) V``,
without a dense Hessian (one batched reverse-over-reverse pass per draw and vector, the same vmap rules as Hessians:
:class:`NotBatchable` where vmap refuses); :func:`guide_factors` reads a mean-field, low-rank or full-rank guide's
``S = diag(D) + W W^T`` as factors (a full-rank guide's: ``D = 0``, ``W`` its Cholesky factor) (the conjugate-gradient gap of :mod:`bnn_pyro.infer.svi_gap_cg` and the mean's
Newton step of :mod:`bnn_pyro.infer.svi_refine_cg`).

Example
-------
>>> target = guide_target(guide, model, data)        # None where the guide is not covered
>>> d = derivatives(target.pot, target.order, target.loc[None].to(target.dtype), hessians=True)
>>> d.values, d.grads, d.hessians                     # (n,), (n, dim), (n, dim, dim)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import pyro
import torch
from pyro.distributions import constraints
from pyro.distributions.transforms import biject_to
from pyro.infer import autoguide

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential

__all__ = [
    "VMAP_CHUNK",
    "GuideTarget",
    "NoDensity",
    "NotBatchable",
    "VMAP_MESSAGES",
    "Derivatives",
    "guide_target",
    "guide_gaussian",
    "derivatives",
    "guide_factors",
    "hessian_products",
    "labels",
    "unconstrained_size",
    "vmap_refused",
]

VMAP_CHUNK = 250
"""Rows per batched pass of :func:`derivatives`: bounds the memory of one pass at ``250 x`` one evaluation's (times
``dim`` with Hessians)."""

_MODEL_ERRORS = (ValueError, RuntimeError, TypeError, NotImplementedError)

VMAP_MESSAGES = ("vmap", "Batching rule not implemented", "doesn't have storage")
"""The markers of ``torch.func.vmap``'s own refusals (all ``RuntimeError``; torch 2.13's messages, from the strings in
``libtorch_cpu`` and its ``torch/_functorch``): ``"vmap: It looks like you're either (1) calling .item() on a Tensor or
(2) attempting to use a Tensor in some data-dependent control flow ..."`` (``float()`` or a Python ``if`` on a
latent value), ``"vmap: called random operation while in randomness error mode ..."``, ``"vmap: We do not support
batching operators that can output dynamic shape ..."`` (``nonzero``, ``unique``, a boolean mask), ``"vmap over
torch.allclose isn't supported yet"``, ``"... This is not supported inside of vmap ..."`` (``as_strided``),
``"Batching rule not implemented for <op>. We could not generate a fallback."`` and, where a batched tensor reaches
raw memory (``.numpy()``, ``.tolist()``), ``"Cannot access data pointer of Tensor that doesn't have storage"``. Why
by message: vmap raises a plain ``RuntimeError``, the type a model's own failure has too (a ``LinAlgError`` from a
Cholesky factor, a shape mismatch), and only vmap's refusals say that row by row the model would run. An unbatchable
in-place write into an unbatched tensor surfaces as a plain shape error and is reported as the model's
(``tests/infer/test_guide_density.py`` checks each marked refusal against this torch)."""


class NoDensity(Exception):
    """:func:`guide_target` could not build the log density at the guide's median; the message says why."""


class NotBatchable(Exception):
    """:func:`derivatives` was asked for Hessians of a model that ``torch.func.vmap`` cannot batch (module docstring:
    row by row they cost too much); the message carries vmap's error."""


@dataclass(frozen=True)
class GuideTarget:
    """The guide's Gaussian over its flat unconstrained coordinates (``loc``, ``cov``: float64 on the guide's device)
    and the model's potential over the same coordinates (sites ``order``, float ``dtype``); ``labels`` names them.
    Built ``factored`` (:func:`guide_target`), ``cov`` is ``None`` and ``S = diag(diag) + factor factor^T``."""

    pot: Potential
    order: list[str]
    loc: torch.Tensor
    cov: torch.Tensor | None
    labels: list[str]
    dtype: torch.dtype
    diag: torch.Tensor | None = None
    factor: torch.Tensor | None = None


class Derivatives(NamedTuple):
    """``log p`` (``(n,)``), its gradient (``(n, dim)``) and its Hessian (``(n, dim, dim)``, or ``None`` where not
    asked) at each row."""

    values: torch.Tensor
    grads: torch.Tensor
    hessians: torch.Tensor | None


def guide_target(guide, model, data: Data, *, factored: bool = False) -> GuideTarget | None:
    """The :class:`GuideTarget` of a fitted Gaussian autoguide of ``model`` on ``data`` (full batch), or ``None`` where
    the guide is not a Gaussian autoguide over exactly the potential's sites (``factored``: read as factors by
    :func:`guide_factors`, without the dense covariance). Raises :class:`NoDensity` where the potential
    cannot be built at the guide's median (a diagnostic's caller records the reason and goes on)."""
    try:
        pot = Potential(model, data, init=guide.median(*data.first()), fast_path=False)
    except _MODEL_ERRORS as error:
        raise NoDensity(f"the log density could not be evaluated at the guide's median ({error})") from error
    order = [
        name
        for name, site in guide.prototype_trace.iter_stochastic_nodes()
        if not site["is_observed"] and name in pot.shapes
    ]
    if sorted(order) != sorted(pot.shapes):
        return None
    dtype = next(iter(pot.init.values())).dtype
    if factored:
        factors = guide_factors(guide, order, pot.shapes)
        if factors is None:
            return None
        loc, diag, factor = factors
        return GuideTarget(pot, order, loc, None, labels(guide, order, pot.shapes), dtype, diag, factor)
    gaussian = guide_gaussian(guide, order, pot.shapes)
    if gaussian is None:
        return None
    return GuideTarget(pot, order, *gaussian, labels(guide, order, pot.shapes), dtype)


def guide_gaussian(guide, order: list[str], shapes: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The guide's mean and covariance over the flat unconstrained coordinates of the sites ``order`` (each of
    ``shapes[site]``), or ``None`` for a guide that is not a Gaussian autoguide (``AutoNormal``,
    ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal``) or whose coordinates are not exactly those sites'
    (a guide site the potential lacks would shift every slice)."""
    size = sum(math.prod(shapes[s]) for s in order)
    with torch.no_grad():
        if isinstance(guide, (autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal)):
            q = guide.get_posterior()
            if q.loc.numel() != size:
                return None
            return q.loc.detach().double(), q.covariance_matrix.detach().double()
        if isinstance(guide, autoguide.AutoNormal):
            locs = [attrgetter(site)(guide.locs).detach().reshape(-1) for site in order]  # a dotted name nests
            scales = [attrgetter(site)(guide.scales).detach().reshape(-1) for site in order]
            if sum(v.numel() for v in locs) != size:
                return None
            return torch.cat(locs).double(), torch.diag(torch.cat(scales).double() ** 2)
    return None


def derivatives(
    pot: Potential, order: list[str], z: torch.Tensor, *, hessians: bool = False, chunk_size: int = VMAP_CHUNK
) -> Derivatives:
    """``log p``, ``grad log p`` and (``hessians=True``) ``hess log p`` at each row of ``z`` (``(n, dim)``, the sites
    ``order`` flat, in ``z``'s dtype and device): batched passes of ``chunk_size`` rows, or, without Hessians, row by
    row where the batched pass fails (module docstring). With Hessians: raises :class:`NotBatchable` where vmap
    refuses to batch the model (:func:`vmap_refused`), and any other error of the batched pass as it is (the model's
    own); without: what the model raises where the row-by-row pass cannot evaluate it either."""

    log_density = _flat_log_density(pot, order)

    def grad_twice(flat):
        grad, value = torch.func.grad_and_value(log_density)(flat)
        return grad, (grad, value)

    def second(flat):
        hess, (grad, value) = torch.func.jacrev(grad_twice, has_aux=True)(flat)
        return value, grad, hess

    def first(flat):
        grad, value = torch.func.grad_and_value(log_density)(flat)
        return value, grad

    # no graph to the model's pyro.param values (torch.func's transforms differentiate inside no_grad): the results
    # are data, and a graph would keep every pass's saved tensors alive in whatever holds them (review 14)
    with pyro.validation_enabled(False), torch.no_grad():  # validation's data-dependent checks cannot be batched
        try:
            out = torch.func.vmap(second if hessians else first, chunk_size=chunk_size)(z)
            return Derivatives(*out) if hessians else Derivatives(*out, None)
        except _MODEL_ERRORS as error:
            if hessians and vmap_refused(error):
                raise NotBatchable(
                    f"torch.func.vmap cannot batch the model ({type(error).__name__}: {error})"
                ) from error
            if hessians:
                raise  # the model's own error (at some row, batched or not): the caller records it
    return _row_by_row(log_density, z)


def hessian_products(
    pot: Potential, order: list[str], z: torch.Tensor, vectors: torch.Tensor, *, chunk_size: int = VMAP_CHUNK
) -> torch.Tensor:
    """``mean_i hess log p(z_i) @ vectors`` over the rows of ``z`` (``(n, dim)``, in the potential's dtype) for
    ``vectors`` (``(dim, k)``): ``(dim, k)`` in ``z``'s dtype, from ``n x k`` Hessian-vector products (reverse over
    reverse, ``torch.func.vmap`` over the rows, ``chunk_size`` rows per pass, and over the vectors) without forming a
    Hessian. Raises :class:`NotBatchable` where vmap refuses to batch the model (row by row the products would cost
    ``n x k`` traced passes per product: :func:`derivatives`' rule for Hessians), and the model's own errors as they
    are."""
    log_density = _flat_log_density(pot, order)

    def product(flat, vector):
        return torch.func.grad(lambda point: torch.dot(torch.func.grad(log_density)(point), vector))(flat)

    def row(flat):
        return torch.func.vmap(product, in_dims=(None, 1), out_dims=1)(flat, vectors.to(z.dtype))

    with pyro.validation_enabled(False), torch.no_grad():  # as in derivatives: batched, and no graph kept
        try:
            out = torch.func.vmap(row, chunk_size=chunk_size)(z)
        except _MODEL_ERRORS as error:
            if vmap_refused(error):
                raise NotBatchable(
                    f"torch.func.vmap cannot batch the model ({type(error).__name__}: {error})"
                ) from error
            raise
    return out.mean(0)


def _flat_log_density(pot: Potential, order: list[str]):
    """``log p`` as a function of the flat coordinates of the sites ``order`` (in that order)."""

    def log_density(flat):
        sites, k = {}, 0
        for name in order:
            n = math.prod(pot.shapes[name])
            sites[name] = flat[k : k + n].reshape(pot.shapes[name])
            k += n
        return -pot(sites)

    return log_density


def guide_factors(guide, order: list[str], shapes: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A mean-field (``AutoNormal``), low-rank (``AutoLowRankMultivariateNormal``) or full-rank
    (``AutoMultivariateNormal``) guide's mean ``m`` and covariance ``S = diag(D) + W W^T`` over the flat coordinates of
    the sites ``order`` (each of ``shapes[site]``), without forming ``S``: ``(m, D, W)`` in float64 on the guide's device
    (``W`` is ``(dim, 0)`` for a mean-field guide; for a full-rank guide ``D`` is zero and ``W`` its lower-triangular
    ``scale_tril`` ``L``, ``S = L L^T``, so that draws ``W v`` are exact and the conjugate-gradient path serves it too),
    or ``None`` for another guide or where the guide's coordinates are not exactly those sites'."""
    size = sum(math.prod(shapes[s]) for s in order)
    with torch.no_grad():
        if isinstance(guide, (autoguide.AutoLowRankMultivariateNormal, autoguide.AutoMultivariateNormal)):
            q = guide.get_posterior()
            if q.loc.numel() != size:
                return None
            if isinstance(guide, autoguide.AutoMultivariateNormal):
                tril = q.scale_tril.detach().double()
                return q.loc.detach().double(), tril.new_zeros(size), tril
            return q.loc.detach().double(), q.cov_diag.detach().double(), q.cov_factor.detach().double()
        if isinstance(guide, autoguide.AutoNormal):
            locs = [attrgetter(site)(guide.locs).detach().reshape(-1) for site in order]  # a dotted name nests
            scales = [attrgetter(site)(guide.scales).detach().reshape(-1) for site in order]
            if sum(v.numel() for v in locs) != size:
                return None
            loc = torch.cat(locs).double()
            return loc, torch.cat(scales).double() ** 2, loc.new_zeros((size, 0))
    return None


def unconstrained_size(sites: dict) -> int:
    """The number of unconstrained coordinates of the latent ``sites`` (a trace's nodes): what a Gaussian autoguide
    fits and :func:`guide_target` flattens, ``biject_to(support).inv(value)``'s size per site, which is smaller than
    the value's for a site such as ``LKJCholesky(10)`` (45 of 100) or a simplex (one fewer). A discrete site counts
    none (no Gaussian guide covers it: it is enumerated or guided by hand, e.g. under REINFORCE), and a support
    without a bijection its elements (the count only chooses a diagnostic's path: it must not fail a fit)."""
    total = 0
    for site in sites.values():
        support = site["fn"].support
        if support.is_discrete:
            continue
        try:
            total += int(biject_to(support).inv(site["value"]).numel())
        except NotImplementedError:
            total += int(site["value"].numel())
    return total


def vmap_refused(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.func.vmap`` refusing to batch the model rather than the model's own error: a
    ``RuntimeError`` carrying one of :data:`VMAP_MESSAGES`."""
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in VMAP_MESSAGES)


def _row_by_row(log_density, z: torch.Tensor) -> Derivatives:
    values = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    grads = torch.full_like(z, math.nan)
    for i in range(z.shape[0]):
        with torch.enable_grad():
            flat = z[i].detach().requires_grad_()
            value = log_density(flat)
            values[i] = value.detach()
            if bool(torch.isfinite(value)):
                (grad,) = torch.autograd.grad(value, flat)
                grads[i] = grad.detach()
    return Derivatives(values, grads, None)


def labels(guide, order: list[str], shapes: dict) -> list[str]:
    """One label per flat coordinate: ``name[j]`` (``name`` for a scalar site); a site the guide transforms to the real
    line (a positive scale: its log; a simplex: stick-breaking coordinates) is marked ``(unconstrained)``, since those
    coordinates are not the constrained values ``post.summary()`` shows."""
    out = []
    for name in order:
        n = math.prod(shapes[name])
        support = guide.prototype_trace.nodes[name]["fn"].support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        tag = "" if support is constraints.real else " (unconstrained)"
        scalar = n == 1 and len(shapes[name]) == 0
        out += [f"{name}{tag}"] if scalar else [f"{name}[{j}]{tag}" for j in range(n)]
    return out
