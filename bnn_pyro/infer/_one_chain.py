"""The one-chain kernels of the fast path: ``method="hmc"`` and ``method="nuts"`` over one flat vector.

Pyro's ``HMC`` and ``NUTS`` keep the position, momentum and gradient as dicts of site tensors and run each
leapfrog step through a differentiable potential (autograd per step). The fast path's kernels run the same
algorithms as ONE chain of :class:`~bnn_pyro.infer._batched.BatchedChains` (``C = 1``), with the transitions that
``chain_method="vectorized"`` runs for ``C`` chains: :func:`~bnn_pyro.infer._batched.hmc_transition` (a fixed number
of leapfrog steps per draw, ``num_leapfrog``, or ``max(1, int(trajectory_length / step_size))`` as Pyro counts them,
jittered per draw by ``leapfrog_jitter``; a Metropolis accept) and :func:`~bnn_pyro.infer._nuts.nuts_transition`;
Pyro's ``WarmupAdapter`` (dual averaging, Stan's windows, the step-size heuristic after each window; HMC's step
after warm-up aimed at ``target_accept`` by :func:`~bnn_pyro.infer._aimed_step.aimed_step`); divergences
(energy error > 1000 or NaN) rejected, never raised. The potential and its gradient are the analytic ones of
:mod:`bnn_pyro.infer._analytic` for a stack of ``nn.Linear`` layers and elementwise activations with Normal priors
and a Gaussian likelihood (a forward and a hand-written backward, eager), else the generic one recorded as one
compiled graph (:func:`bnn_pyro.infer._logjoint.flat_potential_and_grad`). Random numbers come from a
``torch.Generator`` seeded from the chain's seeded global generator, so the draws differ from Pyro's kernels' for
the same seed (same target). :class:`OneChainKernel` has Pyro's ``MCMCKernel`` interface (``setup``, ``sample``) and
the ``stats``/``state_dict`` that :mod:`bnn_pyro.infer.mcmc`'s loop reads.
"""

from __future__ import annotations

import torch
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _analytic, _logjoint
from bnn_pyro.infer._analytic_batched import OneChain, leapfrog_from
from bnn_pyro.infer._batched import BatchedChains, hmc_transition
from bnn_pyro.infer._kernels import AdaptedKernel
from bnn_pyro.infer.checkpoint import CheckpointError, current_names, read, run_identity

__all__ = [
    "OneChainKernel",
    "FlatHMC",
    "analytic_applies",
    "batched_target",
    "flat_layout",
    "refuse_old_checkpoints",
    "seeded_generator",
]

