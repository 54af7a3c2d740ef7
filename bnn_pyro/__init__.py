"""bnn_pyro: Bayesian neural networks in Pyro. One model, every inference engine, one posterior.

The package's layers (docs/layout.md): the model (``model``, ``priors``, ``likelihoods``, ``inputs``,
``selection``, ``predictions``) on top of ``utils/``; ``posterior/`` (the ``Posterior`` with its diagnostics,
plots and files); ``infer/`` (the engines); ``io`` (``bp.load``) and the users of fitted posteriors
(``tasks/``, ``tools/``, ``data/``, ``comparison/``, ``cli``). Every name below is reached as ``bp.<name>``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bnn_pyro import inputs, io, likelihoods, metrics, priors
from bnn_pyro.comparison import Comparison, compare
from bnn_pyro.data import datasets, splits
from bnn_pyro.infer import distributed, fit
from bnn_pyro.io import load
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.tasks import acquisition, adversarial, calibration, conformal, selective
from bnn_pyro.tools import compression, curves
from bnn_pyro.tools.distill import distill
from bnn_pyro.utils import moved as _moved

if TYPE_CHECKING:  # imported on first use (ArviZ and matplotlib take seconds); seen by static analysis
    from bnn_pyro.data import zoo  # noqa: F401 - bp.zoo (lazy), named for static readers
    from bnn_pyro.posterior import diagnostics, plots, psis
    from bnn_pyro.tools import sbc

__version__ = "0.1.0"
__all__ = [
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
    "splits",
]

# bp.<name> -> the module it names, imported on first use
LAZY = {
    "diagnostics": "bnn_pyro.posterior.diagnostics",
    "plots": "bnn_pyro.posterior.plots",
    "psis": "bnn_pyro.posterior.psis",
    "zoo": "bnn_pyro.data.zoo",
    "sbc": "bnn_pyro.tools.sbc",
}

_moved.install()  # `import bnn_pyro.posterior_file` and the other old paths: the new module, with a DeprecationWarning


def __getattr__(name: str):
    """``bp.diagnostics``, ``bp.plots``, ``bp.psis``, ``bp.zoo`` and ``bp.sbc`` import on first use; ``bp.posterior_file``
    and ``bp.tensor_files`` (reachable before only because a submodule import set them) warn and give the new module."""
    if name in LAZY:
        return importlib.import_module(LAZY[name])
    new = _moved.MOVED.get(f"bnn_pyro.{name}")
    if new is not None:
        from bnn_pyro.utils.user_warnings import warn

        warn(
            f"bnn_pyro.{name} moved to {new}; import it from there. The old name stops working in the next release.",
            DeprecationWarning,
        )
        return importlib.import_module(new)
    raise AttributeError(f"module 'bnn_pyro' has no attribute {name!r}")
