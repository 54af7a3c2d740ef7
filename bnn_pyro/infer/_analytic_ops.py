"""The pieces of the analytic fast path (:mod:`bnn_pyro.infer._analytic`) that its potential, ELBO and GGN share: a
layer of the stack (:class:`Layer`) and its affine map, each covered activation's forward and backward (ATen's own
derivative kernels, the formulas autograd runs), and the score ``d log p(v) / d log v`` of each covered prior on a
learned noise scale or precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "NOISE_PRIORS", "Layer", "activation", "affine"]

_aten = torch.ops.aten


class Layer(NamedTuple):
    """A layer of the stack: ``h @ weight^T + bias``."""

    weight: str | torch.Tensor  # a site name (a slot of theta), or a constant
    bias: str | torch.Tensor | None


def affine(h, w, b):
    """``h @ w^T + b`` for ``h`` ``(N, in)`` or ``(B, N, in)`` and ``w`` ``(out, in)`` or ``(B, out, in)``."""
    if w.dim() == 2 and h.dim() == 2:
        return h @ w.t() if b is None else torch.addmm(b, h, w.t())
    if w.dim() == 3 and b is not None and b.dim() == 2:
        return torch.baddbmm(b.unsqueeze(-2), h, w.mT)
    out = h @ w.mT
    return out if b is None else out + (b.unsqueeze(-2) if b.dim() == 2 else b)


class _Activation(NamedTuple):
    forward: Callable[[torch.Tensor], torch.Tensor]
    # backward(grad wrt output, input, output) -> grad wrt input: ATen's derivative kernels (the formulas
    # autograd uses: derivatives.yaml), one operation each
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # the forward in place, for an activation whose backward reads only its output (the input is not kept)
    inplace: Callable[[torch.Tensor], torch.Tensor] | None = None


def activation(m: nn.Module) -> _Activation | None:
    kind = type(m)
    if kind is nn.Tanh:
        return _Activation(torch.tanh, lambda g, a, h: _aten.tanh_backward(g, h), torch.tanh_)
    if kind is nn.Sigmoid:
        return _Activation(torch.sigmoid, lambda g, a, h: _aten.sigmoid_backward(g, h), torch.sigmoid_)
    if kind is nn.ReLU:
        return _Activation(torch.relu, lambda g, a, h: _aten.threshold_backward(g, h, 0), torch.relu_)
    if kind is nn.LeakyReLU:
        slope = m.negative_slope
        return _Activation(
            lambda a: F.leaky_relu(a, slope), lambda g, a, h: _aten.leaky_relu_backward(g, a, slope, False)
        )
    if kind is nn.GELU:
        approx = m.approximate
        return _Activation(
            lambda a: F.gelu(a, approximate=approx), lambda g, a, h: _aten.gelu_backward(g, a, approximate=approx)
        )
    if kind is nn.SiLU:
        return _Activation(F.silu, lambda g, a, h: _aten.silu_backward(g, a))
    if kind is nn.Softplus:
        beta, threshold = m.beta, m.threshold
        return _Activation(
            lambda a: F.softplus(a, beta, threshold), lambda g, a, h: _aten.softplus_backward(g, a, beta, threshold)
        )
    if kind is nn.ELU:
        alpha = m.alpha
        return _Activation(lambda a: F.elu(a, alpha), lambda g, a, h: _aten.elu_backward(g, alpha, 1, 1, False, a))
    return None


ACTIVATIONS = (nn.Identity, nn.Tanh, nn.Sigmoid, nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Softplus, nn.ELU)

# d log p(v) / d log v for the noise priors covered (v = sigma or the precision, v = exp(z))
NOISE_PRIORS: dict[str, Callable] = {
    "HalfNormal": lambda d, v: -((v / d.scale) ** 2),
    "HalfCauchy": lambda d, v: -2.0 * v * v / (v * v + d.scale**2),
    "Exponential": lambda d, v: -d.rate * v,
    "Gamma": lambda d, v: (d.concentration - 1.0) - d.rate * v,
    "InverseGamma": lambda d, v: -(d.concentration + 1.0) + d.rate / v,
    "LogNormal": lambda d, v: -(v.log() - d.loc) / d.scale**2 - 1.0,
}
