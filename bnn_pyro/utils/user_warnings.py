"""Warnings that point at the user's line.

``warnings.warn(..., stacklevel=k)`` needs ``k`` to be the number of frames between the warning and the user's
code, which differs per call path (``bp.fit`` -> engine -> health check, ``Posterior.summary`` -> diagnostics, the
CLI, ...) and breaks whenever a helper is added in between: a ``k`` too large points at ``sys:1`` or at Python's
own frames, one too small at bnn_pyro's. :func:`warn` instead counts the frames: it attributes the warning to
the caller of the outermost ``bnn_pyro`` frame on the stack (pandas' ``find_stack_level`` does the same for
pandas). The *outermost* one, not the first frame outside the package, so that a warning raised inside a
callback that Pyro or torch calls on bnn_pyro's behalf (a potential, a poutine handler) still points at the
user's ``bp.fit`` line rather than at Pyro's internals. An engine that runs another inside it renames that
engine's warnings to the method the user called (:func:`speaking_for`).

Usage::

    from bnn_pyro.utils.user_warnings import warn

    warn("svi: the ELBO has not converged ...", DiagnosticWarning)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from collections.abc import Iterator

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""Frames whose file lies under this folder are bnn_pyro's own (the zoo in ``models/`` is a user of the library)."""


def find_stack_level() -> int:
    """The ``stacklevel`` that, passed to ``warnings.warn`` by this function's caller, names the line that
    called into bnn_pyro: one past the outermost frame whose file is under :data:`PACKAGE_DIR`.

    Returns 1 (the caller itself) when no frame beyond the caller is bnn_pyro's (code outside the package
    calling this function directly)."""
    frame = sys._getframe(1)  # the caller of find_stack_level: stacklevel 1
    level, outermost = 1, 0
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIR):
            outermost = level
        frame, level = frame.f_back, level + 1
    return min(outermost + 1, level - 1)  # level - 1: the outermost frame of all (nothing called it)


_SPEAKER: contextvars.ContextVar[tuple[str, str, str] | None] = contextvars.ContextVar("bnn_pyro_speaker", default=None)


@contextlib.contextmanager
def speaking_for(method: str, label: str, note: str = "") -> Iterator[None]:
    """Within this block, a warning whose message starts with ``"{method}:"`` starts with ``"{label}:"`` instead, and
    ends with ``note`` (after a space; e.g. where the options the message advises are set for the engine run inside).

    Why: every fit-time check names the method it judges by its posterior's ``method`` (``"nuts: 3.1% of the draws
    diverged ..."``), and an engine run inside another (subspace inference's inner NUTS, fitted by ``bp.fit``) is a
    fit of its own, so its checks would name a method the user never called, and advise its options as if set on
    ``bp.fit`` with their top-level defaults. The outer engine wraps the inner fit in
    ``speaking_for("nuts", "subspace (inner nuts)", "(...)")``: one rename where the warnings are issued, for every
    check, with no check told who called it.

    Scope: a context variable, restored on exit, also when the block raises; a nested block replaces the label for
    its own extent (it does not compose with the outer one). A thread started inside the block begins with an empty
    context (unless Python's ``-X thread_inherit_context``, 3.14's default only in free-threaded builds, is on), so its
    warnings are not renamed: run its target with ``contextvars.copy_context().run``;
    a forked worker process inherits the label, a spawned one does not."""
    token = _SPEAKER.set((f"{method}:", f"{label}:", f" {note}" if note else ""))
    try:
        yield
    finally:
        _SPEAKER.reset(token)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line (see :func:`find_stack_level`), so that
    ``-W error``, ``warnings.filterwarnings(module=...)`` and the printed ``file:line`` all refer to the user's
    call, whichever path inside bnn_pyro raised it.

    Parameters
    ----------
    message:
        The warning's text: what happened, why it matters, and what to try.
    category:
        A ``Warning`` subclass; ``UserWarning`` by default, as ``warnings.warn``'s.

    Inside :func:`speaking_for`, a message that starts with its method's name names its label instead, and ends with
    its note."""
    speaker = _SPEAKER.get()
    if speaker is not None and message.startswith(speaker[0]):
        message = speaker[1] + message[len(speaker[0]) :] + speaker[2]
    warnings.warn(message, category, stacklevel=find_stack_level())
