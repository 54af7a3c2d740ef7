"""The library's docstrings and comments state rules, maths, references and reasons, not timings: a figure such
as "15.4 s with 2 threads" or "on a busy 2-core machine" goes stale with the next change of code or machine, so
measured figures live in benchmarks/results/ (with their date, commit, machine and load) and the docs pages that
cite them. This test reads every docstring (any string statement) and comment of bnn_pyro/ and models/ and fails
naming file:line for a timing narrative."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "bnn_pyro", ROOT / "models"]
NOT_YET_CHECKED: set[str] = set()
"""Files exempt from the check (none: every file of the library is checked)."""

_TIME = r"\d+(?:[.,]\d+)?\s?(?:s|ms|sec|seconds?|min|minutes?|h|hours?)\b"
NARRATIVES = {
    "a time with its threads or machine": _TIME + r"[^.;\n]{0,40}?\b(?:with|on|at|using)\s+(?:\d+\s+threads?|"
    r"one\s+thread|an?\s+(?:busy|loaded|shared|idle)|(?:this|the)\s+(?:\d-core|busy|loaded|shared|idle)|"
    r"\d-core|\d+\s+cores?)",
    "a machine's load": r"\b(?:busy|loaded|shared|idle)\s+(?:\d-core\s+)?machine|\b\d-core\s+machine|\bload\s+average",
    "a before/after timing": _TIME
    + r"\s*(?:\.\.\.|->|→|vs\.?|against|to)\s*"
    + _TIME
    + r"|\d+(?:\.\d+)?\s+(?:vs\.?|against)\s+"
    + _TIME,
    "a cost per step": r"\d+(?:\.\d+)?\s?(?:s|ms)\s+(?:per|/|a)\s+(?:step|leapfrog|call|draw|gradient|iteration|"
    r"transition|fit|chain)",
    "a speed ratio": r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\s+(?:faster|slower|the\s+(?:cost|time|evaluation))",
    "a wall time": r"\b(?:took|takes)\s+(?:about\s+|~)?"
    + _TIME
    + r"|\((?:\s*~\d+(?:\.\d+)?|\s*\d+\.\d+)\s?(?:ms|s)\s*\)|\(\s*\d+\s?ms\s*\)",
}
PATTERN = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(NARRATIVES.values())), re.IGNORECASE)


def _prose(path: Path):
    """(line, text) of every string statement (docstrings, attribute docstrings) and every comment."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for offset, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def narratives(path: Path) -> list[str]:
    kinds, name = list(NARRATIVES), path.relative_to(ROOT) if ROOT in path.parents else path
    return [
        f"{name}:{line}: {kinds[int(m.lastgroup[1:])]}: {m.group(0)!r}"
        for line, text in _prose(path)
        for m in PATTERN.finditer(text)
    ]


def test_no_timing_narratives_in_the_librarys_docstrings_and_comments():
    found = [
        hit
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        if str(path.relative_to(ROOT)) not in NOT_YET_CHECKED
        for hit in narratives(path)
    ]
    assert not found, (
        "timing narratives in code (move the figures to benchmarks/results/ and cite them):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "variational-dropout steps on digits took 15.4 s with 2 threads, 2.2 s with 1",
        "the same run took 24 s on a busy 2-core machine",
        "772 s ... 24 s",
        "~70 ms per leapfrog step without it",
        "Chunks of a few MB ran ~1.7x faster than chunks of ~128 MB",
        "measured: 2.1 against 6.6 ms for 80 Gaussian points",
        "takes about 25 minutes",
        "that bookkeeping costs about as much per leapfrog step (~0.45 ms) as the potential",
    ],
)
def test_the_patterns_catch_the_narratives_the_issue_names(text, tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(f'"""{text}"""\n# {text}\n')
    assert len(narratives(path)) >= 2, text  # in a docstring and in a comment


@pytest.mark.parametrize(
    "text",
    [
        "epistemic sd in the gap 6.6x that on the data",  # a quality ratio, not a timing
        "Raise FitTimeout after ``seconds`` of wall time",
        "a 10-minute run writes about 60 lines",
        "2,000 iterations per chain, 4 chains",
        "the Monte Carlo error 1 / sqrt(2 S) for S draws",
    ],
)
def test_the_patterns_leave_rules_and_quality_figures_alone(text):
    assert not PATTERN.search(text), text
