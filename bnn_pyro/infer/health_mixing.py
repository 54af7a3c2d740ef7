"""Fit-time health checks of a sampler's chains: did they move, mix and agree?

Each issues a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning`
(:func:`bnn_pyro.infer.health_warn.warn_diagnostic`) that says what was seen, the threshold, and what to try, at the
end of every fit of the engines that call them (the other families: :mod:`bnn_pyro.infer._health`,
:mod:`bnn_pyro.infer.health_off_data`, :mod:`bnn_pyro.infer.health_spread`).

- :func:`check_sampler` (MCMC): divergences, a chain of an accept/reject kernel (Metropolis, MALA) that (almost)
  never moved, NUTS trajectories cut off at ``max_tree_depth``.
- :func:`check_mixing` (MCMC and SG-MCMC): too few effective draws, or chains that disagree, in function space
  (``f`` at the training inputs that ``post.summary(space="function")`` reports, by the same
  ArviZ estimators). A network's weight-space R-hat is not used: BNN weights are permutation- and
  sign-symmetric, so it is nearly always bad. A model without an ``f`` site (a plain Pyro model, e.g.
  eight schools), or a posterior without training inputs, is checked on every element of its sampled
  (and ``pyro.deterministic``) sites and on the log density ``lp``: there the parameters are what the
  user reads. With one chain R-hat is undefined (NaN), and the check says so.
- :func:`check_chains_agree` (every approximation and point fit of a Pyro function model, from ``bp.fit``, with
  several chains of several draws: SWAG): chains that disagree (R-hat), each describing another distribution; SWAG's
  three chains on the logistic regression did.

The thresholds are module constants; each one's docstring says where it comes from.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from bnn_pyro.infer.health_warn import warn_diagnostic as _warn
from bnn_pyro.utils.upstream_private import arviz_log_level

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DIVERGENCE_MAX",
    "ACCEPT_MIN",
    "TREE_DEPTH_MAX_FRACTION",
    "ESS_MIN",
    "ESS_CHANCE_QUANTILE",
    "RHAT_FIT_MAX",
    "check_sampler",
    "check_mixing",
    "ess_chance_min",
    "check_mcmc",
    "RANDOM_WALK_EFFICIENCY",
    "random_walk_advice",
    "RHAT_CHANCE_ALPHA",
    "rhat_chance_max",
    "check_chains_agree",
]

DIVERGENCE_MAX = 0.01
"""Warn when more than 1% of the kept draws diverged."""
ACCEPT_MIN = 0.01
"""Warn when a Metropolis chain accepted fewer than 1% of its proposals after warm-up."""
TREE_DEPTH_MAX_FRACTION = 0.10
"""Warn when more than 10% of the kept NUTS draws stopped at ``max_tree_depth`` (not counting
divergent ones). Stan warns on any such draw; a few are harmless (the cost is capped, the draw is
still valid), so we warn where saturation is the rule rather than the exception: there the
trajectories are cut before they turn back, every draw costs the maximum ``2**max_tree_depth - 1``
leapfrog steps, and successive draws stay correlated (Hoffman & Gelman 2014, section 3)."""
ESS_MIN = 100
"""Warn when the bulk ESS of the monitored quantity is below 100 in all (chains together): with
fewer, the Monte Carlo error of a posterior mean exceeds 10% of the posterior sd, and the ESS and
R-hat estimates themselves are unreliable (Vehtari et al. 2021, section 4: ESS > 100 per chain is
their recommendation for the summary, which :func:`bnn_pyro.summary` applies; this is the floor)."""
ESS_CHANCE_QUANTILE = {
    1: {10: 0.30, 25: 0.11, 50: 0.08, 100: 0.08, 200: 0.14, 400: 0.39},
    2: {10: 0.35, 25: 0.17, 50: 0.15, 100: 0.24, 200: 0.47, 400: 0.57},
    4: {10: 0.45, 25: 0.32, 50: 0.28, 100: 0.48, 200: 0.63, 400: 0.68},
    8: {10: 0.59, 25: 0.50, 50: 0.58, 100: 0.72},
}
"""``ESS_CHANCE_QUANTILE[C][S]``: the bulk ESS estimate of ``C`` chains of ``S`` independent draws, as a fraction of
their number ``C S``, that one quantity's estimate falls below with probability 5e-4 (1% over 20 independent
quantities, the 20 inputs of ``f``; correlated quantities, as ``f``'s are, fall below it together less often):
ArviZ's rank-normalized split estimate of 10,000 simulated quantities of standard normal draws per cell, rounded
down (``benchmarks/results/health_false_alarms/spread.md``). Its left tail is long: for one chain of 200 draws the
median is 0.96, the 1% quantile 0.47 and this one 0.14; more chains shorten it."""
RHAT_FIT_MAX = 1.05
"""Warn when the rank-normalized split R-hat of the monitored quantity exceeds 1.05. Vehtari et al.
(2021) recommend 1.01 for a final analysis with ESS > 400 (:func:`bnn_pyro.summary` uses it), but at
the 100-400 effective draws of a short run perfectly mixed chains exceed 1.01 by chance: measured
with i.i.d. draws, the largest R-hat of 20 correlated outputs exceeded 1.01 in 69% of 2 x 100-draw
runs and 28% of 2 x 200, and 1.05 in 2.5% and 0%. 1.05 flags chains that really disagree."""


def check_sampler(
    kind: str,
    samples: dict[str, torch.Tensor],
    stats: dict[str, torch.Tensor],
    *,
    target_accept: float,
    max_tree_depth: int | None = None,
    acceptance: bool = False,
) -> None:
    """Warn about divergences above :data:`DIVERGENCE_MAX` of the draws, a chain of an accept/reject kernel
    (``acceptance``: the method's declaration says ``accept_reject``) that moved on fewer than :data:`ACCEPT_MIN` of
    its draws, and NUTS draws at ``max_tree_depth`` above
    :data:`TREE_DEPTH_MAX_FRACTION`. ``samples`` and ``stats`` are shaped ``(chains, draws, ...)``."""
    diverging = stats.get("diverging")
    if diverging is not None and diverging.numel() and diverging.float().mean() > DIVERGENCE_MAX:
        frac = float(diverging.float().mean())
        higher = next((t for t in (0.95, 0.99) if t > target_accept), None)  # a value above the one that ran
        accept = f"a higher target_accept (now {target_accept}; e.g. {higher}), " if higher is not None else ""
        already = f" (target_accept is already {target_accept})" if higher is None else ""
        _warn(
            f"{kind}: {100 * frac:.1f}% of the draws diverged ({int(diverging.sum())} of {diverging.numel()}; "
            f"threshold {100 * DIVERGENCE_MAX:.0f}%), so the draws may be biased. Try {accept}more num_warmup, "
            f"or a reparameterized (non-centered) prior{already}."
        )
    depth = stats.get("tree_depth")
    if max_tree_depth is not None and depth is not None and depth.numel():
        capped = depth >= max_tree_depth
        if diverging is not None:
            capped &= ~diverging.bool()
        frac = float(capped.float().mean())
        if frac > TREE_DEPTH_MAX_FRACTION:
            step = float(stats["step_size"].float().median()) if "step_size" in stats else math.nan
            _warn(
                f"{kind}: {100 * frac:.0f}% of the draws stopped at max_tree_depth={max_tree_depth} "
                f"({2**max_tree_depth - 1} leapfrog steps; threshold {100 * TREE_DEPTH_MAX_FRACTION:.0f}%): the "
                f"trajectories were cut off before they turned back (adapted step size {step:.2g}), so successive "
                "draws are correlated and each costs the maximum. The draws remain valid; check the ESS "
                "(post.summary(space='function')). Try a larger max_tree_depth (e.g. "
                f"{max_tree_depth + 2}), a longer num_warmup, dense_mass=True, or a narrower prior or "
                "standardized inputs and targets (a better-scaled posterior allows larger steps)."
            )
    if not acceptance or not samples:
        return
    draws = next(iter(samples.values())).shape[1]
    if draws < 2:
        return
    first = next(iter(samples.values()))
    moved = torch.zeros(first.shape[:1] + (draws - 1,), dtype=torch.bool, device=first.device)
    for v in samples.values():
        moved |= (v[:, 1:] != v[:, :-1]).reshape(v.shape[0], draws - 1, -1).any(-1)
    for chain, rate in enumerate(moved.float().mean(1).tolist()):
        if rate < ACCEPT_MIN:
            _warn(
                f"{kind}: chain {chain} accepted {100 * rate:.1f}% of its {draws - 1} proposals after warm-up "
                f"(threshold {100 * ACCEPT_MIN:.0f}%): it barely moved, so its draws do not describe the posterior. "
                "Try more num_warmup (the step size adapts during warm-up), a smaller step_size, or method='nuts'."
            )


def check_mixing(post, *, advice: str = "", note: str = "") -> None:
    """Warn when the chains of an MCMC posterior give fewer than :data:`ESS_MIN` effective draws
    (bulk ESS, chains together) or disagree (R-hat above :data:`RHAT_FIT_MAX`, or, with few draws per chain, above
    what chains of independent exact draws exceed by chance: :func:`rhat_chance_max`), measured on ``f``
    at the training inputs of ``post.summary(space="function")``; without an ``f`` site or training inputs, on
    every element of ``post.samples`` and the log density ``lp`` (the worst one is named). With one chain, R-hat
    is NaN: the warning says so, whether or not the ESS is low. Why the chance bound: with the fixed 1.05, 2 chains
    of 25 exact independent draws were said to disagree in most runs (``benchmarks/results/health_false_alarms/``).
    The ESS threshold is likewise chance-adjusted where the draws are few (:func:`ess_chance_min`): the estimate of
    200 exact draws fell below 100 in 4-10% of fits. ``f`` is judged as far as the likelihood depends on it
    (``Likelihood.identified``, named in the message by its ``identified_as``): a ``Categorical``'s logits centred over
    the classes, ``f_k - mean_j f_j``: softmax is unchanged by a shift common to every class, so that shift is
    identified by the prior alone, wanders slowly in a sampler's draws, and no prediction depends on it (SG-HMC on
    iris: the smallest ESS of the raw logits 8, of the centred ones 38; ``benchmarks/results/sgmcmc_ess_truth/``).
    ``advice``: what to try, specific to the engine, in place of the MCMC engines' (more draws, chains, NUTS);
    ``note``: a sentence the engine adds after it (e.g. :func:`random_walk_advice`'s bound)."""
    import arviz as az
    import numpy as np

    from bnn_pyro.posterior.diagnostics import NUM_FUNCTION_INPUTS, from_dict, function_draws

    if post.num_draws < 2:
        return
    try:
        if post.x is None:
            raise ValueError("no training inputs")
        rows = torch.linspace(0, post.x.shape[0] - 1, min(NUM_FUNCTION_INPUTS, post.x.shape[0])).round().long()
        f = function_draws(post, post.x[rows]).double()
        likelihood = getattr(post.model, "likelihood", None)
        identify = getattr(likelihood, "identified", None)  # as far as the likelihood depends on f (docstring)
        judged = identify(f) if identify is not None else f
        changed, f = judged is not f, judged
        data = from_dict(posterior={"f": f.cpu().numpy()})
        with arviz_log_level(logging.ERROR):  # ArviZ logs a shape complaint for one chain; R-hat is not used then
            ess, rhat = az.ess(data)["f"].values.ravel(), az.rhat(data)["f"].values.ravel()
        what = worst_ess = worst_rhat = f"f(x) at {len(rows)} training inputs" + (
            f" ({likelihood.identified_as})" if changed else ""
        )
    except ValueError:  # a Pyro function without an 'f' site, or no training inputs: its parameters and lp
        ess, rhat, names = _parameter_diagnostics(post)
        if not names:
            return
        what = "the parameters and the log density lp"
        worst_ess = f"{what} (worst: {names[int(np.nanargmin(ess))]})" if np.isfinite(ess).any() else what
        worst_rhat = f"{what} (worst: {names[int(np.nanargmax(rhat))]})" if np.isfinite(rhat).any() else what
    problems = []
    ess_limit = ess_chance_min(post.num_chains, post.num_draws)  # few draws: chance
    if np.isfinite(ess).any() and np.nanmin(ess) < ess_limit:
        problems.append(
            f"the bulk ESS of {worst_ess} is {np.nanmin(ess):.0f} at worst (threshold {ess_limit:.0f} in all), "
            "so Monte Carlo errors of means and intervals exceed 10% of the posterior sd"
        )
    limit = max(RHAT_FIT_MAX, rhat_chance_max(post.num_chains, post.num_draws, len(rhat)))  # few draws: chance
    if post.num_chains > 1 and np.isfinite(rhat).any() and np.nanmax(rhat) > limit:
        problems.append(
            f"R-hat of {worst_rhat} is up to {np.nanmax(rhat):.3g} (threshold {limit:.3g}): the "
            "chains disagree, they have not mixed or sit in different modes"
        )
    if post.num_chains == 1:  # its own name: the engine's ``note`` still follows the advice (review 15's bound)
        one_chain = (
            f"with one chain R-hat is undefined (NaN in post.summary()), so whether chains started elsewhere "
            f"would agree on {what} is unchecked; run num_chains >= 2, as the MCMC engines do by default with 4"
        )
        if not problems:  # nothing else to fix: the note alone, without the mixing advice
            _warn(f"{post.method}: {one_chain} ({post.num_draws} draws).")
            return
        problems.append(one_chain)
    if problems:
        other = (
            "a larger max_tree_depth if the trajectories hit the maximum"
            if post.method == "nuts"
            else "method='nuts' (with a larger max_tree_depth if its trajectories hit the maximum)"
        )
        _warn(
            f"{post.method}: {'; and '.join(problems)} ({post.num_chains} chain(s) x {post.num_draws} draws). "
            + (advice or f"Try more num_samples and num_warmup, more chains, or {other}")
            + "; post.summary(space='function') shows every input."
            + (f" {note}." if note else "")
        )


def ess_chance_min(num_chains: int, num_draws: int) -> float:
    """The bulk ESS below which :func:`check_mixing` says a fit has fewer than :data:`ESS_MIN` effective draws:
    :data:`ESS_MIN`, or, where ``N = num_chains * num_draws`` draws are at least :data:`ESS_MIN` but few, the
    estimate that ``N`` independent draws fall below by chance (:data:`ESS_CHANCE_QUANTILE` times ``N``) if that is
    lower.

    Why: the estimate is noisy. ``N`` independent draws have ``N`` effective draws, yet their estimate has an sd of
    about ``2.7 sqrt(N)`` and a long left tail, so with 200 exact draws the smallest of 20 outputs' estimates fell
    below 100 in 10% of fits of one chain and 4% of 2 x 100 and 4 x 50 (``benchmarks/results/health_false_alarms/``,
    ``ess_chance.md``; with this threshold 1%, 1% and 0%): a false alarm, since 200 exact draws are 200 effective
    ones. Rule: in the table's row of the largest tabulated chain count not above the fit's (fewer chains have
    longer tails), the fraction interpolated linearly in the draws per chain between the tabulated entries either
    side (the last entry beyond the table), times ``N``; fewer than :data:`ESS_MIN` draws, or fewer than 10 per
    chain, are below :data:`ESS_MIN` whatever the estimate, so :data:`ESS_MIN` rules there. Why interpolate: the
    rule before took the smaller of the two entries, so the threshold jumped from 56 at 1 x 399 draws to 100 at
    1 x 400; interpolated it rises continuously (1 x 300: 79.5, 100 from about 1 x 330). It is :data:`ESS_MIN` from
    400 draws on in one chain, 200 per chain in two, 100 in four (every engine's default but csgmcmc's one chain of
    200 draws): there a fit is flagged as before. Below, a chain must mix worse to be flagged: 1 x 200 draws at an
    estimate under 28, 2 x 100 under 48.

    Power (``benchmarks/results/health_false_alarms/power.md``: AR(1) chains of exact draws of a linear regression's
    posterior, ``f`` at 20 inputs, 400 runs each, sd of a rate at most 0.025): at 1 x 200 draws (threshold 28) a
    true ESS of 50 is flagged in 33% of fits and of 75 in 11%, so such chains, whose Monte Carlo errors are 12-14%
    of the sd, are mostly missed; at 1 x 300 (79.5) 100% and 96% (the rule before, 42: 75% and 29%). False alarms
    on exact independent draws there: 0.25% of fits at 1 x 200 and 1 x 399, 0.5% at 1 x 300 and 1 x 350 (the rule
    before: 0.25% at each; the same draws); at 2 x 75, 2 x 150 and 4 x 75 0.5%, 0.25% and 0.25% (before: 0.25%, 0
    and 0.25%; ``power_chains.md``): one more false alarm in 400 fits in 4 of these 8 cases, within the 1% the
    table is set for, while at 2 x 75 a true ESS of 50 is flagged in 43% of fits (before: 29%)."""
    n = num_chains * num_draws
    if n < ESS_MIN or num_draws < 10:
        return float(ESS_MIN)
    import numpy as np

    row = ESS_CHANCE_QUANTILE[max(c for c in ESS_CHANCE_QUANTILE if c <= num_chains)]
    grid = sorted(row)
    fraction = float(np.interp(num_draws, grid, [row[s] for s in grid]))  # the last entry beyond the table
    return float(min(ESS_MIN, n * fraction))


def _parameter_diagnostics(post) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Bulk ESS and R-hat of every element of ``post.samples`` (sampled and deterministic sites) and of
    ``sample_stats["lp"]``, with their names (``"theta[3]"``, ``"lp"``)."""
    import arviz as az
    import numpy as np

    from bnn_pyro.posterior.diagnostics import from_dict

    columns = {}
    for name, value in post.samples.items():
        flat = value.reshape(post.num_chains, post.num_draws, -1)
        for i in range(flat.shape[-1]):
            columns[name if flat.shape[-1] == 1 and value.dim() == 2 else f"{name}[{i}]"] = flat[..., i]
    if "lp" in post.sample_stats:
        columns["lp"] = post.sample_stats["lp"]
    if not columns:
        return np.zeros(0), np.zeros(0), []
    names = list(columns)
    stacked = np.stack([columns[n].double().cpu().numpy() for n in names], -1)  # (chains, draws, K)
    data = from_dict(posterior={"v": stacked})
    with arviz_log_level(logging.ERROR):  # ArviZ logs a shape complaint for one chain
        ess, rhat = az.ess(data)["v"].values.ravel(), az.rhat(data)["v"].values.ravel()
    return ess, rhat, names


def check_mcmc(post, *, target_accept: float, acceptance: bool = False, note: str = ""):
    """Every MCMC check (:func:`check_sampler`, :func:`check_mixing`) on a finished posterior; returns it.
    ``acceptance``: the method's kernel accepts or rejects each proposal whole (its declaration's
    ``accept_reject``); ``note``: :func:`check_mixing`'s, where the engine adds one (e.g. :func:`random_walk_advice`)."""
    check_sampler(
        post.method,
        post.samples,
        post.sample_stats,
        target_accept=target_accept,
        max_tree_depth=post.config.get("max_tree_depth"),
        acceptance=acceptance,
    )
    check_mixing(post, note=note)
    return post


