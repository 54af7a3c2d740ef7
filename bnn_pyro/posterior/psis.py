"""Pareto-smoothed importance sampling as a diagnostic of an approximate posterior (Yao et al. 2018).

An approximation ``q`` (an SVI guide, a Laplace or SWAG Gaussian) is good where the importance
ratios ``r_s = p(w_s, y | x) / q(w_s)`` of its own draws ``w_s ~ q`` are nearly constant. PSIS fits a
generalized Pareto distribution to the largest ratios; its shape ``k_hat`` says how heavy their tail
is (Yao, Vehtari, Simpson & Gelman 2018, "Yes, but did it work?: Evaluating variational inference"):

- ``k_hat < 0.5``: ``q`` is close to the posterior; importance-reweighted estimates converge fast.
- ``0.5 <= k_hat <= 0.7``: usable; reweighted estimates are better than ``q``'s own but noisier.
- ``k_hat > 0.7``: the ratios have (nearly) infinite variance: ``q`` misses mass the posterior has
  (typically ``q`` is too narrow), and neither ``q`` nor reweighting can be trusted. A
  :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning` says so, with what to try.

The ratios are taken in the UNCONSTRAINED coordinates ``z = T^-1(w)`` in which every ``q`` here is
defined (``T = biject_to(support)``, e.g. ``sigma = exp(z)`` for a learned noise scale)::

    log r_s = log p(T(z_s), y | x) + log |det dT/dz (z_s)| - log q(z_s)

``log q`` is the one the engine recorded at each draw (``post.sample_stats["log_q"]``,
:mod:`bnn_pyro.infer._density`); ``log p`` is the model's log joint density on the training data, or
on the ``x``, ``y`` given (with no minibatch scaling). Constants (the evidence, sites that ``q``
holds fixed, e.g. all but the last layer under Laplace's default ``structure="last_layer"``, where the
ratio then judges ``q`` against the posterior of the covered sites given the others) cancel in
normalized weights. Each chain (an independent restart with its own ``q``) is smoothed on its own
(``arviz.psislw``, ``reff=1``: independent draws); ``k_hat`` is the largest over chains, and the
pooled weights give every chain the same total weight.

Methods with no density: an ensemble (and SWA, MAP, MC dropout) is a set of points, i.e. a mixture
of point masses, so ``p / q`` is undefined; MCMC draws come from a Markov chain whose marginal law is
the posterior itself, not from a ``q`` that can be evaluated. :func:`psis` raises for them. With a
fitted prior (Laplace ``prior_precision`` other than ``"model"``, SVI ``empirical_bayes``) ``q``
targets the posterior under that prior while ``p`` is the model's own: ``k_hat`` measures both gaps.

Example
-------
>>> post = bp.fit(model, x, y, method="svi", guide="full_rank", num_steps=3000, seed=0)
>>> check = post.psis()                  # PSISResult(k_hat=0.21, ess=742.3, ...)
>>> pred = check.predict(x_test)         # importance-reweighted predictive (k_hat <= 0.7 only)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from pyro import poutine
from torch.distributions import Distribution, biject_to

from bnn_pyro.model import BNN
from bnn_pyro.utils import user_warnings
from bnn_pyro.utils.checks import check_data, match_columns, positive_int
from bnn_pyro.utils.checks import seed as check_seed
from bnn_pyro.utils.upstream_private import PARETO_MIN_DRAWS

__all__ = ["PSISResult", "psis", "resample", "K_HAT_MAX", "MIN_DRAWS_PER_CHAIN", "RELIABLE_DRAWS_PER_CHAIN"]

K_HAT_MAX = 0.7  # Yao et al. (2018): above it the importance ratios' variance is (nearly) infinite
MIN_DRAWS_PER_CHAIN = PARETO_MIN_DRAWS
"""The fewest draws of one chain from which :func:`psis` estimates ``k_hat``. ``arviz.psislw`` fits the generalized
Pareto law to the largest ``M = ceil(min(0.2 S, 3 sqrt(S)))`` of ``S`` ratios and needs ``M >= 5`` of them (with
fewer it returns ``k_hat = inf``, and with one draw it fails with an IndexError): ``0.2 S > 4``, so ``S >= 21``."""

RELIABLE_DRAWS_PER_CHAIN = 100
"""The fewest draws per chain from which a ``k_hat > 0.7`` is read as a verdict on ``q``. From
:data:`MIN_DRAWS_PER_CHAIN`, where it is defined, to well above, the Pareto fit to ``ceil(min(0.2 S, 3 sqrt(S)))``
tail ratios is noisy, and :func:`psis` reports the largest over chains. For a good ``q`` (1.2 times wider than ``p``,
``d = 3``, true ``k <= 0``) the largest ``k_hat`` of 4-5 chains exceeds 0.7 in 22-30% of runs at 21-25 draws per
chain, 2-4% at 30-40, under 1% at 50-75 and in 0 of 1000 runs (under 0.3% at 95%) at 100-200
(``benchmarks/results/psis_khat_noise/``). :func:`~bnn_pyro.infer.health_spread.check_gaussian` judges from here on, and
:func:`psis`'s warning says when fewer draws make ``k_hat`` noisy."""

