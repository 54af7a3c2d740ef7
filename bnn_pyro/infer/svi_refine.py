"""Take a fitted full-rank, low-rank or mean-field Gaussian guide the rest of the way to its ELBO optimum: fixed-point
iterations.

The rule. For ``q = N(m, S)`` over the unconstrained coordinates ``z``, the ELBO's stationary points satisfy
``E_q[grad log p] = 0`` and ``S^-1 = E_q[-hess log p]`` (Opper & Archambeau 2009, eq. 9-10). The damped
natural-gradient step of Khan & Lin (2017) moves towards them::

    P_new = (1 - r) S^-1 + r E_q[-hess log p],     m_new = m + r P_new^-1 E_q[grad log p]

(``r = 1``: a Newton step in the mean and the fixed point in the precision). The expectations are over one fixed set
of :data:`DRAWS` standard-normal draws ``e`` in antithetic pairs (``e`` and ``-e``), mapped through the current
``(m, chol S)``: common random numbers, so that two guides are compared on the same draws, and antithetic so that
the draws' mean is exactly ``m`` (the control variate: wherever ``log p`` is quadratic its gradient is linear, and
the mean over the pairs is the exact ``E_q[grad log p]``; a Gaussian posterior is then reached in one step, with
no Monte Carlo error). The Hessians are exact per draw (:func:`bnn_pyro.infer.guide_density.derivatives`).

A mean-field guide (``AutoNormal``, diagonal ``S``): its optimum has ``S_ii^-1 = E_q[-d2 log p / dz_i^2]`` (the
diagonal of the same matrix: the ELBO's stationarity in each sd alone), so the precision's step takes the diagonal,
while the mean's step keeps the full ``E_q[-hess log p]``, which is the ELBO's curvature in the mean whatever the
family (a diagonal one would take steps too long along correlated coordinates).

A low-rank guide (``AutoLowRankMultivariateNormal``, ``S = diag(D) + W W^T`` with ``W`` of rank ``k``): with ``H =
E_q[-hess log p]`` and ``g = E_q[grad log p]`` at the current ``q``, the ELBO's gradient in ``(m, W, D)`` there equals
that of the surrogate ``g^T (m' - m) - 1/2 (m' - m)^T H (m' - m) - 1/2 tr(H S') + 1/2 log det S'`` (Bonnet's and
Price's theorems: ``d E_q[log p] / dm = g``, ``d E_q[log p] / dS = -H / 2``), so the ELBO's stationary points in the
family are the surrogate's fixed points. Its maximum in ``m'`` is the Newton step ``m + H^-1 g``; in ``S'`` it is the
family's member closest to ``N(., H^-1)`` in ``KL(q' || .)``, found by L-BFGS over ``(W', log D')`` from the current
factors (:func:`project_low_rank`; ``log det S'`` by the determinant lemma). The damped step takes that projection of
the full-rank step's precision ``(1 - r) S^-1 + r H`` (``r`` small: ``S`` itself, which is in the family) and the
mean's step ``m + r H^-1 g``, with the same draws, acceptance and stopping rules as the full-rank guide's. On a
Gaussian posterior ``H`` is its precision at every draw, so one step lands on the family's KL optimum. The draws go
through the Cholesky factor of the dense ``S`` (``dim <=`` :data:`MAX_DIM`). The result goes into Pyro 1.9's
parameters ``loc``, ``scale = sqrt(D)`` and ``cov_factor = W / scale``; so that Pyro can still factor it in the
guide's float32, ``D'_i`` is kept above :data:`DIAG_FLOOR` ``/ H_ii`` and a step it cannot factor is not taken.

Why. Adam under the cosine schedule freezes the guide wherever it is at the end; on eight schools' funnel the
default 5,000 steps stop 0.10-0.19 guide sds short of the full-rank optimum at four seeds of five
(``benchmarks/results/svi_convergence/``), and 20,000 steps are needed. The fixed point uses the curvature the
Newton-gap check already measures (:mod:`bnn_pyro.infer.svi_gap`), and on a small model a few iterations cost a
fraction of the fit: each evaluates ``dim`` gradient passes over every row per draw, hence :data:`MAX_DIM` and
:data:`MAX_WORK`.

Safeguards: a finished fit is never made worse and never fails here. A step is kept only if the ELBO estimated on the
same draws (``mean log p(z) + log det chol S``) does not fall; otherwise ``r`` is halved, down to :data:`MIN_RATE`.
The iterations stop at a fixed point (the undamped step from the current guide, the candidate's move divided by ``r``,
moves the guide less than :data:`TOL` in its own whitened frame, the mean's step and the sd along every
direction, so correlations count: judged before the candidate is evaluated, since
a step that small is below the float32 rounding of the ELBO estimate, which could reject it at every ``r``) or after
:data:`MAX_EVALUATIONS` evaluations of the draws. Where the log density, its gradient or its Hessian cannot be
evaluated or is not finite at some draw (a candidate's: that step is not taken), the expected Hessian is not positive
definite at the fitted guide, ``torch.func.vmap`` cannot batch the model (its Hessians one draw at a time would cost
minutes: :mod:`bnn_pyro.infer.guide_density`), ``dim x rows`` is over :data:`MAX_WORK`, or anything else raises, the
guide is left as it was (it is written only at the end, all its parameters or none), with the reason. The result is
written into the guide's own parameters (an ``AutoMultivariateNormal``'s ``loc``, ``scale`` and ``scale_tril``, whose
product ``scale[:, None] * scale_tril`` is the Cholesky factor; an ``AutoNormal``'s per-site ``locs`` and ``scales``;
a low-rank guide's as above), so the draws, ``post.psis()`` and the gap check see it.

Example
-------
>>> result = refine(guide, model, data)        # None where the guide is not covered
>>> result.accepted, result.elbo_change, result.stopped
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from operator import attrgetter

import torch
from pyro.distributions import constraints
from pyro.infer import autoguide
from torch.distributions import transform_to

from bnn_pyro.infer._common import Data
from bnn_pyro.infer.guide_density import VMAP_CHUNK, NoDensity, NotBatchable, derivatives, guide_target

__all__ = [
    "CHUNK_ELEMENTS",
    "DRAWS",
    "MAX_DIM",
    "MAX_EVALUATIONS",
    "MAX_WORK",
    "MIN_RATE",
    "DIAG_FLOOR",
    "PROJECTION_ITERATIONS",
    "TOL",
    "Refinement",
    "hessian_chunk",
    "project_low_rank",
    "refine",
    "write_mean",
    "write_scale",
]

DRAWS = 1000
"""Draws (500 antithetic pairs) for the expectations: the same count as the Newton gap's, whose standard error with
them is 0.005-0.08 guide sds on the references (:data:`bnn_pyro.infer.svi_gap.GAP_DRAWS`)."""
MAX_DIM = 100
"""The most unconstrained coordinates refined (and the dense ``dim x dim`` matrices it holds): one evaluation costs
``dim`` gradient passes per draw. On a linear regression with a learned noise scale (200 rows, 5,000 steps) the
refinement took 0.01-0.03 of the rest of the fit's time at 10-25 coordinates, about a quarter at 50-100, and 6 times
the fit at 200 (``benchmarks/results/svi_convergence/refine_cost.md``). The cost grows with the rows too:
:data:`MAX_WORK` bounds ``dim x rows``."""
MAX_WORK = 10_000
"""The most ``dim x rows`` (unconstrained coordinates times data rows) refined; past it the refinement is skipped and
``"skipped: ... MAX_WORK ..."`` recorded. Why: one evaluation takes ``dim`` gradient passes over every row for each of
the :data:`DRAWS` draws, while a step of the fit is one pass whose fixed per-step cost (Pyro's tracing) dominates on a
small model, so the refinement's share of the fit grows with ``dim x rows``, which :data:`MAX_DIM` alone did not
bound. On a linear regression with a learned noise scale, against a default fit
(``benchmarks/results/svi_convergence/refine_cost_rows.md``), it was 0.03-0.08 of the fit at ``dim x rows = 10,000``
with the 2-5 evaluations it needed, and 0.8-1.0 at 50,000 with 2-3: off a Gaussian it needs more evaluations (5-12 on
eight schools), so the cap is at the first; :data:`MAX_EVALUATIONS` bounds the rest."""
MAX_EVALUATIONS = 30
"""Evaluations of the draws at most (the first included): accepted and rejected steps together. Off a Gaussian the
iteration converges linearly, so it needs more than a Newton method's handful (4-10 kept steps on eight schools at
the defaults, ``benchmarks/results/svi_convergence/``)."""
MIN_RATE = 1 / 16
"""The smallest damping ``r`` tried before giving up on a step."""
TOL = 0.01
"""A fixed point: the undamped step from the current guide would move its mean by less than this many guide sds in the
guide's whitened frame (which bounds every coordinate's move in its sds) and its sd along no direction by more than
this fraction (``_moved``). A fifth of the gap check's :data:`~bnn_pyro.infer._health.GAP_MAX` and a tenth of what the 1,000 draws of
a fit resolve (``4 / sqrt(1000) = 0.13`` sds), so the steps left are below anything the fit reports. Off a Gaussian
the steps shrink geometrically, not quadratically, so a much smaller tolerance would spend many evaluations on moves
that the draws' own Monte Carlo error (the gap check's standard error, 0.03 guide sds on eight schools' ``log tau``)
swamps."""

CHUNK_ELEMENTS = 2**24
"""Draws per batched Hessian pass: at most this many over ``dim x rows`` (and at most
:data:`~bnn_pyro.infer.guide_density.VMAP_CHUNK`), since one pass holds ``dim`` reverse passes over every row for each
draw: ~64 MiB of float32 per intermediate tensor, where 250 draws of a 100-coordinate model on 100,000 rows would
want 10 GB."""

_ERRORS = (ValueError, RuntimeError, TypeError, NotImplementedError)
_COVERED = (autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal, autoguide.AutoNormal)


def hessian_chunk(dim: int, rows: int) -> int:
    """Draws per batched Hessian pass for ``dim`` coordinates over ``rows`` data rows (:data:`CHUNK_ELEMENTS`)."""
    return max(1, min(VMAP_CHUNK, CHUNK_ELEMENTS // (dim * max(1, rows))))


@dataclass(frozen=True)
class Refinement:
    """What :func:`refine` did: ``accepted`` steps, the ELBO estimate on its draws before and after
    (``elbo_change = after - before >= 0``), and ``stopped``: ``"fixed point"``, ``"no better step"`` (the ELBO
    fell at every damping down to :data:`MIN_RATE`), ``"evaluation limit"``, or ``"skipped: <reason>"`` (the guide
    untouched)."""

    accepted: int
    elbo_change: float
    stopped: str

    def record(self) -> dict:
        """A plain dict for ``post.config``."""
        return asdict(self)


@dataclass
class _Point:
    loc: torch.Tensor
    tril: torch.Tensor
    elbo: float
    grad: torch.Tensor
    precision: torch.Tensor  # E_q[-hess log p]
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None  # (W, D) of a low-rank guide's S = diag(D) + W W^T


def refine(
    guide, model, data: Data, *, num_draws: int = DRAWS, seed: int = 0, max_evaluations: int = MAX_EVALUATIONS
) -> Refinement | None:
    """Refine a fitted ``AutoMultivariateNormal``, ``AutoLowRankMultivariateNormal`` or ``AutoNormal`` of ``model`` on
    ``data`` (full batch) in place (module docstring), with ``num_draws`` draws from a generator of its own seeded with
    ``seed`` on the guide's device (the caller's random state is left as it was), in at most ``max_evaluations``
    evaluations of the draws (:data:`MAX_EVALUATIONS`, or fewer where the fit's own cost bounds them:
    :func:`~bnn_pyro.infer.svi_gap_cg.choose_path`): a :class:`Refinement`, or ``None``
    where the guide is not covered (another guide, more than :data:`MAX_DIM` coordinates). It never raises: whatever
    the model raises is recorded as ``"skipped: <type>: <message>"``, the guide untouched (it is written only at the
    end, all its parameters or none)."""
    if not isinstance(guide, _COVERED):
        return None
    device = next((p.device for p in guide.parameters()), torch.device("cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # a model drawing on its own
        try:
            return _refine(guide, model, data, num_draws, generator, max_evaluations)
        except Exception as error:  # a finished fit never fails here (module docstring)
            return Refinement(0, 0.0, f"skipped: {type(error).__name__}: {error}")


def _refine(
    guide, model, data: Data, num_draws: int, generator: torch.Generator, max_evaluations: int
) -> Refinement | None:
    try:
        target = guide_target(guide, model, data)
    except NoDensity as error:
        return Refinement(0, 0.0, f"skipped: {error}")
    if target is None or target.loc.numel() > MAX_DIM:
        return None
    dim = target.loc.numel()
    if dim * data.size > MAX_WORK:
        return Refinement(
            0, 0.0, f"skipped: {dim} coordinates x {data.size} rows is over MAX_WORK ({MAX_WORK:,}): too slow"
        )
    diagonal = isinstance(guide, autoguide.AutoNormal)
    low_rank = isinstance(guide, autoguide.AutoLowRankMultivariateNormal)
    half = torch.randn((num_draws + 1) // 2, dim, dtype=torch.float64, device=target.loc.device, generator=generator)
    draws = torch.cat([half, -half])
    chunk = hessian_chunk(dim, data.size)

    def evaluate(loc, tril, factors=None) -> _Point | str:
        z = loc + draws @ tril.T
        try:
            d = derivatives(target.pot, target.order, z.to(target.dtype), hessians=True, chunk_size=chunk)
        except NotBatchable as error:
            return f"{error}, and its Hessians one draw at a time would cost too much (guide_density)"
        except Exception as error:  # the model's own, at this step's draws: the step is not taken
            return f"the log density's Hessian could not be evaluated ({type(error).__name__}: {error})"
        values, grads, hess = d.values.double(), d.grads.double(), d.hessians.double()
        bad = int(
            (~torch.isfinite(values) | ~torch.isfinite(grads).all(-1) | ~torch.isfinite(hess).flatten(1).all(-1)).sum()
        )
        if bad:
            return f"the log density or its derivatives are not finite at {bad} of {len(draws)} draws"
        precision = -hess.mean(0)
        elbo = float(values.mean() + tril.diagonal().log().sum())
        return _Point(loc, tril, elbo, grads.mean(0), (precision + precision.T) / 2, factors)

    try:
        tril = torch.linalg.cholesky(target.cov)
    except _ERRORS as error:
        return Refinement(0, 0.0, f"skipped: the guide's covariance has no Cholesky factor ({error})")
    start = evaluate(target.loc, tril, _factors(guide) if low_rank else None)
    if isinstance(start, str):
        return Refinement(0, 0.0, f"skipped: {start}")
    if torch.linalg.cholesky_ex(start.precision).info != 0:
        return Refinement(0, 0.0, "skipped: the expected Hessian of -log p is not positive definite at the guide")
    point, rate, accepted, stopped = start, 1.0, 0, "evaluation limit"
    for _ in range(max_evaluations - 1):
        candidate = _step(point, rate, diagonal)
        if candidate is not None and _moved(point, *candidate[:2]) / rate < TOL:  # the undamped step's move
            stopped = "fixed point"
            break
        if candidate is not None and low_rank and not _storable(guide, *candidate[2]):
            candidate = None
        new = evaluate(*candidate) if candidate is not None else None
        if isinstance(new, _Point) and new.elbo >= point.elbo:
            point, accepted, rate = new, accepted + 1, min(1.0, 2 * rate)
        elif rate / 2 < MIN_RATE:
            stopped = "no better step"
            break
        else:
            rate /= 2
    if accepted and low_rank:
        _write_low_rank(guide, point.loc, *point.low_rank)
    elif accepted:
        (_write_diagonal if diagonal else _write)(guide, target, point.loc, point.tril)
    return Refinement(accepted, point.elbo - start.elbo, stopped)


def _step(point: _Point, rate: float, diagonal: bool) -> tuple | None:
    """The damped fixed-point step from ``point`` (module docstring): the new ``(loc, chol S)`` (a low-rank guide's
    with its ``(W, D)``), or ``None`` where the new precision is not positive definite. ``diagonal`` (a mean-field
    guide): the precision's fixed point is the diagonal of ``E_q[-hess log p]`` (the mean-field optimum's), while the
    mean's Newton step keeps the full matrix, the curvature of the ELBO in the mean; a low-rank guide's covariance is
    the projection of the full-rank step's onto its family (:func:`project_low_rank`), its mean step the same."""
    if point.low_rank is not None:
        precision = (1 - rate) * torch.cholesky_inverse(point.tril) + rate * point.precision
        factor, info = torch.linalg.cholesky_ex(point.precision)
        if info != 0 or not bool(torch.isfinite(precision).all()):
            return None
        w, d = project_low_rank((precision + precision.T) / 2, *point.low_rank)
        tril, info = torch.linalg.cholesky_ex(torch.diag(d) + w @ w.T)
        if info != 0:
            return None
        return point.loc + rate * torch.cholesky_solve(point.grad[:, None], factor)[:, 0], tril, (w, d)
    if diagonal:
        precision = (1 - rate) / point.tril.diagonal() ** 2 + rate * point.precision.diagonal()
        if not bool((precision > 0).all()):
            return None
        factor, info = torch.linalg.cholesky_ex(point.precision)
        if info != 0:
            return None
        return point.loc + rate * torch.cholesky_solve(point.grad[:, None], factor)[:, 0], torch.diag(precision**-0.5)
    precision = (1 - rate) * torch.cholesky_inverse(point.tril) + rate * point.precision
    factor, info = torch.linalg.cholesky_ex((precision + precision.T) / 2)
    if info != 0:
        return None
    cov = torch.cholesky_inverse(factor)
    tril, info = torch.linalg.cholesky_ex((cov + cov.T) / 2)
    if info != 0:
        return None
    return point.loc + rate * cov @ point.grad, tril


