"""A checkpoint folder as a whole (``bp.fit(..., checkpoint=FOLDER)``): one writer at a time, and the model and
data its checkpoints belong to. :func:`guard` holds both for the length of a fit; ``bp.fit`` enters it before
any engine runs, so every engine (and every stage of ``"subspace"``) gets them.

- **One writer.** ``FOLDER/.lock`` is locked (``fcntl.flock``, :mod:`bnn_pyro.utils.locks`) for the whole fit and
  names the process holding it. A second fit on the folder is refused (:class:`CheckpointInUseError`) instead of
  overwriting the first one's state. The OS releases the lock when its process ends, killed or not, so a lock
  left by a crash never blocks a resume, and nothing has to guess whether its holder is alive.
- **Identity.** ``FOLDER/identity.ckpt`` holds the fingerprint of the model (net, sites and shapes, prior and
  likelihood: :func:`bnn_pyro.posterior.posterior_file.fingerprint`) and of the data (shapes, dtypes and a SHA-256 of
  ``x`` and ``y``; for a loader, the dataset size, the first batch's shapes and dtypes, and a SHA-256 of its
  dataset where it has one that is indexable and finite: :func:`dataset_hash`). ``resume=True`` on a
  folder holding checkpoints checks them first and refuses another model or data with a
  :class:`~bnn_pyro.infer.checkpoint.CheckpointError` that names what differs (a wider net was a raw size error
  from ``copy_``; other targets continued silently). A folder written before identities existed resumes
  unchecked, and gets one.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bnn_pyro.infer.checkpoint import CheckpointError, checkpoint_folder, read, write
from bnn_pyro.infer.training_data import Data
from bnn_pyro.inputs import Inputs
from bnn_pyro.posterior.posterior_file import fingerprint
from bnn_pyro.utils.locks import keep_from_children, release, try_lock

__all__ = ["guard", "identity", "dataset_hash", "CheckpointInUseError", "IDENTITY", "LOCK"]

IDENTITY = "identity.ckpt"
LOCK = ".lock"


class CheckpointInUseError(CheckpointError):
    """Another live process is fitting into the same checkpoint folder."""


@contextmanager
def guard(folder, *, model, data: Data, resume) -> Iterator[None]:
    """Hold ``folder``'s lock for the fit, and check (``resume=True``) or record the model and data it is for."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint: expected the path of a folder, got {type(folder).__name__}; pass e.g. checkpoint='runs/fit1'."
        )
    folder = checkpoint_folder(folder)
    resume = isinstance(resume, (bool, np.bool_)) and bool(resume)  # anything else: the engine's own error
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    keep_from_children(fd)  # chain workers forked during the fit must not keep the lock after it
    try:
        if not try_lock(fd):
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process"
            raise CheckpointInUseError(
                f"checkpoint: {str(folder)!r} is in use by another fit ({holder}); two fits writing one folder would "
                "overwrite each other's checkpoints. Wait for that fit to end (the lock goes with its process, "
                "even a killed one) or pass another folder (torch.distributed ranks: one folder each, e.g. "
                "checkpoint=f'run/rank{bp.distributed.rank()}')."
            )
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}".encode(),
            0,
        )
        _check_or_record(folder, identity(model, data), resume)
        yield
    finally:
        release(fd)


def identity(model, data: Data) -> dict[str, Any]:
    """The model's fingerprint and the data's (shapes, dtypes, SHA-256; a loader: its size, first batch and
    :func:`dataset_hash`)."""
    if data.loader is not None:
        xb, yb = data.first()
        seen = {
            "loader": type(data.loader).__name__,
            "dataset_size": data.size,
            "first batch": {"x": _described(xb, hash_values=False), "y": _described(yb, hash_values=False)},
            "dataset": dataset_hash(data.loader),
        }
    else:
        seen = {"x": _described(data.x), "y": _described(data.y)}
    return {"model": fingerprint(model), "data": seen}


