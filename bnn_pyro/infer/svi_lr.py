"""SVI's default learning rate per guide (:func:`default_lr`), apart from :mod:`bnn_pyro.infer.svi` so that the fit-time
health checks (:mod:`bnn_pyro.infer._health`) can name it without importing the engine.

Example
-------
>>> default_lr("full_rank", 853)     # 1e-2 * sqrt(10 / 852)
0.0010833784750435987
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_LR", "FACTOR_ROW_FREE", "default_lr"]

DEFAULT_LR = 1e-2  # lr's default for a mean-field or MAP guide, and the most any guide gets by default
FACTOR_ROW_FREE = 10
""":func:`default_lr`: a covariance factor whose rows hold at most this many free entries keeps :data:`DEFAULT_LR`
(every full-rank guide on up to 11 coordinates: the small Pyro function models keep the rate they were checked at)."""


def default_lr(guide, dim: int, rank: int | None = None) -> float:
    """``lr``'s default for ``guide`` on ``dim`` latent coordinates: :data:`DEFAULT_LR`, times
    ``sqrt(FACTOR_ROW_FREE / m)`` where the guide's covariance factor has ``m > FACTOR_ROW_FREE`` free entries per row
    (``m = dim - 1`` for ``"full_rank"``, ``m = rank`` for ``"low_rank"``, default ``round(sqrt(dim))`` as in Pyro).

    Why: coordinate ``i``'s guide sd is ``scale_i * ||L_i||`` (``L`` the unit lower Cholesky factor of
    ``AutoMultivariateNormal``; ``sqrt(1 + ||W_i||^2)`` with ``W`` the ``cov_factor`` of
    ``AutoLowRankMultivariateNormal``). The ELBO's gradient in each factor entry is mostly one-particle Monte Carlo
    noise, and Adam normalizes it, so every entry moves by about ``lr`` per step whatever its signal: a random walk
    whose squared row norm grows like ``m * lr**2`` per step. Keeping ``m * lr**2`` at its value for ``m =
    FACTOR_ROW_FREE`` keeps that drift, relative to the signal, where the small models have it; at ``lr = 1e-2`` a
    full-rank guide on a 403- or 853-weight net ends with sds of 6-26 and predicts no better than a constant
    (``benchmarks/results/svi_full_rank/``). A mean-field guide has no factor and keeps :data:`DEFAULT_LR`."""
    kind = getattr(guide, "value", guide)
    if kind == "full_rank":
        free = dim - 1
    elif kind == "low_rank":
        free = rank if rank is not None else int(round(dim**0.5))
    else:
        return DEFAULT_LR
    return DEFAULT_LR * min(1.0, math.sqrt(FACTOR_ROW_FREE / max(free, 1)))
