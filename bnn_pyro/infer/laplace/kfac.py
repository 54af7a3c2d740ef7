"""Curvature backend of ``structure="kron"``: Kronecker factors of the GGN (or empirical Fisher) per
``nn.Linear`` and ``nn.Conv2d`` layer, from the layer inputs and the output gradients that backpropagation
delivers for a whole batch at once (no per-example Jacobians).

For a Linear layer ``s = W a + b`` and one datum, the GGN block of ``[W, b]`` (row-major) is exactly
``sum_c g_c g_c^T (x) a a^T``, with ``a`` the input (and a 1 for the bias) and ``g_c = (ds f)^T L_c`` the
gradient at ``s`` of the output ``f`` in the direction ``L_c``, column ``c`` of a square root ``L L^T = Lambda``
of the likelihood's Hessian in ``f`` (``I / sigma`` for a Gaussian, the closed-form Cholesky factor of
``diag(p) - p p^T`` for a Categorical, :func:`.functional.hessian_sqrt`; in general by eigendecomposition; the
empirical Fisher uses the gradient of ``-log p(y | f)``
instead, one column). KFAC (Martens & Grosse 2015) replaces the sum over data of these Kronecker products by
the Kronecker product of sums, ``G (x) A / N`` with ``G = sum_i sum_c g g^T``, ``A = sum_i a a^T``. It is the
exact GGN block when one factor is the same for every datum: one datum; or ``G`` constant, as in the output
layer of a Gaussian regression (``g = e_c / sigma``), so a net of one Linear layer with a Gaussian likelihood
gets its exact Hessian. A Conv2d layer is a Linear layer applied to every patch of its input (``F.unfold``);
KFC (Grosse & Martens 2016) also drops the cross terms between locations: ``G (x) A / (N T)`` over the ``T``
output locations, exact for one datum and one location. Cross-layer blocks are dropped.

Covered: the weight and bias sites of every Linear and Conv2d (``groups=1``, zero padding) layer; other sites
stay at the MAP. Each layer may be called once per forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.functional import epoch, hessian_sqrt, output_gradients, site_values
from bnn_pyro.infer.laplace.kron import Kron, KronBlock
from bnn_pyro.model import BNN

ROWS = 512  # data rows per pass


@dataclass
class Layer:
    path: str
    module: nn.Module
    weight: str | None  # site names (None: not Bayesian)
    bias: str | None


def kron_layers(model: BNN, pot: Potential) -> list[Layer]:
    """The Linear and Conv2d layers with Bayesian weights or biases, in module order."""
    out = []
    for path, module in model._template.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        prefix = f"{path}." if path else ""
        weight, bias = (prefix + "weight", prefix + "bias")
        layer = Layer(path, module, weight if weight in pot.shapes else None, bias if bias in pot.shapes else None)
        if layer.weight is None and layer.bias is None:
            continue
        if isinstance(module, nn.Conv2d) and (
            module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            raise ValueError(
                f"structure='kron': Conv2d layer {path!r} has groups={module.groups}, "
                f"padding={module.padding!r}, padding_mode={module.padding_mode!r}; KFAC here supports "
                "groups=1 with numeric zero padding. Use structure='diag' or 'last_layer'."
            )
        out.append(layer)
    if not out:
        raise ValueError(
            "structure='kron': the net has no nn.Linear or nn.Conv2d layer with Bayesian parameters; use "
            "structure='diag' or 'full'."
        )
    return out


def kron_sites(model: BNN, pot: Potential) -> list[str]:
    return [s for layer in kron_layers(model, pot) for s in (layer.weight, layer.bias) if s is not None]


def block_index(layer: Layer, coords: dict[str, torch.Tensor], where: torch.Tensor) -> torch.Tensor:
    """Positions among the covered coordinates, ``(out, in [+ 1 for a bias])``."""
    cols = []
    if layer.weight is not None:
        cols.append(coords[layer.weight].reshape(layer.module.weight.shape[0], -1))
    if layer.bias is not None:
        cols.append(coords[layer.bias].reshape(-1, 1))
    return where[torch.cat(cols, 1)]


class Recorder:
    """Forward hooks that keep each layer's input (as ``(B, T, in)`` patches) and output (in the graph)."""

    def __init__(self, layers: list[Layer]):
        self.layers, self.inputs, self.outputs, self.handles = layers, {}, {}, []

    def __enter__(self):
        for layer in self.layers:
            self.handles.append(layer.module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, layer: Layer):
        def hook(module, args, output):
            if layer.path in self.outputs:
                raise ValueError(
                    f"structure='kron': layer {layer.path!r} is called more than once per forward pass "
                    "(a shared layer); use structure='diag'."
                )
            self.inputs[layer.path] = _patches(layer, args[0].detach())
            self.outputs[layer.path] = output

        return hook

    def gradients(self, f: torch.Tensor, directions: torch.Tensor):
        """Per direction ``c`` (``directions`` ``(B, out, k)``), each layer's output gradient ``(B, T, out_l)``."""
        outs = [self.outputs[layer.path] for layer in self.layers]
        for c in range(directions.shape[-1]):
            grads = torch.autograd.grad(f, outs, grad_outputs=directions[..., c].to(f.dtype), retain_graph=True)
            yield [locations(layer, g.detach()) for layer, g in zip(self.layers, grads)]


