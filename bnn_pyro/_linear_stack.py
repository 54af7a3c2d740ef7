"""A plain stack of ``nn.Linear`` layers and elementwise activations, evaluated for many weight draws at once by
batched matrix products (``baddbmm``) instead of ``vmap(functional_call)``: used by ``BNN.forward_draws`` for
prediction and for vectorized ELBO particles. Anything else (other modules, hooks, in-place activations, an active
torch function mode) keeps the general path."""

from __future__ import annotations

import torch
from torch import nn

from bnn_pyro._upstream_private import function_mode_active, global_module_hooks, module_hooks

__all__ = ["linear_stack", "run_linear_stack", "site"]


_ELEMENTWISE = (nn.Identity, nn.Tanh, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU,
                nn.Mish, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus, nn.Softsign,
                nn.LogSigmoid, nn.Tanhshrink)


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


def run_linear_stack(layers, params: dict[str, torch.Tensor], x: torch.Tensor, template: nn.Module) -> torch.Tensor:
    """The stack of :func:`linear_stack` for weights with one leading draw dimension ``S``: ``(S, N, out)``."""
    has_bias = {path: template.get_submodule(path).bias is not None for path, act in layers if act is None}
    size = next(iter(params.values())).shape[0]
    h = x.expand((size,) + x.shape)
    for path, activation in layers:
        if activation is not None:
            h = activation(h)
            continue
        weight = params[site(path, "weight")].transpose(1, 2)
        bias = params[site(path, "bias")] if site(path, "bias") in params or has_bias[path] else None
        h = torch.bmm(h, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, weight)
    return h