RANDOM_WALK_EFFICIENCY = 0.3
"""Effective draws per iteration of random-walk Metropolis in ``d`` coordinates, times ``d``, at best: with the
optimal proposal scale (``2.38 / sqrt(d)`` in the posterior's own whitened coordinates, acceptance 0.234) on a
Gaussian target its efficiency is about ``0.3 / d`` (Gelman, Roberts & Gilks 1996; Roberts, Gelman & Gilks 1997),
and a posterior that is not Gaussian, or a metric that does not whiten it, does worse. So the iterations a random
walk needs per effective draw grow in proportion to the dimension: the structural reason a network's Metropolis
chains do not mix at run lengths where NUTS's do."""


def random_walk_advice(dim: int, num_chains: int, num_draws: int) -> str:
    """:func:`check_mixing`'s note for random-walk Metropolis in ``dim`` unconstrained coordinates (the ones the walk
    moves in), where even the best-case efficiency (:data:`RANDOM_WALK_EFFICIENCY`) asks for more iterations per chain
    than ``num_draws`` to give :data:`ESS_MIN` effective draws over ``num_chains`` chains: the number it asks for, and
    that NUTS's cost per effective draw grows far more slowly with the dimension. Added to the usual advice, not in
    its place (a chain can fail to mix for other reasons too); empty where the run is long enough by that bound."""
    needed = math.ceil(ESS_MIN * dim / (RANDOM_WALK_EFFICIENCY * max(num_chains, 1)))
    if needed <= num_draws:
        return ""
    return (
        f"A random walk in {dim:,} coordinates gains at most about {RANDOM_WALK_EFFICIENCY} / {dim:,} effective "
        f"draws per iteration (Gelman, Roberts & Gilks 1996), so {ESS_MIN} effective draws over {num_chains} "
        f"chain(s) need at least ~{needed:,} draws per chain (this run: {num_draws:,}); NUTS's cost per effective "
        "draw grows far more slowly with the dimension"
    )


