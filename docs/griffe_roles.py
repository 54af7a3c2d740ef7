"""Griffe extension: the docstrings' Sphinx roles (``:class:`~bnn_pyro.Posterior```) as Markdown for mkdocstrings.

The library's docstrings cross-reference with Sphinx roles, which mkdocstrings does not read (it would print
``:class:`` before the name). Each role becomes inline code showing what Sphinx would show (the last component
after ``~``), and a link where the target is a public name this site documents at a fixed address: a name that
``bnn_pyro`` exports (``bnn_pyro.Posterior``, ``bnn_pyro.fit``, ``bnn_pyro.priors``, ...). Other targets (engine
internals, private modules) stay plain code, so that no link can point at a page that does not exist.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`<>]+?)(\(\))?`")


def _public() -> set[str]:
    import bnn_pyro

    return {f"bnn_pyro.{name}" for name in (*bnn_pyro.__all__, "zoo")}


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring before it is parsed."""

    def __init__(self) -> None:
        super().__init__()
        self.linkable = _public()

    def _markdown(self, match: re.Match) -> str:
        tilde, target, call = match.group(1), match.group(2).strip(), match.group(3) or ""
        shown = (target.rsplit(".", 1)[-1] if tilde else target) + call
        return f"[`{shown}`][{target}]" if target in self.linkable else f"`{shown}`"

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(self._markdown, obj.docstring.value)
