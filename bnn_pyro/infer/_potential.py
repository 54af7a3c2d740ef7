"""The potential energy of any model on minibatches, for engines that move the weights themselves.

SG-MCMC, SWA/SWAG, ensembles and Laplace need ``U(w) = -log p(w) - (N/B) sum_{i in B} log p(y_i | x_i, w)``
as a differentiable function of the latent sites. This is Pyro's own potential energy
(:func:`pyro.infer.mcmc.util.initialize_model`: the model conditioned on the values, traced, its
log-density summed, plus the log-Jacobians of the maps to unconstrained space), built once and
pointed at a new minibatch per call. It serves a :class:`~bnn_pyro.BNN` and a Pyro function alike.

Example
-------
>>> pot = Potential(model, data, init="net")
>>> z = {k: v.clone().requires_grad_() for k, v in pot.init.items()}   # unconstrained values
>>> u = pot(z, data.first())          # -log joint of that batch, likelihood scaled by N / B
>>> u.backward()
>>> draws = pot.constrain(z)           # values on each site's support (e.g. positive noise scales)

The fast path. Tracing Pyro costs milliseconds of Python per call; where :func:`bnn_pyro.infer._logjoint.build`
accepts the model (a ``BNN`` without hierarchical priors or BatchNorm) the same ``U`` is evaluated without Pyro:

- ``path == "analytic"``: a stack of ``nn.Linear`` layers and elementwise activations, Normal priors, a Gaussian
  likelihood and no deterministic parameters: value and gradient by hand (:mod:`bnn_pyro.infer._analytic`), as
  one ``torch.autograd.Function`` (data that require a gradient, e.g. adversarial inputs, take the
  ``"logjoint"`` path). A gradient taken with ``create_graph=True`` (Hessian-vector products: SG-MCMC's
  and SWAG's step-size rules) is recomputed by autograd through the ``"logjoint"`` path, so that second
  derivatives are exact too.
- ``path == "logjoint"``: :class:`~bnn_pyro.infer._logjoint.LogJoint` in torch (eager, autograd): the same sites,
  densities, log-Jacobians and ``N / B`` scaling; the net runs through ``functional_call`` as on Pyro's path, so a
  stochastic module (``nn.Dropout`` in training mode) draws its masks from the same generator in the same order.
  Deterministic parameters are read as Pyro reads them (``pyro.param`` in the net's Pyro context), so they get
  gradients and a caller's ``poutine.trace(param_only=True)`` still finds them.
- ``path == "pyro"``: Pyro's traced potential, for everything else or with ``fast_path=False``.

The fast path is checked against Pyro's at the starting point on the first batch (value and gradient) when it is
built; where they disagree it warns and keeps Pyro's. ``tests/infer/test_potential.py`` checks values, gradients and
Hessian-vector products against Pyro's, and that every engine built on this class draws the same with either path.
"""

from __future__ import annotations

import math

import torch
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _analytic, _logjoint
from bnn_pyro.infer._common import Data, init_strategy, quiet_model
from bnn_pyro.utils.checks import flag
from bnn_pyro.utils.user_warnings import warn

__all__ = ["Potential", "Potentials", "dense_precision", "newton_mode"]


