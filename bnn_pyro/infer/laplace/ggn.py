"""Curvature backend: the generalized Gauss-Newton ``sum_i J_i^T Lambda_i J_i`` of a ``BNN``."""

from __future__ import annotations

import torch
from torch.func import vmap

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.approximation import CHUNK
from bnn_pyro.infer.laplace.functional import epoch, nll, output_jacobian, psd, second_derivative, site_values
from bnn_pyro.infer.laplace.structure import Layout, add_block, zeros
from bnn_pyro.model import BNN


def ggn(model: BNN, pot: Potential, z, data: Data, layout: Layout, diag: bool) -> torch.Tensor:
    """``sum_i J_i^T Lambda_i J_i`` on the covered weights, plus the exact Hessian of ``-log p(y | f*, noise)``
    on the covered noise coordinates."""
    w_idx, n_idx = layout.indices(model.sample_names), layout.indices(model.likelihood.sites())
    hess = zeros(layout, diag)
    weights, noise = site_values(model, pot, z)

    def nll_noise(zn, f, y):
        return nll(model, f, y, site_values(model, pot, z.index_copy(0, n_idx, zn))[1])

    out = model.output_dim(data.first()[0])
    for xb, yb in epoch(data, max(1, CHUNK // max(1, out * len(w_idx)))):
        if len(w_idx):
            f, jac = output_jacobian(model, pot, z, xb, w_idx)  # (B, out), (B, out, w)
            lam = vmap(second_derivative(lambda fi, yi: nll(model, fi[None], yi[None], noise)))(f, yb).double()
            lam = lam.clamp(min=0.0) if out == 1 else psd(lam)
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


