"""SVI's flat fast path: a mean-field guide over the analytic potential as two flat tensors and one lean loop.

Where :mod:`bnn_pyro.infer._analytic` covers the model (a stack of ``nn.Linear`` layers and elementwise activations,
Normal priors, a Gaussian likelihood) and the guide is ``AutoNormal``, an SVI chain keeps the guide's parameters as
ONE flat tensor of means ``loc`` and ONE of unconstrained scales ``rho`` (``scale = softplus(rho)``, AutoNormal's
constraint) and takes each step without Pyro, without autograd and without a Python loop over parameters:

* the noise ``eps`` is drawn per site in the site order into a preallocated buffer, with the same generator calls as
  ``AutoNormal`` (the same draws for the same seed as Pyro's path);
* the negative ELBO and its gradient in ``(loc, scale)`` come from :func:`bnn_pyro.infer._analytic_elbo.negative_elbo`
  (Pyro's ``Trace_ELBO`` estimator: the Monte Carlo ``log p(y, w) - log q(w)`` at ``w = loc + scale * eps``,
  particles averaged; with ``elbo="mean_field"`` the Normal priors' KL in closed form, as
  :class:`~bnn_pyro.infer.reparam.MeanFieldELBO`), the chain rule through ``softplus`` by ATen's
  ``softplus_backward`` (autograd's formula);
* one optimizer update over the two tensors (Adam and AdamW with their fused kernel where torch has one);
* the loss is written into a preallocated tensor, on the parameters' device; the non-finite stop reads it every step
  on the CPU and every :data:`CHECK_EVERY` steps on an accelerator (no host synchronisation per step there), naming
  the first step whose loss was not finite.

The values go back to Pyro's parameter store (so the guide, the draws and the :class:`~bnn_pyro.Posterior` are
unchanged) at every checkpoint and at the end; a resumed run reads them from the store, so checkpoint/resume stays
bit-identical. The update is the same as on Pyro's path but for the fused Adam kernel's float rounding.
:func:`drive` is :func:`bnn_pyro.infer.contract.drive` with this loop in place of the driver's for the chains
:meth:`FlatMeanField.of` accepts (``bp.fit(..., fast_path=False)`` keeps Pyro's path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pyro.distributions.transforms import SoftplusTransform
from pyro.infer import autoguide
from torch.distributions import transform_to

from bnn_pyro.infer import _analytic, _analytic_elbo, _logjoint, driver
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.checkpoint import CheckpointError
from bnn_pyro.infer.contract import Engine, Loop, run
from bnn_pyro.infer.driver import Resumable, assemble, run_chains
from bnn_pyro.infer.kl_warmup import kl_weight
from bnn_pyro.infer.optim import Optimizer, make_optimizer
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice

__all__ = ["FlatMeanField", "descend", "drive", "CHECK_EVERY"]

CHECK_EVERY = 50  # steps between the non-finite checks on an accelerator (every step on the CPU)

_SOFTPLUS_BETA, _SOFTPLUS_THRESHOLD = 1.0, 20.0  # torch.nn.functional.softplus's defaults (AutoNormal's constraint)


class FlatMeanField:
    """An ``AutoNormal`` guide's parameters as flat ``loc`` and ``rho`` (leaves, in the site order of its parameter
    store tensors ``locs``/``scales``), with :meth:`step` the analytic negative ELBO on the potential ``pot``
    (a :class:`~bnn_pyro.infer._analytic.StackPotential`). Build it with :meth:`of`."""

    def __init__(
        self,
        pot: _analytic.StackPotential,
        locs: list[torch.Tensor],
        scales: list[torch.Tensor],
        num_particles: int,
        analytic_kl: bool = False,
        warmup_steps: int = 0,
    ):
        self.pot, self._store, self.analytic_kl = pot, (locs, scales), analytic_kl
        self.warmup_steps, self.kl_weight = warmup_steps, 1.0  # kl_warmup: descend sets kl_weight per step
        self._sizes = [t.numel() for t in locs]
        with torch.no_grad():
            self.loc = torch.cat([t.reshape(-1) for t in locs]).requires_grad_()
            self.rho = torch.cat([t.reshape(-1) for t in scales]).requires_grad_()
        self.params = [self.loc, self.rho]
        lead = (num_particles,) if num_particles > 1 else ()
        self._eps = self.loc.new_empty(lead + self.loc.shape)
        if lead:  # each site's (P, size) block drawn in one call, then laid side by side
            self._blocks = list(
                self.loc.new_empty(num_particles * self.loc.numel()).split([num_particles * s for s in self._sizes])
            )
            self._blocks = [b.view(num_particles, -1) for b in self._blocks]
        else:
            self._blocks = list(self._eps.split(self._sizes))

    @classmethod
    def of(
        cls,
        joint: _logjoint.LogJoint | None,
        guide,
        num_particles: int,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        analytic_kl: bool = False,
        warmup_steps: int = 0,
    ) -> FlatMeanField | None:
        """The flat state of ``guide`` (set up: its parameters in the store) on ``joint``'s analytic potential, or
        ``None`` where this path does not apply (another guide or scale constraint, deterministic parameters, a
        model the analytic potential does not cover or disagrees with at its probe point). ``analytic_kl``: the
        estimator of ``elbo="mean_field"`` (closed-form KL, see :func:`~bnn_pyro.infer._analytic_elbo.negative_elbo`)
        instead of ``Trace_ELBO``'s; ``warmup_steps``: ``svi``'s KL warm-up (Trace_ELBO's estimator only, see
        :func:`~bnn_pyro.infer._analytic_elbo.negative_elbo`)."""
        if joint is None or joint.model.point_names or type(guide) is not autoguide.AutoNormal:
            return None
        if type(transform_to(guide.scale_constraint)) is not SoftplusTransform:
            return None
        names = list(joint.priors)
        stored = _analytic_elbo.store_params(names)
        if stored is None:
            return None
        locs, scales = stored
        pot = _logjoint.analytic(joint, names, {n: t.shape for n, t in zip(names, locs)}, x, y)
        if pot is None or (warmup_steps and analytic_kl):
            return None
        return cls(pot, locs, scales, num_particles, analytic_kl, warmup_steps)

    @staticmethod
    def covers(joint: _logjoint.LogJoint | None, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether :meth:`of` will build an ``AutoNormal`` guide's flat state on ``joint`` (before any guide
        exists: its sites' shapes are the priors'); SVI asks it to decide up front where a fit takes this path."""
        if joint is None or joint.model.point_names:
            return False
        shapes = {n: d.batch_shape + d.event_shape for n, d in joint.priors.items()}
        return _logjoint.analytic(joint, list(shapes), shapes, x, y) is not None

    @property
    def device(self) -> torch.device:
        return self.loc.device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The negative ELBO at a fresh draw on the batch ``(x, y)`` (a 0-dim tensor); sets ``loc.grad`` and
        ``rho.grad`` to its gradient."""
        with torch.no_grad():
            for block in self._blocks:  # AutoNormal's draws: torch.randn per site, in the site order
                block.normal_()
            eps = self._eps if self._eps.dim() == 1 else torch.cat(self._blocks, -1, out=self._eps)
            scale = F.softplus(self.rho, _SOFTPLUS_BETA, _SOFTPLUS_THRESHOLD)
            value, g_loc, g_scale = _analytic_elbo.negative_elbo(
                self.loc, scale, eps, self.pot, x, y, analytic_kl=self.analytic_kl, kl_weight=self.kl_weight
            )
            self.loc.grad = g_loc
            self.rho.grad = torch.ops.aten.softplus_backward(g_scale, self.rho, _SOFTPLUS_BETA, _SOFTPLUS_THRESHOLD)
        return value

    def weigh(self, step: int) -> FlatMeanField:
        """Set the KL weight for the 0-based ``step`` of the run (:func:`~bnn_pyro.infer.kl_warmup.kl_weight`)."""
        self.kl_weight = kl_weight(step, self.warmup_steps)
        return self

    def to_store(self) -> None:
        """Write ``loc``/``rho`` into the guide's parameters in Pyro's store."""
        with torch.no_grad():
            for flat, tensors in zip(self.params, self._store):
                for t, part in zip(tensors, flat.split(self._sizes)):
                    t.copy_(part.view_as(t))

    def from_store(self) -> None:
        """Read ``loc``/``rho`` from the guide's parameters in Pyro's store (after a checkpoint restored them)."""
        with torch.no_grad():
            for flat, tensors in zip(self.params, self._store):
                flat.copy_(torch.cat([t.reshape(-1) for t in tensors]))


def _optimizer(optimizer, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """:func:`~bnn_pyro.infer.optim.make_optimizer`'s optimizer, with Adam's and AdamW's fused kernel where this
    torch has one for the parameters' device and dtype (one operation for the whole update)."""
    if isinstance(optimizer, str):
        kind = choice("optimizer", optimizer, Optimizer)
        if kind in (Optimizer.ADAM, Optimizer.ADAMW):
            try:
                return (torch.optim.Adam if kind is Optimizer.ADAM else torch.optim.AdamW)(params, lr=lr, fused=True)
            except (RuntimeError, TypeError):  # no fused kernel here: the multi-tensor one
                pass
    return make_optimizer(optimizer, params, lr)


