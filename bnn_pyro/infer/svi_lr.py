"""SVI's defaults that depend on the model and its size: the guide (:func:`default_guide`) and the learning rate per
guide (:func:`default_lr`), apart from :mod:`bnn_pyro.infer.svi` so that the fit-time health checks
(:mod:`bnn_pyro.infer._health`) can name them without importing the engine.

Example
-------
>>> default_lr("full_rank", 853)     # 1e-2 * sqrt(10 / 852)
0.0010833784750435987
>>> default_guide(plain_function=True, dim=4, full_batch=True, elbo="trace", estimator="sample")
'full_rank'
"""

from __future__ import annotations

import math

__all__ = [
    "DEFAULT_LR",
    "FACTOR_ROW_FREE",
    "CONVERGED_START_LR_FACTOR",
    "FULL_RANK_MAX_DIM",
    "default_lr",
    "default_guide",
]

DEFAULT_LR = 1e-2  # lr's default for a mean-field or MAP guide, and the most any guide gets by default
FACTOR_ROW_FREE = 10
""":func:`default_lr`: a covariance factor whose rows hold at most this many free entries keeps :data:`DEFAULT_LR`
(every full-rank guide on up to 11 coordinates: the small Pyro function models keep the rate they were checked at)."""


CONVERGED_START_LR_FACTOR = 0.25
""":func:`default_lr` for a ``"full_rank"`` guide that starts at the Laplace approximation (``converged_start``: a
Pyro function whose mode search ended at a positive definite Hessian; otherwise the guide starts at ``init_scale`` and
keeps the plain rate) with more than :data:`FACTOR_ROW_FREE` free factor entries per row: the rate is this fraction of
the one for a guide that starts elsewhere. Such a guide starts where a Gaussian posterior's optimum is, so the factor's random walk only takes
it away: on a conjugate regression with correlated coefficients the lowest sd ratio (the guide's draws against the
exact posterior) was 0.76, 0.72 and 0.65 at 100, 200 and 500 coordinates with the plain rate, 0.95, 0.92 and 0.91 at a
quarter of it, where the 1,000 draws' Monte Carlo error alone puts the lowest of 100-500 ratios near 0.93
(``benchmarks/results/svi_function_guide/``). On up to 11 coordinates (every reference posterior) the rate is
:data:`DEFAULT_LR` either way."""


def default_lr(guide, dim: int, rank: int | None = None, *, converged_start: bool = False) -> float:
    """``lr``'s default for ``guide`` on ``dim`` latent coordinates: :data:`DEFAULT_LR`, times
    ``sqrt(FACTOR_ROW_FREE / m)`` where the guide's covariance factor has ``m > FACTOR_ROW_FREE`` free entries per row
    (``m = dim - 1`` for ``"full_rank"``, ``m = rank`` for ``"low_rank"``, default ``round(sqrt(dim))`` as in Pyro),
    and times :data:`CONVERGED_START_LR_FACTOR` there for a ``"full_rank"`` guide that starts at the Laplace
    approximation (``converged_start``).

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
    if free <= FACTOR_ROW_FREE:
        return DEFAULT_LR
    factor = CONVERGED_START_LR_FACTOR if converged_start and kind == "full_rank" else 1.0
    return DEFAULT_LR * math.sqrt(FACTOR_ROW_FREE / free) * factor


FULL_RANK_MAX_DIM = 500
""":func:`default_guide`: the most latent elements (each site's ``numel``, as sampled) of a Pyro function model whose default guide is
``"full_rank"``. A full-rank guide's step costs ``O(dim^2)`` (its ``dim x dim`` Cholesky factor: the sampling, the
log-determinant and Adam over ``dim (dim + 1) / 2`` entries) against a mean-field guide's ``O(dim)``; up to this size the
whole fit stays within a small multiple of the mean-field fit (``benchmarks/results/svi_function_guide/``). Below
``svi_start.MAX_DIM``, so every such guide starts at the Laplace approximation ``N(mode, H^-1)``."""


def default_guide(*, plain_function: bool, dim: int, full_batch: bool, elbo: str, estimator: str) -> str:
    """``guide``'s default: ``"full_rank"`` for a Pyro function model (``plain_function``) with at most
    :data:`FULL_RANK_MAX_DIM` latent coordinates, trained on full-batch tensors (``full_batch``: no loader, no
    ``batch_size`` below the data's size, not ``distributed``) with ``elbo="trace"`` and ``estimator="sample"``;
    ``"mean_field"`` otherwise.

    Why full-rank there: such a model starts at the Laplace approximation (:mod:`bnn_pyro.infer.svi_start`), which a
    full-rank guide holds exactly (its covariance ``H^-1``), while a mean-field guide can only take ``1 / sqrt(H_ii)``
    per coordinate (MacKay 2003, section 33.5): several times too narrow where coefficients correlate, as they do in
    any regression on uncentered covariates (an intercept and a slope at -0.95), whatever the number of steps.
    Why mean-field elsewhere: a ``BNN``'s full-rank guide does not converge at the zoo's sizes
    (``benchmarks/results/svi_full_rank/``) and costs ``O(dim^2)`` per step (:data:`FULL_RANK_MAX_DIM`); with
    a loader the Laplace start is one batch's, not the posterior's, and under minibatch gradients (``batch_size``,
    ``distributed``) a full-rank guide's convergence was not measured;
    ``elbo="mean_field"`` (a closed-form KL), ``elbo="reinforce"`` (per-site Rao-Blackwellization) and the local
    estimators are defined for a mean-field guide."""
    if plain_function and dim <= FULL_RANK_MAX_DIM and full_batch and elbo == "trace" and estimator == "sample":
        return "full_rank"
    return "mean_field"