def dataset_hash(loader) -> str:
    """``"sha256:..."`` of the dataset behind ``loader`` (a ``torch.utils.data.DataLoader``'s ``dataset``), or a
    sentence saying why it is not hashed.

    Hashed: a map-style dataset (``__len__`` and ``__getitem__``, not an ``IterableDataset``), item by item in
    index order, whatever order the loader draws them in: every tensor's dtype, shape and bytes, numbers and
    strings by value, through tuples, lists and dicts (a ``TensorDataset`` by its tensors at once). An item of
    another type (e.g. a PIL image) counts by its type only. Reading the items is one pass over the dataset
    (without the loader's workers or collation), made once when a checkpointed fit starts.
    Not hashed: an ``IterableDataset`` or a loader without a dataset (a generator, an iterator of batches): it
    has no index to read it by, reading it would consume a stream, and it may have no end."""
    from torch.utils.data import IterableDataset, TensorDataset

    dataset = getattr(loader, "dataset", None)
    if (
        dataset is None
        or isinstance(dataset, IterableDataset)
        or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
    ):
        return (
            "not hashed: an iterable loader or dataset (no index to read it by without consuming it, and it "
            "may have no end)"
        )
    digest = hashlib.sha256()
    if type(dataset) is TensorDataset:
        _feed(digest, dataset.tensors)
    else:
        for i in range(len(dataset)):
            _feed(digest, dataset[i])
    return "sha256:" + digest.hexdigest()[:16]


def _feed(digest, value) -> None:
    """Add ``value`` (tensors, arrays, numbers, strings, and tuples, lists and dicts of them) to ``digest``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        digest.update(f"{t.dtype} {tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}{len(value)}(".encode())
        for v in value:
            _feed(digest, v)
        digest.update(b")")
    elif isinstance(value, dict):
        digest.update(f"dict{len(value)}(".encode())
        for k in sorted(value, key=repr):
            digest.update(f"{k!r}:".encode())
            _feed(digest, value[k])
        digest.update(b")")
    elif isinstance(value, (bool, int, float, complex, str, bytes, np.generic)) or value is None:
        digest.update(f"{type(value).__name__}:{value!r}|".encode())
    else:
        digest.update(f"<{type(value).__module__}.{type(value).__qualname__}>|".encode())


def _described(value, *, hash_values: bool = True):
    if isinstance(value, Inputs):
        named = value.kwargs or {str(i): t for i, t in enumerate(value.args)}
        return {k: _described(t, hash_values=hash_values) for k, t in named.items()}
    if not torch.is_tensor(value):
        return repr(type(value).__name__)
    text = f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    if hash_values and value.numel():
        t = value.detach().cpu().contiguous()
        text += " sha256:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().data).hexdigest()[:16]
    return text


def _check_or_record(folder: Path, given: dict[str, Any], resume: bool) -> None:
    path = folder / IDENTITY
    holds_run = any(p.name != IDENTITY for p in folder.glob("*.ckpt")) or any(folder.glob("*/*.ckpt"))
    if holds_run and not resume:
        return  # the engine refuses: an existing run is never overwritten
    if holds_run and path.exists():
        saved = read(path)[1].get("identity", {})
        if "loader" in saved.get("data", {}) and "dataset" not in saved["data"]:  # recorded before loaders were hashed
            given = {**given, "data": {k: v for k, v in given["data"].items() if k != "dataset"}}
        diff = differences(saved, given)
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise CheckpointError(
                f"resume: the checkpoints in {str(folder)!r} belong to another model or data "
                f"({shown}). Resume with the model and data that run was fitted to, or pass "
                "another checkpoint folder."
            )
        return
    write(path, {}, {"identity": given})


def differences(saved: Any, given: Any, where: str = "") -> list[str]:
    """What differs between two nested dicts of JSON values, by path: ``["data.y: saved ..., given ..."]``."""
    if isinstance(saved, dict) and isinstance(given, dict):
        return [
            d
            for k in sorted(set(saved) | set(given), key=str)
            for d in differences(saved.get(k, "none"), given.get(k, "none"), f"{where}.{k}" if where else k)
        ]
    if saved == given:
        return []

    def show(v):  # text on one line (a net's repr spans several)
        return " ".join(v.split()) if isinstance(v, str) else repr(v)

    return [f"{where}: saved {show(saved)}, given {show(given)}"]