DIAG_FLOOR = 1e-3
"""The smallest ``D'_i`` of :func:`project_low_rank`, in units of ``1 / P_ii`` (the conditional variance): where ``W'``
takes a coordinate's variance whole, the projection's ``D'_i`` runs to 0, and Pyro's ``cov_factor = W / sqrt(D)``
then overflows the capacitance ``I + F^T F`` of a float32 guide (eight schools, seed 2: not positive definite). The
floor costs at most about ``DIAG_FLOOR / 2`` nats of the ELBO per coordinate."""
PROJECTION_ITERATIONS = 500
"""L-BFGS iterations at most for :func:`project_low_rank` (float64, dense at ``dim <=`` :data:`MAX_DIM`)."""


def project_low_rank(precision: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The covariance ``S' = diag(D') + W' W'^T`` of ``W``'s rank that minimizes ``tr(P S') - log det S'`` for the
    precision ``P``: the Gaussian of that family closest to ``N(., P^-1)`` in ``KL(q' || .)``, with ``D'_i >=``
    :data:`DIAG_FLOOR` ``/ P_ii``. L-BFGS over ``(W', log(D' - floor))`` from ``(W, D)``, with ``log det S' = sum log
    D' + log det(I + W'^T D'^-1 W')`` (the determinant lemma); ``(W, D)`` back where it does not finish finite."""
    w0, d0 = w.detach().double(), d.detach().double()
    diag_p, eye = precision.diagonal(), torch.eye(w0.shape[1], dtype=w0.dtype, device=w0.device)
    floor = DIAG_FLOOR / diag_p
    params = [w0.clone().requires_grad_(), (d0 - floor).clamp(min=1e-3 * floor).log().requires_grad_()]

    def objective():
        optimizer.zero_grad()
        factor, diag = params[0], floor + params[1].exp()
        inner = eye + factor.T @ (factor / diag[:, None])
        value = (diag_p * diag).sum() + (factor * (precision @ factor)).sum() - diag.log().sum() - torch.logdet(inner)
        value.backward()
        return value

    optimizer = torch.optim.LBFGS(
        params,
        lr=1,
        max_iter=PROJECTION_ITERATIONS,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )
    with torch.enable_grad():
        optimizer.step(objective)
    w1, d1 = params[0].detach(), floor + params[1].detach().exp()
    if not bool(torch.isfinite(w1).all() and torch.isfinite(d1).all()):
        return w0, d0
    return w1, d1


def _factors(guide) -> tuple[torch.Tensor, torch.Tensor]:
    """A low-rank guide's ``(W, D)``: Pyro 1.9's ``AutoLowRankMultivariateNormal`` has ``S = diag(s) (I + F F^T)
    diag(s)`` for its ``scale`` ``s`` and ``cov_factor`` ``F``, so ``W = s F`` (rows scaled) and ``D = s^2``."""
    with torch.no_grad():
        q = guide.get_posterior()
        return q.cov_factor.detach().double(), q.cov_diag.detach().double()


def _storable(guide, w: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether ``(W, D)`` written into ``guide`` gives a covariance that Pyro can factor in the guide's own dtype: its
    ``D = scale^2`` stays positive and its capacitance ``I + F^T F`` (``F = W / sqrt(D)``, :func:`_factors`) is finite
    with a Cholesky factor. Why finite too: ``cholesky_ex`` factors an infinite diagonal without an error (``[[inf]]``
    gives ``info == 0``), and a rank-1 capacitance ``1 + |F|^2`` overflows long before it could fail to be positive."""
    scale = d.sqrt().to(guide.cov_factor)
    f = (w / d.sqrt()[:, None]).to(guide.cov_factor)
    capacitance = torch.eye(f.shape[1], dtype=f.dtype, device=f.device) + f.T @ f
    return (
        bool((scale**2 > 0).all())
        and bool(torch.isfinite(capacitance).all())
        and int(torch.linalg.cholesky_ex(capacitance).info) == 0
    )


