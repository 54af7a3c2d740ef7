"""Pyro's NUTS and HMC with per-draw statistics (leapfrog steps, tree depth, the Hamiltonian after the momentum
refresh, acceptance of each draw) and an adaptive random-walk Metropolis kernel, for :mod:`bnn_pyro.infer.mcmc`.

They subclass Pyro's kernels and read some of their private state (``_t``, ``_warmup_steps``,
``_mean_accept_prob``, ``_divergences``, ``_adapter``): listed in
:data:`bnn_pyro._upstream_private.KERNEL_ATTRIBUTES` and checked by tests/test_upstream_private.py.
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro import poutine
from pyro.infer.mcmc import HMC, NUTS, RandomWalkKernel
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _logjoint

__all__ = ["_NUTS", "_HMC", "_Metropolis"]


class _Counted:
    """Mixin for Pyro's HMC/NUTS: counts leapfrog steps (gradient evaluations), records the
    Hamiltonian after the momentum refresh, and keeps the last draw's statistics in ``stats``.
    ``resume = (step_size, inverse_mass_matrix)`` replaces the adaptation's state after setup."""

    resume = None
    joint = None  # a LogJoint: the fast path's potential energy replaces Pyro's
    jit = False  # compile the fast path's potential

    def _initialize_model_properties(self, model_args, model_kwargs):
        super()._initialize_model_properties(model_args, model_kwargs)
        if self.joint is not None:
            self.potential_fn = _logjoint.potential(self.joint, self.transforms, *model_args, jit=self.jit)

    def setup(self, warmup_steps, *args, **kwargs):
        super().setup(warmup_steps, *args, **kwargs)
        if self.resume is not None:
            self._adapter.step_size = self.resume[0]
            ((names, _),) = self.inverse_mass_matrix.items()
            self.mass_matrix_adapter.inverse_mass_matrix = {names: self.resume[1].to(self._potential_energy_last.dtype)}
        self._grad_evals, potential = 0, self.potential_fn

        def counted(z):
            self._grad_evals += 1
            return potential(z)

        self.potential_fn = counted

    def _sample_r(self, name):
        r, r_unscaled = super()._sample_r(name)
        self._energy = float(self._kinetic_energy(r_unscaled) + self._potential_energy_last)
        return r, r_unscaled

    @property
    def num_steps(self):
        fixed = getattr(self, "fixed_num_steps", None)
        return fixed if fixed is not None else super().num_steps

    def sample(self, params):
        evals, mean, divs, step = self._grad_evals, self._mean_accept_prob, len(self._divergences), self.step_size
        with _SiteCounter("direction_") as doublings:
            z = super().sample(params)
        # Pyro keeps a running mean of the acceptance probability (restarted after warm-up), updated
        # as mean += (a - mean) / n with the step counter already advanced; invert it for this draw.
        n = self._t - self._warmup_steps if self._t > self._warmup_steps else self._t
        accept = min(max(mean + n * (self._mean_accept_prob - mean), 0.0), 1.0)
        self.stats = dict(lp=-float(self._potential_energy_last), acceptance_rate=accept,
                          step_size=step, diverging=len(self._divergences) > divs, n_steps=self._grad_evals - evals,
                          energy=self._energy)
        if isinstance(self, NUTS):
            self.stats["tree_depth"] = doublings.count
        return z


class _SiteCounter(poutine.messenger.Messenger):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.count = prefix, 0

    def _pyro_sample(self, msg):
        self.count += msg["name"].startswith(self.prefix)


class _NUTS(_Counted, NUTS):
    pass


class _HMC(_Counted, HMC):
    pass


