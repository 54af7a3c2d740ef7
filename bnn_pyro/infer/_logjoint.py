"""The fast path: a ``BNN``'s log joint density evaluated directly in torch, without tracing Pyro.

Pyro computes a log joint by running the model under effect handlers (a trace, a replay, a
condition, plates, scaling): Python work per evaluation that, on a small net, outweighs the tensor
arithmetic of the density (``benchmarks/fast_path.py`` measures it). For a :class:`~bnn_pyro.BNN` whose every
latent site has a fixed prior (no hierarchical prior: its sites' priors depend on other sites) the
same density is a short torch function of the site values::

    log p(w, y | x) = sum_s log p_s(w_s) + (N / B) sum_{i in batch} log p(y_i | f(x_i; w), noise)

with the network evaluated by ``functional_call`` (batched over leading dimensions by ``vmap``).
:func:`svi_loss` (the reparameterized ELBO of a mean-field or MAP guide) and :func:`potential`
(NUTS, HMC and Metropolis) are built on it. They equal Pyro's ``Trace_ELBO`` and potential energy:
the same sites, densities, Jacobians and minibatch scaling; the mean-field guide's noise is drawn
with the same calls in the same order, so a fit with the fast path follows the same trajectory as
one without, up to float rounding (``tests/infer/test_logjoint.py`` checks values and gradients).

Engines use it when :func:`build` accepts the model and fall back to Pyro otherwise;
``bp.fit(..., fast_path=False)`` forces Pyro's path, and ``config["fast_path"]`` says which ran (every engine that
takes the option). The engines that move the weights themselves get it through
:class:`bnn_pyro.infer._potential.Potential` (``Potential(..., fast_path=False)`` forces Pyro's there; ``pot.path``
says which runs, and ``config["potential"]`` records it: :class:`~bnn_pyro.infer._potential.Potentials`).
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import Distribution, biject_to

from bnn_pyro.infer import _analytic, _analytic_elbo
from bnn_pyro.infer._common import unvalidated
from bnn_pyro.model import BNN
from bnn_pyro.utils.upstream_private import autoguide_loc_scale, autoguide_setup, pyro_context
from bnn_pyro.utils.user_warnings import warn

__all__ = [
    "LogJoint",
    "build",
    "svi_loss",
    "potential",
    "flat_potential_and_grad",
    "FlatPotential",
    "recording",
    "is_identity",
]


class LogJoint:
    """``log p(w, y | x)`` of a BNN for site values batched over leading dimensions.

    Attributes
    ----------
    priors:
        Site name -> prior, in the model's site order (weights, then the likelihood's noise sites).
    """

    def __init__(self, model: BNN, priors: dict[str, Distribution], dataset_size: int):
        self.model, self.priors, self.dataset_size = model, priors, dataset_size
        self._noise = list(model.likelihood.sites())
        self._event_dims = {name: d.event_dim for name, d in priors.items()}

    def batch_shape(self, values: dict[str, torch.Tensor]) -> torch.Size:
        name, v = next(iter(values.items()))
        return v.shape[: v.dim() - self._event_dims[name] - len(self.priors[name].batch_shape)]

    def log_prior(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(d.log_prob(values[name]) for name, d in self.priors.items())

    def log_likelihood(
        self,
        values: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        points: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The minibatch log-likelihood scaled by ``dataset_size / len(x)``; ``points`` are the
        deterministic parameters' values (default: the model's current ones)."""
        params = {n: values[n] for n in self.model.sample_names}
        full = dict(self.model.point_values() if points is None else points)
        full.update(params)
        f = self.model._evaluate(full, x)
        batch = self.batch_shape(values)
        noise = {n: values[n].reshape(batch + (1,)) if batch else values[n] for n in self._noise}
        log_lik = self.model.likelihood.observed(f, noise, inner_dims=f.dim() - len(batch) - 2).log_prob(y)
        return log_lik.sum(-1) * (self.dataset_size / x.shape[0])

    def __call__(self, values, x, y, points=None) -> torch.Tensor:
        return self.log_prior(values) + self.log_likelihood(values, x, y, points)

    def unvalidated(self) -> LogJoint:
        """The same density with argument validation off in every prior (see ``svi_loss`` and ``potential``)."""
        return LogJoint(self.model, {n: unvalidated(d) for n, d in self.priors.items()}, self.dataset_size)


