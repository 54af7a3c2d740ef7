r"""Prior anchoring: a member's MAP objective tilted toward its own draw from the prior.

Pearce, T., Leibfried, F., Brintrup, A., Zaki, M. & Neely, A. (2020). Uncertainty in neural networks:
approximately Bayesian ensembling. AISTATS. (Related: Osband, Aslanides & Cassirer (2018), randomized prior
functions, NeurIPS.)

A MAP fit minimizes ``U(w) = -log p(w) - log p(y | x, w)``. In the directions the data leave free it goes to
the prior's *mode*, the same point for every member: an ensemble of MAPs agrees with itself there, and so is
confident far from the data. An anchored member ``k`` draws ``w_0^(k) ~ p(w)`` and minimizes

.. math::

    U_k(w) = U(w) + \langle w, g_k \rangle, \qquad g_k = \nabla_w \log p(w) \big|_{w = w_0^{(k)}}.

For a Gaussian prior ``N(mu, s^2)`` the tilt is ``-<w, w_0 - mu> / s^2``, so ``U_k`` equals, up to a
constant, the data term plus ``|w - w_0|^2 / (2 s^2)``: Pearce et al.'s anchored loss. For a linear-Gaussian model its minimizer is
``m + S w_0' / s^2`` (``S``, ``m``: the posterior covariance and mean; ``w_0' = w_0 - mu``; :func:`anchor` is
tested against that closed form), so the members' covariance is ``S S / s^2``, not ``S``: the posterior's in the
directions the data leave free (there ``S -> s^2 I``), narrower where the data constrain the weights (an exact
draw needs the targets perturbed too, randomize-then-optimize, which anchoring alone does not do;
``docs/reference_suite.md`` measured the members' sd of a well-determined bias at 0.06-0.11 of the exact one).

Perturbed targets (randomize-then-optimize; Bardsley et al. 2014, Lu & Van Roy 2017's randomized MAP; the deep
ensemble's default, not SWAG's or snapshot's). With a Gaussian likelihood of *fixed* scale ``sigma``,
:func:`target_noise` draws ``delta ~ N(0, sigma^2)`` per target and a member fits ``y + delta``: its minimizer ``S (X^T (y + delta) / sigma^2 + w_0 / s^2)`` (a zero prior mean) has mean ``m`` and
covariance ``S (X^T X / sigma^2 + I / s^2) S = S``, so for a linear-Gaussian model each member is an exact posterior
draw (tested). Only a fixed scale has an exact perturbation: a learned noise is a latent site of the objective
(and chosen on held-out rows), and a Categorical or Bernoulli likelihood has none, since the linear term
``eps^T f`` with ``eps ~ N(0, diag(p) - p p^T)`` (the Fisher's covariance, the GLM analogue) makes
``logsumexp(f) - (y - eps)^T f`` unbounded below whenever ``y - eps`` leaves the simplex (``docs/ood.md``).

The data half of a plain Pyro function: observation weights (the weighted likelihood bootstrap; Newton & Raftery
1994; the posterior bootstrap of Lyddon, Holmes & Walker 2018 and Fong, Lyddon & Holmes 2019, whose prior half is a
prior draw as here). A Pyro function has no target perturbation (its noise is learned, its likelihood Bernoulli, or
its structure hierarchical), and anchoring alone left kidiq's members 0.001-0.07 of the exact sds apart, since there
the data dominate every parameter. An ensemble member of a Pyro function (tensor data) also minimizes its objective
with each observation's log-likelihood weighted,

.. math::

    U_k(w) = -\log p(w) - \langle w, g_k \rangle - \sum_i v_{ik} \log p(y_i \mid x_i, w), \qquad
    v_k = n D_k, \quad D_k \sim \mathrm{Dirichlet}(1, \ldots, 1),

(:func:`bootstrap_sites`, :func:`bootstrap_weights`, drawn under the member's seed; :func:`weighted` applies them
to the observed sites as ``poutine.scale`` does, one weight per element of each observed site's batch shape). For a
linear-Gaussian model the weights give the data half the covariance ``S (X^T diag(r_i^2) X / sigma^4) S``
(``r_i``: residuals), the sandwich form of the perturbed targets' ``S (X^T X / sigma^2) S``, and the anchor adds
``S S / s^2``: together ``S``, the posterior's, to first order in ``1 / n``. Constrained sites (a noise scale, a
population sd), which the anchor leaves alone, get their spread from the weights too. Why keep the anchor: where
the prior, not the data, sets a parameter the weights move nothing, and the anchor gives the prior's spread there.
An observed site whose observations lie in one event (batch shape ``()``) cannot be weighted one by one: it is left
unweighted and ``config["observation_weights"]`` names it; with no site to weight the members are anchored only, and
the fit's ``check_narrow`` names that cause. A ``bp.BNN`` is unchanged (its members fit perturbed targets or ``y``
itself).

For a net the members are approximate in the same way. Along a direction the data do not constrain, member ``k`` stays at its anchor:
the members spread as the prior does, which is what tells inputs off the data apart.

Only the real-valued latent sites (the weights, where ``w`` is the unconstrained ``z`` itself) are anchored;
a noise scale or another constrained site keeps its plain MAP objective. For a non-Gaussian prior the same
tilt (the prior's score at a prior draw) is the first-order version of the anchored loss.

Where a member starts (:func:`free_directions`, :func:`free_start`; the deep ensemble's default). A member starts
where ``init=`` says (a ``BNN``: the layers' initializers), except the first layer's weight ``W`` along the input
directions the rows it fits leave free, where it starts at its anchor:

.. math::

    W_{start} = W_{init} + (W_0 - W_{init}) P_f, \qquad P_f = V_f V_f^T,

``V_f`` the eigenvectors of the rows' second moment ``X^T X / N`` with eigenvalue below
``FREE_START_PRECISION / (N s^4)`` (``s``: the weight's prior sd; :data:`FREE_START_PRECISION` derives the
threshold: below it the data's precision along ``v`` is below the prior's). Why: along such a direction ``v`` the
data term does not depend on ``W v`` (exactly at eigenvalue 0, approximately below the threshold), so the anchored
objective's minimizer there is the anchor, and a member started there starts at its converged value, which held-out
early stopping would otherwise cut short (the members kept a fraction of the prior's spread there and the ensemble
was confident off the data: ``docs/ood.md``). The first layer only: only its inputs are fixed data; deeper layers'
inputs move with the weights. Everything else starts at the initializer: the starts measured that also move the
data's directions toward the anchors (every weight at its anchor, a Gauss-Newton curvature start) lost the log loss
(``docs/ood.md``). It applies to a ``BNN`` whose net is an ``nn.Sequential`` starting with an ``nn.Linear`` whose
weight has a non-hierarchical prior of one sd, fitted on one tensor of inputs; otherwise (a loader, other nets) the
member starts at ``init`` and ``config["anchor"]["skipped"]`` says why. ``config["anchor"]`` records the number of
free directions, the threshold and the rows. SWAG's and snapshot's anchored starts do not use it (their own start
code; not validated there).

Example
-------
>>> g, w0 = anchor(fitted, pot, data.first(), seed=seed)   # one per member, after its Potential is built
>>> z = free_start(pot.init, w0, free_directions(model, data.x))   # once per set of rows, then per member
>>> loss = energy(pot, z, batch) + tilt(z, g)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from torch import nn

from bnn_pyro.infer._common import quiet_model
from bnn_pyro.infer._potential import Potential
from bnn_pyro.likelihoods import Gaussian
from bnn_pyro.model import BNN

__all__ = [
    "anchor",
    "tilt",
    "flat_tilt",
    "target_noise",
    "free_directions",
    "free_start",
    "FreeDirections",
    "ANCHOR_SEED_OFFSET",
    "TARGET_SEED_OFFSET",
    "FREE_START_PRECISION",
    "BOOTSTRAP_SEED_OFFSET",
    "BootstrapSites",
    "bootstrap_sites",
    "bootstrap_weights",
    "weighted",
]

ANCHOR_SEED_OFFSET = 7919  # the anchor's seed is the chain's plus this, so that it is not the start's draw
TARGET_SEED_OFFSET = 104_729  # the target perturbation's seed is the chain's plus this: independent of the anchor
BOOTSTRAP_SEED_OFFSET = 1_299_709  # the observation weights' seed is the chain's plus this: independent of both


def anchor(
    model, pot: Potential, batch: tuple, *, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tilt ``g = grad_w log p(w)`` at one prior draw ``w_0`` (drawn under ``seed``), and ``w_0``, for the
    real-valued latent sites of ``pot`` (constrained sites are left out). Torch's global generator is left as it
    was."""
    run = quiet_model(model, None)
    x, y = batch
    real = [name for name in pot.shapes if _is_real_valued(pot, name)]
    with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope():
        pyro.set_rng_seed(seed + ANCHOR_SEED_OFFSET)
        with torch.no_grad():
            draw = poutine.trace(run).get_trace(x, y)
        w0 = {name: draw.nodes[name]["value"].detach().clone().requires_grad_() for name in real}
        trace = poutine.trace(poutine.condition(run, data=w0)).get_trace(x, y)
        log_prior = sum(
            site["fn"].log_prob(site["value"]).sum()
            for name, site in trace.nodes.items()
            if name in w0 and site["type"] == "sample"
        )  # conditioning marks them observed
        grads = torch.autograd.grad(log_prior, list(w0.values())) if real else []
    return {name: g.detach() for name, g in zip(real, grads)}, {k: v.detach() for k, v in w0.items()}


