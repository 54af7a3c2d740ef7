"""A wall-time limit for one fit (:func:`bnn_pyro.compare`'s ``time_limit``; ``benchmarks/uci.py``'s
``--max-fit-seconds``)."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["FitTimeout", "time_limit"]


class FitTimeout(BaseException):
    """A fit ran past its time limit. A ``BaseException``, as ``KeyboardInterrupt`` is, so that no engine's
    ``except Exception`` eats it; :func:`bnn_pyro.compare` turns it into the method's error row."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`FitTimeout` in the main thread after ``seconds`` of wall time (``None`` or 0: no limit).

    It uses ``SIGALRM`` (a Unix interval timer), so it needs the main thread of a Unix process; elsewhere it
    raises ``ValueError`` saying so rather than silently not limiting. The previous handler and timer are
    restored on exit. An alarm that lands inside a first import (torch and Pyro import some modules lazily, at
    a first optimizer step or compile) leaves that module half-initialized for the rest of the process: give
    limits well above a fit's start-up, not fractions of a second.
    """
    if not seconds:
        yield
        return
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "time_limit: a wall-time limit needs SIGALRM, i.e. the main thread of a Unix process; pass "
            "time_limit=None here."
        )

    def stop(signum, frame):
        raise FitTimeout(f"stopped after {seconds:g} s of wall time (the time limit)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
