"""The observation noise of a Laplace fit chosen on held-out rows, for the linearized (GLM) predictive.

A MAP of an over-parameterized net fits its training targets far better than it predicts new ones, so the
noise at the MAP is the training residual, not the test error (:mod:`bnn_pyro.infer.holdout`). With held-out
rows (``validation=``, the default on tensor data of at least 200 rows) a learned homoscedastic Gaussian noise
``sigma`` is instead set to the value that maximizes the held-out log predictive density of the GLM predictive
``N(y | f(x, w*), J(x) Sigma(sigma) J(x)^T + sigma^2)``. The weight covariance depends on ``sigma`` through
the likelihood curvature (the GGN is ``J^T J / sigma^2``; the empirical Fisher, with its residuals fixed,
scales as ``sigma^-4``), so the two are iterated to a fixed point (a few rounds). The noise site is then held
at ``sigma`` (it is left out of the covered coordinates) and the curvature recomputed there.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer.holdout import Holdout, maximize_on_log_grid
from bnn_pyro.infer.laplace.approximation import Hessian
from bnn_pyro.infer.laplace.functional import output_jacobian, site_values
from bnn_pyro.infer.laplace.kfac import layer_jacobians
from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.infer.laplace.structure import Layout
from bnn_pyro.likelihoods import HALF_LOG_2PI
from bnn_pyro.model import BNN

ROUNDS = 20  # fixed-point rounds at most; they stop once sigma moves by less than 0.1%


def best_sigma(f: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(sigma*, lpd)``: the noise sd maximizing ``mean_n log N(y_n | f_n, var_n + sigma^2)``, searched around
    the residual sd (:func:`~bnn_pyro.infer.holdout.maximize_on_log_grid`)."""
    f, var = f.double(), var.double()
    y = y.double().reshape(f.shape)

    def lpd(sigmas):
        total = var[None] + sigmas.pow(2).reshape((-1,) + (1,) * f.dim())
        values = -HALF_LOG_2PI - 0.5 * (torch.log(total) + (y - f)[None] ** 2 / total)
        return values.reshape(len(sigmas), f.shape[0], -1).sum(-1).mean(-1)

    return maximize_on_log_grid(lpd, (y - f).pow(2).mean().sqrt().clamp_min(1e-12))


def choose_noise(
    model: BNN,
    pot,
    z: torch.Tensor,
    layout: Layout,
    lik_hess: torch.Tensor,
    prior_hess: torch.Tensor,
    holdout: Holdout,
    site: str,
    hessian: Hessian,
):
    """``(z, info)``: ``z`` with the noise site ``site`` (``"sigma"`` or ``"precision"``) set to the held-out
    choice, and the record for ``post.config["noise"]``. ``lik_hess``/``prior_hess``: the curvature parts at
    ``z`` on the covered coordinates (the noise site is not among them)."""
    w_idx = layout.indices(model.sample_names)
    pos = layout.where[w_idx]
    if isinstance(lik_hess, Kron):  # the layers' Jacobians from one backward pass per output (.kfac)
        f, jac = layer_jacobians(model, pot, z, holdout.x, layout.coords, layout.where, len(layout.active))
    else:
        f, jac = output_jacobian(model, pot, z, holdout.x, w_idx)
    value = site_values(model, pot, z)[1][site]
    sigma0 = float(value if site == "sigma" else value.rsqrt())
    power = 2 if hessian is Hessian.GGN else 4
    sigma, lpd = sigma0, float("nan")
    for _ in range(ROUNDS):
        hess = (sigma0 / sigma) ** power * lik_hess + prior_hess
        if isinstance(hess, Kron):
            var = hess.functional_covariance(jac).diagonal(dim1=-2, dim2=-1)
        elif hess.dim() == 1:
            var = (jac**2 * (1.0 / hess[pos])).sum(-1)
        else:
            cov = torch.cholesky_inverse(torch.linalg.cholesky(hess))[pos[:, None], pos]
            var = torch.einsum("bow,wv,bov->bo", jac, cov, jac)
        new, lpd = best_sigma(f, var, holdout.y)
        done = abs(math.log(new / sigma)) < 1e-3
        sigma = new
        if done:
            break
    info = {"selected_on": "validation", "sigma": sigma, "heldout_lpd": lpd, "map_sigma": sigma0}
    return with_noise(pot, z, layout, site, sigma), info


def with_noise(pot, z: torch.Tensor, layout: Layout, site: str, sigma: float) -> torch.Tensor:
    """A copy of the flat unconstrained ``z`` with the noise site at ``sigma`` (``"precision"``: ``sigma^-2``)."""
    value = z.new_tensor(sigma if site == "sigma" else sigma**-2.0)
    z = z.clone()
    z[layout.coords[site]] = (pot.transforms[site](value) if site in pot.transforms else value).reshape(-1)
    return z