def build(model, dataset_size: int) -> LogJoint | None:
    """A :class:`LogJoint` for ``model``, or ``None`` where the fast path does not apply (a Pyro
    function, a hierarchical prior, a prior that is not a ``Distribution``, BatchNorm)."""
    if not isinstance(model, BNN) or model.hyper_names:
        return None
    if any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.net.modules()):
        return None  # its running statistics change in training mode: keep Pyro's path
    priors = {}
    for name in model.sample_names:
        owner_path, _, attr = name.rpartition(".")
        prior = model.net.get_submodule(owner_path).__dict__["_pyro_samples"].get(attr)
        if not isinstance(prior, Distribution):
            return None
        priors[name] = prior
    for name, prior in model.likelihood.sites().items():
        if not isinstance(prior, Distribution):
            return None
        priors[name] = prior
    return LogJoint(model, priors, dataset_size)


def point_params(model: BNN) -> dict[str, torch.Tensor]:
    """The deterministic parameters as SVI learns them (their ``pyro.param`` values)."""
    with pyro_context(model.net):
        return {name: attrgetter(name)(model.net) for name in model.point_names}


def svi_loss(joint: LogJoint, guide, num_particles: int = 1):
    """The negative ELBO of an ``AutoNormal`` or ``AutoDelta`` guide as ``loss(x, y) -> (loss, value)``,
    the same estimator as ``Trace_ELBO`` (``num_particles`` draws averaged), or ``None`` for any
    other guide."""
    from pyro.infer import autoguide

    if not isinstance(guide, (autoguide.AutoNormal, autoguide.AutoDelta)):
        return None
    normal = isinstance(guide, autoguide.AutoNormal)
    transforms = {name: biject_to(d.support) for name, d in joint.priors.items()}
    transforms = {name: None if is_identity(t) else t for name, t in transforms.items()}
    shape = torch.Size([num_particles]) if num_particles > 1 else torch.Size()
    # argument validation off: the data were checked when the fit started and the guide's draws lie in
    # the supports by construction, so a check of every density at every step would only add work.
    # A NaN from a diverging optimization still stops the fit (svi checks that the loss is finite).
    joint = joint.unvalidated()
    # a Linear-and-elementwise stack with Normal priors and a Gaussian likelihood: the analytic gradient
    # (bnn_pyro.infer._analytic); it declines at the first call where it does not apply
    analytic = [
        _analytic_elbo.mean_field_loss(joint, guide, num_particles, autoguide_loc_scale, pyro_context)
        if normal
        else None
    ]

    def loss(x, y):
        if guide.prototype_trace is None:
            autoguide_setup(guide, x, y, dataset_size=joint.dataset_size)
        with pyro.validation_enabled(False):
            if analytic[0] is not None:
                out = analytic[0](x, y)
                if out is not None:
                    return out
                analytic[0] = None
            return _loss(x, y)

    def _loss(x, y):
        values, elbo = {}, 0.0
        with pyro_context(guide):
            for name, _d in joint.priors.items():
                event_dim = joint._event_dims[name]
                if not normal:  # a point mass: no entropy, no Jacobian (the value lives on the support)
                    values[name] = attrgetter(name)(guide)
                    continue
                loc, scale = autoguide_loc_scale(guide, name)
                q = dist.Normal(loc, scale).to_event(event_dim)
                z = q.rsample(shape)
                t = transforms[name]
                values[name] = w = z if t is None else t(z)
                if t is not None:
                    elbo = elbo + sum_rightmost(t.log_abs_det_jacobian(z, w), event_dim)
                elbo = elbo - q.log_prob(z)
            points = point_params(joint.model)
        elbo = elbo + joint(values, x, y, points)
        value = -elbo.mean() if num_particles > 1 else -elbo
        return value, value.detach().item()

    return loss


