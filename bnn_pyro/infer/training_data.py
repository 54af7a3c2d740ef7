"""The training data of one fit, :class:`Data`: full tensors or a loader of ``(x, y)`` batches, its size for
the likelihood's scaling, and the stream of minibatches an engine draws from."""

from __future__ import annotations

import collections.abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Data"]


@dataclass
class Data:
    """Training data for one fit: full tensors (``x``, ``y``) or a loader of ``(x, y)`` batches.

    A loader is either *re-iterable* (a ``DataLoader``, an ``IterableDataset`` yielding batches, any
    object whose ``__iter__`` starts a new pass): every pass is an epoch, and the fit goes round as
    often as it needs; or *one-shot* (an iterator, e.g. a generator): its batches are consumed once,
    in order, by all steps (and chains) of the fit, and running out of them is an error. Nothing
    keeps more than the current batch (and the first one, for tracing the model) in memory.
    """

    x: torch.Tensor | None
    y: torch.Tensor | None
    loader: object | None = None
    dataset_size: int | None = None
    batch_size: int | None = None
    convert: Callable | None = None  # validates and converts each loader batch (and a given held-out pair)

    def __post_init__(self):
        self._first = None  # the first batch (tracing the model), taken once
        self._first_unused = False  # a one-shot stream's first batch, still to be trained on
        self._taken = 0  # batches taken from a one-shot stream

    @property
    def one_shot(self) -> bool:
        """Whether the loader is an iterator whose batches can be consumed only once."""
        return self.loader is not None and isinstance(self.loader, collections.abc.Iterator)

    def _convert(self, batch):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            what = (
                f"a {type(batch).__name__} of {len(batch)}"
                if isinstance(batch, (tuple, list))
                else type(batch).__name__
            )
            raise ValueError(
                f"x: each batch must be an (x, y) pair, got {what}; make the loader yield inputs and "
                "targets, e.g. a DataLoader over TensorDataset(x, y)."
            )
        xb, yb = batch
        return self.convert(xb, yb) if self.convert is not None else (xb, yb)

    def loader_pass(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """One pass over the loader's batches, converted (a re-iterable loader; e.g. for BatchNorm statistics)."""
        for batch in self.loader:
            yield self._convert(batch)

    @property
    def size(self) -> int:
        return self.dataset_size if self.dataset_size is not None else self.x.shape[0]

    def first(self):
        """A small batch for tracing the model once (site discovery, guide set-up)."""
        if self.loader is None:
            return self.x, self.y
        if self._first is None:
            source = self.loader if self.one_shot else iter(self.loader)
            try:
                self._first = self._convert(next(source))
            except StopIteration:
                raise ValueError("x: the iterable of batches is empty; expected (x, y) batches.") from None
            self._first_unused = self.one_shot
            self._taken += self.one_shot
        return self._first

    def batches(self, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """An endless stream of minibatches (reshuffled every epoch) or of the full batch."""
        if self.one_shot:
            yield from self._stream()
        while True:
            if self.loader is not None:
                count = 0
                for batch in self.loader_pass():
                    count += 1
                    yield batch
                if count == 0:
                    raise ValueError("x: a pass over the loader gave no batches; expected (x, y) batches.")
            elif self.batch_size is None or self.batch_size >= self.x.shape[0]:
                yield self.x, self.y
            else:
                perm = torch.randperm(self.x.shape[0], generator=generator).to(self.x.device)
                for i in range(0, len(perm), self.batch_size):
                    j = perm[i : i + self.batch_size]
                    yield self.x[j], None if self.y is None else self.y[j]

    def _stream(self):
        self.first()
        if self._first_unused:
            self._first_unused = False
            yield self._first
        for batch in self.loader:
            self._taken += 1
            yield self._convert(batch)
        raise ValueError(
            f"x: the one-shot iterable of batches (an iterator or generator) ran out after {self._taken} batches, "
            "but the fit asked for more. Give fewer steps (num_steps=, num_samples=), a generator that never "
            "ends, or a re-iterable source (a DataLoader, an IterableDataset, an object whose __iter__ starts "
            "a new pass over the data)."
        )
