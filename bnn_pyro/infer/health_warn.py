"""The one way a fit-time health check speaks: :func:`warn_diagnostic`, shared by every family of checks
(:mod:`bnn_pyro.infer._health`, :mod:`bnn_pyro.infer.health_mixing`, :mod:`bnn_pyro.infer.health_off_data`,
:mod:`bnn_pyro.infer.health_spread`)."""

from __future__ import annotations

from bnn_pyro.utils.user_warnings import warn

__all__ = ["warn_diagnostic"]


def warn_diagnostic(message: str) -> None:
    """Issue ``message`` as a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning` that points at the user's
    line (:func:`bnn_pyro.utils.user_warnings.warn`)."""
    from bnn_pyro.posterior.diagnostics import DiagnosticWarning

    warn(message, DiagnosticWarning)
