"""A stand-in for a second device, for machines without a GPU (CI has none).

On CUDA, a tensor that the package creates without ``device=`` (``torch.zeros(k, dtype=torch.float64)``) lands
on the CPU, and the first operation that mixes it with the model's tensors fails. On a CPU-only machine both
are CPU tensors and nothing fails. :class:`FakeDevice` tells them apart: every tensor created by a factory
(``torch.zeros``, ``torch.tensor``, ``torch.randn``, ...) called from a file under ``roots`` without a
``device=`` argument is *on the host*, and so is everything computed from host tensors only (``.cpu()``
cannot be told apart here: on the CPU it returns the tensor itself);
``.to(device)`` / ``.to(tensor)`` put a tensor on the model's device. An operation that mixes host and
model tensors (0-dim tensors aside: CUDA accepts CPU scalars) is recorded with the call sites under ``roots``.
It also records operations that mix floating dtypes (a float32 tensor made with torch's default dtype meeting
a float64 model's tensors), 0-dim tensors aside.

Indexing (``t[idx]``, ``t[idx] = v``) is allowed to mix: torch moves a CPU index to the indexed tensor's device.
"""

from __future__ import annotations

import collections
import os
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_TORCH = os.path.dirname(torch.__file__)
FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.tensor,
        torch.as_tensor,
        torch.eye,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.randn,
        torch.rand,
        torch.randint,
        torch.randperm,
        torch.scalar_tensor,
    }
)
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})
_NOT_COMPUTING = frozenset({torch.Tensor.__deepcopy__})  # its memo holds every tensor copied so far
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda})


class FakeDevice(TorchFunctionMode):
    """Records ``mixed_devices`` and ``mixed_dtypes``: ``Counter`` of ``"op file:line < file:line ..."``."""

    def __init__(self, roots):
        super().__init__()
        self.roots = tuple(os.path.abspath(r) for r in roots)
        self._host = weakref.WeakValueDictionary()  # id -> tensor: tensors are not hashable by value
        self.mixed_devices = collections.Counter()
        self.mixed_dtypes = collections.Counter()

    def on_host(self, t) -> bool:
        return self._host.get(id(t)) is t

    def _mark(self, tensors, host: bool = True) -> None:
        for t in tensors:
            if host:
                self._host[id(t)] = t
            elif self.on_host(t):
                del self._host[id(t)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func in FACTORIES:
            if (
                kwargs.get("device") is None
                and self._called_from_roots()
                and not (func is torch.as_tensor and isinstance(args[0], torch.Tensor))
            ):
                self._mark(outs)
            return out
        if func in _MOVES:
            target = kwargs.get(
                "device", next((a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))), None)
            )
            if target is not None:  # an explicit device: the model's (the stand-in cannot tell "cpu" apart)
                self._mark(outs, isinstance(target, torch.Tensor) and self.on_host(target))
                return out
        if func is torch.Tensor.cpu:  # a copy on CUDA; on the CPU the tensor itself, which stays where it is
            if out is not args[0]:
                self._mark(outs)
            return out
        if func in _NOT_COMPUTING:
            self._mark(outs[:1], bool(ins) and self.on_host(ins[0]))
            return out
        shaped = [t for t in ins if t.dim() > 0]
        floating = {t.dtype for t in shaped if t.is_floating_point()}
        if len(floating) > 1 and func not in _INDEXING:
            self._record(self.mixed_dtypes, func)
        host = [self.on_host(t) for t in ins]
        if any(host):
            if func not in _INDEXING and len({self.on_host(t) for t in shaped}) > 1:
                self._record(self.mixed_devices, func)
            if all(host) or (func in _INDEXING and host[0]):
                self._mark(outs)
        return out

    def _called_from_roots(self) -> bool:
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename.startswith(_TORCH):
            f = f.f_back
        return f is not None and f.f_code.co_filename.startswith(self.roots)

    def _record(self, counter, func) -> None:
        f, sites = sys._getframe(2), []
        while f is not None and len(sites) < 3:
            if f.f_code.co_filename.startswith(self.roots):
                sites.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
            f = f.f_back
        if sites:  # operations of torch's or Pyro's own, outside the package, are not ours to judge
            counter[f"{getattr(func, '__name__', func)} " + " < ".join(sites)] += 1
