"""Subspace inference's structural limit (issue 26): what part of the posterior's spread, in the net's outputs at the
training inputs and in each weight, a ``k``-dimensional subspace ``w_hat + P z`` can hold, and the fit-time check
that says when it is too little (:func:`check_subspace`, called by :func:`bnn_pyro.infer.subspace.fit_subspace`).

Confined to the affine subspace spanned by a basis ``B`` through the mean, a Gaussian ``N(mu, H^{-1})`` has covariance
``B (B^T H B)^{-1} B^T`` (the precision restricted to the subspace; Rasmussen & Williams 2006, A.2), so a weight keeps
the fraction ``diag(B (B^T H B)^{-1} B^T) / diag(H^{-1})`` of its variance (:func:`subspace_variance_held`). With the
induced prior the subspace posterior is the net's conditioned on the subspace, so no inner engine, however long it
runs, exceeds that fraction. ``H`` is the Laplace precision at the draws' mean as ``method="laplace"`` forms it with
``structure="full", hessian="ggn"`` (:mod:`bnn_pyro.infer.laplace.curvature`, :mod:`bnn_pyro.infer.laplace.ggn`):
one implementation of the generalized Gauss-Newton for both. The measured figures are in ``docs/reference_suite.md``
("Subspace inference: what ``k`` directions can hold") and ``benchmarks/results/subspace_held/``.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer._health import PREDICTIVE_ROWS
from bnn_pyro.infer.health_spread import NARROW_MAX, unconstrained_draws
from bnn_pyro.infer.health_warn import warn_diagnostic
from bnn_pyro.infer.laplace.curvature import terms
from bnn_pyro.infer.laplace.fit import make_settings
from bnn_pyro.infer.laplace.functional import output_jacobian
from bnn_pyro.infer.laplace.priors import potentials
from bnn_pyro.infer.laplace.structure import make_layout
from bnn_pyro.infer.training_data import Data
from bnn_pyro.inputs import Inputs

__all__ = ["SUBSPACE_HELD_MIN", "check_subspace", "laplace_precision", "linear_in_weights", "subspace_variance_held"]

SUBSPACE_HELD_MIN = 1.0 / NARROW_MAX**2
""":func:`check_subspace` warns when some output of the net at the training inputs (or, for a net whose outputs are
linear in its weights, some weight) keeps less than this fraction of its variance under the Laplace approximation
once the weights are confined to the subspace (0.44: an sd below ``1 / NARROW_MAX`` of the full one, the factor by
which :func:`~bnn_pyro.infer.health_spread.check_narrow` and the reference suite's approximations may be narrow)."""


def subspace_variance_held(precision: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the fraction of a Gaussian's variance that remains when it is confined to the affine subspace
    spanned by ``basis``'s columns (``P x m``, linearly independent) through its mean: the covariance of
    ``N(mu, H^{-1})`` conditioned on ``w = mu + B z`` is ``B (B^T H B)^{-1} B^T`` (the precision restricted to the
    subspace; Rasmussen & Williams 2006, A.2), so the fraction is ``diag(B (B^T H B)^{-1} B^T) / diag(H^{-1})``, in
    ``[0, 1]`` (conditioning never adds variance); 1 where the subspace is the whole space. ``precision``: ``H``,
    ``P x P``, symmetric positive definite. Float64."""
    within, full = _subspace_covariance(precision, basis)
    return within.diagonal() / full.diagonal()


def _subspace_covariance(precision: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B (B^T H B)^{-1} B^T, H^{-1})`` (float64): the covariance confined to the subspace, and the full one."""
    h = precision.double()
    q = torch.linalg.qr(basis.double())[0]  # the same subspace, orthonormal columns: the formula is basis-invariant
    return q @ torch.linalg.solve(q.T @ h @ q, q.T), torch.cholesky_inverse(torch.linalg.cholesky(h))


def laplace_precision(post, pot, mean: torch.Tensor, weight_sites: list[str]) -> tuple:
    """``(H, J)``: the Laplace precision ``H`` (``P x P``, float64) of ``post``'s ``BNN`` at the flat unconstrained
    ``mean`` of ``pot``'s coordinates, on its training tensors, and the Jacobian ``J`` (``R * out x w``, float64) of the
    net's outputs at :data:`~bnn_pyro.infer._health.PREDICTIVE_ROWS` evenly spaced training rows in the coordinates of
    ``weight_sites``, as far as the likelihood depends on them (``Likelihood.identified``: a ``Categorical``'s logits
    centred over the classes, whose common shift the data never see, as
    :func:`~bnn_pyro.infer.health_mixing.check_mixing` judges them); ``(None, None)`` for a net whose outputs are not ``(N, out)`` (a sequence model's
    ``(N, T, out)``: not judged).

    ``H`` is the one ``method="laplace"`` forms at its mode with ``structure="full", hessian="ggn"``
    (:func:`bnn_pyro.infer.laplace.curvature.terms`): the exact Hessian of the prior part of the potential
    (log-Jacobians included) over every coordinate, plus the likelihood's generalized Gauss-Newton
    ``sum_i J_i^T Lambda_i J_i`` in the weights (MacKay 1992; Immer et al. 2021; ``Lambda_i`` the Hessians of
    ``-log p(y_i | f_i)`` in the outputs, projected onto the positive semi-definite matrices) and the exact Hessian of
    ``-log p(y | f, noise)`` in a learned noise's coordinates, with no coupling between the weights and the noise (their
    Fisher is zero, the residuals' mean being zero under the model). Why the GGN: at a network's draws' mean (not a
    mode) the exact Hessian is often indefinite, the GGN never; where the outputs are linear in the weights (a linear
    or logistic regression) the two are equal, so there ``H`` is the exact posterior's precision. Why no coupling: the
    exact cross term, ``-2 sum_i r_i J_i / sigma^2`` for a Gaussian, made the precision indefinite on the gap data's
    net at ``subspace_dim=10``. The net is evaluated in eval mode (dropout off), as Laplace's curvature is."""
    model, x = post.model, post.x
    mean = mean.to(x.device)
    data = Data(x, post.y)
    settings = make_settings(model, data, structure="full", hessian="ggn")
    layout = make_layout(model, pot, settings.structure)  # every coordinate, in pot's flat order, dense
    probe = x[torch.linspace(0, x.shape[0] - 1, min(x.shape[0], PREDICTIVE_ROWS)).long()]
    w_idx = layout.indices(weight_sites)
    f, jac = output_jacobian(model, pot, mean, probe, w_idx)
    if f.dim() != 2:
        return None, None
    jac = model.likelihood.identified(jac, dim=1)  # (R, out, w): a Categorical's logits centred over the classes
    likelihood, prior = terms(model, potentials(model, data, pot, mean, None, None), mean, data, layout, settings)
    hess = likelihood.hess + prior.hess
    return (hess + hess.T) / 2, jac.reshape(-1, len(w_idx))


def _rows_not_judged(model, x) -> str | None:
    """Why the check cannot take per-row Jacobians of the net's ``(N, out)`` outputs (as Laplace's curvature, which
    refuses these up front; a subspace fit runs, its check not judged: review 28), else ``None``."""
    if isinstance(x, Inputs):
        return "x is a tuple or dict of tensors: the check takes per-row Jacobians of one input tensor"
    if len(model.output_shape(x[:2])) > 1:
        return "the net returns sequence outputs (N, T, out): the check judges (N, out) outputs"
    if not model.vmappable and not model.reads_values:
        return "torch.func.vmap cannot batch the net (recurrent layers, or a forward whose vmap failed)"
    return None


def linear_in_weights(model) -> bool:
    """Whether a ``BNN``'s outputs are linear in its weights: its net is one ``torch.nn.Linear`` layer, alone or with
    only parameter-free reshaping around it (``Flatten``, ``Identity``), as
    :mod:`bnn_pyro.infer.laplace.quadratic` detects a net whose features are ``x`` (a linear or logistic
    regression). There the weights are the model's coefficients, so their marginals are quantities of interest."""
    net = getattr(model, "net", None)
    if not isinstance(net, torch.nn.Module):
        return False
    leaves = [m for m in net.modules() if not list(m.children())]
    linear = [m for m in leaves if isinstance(m, torch.nn.Linear)]
    return len(linear) == 1 and all(
        isinstance(m, (torch.nn.Linear, torch.nn.Flatten, torch.nn.Identity)) for m in leaves
    )


def check_subspace(post, *, directions: dict[str, torch.Tensor], rank: int, prior: str, deviations: int | None = None):
    """Warn when subspace inference's draws cannot hold the posterior's spread in what a user reads: confined to
    ``w_hat + P z``, some output of the net at the training inputs keeps less than :data:`SUBSPACE_HELD_MIN` of its
    linearized variance under the Laplace approximation at the draws' mean, or, for a net whose outputs are linear in
    its weights (:func:`linear_in_weights`: a linear or logistic regression), some weight keeps less than that of its
    marginal variance (:func:`subspace_variance_held`; the precision of :func:`laplace_precision`; the model's other
    latent sites, e.g. a learned noise, stay free, as the inner engine samples them).

    Why these quantities: with the induced prior (``prior="induced"``, the default) the posterior over ``z`` is the
    net's posterior conditioned on the subspace, and for a Gaussian posterior that conditional's covariance is
    exactly ``B (B^T H B)^{-1} B^T``; no sampler over ``z``, however long, exceeds it. An output ``f_i = J_i w``
    (linearized) keeps ``J_i B (B^T H B)^{-1} B^T J_i^T / J_i H^{-1} J_i^T`` of its variance. Subspace inference is
    about the function (Izmailov et al. 2019): ``k`` directions cannot hold the marginals of a net's many weights, yet
    can hold most of its outputs' spread, so a net's weights are reported, not judged; where the outputs are linear in
    the weights the weights are the model's coefficients, and are judged too. False alarms: none where the subspace
    holds the spread (the whole weight space holds exactly all of it, a subspace along the posterior's dominant
    directions nearly all); near the threshold the Gaussian's fraction can sit a few percent below a non-Gaussian
    posterior's (the logistic reference at ``subspace_dim=2``: sds predicted 0.64-0.67 of the exact ones, the draws'
    0.67-0.72), so a fit just inside the 1/1.5 bound can be flagged.

    ``directions``: per weight site, the SWA run's principal directions (``K x *shape``: row ``j`` is direction ``j``'s
    values there, leading directions first), of which the first ``rank`` span the subspace; the smallest number of them
    that would hold the threshold in every judged quantity, if any, is suggested. ``deviations``: the number of SWA
    deviations kept, ``K``; where the subspace already holds every direction they span and they span fewer than
    ``K``, a larger ``subspace_dim`` is refused and more deviations need not add any, so none is advised. The outputs are the net's at
    :data:`~bnn_pyro.infer._health.PREDICTIVE_ROWS` evenly spaced training rows. Judged as
    :func:`~bnn_pyro.infer.health_spread.check_narrow` judges (a ``BNN`` with training tensors, at most
    :data:`~bnn_pyro.infer.health_spread.NARROW_MAX_DIM` latent coordinates, a positive definite precision at the draws'
    mean); not judged under ``prior="isotropic"`` (its prior over ``z`` is not the net's, so there is no conditional
    to hold it to). The figures (each weight's and the outputs' fractions, and which criteria fired) go to
    ``post.config["subspace"]["held"]``, or why it was not judged. Returns ``post``."""
    record = post.config.setdefault("subspace", {})
    if prior != "induced":
        record["held"] = {"judged": False, "reason": f"prior={prior!r}: the prior over z is not the net's"}
        return post
    judged = unconstrained_draws(post, init="net") if post.x is not None and post.y is not None else None
    if judged is None or not set(directions) <= set(judged[0].shapes):
        record["held"] = {"judged": False, "reason": "a model or posterior check_narrow does not judge either"}
        return post
    why = _rows_not_judged(post.model, post.x)
    if why is not None:
        record["held"] = {"judged": False, "reason": why}
        return post
    pot, flat = judged
    precision, jac = laplace_precision(post, pot, flat.mean(0), list(directions))
    chol, info = torch.linalg.cholesky_ex(precision if precision is not None else torch.zeros(1, 1))
    if int(info) != 0 or not bool(torch.isfinite(precision).all()):
        record["held"] = {"judged": False, "reason": "the precision at the draws' mean is not positive definite"}
        return post
    rows, free, names, start = [], [], [], 0  # each coordinate's row of the basis; the non-weight ones stay free
    total = directions[next(iter(directions))].shape[0]
    for name, shape in pot.shapes.items():
        n = math.prod(shape)
        if name in directions:
            rows.append(directions[name].reshape(total, n).T.double().to(precision.device))
            names += [f"{name}[{i}]" for i in range(n)]
        else:
            rows.append(precision.new_zeros(n, total))
            free += range(start, start + n)
        start += n
    full = torch.cat(rows)
    weights = torch.tensor([i for i in range(pot.dim) if i not in set(free)], dtype=torch.long)
    whole = torch.cholesky_inverse(chol)[weights][:, weights]
    f_whole = ((jac @ whole) * jac).sum(1)  # the outputs' linearized variance, the weights free
    judge_weights = linear_in_weights(post.model)

    def held(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each weight's fraction held, each output's) by the first ``k`` directions."""
        basis = torch.cat([full[:, :k], torch.eye(pot.dim, dtype=full.dtype, device=full.device)[:, free]], 1)
        within = _subspace_covariance(precision, basis)[0][weights][:, weights]
        return within.diagonal() / whole.diagonal(), ((jac @ within) * jac).sum(1) / f_whole

    def fired(k: int) -> list[str]:
        fraction, outputs = held(k)
        said = ["outputs"] if float(outputs.min()) < SUBSPACE_HELD_MIN else []
        return said + (["weights"] if judge_weights and float(fraction.min()) < SUBSPACE_HELD_MIN else [])

    exhausted = deviations is not None and rank == total < deviations  # no larger subspace_dim to advise
    fraction, outputs = held(rank)
    criteria = fired(rank)
    suggested = next((k for k in range(rank + 1, total + 1) if not fired(k)), None) if criteria else None
    worst = int(fraction.argmin())
    record["held"] = {
        "judged": True,
        "names": names,
        "variance_held": [float(f) for f in fraction],
        "laplace_sd": [float(v) for v in whole.diagonal().sqrt()],
        "worst": names[worst],
        "outside": 1.0 - float(fraction[worst]),
        "threshold": SUBSPACE_HELD_MIN,
        "weights_judged": judge_weights,
        "fired": criteria,
        "suggested_subspace_dim": suggested,
        "function_variance_held": {"median": float(outputs.median()), "min": float(outputs.min())},
    }
    if criteria:
        _warn_short(post, names, fraction, outputs, criteria, rank, total, suggested, exhausted)
    return post


def _warn_short(post, names, fraction, outputs, criteria, rank, total, suggested, exhausted) -> None:
    """The warning of :func:`check_subspace`: which criterion fired (the outputs' share held; the weights below
    :data:`SUBSPACE_HELD_MIN`, for a net linear in its weights), the figures, and what to try."""
    bound = f"{SUBSPACE_HELD_MIN:.0%} (an sd 1/{NARROW_MAX:g} of the full one)"
    f_said = (
        f"the network's outputs at the training inputs keep a median {float(outputs.median()):.0%} of their "
        f"linearized variance, min {float(outputs.min()):.0%}"
    )
    parts = []
    if "outputs" in criteria:
        parts.append(
            f"{f_said}, below {bound}: post.predict()'s spread (its intervals of f) is too small where the outputs "
            "lose it"
        )
    if "weights" in criteria:
        short = [i for i in fraction.argsort().tolist() if float(fraction[i]) < SUBSPACE_HELD_MIN]
        listed = ", ".join(f"{names[i]} {float(fraction[i]):.0%}" for i in short[:3])
        more = f" and {len(short) - 3} more" if len(short) > 3 else ""
        worst = short[0]
        parts.append(
            f"the outputs being linear in the weights (the weights are the model's coefficients), these weights "
            f"keep less than {bound} of their variance: {listed}{more} ({names[worst]}: "
            f"{1.0 - float(fraction[worst]):.0%} lies outside the subspace, its sd is "
            f"{math.sqrt(float(fraction[worst])):.2g} times the full one), so post.summary()'s sds and intervals of "
            "these weights are too small" + ("" if "outputs" in criteria else f" ({f_said})")
        )
    if exhausted:  # a larger subspace is refused: no subspace_dim to advise
        advice = (
            "method='nuts' or 'laplace' (a model this small: exact on a Gaussian posterior); the subspace already "
            f"holds all {rank} directions the SWA deviations span, so no larger subspace_dim is possible."
        )
    elif suggested is not None:
        advice = (
            f"subspace_dim={suggested} (the smallest number of this SWA run's directions that holds it), or "
            "method='nuts' or 'laplace' (a model this small: exact on a Gaussian posterior)."
        )
    else:
        advice = (
            f"a larger subspace_dim with more SWA deviations (swa=SWAGConfig(swag_rank=...); these {total} "
            "directions do not hold it), or method='nuts' or 'laplace' (a model this small: exact on a Gaussian "
            "posterior)."
        )
    warn_diagnostic(
        f"{post.method}: the subspace holds too little of the posterior's spread: confined to its {rank} "
        f"directions, under the Laplace approximation at the draws' mean, " + "; and ".join(parts) + ". Subspace "
        "inference samples only w_hat + P z, so no draw moves outside those directions, however long the inner "
        f"engine runs. Try {advice}"
    )
