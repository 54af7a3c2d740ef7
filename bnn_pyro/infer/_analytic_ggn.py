"""Laplace's curvature step on the analytic potential (:mod:`bnn_pyro.infer._analytic`) in one pass over the data:
the Gaussian likelihood's value, its gradient and the diagonal of its generalized Gauss-Newton matrix in the weights.

For a stack of ``nn.Linear`` layers and elementwise activations, ``f = net(x; w)`` with ``out`` outputs and
``-log p(y | f) = |f - y|^2 / (2 sigma^2) + N out (log sigma + log(2 pi) / 2)``, the GGN is
``sum_i J_i^T J_i / sigma^2``. One forward pass keeps each layer's input ``a``; a backward pass from the unit output
direction ``e_o`` gives each layer's output gradient ``G_o`` (``(N, out_l)``, row ``i``: ``d f_io / d s_i`` for the
layer's output ``s = W a + b``), and per layer

    diag GGN_W = (sum_o G_o^2)^T a^2 / sigma^2,    grad_W = (sum_o G_o (f_o - y_o))^T a / sigma^2

(a bias: ``a = 1``). The loss gradient thus comes from the curvature's own backward passes: the potential's gradient
pass would repeat the forward pass and a backward pass. This is :func:`bnn_pyro.infer.laplace.layerwise.gram`'s
diagonal for a Gaussian likelihood (there through autograd and hooks on any Linear/Conv2d net), and the squared
sums are taken in float64 as there; tests/infer/test_analytic_ggn.py checks it against that path and the potential.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer._analytic import StackPotential
from bnn_pyro.infer._analytic_ops import Layer, affine
from bnn_pyro.likelihoods import HALF_LOG_2PI

__all__ = ["likelihood_diagonal"]


def likelihood_diagonal(pot: StackPotential, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """``(value, grad, diag)`` of ``-log p(y | x, theta)`` summed over the rows of ``(x, y)`` (no ``dataset_size``
    scaling) at the flat unconstrained ``theta`` ``(D,)``: the value a float, its gradient ``(D,)`` in ``theta``'s
    dtype and its GGN diagonal ``(D,)`` in float64, both zero at a learned noise site (whose value ``theta`` holds:
    the noise is a hyperparameter here) and at the sites before the first random layer."""
    ops, first = pot._ops, pot._first_random
    y = y.reshape(x.shape[0], -1).to(theta.dtype)
    h, saved = x, []
    for op in ops:  # forward, keeping each layer's input and weight, each activation's input and output
        if isinstance(op, Layer):
            w = pot._param(theta, op.weight, ())
            saved.append((h, w))
            h = affine(h, w, pot._param(theta, op.bias, ()))
        else:
            a, h = h, op.forward(h)
            saved.append((a, h))
    r = h - y
    if pot._noise is None:
        log_sigma = math.log(pot._fixed_scale)
    else:  # sigma: z; precision: -z / 2
        _, index, per_z, _, _ = pot._noise
        log_sigma = float(theta[index]) * per_z
    inv_var = math.exp(-2.0 * log_sigma)
    value = 0.5 * inv_var * float(torch.dot(r.reshape(-1), r.reshape(-1))) + r.numel() * (log_sigma + HALF_LOG_2PI)
    squares, weighted = {}, {}  # layer index -> sum_o G_o^2, sum_o G_o r_o
    for o in range(r.shape[1]):
        delta = torch.zeros_like(r)
        delta[:, o] = 1.0
        for i in range(len(ops) - 1, first - 1, -1):
            op = ops[i]
            if not isinstance(op, Layer):
                delta = op.backward(delta, *saved[i])
                continue
            if i in squares:
                squares[i].addcmul_(delta, delta)
                weighted[i].addcmul_(delta, r[:, o : o + 1])
            else:
                squares[i], weighted[i] = delta * delta, delta * r[:, o : o + 1]
            if i > first:
                delta = delta @ saved[i][1]
    grad = torch.zeros_like(theta)
    diag = torch.zeros(theta.shape, dtype=torch.float64, device=theta.device)
    for i, sq in squares.items():
        a, op, sq = saved[i][0], ops[i], sq.double()  # each float64 copy made once
        if isinstance(op.weight, str):
            start, stop, _ = pot._slots[op.weight]
            torch.mm(sq.T, _squared64(a), out=diag[start:stop].view(-1, a.shape[1]))
            torch.mm(weighted[i].T, a, out=grad[start:stop].view(-1, a.shape[1]))
        if isinstance(op.bias, str):
            start, stop, _ = pot._slots[op.bias]
            torch.sum(sq, 0, out=diag[start:stop])
            torch.sum(weighted[i], 0, out=grad[start:stop])
    return value, grad.mul_(inv_var), diag.mul_(inv_var)


def _squared64(a: torch.Tensor) -> torch.Tensor:
    """``a^2`` in float64: a float32 ``a``'s float64 copy squared in place (one new tensor); a float64 ``a`` (the data,
    or an activation that the backward pass reads) left as it is."""
    return a.square() if a.dtype == torch.float64 else a.double().square_()
