"""Where the MCMC chains of a small plain Pyro function start, and the metric their warm-up starts from: the
Laplace approximation at the mode.

A Pyro function's default start is a prior draw per chain (``init="prior"``). With wide priors that is far from the
posterior: on kidiq (``tests/reference``: ``N(0, 100)`` coefficients, an IQ-like covariate near 100) ``U``, the
negative log joint, is ~9e6 at a prior draw and 862 at the mode, and the Hessian there has condition number 5.1e5
(posterior correlation 0.95 between the intercept and the covariate's coefficient). A warm-up that adapts its
metric from the identity estimates the variances of the descent rather than of the posterior, and a diagonal
metric cannot hold the correlation. So, for such a model (:func:`~bnn_pyro.infer.sg_metric.mode_metric`: a Pyro
function on tensor data, no ``pyro.param`` sites, at most ``CONVERGE_MAX_DIM`` coordinates):

- the metric (inverse mass matrix, or the random walk's proposal covariance) starts at ``H^{-1}``, ``H`` the
  Hessian of ``U`` at the mode (dense); the warm-up windows then re-estimate it from the chain as usual;
- chain ``c`` starts at ``z_c = z* + SPREAD * L^{-T} eps_c`` with ``H = L L^T`` and ``eps_c ~ N(0, I)`` drawn from
  its own generator seeded ``seed + c +`` :data:`START_SEED_OFFSET` (the driver seeds chain ``c``'s stream
  ``seed + c``: without the offset the start's ``eps_c`` would be the chain's first normals, its first momentum):
  a draw of ``N(z*, SPREAD^2 H^{-1})``, the Laplace approximation over-dispersed by ``SPREAD`` = 2 in every
  direction (Gelman & Rubin 1992 ask for starts over-dispersed relative to the posterior, so that R-hat can still
  detect chains that do not mix; starting every chain at the mode would hide it);
- both only where the Laplace approximation describes the posterior: the Pareto ``k_hat`` of the importance ratios
  ``p / q`` of :data:`NUM_CHECK` draws of ``q = N(z*, H^{-1})`` (PSIS, Vehtari et al. 2024; Yao et al. 2018, the
  rule of ``check_gaussian``) at most :data:`K_HAT_MAX` = 0.7. Where the mode is not where the mass is (the
  non-centered eight schools: its joint mode has ``tau`` ~29 where the posterior mean is 3.6; ``k_hat`` 1.03), a
  start there puts the chains in the tail and the warm-up adapts its metric to the way back, so the default
  (prior draws, a metric from the identity) is kept.

Example
-------
>>> start = mode_start(model, data, num_chains=4, seed=0, fast_path=True)  # None where it does not apply
>>> start.values[c]                     # chain c's start, constrained site values (for init_to_value)
>>> start.inverse_mass(("beta", "sigma"), torch.float32)   # H^{-1} with its blocks in that site order
"""

from __future__ import annotations

from dataclasses import dataclass

import arviz as az
import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potentials
from bnn_pyro.infer.sg_metric import Metric, mode_metric, unwhiten

__all__ = ["ModeStart", "mode_start", "SPREAD", "K_HAT_MAX", "NUM_CHECK", "START_SEED_OFFSET"]

SPREAD = 2.0  # the starts' sd in Laplace sds: over-dispersed (Gelman & Rubin 1992), within a few sds of the mass
K_HAT_MAX = 0.7  # PSIS k_hat above which importance ratios p / q are unreliable: q is far from p (Vehtari et al. 2024)
START_SEED_OFFSET = 104729  # chain c's start generator is seeded seed + c + this: apart from its stream, seed + c
NUM_CHECK = 1000  # draws of the Laplace approximation for k_hat: one potential each, cheap beside the MCMC run


