"""What one SWA/SWAG chain carries (:mod:`bnn_pyro.infer.swag`): the running moments of its collected iterates
(:class:`SWAGMoments`), its two-phase optimizer (:class:`PhasedOptimizer`), the automatic SWA learning rate
(:func:`auto_lr`) and the BatchNorm statistics of each draw (:func:`batchnorm_statistics`).

Example
-------
>>> moments = SWAGMoments.empty(z, rank=20)
>>> moments.collect(z)                                    # after each collected SGD step
>>> flat = moments.sample(1000, scale=1.0, generator=g)   # (1000, d) SWAG draws
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer.optim import make_schedule
from bnn_pyro.model import BNN
from bnn_pyro.predictive_draws import evaluating

__all__ = ["SWAGMoments", "PretrainOptimizer", "PhasedOptimizer", "auto_lr", "batchnorm_statistics"]

_CURVATURE_POINTS, _POWER_ITERATIONS = 2048, 30


class PretrainOptimizer(str, Enum):
    ADAM = "adam"
    SGD = "sgd"


@dataclass
class SWAGMoments:
    """Running moments of the collected iterates (flat unconstrained vectors) of one run."""

    mean: torch.Tensor
    sq_mean: torch.Tensor
    deviations: torch.Tensor  # (k, dim): the last ``rank`` deviations z_i - mean_i, oldest first
    count: int = 0
    rank: int = 0

    @classmethod
    def empty(cls, like: torch.Tensor, rank: int) -> SWAGMoments:
        """No snapshot yet, for flat vectors like ``like``. Moments are kept in float64:
        ``sq_mean - mean^2`` cancels digits."""
        zeros = torch.zeros(like.numel(), dtype=torch.float64, device=like.device)
        return cls(zeros, zeros.clone(), zeros.new_zeros((0, like.numel())), 0, rank)

    def collect(self, z: torch.Tensor) -> None:
        z, n = z.detach().to(torch.float64), self.count
        self.mean = (n * self.mean + z) / (n + 1)
        self.sq_mean = (n * self.sq_mean + z * z) / (n + 1)
        self.count = n + 1
        if self.rank:
            self.deviations = torch.cat([self.deviations, (z - self.mean)[None]])[-self.rank :]

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """For a checkpoint (:class:`~bnn_pyro.infer.checkpoint.ExtraState`): the moments and deviations."""
        return {"mean": self.mean, "sq_mean": self.sq_mean, "deviations": self.deviations}, {"count": self.count}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        device = self.mean.device
        self.mean, self.sq_mean = tensors["mean"].to(device), tensors["sq_mean"].to(device)
        self.deviations, self.count = tensors["deviations"].to(device), meta["count"]

    @property
    def variance(self) -> torch.Tensor:
        return (self.sq_mean - self.mean**2).clamp_min(0.0)

    def sample(self, num_samples: int, scale: float, generator: torch.Generator) -> torch.Tensor:
        """``(num_samples, dim)`` SWAG draws (see :mod:`bnn_pyro.infer.swag`)."""
        k = self.deviations.shape[0]
        e1 = torch.randn((num_samples, self.mean.numel()), generator=generator, dtype=self.mean.dtype)
        e2 = torch.randn((num_samples, k), generator=generator, dtype=self.mean.dtype)
        e1, e2 = e1.to(self.mean.device), e2.to(self.mean.device)  # the generator lives on the CPU
        noise = self.variance.sqrt() * e1 / math.sqrt(2.0) + e2 @ self.deviations / math.sqrt(2.0 * (k - 1))
        return self.mean + math.sqrt(scale) * noise


class PhasedOptimizer:
    """Both phases' optimizer: pre-training's (Adam, or SGD with momentum; rate on a cosine from ``pretrain_lr``
    to 1% of it over ``pretrain_steps``; ``pretrain_schedule`` as :func:`~bnn_pyro.infer.optim.make_schedule` takes
    it, e.g. a :class:`~bnn_pyro.infer.optim.Horizon`), then, from :meth:`start_swa`, SGD with heavy-ball momentum
    at a constant rate; ``precondition`` (a map of the first tensor's gradient, e.g. ``M grad``) is applied before each
    of the SWA phase's steps."""

    def __init__(
        self,
        params: list[torch.Tensor],
        *,
        pretrain_optimizer: PretrainOptimizer,
        pretrain_lr: float,
        pretrain_steps: int,
        momentum: float,
        pretrain_schedule="cosine",
        precondition=None,
    ):
        self.params, self.momentum, self.swa_lr, self.precondition = params, momentum, None, precondition
        if pretrain_optimizer is PretrainOptimizer.ADAM:
            self.inner = torch.optim.Adam(params, lr=pretrain_lr)
        else:
            self.inner = torch.optim.SGD(params, lr=pretrain_lr, momentum=momentum)
        self.decay = make_schedule(pretrain_schedule, self.inner, max(pretrain_steps, 1))

    def start_swa(self, lr: float) -> None:
        self.inner, self.decay, self.swa_lr = torch.optim.SGD(self.params, lr=lr, momentum=self.momentum), None, lr

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.precondition is not None and self.swa_lr is not None:  # the SWA phase's step on params[0]
            self.params[0].grad = self.precondition(self.params[0].grad)
        self.inner.step()
        if self.decay is not None:
            self.decay.step()

    def state_dict(self) -> dict:
        return {
            "swa_lr": self.swa_lr,
            "inner": self.inner.state_dict(),
            "decay": None if self.decay is None else self.decay.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["swa_lr"] is not None:
            self.start_swa(state["swa_lr"])
        self.inner.load_state_dict(state["inner"])
        if self.decay is not None:
            self.decay.load_state_dict(state["decay"])


def auto_lr(
    loss, params: list[torch.Tensor], data: Data, *, batch_size: int, momentum: float, generator: torch.Generator
) -> float:
    """``lr = x / lambda`` (:mod:`bnn_pyro.infer.swag`): ``lambda`` the largest |eigenvalue| of the Hessian of
    ``loss`` (``U / N``) over all trained tensors, by power iteration on Hessian-vector products over up to 2,048
    points (drawn by ``generator``)."""
    if data.loader is not None:
        batch = data.first()
    elif data.x.shape[0] <= _CURVATURE_POINTS:
        batch = (data.x, data.y)
    else:
        idx = torch.randperm(data.x.shape[0], generator=generator)[:_CURVATURE_POINTS].to(data.x.device)
        batch = (data.x[idx], data.y[idx])
    grads = torch.autograd.grad(loss(batch), params, create_graph=True)
    v = [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params]
    curvature = 0.0
    for _ in range(_POWER_ITERATIONS):
        norm = torch.sqrt(sum((u * u).sum() for u in v))
        v = [u / norm for u in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        curvature = abs(float(sum((a * b).sum() for a, b in zip(hv, v))))
        v = [h.detach() for h in hv]
    if not (math.isfinite(curvature) and curvature > 0.0):
        raise FloatingPointError(
            f"lr='auto': the curvature of the loss at the end of pre-training is {curvature}, so "
            "no step size follows from it. Pass lr= a positive number (e.g. 1e-3)."
        )
    b, n, beta = batch_size, data.size, momentum
    return 2 * b * (1 - beta) * (1 + beta) / ((1 + beta) * n + b * (1 - beta)) / curvature


def batchnorm_statistics(
    model, samples: dict[str, torch.Tensor], average: dict[str, torch.Tensor], data: Data, batch_size: int
) -> dict[str, torch.Tensor]:
    """BatchNorm statistics of each draw, ``(draws, *shape)`` (empty without BatchNorm); the model's
    own buffers get those of the SWA average."""
    if not isinstance(model, BNN) or not any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.net.modules()
    ):
        return {}
    if data.loader is not None:
        inputs = [xb for xb, _ in data.loader_pass()]
    else:  # near-equal chunks: none of size 1, which training-mode BatchNorm refuses
        inputs = list(torch.tensor_split(data.x, math.ceil(data.x.shape[0] / batch_size)))
    with evaluating(model):  # only the BatchNorm layers run in training mode (dropout stays off)

        def refresh(values, i):
            return model.batchnorm_statistics({k: values[k][i] for k in model.sample_names}, inputs)

        per_draw = [refresh(samples, i) for i in range(next(iter(samples.values())).shape[0])]
        own = refresh(average, 0)
    with torch.no_grad():
        for name, b in model.net.named_buffers():
            if name in own:
                b.copy_(own[name])
    return {k: torch.stack([d[k] for d in per_draw]) for k in per_draw[0]}
