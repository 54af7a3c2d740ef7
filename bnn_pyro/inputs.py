"""Network inputs: one tensor, or several tensors a net's ``forward`` takes together.

``x`` is usually one tensor shaped ``(N, ...)``. A net whose ``forward`` takes several tensors
(``forward(self, tokens, lengths)``) gets them as a tuple, ``x=(tokens, lengths)``, passed as
positional arguments; one whose ``forward`` takes keyword arguments (``forward(self, tokens, mask)``,
the Hugging Face ``model(**batch)`` convention) gets a dict, ``x={"tokens": t, "mask": m}``, passed
as keywords. Every tensor's first dimension is the row (example) dimension, the same for all.

Such inputs travel through the library as :class:`Inputs`, which indexes and moves like a tensor
along its rows (``x[idx]``, ``x.shape[0]``, ``len(x)``, ``x.to(device)``), so that minibatches,
held-out splits and chunked prediction treat them as they treat one tensor. ``post.x`` of a fit on
such data is an ``Inputs``; ``Inputs.of(post.x)`` gives back the user's tuple or dict.

Integer tensors (token ids for ``nn.Embedding``) keep their dtype when the net has an
``nn.Embedding`` or ``nn.EmbeddingBag`` (:func:`keeps_integers`); for other nets integer inputs
are integer-valued features and are cast to the model's float dtype, as before.

Example
-------
>>> post = bp.fit(model, (tokens, lengths), y, method="svi")     # net.forward(tokens, lengths)
>>> post.predict({"tokens": t_test, "mask": m_test})               # net.forward(tokens=..., mask=...)
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["Inputs", "is_structured", "keeps_integers", "check_token_ids", "input_mismatch"]


class Inputs:
    """Several input tensors with a shared first (row) dimension: positional ``args`` (from a
    tuple) or keyword ``kwargs`` (from a dict), never both.

    ``shape`` is ``torch.Size([N])``, the row dimension only (what code that batches by rows reads);
    ``x[index]`` indexes every tensor along its rows; ``to``, ``device`` act on every tensor.
    """

    def __init__(self, args: tuple = (), kwargs: dict | None = None):
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        if bool(self.args) == bool(self.kwargs):
            raise ValueError("x: expected a non-empty tuple of tensors or a non-empty dict of tensors.")
        rows = {t.shape[0] if t.dim() else None for t in self.tensors()}
        if len(rows) != 1 or None in rows:
            raise ValueError(
                f"x: every tensor of a {'tuple' if self.args else 'dict'} input must have the same first "
                f"(row) dimension; got shapes {self._shapes()}. Give each tensor one row per example."
            )

    @classmethod
    def of(cls, x) -> tuple | dict:
        """The user's form of ``x``: the tuple or the dict (one tensor is returned as it is)."""
        return x if not isinstance(x, cls) else (x.args if x.args else dict(x.kwargs))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.args) + list(self.kwargs.values())

    def map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Inputs:
        """``fn(argname, tensor)`` applied to every tensor (``argname``: ``"x[0]"``, ``"x['tokens']"``)."""
        return Inputs(
            tuple(fn(f"x[{i}]", t) for i, t in enumerate(self.args)),
            {k: fn(f"x[{k!r}]", t) for k, t in self.kwargs.items()},
        )

    def detach(self) -> Inputs:
        """Every tensor detached, as ``torch.Tensor.detach`` (the MCMC kernels take ``x.detach()`` of either)."""
        return self.map(lambda _, t: t.detach())

    def call(self, fn: Callable):
        """``fn(*args, **kwargs)``."""
        return fn(*self.args, **self.kwargs)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.tensors()[0].shape[0]])

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def __getitem__(self, index) -> Inputs:
        if isinstance(index, tuple):
            raise IndexError("Inputs index rows only (x[rows]); index the tensors themselves for more.")
        return self.map(lambda name, t: t[index])

    def to(self, *args, **kwargs) -> Inputs:
        """Every tensor ``.to(...)``; a dtype applies to floating tensors only (token ids stay integer)."""

        def move(name, t):
            if not t.dtype.is_floating_point:
                return t.to(device=_device_of(args, kwargs)) if _device_of(args, kwargs) is not None else t
            return t.to(*args, **kwargs)

        return self.map(move)

    def _shapes(self) -> str:
        if self.args:
            return ", ".join(str(tuple(t.shape)) for t in self.args)
        return ", ".join(f"{k!r}: {tuple(t.shape)}" for k, t in self.kwargs.items())

    def __repr__(self) -> str:
        return f"Inputs({'(' + self._shapes() + ')' if self.args else '{' + self._shapes() + '}'})"


def _device_of(args, kwargs):
    for a in args:
        if isinstance(a, (str, torch.device)):
            return a
    return kwargs.get("device")


