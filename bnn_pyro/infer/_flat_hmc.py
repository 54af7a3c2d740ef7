"""HMC over one flat vector: the fast path's HMC kernel for ``bp.fit(..., method="hmc")``.

Pyro's ``HMC`` keeps the position, momentum and gradient as dicts of site tensors and runs each leapfrog step
through its own integrator and a differentiable potential (autograd per step). On the analytic path (a stack of
``nn.Linear`` layers and elementwise activations, Normal priors, Gaussian likelihood:
:mod:`bnn_pyro.infer._analytic`) this kernel runs the same algorithm as ONE chain of
:class:`~bnn_pyro.infer._batched.BatchedChains` (``C = 1``): the batched analytic leapfrog, Pyro's
``WarmupAdapter`` (dual averaging, Stan's windows, the step-size heuristic after each window), a fixed number of
leapfrog steps per draw (``num_leapfrog``) or ``max(1, int(trajectory_length / step_size))`` as Pyro counts them,
jittered per draw (``leapfrog_jitter``),
a Metropolis accept, divergences (energy error > 1000 or NaN) rejected. Its random numbers come from a
``torch.Generator`` seeded from the chain's seeded global generator, so its draws differ from Pyro's ``HMC``'s
for the same seed (same target). :class:`FlatHMC` has Pyro's ``MCMCKernel`` interface (``setup``, ``sample``) and
the ``stats``/``state_dict`` that :mod:`bnn_pyro.infer.mcmc`'s loop reads, like
:class:`~bnn_pyro.infer._nuts.FlatNUTS`.
"""

from __future__ import annotations

import torch
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _analytic, _logjoint
from bnn_pyro.infer._analytic_batched import leapfrog_from, one_chain_leapfrog
from bnn_pyro.infer._batched import BatchedChains, hmc_transition
from bnn_pyro.infer._kernels import AdaptedKernel

__all__ = ["FlatHMC", "analytic_applies", "flat_layout", "seeded_generator"]


def analytic_applies(joint, x, y) -> bool:
    """Whether the analytic potential covers this model (structure only: the layers, priors and likelihood that
    :func:`bnn_pyro.infer._analytic.build` accepts; the values are checked when a chain builds it)."""
    if joint is None:
        return False
    shapes = {n: torch.Size(d.batch_shape + d.event_shape) for n, d in joint.priors.items()}
    return _analytic.build(joint, sorted(shapes), shapes, x, y) is not None


def flat_layout(params: dict) -> tuple[tuple[str, ...], dict, list[int]]:
    """The flat vector's layout: the sites in sorted order (Pyro's: mass matrices are interchangeable between
    kernels), their shapes and sizes."""
    names = tuple(sorted(params))
    return names, {n: params[n].shape for n in names}, [int(params[n].numel()) for n in names]


def seeded_generator(like: torch.Tensor) -> torch.Generator:
    """The chains' own generator, seeded from torch's (seeded) global one."""
    return torch.Generator(device=like.device).manual_seed(int(torch.randint(2**62, ())))


def batched_target(joint, names, shapes: dict, x, y, transforms: dict, jit: bool):
    """``(potential, leapfrog)`` of :mod:`bnn_pyro.infer._batched` for ONE chain: the analytic ones, else (the
    analytic potential disagreed with the generic one at its probe point, and warned) the generic compiled one."""
    pot = _logjoint.analytic(joint, names, shapes, x, y)
    if pot is not None:  # one chain: the unbatched bound-data step (benchmarks/engine_speed.py --only hmc)
        return pot.batch(1), one_chain_leapfrog(pot)

    flat = _logjoint.flat_potential_and_grad(joint, transforms, x, y, shapes=shapes, compile=jit)

    def potential(theta):
        u, g = flat(theta[0])
        return u.reshape(1), g.unsqueeze(0)

    return potential, leapfrog_from(potential)


class FlatHMC(AdaptedKernel):
    """HMC for one chain over a flat vector (module docstring); its step size and mass matrix are its one
    :class:`~bnn_pyro.infer._batched.BatchedChains` chain's (``AdaptedKernel``'s ``initial_params`` kept). ``resume = (step_size, inverse_mass_matrix)``
    replaces the adapted state after setup; ``stats`` holds the last draw's :class:`DrawStats`."""

    def __init__(self, model, joint, *, init_strategy, step_size=None, target_accept_prob=0.8, dense_mass=False,
                 num_leapfrog=None, trajectory_length=None, jit=True, leapfrog_jitter=0.0):
        self.model, self.joint, self.jit, self.resume, self.transforms = model, joint, jit, None, None
        self._init_strategy, self._step_size, self._target, self._dense = (init_strategy, step_size,
                                                                           target_accept_prob, dense_mass)
        self._options = (dict(num_steps=num_leapfrog) if num_leapfrog is not None
                         else dict(trajectory_length=trajectory_length))
        self._options["jitter"] = leapfrog_jitter

    def setup(self, warmup_steps, *args, **kwargs):
        params, _, self.transforms, _ = initialize_model(self.model, model_args=args, model_kwargs=kwargs,
                                                         init_strategy=self._init_strategy, skip_jit_warnings=True)
        self.initial_params = params
        self._names, self._shapes, sizes = flat_layout(params)
        potential, leapfrog = batched_target(self.joint, self._names, self._shapes, *args, self.transforms, self.jit)
        z = torch.cat([params[n].detach().reshape(-1) for n in self._names]).unsqueeze(0)
        self.chains = BatchedChains(potential, leapfrog, z, names=self._names, sizes=sizes, warmup_steps=warmup_steps,
                                    transition=hmc_transition, options=self._options, generator=seeded_generator(z),
                                    step_size=self._step_size, target_accept_prob=self._target, dense_mass=self._dense,
                                    resume=None if self.resume is None else [self.resume])

    @property
    def step_size(self) -> float:
        return self.chains.step_sizes[0]

    @property
    def inverse_mass_matrix(self) -> dict:
        return {self._names: self.chains.inverse_mass_matrix[0]}

    def logging(self):
        return self.chains.logging()

    def sample(self, params):
        z = self.chains.sample()[0]
        self.stats = self.chains.stats[0]
        return {n: part.reshape(s) for n, part, s in zip(self._names, z.split(self.chains.sizes), self._shapes.values())}

    def state_dict(self):
        return self.chains.state_dict()

    def load_state_dict(self, tensors, meta):
        self.chains.load_state_dict(tensors, meta)
