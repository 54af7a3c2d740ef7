"""bnn_pyro: Bayesian neural networks in Pyro. One model, every inference engine, one posterior."""

from bnn_pyro import likelihoods, priors
from bnn_pyro.infer import fit
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__version__ = "0.1.0"
__all__ = ["BNN", "Posterior", "fit", "priors", "likelihoods"]
