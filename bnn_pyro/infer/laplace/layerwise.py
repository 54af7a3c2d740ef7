"""Fast path of the curvature backends for nets whose covered weights all sit in ``nn.Linear`` / ``nn.Conv2d``
layers: per-example Jacobians from the layer inputs and one batched backward pass per output direction, instead
of ``vmap(jacrev)`` through the whole net.

For a layer ``s = W a + b`` (a Conv2d: the same on every patch ``t`` of its input, ``F.unfold``), the Jacobian of a
scalar ``v^T f(x_i)`` in ``[W, b]`` is ``sum_t g_t [a_t, 1]^T`` with ``g_t`` the gradient of ``v^T f`` at the
layer's output: one backward pass per direction ``v`` gives ``g`` for a whole batch and every layer at once
(what BackPACK's extensions and laplace-torch's last-layer Jacobians do). With ``v`` the columns of a square root
``L L^T = Lambda_i`` of the likelihood's Hessian in ``f``, the rows ``L^T J_i`` give the GGN
``sum_i J_i^T Lambda_i J_i = sum_i (L^T J_i)^T (L^T J_i)``; with ``v`` the gradient of ``-log p(y_i | f)`` in
``f``, they are the per-example gradients of the empirical Fisher. The diagonal is the sum of the squared rows,
never a dense matrix; a single layer without patches (the last layer of an MLP) gets the dense block from the
``out x out`` matrices ``K_i = G_i^T G_i`` (``G_i`` the rows' layer gradients), ``sum_i K_i (x) a_i a_i^T``,
a factor ``out`` cheaper than the rows' Gram matrix.

The path is taken when every covered weight site is the weight or bias of such a layer, each layer is called
once per forward pass, and, on the first rows of the data, the layer-wise Jacobians along a Gaussian direction
summed over the rows equal autograd's gradient in the flat coordinates from the same backward pass (which also
catches a weight used outside its layer or a constrained weight site). Otherwise the caller falls back to ``vmap(jacrev)``
(:func:`.functional.output_jacobian`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.approximation import CHUNK
from bnn_pyro.infer.laplace.functional import epoch, site_values
from bnn_pyro.infer.laplace.kfac import Layer, Recorder, block_index, locations
from bnn_pyro.infer.laplace.structure import Layout, zeros
from bnn_pyro.model import BNN

# directions(f, y) -> (B, out, k): the k output directions per example (float64)
Directions = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GUARD_RTOL = 1e-4  # layer-wise against autograd gradient, relative (float32 rounding ~1e-6; a missed term ~1)
CHECK_ROWS = 16  # rows of the first batch on which the layer-wise Jacobians are checked against autograd


def covered_layers(model: BNN, layout: Layout) -> list[Layer] | None:
    """The Linear / Conv2d layers (Conv2d: ``groups=1``, numeric zero padding) that hold the covered weight sites,
    or ``None`` when some covered weight site is not the weight or bias of one of them."""
    covered = set(layout.covered(model.sample_names))
    layers, found = [], set()
    for path, module in model._template.named_modules():
        if isinstance(module, nn.Conv2d) and (
            module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            continue
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        prefix = f"{path}." if path else ""
        weight, bias = prefix + "weight", prefix + "bias"
        layer = Layer(path, module, weight if weight in covered else None, bias if bias in covered else None)
        if layer.weight is not None or layer.bias is not None:
            layers.append(layer)
            found |= {weight, bias} & covered
    return layers if layers and found == covered else None


def gram(
    model: BNN, pot: Potential, z, data: Data, layout: Layout, diag: bool, directions: Directions, out: int
) -> torch.Tensor | None:
    """``sum_i (L_i^T J_i)^T (L_i^T J_i)`` on the covered coordinates (zero outside the layers' weights), with
    ``L_i = directions(f_i, y_i)`` (``(B, out, k)``, ``out`` the network's outputs); ``None`` where the fast path
    does not apply (module docstring)."""
    layers = covered_layers(model, layout)
    if layers is None:
        return None
    w_idx = layout.indices(model.sample_names)
    hess = zeros(layout, diag)
    blocks = {layer.path: block_index(layer, layout.coords, layout.where) for layer in layers}
    conv = any(isinstance(layer.module, nn.Conv2d) for layer in layers)
    single = len(layers) == 1 and not conv
    if diag and not conv:  # per row: the layers' inputs and summed squared output gradients, for one direction
        rows = CHUNK // max(1, sum(sum(b.shape) for b in blocks.values()))
    elif diag:  # per-example Jacobians of a conv layer, one direction at a time
        rows = CHUNK // max(1, out * max(int(b.numel()) for b in blocks.values()))
    else:
        rows = CHUNK // max(1, out * (int(blocks[layers[0].path].numel()) if single else len(layout.active)))
    try:
        if not _wired(model, pot, z, data.first()[0][:CHECK_ROWS], w_idx, layers, blocks, layout):
            return None
    except (ValueError, KeyError):  # a layer called twice per forward pass (a shared layer), or never
        return None
    acc = {}  # per layer (diag, single) the sums before they are placed among the covered coordinates
    for xb, yb in epoch(data, max(1, rows)):
        f, rec, _ = _forward(model, pot, z, xb, w_idx, layers)
        dirs = directions(f.detach(), yb)
        outs = [rec.outputs[layer.path] for layer in layers]
        squares = {}  # diag, per layer without patches: sum over directions of the squared output gradients
        grads = []  # per direction, per layer: (B, T, out_l) (not kept for the diagonal)
        for c in range(dirs.shape[-1]):
            gc = torch.autograd.grad(f, outs, grad_outputs=dirs[..., c].to(f.dtype), retain_graph=True)
            if diag:
                _add_squares(acc, squares, layers, gc, rec)
            else:
                grads.append([locations(layer, g) for layer, g in zip(layers, gc)])
        for path, sq in squares.items():  # (J_ic)_oj^2 = g_ico^2 a_ij^2: summed over directions, then one product
            acc[path] = acc.get(path, 0.0) + sq.double().T @ rec.inputs[path][:, 0] ** 2
        if diag:
            continue
        if single:  # sum_i K_i (x) a_i a_i^T, K_i = sum_c g_ic g_ic^T, as (o, p, i, j)
            g = torch.stack([gc[0][:, 0] for gc in grads], 1)  # (B, k, out_l)
            a = rec.inputs[layers[0].path][:, 0]  # (B, in)
            k_mat = g.transpose(1, 2) @ g  # (B, out_l, out_l)
            block = (k_mat[:, :, :, None] * a[:, None, None, :]).reshape(len(a), -1).T @ a
            acc["single"] = acc.get("single", 0.0) + block
        else:  # the Gram matrix of the rows L_i^T J_i
            rows = torch.zeros(f.shape[0], len(grads), len(layout.active), dtype=torch.float64, device=f.device)
            for c, gc in enumerate(grads):
                for layer, g in zip(layers, gc):
                    rows[:, c][:, blocks[layer.path]] = _jacobian(g, rec.inputs[layer.path])
            rows = rows.flatten(0, 1)
            hess += rows.T @ rows
    if diag:
        for layer in layers:
            if layer.path in acc:
                hess[blocks[layer.path].reshape(-1)] += acc[layer.path].reshape(-1)
    elif single and acc:
        pos = blocks[layers[0].path].reshape(-1)
        o = blocks[layers[0].path].shape[0]
        n_in = len(pos) // o
        hess[pos[:, None], pos] += acc["single"].reshape(o, o, n_in, n_in).permute(0, 2, 1, 3).reshape(len(pos), -1)
    return hess


def _forward(model: BNN, pot: Potential, z, x, w_idx, layers):
    """The net at ``x`` with its covered weights from the leaf ``zw`` and the layers' inputs and outputs recorded."""
    zw = z[w_idx].detach().clone().requires_grad_()
    rec = Recorder(layers)
    with rec, torch.enable_grad():
        weights = site_values(model, pot, z.detach().index_copy(0, w_idx, zw))[0]
        f = model.forward_draws(weights, x)
    return f, rec, zw


def _add_squares(acc, squares, layers, gc, rec) -> None:
    """Add one direction's squared per-example Jacobians of the layers: for a layer without patches only the squared
    output gradients, into ``squares`` (float64, summed over the directions before the product with the squared
    inputs); for a conv layer the squared Jacobians ``sum_t g_t a_t^T``, into ``acc``."""
    for layer, g in zip(layers, gc):
        a = rec.inputs[layer.path]
        if a.shape[1] == 1:
            g = g.reshape(g.shape[0], -1)
            if layer.path in squares:  # in the net's dtype: a float32 net adds < k float32 roundings per entry
                squares[layer.path].addcmul_(g, g)
            else:
                squares[layer.path] = g * g
        else:
            acc[layer.path] = acc.get(layer.path, 0.0) + _jacobian(locations(layer, g), a).pow(2).sum(0)


def _jacobian(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per-example Jacobian of a layer, ``sum_t g_t a_t^T``: ``(B, out_l, in)``."""
    if g.shape[1] == 1:
        return g[:, 0, :, None] * a[:, 0, None, :]
    return torch.einsum("bto,bti->boi", g, a)


def _wired(model: BNN, pot: Potential, z, x, w_idx, layers, blocks, layout: Layout) -> bool:
    """Whether on the rows ``x`` the layer-wise Jacobians along a Gaussian direction (fixed seed), summed over the
    rows, are autograd's gradient of the outputs along it in the flat coordinates of the covered weights (one
    backward pass for both). A weight used outside its layer, or a constrained weight site, adds a term the layers
    do not see; a Gaussian direction misses it with probability 0."""
    f, rec, zw = _forward(model, pot, z, x, w_idx, layers)
    v = torch.randn(f.shape, generator=torch.Generator().manual_seed(0), dtype=f.dtype).to(f.device)
    *grads, expected = torch.autograd.grad(
        f, [rec.outputs[layer.path] for layer in layers] + [zw], grad_outputs=v, allow_unused=True
    )
    if expected is None or any(g is None for g in grads):
        return False
    return _agrees(
        [locations(layer, g) for layer, g in zip(layers, grads)], expected, rec, layers, blocks, layout, w_idx
    )


def _agrees(grads, expected, rec, layers, blocks, layout: Layout, w_idx) -> bool:
    """Whether the layer-wise Jacobians ``grads`` (per layer, ``(B, T, out_l)``), summed over the batch, are
    autograd's gradient ``expected`` in the flat coordinates of the covered weights (from the same backward pass)."""
    got = torch.zeros(len(layout.active), dtype=torch.float64, device=expected.device)
    for layer, g in zip(layers, grads):
        got[blocks[layer.path]] += torch.einsum("bto,bti->oi", g, rec.inputs[layer.path])
    expected = expected.double()
    return float((got[layout.where[w_idx]] - expected).norm()) <= GUARD_RTOL * float(expected.norm()) + 1e-30
