"""One NUTS transition of C chains advanced together, in lockstep, as one batched computation.

A small net's leapfrog step is bound by dispatch (a few microseconds per tensor operation), not arithmetic,
so C chains whose positions are the rows of one ``(C, D)`` tensor cost less per chain than one chain at a time
(NumPyro's ``chain_method="vectorized"``). :func:`nuts_transition` is the Markov kernel of
:class:`~bnn_pyro.infer._nuts.FlatNUTS` (Stan's multinomial NUTS) for every row at once: the same kernel per
chain in distribution, not the same random stream. It is a pure function: the momentum and every uniform
come from ``generator``; step sizes and inverse mass matrices are per chain; adaptation is the caller's.

Lockstep, masked. All chains double their trajectories together: at depth ``j`` each chain still running
picks a direction and builds a subtree of ``2**j`` leapfrog steps from that end of its trajectory, with its
own signed step. A chain whose subtree diverges (energy error > ``MAX_ENERGY_ERROR``, or NaN) or turns back
is marked dead in a per-leaf mask; its later leapfrog steps are still computed (one batched call) but their
results are not used, exactly as the recursive builder discards that subtree and stops. The loop ends when
no chain runs (one host read per two leapfrog steps inside a subtree, one per doubling).

Inside a subtree, iteratively (no recursion):

- the state drawn from it is chosen by streaming: a running ``W = log sum exp(H0 - H)`` over its leaves,
  and the new leaf replaces the candidate with probability ``exp(log_w - W_new)``: a state with
  probability proportional to ``exp(-H)``, the distribution that uniform progressive sampling gives;
- Stan's turning checks of every balanced sub-subtree: the node of size ``2**m`` that ends at leaf ``k``
  (``k + 1`` divisible by ``2**m``) is checked at leaf ``k``, for ``m = 1 .. trailing_zeros(k + 1)``
  together, with Stan's two extra checks across its halves: the same set of checks as the recursion,
  so a subtree is rejected exactly when the recursive builder rejects it. The vectors they need live in
  one preallocated buffer of shape ``(levels + 1, 5, C, D)``: per level, the momentum, ``M^-1 p`` and the
  prefix sum of momenta before the node's first leaf, and ``M^-1 p`` and the prefix sum before the first
  half's last leaf (slot 0 holds the current leaf). Every vector a check's momentum sum needs is a signed
  sum of those (prefix sums make the sums of momenta differences), so the checks completing at a leaf are
  one matrix product with a constant ``(+-1)`` matrix (the momentum sums), one ``index_select`` (the
  ``M^-1 p`` they are dotted with), one batched inner product and one comparison (prefix sums restart at
  each subtree, which bounds the cancellation of the differences).

At the top level the new subtree's draw wins with probability ``min(1, w_new / w_old)`` (biased progressive
sampling) and the merged trajectory is checked with Stan's three criteria, as ``FlatNUTS._transition`` and
``_u_turn`` do. Per lockstep leaf, about 25 top-level tensor operations of bookkeeping beside the leapfrog
step, whatever C (``benchmarks/nuts_batched.py`` counts them).
``tests/infer/test_nuts_batched.py`` checks exact-draw invariance, a non-Gaussian target with closed-form
moments, the subtree outcomes against the recursive builder of :mod:`bnn_pyro.infer._nuts` and the
statistics against :class:`~bnn_pyro.infer._nuts.FlatNUTS`; ``benchmarks/nuts_batched.py`` measures it.

Usage::

    step_fn = leapfrog_from(potential)  # bnn_pyro.infer._analytic_batched;  # potential(theta (C, D)) -> (U (C,), grad U (C, D))
    z, u, g, stats = nuts_transition(z, u, g, step, minv, leapfrog=step_fn, generator=torch.Generator())
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from bnn_pyro.infer._analytic_batched import sharp
from bnn_pyro.infer._batched import TransitionStats, momentum
from bnn_pyro.infer._nuts import MAX_ENERGY_ERROR

__all__ = ["nuts_transition"]

Leapfrog = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]]


# the five vectors a level's slot of the buffer holds: momentum, M^-1 p and the prefix sum of momenta before
# the level's first leaf; M^-1 p and the prefix sum before the last leaf of the level's first half
_P, _SHARP, _PREV, _E_SHARP, _E_PREV = range(5)


@torch.no_grad()  # nothing here is differentiated (a generic potential enables grad for itself)
def nuts_transition(z: Tensor, u: Tensor, g: Tensor, step: Tensor, minv: Tensor, *, leapfrog: Leapfrog,
                    generator: torch.Generator, max_tree_depth: int = 10) -> tuple[Tensor, Tensor, Tensor,
                                                                                   TransitionStats]:
    """One NUTS transition of every chain: ``z``, ``g`` (C, D), ``u`` (C,), ``step`` (C,) > 0; momentum
    ``p ~ N(0, M)`` drawn here from ``generator`` (``M = minv^-1``: diagonal ``p = eps / sqrt(minv)``; dense
    ``p = L^-T eps`` with ``L`` the Cholesky factor of ``minv``, as FlatNUTS does).

    ``leapfrog(z, p, g, step, minv) -> (z, p, g, sharp, u, kinetic)``: one velocity-Verlet step for every chain
    (signed ``(C,)`` steps; ``sharp = M^-1 p``; ``u``, ``kinetic`` ``(C,)``), e.g. :func:`~bnn_pyro.infer._analytic_batched.leapfrog_from`.
    Returns the drawn ``(z, u, g)`` and the :class:`TransitionStats`.
    """
    _check(z, u, g, step, minv, max_tree_depth)
    c, d = z.shape
    p0 = momentum(minv, generator)
    sharp0 = sharp(minv, p0)
    h0 = u + 0.5 * torch.linalg.vecdot(p0, sharp0)
    # the trajectory: its backward and forward ends as (z, p, g, M^-1 p) stacks, the sum of its momenta,
    # log sum exp(H0 - H) over its states and the state drawn from it
    left = right = torch.stack([z, p0, g, sharp0])
    rho, log_w, draw = p0, torch.zeros_like(u), (z, u, g)
    running = torch.ones(c, dtype=torch.bool, device=z.device)
    depth = torch.full((c,), max_tree_depth, dtype=torch.int64, device=z.device)
    n_steps = torch.zeros(c, dtype=torch.int64, device=z.device)
    accept, diverging = torch.zeros_like(u), torch.zeros_like(running)
    buf = _Buffers(c, d, max_tree_depth - 1, z.dtype, z.device)
    for j in range(max_tree_depth):
        uniforms = torch.rand(2 ** j + 2, c, generator=generator, dtype=z.dtype, device=z.device)
        forward = uniforms[0] < 0.5
        begin = torch.where(forward[None, :, None], right, left)
        signed = torch.where(forward, step, -step)
        new = _subtree(begin[0], begin[1], begin[2], j, signed, h0, ~running, uniforms[2:].log(), leapfrog, minv, buf)
        n_steps += new.n_steps
        accept += new.accept_sum
        diverging |= new.diverged
        ok = new.ok
        # biased progressive sampling: the new subtree's draw wins with probability min(1, w_new / w_old)
        take = ok & (uniforms[1].log() < new.log_w - log_w)
        draw = tuple(torch.where(take.view(-1, *[1] * (old.dim() - 1)), fresh, old)
                     for fresh, old in zip(new.draw, draw))
        log_w = torch.where(ok, torch.logaddexp(log_w, new.log_w), log_w)
        turned = _merged_u_turn(left, right, forward, rho, new)
        rho = torch.where(ok[:, None], rho + new.rho, rho)
        far = torch.stack(new.far)
        left = torch.where((ok & ~forward)[None, :, None], far, left)
        right = torch.where((ok & forward)[None, :, None], far, right)
        still = ok & ~turned
        depth = torch.where(running & ~still, j + 1, depth)
        running = still
        if not bool(running.any()):
            break
    stats = TransitionStats(accept / n_steps.clamp(min=1), n_steps, diverging, h0, depth)
    return draw[0], draw[1], draw[2], stats


def _merged_u_turn(left: Tensor, right: Tensor, forward: Tensor, rho: Tensor, new: _Subtree) -> Tensor:
    """Stan's three checks of the trajectory ``old + new`` (``new`` grown from old's end in its direction), as
    ``bnn_pyro.infer._nuts._u_turn``: ``p_sharp . rho > 0`` at both ends of the whole, of ``old`` plus new's
    first state, and of old's last state plus ``new``. ``True`` where it turns back."""
    col = forward[:, None]
    old_far_sharp = torch.where(col, left[3], right[3])
    old_end_p, old_end_sharp = torch.where(col, right[1], left[1]), torch.where(col, right[3], left[3])
    near_p, near_sharp = new.near
    far_sharp = new.far[3]
    whole, with_first, with_last = rho + new.rho, rho + near_p, new.rho + old_end_p
    lefts = torch.stack([old_far_sharp, far_sharp, old_far_sharp, near_sharp, old_end_sharp, far_sharp])
    rights = torch.stack([whole, whole, with_first, with_first, with_last, with_last])
    return (torch.linalg.vecdot(lefts, rights) <= 0).any(0)


