"""Simulation-based calibration (Talts, Betancourt, Simpson, Vehtari & Gelman 2018).

If an engine samples the posterior exactly, then drawing ``theta ~ p(theta)``, simulating
``y ~ p(y | x, theta)`` and fitting gives draws among which ``theta`` sits at a uniformly distributed
rank: with ``L`` (independent) posterior draws, every rank ``0..L`` has probability ``1 / (L + 1)``.
A sampler that is too narrow piles the ranks at both ends (a U), one too wide in the middle (a hump),
a biased one on one side. :func:`run` does the loop for any model and engine; :func:`chi_square`
tests the ranks for uniformity; :func:`plot` draws the rank histograms with the band that holds 99%
of a uniform histogram's bars.

The posterior draws are thinned evenly to ``num_draws`` (``L``) per replication, so that they are
close to independent (Talts et al.: autocorrelated draws distort the histogram).

Example
-------
>>> net = torch.nn.Linear(1, 1)
>>> model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5))
>>> result = bp.sbc.run(model, x, method="nuts", num_replications=100, num_draws=9, num_warmup=100, num_samples=90)
>>> bp.sbc.chi_square(result.ranks, result.num_draws)      # p-value of the uniformity test
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pyro
import torch
from pyro import poutine

from bnn_pyro.utils.checks import SEED_MAX, check_data, positive_int
from bnn_pyro.utils.checks import seed as check_seed

__all__ = ["SBCResult", "run", "ranks", "chi_square", "plot"]


@dataclass(frozen=True)
class SBCResult:
    """The outcome of :func:`run`.

    Attributes
    ----------
    truth:
        ``(replications, P)``: the prior draw of every scalar latent coordinate (sites flattened and
        concatenated in ``names`` order).
    draws:
        ``(replications, num_draws, P)``: the thinned posterior draws.
    names:
        ``(site, size)`` per latent site, in the column order of ``truth``.
    """

    truth: torch.Tensor
    draws: torch.Tensor
    names: list[tuple[str, int]]

    @property
    def num_draws(self) -> int:
        return self.draws.shape[1]

    @property
    def ranks(self) -> torch.Tensor:
        """``(replications, P)``: how many posterior draws lie below the true value (``0..num_draws``)."""
        return ranks(self.draws, self.truth)

    def columns(self, site: str) -> slice:
        """The columns of ``site`` in ``truth``, ``draws`` and ``ranks``."""
        start = 0
        for name, size in self.names:
            if name == site:
                return slice(start, start + size)
            start += size
        raise KeyError(f"site: {site!r} is not a latent site here; the sites are {[n for n, _ in self.names]}.")


def run(
    model, x, *, method: str, num_replications: int = 100, num_draws: int = 9, seed: int = 0, **fit_config
) -> SBCResult:
    """Draw ``theta`` from the prior and ``y`` from the likelihood at ``x``, fit with ``bp.fit(model, x, y,
    method=method, seed=seed + r, progress=False, **fit_config)``, and keep ``num_draws`` evenly thinned
    pooled posterior draws, ``num_replications`` times (replication ``r`` simulates with seed ``seed + r``)."""
    from bnn_pyro.infer import fit

    num_replications = positive_int("num_replications", num_replications)
    num_draws = positive_int("num_draws", num_draws)
    seed = check_seed("seed", seed)
    if seed + num_replications - 1 > SEED_MAX:  # replication r fits with seed + r
        raise ValueError(
            f"seed: replication r uses seed + r, so seed + num_replications - 1 must be at most "
            f"2**31 - 1 = {SEED_MAX}; got seed={seed} with num_replications={num_replications}. Pass a "
            "smaller seed, e.g. seed=0."
        )
    x, _ = check_data(x, None)
    truths, kept, names = [], [], None
    for r in range(num_replications):
        theta, y = simulate(model, x, seed=seed + r)
        fresh = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
        post = fit(fresh, x, y, method=method, seed=seed + r, progress=False, **fit_config)
        pooled = post.sample()
        total = post.num_chains * post.num_draws
        if total < num_draws:
            raise ValueError(
                f"num_draws: the fit stored {total} draws, fewer than num_draws={num_draws}; ask the "
                "engine for more (num_samples=) or lower num_draws."
            )
        idx = torch.linspace(0, total - 1, num_draws).round().long()
        names = names or [(n, v.numel()) for n, v in theta.items()]
        truths.append(torch.cat([theta[n].reshape(-1) for n, _ in names]))
        kept.append(torch.cat([pooled[n][idx].reshape(num_draws, -1) for n, _ in names], dim=1))
    return SBCResult(truth=torch.stack(truths), draws=torch.stack(kept), names=names)


def simulate(model, x, *, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One draw ``(theta, y)`` from the prior predictive at ``x``: the latent sites and the observations."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        pyro.set_rng_seed(seed)
        trace = poutine.trace(model).get_trace(x, None)
    theta = {
        name: site["value"].detach()
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and name != "obs"
        and not poutine.util.site_is_subsample(site)
    }
    return theta, trace.nodes["obs"]["value"].detach()


def ranks(draws: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """``(replications, P)`` ranks of ``truth`` ``(replications, P)`` among ``draws`` ``(replications, L, P)``."""
    return (draws < truth.unsqueeze(1)).sum(1)


def chi_square(rank: torch.Tensor, num_draws: int, *, bins: int | None = None) -> float:
    """p-value of Pearson's chi-square test that ``rank`` (any shape, values ``0..num_draws``) is uniform,
    with the ``num_draws + 1`` possible ranks grouped into ``bins`` equal bins (default: all of them)."""
    from scipy import stats

    values = num_draws + 1
    bins = values if bins is None else positive_int("bins", bins)
    if values % bins:
        raise ValueError(f"bins: {bins} does not divide the {values} possible ranks (0..{num_draws}); pick a divisor.")
    counts = np.bincount((rank.reshape(-1).numpy() * bins) // values, minlength=bins)
    return float(stats.chisquare(counts).pvalue)


def plot(result: SBCResult, *, sites=None, ax=None, level: float = 0.99):
    """Rank histograms, one panel per site (``sites``: default all), with the central ``level`` band of a
    uniform histogram's bar heights (binomial). Returns the axes."""
    import matplotlib.pyplot as plt
    from scipy import stats

    sites = [n for n, _ in result.names] if sites is None else list(sites)
    if ax is None:
        _, ax = plt.subplots(1, len(sites), figsize=(3.2 * len(sites), 2.6), squeeze=False)
        ax = ax[0]
    ax = np.atleast_1d(ax)
    values = result.num_draws + 1
    for a, site in zip(ax, sites):
        r = result.ranks[:, result.columns(site)].reshape(-1).numpy()
        lo, hi = stats.binom.interval(level, len(r), 1.0 / values)
        a.axhspan(lo, hi, color="0.85", label=f"{level:.0%} band (uniform)")
        a.axhline(len(r) / values, color="0.5", lw=1)
        a.hist(r, bins=np.arange(values + 1) - 0.5, color="C0", edgecolor="white")
        a.set_title(f"{site}: p = {chi_square(torch.as_tensor(r), result.num_draws):.2f}")
        a.set_xlabel("rank of the true value")
    return ax
