"""The mean-field ELBO on the analytic potential (:mod:`bnn_pyro.infer._analytic`): its value and gradient by hand.

:func:`negative_elbo` is Pyro's ``Trace_ELBO`` estimator for a mean-field Gaussian over the flat weights (or, with
``analytic_kl=True``, ``elbo="mean_field"``'s: the Normal priors' KL in closed form), with its gradient in
``(loc, scale)`` written out; :func:`mean_field_loss` serves it to SVI's loss as an autograd function,
and :mod:`bnn_pyro.infer._svi_flat` calls it directly; :func:`store_params` reads an ``AutoNormal``'s values from
Pyro's parameter store.
"""

from __future__ import annotations

import pyro
import torch
from torch.distributions import transform_to

from bnn_pyro.infer._analytic import StackPotential, build
from bnn_pyro.likelihoods import HALF_LOG_2PI

__all__ = ["negative_elbo", "mean_field_loss", "store_params"]


def negative_elbo(loc, scale, eps, pot: StackPotential, x, y, *, analytic_kl: bool = False, kl_weight: float = 1.0):
    """``(-ELBO, d/d loc, d/d scale)`` of a mean-field Gaussian ``q`` over ``theta`` at the standard-normal draws
    ``eps`` (``(D,)``, or ``(P, D)``: ``P`` particles, averaged), by hand: ``z = loc + scale * eps`` (the
    reparameterized estimator of Pyro's ``Trace_ELBO``), ``-ELBO = U(z) - sum log scale - |eps|^2 / 2 - D log(2 pi) / 2``;
    ``d/d loc = grad U(z)``, ``d/d scale = grad U(z) * eps - 1 / scale``.

    ``analytic_kl=True``: the estimator of ``elbo="mean_field"`` (:class:`~bnn_pyro.infer.reparam.MeanFieldELBO`,
    Pyro's ``TraceMeanField_ELBO`` on Normal guide sites): ``KL(q || p)`` of every Normal-prior weight in closed form,
    ``-ELBO = U_lik(z) + KL`` with ``U_lik`` the potential without the Normal priors (see :func:`_closed_kl`).

    ``kl_weight`` (``beta``, ``svi``'s ``kl_warmup``; Trace_ELBO's estimator only): ``-log p(y | z) + beta (log q(z) -
    log p(z))``, every latent's prior (the Normal priors and a learned noise's prior and Jacobian) and ``log q``
    weighted by ``beta``, as :class:`~bnn_pyro.infer.kl_warmup.KLWeight` weights them on Pyro's path."""
    z = torch.addcmul(loc, scale, eps)
    if analytic_kl:
        return _closed_kl(loc, scale, eps, z, pot, x, y)
    u, grad = pot(z, x, y)
    if kl_weight != 1.0:
        u, grad = _weigh_prior(u, grad, z, pot, kl_weight)
    log_q = 0.5 * (eps * eps).sum(-1) + HALF_LOG_2PI * eps.shape[-1]
    if eps.dim() == 2:  # particles
        u, log_q, g_loc, g_eps = u.mean(0), log_q.mean(0), grad.mean(0), (grad * eps).mean(0)
    else:
        g_loc, g_eps = grad, grad * eps
    minus_log_q, inv_scale = scale.log().sum() + log_q, scale.reciprocal()  # -log q(z) and its d/d scale
    if kl_weight != 1.0:  # (at 1 the two products change no float: skipped, two operations fewer per step)
        minus_log_q, inv_scale = kl_weight * minus_log_q, kl_weight * inv_scale
    return u - minus_log_q, g_loc, g_eps - inv_scale


def _weigh_prior(u, grad, z, pot: StackPotential, kl_weight: float):
    """``U`` and its gradient with the prior part (``0.5 (z - m)' P (z - m) + const`` of the Normal priors, and a
    learned noise's :meth:`~bnn_pyro.infer._analytic.StackPotential.noise_prior`) weighted by ``kl_weight``."""
    d = z - pot.prior_loc
    g_prior = pot.prior_precision * d
    u_prior = 0.5 * (d * g_prior).sum(-1) + pot.prior_const
    if pot.noise_index is not None:
        u_noise, g_noise = pot.noise_prior(z)
        u_prior = u_prior + u_noise
        g_prior[..., pot.noise_index] += g_noise
    rest = 1.0 - kl_weight
    return u - rest * u_prior, grad - rest * g_prior


