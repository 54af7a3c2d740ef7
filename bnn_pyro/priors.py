"""Priors over network parameters.

A prior answers one question: *which distribution does this parameter get?*

.. code-block:: python

    prior(name: str, module: nn.Module, param: Tensor) -> Distribution | Hierarchical | None

``None`` keeps the parameter deterministic (a point estimate). A returned distribution may be a
scalar one (``dist.Normal(0., 1.)``); :class:`~bnn_pyro.BNN` expands it to the parameter's shape.
A :class:`Hierarchical` adds hyper sites (named ``f"{name}_{suffix}"``) that every engine infers
like weights. A user's prior is any such callable, a ``dict`` from name patterns to distributions
(see :func:`as_prior`), or a subclass of :class:`Prior`.

Example
-------
>>> import pyro.distributions as dist, bnn_pyro as bp
>>> prior = bp.priors.LayerwiseNormal("radford")
>>> prior = {"*.weight": dist.Laplace(0., 1.), "*.bias": dist.Normal(0., 10.)}
>>> prior = lambda name, module, param: dist.StudentT(3., 0., 1.) if param.dim() > 1 else None
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

import pyro.distributions as dist
import torch
from torch import nn
from torch.distributions import Distribution

from bnn_pyro.utils.checks import choice as _choice
from bnn_pyro.utils.checks import instance as _instance
from bnn_pyro.utils.checks import positive as _positive
from bnn_pyro.utils.checks import positive_support as _positive_support
from bnn_pyro.utils.checks import pyro_distribution as _pyro_distribution
from bnn_pyro.utils.checks import real as _real
from bnn_pyro.utils.upstream_private import fan_in_and_fan_out

__all__ = [
    "Prior",
    "Hierarchical",
    "Normal",
    "Laplace",
    "StudentT",
    "LayerwiseNormal",
    "ScaleMixtureNormal",
    "HierarchicalNormal",
    "Horseshoe",
    "Patterns",
    "FromPosterior",
    "from_posterior",
    "as_prior",
    "PriorLike",
]


@dataclass(frozen=True)
class Hierarchical:
    """A prior with hyper sites: ``hyper`` maps a suffix to its hyperprior, and ``conditional``
    builds the parameter's distribution from the sampled hyper values (keyed by suffix).

    Hyper values may carry leading batch dimensions (vectorized particles); ``conditional`` must
    broadcast over them, which :func:`expand_to` does for the common case.
    """

    hyper: Mapping[str, Distribution]
    conditional: Callable[[Mapping[str, torch.Tensor]], Distribution]


class Prior:
    """Base class: subclasses implement :meth:`__call__` and nothing else."""

    def __call__(self, name: str, module: nn.Module, param: torch.Tensor):
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _IID(Prior):
    """The same scalar distribution for every selected parameter entry."""

    def __call__(self, name, module, param):
        return self.distribution()

    def distribution(self) -> Distribution:
        raise NotImplementedError


class Normal(_IID):
    """``w ~ Normal(loc, scale)`` for every entry."""

    def __init__(self, loc: float = 0.0, scale: float = 1.0):
        self.loc, self.scale = _real("loc", loc), _positive("scale", scale)

    def distribution(self):
        return dist.Normal(self.loc, self.scale)


class Laplace(_IID):
    """``w ~ Laplace(loc, scale)``: a sparsity-favouring, heavier-tailed prior."""

    def __init__(self, loc: float = 0.0, scale: float = 1.0):
        self.loc, self.scale = _real("loc", loc), _positive("scale", scale)

    def distribution(self):
        return dist.Laplace(self.loc, self.scale)


class StudentT(_IID):
    """``w ~ StudentT(df, loc, scale)`` (Fortuin et al. 2021 found heavy tails help BNNs)."""

    def __init__(self, df: float = 3.0, loc: float = 0.0, scale: float = 1.0):
        self.df, self.loc, self.scale = _positive("df", df), _real("loc", loc), _positive("scale", scale)

    def distribution(self):
        return dist.StudentT(self.df, self.loc, self.scale)


class FanScaling(str, Enum):
    """How :class:`LayerwiseNormal` scales the standard deviation with a layer's fan."""

    RADFORD = "radford"  # Neal (1996): std = scale / sqrt(fan_in), the infinite-width limit
    XAVIER = "xavier"  # Glorot & Bengio (2010): std = scale * sqrt(2 / (fan_in + fan_out))
    KAIMING = "kaiming"  # He et al. (2015): std = scale * sqrt(2 / fan_in)


