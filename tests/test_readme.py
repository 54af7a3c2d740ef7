"""The README's quickstart runs as written (with tiny run lengths), so it stays true to the code."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SHRINK = {r"num_steps=\d+": "num_steps=20", r"num_samples=\d+": "num_samples=4", r"num_warmup=\d+": "num_warmup=4"}


def _block(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(not README.exists(), reason="README.md is not beside the tests (installed copy)")
def test_quickstart_runs(tmp_path, monkeypatch):
    code = _block("Quickstart")
    for pattern, small in SHRINK.items():
        code = re.sub(pattern, small, code)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 4 draws trigger every convergence warning, as they should
        exec(compile(code + "\n", "README quickstart", "exec"), namespace)
    assert (tmp_path / "trace.png").exists() and (tmp_path / "posterior.bnn").exists()
    assert namespace["again"].num_draws == 4 and namespace["pred"].mean.shape == (200,)
