"""Metropolis-adjusted Langevin algorithm: ``bp.fit(model, x, y, method="mala", ...)``.

One gradient per draw. With the potential ``U(z) = -log p(z, y | x)`` (unconstrained coordinates), its gradient
``g``, a step size ``h`` and a preconditioner ``A = M^-1`` (the inverse mass matrix: identity, or adapted in
warm-up), the Langevin proposal and its density are

    ``z' = mu(z) + h L eps``,  ``mu(z) = z - (h^2 / 2) A g(z)``,  ``L L^T = A``,  ``eps ~ N(0, I)``,
    ``log q(z' | z) = -|L^-1 (z' - mu(z))|^2 / (2 h^2) + const``,

and the Metropolis-Hastings correction accepts ``z'`` with probability
``min(1, exp(U(z) - U(z') + log q(z | z') - log q(z' | z)))``, so the chain targets the exact posterior
(Roberts & Tweedie 1996). In warm-up ``h`` is tuned by dual averaging (Hoffman & Gelman 2014) toward
``target_accept`` = 0.574, the optimal acceptance of MALA in high dimension (Roberts & Rosenthal 1998), and ``A``
is the posterior variance (``dense_mass=True``: covariance) estimated in Stan's windows, both by Pyro's
``WarmupAdapter`` as for the other kernels; after each window ``h`` restarts where one proposal's acceptance
crosses the target. On a small Pyro function at the default ``init``, where the Laplace approximation at the mode
describes the posterior, the chains start at over-dispersed draws of it and ``A`` starts at ``H^{-1}`` there, dense
(:mod:`bnn_pyro.infer._mode_start`; :mod:`bnn_pyro.infer.mcmc`'s docstring). Everything else (chains, seeds, checkpoint/resume, ``resume=Posterior``, ArviZ, health
checks) is the shared MCMC runner's (:func:`bnn_pyro.infer.mcmc.sample`).

Per-draw statistics: ``lp`` (``-U``), ``acceptance_rate`` (the proposal's acceptance probability) and
``step_size``.

References
----------
Roberts, G. O. & Tweedie, R. L. (1996). Exponential convergence of Langevin distributions and their discrete
approximations. Bernoulli 2(4).
Roberts, G. O. & Rosenthal, J. S. (1998). Optimal scaling of discrete approximations to Langevin diffusions.
JRSS B 60(1).

Example
-------
>>> post = bp.fit(model, x, y, method="mala", num_samples=2000, seed=0)
>>> post.sample_stats["acceptance_rate"].mean()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._kernels import AdaptedKernel, DrawStats
from bnn_pyro.infer.contract import entry
from bnn_pyro.infer.mcmc import KernelSettings, MCMCConfig, sample
from bnn_pyro.infer.training_data import Data
from bnn_pyro.posterior import Posterior

__all__ = ["fit_mala", "MALAConfig", "MALAKernel"]


class MALAKernel(AdaptedKernel):
    """MALA over one flat vector of the unconstrained sites (module docstring); a
    :class:`~bnn_pyro.infer.mcmc.ChainKernel`. ``resume = (step_size, inverse_mass_matrix)``: that state, no
    adaptation (extending a posterior)."""

    def __init__(
        self, model, joint, *, init_strategy, step_size, target_accept_prob, dense_mass, jit, resume, metric=None
    ):
        self.model, self.joint, self.jit, self.resume, self.transforms = model, joint, jit, resume, None
        self._init_strategy, self._given_step, self._chol, self._start = init_strategy, step_size, (None, None), metric
        self._adapter = WarmupAdapter(
            step_size or 1.0,
            adapt_step_size=True,
            target_accept_prob=target_accept_prob,
            adapt_mass_matrix=True,
            dense_mass=dense_mass or metric is not None,
        )

    def setup(self, warmup_steps, *args, **kwargs):
        self._warmup, self._t, self._mean_accept = warmup_steps, 0, 0.0
        params, potential_fn, self.transforms, _ = initialize_model(
            self.model,
            model_args=args,
            model_kwargs=kwargs,
            init_strategy=self._init_strategy,
            jit_compile=self.jit and self.joint is None,
            skip_jit_warnings=True,
        )
        self._initial_params, self._names = params, tuple(sorted(params))
        shapes = {n: params[n].shape for n in self._names}
        self._sizes = [params[n].numel() for n in self._names]
        self._potential = (
            None
            if self.joint is None
            # fast path: analytic, else the compiled log joint
            else (
                _logjoint.analytic(self.joint, self._names, shapes, *args)
                or _logjoint.flat_potential_and_grad(
                    self.joint, self.transforms, *args, shapes=shapes, compile=self.jit
                )
            )
        )
        if self._potential is None:  # Pyro's traced potential, differentiated by autograd
            self._potential = lambda z: _value_and_grad(potential_fn, self._unflatten, z)
        z = self._flatten(params)
        u, g = self._potential(z)
        self._state = (z, float(u), g)
        self._adapter.configure(
            warmup_steps,
            mass_matrix_shape={self._names: (z.numel(),) * (2 if self._adapter.dense_mass else 1)},
            find_reasonable_step_size_fn=self._reasonable_step_size,
            options=dict(dtype=z.dtype, device=z.device),
        )
        if self.resume is not None:
            self._adapter.step_size = self.resume[0]
            self._adapter.mass_matrix_adapter.inverse_mass_matrix = {self._names: self.resume[1].to(z.dtype)}
        else:
            if self._start is not None:  # the metric starts at H^-1 at the mode (a small Pyro function)
                inverse_mass = self._start.inverse_mass(self._names, z.dtype)
                self._adapter.mass_matrix_adapter.inverse_mass_matrix = {self._names: inverse_mass}
            self._adapter.reset_step_size_adaptation(params)

    def logging(self):
        return {"step size": f"{self.step_size:.2e}", "acc. prob": f"{self._mean_accept:.3f}"}

    def sample(self, params):
        z, u, g = self._state
        step = self.step_size
        proposal, accept = self._propose(self._state, step, torch.randn_like(z))
        if torch.rand(()) < accept:
            self._state = z, u, g = proposal
        if self._t < self._warmup:
            self._adapter.step(self._t, self._unflatten(z), torch.tensor(accept))
        self._t += 1
        n = self._t - self._warmup if self._t > self._warmup else self._t
        self._mean_accept += (accept - self._mean_accept) / n
        self.stats = DrawStats(lp=-u, acceptance_rate=accept, step_size=step)
        return self._unflatten(z)

    # checkpoint/resume (bnn_pyro.infer.mcmc): the state; the global generators are the checkpoint's
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        (z, u, g), (tensors, adapter) = self._state, self._adapter_state()
        return {**tensors, "z": z, "grad": g}, {"adapter": adapter, "u": u, "counters": [self._t, self._mean_accept]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._load_adapter_state(tensors, meta["adapter"])
        self._state = (tensors["z"], meta["u"], tensors["grad"])
        self._t, self._mean_accept = meta["counters"]

    # ------------------------------------------------------------------ the proposal
    def _propose(self, state, step: float, eps: torch.Tensor):
        """The Langevin proposal from ``state = (z, U, grad)`` with noise ``eps``, and its acceptance probability."""
        z, u, g = state
        inv_mass, chol = self._metric()
        mean = z - 0.5 * step**2 * (inv_mass * g if inv_mass.dim() == 1 else inv_mass @ g)
        new = mean + step * (chol * eps if chol.dim() == 1 else chol @ eps)
        u_new, g_new = self._potential(new)
        back = new - 0.5 * step**2 * (inv_mass * g_new if inv_mass.dim() == 1 else inv_mass @ g_new)
        log_ratio = (
            u
            - float(u_new)
            + 0.5 * float(eps @ eps)
            - 0.5 * float(self._whiten(z - back, chol).square().sum() / step**2)
        )
        accept = min(1.0, torch.tensor(log_ratio).nan_to_num(float("-inf")).exp().item())
        return (new.detach(), float(u_new), g_new.detach()), accept

    def _metric(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse mass matrix ``A`` and its square root ``L`` (elementwise, or ``A``'s Cholesky factor)."""
        ((_, inv_mass),) = self.inverse_mass_matrix.items()
        if self._chol[0] is not inv_mass:
            self._chol = inv_mass, inv_mass.sqrt() if inv_mass.dim() == 1 else torch.linalg.cholesky(inv_mass)
        return inv_mass, self._chol[1]

    @staticmethod
    def _whiten(v: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
        return v / chol if chol.dim() == 1 else torch.linalg.solve_triangular(chol, v[:, None], upper=False)[:, 0]

    def _reasonable_step_size(self, params: dict) -> float:
        """Double or halve the step until one proposal's acceptance crosses ``target_accept`` (the start of dual
        averaging, as Hoffman & Gelman's heuristic for HMC)."""
        z = self._flatten(params)
        u, g = self._potential(z)
        state, eps = (z, float(u), g), torch.randn_like(z)
        step, target = float(self._given_step or self._adapter.step_size), self._adapter.target_accept_prob
        up = self._propose(state, step, eps)[1] > target
        for _ in range(60):
            bigger = step * 2.0 if up else step / 2.0
            if (self._propose(state, bigger, eps)[1] > target) != up:
                break
            step = bigger
        self._given_step = None  # the given step starts the first search only
        return step

    def _flatten(self, params: dict) -> torch.Tensor:
        return torch.cat([params[n].detach().reshape(-1) for n in self._names])

    def _unflatten(self, z: torch.Tensor) -> dict:
        return {n: p.reshape(self._initial_params[n].shape) for n, p in zip(self._names, z.split(self._sizes))}


def _value_and_grad(potential_fn, unflatten, z: torch.Tensor):
    z = z.detach().requires_grad_(True)
    u = potential_fn(unflatten(z))
    return u.detach(), torch.autograd.grad(u, z)[0]


@dataclass(frozen=True)
class MALAConfig(MCMCConfig):
    """MALA's options: :class:`~bnn_pyro.infer.mcmc.MCMCConfig`'s, with ``target_accept`` 0.574, the optimal
    acceptance of MALA in high dimension (Roberts & Rosenthal 1998)."""

    METHOD: ClassVar[str] = "mala"
    EXTENDS: ClassVar[bool] = True
    MODE_START: ClassVar[bool] = True
    target_accept: float | None = 0.574

    def kernel(self, model, chain: KernelSettings):
        return MALAKernel(model, chain.joint, **self.flat_options(chain), resume=chain.resume, metric=chain.metric)


@entry(MALAConfig)
def fit_mala(model, data: Data, config: MALAConfig) -> Posterior:
    """``bp.fit(..., method="mala")``: sample the posterior of ``model`` by MALA (module docstring; options:
    :class:`~bnn_pyro.infer.mcmc.MCMCConfig`)."""
    return sample(model, data, config)