class LayerwiseNormal(Prior):
    """``w ~ Normal(0, std)`` with ``std`` set by the layer's fan-in (and fan-out).

    Biases get the standard deviation of their layer's weight (fan-in of ``module.weight``).
    """

    def __init__(self, scaling: str | FanScaling = "radford", scale: float = 1.0):
        self.scaling = _choice("scaling", scaling, FanScaling)
        self.scale = _positive("scale", scale)

    def __call__(self, name, module, param):
        weight = getattr(module, "weight", None)
        ref = weight if isinstance(weight, torch.Tensor) and weight.dim() >= 2 else param
        if ref.dim() >= 2:
            fan_in, fan_out = fan_in_and_fan_out(ref)
        else:  # a lone vector (e.g. a bias without a weight): treat each entry as a unit
            fan_in = fan_out = 1
        std = {
            FanScaling.RADFORD: 1.0 / math.sqrt(fan_in),
            FanScaling.XAVIER: math.sqrt(2.0 / (fan_in + fan_out)),
            FanScaling.KAIMING: math.sqrt(2.0 / fan_in),
        }[self.scaling]
        return dist.Normal(0.0, self.scale * std)


class ScaleMixtureNormal(_IID):
    """``w ~ pi N(0, sigma1^2) + (1 - pi) N(0, sigma2^2)`` (Blundell et al. 2015, Bayes by Backprop).

    There is no closed-form KL to a Gaussian guide, so ``elbo="mean_field"`` falls back to a
    Monte Carlo estimate for these sites.
    """

    def __init__(self, pi: float = 0.5, sigma1: float = 1.0, sigma2: float = math.exp(-6)):
        if not 0.0 < pi < 1.0:
            raise ValueError(f"ScaleMixtureNormal: pi must lie in (0, 1), got {pi}.")
        self.pi, self.sigma1, self.sigma2 = pi, _positive("sigma1", sigma1), _positive("sigma2", sigma2)

    def distribution(self):
        mix = dist.Categorical(probs=torch.tensor([self.pi, 1.0 - self.pi]))
        return dist.MixtureSameFamily(mix, dist.Normal(torch.zeros(2), torch.tensor([self.sigma1, self.sigma2])))


class HierarchicalNormal(Prior):
    """``s ~ hyperprior``, ``w ~ Normal(0, s)`` with one scale ``s`` per parameter tensor.

    The hyper site is ``f"{name}_scale"``. The default hyperprior is ``HalfNormal(1)``; for a
    prior over precisions use e.g. ``hyperprior=dist.InverseGamma(1., 1.)`` on the variance by
    passing ``on="variance"``. The hyperprior must have positive support; a ``torch.distributions``
    one is converted to its ``pyro.distributions`` counterpart.
    """

    def __init__(self, hyperprior: Distribution | None = None, on: str = "scale"):
        if on not in ("scale", "variance"):
            raise ValueError(f"HierarchicalNormal: on must be 'scale' or 'variance', got {on!r}; pass one of them.")
        hyperprior = dist.HalfNormal(1.0) if hyperprior is None else hyperprior
        self.hyperprior = _pyro_distribution("hyperprior", hyperprior, example="dist.HalfNormal(1.0)")
        _positive_support("hyperprior", self.hyperprior)
        self.on = on

    def __call__(self, name, module, param):
        shape = param.shape

        def conditional(h):
            s = h[self.on] if self.on == "scale" else h[self.on].sqrt()
            return expand_to(dist.Normal(0.0, _lift(s, len(shape))), shape)

        return Hierarchical(hyper={self.on: self.hyperprior}, conditional=conditional)