class _Subtree(NamedTuple):
    ok: Tensor  # (C,) completed without a divergence or a turn (and the chain was growing)
    n_steps: Tensor  # (C,) leapfrog steps the chain took in it (up to and including a failing one)
    accept_sum: Tensor  # (C,) sum of min(1, exp(H0 - H)) over those steps
    diverged: Tensor  # (C,)
    log_w: Tensor  # (C,) log sum exp(H0 - H) over its leaves
    draw: tuple[Tensor, Tensor, Tensor]  # (z, u, g) drawn from it
    rho: Tensor  # (C, D) sum of its momenta
    near: tuple[Tensor, Tensor]  # (p, M^-1 p) of its first leaf (views into the buffer: use before the next one)
    far: tuple[Tensor, Tensor, Tensor, Tensor]  # (z, p, g, M^-1 p) of its last leaf: its frontier


class _Buffers:
    """The subtree's per-level vectors (see the module docstring), laid out ``(levels + 1, 5, C, D)``: each vector
    a contiguous block, those of slots ``0..t`` the rows of one ``(5 (t + 1), C * D)`` matrix; and the views of
    them that a leaf writes (levels starting at it, the first half it ends) and the checks read, made on first use."""

    def __init__(self, c: int, d: int, levels: int, dtype, device):
        q = torch.zeros(levels + 1, 5, c, d, dtype=dtype, device=device)
        self.q, self._shape = q, (c, d)
        self.p, self.sharp, self.prev = q[0, _P], q[0, _SHARP], q[0, _PREV]
        self.leaf = q[0:1, :_E_SHARP]  # the current leaf as a node's start: (p, sharp, prev)
        self.half_end = q[0, _SHARP:_E_SHARP]  # the current leaf as a first half's last: (sharp, prev)
        self._starts, self._ends, self._checks = {}, {}, {}

    def starts(self, r: int) -> Tensor:
        """Slots ``1..r``' (p, sharp, prev): the ``r`` levels starting at the current leaf."""
        if r not in self._starts:
            self._starts[r] = self.q[1:r + 1, :_E_SHARP]
        return self._starts[r]

    def ends(self, m: int) -> Tensor:
        """Slot ``m``'s (E sharp, E prev): level ``m``'s first half ends at the current leaf."""
        if m not in self._ends:
            self._ends[m] = self.q[m, _E_SHARP:]
        return self._ends[m]

    def checks(self, t: int) -> Tensor:
        """The ``6 t`` inner products of the turning checks of levels ``1..t`` completing at the current leaf,
        ``(6 t, C)``: the left vectors gathered by index, the right ones combined by one matrix product, both
        into buffers of their own."""
        if t not in self._checks:
            c, d = self._shape
            left, right = _selection(t, self.q.dtype, self.q.device)
            lefts, rights = self.q.new_empty(2, 6 * t, c, d).unbind(0)
            self._checks[t] = (self.q[:t + 1].view(5 * (t + 1), c * d), left, right.T, lefts, rights,
                               lefts.view(6 * t, c * d), rights.view(6 * t, c * d))
        rows, left, right, lefts, rights, lefts_2d, rights_2d = self._checks[t]
        torch.index_select(rows, 0, left, out=lefts_2d)
        torch.mm(right, rows, out=rights_2d)
        return torch.linalg.vecdot(lefts, rights)


