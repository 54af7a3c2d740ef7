"""The package layout (docs/layout.md): the names users reach are unchanged, and the old dotted paths of the modules
that moved into subpackages still import, for one release, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import bnn_pyro as bp
from bnn_pyro.utils import moved

# bnn_pyro.__all__ and the lazily imported names as of a7736d0, before the layout change: each must stay reachable
BEFORE = [
    "BNN",
    "Posterior",
    "fit",
    "compare",
    "Comparison",
    "load",
    "distill",
    "priors",
    "likelihoods",
    "datasets",
    "metrics",
    "diagnostics",
    "plots",
    "io",
    "distributed",
    "acquisition",
    "selective",
    "adversarial",
    "calibration",
    "compression",
    "conformal",
    "curves",
    "sbc",
    "psis",
    "inputs",
    "zoo",
    "splits",
    "predictions",
    "model",
    "posterior",
    "infer",
]  # reached before as set by the package's own imports
# the public modules that moved, by their old path (private ones, bnn_pyro._checks and the like, are not aliased)
OLD_PATHS = [
    "bnn_pyro." + m
    for m in (
        "posterior_file",
        "tensor_files",
        "diagnostics",
        "psis",
        "plots",
        "acquisition",
        "selective",
        "adversarial",
        "calibration",
        "conformal",
        "compression",
        "curves",
        "distill",
        "sbc",
        "datasets",
        "splits",
        "zoo",
    )
]


@pytest.mark.parametrize("name", BEFORE)
def test_every_name_users_reached_is_reached_the_same_way_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bp.X and `from bnn_pyro import X` are not deprecated
        value = getattr(bp, name)
        exec(f"from bnn_pyro import {name} as imported", scope := {})
    assert scope["imported"] is value
    assert name in bp.__all__ or name in bp.LAZY or name in ("predictions", "model", "posterior", "infer")


@pytest.mark.parametrize("name", ["posterior_file", "tensor_files"])
def test_a_moved_module_reached_as_an_attribute_before_warns_and_gives_the_new_module(name):
    bp.__dict__.pop(name, None)  # set by an earlier import of the old dotted path, if any
    with pytest.warns(DeprecationWarning, match=f"bnn_pyro.{name} moved to bnn_pyro.posterior.{name}") as record:
        value = getattr(bp, name)
    assert value is importlib.import_module(f"bnn_pyro.posterior.{name}")
    assert record[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        bp.no_such_name


def test_all_lists_names_that_exist_and_the_lazy_ones_are_seen_statically():
    assert set(BEFORE) - {"predictions", "model", "posterior", "infer"} <= set(bp.__all__) | set(bp.LAZY)
    for name in bp.__all__:
        assert getattr(bp, name) is not None
    source = Path(bp.__file__).read_text()
    for name, path in bp.LAZY.items():  # griffe (the docs' API reference) reads these TYPE_CHECKING imports
        package, _, module = path.rpartition(".")
        assert f"from {package} import" in source and module in source
        assert getattr(bp, name) is importlib.import_module(path)


def test_the_alias_table_covers_every_moved_public_module():
    assert sorted(moved.MOVED) == sorted(OLD_PATHS)
    for old, new in moved.MOVED.items():
        assert new.rpartition(".")[2] == old.rpartition(".")[2]
        importlib.import_module(new)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_dotted_path_gives_the_new_module_and_warns_at_the_importers_line(old):
    new = moved.MOVED[old]
    sys.modules.pop(old, None)  # a previous test's import would be served from sys.modules without a warning
    code = compile(f"import {old}\nfrom {old} import __name__ as name", "user_script.py", "exec")
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as record:
        exec(code, scope := {})
    assert [w.filename for w in record if w.category is DeprecationWarning] == ["user_script.py"]
    assert sys.modules[old] is sys.modules[new]  # one module: one state, the same classes
    assert scope["name"] == new and sys.modules[new].__spec__.name == new  # the module's own spec is kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(f"import {old}", "user_script.py", "exec"), {})  # once per path: the second import is silent


def test_an_old_path_does_not_replace_the_attribute_of_the_same_name():
    """``bnn_pyro.distill`` was the module of ``bp.distill``, the function: importing the old path (which sets the
    submodule as an attribute of its package) must leave the function in place."""
    function = bp.distill
    assert callable(function) and not isinstance(function, type(bp))
    sys.modules.pop("bnn_pyro.distill", None)
    with pytest.deprecated_call():
        import bnn_pyro.distill  # noqa: F401
    assert bp.distill is function
    from bnn_pyro.distill import distill

    assert distill is function


def test_from_an_old_path_import_a_name_and_isinstance_agree():
    sys.modules.pop("bnn_pyro.splits", None)
    with pytest.deprecated_call():
        from bnn_pyro.splits import Standardizer
    from bnn_pyro.data.splits import Standardizer as New

    assert Standardizer is New


def test_paths_that_never_existed_or_were_private_still_fail():
    for name in ("bnn_pyro.no_such_module", "bnn_pyro._checks", "bnn_pyro._upstream_private"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)


def test_posterior_keeps_its_import_path():
    from bnn_pyro.posterior import Posterior

    assert Posterior is bp.Posterior and Posterior.__module__ == "bnn_pyro.posterior.core"


def test_a_fresh_interpreter_warns_once_for_an_old_path(tmp_path):
    """Outside pytest's warning capture: the default filters show a DeprecationWarning raised in __main__."""
    script = tmp_path / "old_user.py"
    script.write_text("import bnn_pyro.splits\nimport bnn_pyro.splits\nprint(bnn_pyro.splits.__name__)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "bnn_pyro.data.splits"
    assert run.stderr.count("DeprecationWarning: bnn_pyro.splits moved to bnn_pyro.data.splits") == 1
    assert "old_user.py:1:" in run.stderr


def test_importing_the_package_leaves_arviz_and_matplotlib_for_first_use(tmp_path):
    """bp.diagnostics, bp.plots and bp.psis import on first use (ArviZ and matplotlib take seconds); their
    TYPE_CHECKING imports in bnn_pyro/__init__.py must not make them eager."""
    code = (
        "import sys, bnn_pyro as bp\n"
        "print(sorted(m for m in ('arviz', 'matplotlib') if m in sys.modules))\n"
        "bp.diagnostics\n"
        "print(sorted(m for m in ('arviz', 'matplotlib') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = run.stdout.split("\n")[:2]
    assert before == "[]" and "'arviz'" in after  # the check itself sees an import when there is one
