"""A plain stack of ``nn.Linear`` layers and elementwise activations, evaluated for many weight draws at once by
batched matrix products (``baddbmm``) instead of ``vmap(functional_call)``: used by ``BNN.forward_draws`` for
prediction and for vectorized ELBO particles. Anything else (other modules, hooks, in-place activations, an active
torch function mode) keeps the general path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bnn_pyro.utils.upstream_private import function_mode_active, global_module_hooks, module_hooks

__all__ = ["linear_stack", "run_linear_stack", "runs_per_draw", "site", "PER_DRAW_ELEMENTS"]


_ELEMENTWISE = (
    nn.Identity,
    nn.Tanh,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Softplus,
    nn.Softsign,
    nn.LogSigmoid,
    nn.Tanhshrink,
)


def linear_stack(net: nn.Module) -> list[tuple[str, nn.Module | None]] | None:
    """``[(path, activation module or None for a Linear), ...]`` when ``net`` is a plain ``nn.Sequential``
    (nested ones included) of ``nn.Linear`` layers and parameter-free elementwise activations without
    hooks, or one bare ``nn.Linear`` (path ``""``), else ``None``: then weights batched over draws can run as
    batched matrix products. Parameter names are :func:`site` of a path."""
    layers = []
    if type(net) is nn.Linear:
        plain = not module_hooks(net) and not global_module_hooks() and not function_mode_active()
        return [("", None)] if plain else None

    def walk(module: nn.Module, prefix: str) -> bool:
        # not named_children(): it skips a module registered twice (one Tanh instance after two layers), which
        # Sequential.forward runs twice
        for name, child in module._modules.items():
            if module_hooks(child) or getattr(child, "inplace", False):  # in place: would write into the shared x
                return False
            if type(child) is nn.Sequential:
                if not walk(child, f"{prefix}{name}."):
                    return False
            elif type(child) is nn.Linear or type(child) in _ELEMENTWISE:
                layers.append((f"{prefix}{name}", None if type(child) is nn.Linear else child))
            else:
                return False
        return True

    plain = type(net) is nn.Sequential and not module_hooks(net) and not global_module_hooks()
    # a torch function mode (e.g. one that intercepts F.linear) sees functional_call's ops, not bmm's
    return layers if plain and not function_mode_active() and walk(net, "") and layers else None


def site(path: str, attr: str) -> str:
    """The parameter name of ``attr`` (``"weight"``, ``"bias"``) of the layer at ``path`` (``""``: the net itself)."""
    return f"{path}.{attr}" if path else attr


# in-place forms of common activations, used where no gradient is recorded (prediction): an out-of-place
# activation allocates a fresh block of the chunk's size each time, whose pages are faulted in anew
_IN_PLACE = {
    nn.Tanh: lambda m, h: h.tanh_(),
    nn.Sigmoid: lambda m, h: h.sigmoid_(),
    nn.ReLU: lambda m, h: h.relu_(),
    nn.Identity: lambda m, h: h,
    nn.SiLU: lambda m, h: F.silu(h, inplace=True),
    nn.LeakyReLU: lambda m, h: F.leaky_relu_(h, m.negative_slope),
    nn.ELU: lambda m, h: F.elu_(h, m.alpha),
}


PER_DRAW_ELEMENTS = 2**15
"""Without autograd, the draws run one at a time (``addmm`` per layer into reused buffers) once one draw's widest
layer output over the rows has at least this many elements: a draw's work then outweighs the Python cost of its
few calls, and its buffers are reused draw after draw instead of a batch of draws' outputs being allocated; below
it, batched products (``baddbmm``) amortize the per-call cost over the draws. Batched products were faster at
16,500 elements and one draw at a time from 50,000 (``benchmarks/results/predict/``, the ``rule`` case). A CPU rule:
on an accelerator every call is a kernel launch whose fixed cost no single draw's work outweighs at these sizes,
so there the draws always run batched (:func:`runs_per_draw`)."""


def runs_per_draw(layers, x: torch.Tensor, template: nn.Module) -> bool:
    """Whether :func:`run_linear_stack` (without autograd) evaluates the draws one at a time at inputs ``x``
    (``(N, in)``): on the CPU, where one draw's widest layer output over the rows has at least
    :data:`PER_DRAW_ELEMENTS` elements. Never on another device: there a draw at a time is a few kernel launches
    per draw, and batched products (chunked by :meth:`~bnn_pyro.model.BNN.draws_per_chunk`) launch a few per chunk."""
    if x.device.type != "cpu":
        return False
    widths = [x.shape[1]] + [template.get_submodule(path).out_features for path, act in layers if act is None]
    return x.shape[0] * max(widths) >= PER_DRAW_ELEMENTS


def run_linear_stack(layers, params: dict[str, torch.Tensor], x: torch.Tensor, template: nn.Module) -> torch.Tensor:
    """The stack of :func:`linear_stack` for weights with one leading draw dimension ``S``: ``(S, N, out)``.

    Without autograd (no gradient recorded, as in prediction) activations run in place on the layer outputs
    this function made; where :func:`runs_per_draw` says so, the draws run one at a time (:func:`_per_draw`),
    else batched, with a first layer with one input as an outer product (``addcmul``) rather than a batched
    matrix product with inner dimension 1, which BLAS runs slowly."""
    has_bias = {path: template.get_submodule(path).bias is not None for path, act in layers if act is None}
    size = next(iter(params.values())).shape[0]
    tracked = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params.values()))
    if not tracked and runs_per_draw(layers, x, template):
        return _per_draw(layers, params, x, has_bias, size)
    h, owned = x.expand((size,) + x.shape), False  # owned: a tensor made here, free to overwrite
    for path, activation in layers:
        if activation is not None:
            inplace = _IN_PLACE.get(type(activation)) if owned and not tracked else None
            h = activation(h) if inplace is None else inplace(activation, h)
            owned = True
            continue
        weight = params[site(path, "weight")].transpose(1, 2)
        bias = params[site(path, "bias")] if site(path, "bias") in params or has_bias[path] else None
        if not owned and not tracked and weight.shape[1] == 1:  # the inputs x (N, 1) times each draw's row
            h = x * weight if bias is None else torch.addcmul(bias.unsqueeze(1), x, weight)
        else:
            h = torch.bmm(h, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight)
        owned = True
    return h


def _per_draw(layers, params: dict[str, torch.Tensor], x: torch.Tensor, has_bias: dict[str, bool], size: int):
    """:func:`run_linear_stack` without autograd, one draw at a time: each Linear layer one ``addmm`` (``mm``
    without a bias; ``addcmul``, an outer product, for a layer with one input) into a buffer of that layer reused
    for every draw, the last one into the draw's slice of the result, activations in place where they can be."""
    last = max(i for i, (path, act) in enumerate(layers) if act is None)
    steps = []  # per layer: (activation, None, None, None) or (None, weights (S, in, out), biases (S, out) | None, i)
    for i, (path, activation) in enumerate(layers):
        if activation is not None:
            steps.append((activation, None, None, i))
            continue
        bias = params[site(path, "bias")] if site(path, "bias") in params or has_bias[path] else None
        steps.append((None, params[site(path, "weight")].transpose(1, 2), bias, i))
    buffers: dict[int, torch.Tensor] = {}
    out = None
    for s in range(size):
        h, owned, row = x, False, None
        for activation, weights, biases, i in steps:
            if activation is not None:
                inplace = _IN_PLACE.get(type(activation)) if owned else None
                h = activation(h) if inplace is None else inplace(activation, h)
                owned = True
                continue
            weight, bias = weights[s], None if biases is None else biases[s]
            if i == last:
                out = h.new_empty((size, h.shape[0], weight.shape[1])) if out is None else out
                target = row = out[s]
            elif i in buffers:
                target = buffers[i]
            else:
                target = buffers[i] = h.new_empty((h.shape[0], weight.shape[1]))
            if weight.shape[0] == 1:  # one input: an outer product, which addcmul runs faster than BLAS's addmm
                h = torch.mul(h, weight, out=target) if bias is None else torch.addcmul(bias, h, weight, out=target)
            else:
                h = torch.mm(h, weight, out=target) if bias is None else torch.addmm(bias, h, weight, out=target)
            owned = True
        if h is not row:  # activations after the last Linear that could not run in place
            row.copy_(h)
    return out