class Potential:
    """``U(z; batch)``: the negative log joint density in unconstrained coordinates ``z``.

    Parameters
    ----------
    model:
        A ``BNN`` or a Pyro function model following the site conventions.
    data:
        The fit's :class:`~bnn_pyro.infer._common.Data`; ``dataset_size`` scales minibatch likelihoods.
    init:
        Initial values (see :func:`~bnn_pyro.infer._common.init_strategy`); ``"net"`` starts from a
        BNN's current weights.
    fast_path:
        ``True`` (default): evaluate ``U`` without tracing Pyro where the model allows it (see the module
        docstring); ``False``: always Pyro's traced potential.

    Attributes
    ----------
    path:
        Which evaluation runs: ``"analytic"``, ``"logjoint"`` or ``"pyro"`` (:attr:`fast_path` is whether it is
        one of the first two).
    init:
        Initial unconstrained values, one tensor per latent site.
    transforms:
        Site name -> the bijection from constrained to unconstrained space.
    shapes:
        Site name -> shape, in a fixed order (that of :meth:`flatten`).
    """

    def __init__(self, model, data: Data, *, init="net", fast_path: bool = True):
        self._batch = data.first()
        run = quiet_model(model, data.size)

        def bound():
            return run(*self._batch)

        self.init, self._pyro, self.transforms, _ = initialize_model(
            bound, model_args=(), init_strategy=init_strategy(model, init)
        )
        self.init = {k: v.detach() for k, v in self.init.items()}
        self.shapes = {k: v.shape for k, v in self.init.items()}
        self._fast = _FastEnergy.build(model, data.size, self) if fast_path else None
        self.path = "pyro" if self._fast is None else self._fast.path

    @property
    def fast_path(self) -> bool:
        """Whether ``U`` is evaluated without tracing Pyro (:attr:`path` ``"analytic"`` or ``"logjoint"``)."""
        return self._fast is not None

    @property
    def stack(self) -> _analytic.StackPotential | None:
        """The analytic potential over :meth:`flatten`'s layout where :attr:`path` is ``"analytic"``, else ``None``
        (Laplace's curvature step reads the net from it: :mod:`bnn_pyro.infer._analytic_ggn`)."""
        return None if self._fast is None else self._fast.stack

    def __call__(self, z: dict[str, torch.Tensor], batch: tuple | None = None) -> torch.Tensor:
        """``U(z)`` on ``batch`` (``(x, y)``), or on the last batch given."""
        if batch is not None:
            self._batch = batch
        return self._energy(z)

    def _energy(self, z: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._pyro(z) if self._fast is None else self._fast(z, self._batch)

    def constrain(self, z: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map unconstrained values (with any leading batch dims) to each site's support."""
        return {k: self.transforms[k].inv(v) if k in self.transforms else v for k, v in z.items()}

    def unconstrain(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.transforms[k](v) if k in self.transforms else v for k, v in values.items()}

    # ------------------------------------------------------------------ flat vectors
    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def flatten(self, z: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate the sites (in :attr:`shapes` order) into ``(..., dim)``; leading dims kept."""
        parts = []
        for k, shape in self.shapes.items():
            v = z[k]
            parts.append(v.reshape(v.shape[: v.dim() - len(shape)] + (-1,)))
        return torch.cat(parts, dim=-1)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`flatten` for ``flat`` shaped ``(..., dim)``."""
        out, i = {}, 0
        lead = flat.shape[:-1]
        for k, shape in self.shapes.items():
            n = math.prod(shape)
            out[k] = flat[..., i : i + n].reshape(lead + shape)
            i += n
        return out

    def flat_fn(self, batch: tuple | None = None):
        """``U`` as a function of one flat vector (for Hessians and flat-space samplers)."""
        if batch is not None:
            self._batch = batch
        return lambda flat: self._energy(self.unflatten(flat))


def dense_precision(fn, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(H, L)``: the Hessian of the scalar function ``fn`` of one flat vector at ``z`` (autograd, ``z.numel()``
    gradient passes; float64, symmetrized) and its lower Cholesky factor ``L`` (``H = L L^T``), or ``L = None`` where
    ``H`` is not finite or not positive definite (a saddle, a flat direction: no Gaussian fits there). The precision
    of the Laplace approximation when ``fn`` is a potential ``U`` and ``z`` its mode (MacKay 2003, ch. 27)."""
    hess = torch.autograd.functional.hessian(fn, z).double()
    hess = (hess + hess.T) / 2
    if not bool(torch.isfinite(hess).all()):
        return hess, None
    chol, info = torch.linalg.cholesky_ex(hess)
    return hess, (chol if int(info) == 0 else None)


def newton_mode(fn, z: torch.Tensor, *, steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Up to ``steps`` Newton steps on ``fn`` (a potential of one flat vector) from ``z``, each halved until ``fn``
    does not rise: ``(z, H)``, the point reached and the Hessian there (:func:`dense_precision`), or ``(z, None)``
    where the Hessian is not positive definite (not a mode). A first-order search in float32 stops early on a badly
    conditioned posterior (a coefficient of a covariate near 100 beside an intercept); Newton's step is invariant
    to the coordinates' scales, so a few steps from near the mode reach it to float precision. A step that leaves
    ``z`` unchanged (below its float resolution) ends the search: every further step would recompute the same Hessian
    and factor, and the result is the same."""
    hess = None
    for _ in range(steps + 1):
        hess, chol = dense_precision(fn, z)
        if chol is None:
            return z, None
        x = z.detach().clone().requires_grad_()
        value = fn(x)
        (grad,) = torch.autograd.grad(value, x)
        step = torch.cholesky_solve(grad.double()[:, None], chol)[:, 0].to(z)
        if not bool(torch.isfinite(step).all()) or float(step.abs().max()) == 0.0:
            break
        for _ in range(20):
            trial = z - step
            with torch.no_grad():
                trial_value = fn(trial)
            if bool(torch.isfinite(trial_value)) and float(trial_value) <= float(value.detach()):
                break
            step = step / 2
        else:
            break
        if torch.equal(trial, z):  # a fixed point: hess is already the Hessian at z
            break
        z = trial.detach()
    return z, hess


class Potentials:
    """The potentials of one fit, built with its ``fast_path`` option, and which path they took.

    Every engine built on :class:`Potential` takes ``fast_path: bool = True`` and builds its potentials with
    ``paths(model, data, init=...)``; after the fit, :meth:`record` writes ``config["fast_path"]`` (whether every
    potential built took the fast path) and ``config["potential"]`` (their :attr:`Potential.path`, distinct paths
    joined by ``"+"``, e.g. ``"analytic"``). The chains of a fit run in this process
    (:func:`~bnn_pyro.infer.contract.drive`), so every chain's potential is counted.
    """

    def __init__(self, fast_path: bool = True):
        self.fast_path = flag("fast_path", fast_path)
        self.paths: list[str] = []

    def __call__(self, model, data: Data, *, init="net") -> Potential:
        pot = Potential(model, data, init=init, fast_path=self.fast_path)
        self.paths.append(pot.path)
        return pot

    def record(self, config: dict, *stages: dict) -> dict:
        """``config`` with ``"fast_path"`` and ``"potential"`` set (see the class docstring); returned. The configs
        of sub-fits (``stages``, e.g. subspace inference's SWA and inner runs) count too: ``"fast_path"`` is then
        whether this fit's potentials and every stage ran on the fast path, and ``"potential"`` is left to them."""
        seen = list(dict.fromkeys(self.paths))
        flags = [path != "pyro" for path in seen] + [bool(stage.get("fast_path")) for stage in stages]
        config["fast_path"] = bool(flags) and all(flags)
        if seen and not stages:
            config["potential"] = "+".join(seen)
        return config


class _FastEnergy:
    """``U(z; batch)`` without Pyro: the analytic potential or the generic :class:`~bnn_pyro.infer._logjoint.LogJoint`
    (see the module docstring); :meth:`build` returns ``None`` where neither applies or they disagree with Pyro."""

    def __init__(self, model, generic, stack):
        self.model, self.generic, self.stack = model, generic, stack
        self.path = "logjoint" if stack is None else "analytic"
        self.names = list(stack._order) if stack is not None else None

    @classmethod
    def build(cls, model, dataset_size: int, pot: Potential) -> _FastEnergy | None:
        joint = _logjoint.build(model, dataset_size)
        if joint is None or set(joint.priors) != set(pot.shapes):
            return None
        x, y = pot._batch
        if y is None:
            return None
        generic = _logjoint.Energy(joint, pot.transforms, x, y)
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda(pot.init)):
            if generic(pot.init).dim():  # targets that broadcast against the outputs (y (N, 1) for f[..., 0])
                return None  # keep Pyro's path, whatever it makes of them
        stack = None
        if not model.point_names:  # the analytic potential holds deterministic parameters as constants
            names = list(pot.shapes)
            stack = _analytic.build(joint, names, pot.shapes, x, y, reference=generic)
        fast = cls(model, generic, stack)
        return fast if fast._agrees(pot) else None

    def __call__(self, z: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
        if self.stack is None or any(isinstance(t, torch.Tensor) and t.requires_grad for t in batch):
            return self._generic(z, batch)  # a gradient in the data (adversarial training): autograd's
        theta = torch.cat([z[n].reshape(-1) for n in self.names])
        if not theta.requires_grad:
            return self.stack(theta, *batch)[0]
        return _Analytic.apply(theta, self, *batch)

    def _generic(self, z, batch) -> torch.Tensor:
        # deterministic parameters read as Pyro reads them: pyro.param values, with gradients
        points = _logjoint.point_params(self.model) if self.model.point_names else None
        return self.generic(z, batch=batch, points=points)

    def _generic_flat(self, theta: torch.Tensor, batch) -> torch.Tensor:
        sizes = [self.stack._slots[n][1] - self.stack._slots[n][0] for n in self.names]
        z = {n: part.reshape(self.stack._slots[n][2]) for n, part in zip(self.names, theta.split(sizes))}
        return self._generic(z, batch)

    def _agrees(self, pot: Potential) -> bool:
        """Value and gradient equal Pyro's at the starting point on the first batch (under the same random state,
        for a net that draws dropout masks); else warn: the caller keeps Pyro's path."""
        z = {k: v.clone().requires_grad_() for k, v in pot.init.items()}
        results = []
        for fn in (pot._pyro, lambda v: self(v, pot._batch)):
            with torch.random.fork_rng(devices=_cuda(z)):
                u = fn(z)
                grads = torch.autograd.grad(u, list(z.values()), allow_unused=True)
            results.append([u.detach()] + [torch.zeros_like(v) if g is None else g for g, v in zip(grads, z.values())])
        dtype = next(iter(z.values())).dtype
        tol = 1e-9 if dtype == torch.float64 else 1e-4  # as _analytic's own check
        scale = 1.0 + max(float(t.abs().max()) for t in results[0])
        ok = all(bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * scale for a, b in zip(*results))
        if not ok:
            warn(
                "Potential: the fast log density disagrees with Pyro's on this model at the starting point; "
                "using Pyro's traced potential (same values, slower). Please report this model.",
                RuntimeWarning,
            )
        return ok


def _cuda(values: dict[str, torch.Tensor]) -> list[torch.device]:
    """The CUDA device of ``values`` (whose random state a check must leave as it found it), if any."""
    return [v.device for v in values.values() if v.device.type == "cuda"][:1]


class _Analytic(torch.autograd.Function):
    """``U(theta)`` of the analytic potential; its backward returns the gradient computed with it. Under
    ``create_graph=True`` (a Hessian-vector product follows) the gradient is recomputed by autograd through the
    generic potential, so that it is itself differentiable (the analytic one is a constant to autograd)."""

    @staticmethod
    def forward(ctx, theta, fast, x, y):
        u, grad = fast.stack(theta.detach(), x, y)
        ctx.save_for_backward(theta)
        ctx.fast, ctx.batch, ctx.grad = fast, (x, y), grad
        return u

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # create_graph=True
            (theta,) = ctx.saved_tensors
            u = ctx.fast._generic_flat(theta, ctx.batch)
            (grad,) = torch.autograd.grad(u, theta, create_graph=True)
        else:
            grad = ctx.grad
        return grad_output * grad, None, None, None
