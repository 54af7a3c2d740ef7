r"""SWAG's collection on a small plain Pyro function: whitened, randomized steps from the mode.

Why a collection of its own. SWAG's spread is the covariance of SGD's iterates at a constant rate, and those iterates
spread only as far as the gradient noise pushes them. A small Pyro function fitted on all its rows (eight schools,
kidiq, logistic: ``tests/reference``) has little or no minibatch noise, and the iterates of plain SGD sit at the mode:
SWAG's sds there were 0.014 of the posterior's (``benchmarks/results/reference_suite/function_swag_mode.md``). Its
collection was not whitened either, so the rate ``lr="auto"`` (set by the stiffest direction) barely moved the flat
ones, and SWAG's diagonal half drops the correlations (kidiq's intercept and slope: -0.95).

The collection here. Chain ``c`` starts at the mode ``z*`` of ``U`` (:func:`~bnn_pyro.infer.sg_metric.mode_metric`,
with ``L L^T = H`` the Hessian of ``U`` there) and takes, at every step ``t``, a full-data step on its own randomized
objective

.. math::

    U_t(z) = -\log p(z) + \langle z, g_t \rangle - \sum_i v_{ti} \log p(y_i \mid x_i, z),\qquad
    v_t = n D_t,\ D_t \sim \mathrm{Dirichlet}(1, \ldots, 1),\quad g_t = \nabla \log p(w_t),\ w_t \sim p(w),

fresh observation weights (the weighted likelihood bootstrap, :func:`~bnn_pyro.infer.anchor.bootstrap_weights`) and,
with ``anchored=True``, a fresh prior anchor (:func:`~bnn_pyro.infer.anchor.anchor`: the real-valued sites) each step,
preconditioned by ``M = H^{-1}`` and with heavy-ball momentum ``beta``: ``v <- beta v + M grad U_t(z)``,
``z <- z - lr v``. The gradient noise ``xi_t = grad U_t - grad U`` has mean zero and covariance
``C = n / (n + 1) sum_i (s_i - s_bar)(s_i - s_bar)^T + Lambda_0`` (``s_i`` the per-observation scores; ``Lambda_0 =
Cov grad log p(w)``, the prior's Fisher information, ``I / s^2`` for ``Normal(mu, s)``). At the mode of a
well-specified model ``C ~ H`` (the scores' covariance is the likelihood's Fisher information, Bartlett's identity), so
in the whitened coordinates ``u = L^T (z - z*)`` the noise is ``~ N(0, I)`` and the curvature is ``I``.

The rate (Mandt, Hoffman & Blei 2017, sec. 4: the stationary covariance of preconditioned constant-rate SGD). In
continuous time the iterates' covariance ``Sigma`` solves ``A Sigma + Sigma A^T = lr M C M`` with ``A = M H``; with
``M = H^{-1}``, ``A = I`` and ``Sigma = (lr / 2) H^{-1} C H^{-1}``, so ``lr = 2`` would match ``H^{-1}``: the stability
edge of the discrete recursion, where its variance diverges. The discrete recursion's own stationary variance along a
whitened direction (curvature 1, unit noise) is ``lr / (2 - lr)`` without momentum (``u' = (1 - lr) u - lr xi``:
``Var = (1 - lr)^2 Var + lr^2``) and ``lr (1 + beta) / ((1 - beta)(2 (1 + beta) - lr))`` with heavy-ball momentum
(:mod:`bnn_pyro.infer.swag`'s ``lr="auto"`` formula at ``a = c = 1``); it equals 1, the posterior's, at

.. math::

    lr = 1 - \beta^2,

so ``Sigma = H^{-1} C H^{-1} ~ H^{-1}``, the Laplace covariance at the mode, and beyond it the bootstrap's
non-Gaussian spread where ``U_t``'s minima are skewed. Default ``beta = 0`` (``lr = 1``): each step is a Newton step of
the randomized objective, the iterates of a quadratic ``U`` are independent draws (with ``beta = 0.9`` the lag-1
autocorrelation is 0.9 and SWAG's ``K = 20`` last deviations see one correlated stretch; a ``momentum=`` given is kept
and its rate follows the rule). For a linear-Gaussian model the iterates' covariance is ``S (X^T diag(r_i^2) X /
sigma^4 + I / s^2) S`` (``r_i`` the residuals at the mode), the posterior's ``S`` to first order in ``1 / sqrt(n)``
(tested against the closed form: ``tests/infer/test_swag_function.py``).

The collection is whitened: the moments are kept of ``u``, and a draw ``u`` of SWAG's Gaussian (its diagonal plus
low-rank halves) is mapped to ``z = z* + L^{-T} u``. Why: the diagonal half of SWAG's covariance has no correlations,
and in ``u`` the posterior's are ~0, so halving them costs nothing; in ``z`` it would halve kidiq's -0.95.

Where it applies (:func:`function_collection`): ``method="swag"`` or ``"swa"`` at ``lr="auto"`` on a Pyro function
(never a ``bp.BNN``: its fit is unchanged, tested bit-identical) with tensor data, no ``pyro.param`` sites and at most
:data:`~bnn_pyro.infer.map_fit.CONVERGE_MAX_DIM` coordinates, where the metric exists (the conditions of
:func:`~bnn_pyro.infer.sg_metric.mode_metric`, as sgld / sghmc / snapshot use them) and the potential is Pyro's traced
one (the weights act through a messenger). Nothing is chosen on held-out rows (the start is the mode, the rate
follows from the rule), so the default holds none out and there is no pre-training; ``post.config["collection"]``
records what ran. Constrained sites (a noise scale, a hierarchical sd) get no anchor noise: their prior half is not
randomized, so where the prior sets them (eight schools' ``tau``) SWAG stays narrow and ``check_narrow`` says so.

Example
-------
>>> fc = function_collection(model, paths, data, momentum=None, anchored=True)   # None where it does not apply
>>> fc.lr, fc.momentum                                                          # 1.0, 0.0 at the defaults
>>> u = fc.whiten(z)                                                            # what SWAG's moments collect
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._mode_start import K_HAT_MAX, mode_start
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.anchor import BootstrapSites, anchor, bootstrap_sites, bootstrap_weights, flat_tilt, weighted
from bnn_pyro.infer.sg_metric import Metric, unwhiten
from bnn_pyro.model import BNN

__all__ = ["FunctionCollection", "function_collection", "collection_lr", "MOMENTUM"]

MOMENTUM = 0.0
"""The collection's default heavy-ball momentum on a Pyro function: with ``lr = 1`` each step is a Newton step of its
randomized objective, so the iterates of a quadratic ``U`` are independent (module docstring)."""


def collection_lr(momentum: float) -> float:
    """``1 - momentum^2``: the whitened rate at which heavy-ball SGD's stationary variance equals the posterior's along
    every direction (module docstring)."""
    return 1.0 - momentum**2


@dataclass(frozen=True)
class FunctionCollection:
    """What one fit's chains share: the ``metric`` at the mode, the observed ``sites`` whose log-densities are weighted,
    ``momentum`` and ``lr`` (:func:`collection_lr`), whether the prior half is ``anchored``, and the ``record`` that
    ``post.config["collection"]`` states."""

    metric: Metric
    sites: BootstrapSites
    momentum: float
    lr: float
    anchored: bool
    record: dict

    def whiten(self, z: torch.Tensor) -> torch.Tensor:
        """``u = L^T (z - z*)`` (float64): what the moments collect."""
        return self.metric.chol.T @ (z.detach().double() - self.metric.mode.double())

    def unwhiten(self, u: torch.Tensor) -> torch.Tensor:
        """``z = z* + L^{-T} u`` for ``u`` shaped ``(..., d)`` (float64)."""
        lead = u.shape[:-1]
        flat = u.reshape(-1, u.shape[-1]).double()
        z = torch.linalg.solve_triangular(self.metric.chol.T, flat.T, upper=True).T
        return (self.metric.mode.double() + z).reshape(*lead, -1)

    @property
    def log_det(self) -> float:
        """``log |det L^T|``: ``log q(z) = log q(u) + log_det`` for ``u = L^T (z - z*)``."""
        return float(self.metric.chol.diagonal().log().sum())

    def precondition(self, grad: torch.Tensor, size: int) -> torch.Tensor:
        """``N H^{-1} grad`` for the gradient of ``U / N`` (the SWA phase's loss), so that the step is ``H^{-1}``'s on
        ``U``."""
        inner = unwhiten(self.metric.chol, _whiten_gradient(self.metric.chol, grad))
        return size * inner

    def loss(self, model, pot: Potential, z: torch.Tensor, batch: tuple, seed: int, size: int) -> torch.Tensor:
        """``U_t(z) / N`` (module docstring) with observation weights and, when anchored, the anchor drawn under
        ``seed``."""
        weights = bootstrap_weights(self.sites, seed=seed, like=z)
        u = weighted(lambda p, values, b: p(values, b), weights)(pot, pot.unflatten(z), batch)
        if self.anchored:
            u = u + z @ flat_tilt(anchor(model, pot, batch, seed=seed)[0], pot)
        return u / size


def _whiten_gradient(chol: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(chol, g.double()[:, None], upper=False)[:, 0].to(g)


def function_collection(
    model, paths: Potentials, data: Data, *, momentum: float | None, anchored: bool, lr, seed: int, init=None
) -> tuple[FunctionCollection | None, dict | None]:
    """``(collection, record)``: the collection of a small plain Pyro function (module docstring, "Where it applies"),
    or ``None`` and why not (``record["skipped"]``; ``record`` is ``None`` for a ``BNN`` or a loader, which never take
    it). Skipped: ``init=`` given (the user's start, pre-trained as asked, as MCMC skips its Laplace start then),
    a number ``lr``, no metric (``pyro.param`` sites, too many coordinates, a Hessian that is not
    finite), a Laplace approximation whose PSIS ``k_hat`` exceeds
    :data:`~bnn_pyro.infer._mode_start.K_HAT_MAX` (the rule of the MCMC engines' mode start: there the curvature at
    the mode does not describe the posterior, and unit whitened steps leave it: the non-centered eight schools'
    ``k_hat`` 1.03, where they diverged within 8 steps), a potential evaluated without Pyro's tracing (the weights
    would not act), or no observed site to weight. The mode search is seeded by ``seed`` on a forked generator (the
    caller's stream is left as it was), as :func:`~bnn_pyro.infer._mode_start.mode_start`'s."""
    if isinstance(model, BNN) or data.loader is not None:
        return None, None
    if init is not None:
        return None, {"skipped": "init= given: the plain SGD collection from that start"}
    if lr != "auto":
        return None, {"skipped": "lr= a number: the plain SGD collection at that rate"}
    start = mode_start(model, data, num_chains=1, seed=seed, fast_path=paths.fast_path)
    if start is None:
        return None, {"skipped": "no curvature at the mode (pyro.param sites, too many coordinates, or not finite)"}
    if not start.k_hat <= K_HAT_MAX:
        why = f"the Laplace approximation's PSIS k_hat {start.k_hat:.2f} exceeds {K_HAT_MAX}: the mode's curvature"
        return None, {"skipped": why + " does not describe the posterior", "k_hat": start.k_hat}
    if paths(model, data, init="median").fast_path:
        return None, {"skipped": "the potential is evaluated without Pyro's tracing: observation weights cannot act"}
    sites = bootstrap_sites(model, data.x, data.y, anchored=anchored)
    if not sites.shapes:
        return None, {"skipped": "no observed site to weight", "observation_weights": sites.record}
    metric = start.metric  # mode_start's search, seeded by seed on a forked generator
    beta = MOMENTUM if momentum is None else float(momentum)
    rate = collection_lr(beta)
    record = {
        "rule": "whitened randomized steps from the mode (bnn_pyro.infer.swag_function)",
        "preconditioner": "inverse Hessian of U at its mode",
        "damping": metric.damping,
        "k_hat": start.k_hat,
        "lr": rate,
        "momentum": beta,
        "observation_weights": sites.record,
        "prior_anchor": "fresh each step (real-valued sites)" if anchored else "none (anchored=False)",
        "start": "mode",
    }
    return FunctionCollection(metric, sites, beta, rate, anchored, record), record