def potential(joint: LogJoint, transforms: dict, x: torch.Tensor, y: torch.Tensor, *, jit: bool = False):
    """``U(z) = -log p(T^-1(z), y | x) - log|det J|``: Pyro's potential energy in the unconstrained
    coordinates given by ``transforms`` (site -> constrained-to-unconstrained map, as returned by
    Pyro's ``initialize_model``); deterministic parameters stay fixed at the model's values. Metropolis's
    potential on the fast path (it takes no gradient, so the analytic potential's gain, a hand-written backward,
    does not apply). ``jit=True`` compiles it with ``torch.jit.trace`` at the first call (the data and site shapes
    are fixed, as in MCMC), which removes the torch.distributions and ``functional_call`` overhead of every call."""
    energy = Energy(joint, transforms, x, y)
    return _traced(energy) if jit else energy


def analytic(joint: LogJoint, names, shapes: dict, x: torch.Tensor, y: torch.Tensor):
    """The analytic potential of :mod:`bnn_pyro.infer._analytic` over a flat vector laid out as ``names``/``shapes``,
    checked against the generic potential at a probe point, or ``None`` where it does not apply."""
    inverse = {n: biject_to(d.support).inv for n, d in joint.priors.items()}
    return _analytic.build(joint, names, shapes, x, y, reference=Energy(joint, inverse, x, y))


def flat_potential_and_grad(
    joint: LogJoint,
    transforms: dict,
    x: torch.Tensor,
    y: torch.Tensor,
    shapes: dict[str, torch.Size],
    *,
    compile: bool = True,
):
    """``theta -> (U(theta), grad U(theta))`` over ONE flat vector that holds the sites of ``shapes`` (name ->
    unconstrained shape) in that order: the potential of :func:`potential` and its gradient in one call.

    Sites next to each other in ``theta`` whose priors are the same elementwise distribution with one
    scalar parameter set (``Normal(0, 1)`` on every weight, the usual case) and need no transform
    are scored by ONE ``log_prob`` over their slice of ``theta`` rather than one per site.

    ``compile=True`` records the value and the gradient together as one graph of tensor operations
    (``make_fx`` of ``torch.func.grad_and_value``: no autograd tape at run time), then freezes it with
    TorchScript (constants such as the data and the prior's parameters folded in): no tracing of the model and
    no autograd tape per call (``benchmarks/performance.py`` compares it with a traced potential plus
    ``autograd.grad`` and with the eager one). Where the model cannot be recorded that way (a ``Conv1d`` or
    ``LayerNorm`` layer), it warns and falls back to the energy traced by ``torch.jit.trace`` and differentiated by
    autograd (what Pyro's HMC ran on such nets: ``benchmarks/results/hmc_fast_path_ab/``), where that gives the
    eager values, else to the eager gradient (same values)."""
    energy = Energy(joint, transforms, x, y)
    names, sizes = list(shapes), [int(torch.Size(s).numel()) for s in shapes.values()]
    runs = energy.prior_runs(names, sizes)

    def flat_energy(theta: torch.Tensor) -> torch.Tensor:
        z = {n: part.reshape(shapes[n]) for n, part in zip(names, theta.split(sizes))}
        return energy(z, theta=theta, runs=runs)

    return FlatPotential(flat_energy, compile=compile)