class Horseshoe(Prior):
    """Horseshoe prior (Carvalho et al. 2010; Ghosh et al. 2019 for BNNs).

    ``tau ~ HalfCauchy(global_scale)`` per tensor, ``lambda_j ~ HalfCauchy(1)`` per input unit
    (the last dimension of a weight; per entry for a vector), ``w_ij ~ Normal(0, tau * lambda_j)``.
    Hyper sites: ``f"{name}_tau"`` and ``f"{name}_lambda"``. The centred form shown here is what
    SVI wants; for NUTS, expect divergences at small tau (the funnel) and prefer SVI or a larger
    ``target_accept``.
    """

    def __init__(self, global_scale: float = 1.0):
        self.global_scale = _positive("global_scale", global_scale)

    def __call__(self, name, module, param):
        shape = param.shape
        units = shape[-1:] if len(shape) else torch.Size()

        def conditional(h):
            tau = _lift(h["tau"], len(shape))
            lam = h["lambda"].reshape(
                h["lambda"].shape[: h["lambda"].dim() - len(units)] + (1,) * (len(shape) - len(units)) + units
            )
            return expand_to(dist.Normal(0.0, tau * lam), shape)

        return Hierarchical(
            hyper={"tau": dist.HalfCauchy(self.global_scale), "lambda": expand_to(dist.HalfCauchy(1.0), units)},
            conditional=conditional,
        )


class Patterns(Prior):
    """A prior from a ``dict`` of ``fnmatch`` name patterns (first match wins) to a distribution,
    a prior, or ``None``. Parameters that match no pattern stay deterministic unless ``default``
    is given (a :class:`~bnn_pyro.BNN` lists them in ``point_names`` and its repr).

    :class:`~bnn_pyro.BNN` calls :meth:`check_names` with its net's parameter names: a pattern that
    matches none of them, or only parameters an earlier pattern already took, is an error (a typo
    would otherwise leave those weights deterministic without a word).
    """

    def __init__(self, table: Mapping[str, object], default: object = None):
        for pattern in table:
            if not isinstance(pattern, str):
                raise TypeError(
                    f"prior: a dict prior maps name patterns (str) to distributions, got the key "
                    f"{pattern!r}; use patterns such as {{'0.*': dist.Normal(0., 1.)}}."
                )
        self.table = {pattern: _as_choice(f"prior[{pattern!r}]", choice) for pattern, choice in table.items()}
        self.default = _as_choice("default", default)

    def check_names(self, names: list[str]) -> None:
        """Raise a ``ValueError`` for a pattern that decides no parameter among ``names``."""
        taken: dict[str, str] = {}  # parameter -> the first pattern that matches it
        for name in names:
            first = next((p for p in self.table if fnmatch.fnmatchcase(name, p)), None)
            if first is not None:
                taken[name] = first
        for pattern in self.table:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(
                    f"prior: the pattern {pattern!r} matches no parameter of the net; its parameters "
                    f"are {names}. Check the pattern against these names (e.g. '0.*' or '*.weight')."
                )
            if all(taken[n] != pattern for n in matched):
                earlier = sorted({taken[n] for n in matched})
                raise ValueError(
                    f"prior: the pattern {pattern!r} is never used: every parameter it matches "
                    f"({matched}) is matched first by {earlier} (the first matching pattern wins). "
                    "Move the more specific pattern before it."
                )

    def __call__(self, name, module, param):
        for pattern, choice in self.table.items():
            if fnmatch.fnmatchcase(name, pattern):
                return _resolve(choice, name, module, param)
        return _resolve(self.default, name, module, param)


