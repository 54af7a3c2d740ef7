"""Small functions the curvature backends share: passes over the data in chunks, a ``BNN``'s site values at a
flat vector, its negative log-likelihood, second derivatives, and the projection onto PSD matrices."""

from __future__ import annotations

import pyro
import torch
from torch.func import grad, jacrev, vmap

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.model import BNN


def epoch(data: Data, rows: int):
    """One pass over the data in chunks of at most ``rows`` rows."""
    source = (
        [(data.x, data.y)]
        if data.loader is None
        else (data.convert(xb, yb) if data.convert is not None else (xb, yb) for xb, yb in data.loader)
    )
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
    the same values, faster on these few outputs per datum (measured:
    ``benchmarks/results/docstring_figures/results.md``), and without forward-mode AD, whose first use
    imports torch's JVP decompositions and with them 18 calls of the deprecated ``torch.jit.script``."""
    return jacrev(jacrev(fn))


def output_hessians(model: BNN, f: torch.Tensor, y, noise) -> torch.Tensor:
    """``Lambda_i``, the Hessians ``(B, out, out)`` of ``-log p(y_i | f_i)`` in ``f_i`` for outputs ``f`` ``(B, out)``
    (float64). The rows are independent, so the Hessian of the batch's summed loss is block-diagonal in the rows
    and one backward pass per output gives every row's block: ``out`` passes instead of the ``B`` (vmapped)
    per-row Hessians of :func:`second_derivative`, with the same values (tests/infer/test_laplace_layerwise.py)."""
    if not rows_separate(model, f, y, noise):
        return vmap(second_derivative(lambda fi, yi: nll(model, fi[None], yi[None], noise)))(f, y).double()
    f = f.detach().requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(nll(model, f, y, noise), f, create_graph=True)
        cols = []
        for c in range(f.shape[1]):
            h = (
                torch.autograd.grad(g[:, c].sum(), f, retain_graph=True, allow_unused=True)[0]
                if g.requires_grad
                else None
            )
            cols.append(torch.zeros_like(f) if h is None else h)
    return torch.stack(cols, 1).detach().double()


def output_gradients(model: BNN, f: torch.Tensor, y, noise) -> torch.Tensor:
    """The gradients ``(B, out)`` of ``-log p(y_i | f_i)`` in ``f_i`` (float64), from the batch's summed loss where
    its rows are separate (:func:`rows_separate`), else one row at a time (vmapped)."""
    if not rows_separate(model, f, y, noise):
        return vmap(grad(lambda fi, yi: nll(model, fi[None], yi[None], noise)))(f, y).double()
    f = f.detach().requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(nll(model, f, y, noise), f)
    return g.double()


def rows_separate(model: BNN, f: torch.Tensor, y, noise) -> bool:
    """Whether the batch's log-likelihood terms are its rows' own (outputs ``(B, out)``, and as many terms as ``B``
    single rows give; not, e.g., a ``(B, 1)`` target broadcast against ``(B,)`` outputs into ``B x B`` terms)."""
    if f.dim() != 2:
        return False
    with torch.no_grad(), pyro.validation_enabled(False):
        dist = model.likelihood.distribution
        return dist(f, noise).log_prob(y).numel() == f.shape[0] * dist(f[:1], noise).log_prob(y[:1]).numel()


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


def hessian_sqrt(model: BNN, f: torch.Tensor, y, noise) -> torch.Tensor:
    """A square root ``L`` ``(B, out, k)`` with ``L L^T = Lambda_i``, the output Hessians (:func:`output_hessians`)
    projected onto the PSD matrices. Where ``Lambda_i`` is the softmax Hessian ``diag(p) - p p^T`` at
    ``p = softmax(f_i)`` (a ``Categorical`` likelihood; :func:`is_softmax_hessian`), its Cholesky factor in closed
    form (:func:`softmax_cholesky`) without its zero last column (``k = out - 1``: one backward pass fewer per batch,
    no output Hessians, no batched eigendecomposition); otherwise :func:`psd_sqrt` (``k = out``)."""
    if is_softmax_hessian(model, f, y, noise):
        return softmax_cholesky(torch.softmax(f.detach().double(), -1))[..., :-1]
    return psd_sqrt(output_hessians(model, f, y, noise))