# the kernel states these kernels cannot continue, by method: (the key of the old kernel's checkpoint metadata,
# which kernel wrote it and which bnn_pyro ran that kernel on the fast path)
_OLD_KERNELS = {
    "nuts": ("rng", "the recursive NUTS kernel of an earlier bnn_pyro (up to commit a7736d0)"),
    "hmc": (
        "bp",
        "Pyro's HMC kernel, which bnn_pyro before 0158693 (main up to fcaf34e) ran where the analytic potential "
        "did not apply",
    ),
}


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
    analytic potential does not apply, or disagreed with the generic one at its probe point, and warned) the generic
    compiled ones. The leapfrog is a :class:`~bnn_pyro.infer._analytic_batched.OneChain` over the unbatched step
    (the generic potential's batched interface: :func:`~bnn_pyro.infer._analytic_batched.leapfrog_from`)."""
    pot = _logjoint.analytic(joint, names, shapes, x, y)
    if pot is not None:
        return pot.batch(1), OneChain(pot)
    flat = _logjoint.flat_potential_and_grad(joint, transforms, x, y, shapes=shapes, compile=jit)

    def potential(theta):
        u, g = flat(theta[0])
        return u.reshape(1), g.unsqueeze(0)

    return potential, OneChain(flat, batched=leapfrog_from(potential))


def refuse_old_checkpoints(ckpts: list, method: str) -> None:
    """Raise :class:`~bnn_pyro.infer.checkpoint.CheckpointError` naming every chain file of ``ckpts`` (a
    ``resume=True`` run of ``method`` on the fast path) that a kernel these kernels replaced wrote: its state cannot
    be continued. Called by the parent before any chain runs, so that no chain of the folder starts afresh beside
    an old file (parallel chains each run in a process of their own) and the folder is left as it was."""
    if method not in _OLD_KERNELS:
        return
    key, writer = _OLD_KERNELS[method]

    def old_kernel(c) -> bool:  # a file of another run (e.g. fast_path=False, which still writes that key) is left to
        meta = read(c.path)[1]  # Checkpoint.load, which names what differs (review 20)
        same_run = run_identity(current_names(meta.get("run", {}), c.run)) == run_identity(c.run)
        return same_run and key in meta.get("kernel", {})

    old = [str(c.path) for c in ckpts if c is not None and c.path.exists() and old_kernel(c)]
    if old:
        raise CheckpointError(
            f"checkpoint: {', '.join(repr(p) for p in old)} {'was' if len(old) == 1 else 'were'} written by {writer}; "
            f"this version runs its own {method.upper()} there and cannot continue that state. Resume it with the "
            "version that wrote it, or delete the folder's chain files (chain*.ckpt) to start afresh."
        )


class OneChainKernel(AdaptedKernel):
    """One chain of a batched ``transition`` over a flat vector (module docstring); its step size and mass matrix
    are its one :class:`~bnn_pyro.infer._batched.BatchedChains` chain's. ``resume = (step_size,
    inverse_mass_matrix)`` replaces the adapted state after setup (extending a posterior); ``stats`` holds the
    last draw's :class:`~bnn_pyro.infer._kernels.DrawStats`. ``aim_final_step``: as
    :class:`~bnn_pyro.infer._batched.BatchedChains`'s. ``unbatched``: the transition takes the chain as
    ``(D,)`` vectors and floats (``BatchedChains(unbatched=True)``; NUTS's does: no ``(1, D)`` view per draw)."""

    def __init__(
        self,
        model,
        joint,
        *,
        transition,
        options: dict,
        init_strategy,
        step_size=None,
        target_accept_prob=0.8,
        dense_mass=False,
        jit=True,
        unbatched=False,
        aim_final_step=False,
    ):
        self.model, self.joint, self.jit, self.resume, self.transforms = model, joint, jit, None, None
        self._transition, self._options, self._unbatched = transition, options, unbatched
        self._aim = aim_final_step
        self._init_strategy, self._step_size, self._target, self._dense = (
            init_strategy,
            step_size,
            target_accept_prob,
            dense_mass,
        )

    def setup(self, warmup_steps, *args, **kwargs):
        params, _, self.transforms, _ = initialize_model(
            self.model, model_args=args, model_kwargs=kwargs, init_strategy=self._init_strategy, skip_jit_warnings=True
        )
        self.initial_params = params
        self._names, self._shapes, sizes = flat_layout(params)
        potential, leapfrog = batched_target(self.joint, self._names, self._shapes, *args, self.transforms, self.jit)
        z = torch.cat([params[n].detach().reshape(-1) for n in self._names]).unsqueeze(0)
        self.chains = BatchedChains(
            potential,
            leapfrog,
            z,
            names=self._names,
            sizes=sizes,
            warmup_steps=warmup_steps,
            transition=self._transition,
            options=self._options,
            generator=seeded_generator(z),
            step_size=self._step_size,
            target_accept_prob=self._target,
            dense_mass=self._dense,
            resume=None if self.resume is None else [self.resume],
            unbatched=self._unbatched,
            aim_final_step=self._aim,
        )
        self._sites = list(zip(self._names, self._shapes.values()))

    @property
    def step_size(self) -> float:
        return self.chains.step_sizes[0]

    @property
    def inverse_mass_matrix(self) -> dict:
        return {self._names: self.chains.inverse_mass_matrix[0]}

    def logging(self):
        return self.chains.logging()

    def sample(self, params):
        z = self.chains.sample()
        z = z if z.dim() == 1 else z[0]
        self.stats = self.chains.stats[0]
        # a site already flat is its part of the split as it is (a view either way)
        return {
            n: part if part.shape == s else part.reshape(s)
            for (n, s), part in zip(self._sites, z.split_with_sizes(self.chains.sizes))
        }

    def state_dict(self):
        return self.chains.state_dict()

    def load_state_dict(self, tensors, meta):
        self.chains.load_state_dict(tensors, meta)


class FlatHMC(OneChainKernel):
    """HMC for one chain over a flat vector: :func:`~bnn_pyro.infer._batched.hmc_transition` at ``C = 1``
    (module docstring), its step after warm-up aimed at ``target_accept`` (``aim_final_step``)."""

    def __init__(
        self,
        model,
        joint,
        *,
        init_strategy,
        step_size=None,
        target_accept_prob=0.8,
        dense_mass=False,
        num_leapfrog=None,
        trajectory_length=None,
        jit=True,
        leapfrog_jitter=0.0,
    ):
        options = (
            dict(num_steps=num_leapfrog) if num_leapfrog is not None else dict(trajectory_length=trajectory_length)
        )
        super().__init__(
            model,
            joint,
            transition=hmc_transition,
            options=dict(options, jitter=leapfrog_jitter),
            init_strategy=init_strategy,
            step_size=step_size,
            target_accept_prob=target_accept_prob,
            dense_mass=dense_mass,
            jit=jit,
            aim_final_step=True,
        )

    @property
    def step_size_origin(self) -> str:
        """Which rule gave the step after warm-up (:attr:`~bnn_pyro.infer._batched.BatchedChains.step_size_origins`;
        ``Posterior.config["step_size_origin"]``)."""
        return self.chains.step_size_origins[0]
