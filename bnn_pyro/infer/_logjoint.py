"""The fast path: a ``BNN``'s log joint density evaluated directly in torch, without tracing Pyro.

Pyro computes a log joint by running the model under effect handlers (a trace, a replay, a
condition, plates, scaling), which costs milliseconds of Python per evaluation: on an 8-50-1 MLP
that is ~75% of an SVI step and of a NUTS leapfrog step. For a :class:`~bnn_pyro.BNN` whose every
latent site has a fixed prior (no hierarchical prior: its sites' priors depend on other sites) the
same density is a short torch function of the site values::

    log p(w, y | x) = sum_s log p_s(w_s) + (N / B) sum_{i in batch} log p(y_i | f(x_i; w), noise)

with the network evaluated by ``functional_call`` (batched over leading dimensions by ``vmap``).
:func:`svi_loss` (the reparameterized ELBO of a mean-field or MAP guide) and :func:`potential`
(NUTS, HMC and Metropolis) are built on it. They equal Pyro's ``Trace_ELBO`` and potential energy:
the same sites, densities, Jacobians and minibatch scaling; the mean-field guide's noise is drawn
with the same calls in the same order, so a fit with the fast path follows the same trajectory as
one without, up to float rounding (``tests/infer/test_logjoint.py`` checks values and gradients).

Engines use it when :func:`build` accepts the model and fall back to Pyro otherwise;
``bp.fit(..., fast_path=False)`` forces Pyro's path, and ``config["fast_path"]`` says which ran.
"""

from __future__ import annotations

import warnings
from operator import attrgetter

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import sum_rightmost
from torch.distributions import Distribution, biject_to

from bnn_pyro.infer._common import unvalidated
from bnn_pyro.model import BNN

__all__ = ["LogJoint", "build", "svi_loss", "potential"]