def is_softmax_hessian(model: BNN, f: torch.Tensor, y, noise) -> bool:
    """Whether the Hessian of ``-log p(y_i | f_i)`` in ``f_i`` is ``diag(p_i) - p_i p_i^T``, ``p_i = softmax(f_i)``,
    for every row (``f`` ``(B, out)``, ``out > 1``, rows separate): checked by one Hessian-vector product per row
    with a Gaussian vector ``v_i`` (fixed seed), to the rounding of ``f``'s dtype. Symmetric matrices that differ
    agree along ``v_i`` only on a proper subspace, which a Gaussian draw misses with probability 1."""
    if f.dim() != 2 or f.shape[-1] < 2 or not rows_separate(model, f, y, noise):
        return False
    v = torch.randn(f.shape, generator=torch.Generator().manual_seed(0), dtype=f.dtype).to(f.device)
    fr = f.detach().requires_grad_()
    with torch.enable_grad():
        (g,) = torch.autograd.grad(nll(model, fr, y, noise), fr, create_graph=True)
        if not g.requires_grad:  # a loss linear in f
            return False
        (hv,) = torch.autograd.grad((g * v).sum(), fr, allow_unused=True)
    if hv is None:
        return False
    p, v = torch.softmax(f.detach().double(), -1), v.double()
    pv = p * v
    expected = pv - p * pv.sum(-1, keepdim=True)
    tol = 16 * torch.finfo(f.dtype).eps * v.abs().sum(-1, keepdim=True)
    return bool(((hv.double() - expected).abs() <= tol).all())


def softmax_cholesky(p: torch.Tensor) -> torch.Tensor:
    """The lower-triangular ``L`` ``(B, K, K)`` with ``L L^T = diag(p) - p p^T`` for probability vectors ``p``
    ``(B, K)``: with the tail masses ``r_j = sum_{k >= j} p_k`` (summed from the end, no cancellation),
    ``L_jj = sqrt(p_j r_{j+1} / r_j)`` and ``L_ij = -p_i sqrt(p_j / (r_j r_{j+1}))`` for ``i > j``; the last column
    is zero."""
    r = p.flip(-1).cumsum(-1).flip(-1)
    r_next = torch.cat([r[:, 1:], torch.zeros_like(r[:, :1])], -1)
    tiny = torch.finfo(p.dtype).tiny
    diagonal = torch.where(r > 0, p * r_next / r.clamp(min=tiny), 0.0).sqrt()
    scale = torch.where(r_next > 0, p / (r * r_next).clamp(min=tiny), 0.0).sqrt()
    return torch.tril(-p[:, :, None] * scale[:, None, :], -1) + torch.diag_embed(diagonal)


def output_jacobian(model: BNN, pot: Potential, z, x, w_idx) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, J)`` at the flat unconstrained ``z``: the network outputs ``(B, out)`` and their per-example
    Jacobian ``(B, out, w)`` in the coordinates ``w_idx`` (float64), by ``jacrev`` per row, batched by ``vmap`` or
    looped (:func:`per_row`)."""
    weights = site_values(model, pot, z)[0]

    def f_one(zw, xi):
        return model.forward_draws(site_values(model, pot, z.index_copy(0, w_idx, zw))[0], xi[None])[0]

    with torch.no_grad():
        f = model.forward_draws(weights, x)
    return f, per_row(jacrev(f_one), model)(z[w_idx], x).double()


def per_row(fn, model: BNN):
    """``fn(shared, *rows)`` over the rows (dim 0) of ``rows``: batched by ``vmap``, or, for a net whose forward
    reads values (:attr:`~bnn_pyro.model.BNN.reads_values`: a branch vmap cannot batch), a loop over the rows
    stacked (vmap's values, slower). Each row is its own forward, so a branch decided for a whole batch (e.g. on
    ``h.sum()``) may be decided otherwise for one row: such a net's Jacobians are then another function's
    (docs/guide/models.md)."""
    if not model.reads_values:
        return lambda shared, *rows: vmap(fn, in_dims=(None,) + (0,) * len(rows))(shared, *rows)
    return lambda shared, *rows: torch.stack([fn(shared, *(r[i] for r in rows)) for i in range(len(rows[0]))])
