"""NUTS: one transition of one chain or of ``C`` chains in lockstep, and the one-chain kernel of ``method="nuts"``.

:func:`nuts_transition` is Stan's multinomial NUTS (Betancourt 2017, "A Conceptual Introduction to Hamiltonian
Monte Carlo", appendix A; Stan's ``base_nuts``) for every chain at once. Trajectories are doubled forward or
backward at random; within a new subtree a state is drawn with probability proportional to ``exp(-H)``, and the
new subtree's draw replaces the current one with probability ``min(1, w_new / w_old)`` (biased progressive
sampling); doubling stops at a U-turn (the generalized criterion ``p_sharp . rho <= 0`` at either end, checked
also across the merged halves, as Stan does since 2.26), at a divergence (energy error > ``MAX_ENERGY_ERROR`` or
NaN), or after ``max_tree_depth`` doublings. Nothing is differentiated: it runs under ``torch.no_grad``.

One builder serves one chain and ``C``:

- **Vectors batched, scalars on the host.** Positions, momenta, gradients and ``M^-1 p`` are tensors, ``(C, D)``
  (or ``(D,)`` for one chain whose leapfrog is unbatched: :class:`~bnn_pyro.infer._analytic_batched.OneChain`;
  :class:`~bnn_pyro.infer._batched.BatchedChains` then holds and passes the chain so, its potential a float
  rounded to the chain's dtype, so that no ``(1, D)`` view is made per draw and the draws are those of the
  ``(1, D)`` batch bit for bit); the per-chain scalars (energies, log weights, masks, counts) are Python floats
  read back once per leapfrog step. A small net's step is bound by the dispatch of tensor operations, not their
  arithmetic, so a scalar kept as a float costs no operation where a ``(C,)`` tensor costs one per use.
- **Lockstep, masked.** All chains double together: at depth ``j`` each chain still running picks a direction and
  builds a subtree of ``2**j`` leapfrog steps from that end, with its own signed step. A chain whose subtree
  diverges or turns is marked done; its later leapfrog steps are still computed (one batched call) but unused,
  exactly as the recursive builder discards that subtree. The subtree ends when every chain is done.
- **Iterative subtrees.** Leaf ``k`` completes the balanced nodes of sizes ``2, 4, .., 2**t`` that end at it
  (``t`` = trailing zeros of ``k + 1``); each is merged from the pending first half of its level, and the
  Stan checks of all ``t`` merges are one matrix product of the ends' ``M^-1 p`` with the halves' momentum sums
  and end momenta (by linearity, each check is a sum of two of its entries). Where both halves are single states
  the check needs one inner product: with ``c = sharp_1 . p_2`` (``M^-1`` symmetric) and ``pp = p . M^-1 p``
  (twice the kinetic energy, which the leapfrog returns), it turns where ``pp_1 + c <= 0`` or ``c + pp_2 <= 0``.
  The state drawn from a subtree is chosen by streaming: the new leaf replaces the candidate with probability
  ``exp(log_w - W)``, ``W = log sum exp(H0 - H)`` so far (uniform progressive sampling). A subtree stops at the
  leaf where every chain has diverged or turned; after the last doubling, or one in which no chain's subtree
  completed, the merged trajectory is not checked (every chain stops there: its ends and momentum sum are unused).

Every random number comes from ``generator`` (momenta, directions, multinomial choices); step sizes and inverse
mass matrices are per chain; adaptation is the caller's (:class:`~bnn_pyro.infer._batched.BatchedChains`).
:class:`FlatNUTS` is ``method="nuts"``'s kernel for one chain (its ``C = 1`` case); ``chain_method="vectorized"``
runs ``C`` chains through the same transition. ``tests/infer/test_nuts.py`` checks it against exact posteriors
and Pyro's ``NUTS``; ``tests/infer/test_nuts_batched.py`` against closed forms at ``C`` chains.

Usage::

    z, u, g, stats = nuts_transition(z, u, g, step, minv, leapfrog=leapfrog, generator=torch.Generator())
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from bnn_pyro.infer._analytic_batched import sharp
from bnn_pyro.infer._batched import MAX_ENERGY_ERROR, TransitionStats, momentum
from bnn_pyro.infer._one_chain import OneChainKernel

__all__ = ["FlatNUTS", "nuts_transition"]

_FLOAT32 = struct.Struct("f")
Leapfrog = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple]


class FlatNUTS(OneChainKernel):
    """NUTS for one chain over a flat vector: :func:`nuts_transition` at ``C = 1``, adapted by
    :class:`~bnn_pyro.infer._batched.BatchedChains` (Pyro's ``WarmupAdapter``: dual averaging, Stan's windows, the
    step-size heuristic after each mass-matrix window). ``max_tree_depth``: at most ``2**max_tree_depth - 1``
    leapfrog steps per draw (10: Stan's and Pyro's default)."""

    def __init__(
        self,
        model,
        joint,
        *,
        init_strategy,
        step_size=None,
        target_accept_prob=0.8,
        max_tree_depth=10,
        dense_mass=False,
        jit=True,
    ):
        super().__init__(
            model,
            joint,
            transition=nuts_transition,
            options=dict(max_tree_depth=max_tree_depth),
            init_strategy=init_strategy,
            step_size=step_size,
            target_accept_prob=target_accept_prob,
            dense_mass=dense_mass,
            jit=jit,
            unbatched=True,
        )


class _Node(NamedTuple):
    """A trajectory segment, its states in the order they were grown: the momentum and ``M^-1 p`` of its first
    (``near``) and last (``far``) states and the sum ``rho`` of its momenta; ``pp``: for a single state, ``p . M^-1
    p`` per chain (a list of floats; ``None`` for longer segments)."""

    near_p: Tensor
    near_sharp: Tensor
    far_p: Tensor
    far_sharp: Tensor
    rho: Tensor
    pp: list | None = None


class _Subtree(NamedTuple):
    ok: list  # per chain: completed without a divergence or a turn (and the chain was growing)
    n_steps: list  # leapfrog steps the chain took in it (up to and including a failing one)
    accept_sum: list  # sum of min(1, exp(H0 - H)) over those steps
    diverged: list
    log_w: list  # log sum exp(H0 - H) over its leaves
    draw: tuple  # (z, g) tensors and u (a list): the state drawn from it
    node: _Node  # its ends and momentum sum
    frontier: tuple  # (z, p, g, M^-1 p) of its last state


def nuts_transition(
    z: Tensor,
    u: Tensor,
    g: Tensor,
    step: Tensor,
    minv: Tensor,
    *,
    leapfrog: Leapfrog,
    generator: torch.Generator,
    max_tree_depth: int = 10,
) -> tuple[Tensor, Tensor, Tensor, TransitionStats]:
    """One NUTS transition of every chain: ``z``, ``g`` (C, D), ``u`` (C,), ``step`` (C,) > 0; momentum ``p ~ N(0,
    M)`` drawn here from ``generator`` (:func:`~bnn_pyro.infer._batched.momentum`).

    ``leapfrog(z, p, g, step, minv) -> (z, p, g, sharp, u, kinetic)``: one velocity-Verlet step of every chain
    (signed ``(C,)`` steps; ``sharp = M^-1 p``; ``u``, ``kinetic`` ``(C,)``), e.g.
    :func:`~bnn_pyro.infer._analytic_batched.leapfrog_from`. A :class:`~bnn_pyro.infer._analytic_batched.OneChain`
    leapfrog at ``C = 1`` is run unbatched (``(D,)`` vectors, a float step). One chain may also be passed
    unbatched: ``z``, ``g`` ``(D,)``, ``u`` and ``step`` floats, ``minv`` ``(D,)`` or ``(D, D)`` (with a ``OneChain``
    leapfrog; what :class:`~bnn_pyro.infer._batched.BatchedChains` holds at one chain), and is returned so: no
    ``(1, D)`` view per draw. Returns the drawn ``(z, u, g)`` and the
    :class:`~bnn_pyro.infer._batched.TransitionStats` (lists of ``C`` Python numbers).
    """
    if torch.is_grad_enabled():  # nothing here is differentiated (a generic potential enables grad for itself)
        with torch.no_grad():
            return nuts_transition(
                z, u, g, step, minv, leapfrog=leapfrog, generator=generator, max_tree_depth=max_tree_depth
            )
    # one chain, unbatched: (D,) vectors, a float potential and step
    one = isinstance(z, Tensor) and z.dim() == 1 and not isinstance(u, Tensor)
    if one:
        _check_one(z, u, g, step, minv, leapfrog, max_tree_depth)
        c, u0, minv_1, step_1 = 1, [u], minv, step
    else:
        steps = step.tolist() if isinstance(step, Tensor) else None  # one host read
        _check(z, u, g, step, steps, minv, max_tree_depth)
        c = z.shape[0]
        if c == 1 and hasattr(leapfrog, "unbatched"):  # a one-chain batch: run unbatched, return (1, D) again
            z1, u1, g1, stats = nuts_transition(
                z[0], float(u[0]), g[0], steps[0], minv[0], leapfrog=leapfrog, generator=generator,
                max_tree_depth=max_tree_depth,
            )  # fmt: skip
            return z1.unsqueeze(0), u.new_tensor([u1]), g1.unsqueeze(0), stats
        u0 = u.tolist()
    p0 = momentum(minv, generator, batched=not one)
    sharp0 = _sharp_one(minv, p0) if one else sharp(minv, p0)
    # (1, D) at one chain: a (D,) vecdot reduces in another order (other bits than the batch's)
    pp0 = torch.linalg.vecdot(p0.unsqueeze(0) if one else p0, sharp0).tolist()
    h0 = [a + 0.5 * b for a, b in zip(u0, pp0)]
    if one:
        step_fn, signed = _unbatched(leapfrog.unbatched, minv_1), {True: step_1, False: -step_1}
    else:
        step_fn, signed = _batched(leapfrog, minv), {True: step, False: -step}
    # the trajectory: its backward and forward ends (z, p, g, M^-1 p) and its states' momentum sum
    ends = {False: (z, p0, g, sharp0), True: (z, p0, g, sharp0)}
    rho, log_w, draw_z, draw_g, draw_u = p0, [0.0] * c, z, g, list(u0)
    running = [True] * c
    depth, n_steps, accept, diverging = [max_tree_depth] * c, [0] * c, [0.0] * c, [False] * c
    # the uniforms of every doubling's direction and merge, and of the first two subtrees' leaves: one draw (a
    # shallow tree needs no other); a deeper subtree draws its leaves' when it starts
    first = torch.rand(2 * max_tree_depth + 3, c, generator=generator, dtype=z.dtype, device=z.device).tolist()
    for j in range(max_tree_depth):
        leaves = (
            first[2 * max_tree_depth : 2 * max_tree_depth + 1]
            if j == 0
            else first[2 * max_tree_depth + 1 :]
            if j == 1
            else torch.rand(2**j, c, generator=generator, dtype=z.dtype, device=z.device).tolist()
        )
        forward = [v < 0.5 for v in first[j]]
        fw = _agree(forward)
        begin, signed_step = (
            (ends[fw], signed[fw]) if type(fw) is bool else (_pick(fw, ends[True], ends[False]), _signed(fw, step))
        )
        new = _subtree(begin, j, signed_step, h0, running, leaves, step_fn)
        # per chain, in one pass: the counts, and biased progressive sampling (the new subtree's draw wins with
        # probability min(1, w_new / w_old))
        take = [False] * c
        for i, (ok, nw, uni) in enumerate(zip(new.ok, new.log_w, first[max_tree_depth + j])):
            n_steps[i] += new.n_steps[i]
            accept[i] += new.accept_sum[i]
            diverging[i] = diverging[i] or new.diverged[i]
            if ok:
                w = log_w[i]
                if nw > w or uni < math.exp(nw - w):
                    take[i], draw_u[i] = True, new.draw[2][i]
                log_w[i] = _logaddexp(w, nw)
        taken = _agree(take)
        draw_z, draw_g = _pick(taken, new.draw[0], draw_z), _pick(taken, new.draw[1], draw_g)
        ok = _agree(new.ok)
        if ok is False or j == max_tree_depth - 1:  # every chain stops here: the merged trajectory is not used
            turned = [True] * c
        else:
            # the trajectory as the first half of a merge: its other end first, the end the subtree grew from last
            back, front = ends[False][1::2], ends[True][1::2]  # (p, M^-1 p) of the backward and forward ends
            old = _Node(*_pick(fw, back, front), *_pick(fw, front, back), rho, pp0 if j == 0 else None)
            turned = _turned([(old, new.node)], one)
            rho = _pick(ok, rho + new.node.rho, rho)
            if ok is True and type(fw) is bool:  # every chain grew, at the same end
                ends[fw] = new.frontier
            else:  # the trajectory grows at the end it was extended from, where its subtree was ok
                for end in (True, False):
                    grew = _agree([o and f == end for o, f in zip(new.ok, forward)])
                    ends[end] = _pick(grew, new.frontier, ends[end])
        for i in range(c):
            if running[i] and not (new.ok[i] and not turned[i]):
                running[i], depth[i] = False, j + 1
        if not any(running):
            break
    accept = [a / max(n, 1) for a, n in zip(accept, n_steps)]
    stats = TransitionStats(accept, n_steps, diverging, h0, depth)
    return draw_z, _in_dtype(draw_u[0], z.dtype) if one else u.new_tensor(draw_u), draw_g, stats


def _subtree(begin: tuple, depth: int, step, h0: list, growing: list, uniforms: list, step_fn) -> _Subtree:
    """``2**depth`` lockstep leapfrog steps from ``begin = (z, p, g, M^-1 p)`` with signed steps ``step``;
    ``growing`` (per chain): the chains that grow (the others' steps are computed and unused); ``uniforms``
    (``2**depth`` rows of ``C``): the multinomial choices."""
    c, leaves = len(h0), 1 << depth
    z, p, g, _ = begin
    gone, n, acc, div, total = [not x for x in growing], [0] * c, [0.0] * c, [False] * c, [-math.inf] * c
    cand_z, cand_g, cand_u = z, g, list(h0)
    pending: list[_Node | None] = [None] * depth  # level m: the completed first half of a node of size 2**(m + 1)
    unbatched = c == 1 and z.dim() == 1
    for k in range(leaves):
        z, p, g, s, us, kinetic = step_fn(z, p, g, step)
        take = [False] * c
        for i in range(c):
            if gone[i]:
                continue
            log_w = h0[i] - us[i] - kinetic[i]
            if log_w != log_w:  # NaN energy: a divergence
                log_w = -math.inf
            n[i] += 1
            acc[i] += 1.0 if log_w > 0 else math.exp(log_w)
            if log_w < -MAX_ENERGY_ERROR:
                div[i] = gone[i] = True
                continue
            total[i] = w = _logaddexp(total[i], log_w)
            # streaming multinomial choice: the new leaf replaces the candidate with probability exp(log_w - W)
            if uniforms[k][i] < math.exp(log_w - w):
                take[i], cand_u[i] = True, us[i]
        taken = _agree(take)
        if taken is not False:
            cand_z, cand_g = _pick(taken, z, cand_z), _pick(taken, g, cand_g)
        node = _Node(p, s, p, s, p, [2.0 * v for v in kinetic])
        if all(gone):  # every chain diverged here: the subtree's nodes are not used
            break
        if not k & 1 or depth == 0:  # an odd leaf (k + 1 not even) completes no node
            if depth:
                pending[0] = node
            continue
        merges = []
        level = 0
        while level < depth and (k + 1) >> level & 1 == 0:  # the nodes of size 2**(level + 1) ending at leaf k
            first = pending[level]
            pending[level] = None
            merges.append((first, node))
            node = _Node(first.near_p, first.near_sharp, node.far_p, node.far_sharp, first.rho + node.rho)
            level += 1
        if level < depth:
            pending[level] = node
        for i, t in enumerate(_turned(merges, unbatched)):
            gone[i] = gone[i] or t
        if all(gone):  # a turn inside it stops every chain: no further leapfrog step
            break
    return _Subtree([not x for x in gone], n, acc, div, total, (cand_z, cand_g, cand_u), node, (z, p, g, s))


def _turned(merges: list[tuple[_Node, _Node]], unbatched: bool) -> list[bool]:
    """Per chain, whether any of the ``merges`` (first half, second half) turns back: Stan's three checks of each,
    ``p_sharp . rho > 0`` at both ends of the whole (``rho = first.rho + second.rho``), of ``first`` plus second's
    first state and of first's last state plus ``second``. The six inner products of a merge are sums of the 16
    of the ends' ``M^-1 p`` with ``[first.rho, second.rho, second.near_p, first.far_p]``: one matrix product for
    all merges, read back at once; two single states need one inner product (module docstring)."""
    if len(merges) == 1 and merges[0][0].pp is not None and merges[0][1].pp is not None:
        first, second = merges[0]
        dots = torch.linalg.vecdot(first.far_sharp, second.near_p).tolist()
        dots = [dots] if unbatched else dots
        return [not (a + d > 0 and d + b > 0) for a, d, b in zip(first.pp, dots, second.pp)]
    sharps = torch.stack([v for f, s in merges for v in (f.near_sharp, s.far_sharp, s.near_sharp, f.far_sharp)], -2)
    vectors = torch.stack([v for f, s in merges for v in (f.rho, s.rho, s.near_p, f.far_p)], -2)
    products = (sharps @ vectors.mT).tolist()
    turned, count = [], len(merges)
    for rows in [products] if unbatched else products:
        ok = True
        for m in range(count):
            # merge m's 4 x 4 block of the product (the whole product for one merge)
            block = rows if count == 1 else [r[4 * m : 4 * m + 4] for r in rows[4 * m : 4 * m + 4]]
            (a0, a1, a2, _), (b0, b1, _, b3), (c0, _, c2, _), (_, e1, _, e3) = block
            if not (a0 + a1 > 0 and b0 + b1 > 0 and a0 + a2 > 0 and c0 + c2 > 0 and e1 + e3 > 0 and b1 + b3 > 0):
                ok = False
                break
        turned.append(not ok)
    return turned


def _sharp_one(minv: Tensor, p: Tensor) -> Tensor:
    """``M^-1 p`` of one chain's ``(D,)`` momentum: ``minv * p`` (diagonal), else through the batched product (the
    ``C = 1`` batch's bits)."""
    return minv * p if minv.dim() == 1 else sharp(minv.unsqueeze(0), p.unsqueeze(0))[0]


def _batched(leapfrog: Leapfrog, minv: Tensor):
    """The batched leapfrog with its energies read back as lists (one host read)."""

    def step_fn(z, p, g, step):
        z, p, g, s, u, kinetic = leapfrog(z, p, g, step, minv)
        us, kin = torch.stack([u, kinetic]).tolist()
        return z, p, g, s, us, kin

    return step_fn


def _unbatched(leapfrog, minv: Tensor):
    """One chain's unbatched leapfrog ``(z, p, g, step, minv) -> (z, p, g, sharp, energies)`` (energies: Python
    floats, or a tensor ``[U, kinetic]``) with its energies as one-element lists."""

    def step_fn(z, p, g, step):
        z, p, g, s, energies = leapfrog(z, p, g, step, minv)
        u, kinetic = energies if type(energies) is tuple else energies.tolist()
        return z, p, g, s, [u], [kinetic]

    return step_fn


def _agree(mask: list):
    """``True`` where every chain's entry is true, ``False`` where none is, else ``mask`` (the chains differ): tested
    once per mask, so that :func:`_pick` and :func:`_signed` cost no operation where the chains agree (always at one
    chain)."""
    if len(mask) == 1:
        return mask[0]
    return True if all(mask) else False if not any(mask) else mask


def _pick(mask, new, old):
    """Per chain, ``new`` where ``mask`` (from :func:`_agree`) else ``old``: a tensor ``(C, ...)`` or a tuple of
    them."""
    if mask is True:
        return new
    if mask is False:
        return old
    if isinstance(new, tuple):
        return tuple(_pick(mask, a, b) for a, b in zip(new, old))
    where = torch.tensor(mask, device=new.device).view(-1, *[1] * (new.dim() - 1))
    return torch.where(where, new, old)


def _signed(forward: list, step: Tensor) -> Tensor:
    """The signed step sizes (``forward``: per chain, from :func:`_agree`): ``+step`` forward, ``-step`` backward."""
    return torch.where(torch.tensor(forward, device=step.device), step, -step)


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a ``(C,)`` potential tensor holds it: one chain's potential is then the
    same number held unbatched, batched or in a checkpoint (resumes stay bit-identical). float32 by ``struct``
    (C's cast, as torch's; no tensor operation)."""
    if dtype is torch.float64:
        return value
    if dtype is torch.float32:
        try:
            return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
        except OverflowError:  # beyond float32's range: torch's cast gives +-inf
            pass
    return torch.tensor(value, dtype=dtype).item()


def _logaddexp(a: float, b: float) -> float:
    top = max(a, b)
    return top + math.log1p(math.exp(-abs(a - b))) if top > -math.inf else -math.inf


def _check_one(z, u, g, step, minv, leapfrog, max_tree_depth) -> None:
    """Clear errors for one chain passed unbatched (:func:`nuts_transition`); one comparison when right."""
    if (
        g.shape == z.shape
        and type(u) is float
        and type(step) is float
        and step > 0
        and minv.shape in (z.shape, z.shape * 2)
        and z.is_floating_point()
        and type(max_tree_depth) is int
        and max_tree_depth >= 1
        and hasattr(leapfrog, "unbatched")
    ):
        return
    d = tuple(z.shape)
    if not z.is_floating_point() or tuple(g.shape) != d:
        raise ValueError(
            f"nuts_transition: z must be a floating (D,) tensor for one chain passed unbatched, and g of its shape; "
            f"got {d} {z.dtype} and {tuple(g.shape)}. Pass (C, D) tensors for C chains."
        )
    if type(u) is not float or type(step) is not float:
        raise ValueError(
            f"nuts_transition: one chain's u (potential) and step must be Python floats; got "
            f"{type(u).__name__} and {type(step).__name__}. Pass (C,) tensors for C chains."
        )
    if not step > 0:
        raise ValueError(f"nuts_transition: the step size must be > 0 (the direction is drawn here); got {step}.")
    if tuple(minv.shape) not in (d, d * 2):
        raise ValueError(
            f"nuts_transition: one chain's minv must be a (D,) = {d} diagonal or (D, D) dense inverse mass "
            f"matrix; got {tuple(minv.shape)}."
        )
    if not hasattr(leapfrog, "unbatched"):
        raise ValueError(
            "nuts_transition: one chain passed unbatched needs a leapfrog with an unbatched step "
            "(bnn_pyro.infer._analytic_batched.OneChain); got "
            f"{type(leapfrog).__name__}. Pass (1, D) tensors to use a batched leapfrog."
        )
    if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 1:
        raise ValueError(f"nuts_transition: max_tree_depth must be an int >= 1 (doublings); got {max_tree_depth!r}.")


def _check(z, u, g, step, steps, minv, max_tree_depth) -> None:
    """Clear errors for bad input (``steps``: the step sizes read back); one comparison of the shapes when they
    are right (the case of every call from :class:`~bnn_pyro.infer._batched.BatchedChains`)."""
    if (
        type(z) is Tensor
        and z.dim() == 2
        and g.shape == z.shape
        and u.shape == z.shape[:1] == getattr(step, "shape", None)
        and minv.shape[:2] == z.shape
        and minv.shape[2:] in ((), z.shape[1:])
        and z.is_floating_point()
        and all(v > 0 for v in steps)  # not min(): a NaN step would pass it
        and type(max_tree_depth) is int
        and max_tree_depth >= 1
    ):
        return
    if not (isinstance(z, Tensor) and z.dim() == 2 and z.is_floating_point()):
        raise ValueError(
            f"nuts_transition: z must be a floating (C, D) tensor of positions, one row per chain; got "
            f"{type(z).__name__} {tuple(getattr(z, 'shape', ()))}. Stack the chains' flat vectors."
        )
    c, d = z.shape
    if tuple(g.shape) != (c, d):
        raise ValueError(f"nuts_transition: g (the gradients) must have z's shape {(c, d)}; got {tuple(g.shape)}.")
    if tuple(u.shape) != (c,):
        raise ValueError(f"nuts_transition: u (the potentials) must be shaped (C,) = {(c,)}; got {tuple(u.shape)}.")
    if not isinstance(step, Tensor) or tuple(step.shape) != (c,):
        raise ValueError(
            f"nuts_transition: step must be a (C,) = {(c,)} tensor of step sizes, one per chain; got "
            f"{type(step).__name__} {tuple(getattr(step, 'shape', ()))}. Try step.expand(C)."
        )
    if not all(v > 0 for v in steps):
        raise ValueError(
            f"nuts_transition: every step size must be > 0 (the direction is drawn here); got {steps[:8]}."
        )
    if tuple(minv.shape) not in ((c, d), (c, d, d)):
        raise ValueError(
            f"nuts_transition: minv must be a (C, D) = {(c, d)} diagonal or (C, D, D) dense inverse "
            f"mass matrix per chain; got {tuple(minv.shape)}."
        )
    if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 1:
        raise ValueError(f"nuts_transition: max_tree_depth must be an int >= 1 (doublings); got {max_tree_depth!r}.")