def is_structured(x) -> bool:
    """Whether ``x`` is a tuple or dict of arrays (several inputs), not one array-like."""
    if isinstance(x, Inputs):
        return True
    if isinstance(x, dict):
        return True
    return isinstance(x, tuple) and len(x) > 0 and all(_array_like(v) for v in x)


def _array_like(v) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray)) or hasattr(v, "to_numpy")


_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def keeps_integers(net: nn.Module) -> bool:
    """Whether integer inputs stay integer for ``net``: it has an ``nn.Embedding``/``nn.EmbeddingBag``."""
    return any(isinstance(m, _EMBEDDINGS) for m in net.modules())


def check_token_ids(net: nn.Module, x) -> None:
    """For a net with embeddings, integer inputs must be valid ids: ``0 <= id < num_embeddings`` of its
    largest embedding (a net with several tables may still index a smaller one out of range: torch's
    own error then says so)."""
    sizes = [m.num_embeddings for m in net.modules() if isinstance(m, _EMBEDDINGS)]
    if not sizes:
        return
    if isinstance(x, Inputs):
        named = dict(x.kwargs) if x.kwargs else dict(enumerate(x.args))
    else:
        named = {None: x}
    for key, t in named.items():
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() == 0:
            continue
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= max(sizes):
            name = "x" if key is None else f"x[{key!r}]"
            raise ValueError(
                f"{name}: token ids must lie in 0..{max(sizes) - 1} (the net's nn.Embedding has "
                f"num_embeddings={max(sizes)}); found ids in {lo}..{hi}. Map unknown tokens to a "
                "reserved id, or build the embedding with a larger num_embeddings."
            )


_INPUT_SIZE = {
    nn.Linear: ("in_features", 1),
    nn.Conv1d: ("in_channels", 3),
    nn.Conv2d: ("in_channels", 4),
    nn.Conv3d: ("in_channels", 5),
}  # layer -> (its input size attribute, the dims of its input)


# torch's errors for what a meta tensor (shape, no values) cannot do: read values (.item(), bool(), .tolist()), run an
# op whose output shape depends on them (nonzero: "register_meta"; masked_select, unique: "no fake impl or Meta
# kernel"), or meet a tensor on another device ("... is not on the expected device meta!") (torch 2.13)
_META_ONLY = re.compile(r"\bmeta\b|register_meta", re.IGNORECASE)


def meta_only(err: BaseException) -> bool:
    """Whether ``err``, raised by a forward on meta tensors, is one only meta tensors raise (the forward reads values
    or makes a tensor on another device), not a size mismatch: BNN.output_shape then runs the forward on real rows."""
    return bool(_META_ONLY.search(str(err)))


def input_mismatch(net: nn.Module, x) -> str:
    """Why the net cannot take ``x``, in our words: the first layer of a Sequential net and what it expects."""
    if isinstance(x, Inputs):
        return (
            f"x ({x!r}) is not what the net's forward takes (the error it raised is chained below). A tuple is "
            "passed as positional arguments, net(*x); a dict as keyword arguments, net(**x): check them against "
            "the signature of its forward."
        )
    shape = tuple(x.shape)
    hint = (
        " x is 1-D: for N rows of one feature pass x.reshape(-1, 1), for one row x.reshape(1, -1)."
        if x.dim() == 1
        else ""
    )
    path, first = "", net  # a single layer
    if isinstance(net, nn.Sequential):
        path, first = next(
            ((p, m) for p, m in net.named_modules() if next(m.parameters(recurse=False), None) is not None),
            (None, None),
        )
    if type(first) in _INPUT_SIZE:
        attr, ndim = _INPUT_SIZE[type(first)]
        size = getattr(first, attr)
        axis = -1 if ndim == 1 else 1
        if x.dim() < 2 or x.shape[axis] != size or (ndim > 1 and x.dim() != ndim):
            want = f"(N, {size})" if ndim == 1 else f"(N, {size}, {', '.join(['...'] * (ndim - 2))})"
            return (
                f"x has shape {shape}, which the net cannot take (its first layer, {_layer(path, first)}, takes "
                f"inputs shaped {want}). Check that the feature dimensions of x match the net's first layer.{hint}"
            )
        return (
            f"x has shape {shape}, which the net cannot take (x fits its first layer, {_layer(path, first)}, but a "
            "later layer does not fit the output of the one before; the error it raised is chained below). Check "
            "the layer sizes of the net."
        )
    return (
        f"x has shape {shape}, which the net cannot take (the error it raised is chained below). Check that the "
        f"feature dimensions of x match the net's first layer.{hint}"
    )


def _layer(path: str, module: nn.Module) -> str:
    return f"{path!r}, {type(module).__name__}" if path else type(module).__name__
