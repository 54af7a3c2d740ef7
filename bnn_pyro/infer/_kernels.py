"""Pyro's NUTS and HMC with per-draw statistics, an adaptive random-walk Metropolis kernel, and the typed
record of one draw (:class:`DrawStats`), for :mod:`bnn_pyro.infer.mcmc`.

The statistics come through Pyro's public surface: the kernels' public ``setup``/``sample``/``diagnostics``
and ``potential_fn``, the mass-matrix adapter's public properties, and poutine messengers that see the
momentum and tree-direction sample sites. One value has no public source: the acceptance probability of a
Pyro HMC/NUTS draw, recovered from Pyro's running mean (:func:`bnn_pyro.utils.upstream_private.mean_accept_prob`).
Checkpoints (each kernel's ``state_dict``/``load_state_dict``) read Pyro's kernel and warm-up adapter state,
which is private, through :func:`bnn_pyro.utils.upstream_private.hmc_state` and ``warmup_adapter_state``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pyro
import torch
from pyro import poutine
from pyro.infer.mcmc import HMC, NUTS
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _logjoint
from bnn_pyro.utils.upstream_private import (
    hmc_state,
    load_hmc_state,
    load_warmup_adapter_state,
    mean_accept_prob,
    restart_step_size_search,
    warmup_adapter_state,
)

__all__ = ["DrawStats", "sample_stats", "jittered_steps", "AdaptedKernel", "PyroNUTS", "PyroHMC", "Metropolis"]


class DrawStats(NamedTuple):
    """What one kept MCMC draw records (ArviZ's ``sample_stats`` names; ``None``: not defined for the kernel).

    lp: log joint density up to a constant (unconstrained space); acceptance_rate: the draw's Metropolis
    acceptance probability (NUTS: mean over the trajectory); step_size: the step (or proposal scale) used;
    diverging: the trajectory's energy error exceeded the threshold (NUTS/HMC); n_steps: leapfrog steps
    (gradient evaluations); energy: the Hamiltonian after the momentum refresh (for BFMI); tree_depth:
    trajectory doublings tried (NUTS).
    """

    lp: float
    acceptance_rate: float
    step_size: float
    diverging: bool | None = None
    n_steps: int | None = None
    energy: float | None = None
    tree_depth: int | None = None


def sample_stats(draws: list[DrawStats]) -> dict[str, torch.Tensor]:
    """One chain's per-draw records as ``Posterior.sample_stats`` columns shaped ``(draws,)``: floats as
    float32, counts as int64, flags as bool; fields that are ``None`` for the kernel are left out."""
    return {
        name: torch.tensor([getattr(d, name) for d in draws])
        for name in DrawStats._fields
        if getattr(draws[0], name) is not None
    }


def jittered_steps(num_steps: int, jitter: float, uniform: float) -> int:
    """One draw's leapfrog count: uniform over the integers from ``ceil((1 - jitter) * num_steps)`` to
    ``floor((1 + jitter) * num_steps)`` (at least 1), picked by ``uniform`` in [0, 1); its mean is ``num_steps``.

    A fixed count resonates: on a Gaussian (any posterior's leading order) a trajectory of ``L`` steps of size
    ``h`` turns each direction of frequency ``w`` by an angle near ``L h w``; where that angle is near a multiple of
    ``pi`` the draw returns next to where it started, draw after draw, and the chain barely moves along that
    direction. A count that varies from draw to draw breaks the repetition (Neal 2011, "MCMC using Hamiltonian
    dynamics", sec. 5.4.2.2; Stan jitters the step size instead, ``stepsize_jitter``, which would also disturb its
    adaptation)."""
    lo = max(1, math.ceil((1.0 - jitter) * num_steps))
    hi = max(lo, math.floor((1.0 + jitter) * num_steps))
    return lo + min(int(uniform * (hi - lo + 1)), hi - lo)


class _SiteWatch(poutine.messenger.Messenger):
    """Sees the auxiliary sample sites of one Pyro HMC/NUTS transition: counts the tree doublings
    (``direction_t=...``) and keeps the unscaled momentum (``r_t=...``, standard normal)."""

    def __init__(self):
        super().__init__()
        self.doublings, self.momenta = 0, []

    def _pyro_post_sample(self, msg):
        self.doublings += msg["name"].startswith("direction_")
        if msg["name"].startswith("r_t="):
            self.momenta.append(msg["value"])


class _Counted:
    """Mixin for Pyro's HMC/NUTS: counts leapfrog steps (gradient evaluations, by wrapping the public
    ``potential_fn``), records the Hamiltonian after the momentum refresh, and keeps the last draw's
    :class:`DrawStats` in ``stats``. ``fixed_num_steps``: HMC's leapfrog steps, kept through adaptation.
    ``resume = inverse_mass_matrix``: set after setup (extending a posterior; the step size is passed to the
    constructor with its adaptation off). ``metric``: its ``H^{-1}`` set after setup, then Pyro's initial
    step-size search rerun under it from the constructor's step (Pyro's first search ran under the identity).
    The potential of each new state is evaluated once more (without its gradient), which Pyro computes but keeps
    private: one extra evaluation per draw."""

    resume = None
    metric = None  # a ModeStart (bnn_pyro.infer._mode_start): the dense metric adaptation starts at its H^-1
    fixed_num_steps = None
    leapfrog_jitter = 0.0  # HMC: each draw's leapfrog count drawn by jittered_steps around num_steps
    _bp_jittered = None

    def setup(self, warmup_steps, *args, **kwargs):
        first_step = self.step_size  # the constructor's: where Pyro's initial step-size search starts
        super().setup(warmup_steps, *args, **kwargs)
        params = self.initial_params
        if self.resume is not None:
            ((names, _),) = self.inverse_mass_matrix.items()
            dtype = next(iter(params.values())).dtype
            self.mass_matrix_adapter.inverse_mass_matrix = {names: self.resume.to(dtype)}
        elif self.metric is not None:
            ((names, _),) = self.inverse_mass_matrix.items()
            dtype = next(iter(params.values())).dtype
            self.mass_matrix_adapter.inverse_mass_matrix = {names: self.metric.inverse_mass(names, dtype)}
            # Pyro searched its initial step size under the identity metric: search again under H^-1, from the
            # same first step, so that dual averaging starts near the step this metric allows (as Metropolis)
            restart_step_size_search(self, first_step, params)
        self._bp_warmup, self._bp_draws, self._bp_grad_evals, potential = warmup_steps, 0, 0, self.potential_fn
        self._bp_mean_accept = 0.0

        def counted(z):
            self._bp_grad_evals += 1
            return potential(z)

        self.potential_fn = counted
        self._bp_potential = self._evaluate(params)

    def _evaluate(self, z) -> torch.Tensor:
        evals = self._bp_grad_evals
        with torch.no_grad():
            u = self.potential_fn(z)
        self._bp_grad_evals = evals  # not a leapfrog step
        return u

    @property
    def num_steps(self):
        if self._bp_jittered is not None:
            return self._bp_jittered
        return self.fixed_num_steps if self.fixed_num_steps is not None else super().num_steps

    def sample(self, params):
        evals, step, u0 = self._bp_grad_evals, self.step_size, self._bp_potential
        if self.leapfrog_jitter > 0 and not isinstance(self, NUTS):  # from the chain's seeded global generator
            self._bp_jittered = None  # the un-jittered count first
            uniform = float(torch.rand((), dtype=torch.float64))
            self._bp_jittered = jittered_steps(self.num_steps, self.leapfrog_jitter, uniform)
        with _SiteWatch() as watch:
            z = super().sample(params)
        self._bp_draws += 1
        kept = self._bp_draws > self._bp_warmup
        n = self._bp_draws - self._bp_warmup if kept else self._bp_draws  # Pyro's running-mean count
        before, self._bp_mean_accept = self._bp_mean_accept, mean_accept_prob(self)
        accept = min(max(before + n * (self._bp_mean_accept - before), 0.0), 1.0)  # this draw's, from the mean
        divergences = self.diagnostics()["divergences"] if kept else ()  # Pyro counts them after warm-up only
        kinetic = 0.0
        for r in watch.momenta:  # 1/2 |r|^2 of the standard-normal momentum (Pyro's kinetic energy)
            kinetic = kinetic + r.dot(r)
        self._bp_potential = self._evaluate(z)
        self.stats = DrawStats(
            lp=-float(self._bp_potential),
            acceptance_rate=accept,
            step_size=step,
            diverging=bool(divergences) and divergences[-1] == n - 1,
            n_steps=self._bp_grad_evals - evals,
            energy=float(0.5 * kinetic + u0),
            tree_depth=watch.doublings if isinstance(self, NUTS) else None,
        )
        return z

    # checkpoint/resume (bnn_pyro.infer.mcmc): Pyro's kernel state, then this mixin's counters
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = hmc_state(self)
        tensors["bp_potential"] = self._bp_potential
        meta["bp"] = [self._bp_draws, self._bp_grad_evals, self._bp_mean_accept]
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_hmc_state(self, tensors, meta)
        self._bp_potential = tensors["bp_potential"]
        self._bp_draws, self._bp_grad_evals, self._bp_mean_accept = meta["bp"]


class PyroNUTS(_Counted, NUTS):
    pass


class PyroHMC(_Counted, HMC):
    @property
    def step_size_origin(self) -> str:
        """Where the step after warm-up came from (``Posterior.config["step_size_origin"]``): Pyro's dual
        average ``exp(x_bar)``, or the extended chain's (``resume``)."""
        return "dual_average" if self.resume is None else "extended"


