r"""Local reparameterization and flipout for mean-field Gaussian guides, as effect handlers.

``bp.fit(model, x, y, method="svi", guide="mean_field", estimator="local_reparam" | "flipout")``.

A mean-field guide gives each Bayesian weight ``W`` of a ``BNN`` an independent Gaussian
``q(W) = N(M, S^2)``. The plain estimator (``estimator="sample"``) draws one ``W`` per step and shares it
over the minibatch, so the per-example terms of the data log-likelihood are correlated through that one
draw and the gradient's variance does not fall as ``1 / B``. Two unbiased alternatives draw
*independent* weight noise per example without materializing a weight per example:

- **Local reparameterization** (Kingma, Salimans & Welling 2015, "Variational dropout and the local
  reparameterization trick"). For a linear layer ``b = x W^T + c`` with ``W ~ q``, each example's
  pre-activations are exactly Gaussian, ``b_n ~ N(x_n M^T + m_c, x_n^2 (S^2)^T + s_c^2)``, and examples
  are independent when every example owns its weight draw. Sampling ``b_n`` directly gives the same
  expected log-likelihood per example (the ELBO is a sum over examples) with independent noise.
  It is exact only where each example meets the weight once: a ``Linear`` on a 2-D input ``(N, in)``.
  Where weights are shared within an example (convolutions, a ``Linear`` on ``(N, ..., in)``), the
  pre-activations of one example are correlated, so there ``"local_reparam"`` uses flipout instead
  (Wen et al. 2018 motivate flipout with exactly this limitation).
- **Flipout** (Wen, Vicol, Ba, Tran & Grosse 2018, "Flipout: efficient pseudo-independent weight
  perturbations on mini-batches"). With one shared perturbation ``dW = W - M = S * eps`` and random
  signs ``s_n`` (inputs) and ``r_n`` (outputs) per example, ``b_n = x_n M^T + ((x_n * s_n) dW^T) * r_n``:
  example ``n`` sees ``M + dW * (r_n s_n^T)``, whose distribution is that of ``W`` (``dW`` is symmetric
  and independent of the signs), so every per-example expectation is unchanged, while different
  examples' perturbations are decorrelated. For a convolution, the signs are per example and
  channel (shared over positions: one example must see one kernel). A Bayesian bias is perturbed
  the same way (``c_n = m_c + (c - m_c) * r_n``; for local reparameterization its variance adds).

Both change only how the data term is *estimated*: its expectation, hence the ELBO, is the plain
estimator's. The KL term of each weight site is then taken in closed form,
``KL(N(M, S^2) || p(W))`` (:class:`MeanFieldELBO`), so the estimator never needs the weight draw for it.

The implementation is two effect handlers and no layer classes:

- :class:`GaussianSites`, a Pyro ``Messenger`` around the (``AutoNormal``) guide. ``AutoNormal``
  samples each site as an auxiliary ``N(M, S^2)`` site ``"<name>_unconstrained"`` followed by a
  ``Delta`` at ``"<name>"``. For sites with real support the handler moves the Gaussian onto the
  site itself (the auxiliary site is masked out of the ELBO; same draw, same density, so any ELBO's
  value is unchanged), which makes the closed-form KL available, and registers the drawn tensor
  with its ``(M, S)``.
- :class:`WeightNoise`, a ``torch`` function mode around the model. When ``F.linear`` or
  ``conv1d/2d/3d`` receives a registered weight (the same tensor object: Pyro's replay hands the
  guide's draw to the model, and ``functional_call`` to the layer), it returns sampled
  pre-activations instead. A registered weight used more than once per forward pass (weight tying,
  recurrence), or also by another operation, would break the per-example argument: that raises.

Example
-------
>>> post = bp.fit(model, x, y, guide="mean_field", estimator="flipout", batch_size=100, epochs=50)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import wraps

import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.distributions import Delta, constraints
from pyro.distributions.util import is_identically_zero, scale_and_mask
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.util import torch_item
from torch import nn
from torch.overrides import TorchFunctionMode

from bnn_pyro.model import BNN

__all__ = ["Estimator", "GaussianSites", "WeightNoise", "MeanFieldELBO", "check_estimator"]

_AUX = "_unconstrained"  # AutoNormal's suffix for the auxiliary Gaussian site of "<name>"
_LAYERS = {F.linear: "linear", torch.conv1d: "conv", torch.conv2d: "conv", torch.conv3d: "conv"}
_LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Operations that only read a tensor's metadata: not a "use" of a weight.
_META_METHODS = {
    "dim",
    "size",
    "numel",
    "nelement",
    "ndimension",
    "__len__",
    "is_floating_point",
    "is_complex",
    "stride",
    "is_contiguous",
    "element_size",
    "data_ptr",
    "storage_offset",
    "get_device",
}
_META_ATTRS = {
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "ndim",
    "layout",
    "is_leaf",
    "grad_fn",
    "is_cuda",
    "is_meta",
    "names",
    "is_sparse",
    "is_quantized",
    "is_nested",
    "_version",
}


class Estimator(str, Enum):
    """How the data term of the ELBO draws the weights of ``Linear``/``Conv`` layers."""

    SAMPLE = "sample"  # one weight draw per step, shared by the minibatch (plain reparameterization)
    LOCAL_REPARAM = "local_reparam"  # pre-activations per example (Linear on 2-D input; flipout elsewhere)
    FLIPOUT = "flipout"  # one shared perturbation, decorrelated per example by random signs


@dataclass
class RecordedGaussian:
    """A registered draw ``value = loc + scale * eps`` of the guide site ``name``."""

    name: str
    value: torch.Tensor
    loc: torch.Tensor
    scale: torch.Tensor


# ---------------------------------------------------------------------- guide side
class GaussianSites(poutine.messenger.Messenger):
    """Around an ``AutoNormal`` guide: give each real-support site its Gaussian ``N(loc, scale)``
    (the auxiliary site is masked out) and register the draw in :attr:`registry` (see the module
    docstring). Use as ``GaussianSites(guide)(guide)``."""

    def __init__(self, guide: AutoNormal):
        super().__init__()
        if not isinstance(guide, AutoNormal):
            raise TypeError(f"GaussianSites needs a pyro AutoNormal guide, got {type(guide).__name__}.")
        self.guide = guide
        self.registry: dict[int, RecordedGaussian] = {}
        self._pending: dict[str, tuple] = {}

    def __enter__(self):
        self.registry.clear()  # one guide run per ELBO particle: the previous draws are stale
        self._pending.clear()
        return super().__enter__()

    def _owner(self, msg) -> str | None:
        """The site whose auxiliary Gaussian ``msg`` is, if that site has real support."""
        name = msg["name"]
        if not (msg["infer"].get("is_auxiliary") and name.endswith(_AUX)):
            return None
        site = self.guide.prototype_trace.nodes.get(name[: -len(_AUX)])
        if site is None:
            return None
        support = site["fn"].support
        while isinstance(support, constraints.independent):
            support = support.base_constraint
        return name[: -len(_AUX)] if support is constraints.real else None

    def _pyro_sample(self, msg):
        if self._owner(msg) is not None:
            msg["mask"] = False  # its density is counted at the site it belongs to
            return
        moved = self._pending.pop(msg["name"], None)
        if moved is not None:  # the Delta at "<name>": the same draw, now with its own Gaussian
            msg["fn"], msg["value"] = moved

    def _pyro_post_sample(self, msg):
        owner = self._owner(msg)
        if owner is not None:
            self._pending[owner] = (msg["fn"], msg["value"])
            return
        fn = msg["fn"]
        while isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        if isinstance(fn, torch.distributions.Normal) and not msg["is_observed"] and msg["value"] is not None:
            self.registry[id(msg["value"])] = RecordedGaussian(msg["name"], msg["value"], fn.loc, fn.scale)


# ---------------------------------------------------------------------- model side
class WeightNoise(TorchFunctionMode):
    """Around the model: ``linear``/``convNd`` on a weight registered by ``sites`` returns sampled
    pre-activations (``kind``: local reparameterization or flipout; see the module docstring).
    :meth:`wrap` gives the model run inside the mode."""

    def __init__(self, kind: Estimator | str, sites: GaussianSites):
        super().__init__()
        self.kind = Estimator(kind)
        self.sites = sites
        self._noisy: set[int] = set()
        self._plain: set[int] = set()
        self._num_examples: int | None = None

    def wrap(self, model: Callable) -> Callable:
        """``model(x, y, ...)`` evaluated with this mode active (``x``'s first dimension: examples)."""

        @wraps(model)
        def run(x, *args, **kwargs):
            self._noisy.clear()
            self._plain.clear()
            self._num_examples = x.shape[0]
            with self:
                return model(x, *args, **kwargs)

        return run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        registry = self.sites.registry
        if not registry:
            return func(*args, **kwargs)
        if func in _LAYERS:
            x, w, b, rest, options = _layer_args(args, kwargs)
            gw = registry.get(id(w))
            if gw is not None:
                gb = registry.get(id(b)) if b is not None else None
                for g in filter(None, (gw, gb)):
                    self._use(g, func, noisy=True)
                return self._layer(func, x, gw, b, gb, rest, options)
        for a in _tensors(args, kwargs):
            g = registry.get(id(a))
            if g is not None and not _metadata(func):
                self._use(g, func, noisy=False)
        return func(*args, **kwargs)

    def _use(self, g: RecordedGaussian, func, *, noisy: bool) -> None:
        key = id(g.value)
        if key in self._noisy or (noisy and key in self._plain):
            raise ValueError(
                f"estimator={self.kind.value!r}: the Bayesian weight {g.name!r} is used more than once in one "
                f"forward pass (again by {getattr(func, '__name__', func)}). Local reparameterization and flipout "
                "need each weight to enter exactly one linear/convolution call (no weight tying, no recurrence, "
                "no other use). Use estimator='sample' for this net."
            )
        (self._noisy if noisy else self._plain).add(key)

    def _layer(self, func, x, gw: RecordedGaussian, b, gb: RecordedGaussian | None, rest, options):
        n = self._num_examples
        is_linear = _LAYERS[func] == "linear"
        batched = x.dim() >= 2 if is_linear else x.dim() == gw.value.dim()
        if not batched or x.shape[0] != n:
            raise ValueError(
                f"estimator={self.kind.value!r}: the layer with weight {gw.name!r} got an input of shape "
                f"{tuple(x.shape)} whose first dimension is not the minibatch's {n} examples, so per-example "
                "weight noise cannot be assigned. Use estimator='sample' for this net."
            )
        bias_loc = gb.loc if gb is not None else b
        mean = func(x, gw.loc, bias_loc, *rest, **options)
        if self.kind is Estimator.LOCAL_REPARAM and is_linear and x.dim() == 2:
            var = func(x * x, gw.scale**2, None if gb is None else gb.scale**2, *rest, **options)
            return mean + var.clamp_min(torch.finfo(var.dtype).tiny).sqrt() * torch.randn_like(var)
        lead = (n,) + (1,) * (x.dim() - 2)  # one sign per example (and channel), shared within it
        if is_linear:
            s, r = _signs(lead + x.shape[-1:], x), _signs(lead + mean.shape[-1:], x)
        else:
            space = (1,) * (x.dim() - 2)
            s, r = _signs((n, x.shape[1]) + space, x), _signs((n, mean.shape[1]) + space, x)
        d_bias = None if gb is None else gb.value - gb.loc
        return mean + func(x * s, gw.value - gw.loc, d_bias, *rest, **options) * r


def _layer_args(args, kwargs):
    """``(input, weight, bias, other positional args, other keyword args)`` of a linear/conv call."""
    values, options = list(args[:3]), dict(kwargs)
    for i, key in enumerate(("input", "weight", "bias")):
        if i >= len(values):
            values.append(options.pop(key, None))
    return values[0], values[1], values[2], tuple(args[3:]), options


def _signs(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, 2, shape, device=like.device).to(like.dtype).mul_(2).sub_(1)


def _metadata(func) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _META_ATTRS
    return name in _META_METHODS


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))
        elif isinstance(a, torch.Tensor):
            yield a


