"""The README's quickstart and the docs pages' worked blocks run as written (with tiny run lengths), so they stay
true to the code; the README stays a front page whose links lead somewhere."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHRINK = {r"num_steps=\d+": "num_steps=20", r"num_samples=\d+": "num_samples=4", r"num_warmup=\d+": "num_warmup=4"}


def _block(title: str, page: Path = README) -> str:
    """The first ``python`` block under the heading ``## {title}`` of ``page`` (the README or a docs page)."""
    text = page.read_text()
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


@pytest.mark.skipif(not README.exists(), reason="README.md is not beside the tests (installed copy)")
def test_using_a_posterior_runs():  # docs/guide/using_a_posterior.md, the README links to it
    import matplotlib.pyplot as plt

    code = _block("Active learning, rejection, OOD detection", DOCS / "guide" / "using_a_posterior.md")
    for pattern, small in SHRINK.items():
        code = re.sub(pattern, small, code)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 20 SVI steps and 4 draws: fits warn, as they should
        exec(compile(code + "\n", "README using a posterior", "exec"), namespace)
    plt.close("all")
    assert namespace["picked"].shape == (10,) and namespace["sets"].shape == (397, 10)
    assert set(namespace["selective"].ood_detection(namespace["pred"], namespace["pred"])) == {"auroc", "aupr", "fpr95"}
    assert namespace["interval"].interval == pytest.approx(0.9)


@pytest.mark.skipif(not README.exists(), reason="README.md is not beside the tests (installed copy)")
def test_compression_block_runs():
    code = _block("Compression", DOCS / "guide" / "using_a_posterior.md")
    for pattern, small in SHRINK.items():
        code = re.sub(pattern, small, code)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code + "\n", "README compression", "exec"), namespace)
    assert namespace["small"].num_draws == 1 and namespace["post"].method == "sparse_vd"
    assert list(namespace["quantization_report"](namespace["post"]).index) == ["0.weight", "2.weight", "all"]


@pytest.mark.skipif(not README.exists(), reason="README.md is not beside the tests (installed copy)")
def test_sequence_models_block_runs():
    code = _block("Sequence and embedding models", DOCS / "guide" / "models.md")
    for pattern, small in SHRINK.items():
        code = re.sub(pattern, small, code)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 20 SVI steps: the fit warns, as it should
        exec(compile(code + "\n", "README sequence models", "exec"), namespace)
    pred, post = namespace["pred"], namespace["post"]
    assert post.x.dtype == namespace["torch"].int64 and pred.probs.shape == (5, 10, 4)
    assert pred.mutual_information.shape == (5, 10)


@pytest.mark.skipif(not README.exists(), reason="README.md is not beside the tests (installed copy)")
def test_readme_is_a_front_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "the README is the front page: move detail into docs/ and link it"
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    for section in (
        "## Set up",
        "## Quickstart",
        "## Engines",
        "## Custom priors",
        "## Switching SVI and MCMC",
        "## Trace plots, R-hat and function-space diagnostics",
    ):
        assert section in text, f"README section {section!r} is missing"
