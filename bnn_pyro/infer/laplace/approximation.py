"""The Laplace approximation's choices (``str`` Enums), its settings, and the Gaussian it fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.laplace.kron import Kron

MAX_FULL_DIM = 5000  # a dense float64 H of this size is 200 MB and its Cholesky takes seconds
CHUNK = 2**22  # elements per Jacobian / Hessian-vector block


class Structure(str, Enum):
    FULL = "full"
    DIAG = "diag"
    LAST_LAYER = "last_layer"
    KRON = "kron"  # KFAC: one Kronecker-factored block per Linear / Conv2d layer (.kfac, .kron)


class Hessian(str, Enum):
    GGN = "ggn"  # generalized Gauss-Newton (a BNN's default)
    FISHER = "fisher"  # the empirical Fisher sum_i g_i g_i^T
    EXACT = "exact"  # the Hessian itself, by autograd (a Pyro function model's default; not for "kron")


class Predictive(str, Enum):
    GLM = "glm"  # the linearized network f(x, w*) + J(x) (w - w*) (Immer et al. 2021)
    NN = "nn"  # the network itself at each draw


class Link(str, Enum):
    PROBIT = "probit"  # MacKay's probit approximation of the GLM predictive's class probabilities
    MC = "mc"  # Monte Carlo over the linearized logits


class PriorPrecision(str, Enum):
    MODEL = "model"  # the model's own prior
    MARGLIK = "marglik"  # one delta, by marginal likelihood
    MARGLIK_LAYERWISE = "marglik_layerwise"  # one delta per layer (BNN module) or site (Pyro function)


@dataclass
class LaplaceApproximation:
    """``N(mean, precision^-1)`` over the covered coordinates ``active`` of the flat unconstrained vector
    (:meth:`Potential.flatten` order); the other coordinates stay at ``mean``.

    Attributes
    ----------
    mean:
        ``m``, flat, unconstrained, shaped ``(dim,)``: the MAP, as the mode of the quadratic model of
        ``U`` at ``expansion_point`` (see the module docstring).
    precision:
        ``H`` on the covered coordinates (float64): ``(k, k)``, ``(k,)`` for ``structure="diag"``, or a
        :class:`~.kron.Kron` for ``structure="kron"``.
    active:
        Indices of the covered coordinates in ``mean``.
    expansion_point:
        Where the optimizer stopped and the curvature was computed; ``mean`` is the mode of the
        quadratic model of ``U`` there (they differ by optimizer noise).
    prior_precision:
        ``delta`` per group when the Normal priors were replaced (``None``: the model's prior).
    noise:
        How a learned Gaussian noise was chosen on held-out rows (:mod:`.noise`), or ``None``.
    best_step:
        The step of the MAP search kept (early stopping on held-out rows; the last step without them).
    effective_parameters:
        MacKay's ``gamma = tr(H^-1 G)``, ``G`` the likelihood's curvature (:mod:`.quadratic`), formed only for a
        fit whose quadratic excess is judged (a classifier linear in its covered weights, tensor data, not
        ``structure="kron"``); ``None`` otherwise (an ``O(k^3)`` solve that nothing else reads).
    log_evidence:
        Laplace estimate of ``log p(y)`` of the covered coordinates (the others held at the MAP).
    """

    mean: torch.Tensor
    precision: torch.Tensor
    active: torch.Tensor
    expansion_point: torch.Tensor
    structure: Structure
    potential: Potential = field(repr=False)
    model: object = field(repr=False)
    prior_precision: dict[str, float] | None = None
    log_evidence: float = float("nan")
    loss: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    noise: dict | None = None
    best_step: int = -1
    effective_parameters: float | None = None
    # (H, H._version, L): the lower Cholesky factor L of the dense precision H it was computed for and H's version
    # counter then (:meth:`cholesky`); not an __init__ argument, so dataclasses.replace(approx, precision=...) starts
    # without it
    _factor: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def keep_cholesky(self, chol: torch.Tensor) -> None:
        """Keep ``chol``, the lower Cholesky factor of the dense ``precision`` (the fit's own, from
        :func:`~.curvature.checked`), for :meth:`cholesky` to return instead of factorizing ``H`` again."""
        self._factor = (self.precision, self.precision._version, chol)

    def cholesky(self) -> torch.Tensor:
        """The lower Cholesky factor ``L`` of the dense ``precision`` (``H = L L^T``): the one the fit computed,
        or computed here once and kept. Kept only for the very ``precision`` it factorizes, unedited: a
        ``precision`` assigned since, or edited in place (``approx.precision.mul_(2)``, ``approx.precision[i] +=
        ...``: torch bumps the tensor's version counter on every in-place write), is factorized afresh."""
        h = self.precision
        if self._factor is None or self._factor[0] is not h or self._factor[1] != h._version:
            self._factor = (h, h._version, torch.linalg.cholesky(h))
        return self._factor[2]

    def center(self) -> dict[str, torch.Tensor]:
        """The expansion point on every latent site's support (where the GLM predictive linearizes)."""
        pot = self.potential
        with torch.no_grad():
            return {k: v.detach().clone() for k, v in pot.constrain(pot.unflatten(self.expansion_point)).items()}

    def linearized_sites(self) -> list[str]:
        """The covered network weights of a ``BNN`` (the sites the GLM predictive linearizes in)."""
        names = getattr(self.model, "sample_names", [])
        covered, start = set(self.active.tolist()), 0
        out = []
        for name, shape in self.potential.shapes.items():
            size = math.prod(shape)
            if name in names and start in covered:
                out.append(name)
            start += size
        return out

    def covariance(self) -> torch.Tensor:
        """``H^-1`` (``(k, k)``), or its diagonal for ``structure="diag"`` (dense for ``"kron"`` too: small nets
        only; :func:`~.glm.functional_moments` gives ``J H^-1 J^T`` without it)."""
        if isinstance(self.precision, Kron):
            return self.precision.solve(torch.eye(len(self.active), dtype=torch.float64, device=self.mean.device))
        if self.precision.dim() == 1:
            return 1.0 / self.precision
        return torch.cholesky_inverse(self.cholesky())

    def sample_flat(self, num_samples: int, *, seed: int = 0) -> torch.Tensor:
        """Unconstrained draws ``(num_samples, dim)``."""
        g = torch.Generator().manual_seed(seed)
        eps = torch.randn(num_samples, len(self.active), generator=g, dtype=torch.float64)  # on the CPU generator
        eps = eps.to(self.mean.device)  # the same draws on every device
        if isinstance(self.precision, Kron):
            step = self.precision.inv_sqrt(eps)
        elif self.precision.dim() == 1:
            step = eps / self.precision.sqrt()
        else:  # L^-T eps has covariance (L L^T)^-1 = H^-1
            chol = self.cholesky()
            step = torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T
        out = self.mean.double().expand(num_samples, -1).clone()
        out[:, self.active] += step
        return out.to(self.mean.dtype)

    def sample(self, num_samples: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """Draws of every latent site on its support: ``dict[name, (num_samples, *shape)]``."""
        pot = self.potential
        with torch.no_grad():
            values = pot.constrain(pot.unflatten(self.sample_flat(num_samples, seed=seed)))
        return {k: v.detach().clone() for k, v in values.items()}


@dataclass(frozen=True)
class Settings:
    """The checked options of one Laplace fit (see :func:`~bnn_pyro.infer.laplace.fit_laplace`)."""

    structure: Structure
    hessian: Hessian
    prior_precision: PriorPrecision | float
    num_steps: int
    lr: float
    polish_steps: int | None  # None: 100 without held-out rows, 0 with them (a polish undoes early stopping)
    marglik_rounds: int
    init: object
    predictive: Predictive = Predictive.GLM
    round_steps: int | None = None  # MAP steps after each prior-precision round; None: num_steps // 4
    lr_schedule: object = "cosine"  # the first MAP search's (Adam's rate to 1% of lr); the held-out refit's: a Horizon
