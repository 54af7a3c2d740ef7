"""Progress bars: a tqdm bar on a terminal, a plain line every few seconds anywhere else.

A tqdm bar redraws itself with carriage returns up to ten times a second. On a terminal that is one line
that moves; where stderr is not a terminal (a CI log, a file, a notebook run headless by nbconvert or
papermill, a Jupyter kernel) every redraw stays, and a long fit leaves thousands of lines. So
:func:`progress_bar` draws tqdm's bar only when ``sys.stderr.isatty()``; otherwise it returns a
:class:`LineProgress`, which prints one ``desc: n/total (pct%) elapsed, postfix`` line at most every
:data:`LINE_INTERVAL` seconds and one final line when the run ends. ``enabled=False`` (``progress=False``
in ``bp.fit``) prints nothing in either mode.

Usage::

    with progress_bar(num_steps, "svi chain 0", enabled=True) as bar:
        for step in range(num_steps):
            ...
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.update()
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm

__all__ = ["LINE_INTERVAL", "LineProgress", "progress_bar"]

LINE_INTERVAL = 10.0
"""Seconds between two plain lines: a 10-minute run writes about 60 lines, yet a stalled one shows within
seconds that it is still alive."""


class LineProgress:
    """The part of tqdm's interface that bnn_pyro's loops use (``update``, ``set_postfix``, ``set_description``,
    ``close``, a context manager), written as plain lines to ``file``: one when :data:`LINE_INTERVAL` seconds
    have passed since the last (checked at each ``update``), and one at ``close``.

    Parameters
    ----------
    total:
        The number of steps (``update`` calls of 1) in the run.
    desc:
        The run's label, first on every line (e.g. ``"nuts chain 0"``).
    enabled:
        False prints nothing (as tqdm's ``disable=True``).
    file:
        Where the lines go; ``sys.stderr`` (looked up at each line, so that redirections apply) by default.
    interval:
        Seconds between two lines; :data:`LINE_INTERVAL` by default."""

    def __init__(self, total: int, desc: str = "", *, enabled: bool = True, file=None, interval: float = LINE_INTERVAL):
        self.total, self.desc, self.enabled, self.file, self.interval = total, desc, enabled, file, interval
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled and time.monotonic() - self.last >= self.interval:
            self._line()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = desc

    def close(self) -> None:
        if self.enabled and not self.closed:
            self._line(final=True)
        self.closed = True

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, final: bool = False) -> None:
        now = time.monotonic()
        self.last = now
        done = f"{self.n}/{self.total}" + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")
        extra = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        text = (f"{self.desc}: " if self.desc else "") + done + f" {tqdm.format_interval(now - self.start)}"
        text += (f", {extra}" if extra else "") + (" done" if final else "")
        file = self.file or sys.stderr
        print(text, file=file, flush=True)


def progress_bar(total: int, desc: str, enabled: bool, position: int | None = None, *, leave: bool = False):
    """A progress display over ``total`` steps: tqdm's bar when stderr is a terminal, else a :class:`LineProgress`
    (one line every :data:`LINE_INTERVAL` seconds and a final one); nothing at all when ``enabled`` is False.

    ``position`` is the bar's terminal line, for bars drawn side by side by several processes (parallel MCMC
    chains; plain lines carry their ``desc`` instead). ``leave``: keep tqdm's bar on screen once closed (the
    plain mode always ends with its final line)."""
    if enabled and not _is_terminal(sys.stderr):
        return LineProgress(total, desc, enabled=True)
    return tqdm(total=total, desc=desc, disable=not enabled, leave=leave, dynamic_ncols=True, position=position)


def _is_terminal(stream) -> bool:
    """Whether ``stream`` is an interactive terminal; False for a stream without ``isatty`` or a closed one."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