class FlatPotential:
    """``potential(theta) -> (U, grad U)`` and a whole leapfrog step :meth:`leapfrog`, each compiled at
    its first call when ``compile`` (see :func:`flat_potential_and_grad`), else eager (autograd)."""

    def __init__(self, energy, *, compile: bool = True):
        self.energy, self.compile = energy, compile
        self._gradient = self._step = None

    def eager(self, theta: torch.Tensor):
        with torch.enable_grad():  # NUTS runs its transitions under no_grad
            theta = theta.detach().requires_grad_()
            value = self.energy(theta)
            (grad,) = torch.autograd.grad(value, theta)
        return value.detach(), grad

    def __call__(self, theta: torch.Tensor):
        if not self.compile:
            return self.eager(theta)
        if self._gradient is None:
            self._gradient = _compiled(
                torch.func.grad_and_value(self.energy),
                (theta.detach(),),
                lambda t: self.eager(t)[::-1],
                "the potential's gradient",
                fallback=self._traced_gradient,
            )
        grad, value = self._gradient(theta.detach())
        return value, grad

    def _traced_gradient(self, theta: torch.Tensor):
        """``theta -> (grad U, U)`` by autograd through the energy traced by TorchScript at ``theta``: the
        fallback of a gradient that cannot be recorded as one graph (:func:`_compiled` checks it)."""
        with recording():
            traced = torch.jit.trace(self.energy, (theta.detach(),), check_trace=False)

        def gradient(t: torch.Tensor):
            with torch.enable_grad():
                t = t.detach().requires_grad_()
                value = traced(t)
                (grad,) = torch.autograd.grad(value, t)
            return grad, value.detach()

        return gradient

    def leapfrog(self, z, p, g, step, inverse_mass):
        """One velocity-Verlet step of (signed, 0-dim tensor) size ``step`` from ``(z, p)`` with gradient
        ``g`` under the inverse mass matrix ``inverse_mass`` (a vector: diagonal; a matrix: dense).
        Returns ``(z, p, g, M^-1 p, tensor([U, kinetic energy]))`` at the new point; compiled, the
        whole step is one graph (the vector operations around the gradient are not dispatched one by one)."""
        if not torch.is_tensor(step):
            step = torch.tensor(step, dtype=z.dtype, device=z.device)
        if not self.compile:
            return _leapfrog(lambda t: self.eager(t)[::-1], z, p, g, step, inverse_mass)
        if self._step is None:
            self._step = _compiled(
                partial(_leapfrog, torch.func.grad_and_value(self.energy)),
                (z, p, g, step, inverse_mass),
                partial(_leapfrog, lambda t: self.eager(t)[::-1]),
                "the leapfrog step",
                fallback=lambda *args: partial(_leapfrog, self._traced_gradient(args[0])),
            )
        return self._step(z, p, g, step, inverse_mass)


def _leapfrog(gradient, z, p, g, step, inverse_mass):
    """:meth:`FlatPotential.leapfrog` with ``gradient(z) -> (grad U, U)``."""
    sharp = (lambda v: inverse_mass @ v) if inverse_mass.dim() == 2 else (lambda v: inverse_mass * v)
    p = p - (0.5 * step) * g
    z = z + step * sharp(p)
    g, u = gradient(z)
    p = p - (0.5 * step) * g
    p_sharp = sharp(p)
    return z, p, g, p_sharp, torch.stack([u, 0.5 * p.dot(p_sharp)])