def _check_interval(device: torch.device) -> int:
    """Steps between the non-finite checks: every step on the CPU (reading a CPU tensor costs no synchronisation),
    :data:`CHECK_EVERY` on an accelerator."""
    return 1 if device.type == "cpu" else CHECK_EVERY


class _Synced:
    """A :class:`~bnn_pyro.infer.driver.Resumable` of the parameter store (SVI's) around a :class:`FlatMeanField`:
    saves see the flat values in the store, restores read them back."""

    def __init__(self, inner: Resumable, flat: FlatMeanField, path):
        self.inner, self.flat, self.path = inner, flat, path

    def restore(self, opt, sched, losses: torch.Tensor) -> int:
        try:
            step = self.inner.restore(opt, sched, losses)
        except CheckpointError:  # unreadable, or another run's: its own message
            raise
        except ValueError as err:  # an optimizer state over other tensors than (loc, scale)
            raise CheckpointError(
                f"resume: {str(self.path)!r} holds the optimizer state of another layout of this "
                f"run ({err}): it was written by another bnn_pyro version or path. Resume it with "
                "the version that wrote it, or delete it to start afresh."
            ) from None
        self.flat.from_store()
        return step

    def due(self, step: int, num_steps: int) -> bool:
        return self.inner.due(step, num_steps)

    def save(self, step: int, opt, sched, losses: torch.Tensor) -> None:
        self.flat.to_store()
        self.inner.save(step, opt, sched, losses)