def _write_low_rank(guide, loc: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> None:
    """``(loc, W, D)`` into a low-rank guide's ``loc``, ``scale = sqrt(D)`` and ``cov_factor = W / scale``
    (:func:`_factors`), all or none (:func:`_assign`)."""
    scale = d.sqrt()
    _assign(
        [
            (guide.loc, loc),
            (guide.scale_unconstrained, transform_to(guide.scale_constraint).inv(scale)),
            (guide.cov_factor, w / scale[:, None]),
        ]
    )


def _assign(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each value into its parameter (reshaped, in the parameter's dtype and device), all or none: every value is
    computed before the first copy, and a copy that raises restores the parameters as they were before raising, so
    that a guide is never left half-written and reported as skipped (review 12)."""
    with torch.no_grad():
        values = [value.detach().reshape(param.shape).to(param) for param, value in pairs]
        saved = [param.detach().clone() for param, _ in pairs]
        try:
            for (param, _), value in zip(pairs, values):
                param.copy_(value)
        except BaseException:
            for (param, _), old in zip(pairs, saved):
                param.copy_(old)
            raise


def _moved(old: _Point, loc: torch.Tensor, tril: torch.Tensor) -> float:
    """How far ``(loc, chol S)`` is from ``old``, in the old guide's whitened frame (its sds along its own axes): the
    length of the mean's move (which bounds every coordinate's move in its sds) and the largest log ratio of sds along
    any direction (eigenvalues of ``S_old^-1/2 S S_old^-1/2``), so that a change of correlations counts too: a guide
    with the right means and marginal sds but the wrong correlations is not a fixed point (review 12)."""
    ratio = torch.linalg.solve_triangular(old.tril, tril, upper=False)
    step = torch.linalg.solve_triangular(old.tril, (loc - old.loc)[:, None], upper=False)[:, 0]
    spread = torch.linalg.eigvalsh(ratio @ ratio.T).log().abs().max() / 2
    return float(torch.maximum(step.norm(), spread))


def _write(guide, target, loc: torch.Tensor, tril: torch.Tensor) -> None:
    """``(loc, chol S)`` into an ``AutoMultivariateNormal``'s parameters: ``scale`` is the factor's diagonal and
    ``scale_tril`` its rows divided by it (unit diagonal), each stored unconstrained as Pyro stores it; all or none
    (:func:`_assign`)."""
    scale = tril.diagonal()
    unit = tril / scale[:, None]
    _assign(
        [
            (guide.loc, loc),
            (guide.scale_unconstrained, transform_to(guide.scale_constraint).inv(scale)),
            (guide.scale_tril_unconstrained, transform_to(guide.scale_tril_constraint).inv(unit)),
        ]
    )


def _write_diagonal(guide, target, loc: torch.Tensor, tril: torch.Tensor) -> None:
    """``(loc, diag(sd))`` into an ``AutoNormal``'s per-site ``locs`` and ``scales`` (in the order of ``target``), all
    or none (:func:`_assign`)."""
    shapes = target.pot.shapes
    _assign(
        _per_site(guide.locs, target.order, shapes, loc, constraints.real)
        + _per_site(guide.scales, target.order, shapes, tril.diagonal(), guide.scale_constraint)
    )


def write_mean(guide, order: list[str], shapes: dict, loc: torch.Tensor) -> None:
    """``loc`` (flat, the sites ``order`` of ``shapes``) into a Gaussian autoguide's mean only: an
    ``AutoMultivariateNormal``'s or low-rank guide's ``loc``, an ``AutoNormal``'s per-site ``locs``; all or none
    (:func:`_assign`). The mean step past the bounds (:mod:`bnn_pyro.infer.svi_refine_cg`) writes it."""
    if not isinstance(guide, autoguide.AutoNormal):
        _assign([(guide.loc, loc)])
        return
    _assign(_per_site(guide.locs, order, shapes, loc, constraints.real))


def write_scale(guide, order: list[str], shapes: dict, sd: torch.Tensor) -> None:
    """``sd`` (flat, the sites ``order`` of ``shapes``) into an ``AutoNormal``'s per-site ``scales`` only, all or none
    (:func:`_assign`). The mean-field scale step past the bounds (:mod:`bnn_pyro.infer.svi_refine_scale`) writes it."""
    _assign(_per_site(guide.scales, order, shapes, sd, guide.scale_constraint))


def _per_site(root, order: list[str], shapes: dict, flat: torch.Tensor, constraint) -> list:
    """``(parameter, value)`` pairs for :func:`_assign`: each site's slice of ``flat`` (the sites ``order`` of
    ``shapes``), mapped to the unconstrained parameter ``<site>_unconstrained`` under ``root`` (an ``AutoNormal``'s
    ``locs`` or ``scales``, where a dotted site name nests) by the inverse of ``constraint``'s transform."""
    k, pairs = 0, []
    for site in order:
        n = math.prod(shapes[site])
        *path, last = site.split(".")
        module = attrgetter(".".join(path))(root) if path else root
        pairs.append((getattr(module, f"{last}_unconstrained"), transform_to(constraint).inv(flat[k : k + n])))
        k += n
    return pairs
