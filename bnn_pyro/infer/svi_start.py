"""Where SVI starts on a Pyro function model: the Laplace approximation at the posterior mode (``init="laplace"``).

Why. Adam moves each guide parameter by about ``lr`` per step whatever the parameter's scale, and a Pyro function
model's latent sites can live on any scale: a regression coefficient of 1,500 next to a noise scale of 1. Started
at a prior draw (``init="prior"``), a guide with ``lr=1e-2`` and 1,000 steps moves each location by at most ~10
units and each scale (from ``init_scale=0.01``) by as little, so the fit ends where it started, far from the
posterior (a regression coefficient of ~150 where the data say ~16: ``tests/infer/test_reference_posteriors.py``).
A start that is already on the posterior's scale removes the problem: the mode (by L-BFGS, whose line search does
not care about scales) and the inverse Hessian there (the Laplace approximation) give every guide a location and
spread in the right units, and SVI then corrects the Gaussian shape of the Laplace approximation where the
posterior is skewed (a hierarchical scale) instead of travelling to it.

What each guide gets, in the unconstrained coordinates the autoguides work in:

- every guide: the mode as its location (through ``init_to_value``);
- ``AutoMultivariateNormal`` (``guide="full_rank"``): the Laplace covariance ``H^-1`` (its Cholesky factor split
  into Pyro's ``scale`` and unit ``scale_tril``);
- ``AutoLowRankMultivariateNormal`` (``"low_rank"``): the Laplace covariance's best rank-``rank`` description
  (:func:`_low_rank`);
- ``AutoNormal`` (``"mean_field"``): ``1 / sqrt(diag H)``, the scales the mean-field optimum takes on a Gaussian
  posterior (KL(q || p) matches the precision's diagonal, not the covariance's).

The Hessian is dense, so it is taken only up to :data:`MAX_DIM` latent coordinates (beyond that, the mode and
``init_scale``). Where the search does not end at a finite mode with a positive definite Hessian, the guide keeps
its ``init_scale`` and :attr:`LaplaceStart.converged` says so (the fit's ``config["init_converged"]``).

The mode is taken on the full data (on the first batch, scaled by ``dataset_size / batch``, for a loader).

Example
-------
>>> start = laplace_start(model, data)                 # the mode and the Laplace covariance
>>> guide = AutoMultivariateNormal(model, init_loc_fn=start.init_loc_fn())
>>> start.set_scales(guide, x, y)                      # sets up the guide and overwrites its scales
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer import autoguide
from pyro.infer.autoguide import initialization as init_fns

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential, newton_mode
from bnn_pyro.infer.svi_lr import FULL_RANK_MAX_DIM
from bnn_pyro.utils.user_warnings import warn

__all__ = ["LaplaceStart", "laplace_start", "check_start", "MAX_DIM", "MAX_ITER", "NEWTON_STEPS", "SHRINK_MAX"]

MAX_DIM = 2000
"""Largest number of latent coordinates whose dense Hessian is taken (``MAX_DIM`` gradient passes and a
``MAX_DIM**2`` matrix; a Pyro function model is rarely larger)."""
MAX_ITER = 500
"""L-BFGS iterations at most for the mode (each with a strong-Wolfe line search)."""
NEWTON_STEPS = 5
"""Newton steps after L-BFGS (each one Hessian: ``dim`` gradient passes)."""
SHRINK_MAX = 1.5
""":func:`check_start` warns when a mean-field guide would be at least this many times too narrow in some coordinate
at the Laplace approximation: its sds are
then at most two thirds of the posterior's there (on a Gaussian posterior, exactly ``1 / sqrt(H_ii)`` against
``sqrt(cov_ii)``; MacKay 2003, section 33.5), which no amount of fitting changes."""


@dataclass
class LaplaceStart:
    """The mode ``z`` (unconstrained, per site), its constrained ``values``, and the Laplace covariance ``cov``
    and its inverse ``precision`` (both ``None`` where not taken: more than :data:`MAX_DIM` coordinates, or no mode)
    over ``shapes``' order; ``converged``: whether the search ended at a finite mode (with a positive definite
    Hessian where one was taken)."""

    values: dict[str, torch.Tensor]
    z: dict[str, torch.Tensor]
    shapes: dict[str, torch.Size]
    cov: torch.Tensor | None
    precision: torch.Tensor | None
    converged: bool

    def init_loc_fn(self):
        """An init strategy that puts each site at the mode (the prior median for any other site)."""
        # copies: an autoguide keeps the given value as its parameter, which its optimizer updates in place, and one
        # start serves every chain
        values = {name: value.detach().clone() for name, value in self.values.items()}
        return init_fns.init_to_value(values=values, fallback=init_fns.init_to_median(num_samples=15))

    def mean_field_shrink(self) -> float:
        """The largest ratio of the Laplace sd to the mean-field optimum's sd (``sqrt(cov_ii * H_ii)``): how many
        times too narrow a mean-field guide is in some coordinate because of the posterior's correlations (1 for
        an uncorrelated posterior; ``nan`` without a covariance)."""
        if self.cov is None:
            return math.nan
        return float((self.cov.diagonal() * self.precision.diagonal()).sqrt().max())

    def set_scales(self, guide, *args, **kwargs) -> bool:
        """Set up ``guide`` (by calling it once on ``args``) and overwrite its scales from the Laplace covariance
        (module docstring); returns whether it did (an autoguide of a covered kind, with a covariance)."""
        if self.cov is None or not isinstance(
            guide, (autoguide.AutoNormal, autoguide.AutoMultivariateNormal, autoguide.AutoLowRankMultivariateNormal)
        ):
            return False
        with poutine.block():
            guide(*args, **kwargs)
        store = pyro.get_param_store()
        names = _guide_param_names(guide, *args, **kwargs)
        diag_sd = self.precision.diagonal().rsqrt()
        if isinstance(guide, autoguide.AutoNormal):
            offsets = self._offsets()
            for site, (i, n) in offsets.items():
                name = names.get(f"scales.{site}")
                if name is None:
                    return False
                store[name] = diag_sd[i : i + n].reshape(store[name].shape).to(store[name])
            return True
        order = self._guide_order(guide)
        if order is None:
            return False
        if isinstance(guide, autoguide.AutoMultivariateNormal):
            chol = torch.linalg.cholesky(self.cov[order][:, order])
            scale = chol.diagonal()
            store[names["scale"]] = scale.to(store[names["scale"]])
            store[names["scale_tril"]] = (chol / scale[:, None]).to(store[names["scale_tril"]])
        else:  # low rank: cov = diag(s) (W W^T + I) diag(s) (Pyro's parameterization)
            factor = store[names["cov_factor"]]
            scale, factor_value = _low_rank(self.cov[order][:, order], factor.shape[-1])
            store[names["scale"]] = scale.to(factor)
            with torch.no_grad():  # a plain nn.Parameter, which the store holds as the same tensor: set in place
                factor.unconstrained().copy_(factor_value.to(factor))
        return True

    def _offsets(self) -> dict[str, tuple[int, int]]:
        out, i = {}, 0
        for name, shape in self.shapes.items():
            out[name] = (i, math.prod(shape))
            i += out[name][1]
        return out

    def _guide_order(self, guide) -> torch.Tensor | None:
        """Indices that put :attr:`shapes`' flat order into the guide's (its prototype trace's latent sites), or
        ``None`` where the guide's flat location does not match the mode in that order."""
        offsets = self._offsets()
        sites = [
            name
            for name, site in guide.prototype_trace.iter_stochastic_nodes()
            if not site["is_observed"] and name in offsets
        ]
        if sorted(sites) != sorted(offsets):
            return None
        order = torch.cat([torch.arange(offsets[s][0], offsets[s][0] + offsets[s][1]) for s in sites])
        flat = torch.cat([self.z[s].reshape(-1) for s in offsets])[order]
        loc = guide.loc.detach()
        if loc.shape != flat.shape or not torch.allclose(loc.double(), flat.double(), rtol=1e-4, atol=1e-5):
            return None
        return order


def _low_rank(cov: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pyro's ``(scale, cov_factor)`` for ``cov ~ F F^T + D`` with ``F = cov_factor * scale[:, None]`` and
    ``D = scale**2``: ``F`` from the top ``rank`` eigenpairs of ``cov``, ``D`` the rest of each variance (at least
    1% of it), so that every marginal variance is exact and the leading correlations are kept (probabilistic PCA's
    split). Not ``F = 0``: the ELBO's gradient in ``F`` vanishes there, a saddle that the fit leaves only slowly."""
    values, vectors = torch.linalg.eigh(cov)
    factor = vectors.flip(1)[:, :rank] * values.flip(0)[:rank].clamp_min(0.0).sqrt()
    diag = (cov.diagonal() - factor.pow(2).sum(-1)).clamp_min(0.01 * cov.diagonal())
    scale = diag.sqrt()
    return scale, factor / scale[:, None]


def _guide_param_names(guide, *args, **kwargs) -> dict[str, str]:
    """The guide's parameters' names in Pyro's store, keyed by their name inside the guide (``"scale"``,
    ``"scales.beta"``: the store prefixes them with the guide's own name)."""
    with poutine.block(), poutine.trace(param_only=True) as capture:
        guide(*args, **kwargs)
    return {name.split(".", 1)[-1]: name for name in capture.trace.nodes}


def laplace_start(model, data: Data, *, max_iter: int = MAX_ITER) -> LaplaceStart:
    """The mode of ``model``'s posterior on ``data`` in unconstrained coordinates (L-BFGS from the prior median, then
    Newton steps) and, up to :data:`MAX_DIM` coordinates, the Laplace covariance there (see the module docstring).
    Deterministic: the prior median is estimated under a fixed seed, apart from the caller's random state."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pot = Potential(model, data, init="median", fast_path=False)
    except ValueError:  # Pyro found no start with a finite log density: the guide starts at the prior median
        return LaplaceStart(values={}, z={}, shapes={}, cov=None, precision=None, converged=False)
    energy = pot.flat_fn()
    start = pot.flatten(pot.init).detach().clone()
    mode = _lbfgs(energy, start, max_iter)
    ok = mode is not None
    mode = start if mode is None else mode
    cov = precision = None
    if ok and mode.numel() <= MAX_DIM:
        mode, precision = newton_mode(energy, mode, steps=NEWTON_STEPS)
        ok = precision is not None
        cov = None if precision is None else torch.cholesky_inverse(torch.linalg.cholesky(precision))
    z = pot.unflatten(mode)
    values = {k: v.detach() for k, v in pot.constrain(z).items()}
    return LaplaceStart(values=values, z=z, shapes=dict(pot.shapes), cov=cov, precision=precision, converged=ok)


def _lbfgs(energy, start: torch.Tensor, max_iter: int) -> torch.Tensor | None:
    """L-BFGS with a strong-Wolfe line search from ``start``; ``None`` where it ends at a non-finite point."""
    flat = start.clone().requires_grad_()
    opt = torch.optim.LBFGS(
        [flat],
        lr=1.0,
        max_iter=max_iter,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
    )

    def closure():
        opt.zero_grad()
        value = energy(flat)
        value.backward()
        return value

    try:
        opt.step(closure)
        finite = bool(torch.isfinite(flat).all() and torch.isfinite(energy(flat)))
    except (RuntimeError, ValueError):  # a line search into a region where the model cannot be evaluated
        return None
    return flat.detach().clone() if finite else None


def check_start(start: LaplaceStart, guide: str) -> None:
    """Warn when the search for the mode did not end at one, and when ``guide`` is ``"mean_field"`` and cannot
    represent the posterior's correlations at the mode (:data:`SHRINK_MAX`)."""
    from bnn_pyro.posterior.diagnostics import DiagnosticWarning

    if not start.converged:
        warn(
            "svi: init='laplace' found no finite mode with a positive definite Hessian, so the guide started "
            "at the mode search's end point with init_scale; check post.history['loss'], or pass "
            "init='prior' or 'median' with more num_steps.",
            DiagnosticWarning,
        )
        return
    shrink = start.mean_field_shrink()
    if guide == "mean_field" and shrink >= SHRINK_MAX:
        warn(
            f"svi: the posterior's correlations at its mode (the Laplace approximation) make a {guide} guide "
            f"up to {shrink:.3g}x too narrow in some coordinate (threshold {SHRINK_MAX:g}x): it cannot "
            "represent them, so its sds are too small whatever num_steps. Use guide='full_rank' (SVI's default "
            f"for a Pyro function of at most {FULL_RANK_MAX_DIM} coordinates on full-batch tensors), method='nuts', "
            "or standardize (center) the covariates so that the coefficients decorrelate.",
            DiagnosticWarning,
        )
