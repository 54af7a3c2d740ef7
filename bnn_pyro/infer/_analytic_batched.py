"""The analytic potential of :mod:`bnn_pyro.infer._analytic` for ``C`` chains at once, on the bound data.

``StackPotential.leapfrog_batch(z, p, g, step, minv)`` advances ``C`` chains (``z, p, g`` shaped ``(C, D)``,
``step`` ``(C,)`` signed step sizes, ``minv`` ``(C, D)`` diagonal or ``(C, D, D)`` dense inverse mass) by one
velocity-Verlet step as ONE batched computation: a small net is dispatch-bound (each tensor operation costs about
the same whatever its size), so ``C`` chains cost little more than one. :class:`BoundBatch` holds what is made
once per ``C``: a ``(C, D)`` buffer for the position with per-site views (weights ``(C, out, in)``, biases
``(C, 1, out)``), the plan of the forward and backward pass and the output of the layers before the first random
one (constant: computed once). Per evaluation: one ``baddbmm`` per layer (``addcmul`` for a layer with one input,
an outer product), the activations, ``bmm`` back through the layers, the prior's gradient and three
inner products for the energies; no host read.

:func:`leapfrog_from` is the same step for any batched ``potential(theta (C, D)) -> (U (C,), grad (C, D))``.
``tests/infer/test_batched.py`` checks ``leapfrog_batch`` against ``C`` unbatched steps in float64.
"""

from __future__ import annotations

import torch

__all__ = ["BoundBatch", "OneChain", "leapfrog_from", "sharp"]


