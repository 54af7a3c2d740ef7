"""NUTS over one flat vector: the fast path's sampler for ``bp.fit(..., method="nuts")``.

Pyro's ``NUTS`` keeps the position, momentum and gradient as dicts of site tensors and builds its
trees with a Python sample site per doubling: on the 1-50-1 MLP of ``benchmarks/performance.py``
that bookkeeping costs about as much per leapfrog step (~0.45 ms) as the potential and its gradient
together. This kernel runs the same algorithm on one flat tensor per quantity, with the potential
and its gradient from ONE call: for a stack of ``nn.Linear`` layers and elementwise activations with
Normal priors and a Gaussian likelihood the analytic one of :mod:`bnn_pyro.infer._analytic` (a forward
and a hand-written backward, ~30 tensor operations per leapfrog step with the tree's bookkeeping, eager:
nothing traced), else the generic one recorded as one compiled graph
(:func:`bnn_pyro.infer._logjoint.flat_potential_and_grad`); the energies and turning checks as Python floats
(one host read of the energies per leapfrog step, one per turning check: one matrix product for the six
inner products, or a single inner product where two single states merge; see :func:`_u_turn`). Nothing is
differentiated here: a transition runs under ``torch.no_grad``.

The transition is Stan's multinomial NUTS (Betancourt 2017, "A Conceptual Introduction to
Hamiltonian Monte Carlo", appendix A; Stan's ``base_nuts``): trajectories doubled forward or
backward at random; within a new subtree a state is drawn with probability proportional to
``exp(-H)`` (uniform progressive sampling), and the new subtree's draw replaces the current one
with probability ``min(1, w_new / w_old)`` (biased progressive sampling); doubling stops at a
U-turn (generalized criterion ``p_sharp . rho <= 0`` at either end, checked also across the
merged halves, as Stan does since 2.26), at a divergence (energy error > 1000 or NaN), or at
``max_tree_depth`` doublings. Step size and mass matrix are adapted by Pyro's own
:class:`~pyro.infer.mcmc.adaptation.WarmupAdapter` (dual averaging, Stan's windows), as in Pyro's
kernel; the step size is reset by Pyro's heuristic after each mass-matrix window.

It is a Pyro ``MCMCKernel`` (``pyro.infer.MCMC`` can run it; :mod:`bnn_pyro.infer.mcmc` drives it with its own
loop, for checkpoints: :meth:`FlatNUTS.state_dict`); the progress bar is :mod:`bnn_pyro.infer.mcmc`'s, one per chain, with this
kernel's :meth:`FlatNUTS.logging` (step size, mean acceptance) beside it. ``tests/infer/test_nuts.py`` checks it against exact posteriors.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._kernels import AdaptedKernel, DrawStats

__all__ = ["FlatNUTS", "search_step_size"]

MAX_ENERGY_ERROR = 1000.0  # Stan's divergence threshold


class _Tree:
    """A trajectory segment: its ends (momentum and ``M^-1 p``; ``near`` is the end it started from),
    the sum ``rho`` of its momenta, ``log_w = log sum exp(H0 - H)`` over its states, the state drawn
    from it (position, potential, gradient), to extend it the full state at its far end, and for a
    single state ``pp = p . M^-1 p`` (twice its kinetic energy, a float; ``None`` for longer segments)."""

    __slots__ = ("near_p", "near_sharp", "far_p", "far_sharp", "rho", "log_w", "draw", "frontier", "pp")

    def __init__(self, near_p, near_sharp, far_p, far_sharp, rho, log_w, draw, frontier, pp=None):
        self.near_p, self.near_sharp, self.far_p, self.far_sharp = near_p, near_sharp, far_p, far_sharp
        self.rho, self.log_w, self.draw, self.frontier, self.pp = rho, log_w, draw, frontier, pp


class FlatNUTS(AdaptedKernel):
    """No-U-Turn sampler for a :class:`~bnn_pyro.infer._logjoint.LogJoint` (see the module docstring).

    ``resume = (step_size, inverse_mass_matrix)`` replaces the adapted state after setup (extending
    a posterior); ``stats`` holds the last draw's :class:`~bnn_pyro.infer._kernels.DrawStats`.
    """

    def __init__(self, model, joint, *, init_strategy, step_size=None, target_accept_prob=0.8, max_tree_depth=10,
                 dense_mass=False, jit=True):
        self.model, self.joint, self.max_tree_depth, self.jit = model, joint, max_tree_depth, jit
        self._init_strategy, self.resume, self.transforms = init_strategy, None, None
        self._adapter = WarmupAdapter(step_size or 1.0, adapt_step_size=True, target_accept_prob=target_accept_prob,
                                      adapt_mass_matrix=True, dense_mass=dense_mass)
        self._minv = None

    # ------------------------------------------------------------------ MCMCKernel interface
    def setup(self, warmup_steps, *args, **kwargs):
        self._warmup_steps, self._t, self._mean_accept_prob = warmup_steps, 0, 0.0
        self._divergences, self._accept_sum = [], 0.0
        params, _, self.transforms, _ = initialize_model(self.model, model_args=args, model_kwargs=kwargs,
                                                         init_strategy=self._init_strategy, skip_jit_warnings=True)
        self._initial_params = params
        self._names = tuple(sorted(params))  # Pyro's order: a mass matrix is interchangeable with its kernel's
        self._shapes = [params[n].shape for n in self._names]
        self._sizes = [int(params[n].numel()) for n in self._names]
        shapes = dict(zip(self._names, self._shapes))
        # the analytic potential and gradient (Linear-and-elementwise stacks, Normal priors, Gaussian likelihood),
        # else the generic one recorded as one compiled graph
        self._potential = (_logjoint.analytic(self.joint, self._names, shapes, *args)
                           or _logjoint.flat_potential_and_grad(self.joint, self.transforms, *args, shapes=shapes,
                                                                compile=self.jit))
        z = self._flatten(params)
        u, g = self._potential(z)
        self._state = (z, float(u), g)
        # Python's generator for the many scalar uniforms (direction, multinomial choices): cheap per call,
        # seeded from torch's seeded generator, and leaves the caller's random module alone
        self._rng = random.Random(int(torch.randint(2**62, ())))
        size = z.numel()
        self._adapter.configure(warmup_steps, mass_matrix_shape={self._names: (size, size) if self._adapter.dense_mass
                                                                 else (size,)},
                                find_reasonable_step_size_fn=self._reasonable_step_size,
                                options=dict(dtype=z.dtype, device=z.device))
        if self.resume is not None:
            self._adapter.step_size = self.resume[0]
            self._adapter.mass_matrix_adapter.inverse_mass_matrix = {self._names: self.resume[1].to(z.dtype)}
        else:
            self._adapter.reset_step_size_adaptation(params)

    def logging(self):
        return OrderedDict([("step size", f"{self.step_size:.2e}"), ("acc. prob", f"{self._mean_accept_prob:.3f}")])

    def diagnostics(self):
        kept = max(self._t - self._warmup_steps, 1)
        return {"divergences": self._divergences, "acceptance rate": self._accept_sum / kept}

    @torch.no_grad()  # nothing here is differentiated: no autograd bookkeeping per operation
    def sample(self, params):
        z, u, g = self._state
        step = self.step_size
        self._mass()
        p = self._momentum(z)
        sharp = self._sharp(p)
        pp = float(p.dot(sharp))
        h0 = u + 0.5 * pp
        self._n_leapfrog, self._metro_sum, self._diverged = 0, 0.0, False
        (z, u, g), doublings = self._transition(z, u, g, p, sharp, h0, step, pp)
        self._state = (z, u, g)
        accept = self._metro_sum / max(self._n_leapfrog, 1)
        if self._t < self._warmup_steps:
            self._adapter.step(self._t, self._unflatten(z), torch.tensor(accept))
        self._t += 1
        kept = self._t > self._warmup_steps
        n = self._t - self._warmup_steps if kept else self._t
        self._mean_accept_prob += (accept - self._mean_accept_prob) / n
        if kept:
            self._accept_sum += accept
            if self._diverged:
                self._divergences.append(self._t - 1 - self._warmup_steps)
        self.stats = DrawStats(lp=-u, acceptance_rate=accept, step_size=step, diverging=self._diverged,
                               n_steps=self._n_leapfrog, energy=h0, tree_depth=doublings)
        return self._unflatten(z)

    # ------------------------------------------------------------------ checkpoint/resume (bnn_pyro.infer.mcmc)
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The chain's state after a transition: position, potential and gradient, the adaptation, the counters
        and the Python generator of the trajectory choices (the global generators are the checkpoint's)."""
        (z, u, g), (tensors, adapter) = self._state, self._adapter_state()
        tensors = {**tensors, "z": z, "grad": g}
        version, internal, gauss = self._rng.getstate()
        return tensors, {"adapter": adapter, "u": u, "rng": [version, list(internal), gauss],
                         "counters": [self._t, self._mean_accept_prob, self._divergences, self._accept_sum]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._load_adapter_state(tensors, meta["adapter"])
        self._state = (tensors["z"], meta["u"], tensors["grad"])
        version, internal, gauss = meta["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._t, self._mean_accept_prob, self._divergences, self._accept_sum = meta["counters"]

    # ------------------------------------------------------------------ flat vectors and the mass matrix
    def _flatten(self, params: dict) -> torch.Tensor:
        return torch.cat([params[n].detach().reshape(-1) for n in self._names])

    def _unflatten(self, z: torch.Tensor) -> dict:
        return {n: part.reshape(s) for n, part, s in zip(self._names, z.split(self._sizes), self._shapes)}

    def _mass(self):
        """Cache ``M^-1`` and the factor that draws momenta ``p ~ N(0, M)`` when the adapter changes it."""
        minv = self.inverse_mass_matrix[self._names]
        if minv is not self._minv:
            self._minv = minv
            self._dense = minv.dim() == 2
            self._factor = torch.linalg.cholesky(minv) if self._dense else minv.rsqrt()

    def _momentum(self, z: torch.Tensor) -> torch.Tensor:
        eps = torch.randn_like(z)
        if not self._dense:
            return eps * self._factor
        # M = (L L^T)^-1 = L^-T L^-1, so p = L^-T eps has covariance M
        return torch.linalg.solve_triangular(self._factor.T, eps[:, None], upper=True)[:, 0]

    def _sharp(self, p: torch.Tensor) -> torch.Tensor:
        return self._minv @ p if self._dense else self._minv * p

    # ------------------------------------------------------------------ one NUTS transition
    def _leapfrog(self, state, step: float):
        """One velocity-Verlet step of signed size ``step`` from ``(z, p, g, u)``; returns
        the new state, ``M^-1 p`` and the Hamiltonian (``inf`` where it is NaN)."""
        z, p, g, _ = state
        z, p, g, sharp, energies = self._potential.leapfrog(z, p, g, step, self._minv)
        # the analytic potential gives Python floats; the generic one a tensor [U, kinetic] (one host read either way)
        u, kinetic = energies if type(energies) is tuple else energies.tolist()
        h = u + kinetic
        return (z, p, g, u), sharp, (h if h == h else math.inf), 2.0 * kinetic

    def _transition(self, z, u, g, p, sharp, h0: float, step: float, pp: float):
        """Grow a trajectory from ``(z, p)`` (``sharp = M^-1 p``, ``pp = p . sharp``); return the drawn
        ``(z, u, g)`` and the doublings tried."""
        start = (z, p, g, u)
        # the trajectory so far, as a tree whose "near" end is its backward end and "far" its forward end
        tree = _Tree(p, sharp, p, sharp, p, 0.0, (z, u, g), None, pp)
        frontier = {1: start, -1: start}
        signed = {1: step, -1: -step}
        for depth in range(self.max_tree_depth):
            direction = 1 if self._rng.random() > 0.5 else -1
            new = self._build(frontier[direction], depth, signed[direction], h0)
            if new is None:  # diverged or turned inside the new subtree: its states are not used
                return tree.draw, depth + 1
            frontier[direction] = new.frontier
            # biased progressive sampling: the new subtree's draw wins with probability min(1, w_new / w_old)
            take = new.log_w > tree.log_w or self._rng.random() < math.exp(new.log_w - tree.log_w)
            draw, log_w, rho = (new.draw if take else tree.draw), _logaddexp(tree.log_w, new.log_w), tree.rho + new.rho
            if direction == 1:  # new continues from the forward end
                turned = _u_turn(tree.near_sharp, tree.far_p, tree.far_sharp, tree, new)
                tree = _Tree(tree.near_p, tree.near_sharp, new.far_p, new.far_sharp, rho, log_w, draw, None)
            else:  # new continues from the backward end
                turned = _u_turn(tree.far_sharp, tree.near_p, tree.near_sharp, tree, new)
                tree = _Tree(new.far_p, new.far_sharp, tree.far_p, tree.far_sharp, rho, log_w, draw, None)
            if turned:
                return tree.draw, depth + 1
        return tree.draw, self.max_tree_depth

    def _build(self, state, depth: int, step: float, h0: float) -> _Tree | None:
        """A subtree of ``2**depth`` leapfrog steps from ``state`` (sign of ``step`` = direction), or
        ``None`` where it diverges or turns back (its states are then discarded)."""
        if depth == 0:
            state, sharp, h, pp = self._leapfrog(state, step)
            self._n_leapfrog += 1
            log_w = h0 - h
            self._metro_sum += 1.0 if log_w > 0 else math.exp(log_w)
            if -log_w > MAX_ENERGY_ERROR:
                self._diverged = True
                return None
            z, p, g, u = state
            return _Tree(p, sharp, p, sharp, p, log_w, (z, u, g), state, pp)
        first = self._build(state, depth - 1, step, h0)
        if first is None:
            return None
        second = self._build(first.frontier, depth - 1, step, h0)
        if second is None:
            return None
        log_w = _logaddexp(first.log_w, second.log_w)
        # uniform progressive sampling within a subtree: a state with probability proportional to exp(-H)
        draw = second.draw if self._rng.random() < math.exp(second.log_w - log_w) else first.draw
        if _u_turn(first.near_sharp, first.far_p, first.far_sharp, first, second):
            return None
        rho = first.rho + second.rho
        return _Tree(first.near_p, first.near_sharp, second.far_p, second.far_sharp, rho, log_w, draw,
                     second.frontier)

    # ------------------------------------------------------------------ step size heuristic
    def _reasonable_step_size(self, params: dict) -> float:
        """Pyro's (and Stan's) heuristic: double or halve the step size until one leapfrog step's
        acceptance probability crosses 0.8."""
        step = self.step_size
        z = self._flatten(params)
        u, g = self._potential(z)
        u = float(u)
        self._mass()
        threshold = math.log(0.8)

        def direction(step):
            p = self._momentum(z)
            h0 = u + 0.5 * float(p.dot(self._sharp(p)))
            _, _, h, _ = self._leapfrog((z, p, g, u), step)
            return 1 if threshold < h0 - h else -1

        return search_step_size(step, direction)


def search_step_size(step: float, direction) -> float:
    """The loop of Pyro's (and Stan's) step-size heuristic: ``direction(step)`` is +1 where one leapfrog step's
    acceptance probability exceeds 0.8 (then double), else -1 (then halve), until it changes sign."""
    first = direction(step)
    lo, hi = 1e-10, 1e10  # Pyro's HMC defaults (min_stepsize, max_stepsize)
    while lo < step < hi:
        step *= 2.0 ** first
        if direction(step) != first:
            break
    return min(max(step, lo), hi)


def _u_turn(old_far_sharp, old_end_p, old_end_sharp, old: _Tree, new: _Tree) -> bool:
    """Whether the trajectory ``old + new`` turns back (``new`` grown outward from ``old``'s end
    ``old_end``; ``old_far`` is old's other end). Stan's three generalized no-U-turn checks,
    ``p_sharp . rho > 0`` at both ends of: the whole trajectory (``rho = old.rho + new.rho``);
    ``old`` plus ``new``'s first state; ``old``'s last state plus ``new``. By linearity the six inner
    products are sums of the 16 of one matrix product (ends' ``p_sharp`` x ``[old.rho, new.rho,
    new.near_p, old_end_p]``), read back at once. Two single states need one: with ``c = sharp_1 . p_2
    = p_1 . M^-1 p_2`` (``M^-1`` symmetric), every check is ``pp_1 + c > 0`` or ``c + pp_2 > 0``."""
    if old.pp is not None and new.pp is not None:
        c = float(torch.dot(old_end_sharp, new.far_p))
        return not (old.pp + c > 0 and c + new.pp > 0)
    sharps = torch.stack([old_far_sharp, new.far_sharp, new.near_sharp, old_end_sharp])
    vectors = torch.stack([old.rho, new.rho, new.near_p, old_end_p])
    (a_old, a_new, a_near, _), (b_old, b_new, _, b_end), (c_old, _, c_near, _), (_, e_new, _, e_end) = (
        torch.mm(sharps, vectors.t()).tolist())
    return not (a_old + a_new > 0 and b_old + b_new > 0 and a_old + a_near > 0 and c_old + c_near > 0
                and e_new + e_end > 0 and b_new + b_end > 0)


def _logaddexp(a: float, b: float) -> float:
    top = max(a, b)
    return top + math.log1p(math.exp(-abs(a - b))) if top > -math.inf else -math.inf
