"""Safetensors files written atomically, and the checksum their headers carry: the one writer of
:mod:`bnn_pyro.io` (posterior files) and :mod:`bnn_pyro.infer.checkpoint` (checkpoints).

A file is written piece by piece (its header, then each tensor's bytes) to a temporary file ``.<name>.<12 hex digits>.tmp`` in the same folder,
fsynced, then renamed over the target (``os.replace``) and the folder fsynced, so a crash mid-write leaves the
previous file intact. A write that fails (a full disk, no permission) is an ``OSError`` naming the path, and
its temporary file is removed. The writer holds a lock on its temporary file (:mod:`bnn_pyro.utils.locks`) while it
writes; the lock dies with the process, so the next write into the folder removes the temporary files of
writers that were killed (their lock is free) and leaves those of live writers alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path

import torch

from bnn_pyro.utils.locks import LOCKS_WORK, same_file, try_lock

__all__ = ["write_atomic", "digest", "remove_stale_temporaries"]

_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")  # the names _new_temporary gives, and only those


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a safetensors file to a temporary file beside ``path``, fsync it, rename it over ``path``.

    The file gets the permissions the umask gives any new file (``0o644`` under the usual umask 022): the
    temporary file is created exclusively (``O_EXCL``) with mode ``0o666`` less the umask. An ``OSError``
    while writing (e.g. ``ENOSPC``) is raised again as an ``OSError`` with the same ``errno`` that names
    ``path`` and says the previous file is unchanged."""
    header, parts = _layout(tensors, metadata)
    remove_stale_temporaries(path.parent)
    fd, tmp = _new_temporary(path)
    try:
        _write_all(fd, header)
        for part in parts:  # each tensor's bytes as they are in memory: no copy of the whole file is made
            _write_all(fd, part)
        os.fsync(fd)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(
            err.errno,
            f"could not write {str(path)!r} ({err.strerror or err}); the previous file there, "
            "if any, is unchanged. Free disk space or fix the folder's permissions and save "
            "again",
            str(path),
        ) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # releases the lock that marked the temporary file as live
    _fsync_dir(path.parent)
    return path


def _write_all(fd: int, payload) -> None:
    view = memoryview(payload).cast("B")
    while view:
        view = view[os.write(fd, view) :]


# the safetensors names of the dtypes a posterior or checkpoint holds (the format's spec, safetensors' README)
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list]:
    """A safetensors file as its header (length, JSON, padded to 8 bytes) and each tensor's bytes (views of the
    tensors, in name order, back to back): written piece by piece, it needs no second copy of the data in memory.
    ``safetensors`` reads it back (and checks the layout: every byte covered, no holes)."""
    entries, parts, offset = {"__metadata__": dict(metadata)}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().resolve_conj().resolve_neg().contiguous()
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"cannot store {name!r} of dtype {t.dtype} in a bnn_pyro file; store it as one of "
                f"{sorted(str(d) for d in _DTYPES)}."
            )
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        if size:
            parts.append(t.reshape(-1).view(torch.uint8).numpy())
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, parts


def _new_temporary(path: Path) -> tuple[int, Path]:
    """An empty file ``.<name>.<random>.tmp`` beside ``path``, created by this call (never an existing file or a
    link), with the permissions the umask gives a new file; open (the descriptor) and locked."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        if try_lock(fd) and same_file(fd, tmp):  # not taken for a stale one by a cleaner in the instant between
            return fd, tmp
        os.close(fd)
    raise FileExistsError(
        f"path: could not create a temporary file in {str(path.parent)!r} (100 names taken); "
        "remove stale .*.tmp files there and try again."
    )


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporary files of :func:`write_atomic` in ``folder`` whose writer is gone (killed mid-write:
    its lock is free); a live writer's file (locked) and every other file stay. Returns the removed paths."""
    if not LOCKS_WORK:  # no way to tell a live writer's file from a dead one's
        return []
    removed = []
    for tmp in folder.glob(".*.tmp"):
        if not _TEMPORARY.fullmatch(tmp.name):
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # gone meanwhile (renamed into place), or a link
            continue
        try:
            if try_lock(fd) and same_file(fd, tmp):
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            pass  # removed by another cleaner, or a folder we may not write: left alone
        finally:
            os.close(fd)
    return removed


def digest(tensors: dict[str, torch.Tensor], header: dict | None = None) -> str:
    """SHA-256 over ``header`` (JSON with sorted keys, when given: the metadata the checksum protects) and the
    tensors' names, dtypes, shapes and bytes, in name order (stored in the file's header)."""
    h = hashlib.sha256()
    if header is not None:
        h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"|")
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