RHAT_CHANCE_ALPHA = 0.01
"""The chance, over all of a fit's quantities together, that chains of exchangeable draws exceed the threshold of
:func:`check_chains_agree` (:func:`rhat_chance_max`)."""


def rhat_chance_max(num_chains: int, num_draws: int, num_quantities: int, alpha: float = RHAT_CHANCE_ALPHA) -> float:
    """The split R-hat that ``num_chains`` chains of ``num_draws`` independent draws of one distribution exceed with
    probability ``alpha`` over ``num_quantities`` quantities (Bonferroni over each quantity's bulk and folded
    R-hat, the two ArviZ's rank method takes the larger of).

    Why: with few draws per chain the R-hat of perfectly exchangeable chains is far above 1 by chance (4 chains of
    5 draws exceed 1.05 on most quantities), so a fixed threshold flags agreeing chains. For ``M = 2 num_chains``
    split chains of ``n = num_draws // 2`` normal draws (rank normalization makes any distribution's draws about
    normal), ``R^2 = (n - 1) / n + F / n`` with ``F = B / W ~ F(M - 1, M (n - 1))`` (Gelman & Rubin 1992; B, W the
    between- and within-chain variances), so the threshold is ``sqrt((n - 1) / n + F_q / n)`` at
    ``q = 1 - alpha / (2 num_quantities)``. With hundreds of draws it is below :data:`RHAT_FIT_MAX`, which then rules."""
    from scipy.stats import f

    m, n = 2 * num_chains, num_draws // 2
    if n < 2 or m < 2:
        return float("inf")
    q = 1.0 - alpha / (2 * max(num_quantities, 1))
    return float(((n - 1) / n + f.ppf(q, m - 1, m * (n - 1)) / n) ** 0.5)


