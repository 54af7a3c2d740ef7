"""Likelihoods: the data plate, minibatch scaling, observation noise and how predictive draws are
aggregated.

Every likelihood is called inside the model as ``likelihood(f, y, dataset_size=N)`` where ``f`` is
the network output shaped ``(..., batch, out)``, or ``(..., batch, T, out)`` for sequence outputs
(``inner_dims=1``: each position is observed, and a row's log density sums over its positions). It samples its own noise sites (outside the data
plate), opens ``pyro.plate("data", size=dataset_size, subsample=...)`` so that a minibatch of
``batch`` rows is scaled by ``dataset_size / batch`` (an unbiased ELBO), records ``f`` as the
deterministic site ``"f"`` and observes ``"obs"``.

Example
-------
>>> import pyro.distributions as dist, bnn_pyro as bp
>>> bp.likelihoods.Gaussian(scale=0.1)                       # known noise
>>> bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))      # noise learned under a prior
>>> bp.likelihoods.Gaussian(precision=dist.Gamma(2.0, 0.1))  # prior on the precision instead
>>> bp.likelihoods.Categorical()                             # logits in, labels 0..K-1 out
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch.distributions import Distribution

from bnn_pyro import predictions
from bnn_pyro.utils.checks import positive, positive_support, pyro_distribution
from bnn_pyro.utils.placement import placed_like

__all__ = ["Likelihood", "Gaussian", "HeteroscedasticGaussian", "Categorical", "Bernoulli"]

# log sqrt(2 pi), the constant of a Gaussian log density: log N(y; mu, s^2) = -HALF_LOG_2PI - log s - (y - mu)^2 / (2 s^2).
# The one copy that the engines' hand-written Gaussian terms (analytic potentials, Laplace evidence, held-out scores) use.
HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class Likelihood:
    """Base class. Subclasses set :attr:`task` and implement :meth:`distribution`,
    :meth:`check_target` and :meth:`summarize`; noise priors go in :meth:`sites`."""

    task: str = "regression"
    identified_as: str = ""
    """What :meth:`identified` makes of ``f`` where it changes it, as a check's message names it (empty: ``f`` whole)."""

    def sites(self) -> dict[str, Distribution]:
        """Hyper sites of the likelihood (e.g. a learned noise scale): name -> prior."""
        return {}

    def distribution(self, f: torch.Tensor, noise: dict[str, torch.Tensor]) -> Distribution:
        """The observation distribution, batch shape ``f.shape[:-1]``, given the sampled noise.
        Noise values carry a trailing singleton dimension that lines up with the data dimension."""
        raise NotImplementedError

    def check_target(self, y: torch.Tensor, out_dim: int) -> torch.Tensor:
        """Validate ``y`` against a network with ``out_dim`` outputs; return it in model layout."""
        raise NotImplementedError

    def summarize(self, d: Distribution, *, interval: float = 0.95):
        """Aggregate a distribution batched over draws ``(S, N)`` into a prediction."""
        raise NotImplementedError

    def probs(self, d: Distribution) -> torch.Tensor:
        """Class probabilities ``(S, N, ..., K)`` of a classification likelihood's distribution batched over
        draws (what its predictions average); regression likelihoods use ``d.mean``, ``d.variance`` and
        ``d.sample()`` instead."""
        raise NotImplementedError(f"{type(self).__name__} is not a classification likelihood.")

    def identified(self, f: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The net's outputs ``f`` (or their Jacobian: the map is linear), ``dim`` their axis, as far as this
        likelihood depends on them: all of ``f`` here. A fit-time check judges these, not a part of ``f`` that only
        the prior identifies and no prediction depends on."""
        return f

    def __call__(
        self, f: torch.Tensor, y: torch.Tensor | None = None, *, dataset_size: int | None = None, inner_dims: int = 0
    ):
        noise = {name: pyro.sample(name, placed_like(prior, f)) for name, prior in self.sites().items()}
        n = f.shape[-2 - inner_dims]
        with pyro.plate("data", size=dataset_size or n, subsample=torch.arange(n, device=f.device)):
            pyro.deterministic("f", f, event_dim=1 + inner_dims)
            return pyro.sample("obs", self.observed(f, noise, inner_dims=inner_dims), obs=y)

    def observed(self, f: torch.Tensor, noise: dict[str, torch.Tensor], *, inner_dims: int = 0) -> Distribution:
        """:meth:`distribution` for outputs ``(..., N, *inner, out)`` with ``inner_dims`` dimensions between
        the row and the output (a sequence's ``T``): the noise is lined up with them and they are folded
        into the event, so that one row's log density is the sum over its positions (batch shape
        ``(..., N)``). ``inner_dims=0`` is :meth:`distribution` itself."""
        if not inner_dims:
            return self.distribution(f, noise)
        noise = {
            k: v.reshape(v.shape + (1,) * inner_dims) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in noise.items()
        }
        return self.distribution(f, noise).to_event(inner_dims)

    def check_output_target(self, y: torch.Tensor, out_shape: torch.Size) -> torch.Tensor:
        """:meth:`check_target` for a net whose rows have outputs ``out_shape``: ``(out,)``, or ``(T, ..., out)``
        for sequences, where ``y`` is checked position by position (``y`` shaped ``(N, T, ...)`` followed by
        what :meth:`check_target` takes for one position, e.g. ``(N, T)`` labels)."""
        if len(out_shape) == 1:
            return self.check_target(y, out_shape[-1])
        inner = tuple(out_shape[:-1])
        if tuple(y.shape[1 : 1 + len(inner)]) != inner:
            raise ValueError(
                f"{type(self).__name__}: the net returns outputs shaped (N, {', '.join(map(str, out_shape))}) per "
                f"input, a sequence of {', '.join(map(str, inner))} positions, but y has shape {tuple(y.shape)}; "
                f"a net must map (N, ...) inputs to (N, out) outputs, or to (N, T, out) outputs for sequences with y "
                f"shaped (N, T) or (N, T, out). Reshape y to one target per position. Add a final Flatten or Linear "
                f"layer if the net should return one output vector per row."
            )
        flat = y.reshape((-1,) + tuple(y.shape[1 + len(inner) :]))
        try:
            checked = self.check_target(flat, out_shape[-1])
        except ValueError as err:
            raise ValueError(
                f"{err} (y checked per position of the sequence output: y shaped {tuple(y.shape)}, "
                f"outputs {tuple(out_shape)} per row)"
            ) from None
        return checked.reshape((y.shape[0],) + inner + tuple(checked.shape[1:]))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _RegressionMixin:
    task = "regression"

    def summarize(self, d, *, interval=0.95):
        return predictions.regression(d.mean, d.variance, d.sample(), interval=interval)


class Gaussian(_RegressionMixin, Likelihood):
    """``y ~ Normal(f, sigma)``.

    Parameters
    ----------
    scale:
        A float for known noise, or a distribution over ``sigma`` (site ``"sigma"``) to learn it.
    precision:
        Alternatively, a distribution over the precision ``1 / sigma**2`` (site ``"precision"``).

    Notes
    -----
    A distribution must have positive support; a ``torch.distributions`` one is converted to the
    ``pyro.distributions`` one of the same name.
    """

    def __init__(self, scale: float | Distribution | None = None, *, precision: Distribution | None = None):
        if scale is not None and precision is not None:
            raise ValueError("Gaussian: give either scale= or precision=, not both.")
        if scale is None and precision is None:
            raise ValueError(
                "Gaussian: give the noise, e.g. scale=0.1 (known) or scale=dist.HalfNormal(1.0) (learned)."
            )
        if precision is not None:
            if isinstance(precision, (int, float)) and not isinstance(precision, bool):
                raise TypeError(
                    f"precision: expected a distribution over the precision 1 / sigma**2 (learned noise), "
                    f"got the number {precision!r}; for known noise pass scale=1 / sqrt(precision), e.g. "
                    f"scale={precision**-0.5 if precision > 0 else 0.1:.3g}."
                )
            self.scale, self.precision = None, _noise_prior("precision", precision, "dist.Gamma(2.0, 0.1)")
        elif isinstance(scale, Distribution):
            self.scale, self.precision = _noise_prior("scale", scale, "dist.HalfNormal(1.0)"), None
        else:
            self.scale, self.precision = positive("scale", scale), None

    def sites(self):
        if self.precision is not None:
            return {"precision": self.precision}
        return {"sigma": self.scale} if isinstance(self.scale, Distribution) else {}

    def noise_scale(self, noise: dict[str, torch.Tensor]):
        if "precision" in noise:
            return noise["precision"].rsqrt()
        return noise.get("sigma", self.scale)

    def distribution(self, f, noise):
        sigma = self.noise_scale(noise)
        if f.shape[-1] == 1:
            return dist.Normal(f[..., 0], sigma)
        return dist.Normal(f, _unsqueeze_last(sigma)).to_event(1)

    def check_target(self, y, out_dim):
        return _regression_target(y, out_dim, self)


class HeteroscedasticGaussian(_RegressionMixin, Likelihood):
    """``y ~ Normal(mu, softplus(rho) + min_scale)`` where the net outputs ``[mu, rho]``
    (``2 * D`` columns for ``D`` targets): the noise depends on the input (aleatoric)."""

    def __init__(self, min_scale: float = 1e-3):
        self.min_scale = positive("min_scale", min_scale)

    def distribution(self, f, noise):
        d = f.shape[-1] // 2
        mu, scale = f[..., :d], F.softplus(f[..., d:]) + self.min_scale
        if d == 1:
            return dist.Normal(mu[..., 0], scale[..., 0])
        return dist.Normal(mu, scale).to_event(1)

    def check_target(self, y, out_dim):
        if out_dim % 2:
            raise ValueError(
                f"HeteroscedasticGaussian needs a net with 2 * D outputs (mean and scale per target); "
                f"this net has {out_dim}. Make the last layer output {2 * out_dim} or use Gaussian."
            )
        return _regression_target(y, out_dim // 2, self)


class Categorical(Likelihood):
    """``y ~ Categorical(logits=f)`` with integer labels ``0..K-1`` for a net with ``K`` outputs."""

    task = "classification"

    def distribution(self, f, noise):
        return dist.Categorical(logits=f)

    def check_target(self, y, out_dim):
        y = _integer_labels(y.reshape(-1) if y.dim() == 2 and y.shape[1] == 1 else y, "Categorical")
        if y.dim() != 1:
            one_hot = " If y is one-hot, pass y.argmax(1)." if y.dim() == 2 and y.shape[1] == out_dim else ""
            raise ValueError(
                f"Categorical: y must be a vector of labels shaped (N,), got shape {tuple(y.shape)}; "
                f"pass one integer class label per row.{one_hot}"
            )
        if y.min() < 0 or y.max() >= out_dim:
            raise ValueError(
                f"Categorical: labels must lie in 0..{out_dim - 1} for a net with {out_dim} outputs; "
                f"found labels in {int(y.min())}..{int(y.max())}. Re-encode the labels or widen the last layer."
            )
        return y

    def summarize(self, d, *, interval=0.95):
        return predictions.classification(self.probs(d))

    def probs(self, d):
        return _base(d).probs

    identified_as = "centred over the classes"

    def identified(self, f, dim=-1):
        """The logits centred over the classes, ``f_k - mean_j f_j``: softmax is unchanged by a shift common to every
        class, so that shift is identified by the prior alone and no prediction depends on it. One class (a degenerate
        model, whose single logit no prediction depends on): ``f`` itself, unchanged."""
        return f - f.mean(dim, keepdim=True) if f.shape[dim] > 1 else f


class Bernoulli(Likelihood):
    """``y ~ Bernoulli(logits=f)`` for a net with one output and labels in ``{0, 1}``.
    Predictions report ``probs`` over the two classes ``[0, 1]``."""

    task = "classification"

    def distribution(self, f, noise):
        return _Bernoulli(logits=f[..., 0])

    def check_target(self, y, out_dim):
        if out_dim != 1:
            raise ValueError(f"Bernoulli needs a net with 1 output (a logit), this net has {out_dim}. Use Categorical.")
        y = _integer_labels(y.reshape(-1) if y.dim() == 2 and y.shape[1] == 1 else y, "Bernoulli", allow_float=True)
        if y.dim() != 1 or not ((y == 0) | (y == 1)).all():
            raise ValueError(
                "Bernoulli: y must be a vector of 0/1 labels shaped (N,). Use Categorical for more classes."
            )
        return y.to(torch.get_default_dtype())

    def summarize(self, d, *, interval=0.95):
        return predictions.classification(self.probs(d))

    def probs(self, d):
        p = _base(d).probs
        return torch.stack([1.0 - p, p], dim=-1)


class _Bernoulli(dist.Bernoulli):
    """Pyro's ``Bernoulli`` scoring labels in the logits' dtype: the labels (0/1, exact in any float dtype) are kept
    in torch's default dtype (:meth:`Bernoulli.check_target`), so a float64 model's would otherwise meet its float64
    logits as float32."""

    def log_prob(self, value):
        return super().log_prob(value.to(self.logits.dtype))


def _base(d: Distribution) -> Distribution:
    """The per-position distribution under the ``to_event`` of sequence outputs (:meth:`Likelihood.observed`)."""
    return _base(d.base_dist) if isinstance(d, dist.Independent) else d


def _noise_prior(argname: str, d, example: str):
    d = pyro_distribution(argname, d, example=example)
    positive_support(argname, d, example=example)
    return d


def _unsqueeze_last(t):
    return t.unsqueeze(-1) if isinstance(t, torch.Tensor) and t.dim() else t


def _regression_target(y: torch.Tensor, out_dim: int, likelihood: Likelihood) -> torch.Tensor:
    name = type(likelihood).__name__
    if not y.dtype.is_floating_point:
        y = y.to(torch.get_default_dtype())
    if out_dim == 1 and y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]
    expected = (y.shape[0],) if out_dim == 1 else (y.shape[0], out_dim)
    if tuple(y.shape) != expected:
        raise ValueError(
            f"{name}: y has shape {tuple(y.shape)} but the net predicts {out_dim} output(s) per row, "
            f"so y must be shaped {expected}. Reshape y or change the last layer."
        )
    return y


def _integer_labels(y: torch.Tensor, name: str, *, allow_float: bool = False) -> torch.Tensor:
    if y.dtype.is_floating_point and allow_float and (y == y.round()).all():
        return y.long()
    if y.dtype.is_floating_point or y.dtype.is_complex:
        raise TypeError(
            f"{name}: y must hold integer class labels (torch.long), got dtype {y.dtype}. "
            "If y holds class indices, pass y.long(); for real-valued targets use a regression likelihood "
            "such as Gaussian."
        )
    return y.long()
