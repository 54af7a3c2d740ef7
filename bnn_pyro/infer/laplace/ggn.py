"""Curvature backend: the generalized Gauss-Newton ``sum_i J_i^T Lambda_i J_i`` of a ``BNN``.

The weights' part comes from the layers (:mod:`.layerwise`: one backward pass per output, no per-example
``vmap(jacrev)``) when every covered weight sits in an ``nn.Linear`` / ``nn.Conv2d`` layer, else from
``vmap(jacrev)`` through the net (:func:`.functional.output_jacobian`); both give the same matrix
(tests/infer/test_laplace_layerwise.py)."""

from __future__ import annotations

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace import layerwise
from bnn_pyro.infer.laplace.approximation import CHUNK
from bnn_pyro.infer.laplace.functional import (
    epoch,
    hessian_sqrt,
    nll,
    output_hessians,
    output_jacobian,
    psd,
    second_derivative,
    site_values,
)
from bnn_pyro.infer.laplace.structure import Layout, add_block, zeros
from bnn_pyro.model import BNN


def ggn(
    model: BNN, pot: Potential, z, data: Data, layout: Layout, diag: bool, *, layerwise_path: bool = True
) -> torch.Tensor:
    """``sum_i J_i^T Lambda_i J_i`` on the covered weights, plus the exact Hessian of ``-log p(y | f*, noise)``
    on the covered noise coordinates. ``layerwise_path=False`` forces the general ``vmap(jacrev)`` path."""
    w_idx, n_idx = layout.indices(model.sample_names), layout.indices(model.likelihood.sites())
    weights, noise = site_values(model, pot, z)
    hess_lambda = lambda_fn(model, noise)
    out = model.output_dim(data.first()[0][:1])
    hess = None
    if len(w_idx) and layerwise_path:
        hess = layerwise.gram(
            model,
            pot,
            z,
            data,
            layout,
            diag,  # hessian_sqrt projects onto PSD itself
            lambda f, y: hessian_sqrt(model, f, y, noise),
            out,
        )
    weights_done = hess is not None or not len(w_idx)
    hess = zeros(layout, diag) if hess is None else hess

    def nll_noise(zn, f, y):
        return nll(model, f, y, site_values(model, pot, z.index_copy(0, n_idx, zn))[1])

    for xb, yb in epoch(data, max(1, CHUNK // max(1, out * (1 if weights_done else len(w_idx))))):
        if not weights_done:
            f, jac = output_jacobian(model, pot, z, xb, w_idx)  # (B, out), (B, out, w)
            lam = hess_lambda(f, yb)
            lam_jac = torch.einsum("bop,bpw->bow", lam, jac)
            block = (jac * lam_jac).sum((0, 1)) if diag else jac.flatten(0, 1).T @ lam_jac.flatten(0, 1)
            add_block(hess, block, layout.where[w_idx], diag)
        elif len(n_idx):
            with torch.no_grad():
                f = model.forward_draws(weights, xb)
        if len(n_idx):
            block = second_derivative(nll_noise)(z[n_idx], f, yb).double()
            add_block(hess, block.diagonal() if diag else block, layout.where[n_idx], diag)
    return hess


def lambda_fn(model: BNN, noise):
    """``(f, y) -> Lambda``: the Hessians ``(B, out, out)`` of ``-log p(y_i | f_i)`` in ``f_i`` (float64),
    projected onto the positive semi-definite matrices."""

    def hess(f, y):
        lam = output_hessians(model, f, y, noise)
        return lam.clamp(min=0.0) if lam.shape[-1] == 1 else psd(lam)

    return hess