_NO_DENSITY = {
    "ensemble": "an ensemble is a set of trained networks, i.e. a mixture of point masses with no density, so "
    "the ratio p(w, y) / q(w) is undefined",
    "swa": "SWA is one averaged point per chain (a point mass with no density)",
    "mc_dropout": "MC dropout's draws are a network under random masks: a discrete mixture of point masses in "
    "weight space, with no density",
}


@dataclass(frozen=True)
class PSISResult:
    """What :func:`psis` returns.

    Attributes
    ----------
    k_hat:
        The Pareto shape estimate: the largest over chains (see the module docstring for its scale).
    k_hat_per_chain:
        ``(chains,)``.
    ess:
        Effective sample size of the pooled smoothed weights, ``1 / sum_s w_s^2``.
    log_weights:
        Normalized smoothed log weights ``(chains, draws)`` of every stored draw (``-inf`` for a draw
        not used when ``num_samples`` picked a subset); ``weights`` is their exponential.
    num_draws:
        The number of draws used.
    """

    k_hat: float
    k_hat_per_chain: np.ndarray = field(repr=False)
    ess: float
    log_weights: torch.Tensor = field(repr=False)
    num_draws: int
    posterior: object = field(repr=False)

    @property
    def weights(self) -> torch.Tensor:
        return self.log_weights.exp()

    @property
    def reliable(self) -> bool:
        """``k_hat <= 0.7``: reweighted estimates can be used."""
        return self.k_hat <= K_HAT_MAX

    def predict(self, x, *, force: bool = False, **kwargs):
        """The importance-reweighted posterior predictive at ``x``: ``post.predict(x, weights=self.weights,
        **kwargs)`` (systematic resampling of the draws by their weights, :func:`resample`). Refuses when
        ``k_hat > 0.7`` (the reweighted estimate is then unreliable) unless ``force=True``."""
        if not self.reliable and not force:
            raise ValueError(
                f"psis: k_hat = {self.k_hat:.2f} > {K_HAT_MAX}, so importance-reweighted predictions are "
                "unreliable. Improve the approximation (see the warning psis gave), or pass force=True "
                "to get them anyway."
            )
        return self.posterior.predict(x, weights=self.weights, **kwargs)