# ---------------------------------------------------------------------- the ELBO
class MeanFieldELBO(Trace_ELBO):
    """``Trace_ELBO`` with ``KL(q || p)`` in closed form at every latent site whose guide site has its
    own distribution and a registered KL (e.g. Normal/Normal after :class:`GaussianSites`), Monte
    Carlo ``log p(z) - log q(z)`` elsewhere.

    Unlike Pyro's ``TraceMeanField_ELBO`` it never takes the KL of an autoguide's ``Delta`` site:
    that KL (``-log p(z)``) drops the ``Delta``'s log-Jacobian, which biases the gradient of every
    constrained site (a learned noise scale, a hyper scale). Guide sites must be reparameterized.
    """

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        elbo, closed = 0.0, set()
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and not site["is_observed"]:
                guide_site = guide_trace.nodes[name]
                kl = _closed_form_kl(guide_site["fn"], site["fn"])
                if kl is not None:
                    elbo = elbo - scale_and_mask(kl, guide_site["scale"], guide_site["mask"]).sum()
                    closed.add(name)
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample" and name not in closed:
                elbo = elbo + site["log_prob_sum"]
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and name not in closed:
                _, score, entropy = site["score_parts"]
                if not is_identically_zero(score):
                    raise ValueError(
                        f"elbo='mean_field' needs reparameterized guide sites; {name!r} is not. "
                        "Use elbo='trace' or elbo='reinforce'."
                    )
                if not is_identically_zero(entropy):
                    elbo = elbo - entropy.sum()
        return -torch_item(elbo), -elbo