@functools.lru_cache(maxsize=None)
def _selection(t: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The six turning checks of each level ``m = 1..t`` completing at the current leaf, over the rows
    ``5 slot + component`` of slots ``0..t`` of the buffer: the left vector's row ``(6 t,)`` and the right vectors
    as signed sums of rows ``(5 (t + 1), 6 t)``. Level ``m``'s node starts at slot ``m``'s leaf ``s``, its second half at
    slot ``m - 1``'s (the current leaf for ``m = 1``), its first half ends at the leaf whose vectors slot ``m``'s
    ``E`` components saved; ``P_k`` (the prefix sum up to the current leaf) is slot 0's ``prev + p``. With
    ``rho = P_k - P_{s-1}``, ``rho_1 = first.rho + p_mid`` and ``rho_2 = second.rho + p_{mid-1}``: ``sharp_s .
    rho``, ``sharp_k . rho``, ``sharp_s . rho_1``, ``sharp_mid . rho_1``, ``sharp_{mid-1} . rho_2``, ``sharp_k .
    rho_2``, each > 0 where the node does not turn."""
    left, right = [], torch.zeros(5 * (t + 1), 6 * t, dtype=torch.float64)
    for m in range(1, t + 1):
        rho = [(1, 0, _P), (1, 0, _PREV), (-1, m, _PREV)]
        rho_1 = [(1, m - 1, _PREV), (1, m - 1, _P), (-1, m, _PREV)]
        rho_2 = [(1, 0, _P), (1, 0, _PREV), (-1, m, _E_PREV)]
        checks = [((m, _SHARP), rho), ((0, _SHARP), rho), ((m, _SHARP), rho_1), ((m - 1, _SHARP), rho_1),
                  ((m, _E_SHARP), rho_2), ((0, _SHARP), rho_2)]
        for (slot, comp), terms in checks:
            for sign, other, kind in terms:
                right[5 * other + kind, len(left)] += sign
            left.append(5 * slot + comp)
    return torch.tensor(left, device=device), right.to(dtype=dtype, device=device)


def _trailing_zeros(k: int) -> int:
    return (k & -k).bit_length() - 1


def _subtree(z: Tensor, p: Tensor, g: Tensor, depth: int, step: Tensor, h0: Tensor, dead: Tensor, log_u: Tensor,
             leapfrog: Leapfrog, minv: Tensor, buf: _Buffers) -> _Subtree:
    """``2**depth`` lockstep leapfrog steps from ``(z, p, g)`` with signed steps ``step``; ``dead`` (C,): chains
    not growing; ``log_u`` (2**depth, C): log-uniforms of the multinomial choices."""
    c, leaves = z.shape[0], 2 ** depth
    log_ws = h0.new_empty(leaves, c)
    gone = torch.empty(leaves + 1, c, dtype=torch.bool, device=z.device)  # row k: dead before leaf k
    gone[0] = dead
    rows, w_rows, u_rows = gone.unbind(0), log_ws.unbind(0), log_u.unbind(0)
    buf.q[0, :_E_SHARP:2].zero_()  # the prefix sum restarts: slot 0's p and prev
    total = torch.full_like(h0, -torch.inf)
    cand_z, cand_u, cand_g = z, h0, g
    done = leaves
    for k in range(leaves):
        z, p, g, sharp, u, kinetic = leapfrog(z, p, g, step, minv)
        log_w = torch.sub(h0, u, out=w_rows[k]).sub_(kinetic).nan_to_num_(nan=-torch.inf, neginf=-torch.inf)
        torch.logical_or(rows[k], log_w < -MAX_ENERGY_ERROR, out=rows[k + 1])
        # streaming multinomial choice: the new leaf replaces the candidate with probability exp(log_w - W_new)
        total = torch.logaddexp(total, log_w)
        take = u_rows[k] < log_w - total
        col = take[:, None]
        cand_z, cand_g, cand_u = torch.where(col, z, cand_z), torch.where(col, g, cand_g), torch.where(take, u, cand_u)
        # slot 0 <- this leaf (prefix sum before it, p, M^-1 p); the levels starting here; the first half it ends
        buf.prev.add_(buf.p)
        buf.p.copy_(p)
        buf.sharp.copy_(sharp)
        starting = depth if k == 0 else _trailing_zeros(k)
        if starting:
            buf.starts(starting).copy_(buf.leaf)
        completing = _trailing_zeros(k + 1)
        if completing < depth:
            buf.ends(completing + 1).copy_(buf.half_end)
        if completing:
            rows[k + 1].logical_or_((buf.checks(completing) <= 0).any(0))
            if k + 1 < leaves and bool(rows[k + 1].all()):
                done = k + 1
                break
    grown = ~gone[:done]
    log_ws = log_ws[:done]
    return _Subtree(ok=~gone[done], n_steps=grown.sum(0), accept_sum=(log_ws.clamp(max=0).exp() * grown).sum(0),
                    diverged=(grown & (log_ws < -MAX_ENERGY_ERROR)).any(0), log_w=total,
                    draw=(cand_z, cand_u, cand_g), rho=buf.prev + buf.p,
                    near=(buf.q[depth, _P], buf.q[depth, _SHARP]), far=(z, p, g, sharp))


def _check(z, u, g, step, minv, max_tree_depth) -> None:
    """Clear errors for bad input (one host read: the step sizes' sign)."""
    if not (isinstance(z, Tensor) and z.dim() == 2 and z.is_floating_point()):
        raise ValueError(f"nuts_transition: z must be a floating (C, D) tensor of positions, one row per chain; got "
                         f"{type(z).__name__} {tuple(getattr(z, 'shape', ()))}. Stack the chains' flat vectors.")
    c, d = z.shape
    if tuple(g.shape) != (c, d):
        raise ValueError(f"nuts_transition: g (the gradients) must have z's shape {(c, d)}; got {tuple(g.shape)}.")
    if tuple(u.shape) != (c,):
        raise ValueError(f"nuts_transition: u (the potentials) must be shaped (C,) = {(c,)}; got {tuple(u.shape)}.")
    if not isinstance(step, Tensor) or tuple(step.shape) != (c,):
        raise ValueError(f"nuts_transition: step must be a (C,) = {(c,)} tensor of step sizes, one per chain; got "
                         f"{type(step).__name__} {tuple(getattr(step, 'shape', ()))}. Try step.expand(C).")
    if not bool((step > 0).all()):
        raise ValueError("nuts_transition: every step size must be > 0 (the direction is drawn here); got "
                         f"{step.tolist()[:8]}.")
    if tuple(minv.shape) not in ((c, d), (c, d, d)):
        raise ValueError(f"nuts_transition: minv must be a (C, D) = {(c, d)} diagonal or (C, D, D) dense inverse "
                         f"mass matrix per chain; got {tuple(minv.shape)}.")
    if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 1:
        raise ValueError(f"nuts_transition: max_tree_depth must be an int >= 1 (doublings); got {max_tree_depth!r}.")
