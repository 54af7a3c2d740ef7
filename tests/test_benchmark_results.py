"""benchmarks/results/ stays navigable: every path under it that the repository cites exists, every result folder
and every file in it is listed in the index (benchmarks/README.md) and in its folder's MANIFEST.md, and the
index's and manifests' links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "benchmarks" / "README.md"
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".cfg", ".toml", ".txt", ".rst", ".yml", ".yaml", ".json", ""}
NOT_CHECKED: set = set()
"""README.md is being rewritten as a front page on another branch; after that merge its citations are checked
too (remove it here)."""
CITED = re.compile(r"benchmarks/results/[\w./-]*")


def _text_files():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        hidden = [
            p
            for p in rel.parts[:-1]
            if (p.startswith(".") and p != ".ci") or p.endswith(".egg-info") or p in ("build", "dist", "__pycache__")
        ]
        if hidden or not path.is_file() or path.suffix not in TEXT_SUFFIXES or str(rel) in NOT_CHECKED:
            continue
        if RESULTS in path.parents:  # the results' own notes cite by relative names, checked below
            continue
        yield rel, path.read_text(errors="ignore")


def _citations():
    for rel, text in _text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for match in CITED.finditer(line):
                cited = match.group(0).rstrip(".")
                after = line[match.end() : match.end() + 1]
                if after in "<{*" and after:  # a template such as results/<benchmark>/ or {suffix}
                    continue
                yield f"{rel}:{number}", cited


def test_every_cited_path_under_benchmarks_results_exists():
    missing = [f"{where}: {cited}" for where, cited in _citations() if not (ROOT / cited).exists()]
    assert not missing, "cited but absent (moved? see benchmarks/README.md):\n" + "\n".join(missing)


def _folders() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def test_results_hold_folders_only_one_per_benchmark():
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert not loose, f"benchmarks/results/ holds files outside a benchmark's folder: {loose}"


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_every_result_is_in_the_index_and_its_folders_manifest(folder):
    index = INDEX.read_text()
    manifest = (folder / "MANIFEST.md").read_text()
    assert f"(results/{folder.name}/MANIFEST.md)" in index, f"{folder.name} is not listed in benchmarks/README.md"
    for path in sorted(folder.iterdir()):
        if path.name == "MANIFEST.md":
            continue
        assert f"(results/{folder.name}/{path.name})" in index, f"{folder.name}/{path.name}: not in the index"
        assert f"({path.name})" in manifest, f"{folder.name}/{path.name}: not in {folder.name}/MANIFEST.md"


def test_the_index_and_manifests_links_resolve_and_list_every_script():
    pages = [INDEX] + [folder / "MANIFEST.md" for folder in _folders()]
    broken = [
        f"{page.relative_to(ROOT)}: {link}"
        for page in pages
        for link in re.findall(r"\]\(([^)#]+)\)", page.read_text())
        if not link.startswith("http") and not (page.parent / link).exists()
    ]
    assert not broken, broken
    index = INDEX.read_text()
    unlisted = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"[{p.name}]({p.name})" not in index]
    assert not unlisted, f"benchmarks/README.md does not list {unlisted}"


def test_write_result_heads_a_result_with_its_date_commit_machine_threads_and_load(tmp_path, load_benchmark):
    import platform

    common = load_benchmark("_common")
    assert common.results_dir("speed", tmp_path / "out") == tmp_path / "out"
    assert common.RESULTS / "speed" == ROOT / "benchmarks" / "results" / "speed"  # the default folder
    path = common.write_result(tmp_path / "out" / "results.md", "| a |\n|---|\n| 1 |\n")
    head, body = path.read_text().split("\n\n", 1)
    assert re.match(r"Run \d{4}-\d\d-\d\d \d\d:\d\d UTC; commit [0-9a-f]{7,}|Run .*; commit unknown", head)
    assert platform.machine() in head and "intra-op threads" in head and "torch " in head
    assert re.search(r"load average \(1/5/15 min\) at start [\d.]+ / [\d.]+ / [\d.]+, at end ", head)
    assert body == "| a |\n|---|\n| 1 |\n"