def target_noise(model, y: torch.Tensor | None, *, seed: int) -> torch.Tensor | None:
    """The perturbation ``delta ~ N(0, sigma^2)`` (one per element of ``y``, drawn under ``seed`` with its own
    generator) whose addition to the targets makes an anchored member the randomize-then-optimize draw (module
    docstring), for a ``BNN`` whose likelihood is a Gaussian of fixed scale ``sigma``; ``None`` for any other model
    or likelihood (a learned or heteroscedastic noise, classification, a plain Pyro function) or without targets."""
    likelihood = getattr(model, "likelihood", None)
    if not isinstance(model, BNN) or type(likelihood) is not Gaussian or y is None or not y.dtype.is_floating_point:
        return None
    if likelihood.precision is not None or isinstance(likelihood.scale, torch.distributions.Distribution):
        return None
    g = torch.Generator().manual_seed(seed + TARGET_SEED_OFFSET)
    return (float(likelihood.scale) * torch.randn(y.shape, generator=g, dtype=y.dtype)).to(y.device)


def tilt(z: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> torch.Tensor | float:
    """``<z, g>`` summed over the anchored sites (0 without any)."""
    return sum((z[name] * v).sum() for name, v in g.items())


def flat_tilt(g: dict[str, torch.Tensor], pot: Potential) -> torch.Tensor:
    """The tilt ``g`` of :func:`anchor` as one flat vector in the order of ``pot.flatten``, zero on the sites it
    leaves out (the constrained ones)."""
    return pot.flatten(
        {
            k: g[k] if k in g else torch.zeros(shape, dtype=pot.init[k].dtype, device=pot.init[k].device)
            for k, shape in pot.shapes.items()
        }
    ).detach()


def _is_real_valued(pot: Potential, name: str) -> bool:
    """Whether ``name`` is real-valued: its map to unconstrained space returns its input (as in ``energy``)."""
    t = pot.transforms.get(name)
    probe = torch.zeros(pot.shapes[name], dtype=pot.init[name].dtype, device=pot.init[name].device)
    return t is None or t.inv(probe) is probe


FREE_START_PRECISION = 4.0
r"""The free start's threshold: an input direction ``v`` is free when the eigenvalue ``lambda_v`` of the fitted rows'
second moment ``X^T X / N`` is below ``FREE_START_PRECISION / (N s^4)`` (``s``: the first layer's prior sd).

Derivation. For a first-layer weight row ``W_j`` along ``v`` the data term's Gauss-Newton curvature is
``sum_i (x_i . v)^2 relu'(u_ij) J_ij^T Lambda_i J_ij = N lambda_v c_j`` (``J_ij``: the output weights of unit ``j``,
``Lambda_i``: the likelihood's curvature in the outputs). Take the output weights at the prior's scale
(``E (w_0j - w_1j)^2 = 2 s^2`` for two classes), the softmax at its largest curvature (``p (1 - p) = 1/4``) and the
unit active on half the rows: ``c_j = s^2 / 4``, so the data's precision ``N lambda_v s^2 / 4`` is below the
prior's ``1 / s^2`` exactly where ``lambda_v < 4 / (N s^4)``. Reason for 4: below it the prior, not the data,
sets the weight there, so the anchored minimizer there is (nearly) the anchor; at ``lambda_v = 0`` it is the anchor
exactly, for any likelihood."""


_ROWS_PER_CHUNK = 4096  # rows converted to float64 at a time for X^T X


@dataclass(frozen=True)
class FreeDirections:
    """The first layer's free input directions for one set of rows: the weight site ``site`` and the projector
    ``projector`` (``D x D``, ``V_f V_f^T``) on the eigenvectors of the rows' second moment below :data:`FREE_START_PRECISION`'s
    threshold; ``record`` is what ``config["anchor"]`` states."""

    site: str
    projector: torch.Tensor | None
    record: dict


def free_directions(model, x) -> FreeDirections:
    r"""The free directions of ``model``'s first layer on the rows ``x`` a member fits (module docstring, "Where a
    member starts"): for a ``BNN`` whose net is an ``nn.Sequential`` starting with an ``nn.Linear`` whose weight has a
    non-hierarchical prior of one sd ``s``, and a 2-D floating tensor ``x``, the eigenvectors of ``x^T x / N`` with
    eigenvalue below ``FREE_START_PRECISION / (N s^4)``. Otherwise (or with none below it) ``projector`` is
    ``None`` and ``record`` says why. Why the first layer only: only its inputs are fixed data; deeper layers' inputs
    move with the weights."""
    site, why = _first_linear(model)
    if why:
        return FreeDirections(site, None, {"free_directions": 0, "skipped": why})
    if x is None:
        why = "the rows come from a loader (their second moment is not computed from a stream)"
        return FreeDirections(site, None, {"free_directions": 0, "skipped": why})
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
        why = "the inputs are not one 2-D floating-point tensor (a tuple or dict of inputs)"
        return FreeDirections(site, None, {"free_directions": 0, "skipped": why})
    try:
        sd = model.prior_distributions()[site].stddev
    except NotImplementedError:
        return FreeDirections(site, None, {"free_directions": 0, "skipped": f"the prior of {site!r} has no sd"})
    s = float(sd.flatten()[0])
    if not (torch.all(sd == s) and math.isfinite(s) and s > 0):
        why = f"the prior of {site!r} has no single finite sd"
        return FreeDirections(site, None, {"free_directions": 0, "skipped": why})
    n = x.shape[0]
    threshold = FREE_START_PRECISION / (n * s**4)
    # float64, accumulated over chunks of rows: no float64 copy of a large X
    second = sum(c.T @ c for c in (part.detach().to(torch.float64) for part in x.split(_ROWS_PER_CHUNK)))
    lam, vec = torch.linalg.eigh(second / n)
    free = vec[:, lam < threshold]
    record = {"free_directions": int(free.shape[1]), "site": site, "threshold": threshold, "rows": n}
    projector = free @ free.T if free.shape[1] else None  # float64: free_start applies it
    return FreeDirections(site, projector, record)


def free_start(z: dict[str, torch.Tensor], w0: dict[str, torch.Tensor], free: FreeDirections | None) -> dict:
    """``z`` with the first layer's weight moved to its anchor along the free directions, ``W + (W0 - W) P_f``
    (the rest as it was); ``z`` itself when there is none."""
    if free is None or free.projector is None or free.site not in w0:
        return z
    w = z[free.site].detach()
    p = free.projector.to(w.device)
    eye = torch.eye(p.shape[0], dtype=p.dtype, device=p.device)
    # in float64: along a direction of eigenvalue 0 (an all-zero input column) the start is the anchor to the bit,
    # where the data's and the anchored prior's gradients are both exactly zero, so the member stays there
    start = w.to(p.dtype) @ (eye - p) + w0[free.site].to(p.dtype) @ p
    return {**z, free.site: start.to(w.dtype)}


def _first_linear(model) -> tuple[str, str]:
    """``(site, "")``, the first layer's weight site ``"0.weight"``, when ``model`` is a ``BNN`` whose net is an
    ``nn.Sequential`` starting with an ``nn.Linear`` whose weight has a prior (not hierarchical); else
    ``("", reason)``, the reason the free start does not apply."""
    if not isinstance(model, BNN):
        return "", "not a bp.BNN"
    net = model.net
    if not isinstance(net, nn.Sequential) or not len(net) or not isinstance(net[0], nn.Linear):
        return "", "the net is not an nn.Sequential starting with an nn.Linear"
    site = "0.weight"
    if site not in model.sample_names:
        return "", f"{site!r} has no prior"
    if any(h.startswith(f"{site}_") for h in model.hyper_names):
        return "", f"{site!r} has a hierarchical prior (its sd is a latent site)"
    return site, ""


@dataclass(frozen=True)
class BootstrapSites:
    """The observed sites a Pyro function's member can weight (:func:`bootstrap_sites`): ``shapes`` maps each to the
    batch shape of its distribution (one weight per element); ``record`` is what ``config["bootstrap"]`` states."""

    shapes: dict[str, torch.Size]
    record: dict


BOOTSTRAP_SCHEME = "weighted likelihood bootstrap: n * Dirichlet(1, ..., 1) weights per observation"


def bootstrap_sites(model, x, y, *, skip: str = "", anchored: bool = True) -> BootstrapSites:
    """The observed sample sites of the Pyro function ``model`` on the rows ``(x, y)`` and their batch shapes (module
    docstring, "The data half"). An observed site whose observations all lie in one event (``fn.batch_shape == ()``:
    nothing to weight one by one) is left unweighted and ``record["unweighted"]`` names it. Skipped, with the reason in
    ``record["skipped"]``: a ``bp.BNN`` (its data half is the perturbed targets' or nothing: unchanged), rows from a
    loader (``x`` is ``None``), no observed site that can be weighted, or a caller's reason ``skip`` (the ensemble's
    ``bootstrap=False``). ``anchored``: whether the members' prior half is anchored, as ``record`` says."""
    if skip:
        return BootstrapSites({}, {"skipped": skip})
    if isinstance(model, BNN):
        return BootstrapSites({}, {"skipped": "a bp.BNN (its members fit perturbed targets or y itself)"})
    if x is None or y is None:
        return BootstrapSites({}, {"skipped": "the rows come from a loader (weights are drawn per row of a tensor)"})
    with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
        trace = poutine.trace(quiet_model(model, None)).get_trace(x, y)
    observed = {
        name: site["fn"].batch_shape
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and site["is_observed"] and not site["infer"].get("_deterministic")
    }
    if not observed:
        return BootstrapSites({}, {"skipped": "the model has no observed sample site"})
    whole = [name for name, shape in observed.items() if not len(shape)]
    why = f"the observations of {whole} lie in one event (batch shape ()), so they cannot be weighted one by one"
    shapes = {name: shape for name, shape in observed.items() if len(shape)}
    if not shapes:
        return BootstrapSites({}, {"skipped": why})
    record = {"scheme": BOOTSTRAP_SCHEME, "sites": {n: list(s) for n, s in shapes.items()}, "anchored_prior": anchored}
    return BootstrapSites(shapes, {**record, "unweighted": why} if whole else record)


def bootstrap_weights(sites: BootstrapSites, *, seed: int, like: torch.Tensor | None = None) -> dict:
    """One member's observation weights (drawn under ``seed`` with their own generator): per site, ``n * D`` with
    ``D ~ Dirichlet(1, ..., 1)`` over its ``n`` elements (normalized ``Exponential(1)`` draws), shaped like its batch
    shape, in ``like``'s dtype and device (float32 on the CPU without it); ``{}`` when ``sites`` has none. Why Dirichlet times ``n``: the Bayesian bootstrap's weights (Rubin 1981;
    Newton & Raftery 1994), whose sum ``n`` keeps the data's total weight against the prior's."""
    if not sites.shapes:
        return {}
    g = torch.Generator().manual_seed(seed + BOOTSTRAP_SEED_OFFSET)
    out = {}
    for name, shape in sites.shapes.items():
        e = torch.empty(shape, dtype=torch.float64).exponential_(generator=g)
        w = e / e.mean()
        out[name] = w.float() if like is None else w.to(dtype=like.dtype, device=like.device)
    return out


class _Weighted(poutine.messenger.Messenger):
    """Multiply the log-density of the named observed sites by their weight tensors (broadcast as ``poutine.scale``
    does); every other site (the latent ones, conditioned in a potential) is left alone."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.weights = weights

    def _pyro_sample(self, msg):
        w = self.weights.get(msg["name"])
        if w is not None:
            msg["scale"] = w * msg["scale"]


def weighted(loss_fn, weights: dict[str, torch.Tensor]):
    """``loss_fn(pot, z, batch)`` with the observed sites' log-densities weighted by ``weights``
    (:func:`bootstrap_weights`); ``loss_fn`` itself without weights."""
    if not weights:
        return loss_fn

    def run(pot, z, batch):
        with _Weighted(weights):
            return loss_fn(pot, z, batch)

    return run