def check_chains_agree(post):
    """Warn when the chains of an approximate posterior of a Pyro function model disagree: the rank-normalized split
    R-hat (Vehtari et al. 2021) of some element of its samples exceeds :data:`RHAT_FIT_MAX`, or, with few draws per
    chain, what exchangeable chains exceed by chance (:func:`rhat_chance_max`). Each chain of such an
    engine (a SWAG Gaussian fitted to its own SGD run) is meant to approximate the same posterior, so its draws and
    another chain's are exchangeable, as an MCMC's are; chains that disagree each describe some other distribution,
    and their pooled spread is the spread of their centres, not the posterior's. Judged with at least 2 chains of at
    least 4 draws (R-hat is undefined otherwise: ensembles' one draw per member is not judged) for a Pyro function
    model (a network's chains may sit in different modes of an equally good fit). The reference suite found SWAG's
    three chains on a logistic regression with intercepts -0.35, -3.04 and -5.18, each with an sd near 0.02, where
    the exact posterior is -3.41 +- 0.89, passing as a match only through the allowance for their ~3 effective
    draws. Returns ``post``."""
    import numpy as np

    from bnn_pyro.model import BNN

    if isinstance(post.model, BNN) or post.num_chains < 2 or post.num_draws < 4:
        return post
    _, rhat, names = _parameter_diagnostics(post)
    limit = max(RHAT_FIT_MAX, rhat_chance_max(post.num_chains, post.num_draws, len(names)))
    if not names or not np.isfinite(rhat).any() or np.nanmax(rhat) <= limit:
        return post
    worst = int(np.nanargmax(rhat))
    _warn(
        f"{post.method}: its {post.num_chains} chains disagree: R-hat of {names[worst]} is {rhat[worst]:.3g} "
        f"(threshold {limit:.3g}), so each chain describes a different distribution and their pooled spread is "
        "the spread of their centres, not the posterior's; post.summary() shows every parameter. Use "
        "method='laplace' or 'nuts' on a model this small, or standardize the inputs."
    )
    return post