def _closed_form_kl(q, p) -> torch.Tensor | None:
    base = q
    while isinstance(base, torch.distributions.Independent):
        base = base.base_dist
    if isinstance(base, Delta):
        return None
    try:
        kl = torch.distributions.kl_divergence(q, p)
    except NotImplementedError:
        return None
    return kl if kl.shape == q.batch_shape else None


# ---------------------------------------------------------------------- validation
def check_estimator(model, *, guide_is_mean_field: bool, reinforce: bool, vectorize_particles: bool | None) -> None:
    """Raise a clear error unless local reparameterization / flipout can act on ``model``."""
    if not guide_is_mean_field:
        raise ValueError(
            "estimator: 'local_reparam' and 'flipout' need guide='mean_field' (independent Gaussian "
            "weights); with another guide use estimator='sample'."
        )
    if reinforce:
        raise ValueError(
            "estimator: 'local_reparam' and 'flipout' are reparameterized estimators; they do not "
            "combine with elbo='reinforce'. Use elbo='mean_field' (or 'trace')."
        )
    if vectorize_particles:
        raise ValueError(
            "estimator: 'local_reparam' and 'flipout' evaluate particles one after another; pass "
            "vectorize_particles=False (or leave it unset)."
        )
    if not isinstance(model, BNN):
        raise ValueError(
            f"estimator: 'local_reparam' and 'flipout' act on the nn.Linear/nn.Conv layers of a "
            f"bp.BNN; got a {type(model).__name__} (a Pyro function model has no layers). Use "
            "estimator='sample', or wrap the net in bp.BNN(net, prior=..., likelihood=...)."
        )
    if any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.net.modules()):
        raise ValueError(
            "estimator: batch normalization couples the examples of a minibatch, so per-example weight "
            "noise would change the model; use estimator='sample' for this net."
        )
    layers = [
        path
        for path, m in model.net.named_modules()
        if isinstance(m, _LAYER_TYPES) and f"{path}.weight" in model.sample_names
    ]
    if not layers:
        raise ValueError(
            f"estimator: no nn.Linear/nn.Conv1d/2d/3d layer of this BNN has a Bayesian weight (Bayesian "
            f"parameters: {model.sample_names}); use estimator='sample'."
        )