def _closed_kl(loc, scale, eps, z, pot: StackPotential, x, y):
    """:func:`negative_elbo` with the Normal priors' KL in closed form. Per weight with prior ``N(m, 1 / p)``:
    ``KL = p (scale^2 + (loc - m)^2) / 2 - log scale - log(p) / 2 - 1/2``; a learned noise (prior not Normal, so
    ``p = 0`` at its slot) keeps its Monte Carlo ``log q - log p`` (its prior and Jacobian are in ``U_lik``).
    ``d/d loc = grad U_lik(z) + p (loc - m)``, ``d/d scale = grad U_lik(z) * eps - 1 / scale + p scale``."""
    u, grad = pot(z, x, y, prior=False)
    prec, noise = pot.prior_precision, pot.noise_index
    d = loc - pot.prior_loc
    pd = prec * d
    weights = eps.shape[-1] - (noise is not None)
    # sum over the weights of -log(p)/2 - 1/2 = sum (log prior scale) - 1/2 = prior_const - (log(2 pi)/2 + 1/2) each
    const = pot.prior_const - weights * (HALF_LOG_2PI + 0.5)
    quad = torch.dot(prec, scale * scale) + torch.dot(pd, d)
    if noise is not None:  # the noise's -log q besides -log scale: |eps|^2 / 2 + log(2 pi) / 2
        e = eps[..., noise]
        const = const - HALF_LOG_2PI
        u = u - 0.5 * e * e
    if eps.dim() == 2:  # particles
        u, g_lik, g_eps = u.mean(0), grad.mean(0), (grad * eps).mean(0)
    else:
        g_lik, g_eps = grad, grad * eps
    value = u + 0.5 * quad - scale.log().sum() + const
    return value, g_lik + pd, g_eps - scale.reciprocal() + prec * scale


class _NegativeELBO(torch.autograd.Function):
    """:func:`negative_elbo` as a function of ``(loc, scale)`` that autograd differentiates by its analytic gradient."""

    @staticmethod
    def forward(ctx, loc, scale, eps, pot, x, y):
        value, *ctx.grads = negative_elbo(loc, scale, eps, pot, x, y)
        return value

    @staticmethod
    def backward(ctx, grad_output):
        g_loc, g_scale = ctx.grads
        return grad_output * g_loc, grad_output * g_scale, None, None, None, None


def mean_field_loss(joint, guide, num_particles: int, loc_scale, context):
    """``loss(x, y) -> (loss, value) or None``: the negative ELBO of an ``AutoNormal`` ``guide`` on the analytic
    potential (``None`` at the first call where it does not apply: the caller keeps its own loss). The guide's
    noise is drawn per site in the site order, with the same calls as ``AutoNormal``: the same draws for the same
    seed. ``loc_scale(guide, name)`` and ``context`` are the guide accessors of ``bnn_pyro.utils.upstream_private``."""
    names = list(joint.priors)
    state = {}
    lead = (num_particles,) if num_particles > 1 else ()

    def loss(x, y):
        unconstrained = store_params(names)
        if unconstrained is None:  # not AutoNormal's names in the store: its own accessors
            with context(guide):
                pairs = [loc_scale(guide, name) for name in names]
            locs, scales = [a for a, _ in pairs], [b for _, b in pairs]
        else:
            locs, scales = unconstrained
        if "pot" not in state:
            shapes = {n: loc.shape for n, loc in zip(names, locs)}
            state["pot"] = None if joint.model.point_names else build(joint, names, shapes, x, y)
        if state["pot"] is None:
            return None
        loc = torch.cat([a.reshape(-1) for a in locs])
        scale = torch.cat([b.reshape(-1) for b in scales])
        if unconstrained is not None:  # one transform of the flat vector (softplus for AutoNormal)
            scale = transform_to(guide.scale_constraint)(scale)
        eps = torch.cat(
            [torch.randn(lead + a.shape, dtype=a.dtype, device=a.device).reshape(lead + (-1,)) for a in locs], -1
        )
        value = _NegativeELBO.apply(loc, scale, eps, state["pot"], x, y)
        return value, value.detach().item()

    return loss


def store_params(names):
    """``(locs, unconstrained scales)`` of an ``AutoNormal`` from Pyro's parameter store (its public
    ``named_parameters``: unconstrained values, named ``<guide>.locs.<site>`` and ``<guide>.scales.<site>``), in
    the order of ``names``; ``None`` where the store does not hold exactly those sites."""
    found = {"locs": {}, "scales": {}}
    for key, value in pyro.get_param_store().named_parameters():
        for kind, table in found.items():
            head, sep, site = key.partition(f".{kind}.")
            if sep and head and "." not in head:
                table[site] = value
    if set(found["locs"]) != set(names) or set(found["scales"]) != set(names):
        return None
    return [found["locs"][n] for n in names], [found["scales"][n] for n in names]