def pyro_kernel(kind: str, model, *, jit: bool, init_strategy, resume=None, metric=None, **options):
    """Pyro's ``NUTS`` (``kind="nuts"``) or ``HMC`` with the statistics of :class:`_Counted`, tracing ``model``
    (compiled by Pyro when ``jit``): the path without a log joint (the fast path's kernels are
    :mod:`bnn_pyro.infer._one_chain`'s). ``resume = (step_size, inverse_mass_matrix)``: no adaptation, that state
    kept; ``metric``: a ``ModeStart`` whose ``H^{-1}`` the (dense, ``full_mass=True``) adaptation starts from."""
    cls = PyroNUTS if kind == "nuts" else PyroHMC
    if resume is not None:
        options.update(step_size=resume[0], adapt_step_size=False, adapt_mass_matrix=False)
    kernel = cls(model, jit_compile=jit, ignore_jit_warnings=True, init_strategy=init_strategy, **options)
    kernel.resume, kernel.metric = None if resume is None else resume[1], metric
    return kernel


class AdaptedKernel(MCMCKernel):
    """What our kernels (:class:`Metropolis`, :class:`~bnn_pyro.infer._nuts.FlatNUTS`,
    :class:`~bnn_pyro.infer._one_chain.FlatHMC`, :class:`~bnn_pyro.infer.mala.MALAKernel`) share: Pyro's
    ``MCMCKernel`` starting point (``initial_params``), the step size and inverse mass matrix (or proposal
    covariance) of their Pyro :class:`WarmupAdapter` ``self._adapter``, and its state for checkpoints."""

    @property
    def initial_params(self):
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params):
        self._initial_params = params

    @property
    def step_size(self) -> float:
        return self._adapter.step_size

    @property
    def inverse_mass_matrix(self) -> dict:
        return self._adapter.mass_matrix_adapter.inverse_mass_matrix

    def _adapter_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = warmup_adapter_state(self._adapter)
        return {f"adapter/{k}": v for k, v in tensors.items()}, meta

    def _load_adapter_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        prefix = "adapter/"
        load_warmup_adapter_state(
            self._adapter, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, meta
        )


