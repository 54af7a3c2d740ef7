"""The package's own modules import one another without cycles, never import another module's private names,
and each imports on its own.

The static checks read every ``import`` of a ``bnn_pyro`` module in ``bnn_pyro/``, those inside functions (lazy
imports) included and those under ``if TYPE_CHECKING:`` left out. An import of ``bnn_pyro.a.b.c`` from outside the
package ``bnn_pyro.a`` also runs ``bnn_pyro/a/__init__.py`` and ``bnn_pyro/a/b/__init__.py``, so it counts as an
import of those too (the circle ``posterior -> infer.laplace.glm -> infer -> posterior`` is one that way). A cycle
fails naming the file and line of each edge; private names fail listing every offender. The dynamic check imports
each module in a fresh interpreter state: one process loads the third-party libraries once, then forks a child per
module that imports only that one.
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

# Private names still imported across bnn_pyro's modules: (importing module, owner, private name). THIS SET MUST SHRINK TO EMPTY; nothing may be
# added to it (test_the_known_private_imports_still_exist makes a removed one leave the set).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("bnn_pyro",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


class _Reader:
    """One module's imports of the package: ``edges`` (module -> line of the first import) and ``private``
    (``(line, owner module, private name)`` for each private name of another module that it reaches)."""

    def __init__(self, module: str, path: Path, modules: dict[str, Path]):
        self.module, self.modules = module, modules
        self.package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        self.edges: dict[str, int] = {}
        self.private: list[tuple[int, str, str]] = []
        self.bound: dict[str, str] = {}  # local name -> the package module it is bound to (for `mod._name`)
        tree = ast.parse(path.read_text(), filename=str(path))
        self.visit(tree)
        self.attributes(tree)

    def owner(self, name: str) -> str | None:
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def inside(self, package: str) -> bool:
        return self.module == package or self.module.startswith(package + ".")

    def edge(self, target: str, line: int) -> None:
        """``target`` and the package ``__init__`` files its import runs (those of packages the module is not in)."""
        parts = target.split(".")
        for i in range(1 if target == "bnn_pyro" else 2, len(parts) + 1):  # `import bnn_pyro` itself is an edge
            name = ".".join(parts[:i])
            if name in self.modules and name != self.module and (name == target or not self.inside(name)):
                self.edges.setdefault(name, line)

    def check_private_module(self, target: str, line: int) -> None:
        """A private module (``infer._logjoint``) may be imported only from inside its own package."""
        parts = target.split(".")
        for i, part in enumerate(parts[1:], start=1):
            if _is_private(part) and not self.inside(".".join(parts[:i])):
                self.private.append((line, ".".join(parts[:i]), part))
                return

    def visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bnn_pyro" and (target := self.owner(alias.name)):
                    self.edge(target, node.lineno)
                    self.check_private_module(target, node.lineno)
                    if alias.asname:
                        self.bound[alias.asname] = target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] == "bnn_pyro":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in self.modules else self.owner(base)
                    if target is None:
                        continue
                    if target != self.module:
                        self.edge(target, node.lineno)
                    self.check_private_module(target, node.lineno)
                    if target == full:
                        self.bound[alias.asname or alias.name] = full
                    elif _is_private(alias.name) and target != self.module:
                        self.private.append((node.lineno, target, alias.name))
        for child in ast.iter_child_nodes(node):
            self.visit(child)

    def attributes(self, tree: ast.AST) -> None:
        """``metrics._probs_and_labels`` where ``metrics`` was imported as a package module."""
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and _is_private(node.attr)
                and (owner := self.bound.get(node.value.id))
                and owner != self.module
            ):
                if f"{owner}.{node.attr}" not in self.modules or not self.inside(owner):
                    self.private.append((node.lineno, owner, node.attr))


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that ``module`` imports anywhere in its file (and the package ``__init__`` files
    that those imports run) -> the line of the first import. ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``."""
    return _Reader(module, path, modules).edges


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
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
    assert {"bnn_pyro.posterior.core", "bnn_pyro.model", "bnn_pyro.io", "bnn_pyro.infer.mcmc"} <= set(graph)
    assert "bnn_pyro.model" in graph["bnn_pyro.posterior.core"]  # the graph sees real imports
    assert "bnn_pyro.posterior" in graph["bnn_pyro.infer.mcmc"]  # and the package __init__ files they run
    cycle = _cycle(graph)
    if cycle:
        edges = [
            f"{a} -> {b} ({modules[a].relative_to(PACKAGE.parent)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])
        ]
        pytest.fail("import cycle among bnn_pyro's modules:\n  " + "\n  ".join(edges))


def test_the_cycle_finder_finds_a_cycle_and_its_lines():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None
    modules = _modules()
    source = PACKAGE / "posterior" / "core.py"  # a lazy import inside a function counts; a TYPE_CHECKING one does not
    tree_edges = _imports("bnn_pyro.posterior.core", source, modules)
    assert "bnn_pyro.posterior.plots" in tree_edges and "bnn_pyro.posterior.psis" in tree_edges
    assert "bnn_pyro.posterior" not in tree_edges  # its own package's __init__ is not an edge
    assert "bnn_pyro.posterior.core" not in _imports(
        "bnn_pyro.posterior.plots", PACKAGE / "posterior" / "plots.py", modules
    )


