"""A checkpoint folder as a whole (``bp.fit(..., checkpoint=FOLDER)``): one writer at a time, and the model and
data its checkpoints belong to. :func:`guard` holds both for the length of a fit; ``bp.fit`` enters it before
any engine runs, so every engine (and every stage of ``"subspace"``) gets them.

- **One writer.** ``FOLDER/.lock`` is locked (``fcntl.flock``, :mod:`bnn_pyro.utils.locks`) for the whole fit and
  names the process holding it. A second fit on the folder is refused (:class:`CheckpointInUseError`) instead of
  overwriting the first one's state. The OS releases the lock when its process ends, killed or not, so a lock
  left by a crash never blocks a resume, and nothing has to guess whether its holder is alive.
- **Identity.** ``FOLDER/identity.ckpt`` holds the fingerprint of the model (net, sites and shapes, prior and
  likelihood: :func:`bnn_pyro.posterior.posterior_file.fingerprint`) and of the data (shapes, dtypes and a SHA-256 of
  ``x`` and ``y``; for a loader, the dataset size and the first batch's shapes and dtypes). ``resume=True`` on a
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from bnn_pyro.utils.locks import keep_from_children, release, try_lock
from bnn_pyro.infer.checkpoint import CheckpointError, read, write
from bnn_pyro.infer.training_data import Data
from bnn_pyro.inputs import Inputs
from bnn_pyro.posterior.posterior_file import fingerprint

__all__ = ["guard", "identity", "CheckpointInUseError", "IDENTITY", "LOCK"]

IDENTITY = "identity.ckpt"
LOCK = ".lock"


class CheckpointInUseError(CheckpointError):
    """Another live process is fitting into the same checkpoint folder."""


@contextmanager
def guard(folder, *, model, data: Data, resume) -> Iterator[None]:
    """Hold ``folder``'s lock for the fit, and check (``resume=True``) or record the model and data it is for."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"checkpoint: expected the path of a folder, got {type(folder).__name__}; pass e.g. "
                        "checkpoint='runs/fit1'.")
    folder = Path(folder)
    resume = isinstance(resume, (bool, np.bool_)) and bool(resume)  # anything else: the engine's own error
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint: the folder {str(folder)!r} does not exist; create it first "
                                "(checkpoint= names a folder that gets one file per chain).")
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    keep_from_children(fd)  # chain workers forked during the fit must not keep the lock after it
    try:
        if not try_lock(fd):
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process"
            raise CheckpointInUseError(
                f"checkpoint: {str(folder)!r} is in use by another fit ({holder}); two fits writing one folder would "
                "overwrite each other's checkpoints. Wait for that fit to end (the lock goes with its process, "
                "even a killed one) or pass another folder (torch.distributed ranks: one folder each, e.g. "
                "checkpoint=f'run/rank{bp.distributed.rank()}').")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}".encode(), 0)
        _check_or_record(folder, identity(model, data), resume)
        yield
    finally:
        release(fd)


def identity(model, data: Data) -> dict[str, Any]:
    """The model's fingerprint and the data's (shapes, dtypes, SHA-256; a loader: its size and first batch)."""
    if data.loader is not None:
        xb, yb = data.first()
        seen = {"loader": type(data.loader).__name__, "dataset_size": data.size,
                "first batch": {"x": _described(xb, hash_values=False), "y": _described(yb, hash_values=False)}}
    else:
        seen = {"x": _described(data.x), "y": _described(data.y)}
    return {"model": fingerprint(model), "data": seen}


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
        diff = differences(saved, given)
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise CheckpointError(f"resume: the checkpoints in {str(folder)!r} belong to another model or data "
                                  f"({shown}). Resume with the model and data that run was fitted to, or pass "
                                  "another checkpoint folder.")
        return
    write(path, {}, {"identity": given})


def differences(saved: Any, given: Any, where: str = "") -> list[str]:
    """What differs between two nested dicts of JSON values, by path: ``["data.y: saved ..., given ..."]``."""
    if isinstance(saved, dict) and isinstance(given, dict):
        return [d for k in sorted(set(saved) | set(given), key=str)
                for d in differences(saved.get(k, "none"), given.get(k, "none"), f"{where}.{k}" if where else k)]
    if saved == given:
        return []
    def show(v):  # text on one line (a net's repr spans several)
        return " ".join(v.split()) if isinstance(v, str) else repr(v)

    return [f"{where}: saved {show(saved)}, given {show(given)}"]