class Energy:
    """The potential energy of :func:`potential` as ``energy(z)`` (site -> unconstrained value); with
    ``theta`` and ``runs`` (:meth:`prior_runs`) the runs' sites are scored on slices of ``theta``."""

    def __init__(self, joint: LogJoint, transforms: dict, x: torch.Tensor, y: torch.Tensor):
        self.inverse = {
            name: None if is_identity(transforms.get(name)) else transforms[name].inv for name in joint.priors
        }
        self.points, self.x, self.y = joint.model.point_values(), x, y
        # validation off, as on Pyro's path: a diverging trajectory's NaN gives a NaN energy (a rejected
        # proposal), not a ValueError from a distribution
        self.joint = joint.unvalidated()

    def __call__(
        self,
        z: dict[str, torch.Tensor],
        theta: torch.Tensor | None = None,
        runs=(),
        *,
        batch: tuple | None = None,
        points: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``U(z)`` on the bound data, or on ``batch = (x, y)`` (the likelihood scaled by ``N / len(x)``), with the
        deterministic parameters at ``points`` (default: their values when this was built)."""
        x, y = (self.x, self.y) if batch is None else batch
        points = self.points if points is None else points
        with pyro.validation_enabled(False):
            joint, values, log_det = self.joint, {}, 0.0
            for name, t in self.inverse.items():
                if t is None:
                    values[name] = z[name]
                    continue
                values[name] = t(z[name])
                log_det = log_det + sum_rightmost(
                    t.log_abs_det_jacobian(z[name], values[name]), joint._event_dims[name]
                )
            scored = {name for _, _, run_names, _ in runs for name in run_names}
            log_prior = sum(d.log_prob(theta[a:b]).sum() for a, b, _, d in runs)
            log_prior = log_prior + sum(d.log_prob(values[n]) for n, d in joint.priors.items() if n not in scored)
            return -(log_prior + joint.log_likelihood(values, x, y, points) + log_det)

    def prior_runs(self, names: list[str], sizes: list[int]) -> list[tuple[int, int, tuple[str, ...], Distribution]]:
        """``(start, stop, site names, scalar prior)`` for each run of adjacent sites in a flat vector
        laid out as ``names``/``sizes`` that share one scalar elementwise prior and need no transform."""
        runs, start = [], 0
        for name, size in zip(names, sizes):
            scalar = _scalar_prior(self.joint.priors[name]) if self.inverse[name] is None else None
            if scalar is not None and runs and runs[-1][1] == start and _same(runs[-1][3], scalar):
                a, _, run_names, d = runs[-1]
                runs[-1] = (a, start + size, run_names + (name,), d)
            elif scalar is not None:
                runs.append((start, start + size, (name,), scalar))
            start += size
        return runs


def is_identity(t) -> bool:
    """Whether ``t`` (a transform, or None) leaves values unchanged, with no Jacobian."""
    transforms = torch.distributions.transforms
    while isinstance(t, (transforms.IndependentTransform, transforms._InverseTransform)):
        t = t.inv if isinstance(t, transforms._InverseTransform) else t.base_transform
    return t is None or (isinstance(t, transforms.ComposeTransform) and not t.parts)


def _scalar_prior(d: Distribution) -> Distribution | None:
    """``d``'s elementwise distribution with scalar parameters, when every element of ``d`` has the same
    one (``Normal(0, 1)`` expanded over a weight matrix); checked to give ``d``'s density; else None."""
    base = d.base_dist if isinstance(d, torch.distributions.Independent) else d
    if base.event_shape or type(base).__init__ is Distribution.__init__:
        return None
    params = {k: base.__dict__.get(k) for k in base.arg_constraints}
    if not params or not all(torch.is_tensor(v) and (v.numel() == 1 or not any(v.stride())) for v in params.values()):
        return None
    try:
        scalar = type(base)(**{k: v.reshape(-1)[0] for k, v in params.items()}, validate_args=False)
        # a fixed probe on the real line (only sites without a transform are grouped), elementwise
        probe = torch.linspace(
            -3.0,
            3.0,
            base.batch_shape.numel(),
            dtype=params[next(iter(params))].dtype,
            device=params[next(iter(params))].device,
        ).reshape(base.batch_shape)
        same = torch.allclose(scalar.log_prob(probe), base.log_prob(probe), rtol=1e-6, atol=1e-6)
    except Exception:  # noqa: BLE001 - a distribution these arguments do not build: score it per site
        return None
    return scalar if same else None


def _same(a: Distribution, b: Distribution) -> bool:
    return type(a) is type(b) and all(torch.equal(getattr(a, k), getattr(b, k)) for k in a.arg_constraints)


def _compiled(fn, args: tuple, eager, what: str, *, fallback=None):
    """``fn(*tensors) -> tuple of tensors`` recorded as one graph of tensor operations (``make_fx``: any
    ``torch.func.grad_and_value`` inside becomes plain operations, no autograd tape at run time), traced
    and frozen by TorchScript (constants folded in), and checked against ``eager`` at ``args`` and at a
    perturbation of the first argument (a recording fixes any value-dependent Python branch). Where ``make_fx``
    refuses ``fn`` (a Python branch on a tensor's value, which a TorchScript trace would freeze at the branch ``args``
    take and two nearby points need not reveal: review 20) it warns and returns ``eager``; where a later stage fails
    (TorchScript on a Conv1d or LayerNorm graph) it warns once and returns ``fallback(*args)`` (a slower version, e.g.
    a traced energy differentiated by autograd) where given and it passes the same check, else ``eager``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = tuple(a.detach() for a in args)
    first = args[0]
    g = torch.Generator(device=first.device).manual_seed(0)
    noise = 0.1 * torch.randn(first.shape, generator=g, device=first.device, dtype=first.dtype)
    points = [args, (first + noise,) + args[1:]]
    expected = [eager(*a) for a in points]

    def checked(graphs):
        for graph in graphs:
            try:
                if all(_close(graph(*a), e) for _ in range(2) for a, e in zip(points, expected)):
                    return graph
            except RuntimeError:
                continue
        raise RuntimeError("the compiled graph's values differ from the eager ones")

    try:
        recorded = make_fx(fn)(*args)
    except Exception as err:  # noqa: BLE001 - e.g. a branch on a tensor's value: TorchScript would freeze it too
        warn(
            f"fast path: could not compile {what} ({type(err).__name__}: {err}); using the eager version (slower, "
            "same values).",
            RuntimeWarning,
        )
        return eager
    try:
        with recording():
            module = torch.jit.freeze(torch.jit.trace(_Call(recorded), args, check_trace=False).eval())
        # TorchScript optimizes a graph at its second call; its shape analysis has failed on some frozen
        # graphs (a net with deterministic biases), so check two calls each, else run it unoptimized (~7% slower)
        return checked((module.forward, _unoptimized(module.forward)))
    except Exception as err:  # noqa: BLE001 - any failure to record: the eager version still works
        reason = f"{type(err).__name__}: {err}"
    used, version = eager, "the eager version"
    if fallback is not None:
        try:
            used, version = checked((fallback(*args),)), "the traced energy differentiated by autograd"
        except Exception:  # noqa: BLE001 - neither recorded nor traced: the eager version still works
            pass
    warn(f"fast path: could not compile {what} ({reason}); using {version} (slower, same values).", RuntimeWarning)
    return used


@contextlib.contextmanager
def recording():
    """Silences, while TorchScript records a graph, its ``TracerWarning``s (a recording fixes Python branches:
    :func:`_compiled` checks the graph against the eager values) and torch 2.13's deprecation of
    ``torch.jit.trace`` (``trace_method`` when tracing a module) and ``torch.jit.freeze``, and nothing else.
    TorchScript stays because no supported path keeps its speed: the same ``make_fx`` graph run by ``torch.fx`` and
    the eager gradient are several times slower per call, and ``torch.compile`` matches it only after a compile of
    seconds in every chain's process (measured for issues 6 and 15; ``benchmarks/performance.py``). So setup.cfg
    bounds torch below 2.14: torch deprecates TorchScript, and a later release may drop what this path uses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.(trace|trace_method|freeze)` is deprecated", category=DeprecationWarning
        )
        yield


def _unoptimized(method):
    def call(*args):
        with torch.jit.optimized_execution(False):
            return method(*args)

    return call


def _close(found, expected) -> bool:
    return all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5 * (1.0 + float(b.nan_to_num().abs().max())), equal_nan=True)
        for a, b in zip(found, expected)
    )


class _Call(torch.nn.Module):
    """A module around a function, so that TorchScript can freeze it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _traced(fn):
    """``fn(dict of tensors)`` compiled by ``torch.jit.trace`` on its first call."""
    compiled = {}

    def call(z: dict[str, torch.Tensor]) -> torch.Tensor:
        if not compiled:
            names = list(z)
            with recording():
                graph = torch.jit.trace(
                    lambda *v: fn(dict(zip(names, v))), tuple(z[n].detach() for n in names), check_trace=False
                )
            compiled.update(names=names, graph=graph)
        return compiled["graph"](*(z[n] for n in compiled["names"]))

    return call
