"""The update that SG-MCMC and snapshot ensembles share, as a ``torch.optim.Optimizer`` run by
:func:`~bnn_pyro.infer.driver.descend`: SGD with momentum plus Gaussian noise, its step size per step from a
:class:`Plan`, set from the curvature when ``lr="auto"`` and guarded in the noise-free steps. The methods, their
references and the choice of the step are described in :mod:`bnn_pyro.infer.sgmcmc`.

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

if TYPE_CHECKING:
    from bnn_pyro.infer._potential import Potential

__all__ = ["Plan", "SGMCMC", "GUARD", "largest_curvature", "secant_curvature"]

GUARD = 2.0  # lr="auto", exploration: re-estimate the curvature when eta_t * (secant curvature) > GUARD * fraction


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
    """

    scale: torch.Tensor
    noisy: torch.Tensor
    keep: torch.Tensor
    adapt: torch.Tensor
    friction: float
    fraction: float


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
        plan's ``adapt`` steps to ``plan.fraction / lambda``, and lowered by the stability guard (see
        :mod:`bnn_pyro.infer.sgmcmc`) in the noise-free steps.
    seed:
        The noise comes from a generator of its own, seeded ``seed + 7919`` (apart from the minibatch stream and
        Pyro's generators); it also draws the power iteration's first vector.
    curvature:
        ``curvature(z, start, iters) -> (|lambda|_max, vector)``: the Hessian's largest absolute eigenvalue at
        ``z`` on the current minibatch by power iteration from ``start`` (needed with ``lr=None``).
    fallback:
        ``eta`` when the first estimate is not positive.

    ``state_dict()`` holds the state (momentum ``v``, the power iteration's vector, the guard's last point and
    gradient, the step index ``t``), ``eta`` and the noise generator: a restored optimizer continues exactly.
    After :meth:`step`, ``step_size`` is the ``eta_t`` it used.
    """

    def __init__(self, params, *, plan: Plan, lr: float | None, seed: int, curvature=None, fallback: float = 1.0):
        super().__init__(params, dict(eta=lr))
        if len(self.param_groups) != 1 or len(self.param_groups[0]["params"]) != 1:
            raise ValueError("SGMCMC updates one flat tensor: pass params=[z].")
        if lr is None and (curvature is None or not bool(plan.adapt[0])):
            raise ValueError("SGMCMC: lr=None (the step from the curvature) needs curvature= and a plan whose first "
                             "step estimates it (plan.adapt[0]); or pass lr, the step on U.")
        (z,) = self.param_groups[0]["params"]
        self.plan, self.curvature, self.fallback, self.step_size = plan, curvature, fallback, None
        self._scale, self._noisy, self._adapt = plan.scale.tolist(), plan.noisy.tolist(), plan.adapt.tolist()
        self.noise = torch.Generator(device=z.device).manual_seed(seed + 7919)
        self.state[z].update(t=0, momentum=torch.zeros_like(z), secant=None,
                             direction=torch.randn(z.shape, generator=self.noise, dtype=z.dtype, device=z.device))

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
        power iterations the first time, 10 from the last vector after)."""
        group, z, state = self._parts()
        if self.curvature is None or not self._adapt[state["t"]]:
            return
        lam, state["direction"] = self.curvature(z, state["direction"], 30 if group["eta"] is None else 10)
        group["eta"] = self.plan.fraction / lam if lam > 0 else (group["eta"] or self.fallback)

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
        if self.curvature is not None and not self._noisy[t]:  # the stability guard (bnn_pyro.infer.sgmcmc's docstring)
            if (state["secant"] is not None
                    and group["eta"] * self._scale[t] * secant_curvature(z, grad, *state["secant"]) > GUARD * fraction):
                lam, state["direction"] = self.curvature(z, state["direction"], 10)
                group["eta"] = min(group["eta"], fraction / lam) if lam > 0 else group["eta"]
            state["secant"] = [z.clone(), grad.clone()]
        else:
            state["secant"] = None
        self.step_size = step = group["eta"] * self._scale[t]
        v = state["momentum"]
        v.mul_(1.0 - alpha).add_(grad, alpha=-step)
        if self._noisy[t]:
            v.add_(torch.randn(z.shape, generator=self.noise, dtype=z.dtype, device=z.device),
                   alpha=math.sqrt(2.0 * alpha * step))
        z.add_(v)
        state["t"] = t + 1
        return loss

    def state_dict(self):
        return {**super().state_dict(), "noise": self.noise.get_state()}

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        self.noise.set_state(state_dict.pop("noise"))
        super().load_state_dict(state_dict)


def largest_curvature(pot: Potential, z: torch.Tensor, batch, start: torch.Tensor, iters: int):
    """``|lambda|_max`` of the Hessian of ``U`` at ``z`` on ``batch`` by power iteration on
    Hessian-vector products (double backward), started from ``start``; returns it and its vector."""
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(pot(pot.unflatten(z), batch), z, create_graph=True)
        u, lam = start / start.norm(), 0.0
        for _ in range(iters):
            (hu,) = torch.autograd.grad(grad, z, u, retain_graph=True)
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