def descend(
    flat: FlatMeanField, data: Data, loop: Loop, *, seed: int, index: int = 0, resumable: Resumable | None = None
) -> torch.Tensor:
    """:func:`bnn_pyro.infer.driver.descend` of ``flat`` on ``data``'s batches through its hooks for a hand-written
    gradient (:meth:`FlatMeanField.step` sets it; ``backward=False``) and a loss recorded on the parameters' device,
    checked every :func:`_check_interval` steps; ``loop``'s optimizer (fused Adam, see :func:`_optimizer`),
    schedule and progress bar. Returns the losses; the flat values go back to Pyro's parameter store."""
    opt = _optimizer(loop.optimizer, flat.params, loop.lr)
    if flat.warmup_steps:  # the KL weight of each step (kl_warmup), else 1 throughout

        def objective(batch, step):
            return None, flat.weigh(step).step(*batch)
    else:

        def objective(batch, step):
            return None, flat.step(*batch)

    losses = driver.descend(
        objective,
        flat.params,
        data,
        seed=seed,
        opt=opt,
        resumable=resumable,
        backward=False,
        check_every=_check_interval(flat.device),
        **loop.descend_options(index),
    )
    flat.to_store()
    return losses


def drive(
    model,
    data: Data,
    engine: Engine,
    loop: Loop,
    *,
    flat_of: Callable[[object], FlatMeanField | None],
    num_chains: int,
    seed: int,
    config: dict,
    checkpoints=None,
) -> Posterior:
    """:func:`bnn_pyro.infer.contract.drive` (one ``loss`` history per chain) where each chain whose state
    ``flat_of(state)`` turns into a :class:`FlatMeanField` descends by :func:`descend`; the others by the driver."""

    def one_chain(fitted, info):
        state = engine.init(fitted, info)
        ckpt = None if checkpoints is None else checkpoints[info.index]
        flat = flat_of(state)
        if flat is None:
            history = run(engine, state, data, loop, seed=info.seed, index=info.index, ckpt=ckpt)
        else:
            resumable = None if ckpt is None else _Synced(engine.checkpoint(state, ckpt, {}), flat, ckpt.path)
            history = {"loss": descend(flat, data, loop, seed=info.seed, index=info.index, resumable=resumable)}
        return engine.draws(state, history)

    runs = run_chains(model, num_chains, seed, one_chain, method=loop.method)
    return assemble(runs, method=loop.method, config=config, data=data)
