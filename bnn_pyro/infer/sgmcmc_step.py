"""The update that SG-MCMC and snapshot ensembles share, as a ``torch.optim.Optimizer`` (the optimizer of their
:class:`~bnn_pyro.infer.contract.Engine`): SGD with momentum plus Gaussian noise, its step size per step from a
:class:`Plan`, set from the curvature when ``lr="auto"`` and guarded in the noise-free steps; and the plans of
sgld/sghmc (:func:`langevin_plan`) and csgmcmc (:func:`cyclical_plan`) with the checks of their shared options.
The methods, their references and the choice of the step are described in :mod:`bnn_pyro.infer.sgmcmc`.

Example
-------
>>> z = pot.flatten(pot.init).clone().requires_grad_(True)          # one flat tensor of unconstrained sites
>>> opt = SGMCMC([z], plan=plan, lr=1e-3 / n, seed=0)                # lr: the step on U
>>> opt.zero_grad(); pot(pot.unflatten(z), batch).backward(); opt.step()
>>> opt.step_size                                                    # eta_t of that step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bnn_pyro.infer import optim
from bnn_pyro.infer.sg_metric import unwhiten, whiten

if TYPE_CHECKING:
    from bnn_pyro.infer._potential import Potential

__all__ = [
    "Plan",
    "SGMCMC",
    "GUARD",
    "ADAPT_EVERY",
    "SHRINK",
    "RISE",
    "MAX_RECOVERIES",
    "largest_curvature",
    "secant_curvature",
    "cosine_cycle",
    "langevin_plan",
    "cyclical_plan",
    "auto_fraction",
    "check_lr",
    "check_friction",
]

ADAPT_EVERY = 100  # lr="auto": steps between curvature estimates while the step may change
GUARD = 2.0  # lr="auto", exploration: re-estimate the curvature when eta_t * (secant curvature) > GUARD * fraction
RISE = 2.0  # lr="auto": a curvature estimate may raise the step at most this factor over the step it replaces
SHRINK = 0.25  # lr="auto", after a divergence: the step (and its cap from then on) times this
MAX_RECOVERIES = (
    8  # lr="auto": divergences a chain recovers from (the step then 4^-8 = 1.5e-5 of the first) before it stops
)


@dataclass(frozen=True)
class Plan:
    """Everything one chain does, step by step (``T`` steps).

    Attributes
    ----------
    scale:
        ``(T,)`` step-size multiplier: the step on ``U`` at step ``t`` is ``eta * scale[t]``.
    noisy:
        ``(T,)`` bool: add the Langevin noise at that step (False: exploration, i.e. SGD).
    keep:
        ``(T,)`` bool: store the state at the start of that step as a draw.
    adapt:
        ``(T,)`` bool: with ``lr="auto"``, set ``eta = fraction / lambda_max`` before that step.
    friction:
        ``alpha`` in (0, 1]: the fraction of the momentum removed per step (1: SGLD).
    fraction:
        ``eta * lambda_max`` that ``lr="auto"`` aims at.
    score_start:
        With held-out rows: whether a noise-free stage's first state competes for its best state (csgmcmc: True;
        a snapshot ensemble: False, so that a cycle's snapshot is never the previous cycle's, which it starts from).
    guard:
        ``(T,)`` bool: the steps where ``lr="auto"``'s stability guard runs (:class:`SGMCMC`); ``None``: the
        noise-free ones. sgld's and sghmc's plan guards every warm-up step too (their step may change there
        anyway), where the curvature can outgrow the last estimate before the next one (a learned noise falling).
    """

    scale: torch.Tensor
    noisy: torch.Tensor
    keep: torch.Tensor
    adapt: torch.Tensor
    friction: float
    fraction: float
    score_start: bool = True
    guard: torch.Tensor | None = None
    anchors: object = None  # (model, pot, batch, seed) -> (t -> the flat tilt g_t of step t), or None: plain U~
    weights: object = None  # (model, pot, batch, seed) -> (t -> the observation weights of step t: anchor.weighted's
    # dict by observed site), or None: every observation weighs 1 (snapshot ensembles' weighted cycles)
    metric: str | None = None  # lr="auto" on a small Pyro function: whiten by the curvature at the mode (sg_metric),
    # starting there ("mode"), at the chain's own start ("start") or at an over-dispersed draw from the Laplace
    # approximation there, N(mode, DISPERSION^2 H^-1) ("dispersed"); None: plain coordinates (a BNN, always)


class SGMCMC(torch.optim.Optimizer):
    """The shared update of :mod:`bnn_pyro.infer.sgmcmc` as a torch optimizer, one step per entry of a :class:`Plan`::

        v  <-  (1 - alpha) v  -  eta_t grad  +  N(0, 2 alpha eta_t I)   (the noise only where plan.noisy),
        z  <-  z + v,          eta_t = eta * plan.scale[t],  alpha = plan.friction,

    over one flat tensor ``z`` whose ``.grad`` is ``grad U~(z)``.

    Parameters
    ----------
    params:
        ``[z]``: one flat tensor (the unconstrained latent sites).
    plan:
        The chain's plan (step multipliers, noise, curvature estimates).
    lr:
        ``eta``, the step on ``U``; ``None`` (``lr="auto"``): set from ``curvature`` by :meth:`adapt` before the
        plan's ``adapt`` steps to ``plan.fraction / lambda`` (raised at most :data:`RISE`-fold per estimate), and lowered
        by the stability guard (see :mod:`bnn_pyro.infer.sgmcmc`) in the noise-free steps.
    seed:
        The noise comes from a generator of its own, seeded ``seed + 7919`` (apart from the minibatch stream and
        Pyro's generators); it also draws the power iteration's first vector.
    curvature:
        ``curvature(z, start, iters) -> (|lambda|_max, vector)``: the Hessian's largest absolute eigenvalue at
        ``z`` on the current minibatch by power iteration from ``start`` (needed with ``lr=None``).
    fallback:
        ``eta`` when the first estimate is not positive.
    guard_noisy:
        Whether the guard may run in noisy steps that ``plan.guard`` marks: only when the gradients are full-batch
        (a secant between two minibatches' gradients measures their noise, not the curvature).
    metric:
        ``L`` (lower triangular, ``L L^T = H`` at the mode; :mod:`bnn_pyro.infer.sg_metric`) or ``None``: with it the
        update runs in the whitened coordinates ``u = L^T z`` (the gradient ``L^{-1} grad``, the momentum and noise
        in ``u``, ``z`` moved by ``L^{-T} v``; the guard's secant in ``u``), i.e. preconditioned by ``M = H^{-1}``;
        ``curvature`` must then measure the Hessian in ``u`` (:func:`largest_curvature`'s ``metric``).

    ``state_dict()`` holds the state (momentum ``v``, the power iteration's vector, the guard's last point and
    gradient, the last finite point, the step's cap, the step index ``t``), ``eta`` and the noise generator: a
    restored optimizer continues exactly. After :meth:`step`, ``step_size`` is the ``eta_t`` it used.

    Divergence recovery (``lr=None`` only: the default must not crash; a step the user chose is theirs to change):
    :meth:`recover` puts ``z`` back at the last point whose potential and gradient were finite, zeroes the
    momentum and multiplies ``eta`` by :data:`SHRINK`, which also caps every later curvature estimate; a
    non-finite gradient in :meth:`step` does the same instead of moving. ``recoveries`` lists ``(t, eta)``.
    """

    def __init__(
        self,
        params,
        *,
        plan: Plan,
        lr: float | None,
        seed: int,
        curvature=None,
        fallback: float = 1.0,
        guard_noisy: bool = True,
        metric: torch.Tensor | None = None,
    ):
        super().__init__(params, dict(eta=lr))
        if len(self.param_groups) != 1 or len(self.param_groups[0]["params"]) != 1:
            raise ValueError("SGMCMC updates one flat tensor: pass params=[z].")
        if lr is None and (curvature is None or not bool(plan.adapt[0])):
            raise ValueError(
                "SGMCMC: lr=None (the step from the curvature) needs curvature= and a plan whose first "
                "step estimates it (plan.adapt[0]); or pass lr, the step on U."
            )
        (z,) = self.param_groups[0]["params"]
        self.plan, self.curvature, self.fallback, self.step_size = plan, curvature, fallback, None
        self.metric = metric
        self.recoveries: list[tuple[int, float]] = []
        self._scale, self._noisy, self._adapt = plan.scale.tolist(), plan.noisy.tolist(), plan.adapt.tolist()
        guard = ~plan.noisy if plan.guard is None else plan.guard & (~plan.noisy | guard_noisy)
        self._guard = guard.tolist()
        self.noise = torch.Generator(device=z.device).manual_seed(seed + 7919)
        self.state[z].update(
            t=0,
            momentum=torch.zeros_like(z),
            secant=None,
            good=None,
            cap=math.inf,
            direction=torch.randn(z.shape, generator=self.noise, dtype=z.dtype, device=z.device),
        )

    def _parts(self):
        group = self.param_groups[0]
        z = group["params"][0]
        return group, z, self.state[z]

    @property
    def planned_step(self) -> float:
        """``eta_t`` of the next step as it stands (before the guard)."""
        group, _, state = self._parts()
        return group["eta"] * self._scale[state["t"]]

    def adapt(self) -> None:
        """With ``lr=None``, before a step the plan marks: ``eta = plan.fraction / |lambda|_max`` at ``z`` (30
        power iterations the first time, 10 from the last vector after), at most :data:`RISE` times the step it
        replaces: the estimate is local, and where the curvature has collapsed (a saturated softmax on separable
        rows: ``lambda`` about the prior's precision) it grows back within a step that ``fraction / lambda`` would
        take (:mod:`bnn_pyro.infer.sgmcmc`, "Step size"); a larger step needs a later estimate to confirm it."""
        group, z, state = self._parts()
        if self.curvature is None or not self._adapt[state["t"]]:
            return
        eta = group["eta"]
        lam, state["direction"] = self.curvature(z, state["direction"], 30 if eta is None else 10)
        new = self.plan.fraction / lam if lam > 0 else (eta or self.fallback)
        group["eta"] = min(new, state["cap"], math.inf if eta is None else RISE * eta)

    def recover(self) -> float | None:
        """After a divergence at step ``t``: back to the last finite point, momentum zeroed, ``eta`` (and its cap)
        times :data:`SHRINK`; returns the new ``eta``, or ``None`` when it cannot (a fixed ``lr``, no finite point
        yet, or :data:`MAX_RECOVERIES` used)."""
        group, z, state = self._parts()
        if self.curvature is None or state["good"] is None or len(self.recoveries) >= MAX_RECOVERIES:
            return None
        with torch.no_grad():
            z.copy_(state["good"])
        state["momentum"].zero_()
        state["secant"] = None
        group["eta"] = state["cap"] = group["eta"] * SHRINK
        self.recoveries.append((state["t"], group["eta"]))
        return group["eta"]

    def restart(self) -> None:
        """Momentum to zero and the guard's last point forgotten (the chain jumped, e.g. to a held-out best)."""
        _, _, state = self._parts()
        state["momentum"].zero_()
        state["secant"] = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group, z, state = self._parts()
        t, grad, alpha, fraction = state["t"], z.grad, self.plan.friction, self.plan.fraction
        if self.curvature is not None:  # lr="auto": the point to come back to after a divergence
            if not bool(torch.isfinite(grad).all()):
                if self.recover() is not None:
                    self.step_size = group["eta"] * self._scale[t]
                    grad.zero_()  # the step is skipped; the next one starts from the restored point
                    state["t"] = t + 1
                    return loss
            else:
                state["good"] = z.clone()
        at = z
        if self.metric is not None:  # the whitened coordinates u = L^T z (bnn_pyro.infer.sg_metric)
            grad, at = whiten(self.metric, grad), (self.metric.T @ z.double()).to(z)
        if self.curvature is not None and self._guard[t]:  # the stability guard (bnn_pyro.infer.sgmcmc's docstring)
            if (
                state["secant"] is not None
                and group["eta"] * self._scale[t] * secant_curvature(at, grad, *state["secant"]) > GUARD * fraction
            ):
                lam, state["direction"] = self.curvature(z, state["direction"], 10)
                group["eta"] = min(group["eta"], fraction / lam) if lam > 0 else group["eta"]
            state["secant"] = [at.clone(), grad.clone()]
        else:
            state["secant"] = None
        self.step_size = step = group["eta"] * self._scale[t]
        v = state["momentum"]
        v.mul_(1.0 - alpha).add_(grad, alpha=-step)
        if self._noisy[t]:
            v.add_(
                torch.randn(z.shape, generator=self.noise, dtype=z.dtype, device=z.device),
                alpha=math.sqrt(2.0 * alpha * step),
            )
        z.add_(v if self.metric is None else unwhiten(self.metric, v))
        state["t"] = t + 1
        return loss

    def state_dict(self):
        return {**super().state_dict(), "noise": self.noise.get_state(), "recoveries": list(self.recoveries)}

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        self.noise.set_state(state_dict.pop("noise"))
        self.recoveries = [tuple(r) for r in state_dict.pop("recoveries", [])]
        super().load_state_dict(state_dict)


def largest_curvature(
    pot: Potential, z: torch.Tensor, batch, start: torch.Tensor, iters: int, metric: torch.Tensor | None = None
):
    """``|lambda|_max`` of the Hessian of ``U`` at ``z`` on ``batch`` by power iteration on
    Hessian-vector products (double backward), started from ``start``; returns it and its vector. With ``metric``
    (``L``, :mod:`bnn_pyro.infer.sg_metric`) the Hessian in the whitened coordinates ``u = L^T z``,
    ``L^{-1} H L^{-T}``."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(pot(pot.unflatten(z), batch), z, create_graph=True)
        u, lam = start / start.norm(), 0.0
        for _ in range(iters):
            if metric is None:
                (hu,) = torch.autograd.grad(grad, z, u, retain_graph=True)
            else:
                (hu,) = torch.autograd.grad(grad, z, unwhiten(metric, u), retain_graph=True)
                hu = whiten(metric, hu)
            lam = float(hu @ u)
            if not (math.isfinite(lam) and hu.norm() > 0):
                break
            u = hu.detach() / hu.norm()
    return abs(lam), u.detach()


def secant_curvature(z: torch.Tensor, grad: torch.Tensor, z_prev: torch.Tensor, grad_prev: torch.Tensor) -> float:
    """``|grad - grad_prev| / |z - z_prev|``: the curvature along the last move (at most ``lambda_max``
    on a quadratic), free from the gradients already computed."""
    dz = (z - z_prev).norm()
    return float((grad - grad_prev).norm() / dz) if dz > 0 else 0.0


def cosine_cycle(length: int) -> torch.Tensor:
    """``(length,)`` float64 step multipliers of one cycle: ``(cos(pi k / K) + 1) / 2``, ``k = 0..K-1``
    (1 at the start, ``(1 - cos(pi / K)) / 2`` at the last step); csgmcmc and snapshot ensembles repeat it."""
    k = torch.arange(length, dtype=torch.float64)
    return (torch.cos(math.pi * k / length) + 1) / 2


def auto_fraction(friction: float) -> float:
    """``eta * lambda_max`` chosen by ``lr="auto"`` for sgld and sghmc: ``(2 - alpha) / 4``, at which
    the stiffest direction's stationary variance is 8/7 of the exact one (full batch; see
    :mod:`bnn_pyro.infer.sgmcmc`) and the step is 8 times below the stability limit ``2 (2 - alpha)``."""
    return (2.0 - friction) / 4.0


def langevin_plan(num_warmup: int, num_samples: int, thin: int, polynomial: bool, friction: float) -> Plan:
    """sgld's and sghmc's plan: ``num_warmup`` steps, then a draw every ``thin`` steps, all noisy; the step constant
    or times ``(1 + t / num_warmup)^-0.55`` (``polynomial``); ``lr="auto"`` estimates it every ``ADAPT_EVERY``
    warm-up steps and at the end of warm-up."""
    t = torch.arange(num_warmup + num_samples * thin, dtype=torch.float64)
    scale = (1 + t / max(num_warmup, 1)) ** -0.55 if polynomial else torch.ones_like(t)
    keep = (t >= num_warmup) & ((t - num_warmup) % thin == thin - 1)
    adapt = (t <= num_warmup) & ((t % ADAPT_EVERY == 0) | (t == num_warmup))
    return Plan(
        scale=scale,
        noisy=torch.ones_like(t, dtype=torch.bool),
        keep=keep,
        adapt=adapt,
        friction=friction,
        fraction=auto_fraction(friction),
        guard=t < num_warmup,
    )


def cyclical_plan(num_cycles: int, num_samples: int, thin: int, exploration: float, friction: float) -> Plan:
    """csgmcmc's plan: ``num_cycles`` cosine cycles of ``K = ceil(sampling / (1 - exploration))`` steps, each ending
    in a noisy sampling stage of ``sampling = num_samples / num_cycles * thin`` steps that keeps a draw every
    ``thin``; ``lr="auto"`` estimates the peak step at a cycle's start and every ``ADAPT_EVERY`` exploring steps."""
    sampling = num_samples // num_cycles * thin
    length = math.ceil(sampling / (1.0 - exploration) - 1e-9)  # 500 / (1 - 0.8) is 2500.0000000000005
    k = torch.arange(length, dtype=torch.float64)
    noisy = k >= length - sampling
    keep = noisy & ((length - 1 - k) % thin == 0)
    adapt = (k == 0) | (~noisy & (k % ADAPT_EVERY == 0))  # the start of a cycle, and while exploring
    return Plan(
        scale=cosine_cycle(length).repeat(num_cycles),
        noisy=noisy.repeat(num_cycles),
        keep=keep.repeat(num_cycles),
        adapt=adapt.repeat(num_cycles),
        friction=friction,
        fraction=(2.0 - friction) / 2.0,
    )


def check_lr(lr: float | str) -> float | str:
    """``lr=``: ``"auto"`` or a positive number (the learning rate on ``U / N``; :mod:`bnn_pyro.infer.optim`)."""
    return optim.check_lr(lr, method="sgmcmc", auto=True)


def check_friction(name: str, value: float) -> float:
    """``friction=`` (``alpha``): a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(
            f"{name} must be a number in (0, 1], got {value!r}; try 0.1 (SGD momentum 0.9) or 1 (no momentum: SGLD)."
        )
    return float(value)
