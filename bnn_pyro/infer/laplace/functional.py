"""Small functions the curvature backends share: passes over the data in chunks, a ``BNN``'s site values at a
flat vector, its negative log-likelihood, second derivatives, and the projection onto PSD matrices."""

from __future__ import annotations

import pyro
import torch
from torch.func import jacrev, vmap

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.model import BNN


def epoch(data: Data, rows: int):
    """One pass over the data in chunks of at most ``rows`` rows."""
    source = [(data.x, data.y)] if data.loader is None else (
        data.convert(xb, yb) if data.convert is not None else (xb, yb) for xb, yb in data.loader)
    for xb, yb in source:
        for i in range(0, xb.shape[0], rows):
            yield xb[i : i + rows], yb[i : i + rows]


def site_values(model: BNN, pot: Potential, flat):
    """A BNN's weights and likelihood noise values at the flat unconstrained vector ``flat``."""
    values = pot.constrain(pot.unflatten(flat))
    return {n: values[n] for n in model.sample_names}, {n: values[n] for n in model.likelihood.sites()}


def nll(model: BNN, f, y, noise):
    with pyro.validation_enabled(False):  # no data-dependent checks inside vmap
        return -model.likelihood.distribution(f, noise).log_prob(y).sum()


def second_derivative(fn):
    """``torch.func.hessian(fn)`` (in the first argument) as reverse-over-reverse ``jacrev(jacrev(fn))``:
    the same values, faster on these few outputs per datum (measured: 2.1 against 6.6 ms for 80 Gaussian
    points, 2.3 against 4.8 ms for 200 three-class points), and without forward-mode AD, whose first use
    imports torch's JVP decompositions and with them 18 calls of the deprecated ``torch.jit.script``."""
    return jacrev(jacrev(fn))


def psd(mat: torch.Tensor) -> torch.Tensor:
    """The nearest positive semi-definite matrices (negative eigenvalues set to zero)."""
    vals, vecs = torch.linalg.eigh(mat)
    return (vecs * vals.clamp(min=0.0).unsqueeze(-2)) @ vecs.transpose(-1, -2)


def psd_sqrt(mat: torch.Tensor) -> torch.Tensor:
    """A square root ``L`` with ``L L^T = mat`` of the nearest PSD matrices (batched; symmetric)."""
    if mat.shape[-1] == 1:
        return mat.clamp(min=0.0).sqrt()
    vals, vecs = torch.linalg.eigh(mat)
    return (vecs * vals.clamp(min=0.0).sqrt().unsqueeze(-2)) @ vecs.transpose(-1, -2)


def output_jacobian(model: BNN, pot: Potential, z, x, w_idx) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, J)`` at the flat unconstrained ``z``: the network outputs ``(B, out)`` and their per-example
    Jacobian ``(B, out, w)`` in the coordinates ``w_idx`` (float64), by ``vmap(jacrev)``."""
    weights = site_values(model, pot, z)[0]

    def f_one(zw, xi):
        return model.forward_draws(site_values(model, pot, z.index_copy(0, w_idx, zw))[0], xi[None])[0]

    with torch.no_grad():
        f = model.forward_draws(weights, x)
    return f, vmap(jacrev(f_one), in_dims=(None, 0))(z[w_idx], x).double()
