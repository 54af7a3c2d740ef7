"""Whether the log likelihood is quadratic where a classifier's Laplace Gaussian puts its draws.

The Laplace approximation replaces ``-log p(y | w)`` by its quadratic model at the mode, with curvature ``G`` (the
GGN). Were that exact, a draw ``w ~ N(m, Sigma)`` would fit the training rows worse than the mean ``m`` by

    E[-log p(y | w) + log p(y | m)] = tr(G Sigma) / 2 = gamma / 2

nats (the gradient term has mean zero), ``gamma = tr(G Sigma)`` being MacKay's (1992) effective number of
parameters (``sum lambda / (lambda + delta)`` over the GGN's eigenvalues for a prior precision ``delta``). At an
interpolating MAP of a classifier the GGN ``phi phi^T (diag p - p p^T)`` vanishes in the directions that would push
training rows across their decision boundaries, so the Gaussian spreads there with the prior's width, where the
likelihood is a wall, not a bowl: its draws misclassify training rows, the measured excess is many times
``gamma / 2``, and the predictive is far less sure than the posterior on the data themselves (digits, 600 rows,
last layer: excess 388 nats against ``gamma / 2 = 36``, test log loss 0.50 against 0.145 for NUTS on the same last
layer; ``benchmarks/results/laplace_classification/``).

:func:`draws_excess` measures it on a fit whose network is linear in the covered weights (the default last layer,
where the draws are the GLM predictive's own); :func:`~bnn_pyro.infer.health_off_data.check_quadratic` warns from it.
"""

from __future__ import annotations

import torch

from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.predictive_draws import evaluating

DRAWS = 100
"""Draws whose training log likelihood is evaluated. Under the quadratic model a draw ``w = m + eps``,
``eps ~ N(0, Sigma)``, fits worse than ``m`` by ``g^T eps + eps^T G eps / 2`` nats, ``g`` the negative log
likelihood's gradient at ``m``: not zero, since ``m`` is the posterior's mode, not the likelihood's (``g = -P m`` for a
``N(0, P^-1)`` prior). Its mean is ``gamma / 2`` and its variance ``g^T Sigma g + tr((G Sigma)^2) / 2``, the second
term at most ``gamma / 2`` (the eigenvalues of ``G Sigma`` lie in ``[0, 1)``), the first growing with the prior's
precision; the mean excess of ``DRAWS`` draws is known to the square root of that over ``DRAWS``, e.g. a tenth of
``gamma / 2`` or less where the linear term is small and ``gamma >= 2``. The cost is ``DRAWS`` last-layer products
over the training rows (:func:`draws_excess`)."""


def effective_parameters(lik_hess, hess, *, chol: torch.Tensor | None = None) -> float | None:
    """``gamma = tr(H^-1 G)`` for the likelihood's curvature ``G`` and the posterior precision ``H`` (dense or
    diagonal); ``None`` for a Kronecker-factored ``H`` (not formed there). ``chol``: the Cholesky factor of a dense
    ``H`` where the caller has it (the fit does), so that ``H^-1 G`` costs two triangular solves, not a factorization
    as well. Formed only for the fits :func:`draws_excess` judges: it is an ``O(k^3)`` solve with ``k`` right-hand
    sides."""
    if isinstance(hess, Kron) or isinstance(lik_hess, Kron):
        return None
    if hess.dim() == 1:
        return float((lik_hess.double() / hess.double()).sum())
    chol = torch.linalg.cholesky(hess.double()) if chol is None else chol
    return float(torch.cholesky_solve(lik_hess.to(chol.dtype), chol).diagonal().sum())


ROWS = 2000
"""Training rows evaluated at most: beyond them a random subset (fixed seed) stands for all, its sum scaled by
``N / ROWS`` (unbiased for the sum over every row), so the check costs at most ``DRAWS * ROWS`` forward rows."""


def draws_excess(model, draws: dict[str, torch.Tensor], mean: dict[str, torch.Tensor], x, y) -> float:
    """Mean over the first :data:`DRAWS` of ``draws`` of ``-log p(y | w_s) + log p(y | m)`` summed over the rows
    ``(x, y)`` (over at most :data:`ROWS` of them, scaled), for a ``BNN`` ``model`` whose net is an ``nn.Linear`` or
    an ``nn.Sequential`` ending in the ``nn.Linear`` the draws cover (``mean``: the Gaussian's mean on every site, unbatched).

    The features ``phi = net[:-1](x)`` are computed once, at the mean (the body's weights are not covered, so every
    draw shares them), and each draw's logits are ``phi W_s^T + b_s``, :meth:`~bnn_pyro.model.BNN.draws_per_chunk`
    draws at a time: one pass of the body instead of one per draw (a convolutional body's activations would
    otherwise be held for every draw at once)."""
    sub = {k: v[:DRAWS] for k, v in draws.items()}
    lik = model.likelihood
    target = lik.check_target(y, model.output_dim(x))
    scale = 1.0
    if len(x) > ROWS:
        keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:ROWS].to(x.device)
        x, target, scale = x[keep], target[keep], len(x) / ROWS
    linear = isinstance(model.net, torch.nn.Linear)  # a net that is one Linear layer: its features are x
    last = "" if linear else f"{len(model.net) - 1}."
    # frozen parameters (buffers), point values and the Gaussian's mean: the last layer's weight or bias may be any
    # of them (a Laplace fit may cover only the last bias; a frozen bias is a buffer)
    every = {**model.buffers_dict(), **model.point_values(), **mean}
    n = len(next(iter(sub.values())))
    weight = sub.get(last + "weight", every[last + "weight"].expand(n, *every[last + "weight"].shape))
    fixed_bias = every.get(last + "bias")
    bias = sub.get(last + "bias", None if fixed_bias is None else fixed_bias.expand(n, -1))
    with torch.no_grad(), evaluating(model):  # the network as it predicts (dropout off, BatchNorm's statistics)
        phi = x if linear else model.features(mean, x)

        def log_lik(w, b):  # (draws,) training log likelihood of the rows for last-layer weights (draws, out, in)
            f = phi @ w.transpose(-1, -2) + (0.0 if b is None else b[:, None, :])
            return lik.distribution(f, {}).log_prob(target).sum(-1)

        at_mean = log_lik(every[last + "weight"][None], None if fixed_bias is None else fixed_bias[None])
        chunk, total = model.draws_per_chunk(x), 0.0
        for start in range(0, len(weight), chunk):
            b = None if bias is None else bias[start : start + chunk]
            total += float((at_mean - log_lik(weight[start : start + chunk], b)).sum())
    return scale * total / len(weight)