class _Metropolis(RandomWalkKernel):
    """Random-walk Metropolis with a proposal ``w + h * L eps`` whose scale ``h`` (dual averaging
    toward ``target_accept_prob``) and shape ``L`` (the posterior standard deviations, or the
    Cholesky factor of the covariance when ``dense``) are adapted in Stan's warm-up windows by
    Pyro's :class:`WarmupAdapter`. After each window ``h`` restarts at ``2.38 / sqrt(d)``, the
    optimal scale for a Gaussian target of dimension ``d`` (Gelman, Roberts & Gilks 1996)."""

    def __init__(self, model, *, init_strategy, step_size=None, target_accept_prob=0.234, dense=False, jit=False,
                 joint=None):
        super().__init__(model, init_step_size=float(step_size or 0.1), target_accept_prob=target_accept_prob)
        self._init_strategy, self._jit, self._given_step, self._cov = init_strategy, jit, step_size is not None, None
        self.joint = joint
        self._adapter = WarmupAdapter(step_size or 0.1, adapt_step_size=True, target_accept_prob=target_accept_prob,
                                      adapt_mass_matrix=True, dense_mass=dense)

    def setup(self, warmup_steps, *args, **kwargs):
        self._warmup_steps, self._t, self._accept_cnt, self._mean_accept_prob = warmup_steps, 0, 0, 0.0
        self._initial_params, self.potential_fn, self.transforms, _ = initialize_model(
            self.model, model_args=args, model_kwargs=kwargs, init_strategy=self._init_strategy,
            jit_compile=self._jit and self.joint is None, skip_jit_warnings=True)
        if self.joint is not None:  # no gradient needed: the generic potential (its seeded runs unchanged)
            self.potential_fn = _logjoint.potential(self.joint, self.transforms, *args, jit=self._jit, analytic=False)
        self._energy_last = self.potential_fn(self._initial_params)
        names = tuple(sorted(self._initial_params))
        size = sum(v.numel() for v in self._initial_params.values())
        optimal = 2.38 / math.sqrt(size)
        self._adapter.configure(warmup_steps, initial_step_size=self.init_step_size if self._given_step else optimal,
                                mass_matrix_shape={names: (size, size) if self._adapter.dense_mass else (size,)},
                                find_reasonable_step_size_fn=lambda z: optimal,
                                options=dict(dtype=self._energy_last.dtype, device=self._energy_last.device))
        scheme = self._adapter._step_size_adapt_scheme  # dual averaging starts near 10 * the initial step
        scheme.prox_center = math.log(10 * self._adapter.step_size)
        scheme.reset()

    def _noise(self, params):
        """``L eps`` with ``L L^T`` the adapted proposal covariance, unpacked into the sites."""
        ((names, cov),) = self._adapter.mass_matrix_adapter.inverse_mass_matrix.items()
        if cov is not self._cov:
            self._cov, self._chol = cov, cov.sqrt() if cov.dim() == 1 else torch.linalg.cholesky(cov)
        eps = torch.randn(cov.shape[0], dtype=cov.dtype, device=cov.device)
        flat, out, pos = (self._chol * eps if cov.dim() == 1 else self._chol @ eps), {}, 0
        for name in names:
            out[name] = flat[pos : pos + params[name].numel()].reshape(params[name].shape)
            pos += params[name].numel()
        return out

    def sample(self, params):
        step, noise = self._adapter.step_size, self._noise(params)
        proposal = {k: v + step * noise[k] for k, v in params.items()}
        energy = self.potential_fn(proposal)
        accept_prob = (self._energy_last - energy).exp().clamp(max=1.0).nan_to_num(0.0)
        if pyro.sample(f"rand_t={self._t}", pyro.distributions.Uniform(0.0, 1.0)) < accept_prob:
            params, self._energy_last = proposal, energy
            self._accept_cnt += self._t >= self._warmup_steps
        self._t += 1
        if self._t <= self._warmup_steps:
            self._adapter.step(self._t - 1, params, accept_prob)
        n = self._t - self._warmup_steps if self._t > self._warmup_steps else self._t
        self._mean_accept_prob += (float(accept_prob) - self._mean_accept_prob) / n
        self._log_step_size = math.log(self._adapter.step_size)  # read by RandomWalkKernel.logging
        self.stats = dict(lp=-float(self._energy_last), acceptance_rate=float(accept_prob), step_size=step)
        return params.copy()