class Metropolis(AdaptedKernel):
    """Random-walk Metropolis with a proposal ``w + h * L eps`` whose scale ``h`` (dual averaging
    toward ``target_accept_prob``) and shape ``L`` (the posterior standard deviations, or the
    Cholesky factor of the covariance when ``dense``) are adapted in Stan's warm-up windows by
    Pyro's :class:`WarmupAdapter`. After each window ``h`` restarts at ``2.38 / sqrt(d)``, the
    optimal scale for a Gaussian target of dimension ``d`` (Gelman, Roberts & Gilks 1996).
    ``metric``: a :class:`~bnn_pyro.infer._mode_start.ModeStart`, whose ``H^{-1}`` (dense) the proposal
    covariance starts from instead of the identity (``None``: the identity)."""

    def __init__(
        self,
        model,
        *,
        init_strategy,
        step_size=None,
        target_accept_prob=0.234,
        dense=False,
        jit=False,
        joint=None,
        metric=None,
    ):
        self.model, self.joint, self.transforms, self._metric = model, joint, None, metric
        self._init_strategy, self._jit, self._given_step, self._cov = init_strategy, jit, step_size, None
        self._adapter = WarmupAdapter(
            step_size or 0.1,
            adapt_step_size=True,
            target_accept_prob=target_accept_prob,
            adapt_mass_matrix=True,
            dense_mass=dense or metric is not None,
        )

    def setup(self, warmup_steps, *args, **kwargs):
        self._warmup_steps, self._t, self._accept_cnt, self._mean_accept_prob = warmup_steps, 0, 0, 0.0
        self._initial_params, self.potential_fn, self.transforms, _ = initialize_model(
            self.model,
            model_args=args,
            model_kwargs=kwargs,
            init_strategy=self._init_strategy,
            jit_compile=self._jit and self.joint is None,
            skip_jit_warnings=True,
        )
        if self.joint is not None:  # no gradient needed: the generic potential (its seeded runs unchanged)
            self.potential_fn = _logjoint.potential(self.joint, self.transforms, *args, jit=self._jit)
        self._energy_last = self.potential_fn(self._initial_params)
        names = tuple(sorted(self._initial_params))
        size = sum(v.numel() for v in self._initial_params.values())
        optimal = 2.38 / math.sqrt(size)
        # the proposal's dtype is the parameters' (a float64 target makes the energy float64 under float32 weights)
        like = next(iter(self._initial_params.values()))
        starts = [float(self._given_step or optimal)]  # the first step size; after each window, the optimal one

        def restart(z):
            return starts.pop() if starts else optimal

        self._adapter.configure(
            warmup_steps,
            mass_matrix_shape={names: (size, size) if self._adapter.dense_mass else (size,)},
            find_reasonable_step_size_fn=restart,
            options=dict(dtype=like.dtype, device=like.device),
        )
        if self._metric is not None:
            inverse_mass = self._metric.inverse_mass(names, like.dtype)
            self._adapter.mass_matrix_adapter.inverse_mass_matrix = {names: inverse_mass}
        self._adapter.reset_step_size_adaptation(self._initial_params)  # dual averaging starts near 10 * that step

    def logging(self):
        return {"step size": f"{self.step_size:.2e}", "acc. prob": f"{self._mean_accept_prob:.3f}"}

    def diagnostics(self):
        return {"acceptance rate": self._accept_cnt / max(self._t - self._warmup_steps, 1)}

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
        self.stats = DrawStats(lp=-float(self._energy_last), acceptance_rate=float(accept_prob), step_size=step)
        return params.copy()

    # checkpoint/resume (bnn_pyro.infer.mcmc); the position is the caller's (``params``)
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, adapter = self._adapter_state()
        tensors["energy"] = self._energy_last
        return tensors, {"adapter": adapter, "counters": [self._t, self._accept_cnt, self._mean_accept_prob]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._load_adapter_state(tensors, meta["adapter"])
        self._energy_last = tensors["energy"]
        self._t, self._accept_cnt, self._mean_accept_prob = meta["counters"]
