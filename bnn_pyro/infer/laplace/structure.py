"""Structures of the Laplace precision: which coordinates it covers (``"full"``, ``"diag"``: every one;
``"last_layer"``: the last ``nn.Linear`` layer; ``"kron"``: every ``nn.Linear`` and ``nn.Conv2d`` layer) and how
curvature blocks are stored (dense, diagonal, or Kronecker-factored: :mod:`.kron`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.approximation import MAX_FULL_DIM, Structure
from bnn_pyro.infer.laplace.kfac import kron_sites
from bnn_pyro.model import BNN


@dataclass
class Layout:
    """Where each site sits in the flat vector, and which coordinates the approximation covers."""

    coords: dict[str, torch.Tensor]  # site -> its indices in the flat vector
    active: torch.Tensor  # covered indices
    where: torch.Tensor  # flat index -> position among the covered ones (-1: not covered)

    def covered(self, names) -> list[str]:
        return [n for n in self.coords if n in set(names) and bool((self.where[self.coords[n]] >= 0).all())]

    @property
    def device(self) -> torch.device:
        """The model's device: the index tensors and the float64 curvature buffers live there."""
        return self.active.device

    def indices(self, names) -> torch.Tensor:
        return torch.cat([self.active.new_zeros(0)] + [self.coords[n] for n in self.covered(names)])


def make_layout(model, pot: Potential, structure: Structure, exclude=()) -> Layout:
    """The covered coordinates (``full``/``diag``: all but the sites in ``exclude``), and the guard against a
    dense Hessian that is too large."""
    coords, start, device = {}, 0, next(iter(pot.init.values())).device
    for name, shape in pot.shapes.items():
        coords[name] = torch.arange(start, start + math.prod(shape), device=device)
        start += math.prod(shape)
    last = last_linear_sites(model, pot) if isinstance(model, BNN) else []
    if structure is Structure.LAST_LAYER:
        if not last:
            raise ValueError(
                "structure='last_layer': the net has no nn.Linear layer with Bayesian parameters; "
                "use structure='full' or 'diag'."
            )
        active = torch.cat([coords[n] for n in last])
        if len(active) > MAX_FULL_DIM:
            raise ValueError(
                f"structure='last_layer': the last Linear layer has {len(active)} parameters, more than "
                f"MAX_FULL_DIM={MAX_FULL_DIM} for a dense Hessian; use structure='diag'."
            )
    elif structure is Structure.KRON:  # (a Pyro function model is refused by make_settings)
        active = torch.cat([coords[n] for n in kron_sites(model, pot)])
    else:
        if structure is Structure.FULL and pot.dim > MAX_FULL_DIM:
            hint = (
                (
                    f" or structure='last_layer' (a dense Hessian over the last Linear layer's "
                    f"{sum(len(coords[n]) for n in last)} parameters)"
                )
                if last
                else ""
            )
            raise ValueError(
                f"structure='full' needs a dense {pot.dim} x {pot.dim} Hessian, but this model has "
                f"{pot.dim} parameters, more than MAX_FULL_DIM={MAX_FULL_DIM}. Use structure='diag' "
                f"(every parameter, a diagonal Hessian){hint}."
            )
        active = torch.cat(
            [torch.zeros(0, dtype=torch.long, device=device)] + [c for n, c in coords.items() if n not in exclude]
        )
    where = torch.full((pot.dim,), -1, dtype=torch.long, device=device)
    where[active] = torch.arange(len(active), device=device)
    return Layout(coords, active, where)


def last_linear_sites(model: BNN, pot: Potential) -> list[str]:
    linear = [name for name, m in model.net.named_modules() if isinstance(m, torch.nn.Linear)]
    for path in reversed(linear):
        prefix = f"{path}." if path else ""
        sites = [n for n in (prefix + "weight", prefix + "bias") if n in pot.shapes]
        if sites:
            return sites
    return []


def zeros(layout: Layout, diag: bool) -> torch.Tensor:
    k = len(layout.active)
    return torch.zeros((k,) if diag else (k, k), dtype=torch.float64, device=layout.device)


def add_block(hess, block, pos, diag: bool) -> None:
    if diag:
        hess[pos] += block
    else:
        hess[pos[:, None], pos] += block
