"""Advisory file locks that die with their process (``fcntl.flock``): the checkpoint folder's writer lock and
the marks of live temporary files. The OS releases a process's locks when it exits or is killed, so a lock
left by a killed process never blocks anyone: nothing needs a timeout or a pid check.

Where ``fcntl`` is missing (Windows), :func:`try_lock` always succeeds and :data:`LOCKS_WORK` is ``False``:
callers must then not take a free lock as a sign that a file's writer is gone.
"""

from __future__ import annotations

import os

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["LOCKS_WORK", "try_lock", "unlock", "same_file", "keep_from_children", "release"]

LOCKS_WORK = fcntl is not None
_HELD: set[int] = set()  # descriptors whose lock belongs to this process alone (keep_from_children)


def keep_from_children(fd: int) -> None:
    """Close ``fd`` in every child forked while it is held (e.g. a fit's chain workers): a lock lives as long as
    any copy of its descriptor, so a worker that outlives the fit would otherwise keep the folder locked."""
    _HELD.add(fd)


def release(fd: int) -> None:
    """Close ``fd`` (and with it its lock), held with :func:`keep_from_children`."""
    _HELD.discard(fd)
    os.close(fd)


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def try_lock(fd: int) -> bool:
    """Take an exclusive lock on the open file ``fd`` without waiting; ``False`` when another open file
    (another process, or another open of the same file) holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def unlock(fd: int) -> None:
    """Release the lock :func:`try_lock` took on ``fd`` (closing ``fd`` releases it too)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)


def same_file(fd: int, path: os.PathLike) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not removed or replaced meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
