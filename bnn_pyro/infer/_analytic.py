"""The analytic fast path: potential energy and its gradient by hand for a stack of ``nn.Linear`` layers and
elementwise activations with Normal priors and a Gaussian likelihood (fixed or learned noise).

For such a :class:`~bnn_pyro.BNN` (``bnn_pyro.utils.linear_stack.linear_stack`` recognises the net) the potential
energy over the unconstrained site values ``theta`` laid out in one flat vector,

    U(theta) = -log p(w) - log p(s) - log|ds/dz| - (N_total / N) sum_i log Normal(y_i; f(x_i; w), s),

and its gradient need no autograd tape: the forward pass is one ``addmm`` per layer and the activations;
the backward pass is the activations' derivatives (ATen's own ``*_backward`` kernels, the formulas
autograd runs), two matrix products per layer and the prior's gradient ``(w - m) / v``. About a dozen
tensor operations per evaluation instead of ~80 TorchScript operations on the generic path, eager, so
nothing is traced or frozen. ``theta`` may carry one leading batch axis (chains or ELBO particles):
the layers then run as ``baddbmm``/``bmm``, the first layer with its bias folded into the product (a column of
ones on ``x``), and with one hidden layer and one output the first layer's gradient comes from one product over
the activation's derivative (:meth:`StackPotential._one_output`): fewer passes over the ``(B, N, hidden)``
activations than autograd makes (measured: ``benchmarks/results/docstring_figures/results.md``).

Covered (anything else returns ``None`` from :func:`build` and keeps the generic path of
:mod:`bnn_pyro.infer._logjoint`): priors ``Normal`` (any per-element loc and scale) on every random
weight; deterministic or frozen weights as constants; activations in :data:`ACTIVATIONS`; the
``Gaussian`` likelihood with a fixed ``scale``, or a learned ``sigma``/``precision`` whose prior is one
of :data:`NOISE_PRIORS` (unconstrained by ``exp``, Pyro's ``biject_to`` for a positive support).
:func:`build` checks the result against the generic potential and its autograd gradient at a probe point
before it is used.

Used by NUTS (:class:`~bnn_pyro.infer._nuts.FlatNUTS`), by HMC (:class:`~bnn_pyro.infer._one_chain.FlatHMC`; and
``chain_method="vectorized"`` through :meth:`StackPotential.leapfrog_batch`; Metropolis, without gradients,
keeps the generic one), by MALA on the fast path, and by
the mean-field SVI loss
(:func:`bnn_pyro.infer._logjoint.svi_loss`) and SVI's flat path (:mod:`bnn_pyro.infer._svi_flat`, through
:func:`negative_elbo`). ``tests/infer/test_analytic.py`` checks values and gradients
against Pyro's log density and autograd in float64.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Independent, biject_to, transforms

from bnn_pyro.infer._analytic_batched import BoundBatch
from bnn_pyro.infer._analytic_ops import ACTIVATIONS, NOISE_PRIORS, Layer, activation, affine
from bnn_pyro.infer._common import unvalidated
from bnn_pyro.likelihoods import HALF_LOG_2PI, Gaussian
from bnn_pyro.utils.linear_stack import linear_stack, site
from bnn_pyro.utils.user_warnings import warn

__all__ = ["StackPotential", "build", "normal_loc_scale", "ACTIVATIONS", "NOISE_PRIORS"]


class StackPotential:
    """``potential(theta[, x, y]) -> (U, grad U)`` for ``theta`` shaped ``(D,)`` or ``(B, D)`` (see the module
    docstring); ``x, y`` default to the data given at build time (MCMC), and may be a minibatch (SVI; the
    likelihood is scaled by ``dataset_size / len(x)``). :meth:`leapfrog` is one velocity-Verlet step;
    :meth:`leapfrog_batch` one for ``C`` chains at once.

    One unbatched ``theta`` on the bound data (NUTS's case, :meth:`_bound`) goes into a buffer whose per-site views
    (and a gradient buffer's, filled by ``out=``) are made once, and the energy's sums into a small buffer that a
    leapfrog step reads back once, the scalar arithmetic in Python: ~20 tensor operations per leapfrog step."""

    def __init__(self, ops, slots, loc, precision, prior_const, noise, scale, dataset_size, x, y):
        self._ops, self._slots, self._loc, self._prec = ops, slots, loc, precision
        self._prior_const, self._noise, self._fixed_scale = prior_const, noise, scale
        self.dataset_size, self.x, self.y = dataset_size, x, y
        self._zero_loc = not bool(loc.any())
        self._order = list(slots)  # the layout: site name -> (start, stop, shape)
        first = [
            i
            for i, op in enumerate(ops)
            if isinstance(op, Layer) and any(isinstance(v, str) for v in (op.weight, op.bias))
        ]
        self._first_random = first[0] if first else len(ops)
        # the general path folds the first layer's bias into its product where both are sites (the usual net) and
        # theta is batched (SVI's particles)
        self._fold_first = isinstance(ops[0], Layer) and all(isinstance(v, str) for v in (ops[0].weight, ops[0].bias))
        self._one_hidden = self._fold_first and len(ops) == 3 and not isinstance(ops[1], Layer)
        self._y = y.reshape(x.shape[0], -1).to(loc.dtype)  # float64 targets of a float32 net (numpy data)
        self._buf, self._gbuf = loc.new_zeros(loc.shape), loc.new_zeros(loc.shape)
        self._views = {n: self._buf[a:b].view(shape) for n, (a, b, shape) in slots.items()}
        self._gviews = {n: self._gbuf[a:b].view(shape) for n, (a, b, shape) in slots.items()}
        # the bound path's plan, resolved once: forward (layer: weight, its transpose, bias; or activation) and
        # backward (gradient views; bias ones as (1, out), filled by ones(1, N) @ delta, cheaper than a column sum;
        # None for a constant), the energy sums and their weights in U
        site = lambda ref, views, other: views[ref] if isinstance(ref, str) else other  # noqa: E731
        self._plan = [
            (
                site(op.weight, self._views, op.weight),
                site(op.weight, self._views, op.weight).t(),
                site(op.bias, self._views, op.bias),
            )
            if isinstance(op, Layer)
            else op
            for op in ops
        ]
        self._grad_plan = [
            (
                site(op.weight, self._gviews, None),
                self._gviews[op.bias].view(1, -1) if isinstance(op.bias, str) else None,
            )
            if isinstance(op, Layer)
            else None
            for op in ops
        ]
        self._ones, self._ends_with_layer = loc.new_ones(1, x.shape[0]), isinstance(ops[-1], Layer)
        n, count = x.shape[0], self._y.numel()
        factor = dataset_size / n
        self._sums = loc.new_tensor([0.0, 0.0, 1.0, 0.0])  # likelihood term, d . P d, 1 (constant's slot), p . M^-1 p
        self._sum_lik, self._sum_prior, self._sum_kin, self._sum_u = (
            self._sums[0],
            self._sums[1],
            self._sums[3],
            self._sums[:3],
        )
        if noise is None:  # U = inv_var factor / 2 |f - y|^2 + d . P d / 2 + const
            inv_var = scale**-2
            self._lik_weight, self._delta_scale = 0.5 * factor * inv_var, factor * inv_var
            u_const = factor * count * (math.log(scale) + HALF_LOG_2PI)
        else:  # the likelihood term is the whole noise-dependent part of U, computed as a tensor
            self._lik_weight, self._delta_scale = 1.0, None
            u_const = factor * count * HALF_LOG_2PI
        self._u_const = prior_const + u_const
        self._u_weights = loc.new_tensor([self._lik_weight, 0.5, self._u_const])
        self._batches = {}  # number of chains -> BoundBatch (leapfrog_batch)

    def _param(self, theta, ref, lead):
        a, b, shape = self._slots[ref] if isinstance(ref, str) else (None, None, None)
        return ref if a is None else theta[..., a:b].view(lead + shape)

    @property
    def prior_loc(self) -> torch.Tensor:
        """The Normal priors' means over ``theta`` (0 at a learned noise's slot)."""
        return self._loc

    @property
    def prior_precision(self) -> torch.Tensor:
        """The Normal priors' precisions over ``theta`` (0 at a learned noise's slot, whose prior is not Normal)."""
        return self._prec

    @property
    def noise_index(self) -> int | None:
        """The slot of a learned noise's unconstrained value in ``theta``, or None for a fixed noise scale."""
        return None if self._noise is None else self._noise[1]

    @property
    def prior_const(self) -> float:
        """The Normal priors' constant: ``sum (log scale + log(2 pi) / 2)`` over their elements."""
        return self._prior_const

    def __call__(
        self, theta: torch.Tensor, x: torch.Tensor | None = None, y: torch.Tensor | None = None, *, prior: bool = True
    ):
        # the bound data (no x given: NUTS/HMC), one theta. A caller passing batches (SVI, Potential) always takes the
        # general path below, so that a batch gives the same floats whether or not it is the bound data's tensor
        # (a stream of batches then equals a fit on the tensor, tests/infer/test_streaming.py). ``prior=False``
        # leaves the Normal priors' terms out of U and its gradient (a learned noise's prior and Jacobian stay): the
        # Monte Carlo part of the mean-field ELBO with a closed-form KL (_analytic_elbo)
        if theta.dim() == 1 and x is None and prior:
            self._buf.copy_(theta)
            grad = self._bound()
            return torch.dot(self._sum_u, self._u_weights), grad
        x, y = (self.x, self._y) if x is None else (x, y.reshape(x.shape[0], -1).to(theta.dtype))
        lead, n = theta.shape[:-1], x.shape[0]
        batched = bool(lead)
        ops, saved, h = self._ops, [], x.expand(lead + x.shape) if batched else x
        fold = batched and self._fold_first  # (unbatched, the two concatenations cost more than they save)
        if fold:  # the first layer's bias as a column of ones on x: one product, no bias broadcast
            op = ops[0]
            h = torch.cat([x, x.new_ones(n, 1)], 1)
            w = torch.cat([self._param(theta, op.weight, lead), self._param(theta, op.bias, lead).unsqueeze(-1)], -1)
            saved.append((h, w))
            h = h @ w.mT  # (lead, N, out): matmul broadcasts x over the particles
        for op in ops[len(saved) :]:  # forward
            if isinstance(op, Layer):
                w, b = self._param(theta, op.weight, lead), self._param(theta, op.bias, lead)
                saved.append((h, w))
                h = affine(h, w, b)
            elif op.inplace is not None and saved and isinstance(ops[len(saved) - 1], Layer):
                saved.append((None, op.inplace(h)))  # a layer's fresh output; the backward reads only the result
            else:
                a, h = h, op.forward(h)
                saved.append((a, h))
        r = h - y  # f - y, (lead, N, out)
        ss = (r * r).sum((-2, -1))
        count = r.shape[-1] * n
        factor = self.dataset_size / n
        grads = {}
        if self._noise is None:
            inv_var = self._fixed_scale**-2
            u_lik = ss * (0.5 * factor * inv_var)
            u_const = factor * count * (math.log(self._fixed_scale) + HALF_LOG_2PI)
            delta = r.mul_(factor * inv_var)
        else:
            u_lik, u_const, g_noise, delta_scale = self._noise_terms(theta, ss, count, factor)
            grads[self._noise[0]] = g_noise.unsqueeze(-1)
            delta = r.mul_(delta_scale.view(lead + (1, 1)) if batched else delta_scale)
        for i in range(len(ops) - 1, self._first_random - 1, -1):  # backward
            op, (a, h) = ops[i], saved[i]
            if not isinstance(op, Layer):
                delta = op.backward(delta, a, h)
                continue
            if i == 0 and fold:
                g = delta.mT @ a  # (lead, out, in + 1): the weight's gradient and, in the last column, the bias's
                grads[op.weight], grads[op.bias] = g[..., :-1].reshape(lead + (-1,)), g[..., -1]
                break
            if isinstance(op.weight, str):
                grads[op.weight] = (delta.mT @ a).reshape(lead + (-1,))
            if isinstance(op.bias, str):
                grads[op.bias] = delta.sum(-2)
            if (
                i == 2 and fold and self._one_hidden and h.shape[-2] == 1
            ):  # one hidden layer, one output: see _one_output
                self._one_output(grads, delta, saved[1], saved[0][0], h)
                break
            if i > self._first_random:  # h is the weight here; one output: an outer product, elementwise
                delta = delta * h if h.shape[-2] == 1 else delta @ h
        grad = torch.cat([grads[name] for name in self._order], -1)
        if not prior:
            return u_lik + u_const, grad
        d = theta if self._zero_loc else theta - self._loc
        prior_grad = d * self._prec
        grad.add_(prior_grad)
        u_prior = (d * prior_grad).sum(-1)
        u = torch.add(u_lik, u_prior, alpha=0.5).add_(self._prior_const + u_const)
        return u, grad

    def _one_output(self, grads, delta, act_saved, x1, w) -> None:
        """The first layer's gradients where ``ops`` are [first layer (bias folded), activation, a layer with ONE
        output ``w``]: the activation's input gradient is ``(delta (x) w) * s`` with ``s`` the activation's derivative,
        so the first layer's gradient ``((delta (x) w) * s)^T x1`` is ``w^T * (s^T (delta * x1))``: one product over
        ``s`` in place of the outer product, the activation's backward and a product over its result."""
        a, h = act_saved
        s = self._ops[1].backward(h.new_ones(()).expand_as(h), a, h)
        g = (s.mT @ (delta * x1)).mul_(w.mT)  # (lead, hidden, in + 1)
        lead = g.shape[:-2]
        first = self._ops[0]
        grads[first.weight], grads[first.bias] = g[..., :-1].reshape(lead + (-1,)), g[..., -1]

    def noise_prior(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A learned noise's prior and Jacobian part of U, ``-log p(sigma) - log |d sigma / d z|``, and its derivative
        in the noise's unconstrained value ``z`` (both over ``theta``'s leading dimensions); zeros without one."""
        if self._noise is None:
            zero = theta.new_zeros(theta.shape[:-1])
            return zero, zero
        _, index, _, prior, score = self._noise
        z = theta[..., index]
        value = z.exp()
        return -prior.log_prob(value) - z, -score(prior, value) - 1.0

    def _noise_terms(self, theta, ss, count: int, factor: float):
        """A learned noise's part of U (likelihood, its prior, the Jacobian), its gradient in the noise's
        unconstrained value, and ``factor / sigma^2`` (the scale of ``f - y`` in the backward pass)."""
        _, index, per_z, prior, score = self._noise
        z = theta[..., index]
        log_sigma = z * per_z  # sigma: z; precision: -z / 2
        inv_var = torch.exp(-2.0 * log_sigma)
        value = z.exp()
        u_lik = factor * (0.5 * ss * inv_var + count * log_sigma) - prior.log_prob(value) - z  # prior, Jacobian
        g_noise = factor * per_z * (count - ss * inv_var) - score(prior, value) - 1.0
        return u_lik, factor * count * HALF_LOG_2PI, g_noise, factor * inv_var

    def _bound(self) -> torch.Tensor:
        """``grad U`` at the ``theta`` held in the buffer, on the bound data; leaves the likelihood term and the
        prior quadratic in ``self._sums`` (``U = sums[:3] . [lik_weight, 1/2, const]``)."""
        h, saved = self.x, []
        for step in self._plan:  # forward: addmm with the transposed view made once
            if type(step) is tuple:
                _, wt, b = step
                saved.append(h)
                if b is None:
                    h = torch.mm(h, wt)
                elif wt.shape[0] == 1:  # one input: an outer product, cheaper elementwise than as a rank-1 GEMM
                    h = torch.addcmul(b, h, wt)
                else:
                    h = torch.addmm(b, h, wt)
            else:
                a, h = h, step.forward(h)
                saved.append((a, h))
        # f - y; in place where h is a layer's fresh output (an activation's output is saved for its backward)
        r = h.sub_(self._y) if self._ends_with_layer else h - self._y
        flat = r.view(-1)
        if self._noise is None:
            torch.dot(flat, flat, out=self._sum_lik)
            delta = r.mul_(self._delta_scale)
        else:
            u_lik, _, g_noise, delta_scale = self._noise_terms(
                self._buf, torch.dot(flat, flat), r.numel(), self.dataset_size / r.shape[0]
            )
            self._sum_lik.copy_(u_lik)
            self._gviews[self._noise[0]].copy_(g_noise)
            delta = r.mul_(delta_scale)
        for i in range(len(self._plan) - 1, self._first_random - 1, -1):  # backward
            step = self._plan[i]
            if type(step) is not tuple:
                a, h = saved[i]
                delta = step.backward(delta, a, h)
                continue
            g_weight, g_bias = self._grad_plan[i]
            if g_weight is not None:
                torch.mm(delta.t(), saved[i], out=g_weight)
            if g_bias is not None:
                torch.mm(self._ones, delta, out=g_bias)
            if i > self._first_random:
                delta = torch.mm(delta, step[0])
        theta = self._buf
        d = theta if self._zero_loc else theta - self._loc
        prior_grad = d * self._prec
        torch.dot(d, prior_grad, out=self._sum_prior)
        return torch.add(self._gbuf, prior_grad)

    def leapfrog(self, z, p, g, step, inverse_mass):
        """One velocity-Verlet step of signed size ``step`` (a float) from ``(z, p)`` with gradient ``g`` under
        ``inverse_mass`` (a vector: diagonal; a matrix: dense), on the bound data. Returns ``(z, p, g, M^-1 p,
        (U, kinetic))`` at the new point, the energies as Python floats (one host read per step)."""
        half = -0.5 * float(step)
        dense = inverse_mass.dim() == 2
        p = p.add(g, alpha=half)
        (
            torch.addmv(z, inverse_mass, p, alpha=float(step), out=self._buf)
            if dense  # z + step M^-1 p, in the buffer
            else torch.addcmul(z, inverse_mass, p, value=float(step), out=self._buf)
        )
        z = self._buf.clone()
        g = self._bound()
        p.add_(g, alpha=half)
        sharp = inverse_mass @ p if dense else inverse_mass * p
        torch.dot(p, sharp, out=self._sum_kin)
        lik, prior, _, kinetic = self._sums.tolist()
        return z, p, g, sharp, (self._lik_weight * lik + 0.5 * prior + self._u_const, 0.5 * kinetic)

    def batch(self, chains: int):
        """The bound data's potential for ``chains`` chains at once (:class:`~bnn_pyro.infer._analytic_batched.BoundBatch`,
        made once per number of chains): ``batch(C)(theta (C, D)) -> (U (C,), grad (C, D))``."""
        made = self._batches.get(chains)
        if made is None:
            made = self._batches[chains] = BoundBatch(self, chains)
        return made

    def leapfrog_batch(self, z, p, g, step, minv):
        """One velocity-Verlet step of ``C`` chains on the bound data: ``z, p, g`` ``(C, D)``, ``step`` ``(C,)`` signed
        step sizes, ``minv`` ``(C, D)`` or ``(C, D, D)``; returns ``(z, p, g, M^-1 p, U, kinetic)``, tensors (no host
        read; :mod:`bnn_pyro.infer._analytic_batched`)."""
        return self.batch(z.shape[0]).leapfrog(z, p, g, step, minv)


def normal_loc_scale(d, shape: torch.Size):
    """``(loc, scale)`` of a Normal prior over a parameter of ``shape`` (wrapped in ``Independent``), else None."""
    while isinstance(d, Independent):
        d = d.base_dist
    if not isinstance(d, torch.distributions.Normal) or type(d).log_prob is not torch.distributions.Normal.log_prob:
        return None
    if tuple(d.batch_shape) + tuple(d.event_shape) != tuple(shape):
        return None
    return torch.broadcast_to(d.loc, shape), torch.broadcast_to(d.scale, shape)


def _exp_transform(d) -> bool:
    """Whether Pyro unconstrains ``d``'s support by ``exp`` (``positive``; ``nonnegative`` as ``exp`` then the
    identity ``AffineTransform(0, 1)``)."""
    t = biject_to(d.support)
    parts = t.parts if isinstance(t, transforms.ComposeTransform) else [t]
    rest = parts[1:]
    return isinstance(parts[0], transforms.ExpTransform) and all(
        isinstance(p, transforms.AffineTransform) and float(p.loc) == 0.0 and float(p.scale) == 1.0 for p in rest
    )


def build(joint, names, shapes, x, y, reference=None) -> StackPotential | None:
    """A :class:`StackPotential` for ``joint`` (a :class:`~bnn_pyro.infer._logjoint.LogJoint`) over a flat vector
    laid out as ``names``/``shapes`` (unconstrained shapes), with data ``x, y``, or ``None`` where it does not apply
    or (given ``reference``, the generic potential of dict sites: :func:`bnn_pyro.infer._logjoint.analytic`)
    disagrees with it at a probe point."""
    model = joint.model
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or type(model.likelihood) is not Gaussian:
        return None
    layers = linear_stack(model._template)
    if layers is None or set(names) != set(joint.priors):
        return None
    constants = {**model.buffers_dict(), **model.point_values()}
    ops = []
    for path, act in layers:
        if act is None:
            linear = model._template.get_submodule(path)
            refs = []
            for attr in ("weight", "bias"):
                key = site(path, attr)
                if getattr(linear, attr) is None:
                    refs.append(None)
                elif key in joint.priors or key in constants:
                    refs.append(key if key in joint.priors else constants[key].to(x.dtype))
                else:  # a parameter neither random nor a known constant
                    return None
            if refs[0] is None:
                return None
            ops.append(Layer(*refs))
        elif type(act) is not nn.Identity:
            elementwise = activation(act)
            if elementwise is None:
                return None
            ops.append(elementwise)
    dtype, device = x.dtype, x.device
    slots, start, locs, precs, const, noise = {}, 0, [], [], 0.0, None
    noise_sites = model.likelihood.sites()
    for name in names:
        shape = torch.Size(shapes[name])
        size = shape.numel()
        slots[name] = (start, start + size, shape)
        prior = unvalidated(joint.priors[name])  # a diverging trajectory's NaN gives NaN, not an error
        if name in noise_sites:
            score = NOISE_PRIORS.get(type(prior).__name__)
            if score is None or not _exp_transform(prior) or size != 1:
                return None
            noise = (name, start, 1.0 if name == "sigma" else -0.5, prior, score)
            locs.append(torch.zeros(1, dtype=dtype, device=device))
            precs.append(torch.zeros(1, dtype=dtype, device=device))
        else:
            params = normal_loc_scale(prior, shape)
            if params is None:
                return None
            loc, scale = (p.to(dtype=dtype, device=device).reshape(-1) for p in params)
            locs.append(loc)
            precs.append(scale**-2)
            const += float((scale.log() + HALF_LOG_2PI).sum())
        start += size
    scale = None if noise is not None else float(model.likelihood.scale)
    pot = StackPotential(ops, slots, torch.cat(locs), torch.cat(precs), const, noise, scale, joint.dataset_size, x, y)
    return pot if reference is None or _agrees(pot, reference, names, shapes, x) else None


def _agrees(pot: StackPotential, energy, names, shapes, x) -> bool:
    """Whether ``pot`` gives the generic potential ``energy`` and its autograd gradient at a probe point."""
    g = torch.Generator(device=x.device).manual_seed(0)
    size = sum(torch.Size(shapes[n]).numel() for n in names)
    theta = (0.3 * torch.randn(size, generator=g, device=x.device, dtype=x.dtype)).requires_grad_()
    parts = dict(zip(names, theta.split([torch.Size(shapes[n]).numel() for n in names])))
    ref = energy({n: parts[n].reshape(shapes[n]) for n in names})
    (ref_grad,) = torch.autograd.grad(ref, theta)
    u, grad = pot(theta.detach())
    tol = 1e-4 if x.dtype == torch.float32 else 1e-8
    scale = 1.0 + float(ref.detach().abs()) + float(ref_grad.abs().max())
    ref = ref.detach()
    ok = abs(float(u) - float(ref)) <= tol * scale and float((grad - ref_grad).abs().max()) <= tol * scale
    if not ok:
        warn(
            "fast path: the analytic potential disagrees with the generic one on this model; using the "
            "generic path (same values, slower).",
            RuntimeWarning,
        )
    return ok
