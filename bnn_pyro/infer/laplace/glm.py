"""The linearized (GLM) predictive of a Laplace posterior (Immer, Korzepa & Bauer 2021; laplace-torch's
``pred_type="glm"``): each draw ``w_s`` of the covered weights gives the output of the network linearized at
the expansion point ``w*``,

    f_lin(x, w_s) = f(x, w*) + J(x) (w_s - w*),      J(x) = d f(x, w) / d w at w*,

so that for a Gaussian likelihood the predictive is ``N(f(x, w*), J Sigma J^T + sigma^2)`` (sampled), and for
classification the MC GLM predictive (the softmax / sigmoid of linearized logits). The Jacobian-vector
products ``J(x) (w_s - w*)`` are taken for a chunk of draws at once by the double-backward trick
(:func:`torch.autograd.functional.jvp`; its cost against a plain forward pass:
``benchmarks/results/docstring_figures/results.md``).
A network linear in its covered weights (``structure="last_layer"`` when the last module of an
``nn.Sequential`` is that ``nn.Linear``) stores no expansion point: its own draws are exactly the GLM's, and
the plain forward pass is used.

In function space (no draws): :func:`functional_moments` gives the linearized Gaussian ``N(f(x, w*), J H^-1 J^T)``
of a :class:`~bnn_pyro.infer.laplace.LaplaceApproximation` and :func:`predictive_probs` a classifier's class
probabilities from it, by MacKay's probit approximation or by sampling the logits.

:class:`~bnn_pyro.Posterior` calls :func:`linearized_outputs` when ``post.config["predictive"] == "glm"``;
the expansion point of chain ``c`` is stored as ``post.history[CENTER + site]`` shaped ``(chains, *shape)``.
Both live in :mod:`bnn_pyro.posterior.linearized` (the posterior layer, which never imports ``infer``) and are
re-exported here.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer.laplace.approximation import CHUNK, Link
from bnn_pyro.infer.laplace.functional import output_jacobian
from bnn_pyro.infer.laplace.kfac import layer_jacobians
from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.likelihoods import Bernoulli, Categorical
from bnn_pyro.posterior.linearized import CENTER, linearized_outputs
from bnn_pyro.predictive_draws import evaluating
from bnn_pyro.utils.checks import choice, positive_int

__all__ = ["linearized_outputs", "functional_moments", "predictive_probs", "CENTER"]

# ------------------------------------------------------------------ the linearized Gaussian in function space
PROBIT = math.pi / 8.0  # lambda^2: sigmoid(t) ~ Phi(sqrt(pi / 8) t) (MacKay 1992)


def functional_moments(approx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, cov)`` of the linearized outputs at ``x`` under a
    :class:`~bnn_pyro.infer.laplace.LaplaceApproximation` of a ``BNN``: ``f(x, w*) + J (m - w*)`` ``(N, out)`` and
    ``J H^-1 J^T`` ``(N, out, out)`` (float64), ``J`` the Jacobian in the covered coordinates at the expansion
    point ``w*``. For ``structure="kron"`` ``J`` comes from one backward pass per output (:mod:`.kfac`) and
    ``H^-1`` is applied factor by factor; otherwise by ``vmap(jacrev)``."""
    rows = max(1, CHUNK // max(1, len(approx.active) * approx.model.output_dim(x)))  # Jacobians of ~32 MB
    if x.shape[0] > rows:
        parts = [functional_moments(approx, x[i : i + rows]) for i in range(0, x.shape[0], rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    model, pot, z, active = approx.model, approx.potential, approx.expansion_point, approx.active
    with evaluating(model):
        if isinstance(approx.precision, Kron):
            coords, start = {}, 0
            for name, shape in pot.shapes.items():
                coords[name] = torch.arange(start, start + math.prod(shape), device=z.device)
                start += math.prod(shape)
            where = torch.full((pot.dim,), -1, dtype=torch.long, device=z.device)
            where[active] = torch.arange(len(active), device=z.device)
            f, jac = layer_jacobians(model, pot, z, x, coords, where, len(active))
            cov = approx.precision.functional_covariance(jac)
        else:
            f, jac = output_jacobian(model, pot, z, x, active)
            sigma = approx.covariance()
            cov = (
                torch.einsum("bow,w,bpw->bop", jac, sigma, jac)
                if sigma.dim() == 1
                else torch.einsum("bow,wv,bpv->bop", jac, sigma, jac)
            )
    mean = f.double() + jac @ (approx.mean - z)[active].double()
    return mean, cov


def predictive_probs(
    approx, x: torch.Tensor, *, link: str = "probit", num_samples: int = 1000, seed: int = 0
) -> torch.Tensor:
    """Class probabilities ``(N, K)`` of the GLM predictive of a classifier's Laplace approximation.

        ``link="probit"`` (MacKay 1992; laplace-torch's ``link_approx="probit"``): no sampling; a Bernoulli output
        ``sigmoid(mu / sqrt(1 + pi sigma^2 / 8))``, which is exact for the probit link ``Phi(sqrt(pi / 8) f)``
        (``E Phi(l f) = Phi(l mu / sqrt(1 + l^2 sigma^2))`` for ``f ~ N(mu, sigma^2)``) and within 0.04 of
        ``E sigmoid(f)`` (``|sigmoid(t) - Phi(sqrt(pi / 8) t)| <= 0.018``); a Categorical one
        ``softmax(mu_k / sqrt(1 + pi Sigma_kk / 8))`` (the same scaling per class; it counts the variance of a shift
    common to every logit, which softmax ignores, so it can be far less confident than MC: digits NLL 0.72 against
    0.27, docs/engines.md "Laplace, KFAC"). ``link="mc"``: the average of
        ``num_samples`` softmax (sigmoid) draws of the linearized logits ``f ~ N(mu, Sigma)``.

        Example
        -------
        >>> approx = bp.infer.laplace.laplace_approximation(model, Data(x, y), structure="kron")
        >>> probs = bp.infer.laplace.glm.predictive_probs(approx, x_test)
    """
    link = choice("link", link, Link)
    likelihood = approx.model.likelihood
    if not isinstance(likelihood, (Categorical, Bernoulli)):
        raise ValueError(
            f"predictive_probs: the model's likelihood is {type(likelihood).__name__}; class "
            "probabilities need bp.likelihoods.Categorical or Bernoulli."
        )
    mean, cov = functional_moments(approx, x)
    var = cov.diagonal(dim1=-2, dim2=-1)
    if link is Link.PROBIT:
        logits = mean / (1.0 + PROBIT * var).sqrt()
    else:
        chol = torch.linalg.cholesky(cov + 1e-12 * torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device))
        eps = torch.randn(
            (positive_int("num_samples", num_samples),) + mean.shape,
            generator=torch.Generator().manual_seed(seed),
            dtype=mean.dtype,
        ).to(mean.device)  # CPU draw
        logits = mean + torch.einsum("nop,snp->sno", chol, eps)
    if isinstance(likelihood, Bernoulli):
        p = torch.sigmoid(logits[..., 0])
        probs = torch.stack([1 - p, p], -1)
    else:
        probs = torch.softmax(logits, -1)
    return probs if link is Link.PROBIT else probs.mean(0)
