"""Adversarial inputs for a posterior: the fast gradient sign method (Goodfellow et al. 2015).

For a Bayesian model the attacked loss is the negative log of the *posterior predictive*, the
mixture over draws ``w_s`` (the Bayesian model average), not one network's loss:

``L(x) = -sum_n log (1/S) sum_s p(y_n | x_n, w_s)``,  ``x_adv = x + eps * sign(dL/dx)``

(optionally clipped to ``bounds``). Attacking the model average is what fools the averaged
prediction; compare engines by accuracy and by how their uncertainty rises on ``x_adv``
(e.g. :func:`bnn_pyro.tasks.selective.ood_detection` of clean vs perturbed inputs).

Example
-------
>>> from bnn_pyro import adversarial
>>> x_adv = adversarial.fgsm(post, x_test, y_test, eps=0.1, num_samples=50, seed=0)
>>> metrics.accuracy(post.predict(x_adv), y_test)
"""

from __future__ import annotations

import torch

from bnn_pyro.metrics import mixture_log_density
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import check_data, match_columns, positive

__all__ = ["predictive_nll", "fgsm"]


def predictive_nll(post, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``-log (1/S) sum_s p(y_n | x_n, w_s)`` per row ``(N,)`` over the pooled draws ``idx``,
    differentiable in ``x`` (no ``no_grad``)."""
    return -mixture_log_density(post, x, y, idx)


def fgsm(
    post,
    x,
    y,
    eps: float,
    *,
    num_samples: int | None = 100,
    seed: int | None = 0,
    bounds: tuple[float, float] | None = None,
) -> torch.Tensor:
    """``x + eps * sign(grad_x L)`` for the predictive NLL ``L`` of the targets ``y`` (see the module's
    docstring), with ``num_samples`` posterior draws picked with ``seed`` (``None``: all draws).
    ``bounds=(lo, hi)`` clips the result (e.g. ``(0, 1)`` for pixel intensities). Returns a new
    tensor shaped like ``x``; ``eps=0`` returns a copy of ``x``."""
    if not isinstance(post, Posterior):
        raise TypeError(
            f"post: expected a bnn_pyro.Posterior (what bp.fit returns), got {type(post).__name__}; "
            "pass the posterior, not its prediction."
        )
    eps = float(eps)
    if eps != 0.0:
        eps = positive("eps", eps)
    is_bnn = isinstance(post.model, BNN)
    x, y = check_data(
        match_columns(x, post.feature_names),  # a DataFrame's columns by name, as predict reads them
        y,
        device=post.model.device if is_bnn else None,
        float_dtype=post.model.dtype if is_bnn else None,
    )
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: FGSM perturbs real-valued inputs; got dtype {x.dtype}; pass float inputs (x.float()).")
    if bounds is not None and not (len(bounds) == 2 and float(bounds[0]) < float(bounds[1])):
        raise ValueError(f"bounds: expected (lo, hi) with lo < hi, got {bounds!r}; e.g. (0.0, 1.0) for pixels.")
    idx = post.draw_index(num_samples, seed)
    x_in = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = predictive_nll(post, x_in, y, idx).sum()
        (grad,) = torch.autograd.grad(loss, x_in)
    out = x.detach() + eps * grad.sign()
    if bounds is not None:
        out = out.clamp(float(bounds[0]), float(bounds[1]))
    return out
