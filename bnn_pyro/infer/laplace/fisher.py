"""Curvature backend: the empirical Fisher ``sum_i g_i g_i^T`` (a ``BNN``: per-example gradients from the layers,
:mod:`.layerwise`, where every covered coordinate is a Linear / Conv2d weight, else by ``grad`` per row, batched
by ``vmap`` or looped for a net that reads values (:func:`.functional.per_row`); a Pyro
function one traced example at a time)."""

from __future__ import annotations

import torch
from torch.func import grad

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import layerwise
from bnn_pyro.infer.laplace.approximation import CHUNK
from bnn_pyro.infer.laplace.functional import epoch, nll, output_gradients, per_row, site_values
from bnn_pyro.infer.laplace.structure import Layout, zeros
from bnn_pyro.model import BNN


def fisher(
    model: BNN, pot: Potential, z, data: Data, layout: Layout, diag: bool, *, layerwise_path: bool = True
) -> torch.Tensor:
    """Empirical Fisher ``sum_i g_i g_i^T``: per-example gradients from the layers when every covered coordinate
    is a weight of a Linear / Conv2d layer (``layerwise_path=False`` forces the general path), else by ``grad``
    per row (:func:`.functional.per_row`)."""
    active = layout.active
    if layerwise_path and len(layout.indices(model.sample_names)) == len(active):
        noise = site_values(model, pot, z)[1]
        hess = layerwise.gram(
            model,
            pot,
            z,
            data,
            layout,
            diag,
            lambda f, y: output_gradients(model, f, y, noise)[..., None],
            model.output_dim(data.first()[0][:1]),
        )
        if hess is not None:
            return hess

    def loglik(za, xi, yi):
        weights, noise = site_values(model, pot, z.index_copy(0, active, za))
        return -nll(model, model.forward_draws(weights, xi[None]), yi[None], noise)

    hess = zeros(layout, diag)
    for xb, yb in epoch(data, max(1, CHUNK // len(active))):
        g = per_row(grad(loglik), model)(z[active], xb, yb).double()
        hess += (g**2).sum(0) if diag else g.T @ g
    return hess


def fisher_traced(pot: Potential, zr, grad_prior, data: Data, layout: Layout, diag: bool) -> torch.Tensor:
    """Empirical Fisher of a Pyro function model, one traced example at a time:
    ``grad log p(y_i | z) = -(grad U({i}) - grad U_prior) / N`` (``grad_prior`` on the covered coordinates)."""
    hess = zeros(layout, diag)
    for xb, yb in epoch(data, 1):
        (gu,) = torch.autograd.grad(pot(pot.unflatten(zr), (xb, yb)), zr)
        g = -(gu[layout.active].double() - grad_prior.double()) / data.size
        hess += g**2 if diag else torch.outer(g, g)
    return hess
