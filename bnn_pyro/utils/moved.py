"""Old import paths of the modules that moved into subpackages, kept for one release with a warning.

The rule: ``import bnn_pyro.splits`` (or ``from bnn_pyro.splits import k_fold``) still works and gives the very
module object that ``bnn_pyro.data.splits`` is (one module, one state, so ``isinstance`` and monkeypatching see
the same classes), and warns once per old path with a ``DeprecationWarning`` that names the new path and points
at the line that imported it. ``bp.splits``-style attribute access of the names in ``bnn_pyro.__all__`` is not
deprecated and never warns: only the dotted module paths moved.

How: one meta-path finder (PEP 451), appended to ``sys.meta_path`` by ``bnn_pyro/__init__.py`` so that it is only
asked about names the package's own folders do not hold. For an old path it returns a spec whose loader hands
back the already imported new module (``create_module``) and restores that module's own ``__spec__``, which
the import system overwrites with the alias spec (``exec_module``). The import system then sets the module as an
attribute of ``bnn_pyro``; where that name already holds something else (``bp.distill`` is the function, the old
``bnn_pyro.distill`` was its module) the package's module class keeps the attribute as it was.

Remove :data:`MOVED` (and this module) in the release after 0.1.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "MovedModuleFinder", "install"]

_PACKAGE = "bnn_pyro"

# old dotted path -> new dotted path (the layout of docs/layout.md); private modules (bnn_pyro._checks, ...) are
# not listed: they were never public
MOVED: dict[str, str] = {
    **{
        f"bnn_pyro.{m}": f"bnn_pyro.posterior.{m}"
        for m in ("posterior_file", "tensor_files", "diagnostics", "psis", "plots")
    },
    **{
        f"bnn_pyro.{m}": f"bnn_pyro.tasks.{m}"
        for m in ("acquisition", "selective", "adversarial", "calibration", "conformal")
    },
    **{f"bnn_pyro.{m}": f"bnn_pyro.tools.{m}" for m in ("compression", "curves", "distill", "sbc")},
    **{f"bnn_pyro.{m}": f"bnn_pyro.data.{m}" for m in ("datasets", "splits", "zoo")},
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # stacklevel 2: the importer's line (the warnings module skips the import system's own frames)
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there. The old path stops working in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's spec on the shared module object


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


class _Package(ModuleType):
    """``bnn_pyro``'s module class: an old path imported as a submodule does not replace an attribute of the same
    name that is not a module (``import bnn_pyro.distill`` leaves ``bp.distill``, the function, in place)."""

    def __setattr__(self, name: str, value) -> None:
        current = self.__dict__.get(name)
        if (
            isinstance(value, ModuleType)
            and f"{_PACKAGE}.{name}" in MOVED
            and current is not None
            and not isinstance(current, ModuleType)
        ):
            return
        super().__setattr__(name, value)


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (a second ``install`` is a no-op) and give ``bnn_pyro`` the
    module class that keeps its attributes."""
    sys.modules[_PACKAGE].__class__ = _Package
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