class FromPosterior(Prior):
    """A fitted posterior as the prior of the next task: ``w ~ Normal(mean, sd)`` of its draws, per entry.

    Variational continual learning (Nguyen, Li, Bui & Turner 2018, "Variational continual
    learning"): after task ``t`` the approximate posterior ``q_t(w)`` becomes the prior of task
    ``t + 1``, so that ``p(w | D_1..D_t+1) ∝ p(D_t+1 | w) q_t(w)`` (Bayes' rule applied task by task).
    Here ``q_t`` is the mean-field Gaussian that matches the draws' moments per weight entry: the
    mean and the standard deviation (``correction=1``) over all chains and draws. For a mean-field
    SVI posterior this is its guide up to Monte Carlo error (relative error of the sd about
    ``1 / sqrt(2 S)`` for ``S`` draws); for any other posterior (MCMC, full-rank, ensembles) it drops
    the correlations between entries. When the posterior is itself a diagonal Gaussian the update is
    exact: e.g. Bayesian linear regression whose design columns are orthogonal on every task.

    Only the weight sites of the posterior's ``BNN`` (its ``sample_names``) carry over: hyper sites
    of a hierarchical prior (their weights' marginal is what is matched) and the likelihood's noise
    sites are left to the new model's own prior and likelihood. Build the new ``BNN`` with the same
    architecture; a parameter the posterior lacks (e.g. a new task's head) gets ``default``, or an
    error that names it. Use :func:`from_posterior` to build one.
    """

    def __init__(self, loc: Mapping[str, torch.Tensor], scale: Mapping[str, torch.Tensor], default=None):
        self.loc = {k: v.detach().clone() for k, v in loc.items()}
        self.scale = {k: v.detach().clone() for k, v in scale.items()}
        self.default = None if default is None else as_prior(default)

    def __call__(self, name, module, param):
        if name not in self.loc:
            if self.default is not None:
                return self.default(name, module, param)
            raise ValueError(
                f"from_posterior: the new net has a parameter {name!r} that the posterior has no draws of (its weight "
                f"sites: {sorted(self.loc)}). Build the net with the same architecture (and module names), pass "
                "default=... for new parameters (e.g. default=bp.priors.Normal(0., 1.)), or leave it deterministic "
                "with BNN(bayesian=...)."
            )
        if tuple(param.shape) != tuple(self.loc[name].shape):
            raise ValueError(
                f"from_posterior: parameter {name!r} has shape {tuple(param.shape)} in the new net but "
                f"{tuple(self.loc[name].shape)} in the posterior. Build the new net with the same layer sizes."
            )
        loc, scale = self.loc[name].to(param), self.scale[name].to(param)
        return dist.Normal(loc, scale)

    def __repr__(self) -> str:
        size = sum(v.numel() for v in self.loc.values())
        return f"FromPosterior(sites={sorted(self.loc)}, entries={size}, default={self.default!r})"