def sharp(minv: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``M^-1 p`` for every chain: ``minv`` ``(C, D)`` (diagonal) or ``(C, D, D)`` (dense), ``p`` ``(C, D)``."""
    return minv * p if minv.dim() == 2 else torch.bmm(minv, p.unsqueeze(-1)).squeeze(-1)


def leapfrog_from(potential):
    """``leapfrog(z, p, g, step, minv) -> (z, p, g, M^-1 p, U, kinetic)``: one velocity-Verlet step of every chain
    under a batched ``potential(theta (C, D)) -> (U (C,), grad U (C, D))`` (the interface of
    :mod:`bnn_pyro.infer._batched`)."""

    def leapfrog(z, p, g, step, minv):
        s = step.unsqueeze(-1)
        p = p - 0.5 * s * g
        z = z + s * sharp(minv, p)
        u, g = potential(z)
        p = p - 0.5 * s * g
        p_sharp = sharp(minv, p)
        return z, p, g, p_sharp, u, 0.5 * torch.linalg.vecdot(p, p_sharp)

    return leapfrog


class OneChain:
    """The batched leapfrog interface for ONE chain (``C = 1``) over a potential's unbatched step ``pot.leapfrog(z,
    p, g, step, minv) -> (z, p, g, M^-1 p, energies)`` (``(D,)`` vectors, a float step; energies Python floats, e.g.
    :meth:`~bnn_pyro.infer._analytic.StackPotential.leapfrog`, or a tensor ``[U, kinetic]``, e.g. the compiled
    :meth:`~bnn_pyro.infer._logjoint.FlatPotential.leapfrog`): fewer operations per step than the batched one at
    ``C = 1`` (``mm`` rather than ``bmm``, no batch views). :func:`~bnn_pyro.infer._nuts.nuts_transition` calls
    :attr:`unbatched` directly. ``batched``: a batched leapfrog to run instead for the batched interface (a generic
    potential's: :func:`leapfrog_from` over its value and gradient, fewer conversions than its compiled step's)."""

    def __init__(self, pot, batched=None):
        self.pot, self.unbatched, self._batched = pot, pot.leapfrog, batched

    def __call__(self, z, p, g, step, minv):
        if self._batched is not None:
            return self._batched(z, p, g, step, minv)
        z, p, g, p_sharp, energies = self.unbatched(z[0], p[0], g[0], float(step[0]), minv[0])
        u, kinetic = (
            (z.new_tensor([energies[0]]), z.new_tensor([energies[1]]))
            if type(energies) is tuple
            else (energies[0:1], energies[1:2])
        )
        return z.unsqueeze(0), p.unsqueeze(0), g.unsqueeze(0), p_sharp.unsqueeze(0), u, kinetic


class BoundBatch:
    """``C`` chains of a :class:`~bnn_pyro.infer._analytic.StackPotential` on its bound data (module docstring)."""

    def __init__(self, pot, chains: int):
        self.pot, self.chains = pot, chains
        self.buf = pot._loc.new_zeros(chains, pot._loc.numel())
        views = {n: self.buf[:, a:b].view((chains,) + tuple(shape)) for n, (a, b, shape) in pot._slots.items()}
        # the layers before the first random one see the same input for every chain: their output is a constant
        h = pot.x
        for op in pot._ops[: pot._first_random]:
            h = (
                (torch.addmm(op.bias, h, op.weight.t()) if op.bias is not None else h @ op.weight.t())
                if _is_layer(op)
                else op.forward(h)
            )
        self._h0 = h
        # per op from the first random one: a layer as (weight (C, out, in) or constant (out, in), is it random,
        # bias (C, 1, out) or constant (out,) or None, bias random, weight's site, bias's site); else the activation
        self._plan = []
        for op in pot._ops[pot._first_random :]:
            if not _is_layer(op):
                self._plan.append(op)
                continue
            w_rand, b_rand = isinstance(op.weight, str), isinstance(op.bias, str)
            w = views[op.weight] if w_rand else op.weight
            b = views[op.bias].unsqueeze(1) if b_rand else op.bias
            self._plan.append((w, w_rand, b, b_rand, op.weight if w_rand else None, op.bias if b_rand else None))

    def __call__(self, theta: torch.Tensor):
        """``(U (C,), grad U (C, D))`` at ``theta`` ``(C, D)`` on the bound data."""
        self.buf.copy_(theta)
        return self.evaluate()

    def evaluate(self):
        """``(U, grad U)`` at the position held in :attr:`buf`."""
        pot, c = self.pot, self.chains
        h, saved = self._h0, []
        for step in self._plan:  # forward
            if type(step) is not tuple:
                a, h = h, step.forward(h)
                saved.append((a, h))
                continue
            w, w_rand, b, _, _, _ = step
            saved.append(h)
            h = _forward(h, w, w_rand, b, c)
        r = h - pot._y  # (C, N, out)
        flat = r.view(c, -1)
        ss = torch.linalg.vecdot(flat, flat)
        grads = {}
        if pot._noise is None:
            u_lik, delta = ss * pot._lik_weight, r.mul_(pot._delta_scale)
        else:
            u_lik, _, g_noise, delta_scale = pot._noise_terms(
                self.buf, ss, flat.shape[1], pot.dataset_size / r.shape[1]
            )
            grads[pot._noise[0]] = g_noise.unsqueeze(-1)
            delta = r.mul_(delta_scale.view(c, 1, 1))
        for i in range(len(self._plan) - 1, -1, -1):  # backward
            step = self._plan[i]
            if type(step) is not tuple:
                a, h = saved[i]
                delta = step.backward(delta, a, h)
                continue
            w, w_rand, _, _, w_site, b_site = step
            a = saved[i]
            if w_site is not None:
                grads[w_site] = torch.bmm(delta.mT, a if a.dim() == 3 else a.expand(c, *a.shape)).view(c, -1)
            if b_site is not None:
                grads[b_site] = delta.sum(1)
            if i > 0:
                delta = torch.bmm(delta, w) if w_rand else torch.matmul(delta, w)
        theta = self.buf
        d = theta if pot._zero_loc else theta - pot._loc
        prior_grad = d * pot._prec
        grad = torch.cat([grads[name] for name in pot._order], -1).add_(prior_grad)
        u = torch.linalg.vecdot(d, prior_grad).mul_(0.5).add_(u_lik).add_(pot._u_const)
        return u, grad

    def leapfrog(self, z, p, g, step, minv):
        """One velocity-Verlet step of every chain: ``(z, p, g, M^-1 p, U, kinetic)`` at the new points."""
        s = step.unsqueeze(-1)
        p = torch.addcmul(p, g, s, value=-0.5)
        if minv.dim() == 2:
            torch.addcmul(z, minv * p, s, out=self.buf)
        else:
            torch.addcmul(z, sharp(minv, p), s, out=self.buf)
        z = self.buf.clone()
        u, g = self.evaluate()
        p.addcmul_(g, s, value=-0.5)
        p_sharp = sharp(minv, p)
        return z, p, g, p_sharp, u, torch.linalg.vecdot(p, p_sharp).mul_(0.5)


def _is_layer(op) -> bool:
    """Whether an op of the stack is a layer (``_analytic_ops.Layer``: weight, bias) rather than an activation."""
    return hasattr(op, "weight")


def _forward(h, w, w_rand: bool, b, chains: int):
    """``h @ w^T + b`` for ``h`` ``(N, in)`` (shared) or ``(C, N, in)``, ``w`` ``(C, out, in)`` (random) or
    ``(out, in)``, ``b`` ``(C, 1, out)``, ``(out,)`` or ``None``."""
    if w_rand:
        if h.dim() == 2 and h.shape[1] == 1:  # one input: an outer product, elementwise
            out = h * w.mT  # (N, 1) * (C, 1, out) -> (C, N, out)
            return out if b is None else out.add_(b)
        if h.dim() == 2:
            h = h.expand(chains, *h.shape)
        if b is None:
            return torch.bmm(h, w.mT)
        return torch.baddbmm(b, h, w.mT)
    out = torch.matmul(h, w.t())
    if h.dim() == 2:
        out = out.expand(chains, *out.shape)
    return out if b is None else out + b