def test_an_import_of_a_submodule_runs_its_packages_init(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from bnn_pyro.infer.laplace.glm import functional_moments\n")
    edges = _imports("bnn_pyro.posterior.core", source, _modules())
    assert edges == {"bnn_pyro.infer.laplace.glm": 2, "bnn_pyro.infer.laplace": 2, "bnn_pyro.infer": 2}
    source.write_text("def f():\n    import bnn_pyro as bp\n")  # the package itself (its __init__ imports everything)
    assert _imports("bnn_pyro.comparison.sources", source, _modules()) == {"bnn_pyro": 2}


# The layers of docs/layout.md, bottom first: a module may import its own layer and those below, never one above.
LAYERS = [
    ("bnn_pyro.utils", "bnn_pyro.inputs", "bnn_pyro.predictive_draws", "bnn_pyro.predictions"),  # leaf helpers, types
    ("bnn_pyro.priors", "bnn_pyro.selection", "bnn_pyro.likelihoods", "bnn_pyro.model", "bnn_pyro.metrics"),  # model
    ("bnn_pyro.posterior",),  # the Posterior, its diagnostics, plots and files
    ("bnn_pyro.infer", "bnn_pyro.io"),  # the engines; bp.load
    ("bnn_pyro.tasks", "bnn_pyro.tools", "bnn_pyro.data", "bnn_pyro.comparison"),  # users of posteriors
    ("bnn_pyro", "bnn_pyro.cli"),  # the package's __init__ (the API assembled) and the command line over it
]


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix of ``module``."""
    found = [(len(p), i) for i, layer in enumerate(LAYERS) for p in layer if module == p or module.startswith(p + ".")]
    assert found, f"{module} is in no layer of LAYERS: add it (and to docs/layout.md)"
    return max(found)[1]


def test_no_import_runs_up_a_layer():
    modules = _modules()
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (layer {_layer(module)}) imports {target} "
        f"(layer {_layer(target)})"
        for module, path in modules.items()
        for target, line in _imports(module, path, modules).items()
        if _layer(target) > _layer(module)
    ]
    if upward:
        pytest.fail("imports that run up a layer (docs/layout.md):\n  " + "\n  ".join(sorted(upward)))


def test_the_layer_check_sees_an_upward_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from bnn_pyro.tasks import selective\n")  # a lazy import counts too
    edges = _imports("bnn_pyro.posterior.plots", source, _modules())
    assert {_layer(t) for t in edges} == {4} and _layer("bnn_pyro.posterior.plots") == 2
    assert (
        _layer("bnn_pyro.utils.checks") == 0 and _layer("bnn_pyro") == 5 and _layer("bnn_pyro.infer.laplace.glm") == 3
    )


def _private_imports() -> list[str]:
    modules = _modules()
    found = []
    for module, path in modules.items():
        for line, owner, name in _Reader(module, path, modules).private:
            if (module, owner, name) not in KNOWN_PRIVATE_IMPORTS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {owner}.{name}")
    return sorted(set(found))


def test_no_module_imports_another_modules_private_name():
    offenders = _private_imports()
    if offenders:
        pytest.fail(
            "private names imported across bnn_pyro's modules (give what is shared a public name in a small "
            "internal module, e.g. bnn_pyro/utils/):\n  " + "\n  ".join(offenders)
        )


def test_the_known_private_imports_still_exist():
    """Each known exception is still in use: one that was removed must leave the set (so the set only shrinks)."""
    modules = _modules()
    used = {
        (module, owner, name)
        for module, path in modules.items()
        for _, owner, name in _Reader(module, path, modules).private
    }
    assert not KNOWN_PRIVATE_IMPORTS - used, (
        f"no longer imported, remove from KNOWN_PRIVATE_IMPORTS: {KNOWN_PRIVATE_IMPORTS - used}"
    )


def test_the_private_name_finder_sees_each_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        textwrap.dedent("""
        from bnn_pyro.metrics import _probs_and_labels, accuracy
        from bnn_pyro import predictions
        from bnn_pyro.infer import _logjoint
        import bnn_pyro.infer._common as common
        from bnn_pyro.utils.checks import positive
        def f():
            return predictions._entropy, predictions.__name__
        if TYPE_CHECKING:
            from bnn_pyro.model import _secret
    """)
    )
    private = sorted((o, n) for _, o, n in _Reader("bnn_pyro.tasks.m", source, _modules()).private)
    assert private == [
        ("bnn_pyro.infer", "_common"),
        ("bnn_pyro.infer", "_logjoint"),
        ("bnn_pyro.metrics", "_probs_and_labels"),
        ("bnn_pyro.predictions", "_entropy"),
    ]
    inside = _Reader("bnn_pyro.infer.mcmc", source, _modules()).private  # infer's own private modules are its own
    assert sorted((o, n) for _, o, n in inside) == [
        ("bnn_pyro.metrics", "_probs_and_labels"),
        ("bnn_pyro.predictions", "_entropy"),
    ]


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
    run = subprocess.run(
        [sys.executable, "-c", script, *modules], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "FAILED []" in run.stdout
