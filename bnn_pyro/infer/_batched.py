"""``C`` MCMC chains advanced together as ONE batched computation: the state of ``chain_method="vectorized"``.

A small net is dispatch-bound (each tensor operation costs about the same whatever its size), so ``C`` chains whose
positions are the rows of one ``(C, D)`` tensor cost less per chain than one chain at a time (NumPyro's
``chain_method="vectorized"``, blackjax's ``vmap`` over chains). The pieces:

- a **leapfrog** ``leapfrog(z, p, g, step, minv) -> (z, p, g, sharp, u, kinetic)``: one velocity-Verlet step of
  every chain; ``z, p, g, sharp`` ``(C, D)``, ``step`` ``(C,)`` signed step sizes, ``minv`` ``(C, D)`` diagonal or
  ``(C, D, D)`` dense inverse mass; ``u`` ``(C,)`` the potential at the new points, ``kinetic`` ``(C,)``
  ``0.5 p . M^-1 p``; tensors, no host read (:meth:`~bnn_pyro.infer._analytic.StackPotential.leapfrog_batch`, or
  :func:`~bnn_pyro.infer._analytic_batched.leapfrog_from` for any batched potential);
- a **transition** ``transition(z, u, g, step, minv, *, leapfrog, generator, **options) -> (z, u, g,
  TransitionStats)``: one MCMC transition of every chain, its momentum drawn inside from ``generator``
  (:func:`hmc_transition` here; NUTS's :func:`~bnn_pyro.infer._nuts.nuts_transition`);
- :class:`BatchedChains`: the chains' flat state, one Pyro ``WarmupAdapter`` PER CHAIN (the one-chain kernels of
  :mod:`bnn_pyro.infer._one_chain` are its ``C = 1`` case: dual averaging, Stan's windows, the step-size heuristic
  after each mass-matrix window; with ``aim_final_step`` (HMC), the step after warm-up from
  :func:`~bnn_pyro.infer._aimed_step.aimed_step`), per-chain step sizes and inverse mass matrices, one
  ``torch.Generator`` for every random number, per-draw :class:`~bnn_pyro.infer._kernels.DrawStats` per chain, and
  checkpoints.

The chains are exact and independent in distribution, but share one random stream: chain ``c``'s draws depend on
how many chains run beside it (they differ from ``chain_method="sequential"``'s for the same seed).
``tests/infer/test_batched.py`` checks the transition on 4,000 exact draws of a Gaussian at once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter
from torch import Tensor

from bnn_pyro.infer._aimed_step import AimedStep, aimed_step
from bnn_pyro.infer._analytic_batched import sharp
from bnn_pyro.infer._kernels import DrawStats, jittered_steps
from bnn_pyro.utils.upstream_private import load_warmup_adapter_state, warmup_adapter_state

__all__ = ["TransitionStats", "BatchedChains", "hmc_transition", "momentum", "search_step_size", "MAX_ENERGY_ERROR"]

MAX_ENERGY_ERROR = 1000.0  # Stan's divergence threshold: a larger energy error (or NaN) is a divergence


class TransitionStats(NamedTuple):
    """One transition of ``C`` chains; every field a ``(C,)`` tensor or a list of ``C`` Python numbers."""

    accept_prob: Tensor | list  # float: the draw's mean Metropolis acceptance (NUTS: over the trajectory)
    n_steps: Tensor | list  # int: leapfrog steps (gradient evaluations)
    diverging: Tensor | list  # bool
    energy: Tensor | list  # float: the Hamiltonian after the momentum refresh
    tree_depth: Tensor | list | None  # int (NUTS) or None (HMC)


def search_step_size(step: float, direction) -> float:
    """The loop of Pyro's (and Stan's) step-size heuristic: ``direction(step)`` is +1 where one leapfrog step's
    acceptance probability exceeds 0.8 (then double), else -1 (then halve), until it changes sign."""
    first = direction(step)
    lo, hi = 1e-10, 1e10  # Pyro's HMC defaults (min_stepsize, max_stepsize)
    while lo < step < hi:
        step *= 2.0**first
        if direction(step) != first:
            break
    return min(max(step, lo), hi)


def momentum(minv: Tensor, generator: torch.Generator, *, batched: bool = True) -> Tensor:
    """``p ~ N(0, M)`` for every chain, ``M = minv^-1``: ``eps / sqrt(minv)`` (diagonal), or ``L^-T eps`` with
    ``L L^T = minv`` (dense: ``M = L^-T L^-1``). ``batched=False``: one chain's ``(D,)`` or ``(D, D)`` ``minv``
    and a ``(D,)`` momentum (the same random numbers as the ``C = 1`` batch: one stream, one ``randn`` of ``D``)."""
    if not batched:
        if minv.dim() == 1:
            return torch.randn(minv.shape, generator=generator, dtype=minv.dtype, device=minv.device) * minv.rsqrt()
        return momentum(minv.unsqueeze(0), generator)[0]  # dense: the batched factorisation, bit for bit
    eps = torch.randn(minv.shape[:2], generator=generator, dtype=minv.dtype, device=minv.device)
    if minv.dim() == 2:
        return eps * minv.rsqrt()
    factor = torch.linalg.cholesky(minv)
    return torch.linalg.solve_triangular(factor.mT, eps.unsqueeze(-1), upper=True).squeeze(-1)


def hmc_transition(
    z: Tensor,
    u: Tensor,
    g: Tensor,
    step: Tensor,
    minv: Tensor,
    *,
    leapfrog: Callable,
    generator: torch.Generator,
    num_steps: int | None = None,
    trajectory_length: float | None = None,
    jitter: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, TransitionStats]:
    """One HMC transition of every chain: a momentum refresh, ``num_steps`` leapfrog steps (or, given
    ``trajectory_length``, ``max(1, int(length / step))`` per chain, as Pyro's ``HMC`` counts them), each chain's
    count jittered by :func:`~bnn_pyro.infer._kernels.jittered_steps` when ``jitter > 0``, and a Metropolis accept per chain. A chain whose
    energy error exceeds 1000 or is NaN is diverging: its proposal is rejected (never raised)."""
    if (num_steps is None) == (trajectory_length is None):
        raise ValueError(
            f"hmc_transition: give num_steps= or trajectory_length=, one of the two (got {num_steps!r} "
            f"and {trajectory_length!r})."
        )
    if trajectory_length is not None:
        counts = [max(1, int(trajectory_length / s)) for s in step.tolist()]
    else:
        counts = [num_steps] * z.shape[0]
    if jitter > 0:
        uniform = torch.rand(z.shape[0], generator=generator, dtype=torch.float64, device=generator.device).tolist()
        counts = [jittered_steps(n, jitter, v) for n, v in zip(counts, uniform)]
    p = momentum(minv, generator)
    h0 = u + 0.5 * torch.linalg.vecdot(p, sharp(minv, p))
    most = max(counts)
    active = None if min(counts) == most else torch.tensor(counts, device=z.device)
    z1, p1, g1, u1, kinetic = z, p, g, u, None
    for i in range(most):
        z2, p2, g2, _, u2, k2 = leapfrog(z1, p1, g1, step, minv)
        if active is None or i < min(counts):
            z1, p1, g1, u1, kinetic = z2, p2, g2, u2, k2
            continue
        going = active > i  # chains with fewer steps keep the state after their last one
        z1, p1, g1 = (torch.where(going.unsqueeze(-1), new, old) for new, old in ((z2, z1), (p2, p1), (g2, g1)))
        u1, kinetic = torch.where(going, u2, u1), torch.where(going, k2, kinetic)
    error = (u1 + kinetic - h0).nan_to_num(nan=math.inf)
    accept_prob = torch.exp(-error).clamp(max=1.0)
    accepted = torch.rand(z.shape[0], generator=generator, dtype=z.dtype, device=z.device) < accept_prob
    z, g = torch.where(accepted.unsqueeze(-1), z1, z), torch.where(accepted.unsqueeze(-1), g1, g)
    u = torch.where(accepted, u1, u)
    n_steps = torch.tensor(counts, dtype=torch.int64, device=z.device)
    return z, u, g, TransitionStats(accept_prob, n_steps, error > MAX_ENERGY_ERROR, h0, None)


class BatchedChains:
    """``C`` chains of one ``transition`` over a flat ``(C, D)`` state (see the module docstring).

    ``potential(theta (C, D)) -> (U (C,), grad (C, D))`` and ``leapfrog`` evaluate the target; ``z`` is the chains'
    start ``(C, D)``, laid out as the sites ``names`` of ``sizes`` elements; ``options`` go to ``transition`` (HMC:
    ``num_steps`` or ``trajectory_length``; NUTS: ``max_tree_depth``). ``resume``: one ``(step_size, inverse mass
    matrix)`` per chain replaces the adapted state (extending a posterior, without warm-up).
    ``unbatched``: at ``C = 1`` with a leapfrog that has an ``unbatched`` step
    (:class:`~bnn_pyro.infer._analytic_batched.OneChain`), hold the chain as a ``(D,)`` position and gradient and a
    float potential and pass them so to ``transition`` (one that takes them:
    :func:`~bnn_pyro.infer._nuts.nuts_transition`), so that no ``(1, D)`` view is made per draw; :attr:`z`,
    :attr:`u`, :attr:`g` still read and write ``(C, D)``, ``(C,)``, ``(C, D)`` tensors. ``aim_final_step``: each
    chain ends warm-up at :func:`~bnn_pyro.infer._aimed_step.aimed_step` of its last window's (step, acceptance)
    pairs instead of the dual average ``exp(x_bar)``, which lies below the step the target asks for (HMC's kernels:
    a fixed number of leapfrog steps then runs a longer trajectory at the same cost; a fixed ``trajectory_length``,
    the same length in fewer steps); :attr:`step_size_origins` says, per chain, which rule gave its step.
    :meth:`sample` advances every chain; ``stats`` then holds the C :class:`DrawStats` of that draw."""

    def __init__(
        self,
        potential: Callable,
        leapfrog: Callable,
        z: Tensor,
        *,
        names: tuple[str, ...],
        sizes: list[int],
        warmup_steps: int,
        transition: Callable,
        options: dict,
        generator: torch.Generator,
        step_size: float | None = None,
        target_accept_prob: float = 0.8,
        dense_mass: bool = False,
        resume: list[tuple[float, Tensor]] | None = None,
        unbatched: bool = False,
        aim_final_step: bool = False,
    ):
        self.leapfrog, self.transition, self.options, self.generator = leapfrog, transition, options, generator
        self.names, self.sizes, self._warmup_steps = names, sizes, warmup_steps
        chains, size = z.shape
        # the one chain held unbatched: (D,) position and gradient, a float potential (class docstring)
        self._one = unbatched and chains == 1 and hasattr(leapfrog, "unbatched")
        with torch.no_grad():
            u, g = potential(z)
        self.z, self.u, self.g = z.clone(), u.clone(), g.clone()
        self._t, self._mean_accept, self._resumed = 0, [0.0] * chains, resume is not None
        self._minv_parts, self._steps = None, None
        # aim_final_step: per chain, the last window's (step, acceptance) pairs, for the step after warm-up
        self._window = [[] for _ in range(chains)] if aim_final_step else None
        self._adapters = [
            WarmupAdapter(
                step_size or 1.0,
                adapt_step_size=True,
                target_accept_prob=target_accept_prob,
                adapt_mass_matrix=True,
                dense_mass=dense_mass,
            )
            for _ in range(chains)
        ]
        for c, adapter in enumerate(self._adapters):
            adapter.configure(
                warmup_steps,
                mass_matrix_shape={names: (size, size) if dense_mass else (size,)},
                find_reasonable_step_size_fn=partial(self._reasonable_step_size, c),
                options=dict(dtype=z.dtype, device=z.device),
            )
            if resume is not None:
                adapter.step_size = resume[c][0]
                adapter.mass_matrix_adapter.inverse_mass_matrix = {names: resume[c][1].to(z.dtype)}
            else:
                adapter.reset_step_size_adaptation(self._sites(c))

    # ------------------------------------------------------------------ the chains' state, (C, D) / (C,) outside
    @property
    def z(self) -> Tensor:
        """The positions ``(C, D)``."""
        return self._z.unsqueeze(0) if self._one else self._z

    @z.setter
    def z(self, value: Tensor) -> None:
        self._z = value[0] if self._one else value

    @property
    def u(self) -> Tensor:
        """The potentials ``(C,)``."""
        return self._z.new_tensor([self._u]) if self._one else self._u

    @u.setter
    def u(self, value: Tensor) -> None:
        self._u = float(value[0]) if self._one else value

    @property
    def g(self) -> Tensor:
        """The potentials' gradients ``(C, D)``."""
        return self._g.unsqueeze(0) if self._one else self._g

    @g.setter
    def g(self, value: Tensor) -> None:
        self._g = value[0] if self._one else value

    # ------------------------------------------------------------------ the adapted state, per chain
    @property
    def step_sizes(self) -> list[float]:
        return [a.step_size for a in self._adapters]

    @property
    def inverse_mass_matrix(self) -> Tensor:
        """The chains' inverse mass matrices, ``(C, D)`` or ``(C, D, D)``."""
        mats = [a.mass_matrix_adapter.inverse_mass_matrix[self.names] for a in self._adapters]
        held = self._minv_parts  # the tensors stacked last (held, so that an identity test is sound)
        if held is None or any(m is not h for m, h in zip(mats, held)):  # restacked only when an adapter changed one
            self._minv_parts, self._minv = mats, torch.stack(mats)
        return self._minv

    @property
    def step_size_origins(self) -> list[str]:
        """Per chain, where the step it runs at after warm-up came from: ``"crossing"`` or ``"capped"`` (its
        :func:`~bnn_pyro.infer._aimed_step.aimed_step`, :class:`~bnn_pyro.infer._aimed_step.AimedStep`'s rules),
        ``"dual_average"`` (Pyro's ``exp(x_bar)``: no aim (NUTS), no falling curve in the window's pairs, or a
        checkpoint written before the aim, whose run goes on as it began) or ``"extended"`` (``resume``: the step of
        the chain extended). Read from the window's pairs, which checkpoints keep, so a resumed run says the same."""
        if self._resumed:
            return ["extended"] * len(self._adapters)
        aims = [self._aim(c) for c in range(len(self._adapters))]
        return ["dual_average" if aim is None else aim.origin for aim in aims]

    def _aim(self, c: int) -> AimedStep | None:
        """Chain ``c``'s aimed step from its window's pairs (``None``: none, or no window kept)."""
        pairs = None if self._window is None else self._window[c]
        return aimed_step(*zip(*pairs), target=self._adapters[c].target_accept_prob) if pairs else None

    def _sites(self, c: int) -> dict[str, Tensor]:
        return dict(zip(self.names, (self._z if self._one else self._z[c]).split(self.sizes)))

    def _step_tensor(self, steps: list[float]) -> tuple[Tensor, list[float]]:
        """The step sizes as a ``(C,)`` tensor of the chains' dtype, and its values read back (the floats a
        transition uses, rounded to that dtype); made again only when an adapter changed one."""
        if self._steps is None or self._steps[0] != steps:
            made = torch.tensor(steps, dtype=self._z.dtype, device=self._z.device)
            self._steps = (steps, made, made.tolist())
        return self._steps[1:]

    # ------------------------------------------------------------------ one draw of every chain
    def sample(self) -> Tensor:
        """One transition of every chain (adapting during warm-up); returns the positions ``(C, D)`` (``(D,)``
        where the one chain is held ``unbatched``)."""
        if torch.is_grad_enabled():  # nothing is differentiated (a test, not a decorator: none per draw when off)
            with torch.no_grad():
                return self.sample()
        steps = [self._adapters[0].step_size] if self._one else self.step_sizes
        step, rounded = self._step_tensor(steps)
        if self._one:  # the adapter's own (D,) or (D, D) inverse mass matrix and a float step
            step, minv = rounded[0], self._adapters[0].mass_matrix_adapter.inverse_mass_matrix[self.names]
        else:
            minv = self.inverse_mass_matrix
        z, u, g, stats = self.transition(
            self._z, self._u, self._g, step, minv, leapfrog=self.leapfrog, generator=self.generator, **self.options
        )
        self._z, self._u, self._g = z, u, g
        columns = [stats.accept_prob, stats.n_steps, stats.diverging, stats.energy, [u] if self._one else u]
        if stats.tree_depth is not None:
            columns.append(stats.tree_depth)
        rows = _rows(columns)
        warm, self._t = self._t < self._warmup_steps, self._t + 1
        n = self._t - self._warmup_steps if self._t > self._warmup_steps else self._t
        self.stats = []
        for c, (accept, n_steps, diverging, energy, potential, *depth) in enumerate(rows):
            if warm:
                self._adapt(c, steps[c], accept)
            self._mean_accept[c] += (accept - self._mean_accept[c]) / n
            self.stats.append(
                DrawStats(
                    lp=-potential,
                    acceptance_rate=accept,
                    step_size=steps[c],
                    diverging=bool(diverging),
                    n_steps=int(n_steps),
                    energy=energy,
                    tree_depth=int(depth[0]) if depth else None,
                )
            )
        return z

    def _adapt(self, c: int, step: float, accept: float) -> None:
        """Chain ``c``'s adaptation after warm-up iteration ``self._t - 1`` (run at ``step``, accepted with
        probability ``accept``); with ``aim_final_step``, the step after warm-up is
        :func:`~bnn_pyro.infer._aimed_step.aimed_step` of the last window's pairs (where it finds one) instead of the
        dual average's ``exp(x_bar)``."""
        adapter, t = self._adapters[c], self._t - 1
        adapter.step(t, self._sites(c), torch.tensor(accept))
        if self._window is None or not adapter.adaptation_schedule:
            return
        last = adapter.adaptation_schedule[-1]
        if last.start <= t <= last.end:
            self._window[c].append((step, accept))
        if t == last.end and (aim := self._aim(c)) is not None:  # warm-up ends: Pyro has set exp(x_bar)
            adapter.step_size = aim.step

    def _reasonable_step_size(self, c: int, _sites=None) -> float:
        """Pyro's heuristic for chain ``c`` at its current position and inverse mass matrix:
        double or halve its step size until one leapfrog step's acceptance probability crosses 0.8."""
        minv = self._adapters[c].mass_matrix_adapter.inverse_mass_matrix[self.names].unsqueeze(0)
        z, g, u = self.z[c : c + 1], self.g[c : c + 1], float(self.u[c])
        threshold = math.log(0.8)

        def direction(step: float) -> int:
            p = momentum(minv, self.generator)
            h0 = u + 0.5 * float(torch.linalg.vecdot(p, sharp(minv, p)))
            *_, u1, kinetic = self.leapfrog(z, p, g, z.new_tensor([step]), minv)
            return 1 if threshold < h0 - float(u1 + kinetic) else -1  # NaN: halve

        with torch.no_grad():
            return search_step_size(self._adapters[c].step_size, direction)

    def logging(self) -> OrderedDict:
        """The progress bar's fields: the step sizes (range over chains) and the mean acceptance."""
        lo, hi = min(self.step_sizes), max(self.step_sizes)
        size = f"{lo:.2e}" if lo == hi else f"{lo:.2e}-{hi:.2e}"
        return OrderedDict(
            [("step size", size), ("acc. prob", f"{sum(self._mean_accept) / len(self._mean_accept):.3f}")]
        )

    # ------------------------------------------------------------------ checkpoint/resume
    def state_dict(self) -> tuple[dict[str, Tensor], dict]:
        """Positions, potentials, gradients, the generator, every chain's adaptation and the counters."""
        tensors = {"z": self.z, "u": self.u, "grad": self.g, "generator": self.generator.get_state()}
        adapters = []
        for c, adapter in enumerate(self._adapters):
            own, meta = warmup_adapter_state(adapter)
            tensors.update({f"adapter{c}/{k}": v for k, v in own.items()})
            adapters.append(meta)
        meta = {"adapters": adapters, "counters": [self._t, list(self._mean_accept)]}
        if self._window is not None:
            meta["window"] = [[list(pair) for pair in pairs] for pairs in self._window]
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict) -> None:
        for c, adapter in enumerate(self._adapters):
            prefix = f"adapter{c}/"
            load_warmup_adapter_state(
                adapter, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, meta["adapters"][c]
            )
        device = self._z.device
        self.z, self.u, self.g = (tensors[k].to(device).clone() for k in ("z", "u", "grad"))
        self.generator.set_state(tensors["generator"].cpu())  # torch takes a CPU ByteTensor, for any device's generator
        self._t, self._mean_accept = meta["counters"][0], list(meta["counters"][1])
        if self._window is not None:  # a checkpoint without the window's pairs (written before aim_final_step)
            # continues its run as it began, with exp(x_bar): the draws of the run it interrupted
            window = meta.get("window")
            self._window = None if window is None else [[tuple(pair) for pair in pairs] for pairs in window]


def _rows(columns: list) -> list[list[float]]:
    """Per chain, the values of ``columns`` (each a ``(C,)`` tensor or a list of ``C`` numbers): tensors read back
    together (one host read)."""
    tensors = [i for i, col in enumerate(columns) if isinstance(col, Tensor)]
    if not tensors:
        return list(zip(*columns))
    if len(tensors) == 1:
        read = [columns[tensors[0]].tolist()]
    else:
        read = torch.stack([columns[i].to(torch.float64) for i in tensors]).tolist() if tensors else []
    columns = list(columns)
    for i, values in zip(tensors, read):
        columns[i] = values
    return [list(row) for row in zip(*columns)]