def psis(post, x=None, y=None, *, num_samples: int | None = None, seed: int = 0, warn: bool = True) -> PSISResult:
    """Pareto-smoothed importance sampling of ``post``'s draws against the model's posterior.

    Parameters
    ----------
    post:
        A :class:`~bnn_pyro.Posterior` from an engine that records ``log q`` (``svi`` with a
        ``mean_field``, ``low_rank`` or ``full_rank`` guide, ``laplace``, ``swag``).
    x, y:
        The data of the target posterior ``p(w | x, y)``: both, or neither (the training data).
    num_samples:
        How many of the stored draws to use (all by default). Otherwise a random subset chosen with ``seed``,
        stratified by chain: ``num_samples // num_chains`` draws of each chain (one more for the first
        ``num_samples % num_chains`` chains), since each chain is smoothed on its own and needs at least
        :data:`MIN_DRAWS_PER_CHAIN` (21) of them, so ``num_samples >= 21 * num_chains``; a stratified subset makes
        that count, and so whether the call runs, independent of ``seed``. A chain gives at most its stored draws
        (drawn without replacement), so ``num_samples`` above ``num_chains * num_draws`` uses every draw. ``q``'s draws are the ones the fit
        stored: to use more, fit with more ``num_samples``.
    warn:
        Warn (:class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning`) when ``k_hat > 0.7``.
    """
    _require_density(post)
    x, y = _target_data(post, x, y)
    idx = _stratified_index(post, num_samples, seed)
    _require_draws(post, idx, num_samples)
    log_p = _log_joint(post, x, y, idx)
    log_q = post.sample_stats["log_q"].reshape(-1)[idx].double().cpu()
    log_r = (log_p - log_q).numpy()
    if not np.isfinite(log_r).all():
        raise FloatingPointError(
            f"psis: {int((~np.isfinite(log_r)).sum())} of {len(log_r)} log importance ratios are "
            "not finite (a draw where the model's density or q's is zero or overflows)."
        )
    import arviz as az

    chain = (idx // post.num_draws).numpy()
    chains = np.unique(chain)
    log_w = np.full(post.num_chains * post.num_draws, -np.inf)
    k_hat = np.full(post.num_chains, np.nan)
    for c in chains:
        sel = chain == c
        smoothed, k = az.psislw(log_r[sel].copy(), reff=1.0)
        log_w[idx.numpy()[sel]] = smoothed - np.log(len(chains))
        k_hat[c] = float(k)
    weights = np.exp(log_w)
    result = PSISResult(
        k_hat=float(np.nanmax(k_hat)),
        k_hat_per_chain=k_hat,
        ess=float(1.0 / (weights**2).sum()),
        log_weights=torch.from_numpy(log_w).reshape(post.num_chains, post.num_draws),
        num_draws=len(idx),
        posterior=post,
    )
    if warn and not result.reliable:
        from bnn_pyro.posterior.diagnostics import DiagnosticWarning

        fewest = int(np.bincount(chain, minlength=post.num_chains)[chains].min())
        noisy = (
            ""
            if fewest >= RELIABLE_DRAWS_PER_CHAIN
            else f" With {fewest} draws per chain k_hat itself is noisy (a good q exceeds {K_HAT_MAX} in up to 1 run "
            f"in 4 at 21-25 draws per chain): confirm with >= {RELIABLE_DRAWS_PER_CHAIN} draws per chain."
        )

        user_warnings.warn(
            f"psis: Pareto k_hat = {result.k_hat:.2f} > {K_HAT_MAX} for this {post.method} approximation (ESS of the "
            f"weights {result.ess:.0f} of {len(idx)}): q misses posterior mass (usually it is too narrow), so its "
            "means, intervals and predictions, and importance-reweighted ones, are unreliable (Yao et al. 2018). "
            "Try a richer approximation (svi guide='full_rank' or 'low_rank'; laplace structure='full'), a longer "
            "fit, or an MCMC method (method='nuts')." + noisy,
            DiagnosticWarning,
        )
    return result


def resample(weights: torch.Tensor, num_samples: int, *, seed: int | None = None) -> torch.Tensor:
    """Systematic resampling (Kitagawa 1996): ``num_samples`` indices into the flattened ``weights``
    (non-negative, any total), each index ``s`` appearing ``floor`` or ``ceil`` of ``num_samples * w_s``
    times; a weighted average is reproduced to within ``1 / num_samples`` of its range."""
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if not bool((w >= 0).all()) or not float(w.sum()) > 0:
        raise ValueError(
            "weights: expected non-negative numbers with a positive sum, one per stored draw "
            "(chains * draws), e.g. PSISResult.weights."
        )
    g = torch.Generator().manual_seed(0 if seed is None else check_seed("seed", seed))
    u = (
        torch.arange(num_samples, dtype=torch.float64) + torch.rand((), generator=g, dtype=torch.float64)
    ) / num_samples
    cdf = (w / w.sum()).cumsum(0)
    return torch.searchsorted(cdf, u.clamp_max(float(cdf[-1]) - 1e-15)).clamp_max(len(w) - 1)


# ----------------------------------------------------------------------------------------- internals
def _no_method_facts(method: str) -> bool:
    return False


is_markov_chain: Callable[[str], bool] = _no_method_facts
"""``is_markov_chain(method)``: does the method draw from a Markov chain (no density q to weigh against)? Set by
:mod:`bnn_pyro.infer.registry` to read each method's declaration (``Capabilities.markov_chain``): the posterior layer
does not import the engines' layer, the registry hands the fact down."""


def _require_density(post) -> None:
    if "log_q" in post.sample_stats:
        return
    method = post.method
    if isinstance(method, str) and is_markov_chain(method):
        raise ValueError(
            f"psis: method {method!r} draws from a Markov chain, not from an approximation q with a "
            "density, so there is no importance ratio p / q to check; use post.summary() (R-hat, ESS) "
            "for its convergence instead."
        )
    why = _NO_DENSITY.get(method)
    if why is None and method == "svi":
        why = (
            f"the svi guide {post.config.get('guide')!r} records no density (guide='map' is a point mass; a "
            "hand-written guide's sites cannot be told from auxiliary variables)"
        )
    why = why or f"method {method!r} records no density of its approximation (post.sample_stats['log_q'])"
    raise ValueError(
        f"psis: {why}. It needs draws from a q with a density: svi with guide='mean_field', "
        "'low_rank' or 'full_rank', laplace, or swag."
    )


def _stratified_index(post, num_samples: int | None, seed: int) -> torch.Tensor:
    """Pooled indices (chain-major) of the draws :func:`psis` uses: every stored draw without ``num_samples``;
    else ``num_samples // num_chains`` draws of each chain (one more for the first ``num_samples % num_chains``),
    picked without replacement by a generator seeded by ``seed``, at most every draw of a chain. Stratified because
    each chain is smoothed on its own: a subset across chains would leave a chain below
    :data:`MIN_DRAWS_PER_CHAIN` at some seeds and not at others."""
    chains, draws = post.num_chains, post.num_draws
    if num_samples is None:
        return torch.arange(chains * draws)
    n = positive_int("num_samples", num_samples)
    g = torch.Generator().manual_seed(check_seed("seed", seed))
    per = [min(draws, n // chains + (c < n % chains)) for c in range(chains)]
    return torch.cat([c * draws + torch.randperm(draws, generator=g)[:k] for c, k in enumerate(per)]).sort().values


def _require_draws(post, idx: torch.Tensor, num_samples: int | None) -> None:
    """A ``ValueError`` when a chain has fewer than :data:`MIN_DRAWS_PER_CHAIN` of the draws used: its ``k_hat``
    is undefined (``arviz.psislw`` returns ``inf`` for it, which read as "q misses mass", or fails on one draw)."""
    counts = torch.bincount(idx // post.num_draws, minlength=post.num_chains)
    fewest = int(counts.min())
    if fewest >= MIN_DRAWS_PER_CHAIN:
        return
    why = (
        f"the Pareto tail fit needs at least {MIN_DRAWS_PER_CHAIN} draws per chain (it fits the largest "
        "ceil(min(0.2 S, 3 sqrt(S))) of S ratios and needs 5), and each chain's q is smoothed on its own, so more "
        "chains do not help."
    )
    if num_samples is not None and int(post.num_draws) >= MIN_DRAWS_PER_CHAIN:  # the subset, not the fit, is short
        raise ValueError(
            f"psis: num_samples={num_samples} over {post.num_chains} chains leaves a chain with {fewest} "
            f"draw{'s' if fewest != 1 else ''}, too few for k_hat: {why} Pass num_samples >= "
            f"{MIN_DRAWS_PER_CHAIN * post.num_chains} ({MIN_DRAWS_PER_CHAIN} per chain), or omit it (every stored "
            "draw)."
        )
    raise ValueError(
        f"psis: k_hat is undefined from {fewest} draw{'s' if fewest != 1 else ''} of a chain: {why} Fit with "
        f"num_samples >= {MIN_DRAWS_PER_CHAIN} draws per chain."
    )


def _target_data(post, x, y):
    if (x is None) != (y is None):
        raise ValueError(
            "psis: give both x= and y= (the data of the target posterior), or neither (the training data)."
        )
    if x is None:
        if post.x is None or post.y is None:
            raise ValueError(
                "psis: this posterior holds no training data (the fit streamed batches from a loader); "
                "pass x= and y= (e.g. the training set, or a subset of it that fits in memory)."
            )
        return post.x, post.y
    is_bnn = isinstance(post.model, BNN)
    return check_data(
        match_columns(x, post.feature_names),  # a DataFrame's columns by name, as predict reads them
        y,
        device=post.model.device if is_bnn else None,
        float_dtype=post.model.dtype if is_bnn else None,
        keep_integer=is_bnn and post.model.integer_inputs,
    )


def _log_joint(post, x, y, idx: torch.Tensor) -> torch.Tensor:
    """``log p(w, y | x) + log |det dT/dz|`` of the pooled draws ``idx``, float64 ``(len(idx),)``."""
    flat = post.sample()
    with torch.no_grad():
        if isinstance(post.model, BNN):
            ll = post.observation_distribution(x, idx).log_prob(y).reshape(len(idx), -1).sum(-1).double().cpu()
            return ll + _bnn_log_prior(post, flat, idx, x, y)
        out = []
        for i in idx.tolist():
            trace = post.trace_draw(i, x, y)  # conditioned: latent sites are marked observed too
            out.append(
                sum(
                    _site_log_prob(site, site["name"] in post.samples)
                    for site in trace.nodes.values()
                    if site["type"] == "sample"
                )
            )
        return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out]).cpu()


def _bnn_log_prior(post, flat, idx, x, y) -> torch.Tensor:
    """The prior (with Jacobians) of a BNN's latent sites: batched from the sites' own priors
    (:meth:`~bnn_pyro.BNN.prior_distributions` and the likelihood's noise sites) where none depends on another
    site (no hyper sites), else one trace per draw."""
    model = post.model
    priors = None if model.hyper_names else {**model.prior_distributions(), **model.likelihood.sites()}
    if priors is not None and all(isinstance(prior, Distribution) for prior in priors.values()):
        total = torch.zeros(len(idx), dtype=torch.float64)
        for name, prior in priors.items():
            w = flat[name][idx]
            total += prior.log_prob(w).double().reshape(len(idx), -1).sum(-1).cpu() + _log_jacobian(prior, w, len(idx))
        return total
    out = []
    for i in idx.tolist():
        trace = post.trace_draw(i, x[:1], y[:1])
        out.append(sum(_site_log_prob(s, True) for s in trace.nodes.values() if s["name"] in post.samples))
    return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out]).cpu()


def _site_log_prob(site, latent: bool) -> torch.Tensor:
    """A traced site's log density (scaled and masked as Pyro does), plus its log-Jacobian when latent."""
    if poutine.util.site_is_subsample(site):
        return torch.zeros((), dtype=torch.float64)
    value = site["fn"].log_prob(site["value"])
    if site["mask"] is not None:
        value = value * site["mask"]
    if site["scale"] is not None:
        value = value * site["scale"]
    value = value.double().sum()
    if latent:
        value = value + _log_jacobian(site["fn"], site["value"], None)
    return value


def _log_jacobian(d, w: torch.Tensor, batch: int | None) -> torch.Tensor:
    """``log |det dT/dz|`` at ``z = T^-1(w)`` for ``T = biject_to(d.support)``, summed per draw (a
    leading dimension of ``batch`` draws) or in all."""
    t = biject_to(d.support)
    lad = t.log_abs_det_jacobian(t.inv(w), w).double()
    return lad.reshape(batch, -1).sum(-1).cpu() if batch is not None else lad.sum().cpu()
