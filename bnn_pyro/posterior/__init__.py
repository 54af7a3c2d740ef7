"""The posterior layer: the :class:`Posterior` every engine returns (:mod:`.core`), what it delegates to
(:mod:`.diagnostics`, :mod:`.psis`, :mod:`.plots`, imported on first use), a Laplace posterior's linearized
network (:mod:`.linearized`) and its files (:mod:`.posterior_file`, :mod:`.tensor_files`).

Import rule (docs/layout.md): modules here import the model layer (``bnn_pyro.model``, ``likelihoods``,
``metrics``, ``predictions``, ...) and ``bnn_pyro.utils``, never ``bnn_pyro.infer`` or anything above it; the
modules the Posterior delegates to take it as an argument (typed under ``TYPE_CHECKING``) and never import
:mod:`.core`.
"""

from bnn_pyro.posterior.core import Posterior

__all__ = ["Posterior"]