class LogJoint:
    """``log p(w, y | x)`` of a BNN for site values batched over leading dimensions.

    Attributes
    ----------
    priors:
        Site name -> prior, in the model's site order (weights, then the likelihood's noise sites).
    """

    def __init__(self, model: BNN, priors: dict[str, Distribution], dataset_size: int):
        self.model, self.priors, self.dataset_size = model, priors, dataset_size
        self._noise = list(model.likelihood.sites())
        self._event_dims = {name: d.event_dim for name, d in priors.items()}

    def batch_shape(self, values: dict[str, torch.Tensor]) -> torch.Size:
        name, v = next(iter(values.items()))
        return v.shape[: v.dim() - self._event_dims[name] - len(self.priors[name].batch_shape)]

    def log_prior(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(d.log_prob(values[name]) for name, d in self.priors.items())

    def log_likelihood(self, values: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                       points: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The minibatch log-likelihood scaled by ``dataset_size / len(x)``; ``points`` are the
        deterministic parameters' values (default: the model's current ones)."""
        params = {n: values[n] for n in self.model.sample_names}
        full = dict(self.model.point_values() if points is None else points)
        full.update(params)
        f = self.model._evaluate(full, x)
        batch = self.batch_shape(values)
        noise = {n: values[n].reshape(batch + (1,)) if batch else values[n] for n in self._noise}
        log_lik = self.model.likelihood.distribution(f, noise).log_prob(y)
        return log_lik.sum(-1) * (self.dataset_size / x.shape[0])

    def __call__(self, values, x, y, points=None) -> torch.Tensor:
        return self.log_prior(values) + self.log_likelihood(values, x, y, points)


def build(model, dataset_size: int) -> LogJoint | None:
    """A :class:`LogJoint` for ``model``, or ``None`` where the fast path does not apply (a Pyro
    function, a hierarchical prior, a prior that is not a ``Distribution``, BatchNorm)."""
    if not isinstance(model, BNN) or model.hyper_names:
        return None
    if any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.net.modules()):
        return None  # its running statistics change in training mode: keep Pyro's path
    priors = {}
    for name in model.sample_names:
        owner_path, _, attr = name.rpartition(".")
        prior = model.net.get_submodule(owner_path).__dict__["_pyro_samples"].get(attr)
        if not isinstance(prior, Distribution):
            return None
        priors[name] = prior
    for name, prior in model.likelihood.sites().items():
        if not isinstance(prior, Distribution):
            return None
        priors[name] = prior
    return LogJoint(model, priors, dataset_size)


def _point_params(model: BNN) -> dict[str, torch.Tensor]:
    """The deterministic parameters as SVI learns them (their ``pyro.param`` values)."""
    with model.net._pyro_context:
        return {name: attrgetter(name)(model.net) for name in model.point_names}


def svi_loss(joint: LogJoint, guide, num_particles: int = 1):
    """The negative ELBO of an ``AutoNormal`` or ``AutoDelta`` guide as ``loss(x, y) -> (loss, value)``,
    the same estimator as ``Trace_ELBO`` (``num_particles`` draws averaged), or ``None`` for any
    other guide."""
    from pyro.infer import autoguide

    if not isinstance(guide, (autoguide.AutoNormal, autoguide.AutoDelta)):
        return None
    normal = isinstance(guide, autoguide.AutoNormal)
    transforms = {name: biject_to(d.support) for name, d in joint.priors.items()}
    shape = torch.Size([num_particles]) if num_particles > 1 else torch.Size()

    def loss(x, y):
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, dataset_size=joint.dataset_size)
        values, elbo = {}, 0.0
        with guide._pyro_context:
            for name, d in joint.priors.items():
                event_dim = joint._event_dims[name]
                if not normal:  # a point mass: no entropy, no Jacobian (the value lives on the support)
                    values[name] = attrgetter(name)(guide)
                    continue
                loc, scale = guide._get_loc_and_scale(name)
                q = dist.Normal(loc, scale).to_event(event_dim)
                z = q.rsample(shape)
                w = transforms[name](z)
                jacobian = sum_rightmost(transforms[name].log_abs_det_jacobian(z, w), event_dim)
                values[name] = w
                elbo = elbo + jacobian - q.log_prob(z)
            points = _point_params(joint.model)
        elbo = elbo + joint(values, x, y, points)
        value = -elbo.mean() if num_particles > 1 else -elbo
        return value, value.detach().item()

    return loss


def potential(joint: LogJoint, transforms: dict, x: torch.Tensor, y: torch.Tensor, *, jit: bool = False):
    """``U(z) = -log p(T^-1(z), y | x) - log|det J|``: Pyro's potential energy in the unconstrained
    coordinates given by ``transforms`` (site -> constrained-to-unconstrained map, as returned by
    Pyro's ``initialize_model``); deterministic parameters stay fixed at the model's values.
    ``jit=True`` compiles it with ``torch.jit.trace`` at the first call (the data and site shapes are
    fixed, as in MCMC): eager, the torch.distributions and ``functional_call`` overhead makes it
    ~1.7x slower than traced."""
    inverse = {name: transforms[name].inv if name in transforms else None for name in joint.priors}
    points = joint.model.point_values()
    # validation off, as on Pyro's path: a diverging trajectory's NaN gives a NaN energy (a rejected
    # proposal), not a ValueError from a distribution
    joint = LogJoint(joint.model, {n: unvalidated(d) for n, d in joint.priors.items()}, joint.dataset_size)

    def energy(z: dict[str, torch.Tensor]) -> torch.Tensor:
        with pyro.validation_enabled(False):
            return _energy(z)

    def _energy(z):
        values, log_det = {}, 0.0
        for name, t in inverse.items():
            if t is None:
                values[name] = z[name]
                continue
            values[name] = t(z[name])
            log_det = log_det + sum_rightmost(t.log_abs_det_jacobian(z[name], values[name]), joint._event_dims[name])
        return -(joint(values, x, y, points) + log_det)

    return _traced(energy) if jit else energy


def _traced(fn):
    """``fn(dict of tensors)`` compiled by ``torch.jit.trace`` on its first call."""
    compiled = {}

    def call(z: dict[str, torch.Tensor]) -> torch.Tensor:
        if not compiled:
            names = list(z)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
                warnings.simplefilter("ignore", category=DeprecationWarning)  # Pyro's jit=True uses it too
                graph = torch.jit.trace(lambda *v: fn(dict(zip(names, v))), tuple(z[n].detach() for n in names),
                                        check_trace=False)
            compiled.update(names=names, graph=graph)
        return compiled["graph"](*(z[n] for n in compiled["names"]))

    return call