def _patches(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    m = layer.module
    if isinstance(m, nn.Conv2d):
        a = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride).transpose(1, 2)
    else:
        a = x.reshape(x.shape[0], -1, x.shape[-1])
    parts = ([a] if layer.weight is not None else []) + ([a.new_ones(a.shape[:2] + (1,))] if layer.bias else [])
    return torch.cat(parts, -1).double()


def locations(layer: Layer, g: torch.Tensor) -> torch.Tensor:
    if isinstance(layer.module, nn.Conv2d):
        return g.flatten(2).transpose(1, 2).double()
    return g.reshape(g.shape[0], -1, g.shape[-1]).double()


def _forward(model: BNN, weights: dict[str, torch.Tensor], x: torch.Tensor, layers: list[Layer]):
    params = {n: w.detach().requires_grad_() for n, w in weights.items()}  # outputs in the graph
    rec = Recorder(layers)
    with rec, torch.enable_grad():
        f = model.forward_draws(params, x)
    return f, rec


def kfac(model: BNN, pot: Potential, z, data: Data, coords, where, size: int, fisher: bool = False) -> Kron:
    """The KFAC approximation of ``sum_i J_i^T Lambda_i J_i`` (``fisher``: of ``sum_i g_i g_i^T``) over the
    covered Linear/Conv2d layers, as a :class:`~.kron.Kron`."""
    layers = kron_layers(model, pot)
    weights, noise = site_values(model, pot, z)
    g_sum, a_sum, count = {}, {}, {}

    for xb, yb in epoch(data, ROWS):
        f, rec = _forward(model, weights, xb, layers)
        fd = f.detach()
        if fisher:
            directions = output_gradients(model, fd, yb, noise)[..., None]
        else:
            directions = hessian_sqrt(model, fd, yb, noise)
        for layer in layers:
            a = rec.inputs[layer.path]
            a_sum[layer.path] = a_sum.get(layer.path, 0.0) + torch.einsum("bti,btj->ij", a, a)
            count[layer.path] = count.get(layer.path, 0) + a.shape[0] * a.shape[1]
        for grads in rec.gradients(f, directions):
            for layer, g in zip(layers, grads):
                g_sum[layer.path] = g_sum.get(layer.path, 0.0) + torch.einsum("bto,btp->op", g, g)
    blocks = [
        KronBlock(
            block_index(layer, coords, where),
            g_sum[layer.path],
            a_sum[layer.path] / count[layer.path],
            name=layer.path or "net",
            bias=layer.weight is not None and layer.bias is not None,
        )
        for layer in layers
    ]
    return Kron(blocks, size)


def layer_jacobians(model: BNN, pot: Potential, z, x: torch.Tensor, coords, where, size: int):
    """``(f, J)``: outputs ``(B, out)`` and their exact per-example Jacobians ``(B, out, size)`` in the covered
    coordinates, assembled from the layer inputs and one backward pass per output (``J = sum_t g_t a_t^T``)."""
    layers = kron_layers(model, pot)
    weights, _ = site_values(model, pot, z)
    f, rec = _forward(model, weights, x, layers)
    out = f.shape[-1]
    eye = torch.eye(out, dtype=torch.float64, device=f.device).expand(f.shape[0], out, out)
    jac = torch.zeros(f.shape[0], out, size, dtype=torch.float64, device=f.device)
    for c, grads in enumerate(rec.gradients(f, eye)):
        for layer, g in zip(layers, grads):
            jac[:, c][:, block_index(layer, coords, where)] = torch.einsum("bto,bti->boi", g, rec.inputs[layer.path])
    return f.detach(), jac
