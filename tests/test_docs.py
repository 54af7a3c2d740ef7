"""The documentation site's API reference covers every public name (``mkdocs build --strict`` in CI checks links,
cross-references and docstrings; this checks what the build cannot: that nothing public was left out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import bnn_pyro

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


@pytest.mark.skipif(not REFERENCE.exists(), reason="docs/ is not beside the tests (installed copy)")
def test_every_public_name_has_a_reference_entry():
    directives = set()
    for page in REFERENCE.glob("*.md"):
        directives |= set(re.findall(r"^::: bnn_pyro\.([A-Za-z_]\w*)\s*$", page.read_text(), re.M))
    public = set(bnn_pyro.__all__) | {"zoo"}  # bp.zoo imports on first use, outside __all__
    missing = sorted(public - directives)
    assert not missing, f"public names without an API reference entry in docs/reference/: {missing}"
    unknown = sorted(d for d in directives if not hasattr(bnn_pyro, d) and d != "infer")
    assert not unknown, f"docs/reference/ documents names bnn_pyro does not have: {unknown}"