@dataclass(frozen=True)
class ModeStart:
    """``values``: each chain's start (constrained site values); ``cov``: ``H^{-1}`` (float64) over the flat
    unconstrained coordinates in ``sizes`` order; ``sizes``: each site's number of coordinates, in that order;
    ``k_hat``: the Laplace approximation's PSIS ``k_hat`` (module docstring); ``usable``: at most ``K_HAT_MAX``;
    ``metric``: the mode and Hessian factor they come from (for a caller that needs them too, e.g. SWAG's collection,
    instead of searching again)."""

    values: list[dict[str, torch.Tensor]]
    cov: torch.Tensor
    sizes: dict[str, int]
    k_hat: float
    metric: Metric | None = None

    @property
    def usable(self) -> bool:
        return self.k_hat <= K_HAT_MAX

    def inverse_mass(self, names: tuple[str, ...], dtype: torch.dtype) -> torch.Tensor:
        """``H^{-1}`` with its rows and columns in the order of the sites ``names`` (a kernel's flat layout)."""
        offsets, pos = {}, 0
        for name, size in self.sizes.items():
            offsets[name], pos = torch.arange(pos, pos + size), pos + size
        index = torch.cat([offsets[n] for n in names]).to(self.cov.device)
        return self.cov[index][:, index].to(dtype)


def mode_start(model, data: Data, *, num_chains: int, seed: int, fast_path: bool) -> ModeStart | None:
    """The chains' starts and the initial metric of ``model`` on ``data`` (module docstring), or ``None`` where
    :func:`~bnn_pyro.infer.sg_metric.mode_metric` does not apply (a ``BNN``, a loader, ``pyro.param`` sites, more
    than ``CONVERGE_MAX_DIM`` coordinates, a Hessian that is not finite)."""
    paths = Potentials(fast_path)
    cuda = [data.x.device] if isinstance(data.x, torch.Tensor) and data.x.device.type == "cuda" else []
    # the mode search's prior-median draws, seeded; the CPU stream and the data's CUDA device's are restored after it
    # (the median start of ``pot`` below draws from the caller's stream, which bp.fit keeps for its caller)
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        metric = mode_metric(model, paths, data)
    if metric is None:
        return None
    pot = paths(model, data, init="median")
    mode, chol = metric.mode.double(), metric.chol
    values = []
    for c in range(num_chains):
        # its own generator, so the chain's global stream (seeded seed + c by the driver) is untouched and not reused
        g = torch.Generator().manual_seed(seed + c + START_SEED_OFFSET)
        eps = torch.randn(len(mode), generator=g, dtype=torch.float64).to(chol.device)
        z = (mode + unwhiten(chol, SPREAD * eps)).to(metric.mode.dtype)
        values.append({k: v.detach() for k, v in pot.constrain(pot.unflatten(z)).items()})
    sizes = {name: int(torch.Size(shape).numel()) for name, shape in pot.shapes.items()}
    return ModeStart(values, torch.cholesky_inverse(chol), sizes, _k_hat(pot, metric, seed), metric)


def _k_hat(pot, metric, seed: int) -> float:
    """PSIS ``k_hat`` of ``log p(z) - log q(z)`` over ``NUM_CHECK`` draws ``z = z* + L^{-T} eps`` of ``q = N(z*, H^-1)``
    (``log q = -|eps|^2 / 2`` up to a constant, which ``k_hat`` ignores); NaN potentials count as ``p = 0``."""
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(NUM_CHECK, len(metric.mode), generator=g, dtype=torch.float64).to(metric.chol.device)
    u = torch.linalg.solve_triangular(metric.chol.T, eps.T, upper=True).T  # rows L^{-T} eps
    fn = pot.flat_fn()
    with torch.no_grad():
        energy = torch.stack([fn((metric.mode.double() + row).to(metric.mode.dtype)) for row in u]).double().cpu()
    log_r = (-energy + 0.5 * eps.square().sum(1).cpu()).nan_to_num(float("-inf"))
    log_r = log_r - log_r[torch.isfinite(log_r)].max() if torch.isfinite(log_r).any() else log_r
    if not torch.isfinite(log_r).any():
        return float("inf")
    _, k = az.psislw(log_r.clamp(min=-1e300).numpy().copy(), reff=1.0)
    return float(k)