def from_posterior(posterior, *, default: PriorLike | None = None) -> FromPosterior:
    """The moment-matched mean-field Gaussian of ``posterior``'s weights, as a prior (see :class:`FromPosterior`).

    Parameters
    ----------
    posterior:
        A :class:`~bnn_pyro.Posterior` of a :class:`~bnn_pyro.BNN` (any engine; at least two draws
        in all, e.g. ``num_samples`` draws of SVI, MCMC chains, ensemble members).
    default:
        Prior for parameters of the new net that the posterior does not have (e.g. a new head);
        without it such a parameter is an error.

    Example
    -------
    >>> post_a = bp.fit(model_a, x_a, y_a, method="svi", num_steps=3000)
    >>> model_b = bp.BNN(net, prior=bp.priors.from_posterior(post_a), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    >>> post_b = bp.fit(model_b, x_b, y_b, method="svi", num_steps=3000)    # posterior after tasks A and B
    """
    samples = getattr(posterior, "samples", None)
    if not isinstance(samples, Mapping):
        raise TypeError(
            f"posterior: expected a bnn_pyro.Posterior (the result of bp.fit), got {type(posterior).__name__}."
        )
    model = posterior.model
    if getattr(model, "is_unbound", False):  # bp.load without model=: the saved model's fingerprint
        names = model.fingerprint.get("sample_names") if model.fingerprint.get("kind") == "BNN" else None
    else:  # a bp.BNN's weight sites (this module is imported by bnn_pyro.model, so asks by name)
        names = getattr(model, "sample_names", None)
    if names is not None:
        names = list(names)
    else:
        raise ValueError(
            f"from_posterior: the posterior's sites {sorted(samples)} are not the weight tensors of a bp.BNN "
            "(its model is a Pyro function), so they cannot be matched to a net's parameters. Fit a bp.BNN on the "
            "first task."
        )
    if not names:
        raise ValueError("from_posterior: the posterior has no Bayesian weights (every parameter was deterministic).")
    loc, scale = {}, {}
    for name in names:
        draws = samples[name].detach()
        draws = draws.reshape((-1,) + draws.shape[2:])
        if draws.shape[0] < 2:
            raise ValueError(
                f"from_posterior: {name!r} has {draws.shape[0]} draw; a spread needs at least 2. Fit with "
                "more draws (num_samples= or num_chains=)."
            )
        loc[name], scale[name] = draws.mean(0), draws.std(0)
        bad = ~(torch.isfinite(scale[name]) & (scale[name] > 0))
        if bad.any():
            raise ValueError(
                f"from_posterior: {int(bad.sum())} entries of {name!r} have zero or non-finite spread "
                "over the draws (a point mass cannot be a Normal prior). Use a posterior with spread in "
                "every weight."
            )
    return FromPosterior(loc, scale, default=default)


PriorLike = Prior | Callable | Mapping[str, object] | Distribution


def as_prior(prior: PriorLike) -> Callable:
    """Turn anything a user may pass as ``prior=`` into a callable ``(name, module, param)``.

    A ``torch.distributions`` distribution (alone, or as a value of a dict) becomes the
    ``pyro.distributions`` one of the same name and parameters."""
    _instance("prior", prior, "bp.priors.Normal(0., 1.)")
    if isinstance(prior, Mapping):
        return Patterns(prior)
    if isinstance(prior, Distribution):
        prior = _pyro_distribution("prior", prior)
        return lambda name, module, param: prior
    if callable(prior):
        return prior
    raise TypeError(
        f"prior: expected a bnn_pyro.priors.Prior, a callable (name, module, param) -> Distribution | None, "
        f"a dict from name patterns to distributions, or a Distribution; got {type(prior).__name__}. "
        "Try prior=bp.priors.Normal(0., 1.)."
    )


def expand_to(d: Distribution, shape: torch.Size) -> Distribution:
    """Expand ``d`` (whose batch shape broadcasts to ``(*batch, *shape)``) and declare ``shape``
    as its event shape. Leading batch dimensions (particles, draws) are kept."""
    shape = torch.Size(shape)
    batch = d.batch_shape[: max(len(d.batch_shape) - len(shape), 0)]
    return d.expand(batch + shape).to_event(len(shape)) if len(shape) else d.expand(batch)


def _lift(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Append ``ndim`` singleton dimensions so a per-tensor hyper value broadcasts over a weight."""
    return t.reshape(t.shape + (1,) * ndim)


def _as_choice(argname: str, choice):
    """A dict prior's value as it is used: a Pyro distribution (torch ones converted), a prior, or None."""
    if isinstance(choice, Distribution):
        return _pyro_distribution(argname, choice)
    if choice is None or isinstance(choice, Hierarchical) or (callable(choice) and not isinstance(choice, type)):
        return choice
    _instance(argname, choice, "dist.Normal(0., 1.)")
    raise TypeError(
        f"{argname}: expected a Distribution, a prior or None, got {type(choice).__name__} {choice!r}; "
        "use e.g. dist.Normal(0., 1.) (import pyro.distributions as dist)."
    )


def _resolve(choice, name, module, param):
    if choice is None or isinstance(choice, (Distribution, Hierarchical)):
        return choice
    return choice(name, module, param)  # a prior (checked by _as_choice)
