"""Safetensors files written atomically, and the checksum their headers carry: the one writer of
:mod:`bnn_pyro.io` (posterior files) and :mod:`bnn_pyro.infer.checkpoint` (checkpoints).

A file goes to a temporary file in the same folder, is fsynced, then renamed over the target
(``os.replace``) and the folder fsynced, so a crash mid-write leaves the previous file intact.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["write_atomic", "digest"]


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a safetensors file to a temporary file beside ``path``, fsync it, rename it over ``path``.

    The file gets the permissions the umask gives any new file (``0o644`` under the usual umask 022):
    the temporary file is created exclusively (``O_EXCL``) with mode ``0o666`` less the umask, and
    that mode is set again after safetensors has written it (``save_file`` leaves ``0o600``, as
    ``tempfile.mkstemp`` would). Used by :mod:`bnn_pyro.io` and :mod:`bnn_pyro.infer.checkpoint`."""
    tmp = _new_temporary(path)
    try:
        mode = tmp.stat().st_mode & 0o777
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _new_temporary(path: Path) -> Path:
    """An empty file ``.<name>.<random>.tmp`` beside ``path``, created by this call (never an existing
    file or a link), with the permissions the umask gives a new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"path: could not create a temporary file in {str(path.parent)!r} (100 names taken); "
                          "remove stale .*.tmp files there and try again.")


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, dtypes, shapes and bytes, in name order (stored in the file's header)."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
