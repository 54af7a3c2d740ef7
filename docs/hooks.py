"""MkDocs hook: the pages generated at build time, and the files mounted from outside ``docs/``.

- ``reference/options.md``: every method's options and defaults, read from ``bnn_pyro.infer.options(method)`` for
  each ``bnn_pyro.infer.Method`` (the engines' declarations), so the page cannot drift from the code.
- ``reference/cli.md``: ``bnn-pyro --help`` and each command's ``--help``, from ``bnn_pyro.cli.main``.
- ``tutorials/*.ipynb``: the notebooks of the top-level ``tutorials/`` folder, rendered by mkdocs-jupyter from
  their stored outputs (never executed here).
- ``benchmarks/``: the top-level ``benchmarks/`` folder (its ``README.md`` index, the scripts and every result),
  so the benchmarks page and the result files it links to are part of the site. Without a ``README.md`` there, a
  generated index lists the result files.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def _options_page() -> str:
    from bnn_pyro import infer

    lines = [
        "# Options per method",
        "",
        "Every keyword option `bp.fit(model, x, y, method=...)` takes, with its default, read at build time from",
        "`bnn_pyro.infer.options(method)` (each engine's declared configuration). What each option means is in",
        "the engine's documentation ([bp.fit and the engines](fit.md)); `bp.infer.options(method)` returns",
        "the same dictionary in Python. A default of `None` means the engine decides at fit time from the model",
        "and the data (e.g. SVI's `num_steps`, MCMC's `num_chains`); the engine's documentation says how.",
        "",
    ]
    for method in infer.Method:
        lines += [f"## `{method.value}`", "", "| option | default |", "|---|---|"]
        for name, default in infer.options(method).items():
            text = repr(default).replace("|", "\\|")
            lines.append(f"| `{name}` | `{text}` |")
        lines.append("")
    return "\n".join(lines)


def _help(argv: list[str]) -> str:
    from bnn_pyro import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(argv)
    return out.getvalue().rstrip()


def _cli_page() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps its help at the terminal's width: fix it for the page
    top = _help(["--help"])
    commands = re.search(r"\{([a-z,]+)\}", top).group(1).split(",")
    lines = [
        "# Command line: `bnn-pyro`",
        "",
        "The help of `bnn-pyro` and of each command, rendered at build time from `bnn_pyro.cli.main`. What the",
        "commands do, with examples: [Zoo and CLI](../zoo_and_cli.md).",
        "",
        "```text",
        top,
        "```",
        "",
    ]
    for command in commands:
        lines += [f"## `bnn-pyro {command}`", "", "```text", _help([command, "--help"]), "```", ""]
    return "\n".join(lines)


def _benchmarks_index() -> str:
    results = sorted(p.relative_to(ROOT / "benchmarks") for p in (ROOT / "benchmarks" / "results").rglob("*.md"))
    return (
        "\n".join(
            ["# Benchmark results", "", "Every result file under `benchmarks/results/`:", ""]
            + [f"- [{p}]({p.as_posix()})" for p in results]
        )
        + "\n"
    )


def _mounted(folder: str, config, *, suffixes: tuple[str, ...] | None = None) -> list[File]:
    base = ROOT / folder
    files = []
    for path in sorted(base.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and (suffixes is None or path.suffix in suffixes):
            files.append(
                File(
                    path.relative_to(ROOT).as_posix(),
                    src_dir=str(ROOT),
                    dest_dir=config.site_dir,
                    use_directory_urls=config.use_directory_urls,
                )
            )
    return files


@event_priority(100)  # before mkdocs-jupyter's on_files, so that it renders the mounted notebooks
def on_files(files: Files, config) -> Files:
    for file in _mounted("tutorials", config, suffixes=(".ipynb",)) + _mounted("benchmarks", config):
        files.append(file)
    if not (ROOT / "benchmarks" / "README.md").exists():
        files.append(File.generated(config, "benchmarks/README.md", content=_benchmarks_index()))
    files.append(File.generated(config, "reference/options.md", content=_options_page()))
    files.append(File.generated(config, "reference/cli.md", content=_cli_page()))
    return files
