"""The installed package: the zoo imports as bnn_pyro.models, never as a top-level `models`."""

from __future__ import annotations

import importlib
import importlib.metadata

import bnn_pyro as bp


def test_zoo_is_installed_under_the_package():
    zoo = importlib.import_module("bnn_pyro.models")
    assert zoo.__name__ == "bnn_pyro.models" and zoo.__doc__


def test_no_top_level_models_package_is_installed():
    files = importlib.metadata.files("bnn_pyro") or []
    top = {str(f).split("/")[0] for f in files}
    assert "models" not in top, top
    assert bp.__version__ == importlib.metadata.version("bnn_pyro")


def test_bundled_data_loads_from_the_installed_copy():
    x, y = bp.datasets.toy_gap()
    assert x.shape == (80, 1) and y.shape == (80,)
    assert not ((x[:, 0] > -0.5) & (x[:, 0] < 0.5)).any()  # the gap is empty


def test_every_subpackage_is_declared_in_setup_cfg():
    """A non-editable install (CI's `pip install .`) ships only the packages setup.cfg lists: a subpackage left
    out imports from a source checkout and fails from an installed copy."""
    from pathlib import Path

    from setuptools.config.setupcfg import read_configuration

    root = Path(__file__).resolve().parents[1]
    # read as setuptools reads it: a value wrapped over lines is one name per line, so a wrapped comma list
    # gives names like "bnn_pyro.posterior," that no folder has (a non-editable install then fails)
    declared = set(read_configuration(root / "setup.cfg")["options"]["packages"])
    assert all(name.isidentifier() for d in declared for name in d.split(".")), declared
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "bnn_pyro").rglob("__init__.py")}
    assert found <= declared, f"add to setup.cfg's packages: {sorted(found - declared)}"
