"""Where tensors live: distributions placed on the device and floating dtype of the tensors they meet.

A prior written as ``dist.Normal(0., 1.)`` holds float32 tensors on the CPU (torch's defaults), whatever
the network's parameters are: a ``net.double()`` or a ``net.cuda()`` then drew float32 or CPU weights and
failed (``mat1 and mat2 must have the same dtype``). :class:`~bnn_pyro.BNN` and the likelihoods place every
distribution they sample from with :func:`placed_like`, so that draws follow the model's parameters.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch.distributions import Distribution, Transform

__all__ = ["placed_like"]


def placed_like(d: Distribution, like: torch.Tensor) -> Distribution:
    """``d`` with its tensors on ``like``'s device and its floating tensors in ``like``'s dtype (integer and
    boolean tensors keep their dtype). Nested distributions (``base_dist``, mixture components) and
    transforms are placed too. ``d`` itself is returned when nothing needs to move; otherwise a shallow copy,
    so the caller's distribution is not changed. The answer is remembered per distribution, device and dtype
    (a likelihood places its noise prior at every model run: ~1 us then, ~40 us to inspect it anew)."""
    key = (like.device, like.dtype)
    try:
        known = _KNOWN.setdefault(d, {})
    except TypeError:  # not weakly referenceable: inspect it every time
        known = {}
    if key not in known:  # None: d itself (a value holding d would keep its weak key alive)
        known[key] = _placed(d, *key) if _needs(d, *key) else None
    placed = known[key]
    return d if placed is None else placed


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # d -> {(device, dtype): placed copy or None}


def _needs(obj, device: torch.device, dtype: torch.dtype) -> bool:
    for value in _attributes(obj):
        if isinstance(value, torch.Tensor):
            if value.device != device or (value.is_floating_point() and value.dtype != dtype):
                return True
        elif isinstance(value, (Distribution, Transform)) and _needs(value, device, dtype):
            return True
    return False


def _placed(obj, device: torch.device, dtype: torch.dtype):
    out = copy.copy(obj)
    for key, value in list(vars(out).items()):
        if isinstance(value, torch.Tensor):
            setattr(out, key, value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype))
        elif isinstance(value, (Distribution, Transform)):
            setattr(out, key, _placed(value, device, dtype))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (Distribution, Transform)) for v in value):
            setattr(
                out,
                key,
                type(value)(
                    _placed(v, device, dtype) if isinstance(v, (Distribution, Transform)) else v for v in value
                ),
            )
    return out


def _attributes(obj):
    for value in vars(obj).values():
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value
