"""bnn_pyro: Bayesian neural networks in Pyro. One model, every inference engine, one posterior."""

import importlib

from bnn_pyro import (acquisition, adversarial, calibration, compression, conformal, curves, datasets, inputs, io,
                      likelihoods, metrics, priors, selective)
from bnn_pyro.comparison import Comparison, compare
from bnn_pyro.infer import distributed, fit
from bnn_pyro.distill import distill
from bnn_pyro.io import load
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__version__ = "0.1.0"
__all__ = ["BNN", "Posterior", "fit", "compare", "Comparison", "load", "distill", "priors", "likelihoods", "datasets", "metrics", "diagnostics", "plots", "io", "distributed",
           "acquisition", "selective", "adversarial", "calibration", "compression", "conformal", "curves", "sbc", "psis", "inputs"]


def __getattr__(name: str):
    """``bp.diagnostics``, ``bp.plots``, ``bp.zoo``, ``bp.sbc`` and ``bp.psis`` import on first use (ArviZ and matplotlib take seconds)."""
    if name in ("diagnostics", "plots", "zoo", "sbc", "psis"):
        return importlib.import_module(f"bnn_pyro.{name}")
    raise AttributeError(f"module 'bnn_pyro' has no attribute {name!r}")
