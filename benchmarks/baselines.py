"""The hand-written torch baselines: the tightest loops an expert writes for the benchmark's MLP.

- :func:`svi_loop`: mean-field Gaussian VI over ONE flat vector of means and one of softplus
  scales (every layer a view into a draw), Adam (fused where this torch has it), the Gaussian
  log-likelihood without its constant; ``kl="analytic"`` (closed-form KL to the Normal(0, 1) prior,
  the lower-variance estimator) or ``kl="mc"`` (``log q(w) - log p(w)`` at the draw: the estimator of
  ``Trace_ELBO`` and of bnn_pyro's default ``elbo="trace"``). One particle: ``addmm``; ``P``
  particles: one ``baddbmm`` per layer over all of them.
- :func:`predict_loop`: predictive mean and std from weight draws in chunks of a few draws
  (small blocks stay in cache), ``baddbmm`` per layer, in-place ``tanh``, running sums.
"""

from __future__ import annotations

import torch
from _common import SIGMA, layer_shapes, mlp


def _forward(w: torch.Tensor, x: torch.Tensor, shapes) -> torch.Tensor:
    """The MLP at ``x`` (N, d) for each row of the flat draws ``w`` (P, D): (P, N)."""
    p, start, h = w.shape[0], 0, x
    for i, (out, inp) in enumerate(shapes):
        weight = w[:, start : start + out * inp].view(p, out, inp)
        bias = w[:, start + out * inp : start + out * inp + out].view(p, 1, out)
        start += out * inp + out
        if p == 1:
            h = torch.addmm(bias[0], h, weight[0].T)
        else:
            h = torch.baddbmm(bias, h.expand(p, -1, -1) if h.dim() == 2 else h, weight.transpose(1, 2))
        if i < len(shapes) - 1:
            h = torch.tanh(h)
    return h.reshape(p, -1)


def _adam(params, lr: float) -> torch.optim.Optimizer:
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError):  # a torch without the fused kernel on this device
        return torch.optim.Adam(params, lr=lr, foreach=True)


def negative_elbo(mu, rho, eps, x, y, shapes, kl: str = "analytic") -> torch.Tensor:
    """The loss of :func:`svi_loop` at the standard-normal draws ``eps`` (P, D): the Gaussian negative
    log-likelihood without its constant ``N log(SIGMA sqrt(2 pi))``, averaged over the P draws, plus
    KL(q || p) in closed form (``"analytic"``) or its one-draw estimate ``log q(w) - log p(w)`` (``"mc"``)."""
    scale = torch.nn.functional.softplus(rho)
    w = torch.addcmul(mu, scale, eps)
    nll = (_forward(w, x, shapes) - y).square().sum() * (0.5 / SIGMA**2 / eps.shape[0])
    if kl == "analytic":
        return nll + (0.5 * (scale.square() + mu.square() - 1.0) - scale.log()).sum()
    return nll + (0.5 * (w.square() - eps.square())).sum() / eps.shape[0] - scale.log().sum()  # constants cancel


def svi_loop(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    particles: int = 1,
    kl: str = "analytic",
    width: int = 50,
    depth: int = 1,
    lr: float = 1e-2,
):
    """``run(steps)``: ``steps`` Adam steps on the negative ELBO of mean-field VI (see the module)."""
    d, dev = x.shape[1], x.device
    shapes = layer_shapes(d, width, depth)
    start = torch.cat(
        [
            torch.cat([layer.weight.flatten(), layer.bias])
            for layer in mlp(d, width, depth=depth, device=dev)
            if isinstance(layer, torch.nn.Linear)
        ]
    ).detach()
    mu = start.clone().requires_grad_()
    rho = torch.full_like(start, -4.6).requires_grad_()  # softplus(-4.6) ~ 0.01
    opt = _adam([mu, rho], lr)

    def run(steps: int):
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            eps = torch.randn(particles, mu.shape[0], device=dev)
            negative_elbo(mu, rho, eps, x, y, shapes, kl).backward()
            opt.step()

    return run


def predict_loop(layers: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, chunk: int = 8):
    """Predictive mean and std (noise included) at ``x`` from draws ``layers``: (W (S, out, in), b (S, out))
    per layer."""
    draws = layers[0][0].shape[0]
    total = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)
    total_sq = torch.zeros_like(total)
    with torch.inference_mode():
        for i in range(0, draws, chunk):
            h = x.expand(min(chunk, draws - i), -1, -1)
            for j, (w, b) in enumerate(layers):
                h = torch.baddbmm(b[i : i + chunk, None], h, w[i : i + chunk].transpose(1, 2))
                if j < len(layers) - 1:
                    h.tanh_()
            f = h[..., 0]
            total += f.sum(0)
            total_sq += f.square().sum(0)
    mean = total / draws
    return mean, (total_sq / draws - mean.square() + SIGMA**2).clamp_min(0).sqrt()
