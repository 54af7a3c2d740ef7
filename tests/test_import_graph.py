"""The package's own modules import one another without cycles, and each imports on its own.

The static check reads every ``import`` of a ``bnn_pyro`` module in ``bnn_pyro/``, those inside functions
(lazy imports) included and those under ``if TYPE_CHECKING:`` left out, and fails naming a cycle with the
file and line of each edge. The dynamic check imports each module in a fresh interpreter state: one
process loads the third-party libraries once, then forks a child per module that imports only that one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bnn_pyro

PACKAGE = Path(bnn_pyro.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("bnn_pyro",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that ``module`` imports anywhere in its file -> the line of the first import.
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: dict[str, int] = {}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            target = owner(name) if name.split(".")[0] == "bnn_pyro" else None
            if target is not None and target != module:
                edges.setdefault(target, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return edges


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_the_package_import_graph_has_no_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert {"bnn_pyro.posterior", "bnn_pyro.model", "bnn_pyro.io", "bnn_pyro.infer.mcmc"} <= set(graph)
    assert "bnn_pyro.model" in graph["bnn_pyro.posterior"]  # the graph sees real imports
    cycle = _cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({modules[a].relative_to(PACKAGE.parent)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle among bnn_pyro's modules:\n  " + "\n  ".join(edges))


def test_the_cycle_finder_finds_a_cycle_and_its_lines():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None
    modules = _modules()
    source = PACKAGE / "posterior.py"  # a lazy import inside a function counts; a TYPE_CHECKING one does not
    tree_edges = _imports("bnn_pyro.posterior", source, modules)
    assert "bnn_pyro.plots" in tree_edges and "bnn_pyro.infer.laplace.glm" in tree_edges
    assert "bnn_pyro.posterior" not in _imports("bnn_pyro.plots", PACKAGE / "plots.py", modules)


@pytest.mark.slow
def test_every_module_imports_on_its_own_in_a_fresh_interpreter(tmp_path):
    modules = sorted(_modules())
    script = textwrap.dedent("""
        import os, sys
        import arviz, matplotlib, numpy, pandas, pyro, safetensors, torch, tqdm  # third-party, loaded once
        failed = []
        for name in sys.argv[1:]:
            pid = os.fork()
            if pid == 0:  # a child with none of bnn_pyro loaded imports this one module
                try:
                    assert not any(m == "bnn_pyro" or m.startswith("bnn_pyro.") for m in sys.modules)
                    __import__(name)
                except BaseException as err:
                    print(f"{name}: {type(err).__name__}: {err}", flush=True)
                    os._exit(1)
                os._exit(0)
            if os.waitpid(pid, 0)[1] != 0:
                failed.append(name)
        print("FAILED", failed)
        sys.exit(1 if failed else 0)
    """)
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    # run outside the checkout: ``python -c`` puts the working directory first on sys.path, where the source tree's
    # bnn_pyro (without bnn_pyro.models, which setup.cfg maps from models/) would shadow the installed package
    run = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "FAILED []" in run.stdout
