"""End-of-fit health checks: warnings about a finished fit that the user should not miss.

Every check issues a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning` that says what was seen, the
threshold, and what to try. They run at the end of every fit of the engines that call them, so a
fit that cannot be trusted is flagged even when nobody looks at :func:`bnn_pyro.summary`. Each is
cheap: no extra fits, at most one pass of :data:`PREDICTIVE_DRAWS` posterior and as many prior
draws over :data:`PREDICTIVE_ROWS` training rows.

- :func:`check_sampler` (MCMC): divergences, a chain of an accept/reject kernel (Metropolis, MALA) that (almost)
  never moved, NUTS trajectories cut off at ``max_tree_depth``.
- :func:`check_mixing` (MCMC and SG-MCMC): too few effective draws, or chains that disagree, in function space
  (``f`` at the training inputs that ``post.summary(space="function")`` reports, by the same
  ArviZ estimators). A network's weight-space R-hat is not used: BNN weights are permutation- and
  sign-symmetric, so it is nearly always bad. A model without an ``f`` site (a plain Pyro model, e.g.
  eight schools), or a posterior without training inputs, is checked on every element of its sampled
  (and ``pyro.deterministic``) sites and on the log density ``lp``: there the parameters are what the
  user reads. With one chain R-hat is undefined (NaN), and the check says so.
- :func:`check_elbo` (SVI): a loss still falling (or rising) at the end of the run.
- :func:`check_guide_gap` (SVI with a full-rank guide on a small Pyro function): the guide's mean stopped short of its
  family's ELBO optimum by one Newton step (:mod:`bnn_pyro.infer.svi_gap`), which the ELBO trace does not show.
- :func:`check_predictive` (any engine): a posterior predictive that fits the training data no
  better than a constant, as the prior's does (posterior ~ prior).
- :func:`check_targets` (any engine, before the fit, from ``bp.fit``): regression targets in raw units
  (their sd far above the O(1) outputs of a unit-prior net) under a fixed Gaussian noise far below
  their sd; :func:`check_elbo` then gives the same advice instead of "more steps".
- :func:`check_training_noise` (engines that start from a point fit, before the fit, from
  :func:`bnn_pyro.infer.holdout.split`): a learned Gaussian noise on data too small to hold rows out for it.
- :func:`check_off_data` (classification fits of engines whose spread cannot grow away from the data, for a
  structural reason the engine states: MC dropout with its inputs kept whole; SWAG, SWA and snapshot ensembles
  without anchoring; Laplace with ``structure="last_layer"``, a ``BNN``'s default): says so at fit time, with what to
  use instead (``docs/ood.md``).
- :func:`check_scale_free_off_data` (classification fits of variational and sparse variational dropout): their
  Gaussian's sd is at most its mean's magnitude under a prior with no scale, so in weight directions the data leave
  free the spread is the initial weights' (or zero, pruned), not the prior's; said at fit time (``docs/ood.md``).
- :func:`check_anchored_log_loss` (classification fits of anchored members: ensemble members, SWAG chains,
  snapshot cycles with ``anchored=True``, their default): their off-data spread holds, but the mixture's test log
  loss can be well above the exact posterior's, and nothing a fit can measure tells when (``docs/ood.md``).
- :func:`check_spread` (any task, engines whose draws' spread is, for a structural reason the engine states, not
  the model's posterior spread: SWA's one point per chain, MC dropout's masks at a fixed rate): says so at fit
  time, with what to use instead. Found by the reference suite (``tests/infer/test_reference_engines.py``,
  ``docs/reference_suite.md``): on Bayesian linear regression SWA's sd was 0 and MC dropout's means were 6
  posterior sds off with sds from 0 to 4.5 times the exact ones, both without a warning.
- :func:`check_narrow` (a ``BNN`` posterior of an approximate engine on a small model: SVI, variational and sparse
  variational dropout, SWAG, snapshot ensembles): draws narrower than the Laplace approximation at their mean in
  some coordinate, beyond what their number explains. The reference suite found mean-field SVI at 0.21-0.57 of the
  exact sds of two linear BNNs (correlated coefficients), SWAG at 0.56 and snapshot ensembles at 0.02-0.08, silently.
- :func:`bnn_pyro.infer.subspace_held.check_subspace` (subspace inference on a small ``BNN``; in its own module,
  next to the Laplace curvature it uses): a weight that keeps less than ``SUBSPACE_HELD_MIN`` of its Laplace variance
  once confined to the subspace ``w_hat + P z``, which no inner engine can exceed. On the linear BNN reference at
  ``subspace_dim=2`` (of 3 weights) ``weight[1]``'s sd was 0.36 of the exact one, silently
  (``docs/reference_suite.md``).
- :func:`check_gaussian` (Laplace on a Pyro function model): the posterior is far from the fitted Gaussian by the
  Pareto ``k_hat`` of the importance ratios ``p / q`` of its draws (Yao et al. 2018). On eight schools the
  Gaussian at the joint mode (``tau`` ~29, where the posterior mean is 3.6) was 14 posterior sds off in ``tau``,
  silently; its ``k_hat`` is 1.03 (1,000 draws).
- :func:`check_typical` (every approximation and point fit of a Pyro function model, from ``bp.fit``): the median
  draw's log density far below the mode's, beyond what the chi-square law of exact draws allows. On kidiq (a
  covariate near 100) ensemble members and SWAG chains were 171 and 4,899 posterior sds off, silently.
- :func:`check_chains_agree` (the same fits, with several chains of several draws: SWAG): chains that disagree
  (R-hat), each describing another distribution; SWAG's three chains on the logistic regression did.
- :func:`check_descent` (snapshot ensembles and SG-MCMC): a run whose potential (negative log joint) ends well
  above where it started diverged; on the logistic BNN with an unstandardized covariate (``lr="auto"`` peaking at a
  step of 5.9) the snapshots were hundreds of posterior sds off, and SGLD's draws 10^5 sds, silently.
- :func:`check_noise_collapse` (any engine, from ``bp.fit``): a regression fit with a learned Gaussian noise whose
  predictive mean explains almost none of the training targets' variance while the noise absorbs it, on data where a
  ridge or nearest-neighbour regression finds signal out of sample. Mean-field SVI on the zoo's ``mlp_regression`` ends
  there as its best ELBO (``benchmarks/results/zoo_svi_collapse/``). Such a fit also ignores the data
  (:func:`check_predictive`) and has a learned noise at the targets' sd (:func:`check_learned_noise`): both stay silent
  there, so one cause gives one warning, with its figures and advice.
- :func:`check_gaussian_guide_off_data` (classification fits of a ``BNN`` by SVI with a Gaussian guide: mean-field,
  low-rank, full-rank): the guide carries the fit in a few hidden units and prunes the rest, so its off-data
  uncertainty can fall short of the posterior's (``docs/ood.md``, "Mean-field SVI off the data").

The thresholds are module constants; each one's docstring says where it comes from.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from bnn_pyro.utils.upstream_private import arviz_log_level
from bnn_pyro.utils.user_warnings import warn

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "check_mcmc",
    "check_svi",
    "svi_advice",
    "check_sampler",
    "check_mixing",
    "check_elbo",
    "check_guide_gap",
    "GAP",
    "GAP_SE",
    "GAP_MAX",
    "GAP_Z",
    "check_predictive",
    "DIVERGENCE_MAX",
    "ACCEPT_MIN",
    "TREE_DEPTH_MAX_FRACTION",
    "ESS_MIN",
    "ESS_CHANCE_QUANTILE",
    "ess_chance_min",
    "RHAT_FIT_MAX",
    "ELBO_WINDOW",
    "ELBO_MIN_WINDOW",
    "ELBO_TREND_Z",
    "ELBO_TREND_NATS",
    "FIT_GAIN_MIN",
    "PREDICTIVE_DRAWS",
    "PREDICTIVE_ROWS",
    "check_targets",
    "unscaled_targets",
    "TARGET_SD_MAX",
    "NOISE_FRACTION_MIN",
    "check_off_data",
    "check_scale_free_off_data",
    "check_spread",
    "check_narrow",
    "check_descent",
    "check_gaussian",
    "check_typical",
    "check_chains_agree",
    "check_noise_collapse",
    "collapse_message",
    "check_gaussian_guide_off_data",
    "TYPICAL_TAIL",
    "NARROW_MAX",
    "NARROW_TAIL",
    "NARROW_MAX_DIM",
    "check_training_noise",
    "unconstrained_draws",
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
ELBO_WINDOW = 0.10
"""The ELBO check compares the mean loss over the last 10% of the steps with the previous 10%."""
ELBO_MIN_WINDOW = 5
"""... with windows of at least 5 steps (half the run each when it is shorter than 100 steps)."""
ELBO_TREND_Z = 4.0
"""A change between the windows counts only when it exceeds 4 standard errors of the difference of
the window means (per-step loss noise, treated as independent): a one-sided false alarm rate of
3e-5 for stationary independent noise, leaving room for the autocorrelation of an optimizer's
fluctuations that the independent-noise standard error understates."""
ELBO_TREND_NATS = 1.0
"""... and 1 nat: a difference in log evidence below 1 is "not worth more than a bare mention"
(Kass & Raftery 1995), so a deterministic (full-batch MAP) loss still creeping down by less is
converged for every practical purpose."""
FIT_GAIN_MIN = 0.05
""":func:`check_predictive` warns when the posterior predictive fits the training data less than 5%
better than the best constant predictor: ``1 - MSE / Var(y)`` (regression, the predictive mean
against the mean of y) or ``1 - NLL / H`` (classification, the predictive probabilities against the
training class frequencies, whose log loss is their entropy ``H``), *and* the posterior shows that
the data did not inform it: its draws fit the data less than 5% better than prior draws (the
expected squared error or log loss per draw), or (regression) the variance of ``f`` over the draws
at the training inputs is at least ``Var(y)``: after seeing the data, the posterior is less sure of
``f`` at the observed inputs than the observations' own spread. A zero-mean prior's predictive
mean is such a constant. The second condition keeps a posterior that the data made sure that y
barely depends on x (Bayesian linear regression with noise dominating) from being flagged."""
PREDICTIVE_DRAWS = 50
"""Posterior draws, and prior draws, used by :func:`check_predictive`: the predictive mean to ~14% of
its spread, ample for a 5% threshold that a fit ignoring the data misses by far."""
GAP = "guide_gap"
"""``post.history`` key of an SVI fit's Newton gap per chain and unconstrained coordinate (``(chains, dim)``, in the
guide's sds: :func:`bnn_pyro.infer.svi_gap.newton_gap`); ``GAP_SE`` holds its standard errors and
``post.config["guide_coordinates"]`` the coordinates' labels."""
GAP_SE = "guide_gap_se"
GAP_MAX = 0.05
""":func:`check_guide_gap` warns when the guide's mean stopped more than this many of the guide's own sds short of the
ELBO's optimum in some coordinate (one Newton step, :mod:`bnn_pyro.infer.svi_gap`) ... Why 0.05: the full-rank misses
of eight schools at the defaults read 0.10-0.19, and fits that reach the optimum 0.01-0.03 (a real gap of 0.12 on one
matching kidiq fit warns: the reference test's 1,000 draws cannot resolve it), ``benchmarks/results/svi_convergence/``."""
GAP_Z = 4.0
"""... and the gap exceeds 4 of its standard errors: a two-sided 6e-5 chance per coordinate of a gap made by the
estimate's Monte Carlo error alone."""
PREDICTIVE_ROWS = 1000
"""Training rows (evenly spaced) used by :func:`check_predictive`, which bounds its cost (one pass of
the posterior and prior draws over these rows)."""


def _warn(message: str) -> None:
    from bnn_pyro.posterior.diagnostics import DiagnosticWarning

    warn(message, DiagnosticWarning)


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
        _warn(
            f"{kind}: {100 * frac:.1f}% of the draws diverged ({int(diverging.sum())} of {diverging.numel()}; "
            f"threshold {100 * DIVERGENCE_MAX:.0f}%), so the draws may be biased. Try a higher target_accept "
            f"(now {target_accept}; e.g. 0.95), more num_warmup, or a reparameterized (non-centered) prior."
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


def check_mixing(post, *, advice: str = "") -> None:
    """Warn when the chains of an MCMC posterior give fewer than :data:`ESS_MIN` effective draws
    (bulk ESS, chains together) or disagree (R-hat above :data:`RHAT_FIT_MAX`, or, with few draws per chain, above
    what chains of independent exact draws exceed by chance: :func:`rhat_chance_max`), measured on ``f``
    at the training inputs of ``post.summary(space="function")``; without an ``f`` site or training inputs, on
    every element of ``post.samples`` and the log density ``lp`` (the worst one is named). With one chain, R-hat
    is NaN: the warning says so, whether or not the ESS is low. Why the chance bound: with the fixed 1.05, 2 chains
    of 25 exact independent draws were said to disagree in most runs (``benchmarks/results/health_false_alarms/``).
    The ESS threshold is likewise chance-adjusted where the draws are few (:func:`ess_chance_min`): the estimate of
    200 exact draws fell below 100 in 4-10% of fits. A ``Categorical`` likelihood's logits are judged centred over
    the classes, ``f_k - mean_j f_j``: softmax is unchanged by a shift common to every class, so that shift is
    identified by the prior alone, wanders slowly in a sampler's draws, and no prediction depends on it (SG-HMC on
    iris: the smallest ESS of the raw logits 8, of the centred ones 38; ``benchmarks/results/sgmcmc_ess_truth/``).
    ``advice``: what to try, specific to the engine, in place of the MCMC engines' (more draws, chains, NUTS)."""
    import arviz as az
    import numpy as np

    from bnn_pyro.likelihoods import Categorical
    from bnn_pyro.posterior.diagnostics import NUM_FUNCTION_INPUTS, from_dict, function_draws

    if post.num_draws < 2:
        return
    try:
        if post.x is None:
            raise ValueError("no training inputs")
        rows = torch.linspace(0, post.x.shape[0] - 1, min(NUM_FUNCTION_INPUTS, post.x.shape[0])).round().long()
        f = function_draws(post, post.x[rows]).double()
        centred = isinstance(getattr(post.model, "likelihood", None), Categorical) and f.shape[-1] > 1
        if centred:  # softmax ignores a shift common to every class's logit: only the centred logits are identified
            f = f - f.mean(-1, keepdim=True)
        data = from_dict(posterior={"f": f.cpu().numpy()})
        with arviz_log_level(logging.ERROR):  # ArviZ logs a shape complaint for one chain; R-hat is not used then
            ess, rhat = az.ess(data)["f"].values.ravel(), az.rhat(data)["f"].values.ravel()
        what = worst_ess = worst_rhat = f"f(x) at {len(rows)} training inputs" + (
            " (centred over the classes)" if centred else ""
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
    if post.num_chains == 1:
        note = (
            f"with one chain R-hat is undefined (NaN in post.summary()), so whether chains started elsewhere "
            f"would agree on {what} is unchecked; run num_chains >= 2 (the default is 4 for the MCMC engines)"
        )
        if not problems:  # nothing else to fix: the note alone, without the mixing advice
            _warn(f"{post.method}: {note} ({post.num_draws} draws).")
            return
        problems.append(note)
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


def check_elbo(
    losses: torch.Tensor, *, method: str = "svi", lr: float | None = None, advice: str | None = None
) -> None:
    """Warn when the loss (negative ELBO) of a chain ``losses[c]`` still falls, or rises, at the end of
    the run: the mean over the last :data:`ELBO_WINDOW` of the steps differs from the mean over the
    previous one by more than :data:`ELBO_TREND_Z` standard errors and :data:`ELBO_TREND_NATS`.
    ``advice`` replaces the usual "more num_steps / another lr" where the cause is known to be elsewhere
    (:func:`unscaled_targets`): more steps do not fix a likelihood that does not fit the targets' units."""
    losses = torch.as_tensor(losses).double().reshape(-1, torch.as_tensor(losses).shape[-1])
    steps = losses.shape[-1]
    width = max(int(steps * ELBO_WINDOW), min(ELBO_MIN_WINDOW, steps // 2))
    if width < 2:
        return
    worst = None
    for chain, trace in enumerate(losses):
        prev, last = trace[-2 * width : -width], trace[-width:]
        if not (torch.isfinite(prev).all() and torch.isfinite(last).all()):
            continue
        change = float(prev.mean() - last.mean())  # > 0: still falling
        se = float((prev.var() / width + last.var() / width).sqrt())
        if abs(change) > max(ELBO_TREND_Z * se, ELBO_TREND_NATS) and (worst is None or abs(change) > abs(worst[1])):
            worst = (chain, change, se)
    if worst is None:
        return
    chain, change, se = worst
    where = f"over the last {width} of {steps} steps (chain {chain})"
    lr_now = "" if lr is None else f" (lr={lr:g} now)"
    if change > 0:
        _warn(
            f"{method}: the ELBO has not converged: the loss fell by {change:.3g} nats {where}, "
            f"{change / se if se > 0 else math.inf:.1f} standard errors of its noise (thresholds {ELBO_TREND_Z:g} "
            f"and {ELBO_TREND_NATS:g} nat). "
            + (advice or f"Try more num_steps, or a higher lr{lr_now}")
            + "; post.history['loss'] shows the trace."
        )
    else:
        _warn(
            f"{method}: the ELBO got worse at the end of the run: the loss rose by {-change:.3g} nats {where} "
            f"(thresholds {ELBO_TREND_Z:g} standard errors and {ELBO_TREND_NATS:g} nat): the optimizer is "
            "unstable. "
            + (advice or f"Try a lower lr{lr_now} or lr_schedule='cosine'")
            + "; post.history['loss'] shows the trace."
        )


def check_predictive(post, *, advice: str = "") -> None:
    """Warn when the posterior is (close to) the prior in what it predicts at the training data: its
    predictive fits them less than :data:`FIT_GAIN_MIN` better than the best constant predictor,
    *and* its draws fit them, on average, less than :data:`FIT_GAIN_MIN` better than prior draws do
    (the second condition keeps a posterior that the data made confident that y barely depends on x
    from being flagged). Uses :data:`PREDICTIVE_DRAWS` posterior and prior draws at up to
    :data:`PREDICTIVE_ROWS` evenly spaced training rows; the global random state is left untouched.
    ``advice``: what to try, specific to the engine. Silent where :func:`collapse_message` applies: that fit predicts
    the mean because its learned noise absorbs the targets, one cause that :func:`check_noise_collapse` (``bp.fit``, every
    engine) says once, with its advice, rather than three warnings for it."""
    if post.x is None or post.y is None or getattr(post.model, "is_unbound", False):
        return
    x, y, fitted = _fitted_on_rows(post, post.x, post.y)
    if fitted is None:
        return
    means, losses, classes = fitted
    target = y.double()
    if classes:  # log loss of the averaged probabilities, against the class frequencies' entropy
        labels = target.reshape(-1).long()
        probs = means.mean(0).reshape(labels.shape[0], -1)
        freq = torch.bincount(labels, minlength=probs.shape[-1]).double() / labels.shape[0]
        baseline = float(-(freq[freq > 0] * freq[freq > 0].log()).sum())
        loss = float(-probs.gather(-1, labels[:, None]).clamp_min(1e-300).log().mean())
        what = f"log loss {loss:.3g} per point against {baseline:.3g} for the training class frequencies"
    else:  # squared error of the predictive mean, against the variance of y
        mean = means.mean(0)
        target = target.reshape(mean.shape)
        baseline, loss = float(((target - target.mean(0)) ** 2).mean()), float(((mean - target) ** 2).mean())
        what = f"RMSE {math.sqrt(loss):.3g} against {math.sqrt(baseline):.3g} for the mean of y"
    gain = 1.0 - loss / baseline if baseline > 0 else math.nan
    if not (math.isfinite(gain) and gain < FIT_GAIN_MIN):
        return  # the usual case: no prior draws needed
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        prior = _observations(post.model, x, y, PREDICTIVE_DRAWS)
    moved = math.nan if prior is None else 1.0 - float(losses.mean()) / float(prior[1].mean())
    # regression: the spread of f over the draws at the data, against the spread of the data themselves
    spread = math.nan if classes else float(means.var(0, correction=0).mean()) / baseline
    if (moved < FIT_GAIN_MIN or spread >= 1.0) and collapse_message(post) is None:  # a collapse is said once
        _warn(
            f"{post.method}: the posterior ignores the data: its predictive fits the training data no better than "
            f"a constant ({what}: {100 * gain:.0f}% better; threshold {100 * FIT_GAIN_MIN:.0f}%), and "
            + (
                f"its draws fit them only {100 * moved:.0f}% better than prior draws. "
                if moved < FIT_GAIN_MIN
                else f"f varies over the draws at the training inputs by {spread:.2g}x the variance of y (a posterior "
                "informed by the data is surer of f where it has seen data than the data's own spread). "
            )
            + f"{advice or 'Try a longer run or another method (e.g. nuts).'}"
        )


def _fitted_on_rows(post, x: torch.Tensor, y: torch.Tensor):
    """``(x, y, fitted)`` on :data:`PREDICTIVE_ROWS` evenly spaced rows of ``x``, ``y`` and up to
    :data:`PREDICTIVE_DRAWS` evenly spaced draws of ``post``: ``fitted`` is :func:`_observations`' answer (``None``
    where it has none), computed under a fixed seed with the global random state left untouched."""
    rows = torch.linspace(0, x.shape[0] - 1, min(PREDICTIVE_ROWS, x.shape[0])).round().long().unique()
    x, y = x[rows], y[rows]
    total = post.num_chains * post.num_draws
    idx = torch.linspace(0, total - 1, min(PREDICTIVE_DRAWS, total)).round().long().unique()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        return x, y, _observations(post, x, y, idx)


def _observations(source, x: torch.Tensor, y: torch.Tensor, draws):
    """Per draw: the observation model's mean (regression) or class probabilities, stacked
    ``(S, N, ...)``, and the loss at ``y`` (squared error or log loss per point, ``(S,)``), and whether
    it is a classification. ``source``: a Posterior with draw indices ``draws``, or a model with a
    number of prior draws. ``None`` where the model has no ``"obs"`` site it can say this for."""
    import pyro
    from pyro import poutine

    from bnn_pyro.model import BNN
    from bnn_pyro.posterior import Posterior
    from bnn_pyro.utils.targets import base_distribution

    if source is None:
        return None
    try:
        if isinstance(source, Posterior) and isinstance(source.model, BNN):
            fns, batched = [source.observation_distribution(x, draws)], True  # batched over the draws already
        elif isinstance(source, Posterior):
            fns, batched = [source.trace_draw(int(i), x, y).nodes["obs"]["fn"] for i in draws], False
        else:  # prior draws: the model run forward, conditioned on y only (its pyro.params kept out of the store)
            with poutine.block(), pyro.get_param_store().scope():
                fns = [poutine.trace(source).get_trace(x, y).nodes["obs"]["fn"] for _ in range(draws)]
            batched = False
    except KeyError:  # no "obs" site: nothing to compare
        return None
    classes = isinstance(base_distribution(fns[0]), (torch.distributions.Categorical, torch.distributions.Bernoulli))
    outs, losses = [], []
    for fn in fns:
        b = base_distribution(fn)
        out = (
            torch.stack([1 - b.probs, b.probs], -1)
            if isinstance(b, torch.distributions.Bernoulli)
            else b.probs
            if classes
            else fn.mean
        ).double()
        out = out if batched else out.unsqueeze(0)
        if classes:
            labels = y.reshape(-1).long()
            picked = out.reshape(out.shape[0], labels.shape[0], -1)[:, torch.arange(labels.shape[0]), labels]
            loss = -picked.clamp_min(1e-300).log().mean(-1)
        else:
            loss = ((out - y.double().reshape(out.shape[1:])) ** 2).reshape(out.shape[0], -1).mean(-1)
        outs.append(out)
        losses.append(loss)
    return torch.cat(outs), torch.cat(losses), classes


def check_mcmc(post, *, target_accept: float, acceptance: bool = False):
    """Every MCMC check (:func:`check_sampler`, :func:`check_mixing`) on a finished posterior; returns it.
    ``acceptance``: the method's kernel accepts or rejects each proposal whole (its declaration's
    ``accept_reject``)."""
    check_sampler(
        post.method,
        post.samples,
        post.sample_stats,
        target_accept=target_accept,
        max_tree_depth=post.config.get("max_tree_depth"),
        acceptance=acceptance,
    )
    check_mixing(post)
    return post


def svi_advice(post) -> str:
    """What to try after an SVI fit that failed a check, for its guide and model: a mean-field guide on a ``BNN``
    may have found the prior as its best ELBO (Coker et al. 2022); a Pyro function model is most often a run too
    short for parameters on very different scales (Adam moves each by about ``lr`` per step)."""
    from bnn_pyro.model import BNN

    guide = post.config.get("guide")
    if not isinstance(post.model, BNN):
        start = (
            ""
            if post.config.get("init") == "laplace"
            else "init='laplace' (the mode and the Laplace covariance as the start, the default for a Pyro function), "
        )
        return (
            "On a Pyro function model the guide moves each parameter by about lr per step, so parameters on very "
            f"different scales (a coefficient of 1,000 next to a noise scale of 1) need a good start: try {start}"
            "standardized covariates (and targets), more num_steps (the ELBO trace in post.history['loss'] "
            "should be flat at the end), or method='nuts' for the exact posterior of a small model."
        )
    if guide == "mean_field":
        return (
            "A mean-field guide on a wide net and a small data set can make the prior the best ELBO (Coker et al. "
            "2022, 'Wide mean-field Bayesian neural networks ignore the data'); more steps or kl_warmup do not "
            "change that optimum (docs/engines.md, 'Mean-field SVI on small data'): try guide='low_rank' or "
            "'full_rank', or method='nuts'."
        )
    if guide in ("full_rank", "low_rank"):
        return _factor_advice(post, guide)
    return "Try more num_steps if the ELBO is still falling, a smaller lr if it is noisy, or method='nuts'."


def _factor_advice(post, guide: str) -> str:
    """:func:`svi_advice` for a guide with a covariance factor on a ``BNN``: its entries random-walk under Adam at a
    rate set by ``lr`` (:func:`bnn_pyro.infer.svi_lr.default_lr`), so a fit that ignores the data needs a lower ``lr``,
    not more steps (which lengthen the walk)."""
    from bnn_pyro.infer.svi_lr import default_lr

    dim = sum(v[0, 0].numel() for v in post.samples.values())
    rank = post.config.get("guide_rank")
    entries = dim - 1 if guide == "full_rank" else rank or round(dim**0.5)
    advised = default_lr(guide, dim, rank)
    lr = post.config.get("lr")
    used = f"lr={lr:g}" if isinstance(lr, (int, float)) else f"lr={lr!r}"
    lower = min(advised, lr) / 10 if isinstance(lr, (int, float)) else advised / 10
    return (
        f"A {guide} guide on {dim} coordinates has {entries} free covariance-factor entries per row, and Adam moves "
        "each by about lr per step, mostly on Monte Carlo noise: the guide's sds grow with lr and the run's length "
        "until the fit ignores the data (at lr=0.01 a full-rank guide on wine and iris ended with sds 6-26 and "
        "accuracy 0.42 / 0.37: benchmarks/results/classification/svi_ood_cause_*_full_rank.md). This fit used "
        f"{used} (the default for this guide and size: {advised:.3g}). Try a lower lr (e.g. lr={lower:.2g}), not "
        "more num_steps; or num_particles=4 (less noise per step), or method='nuts'."
    )


NOISE_OVER_SPREAD_MAX = 1.0
""":func:`check_learned_noise` warns when a learned Gaussian noise sd (its posterior median) is at least this multiple
of the training targets' sd: the likelihood then ascribes all of y's variance to noise, i.e. the fitted f explains
none of it (a mean-field guide on little data ends there at its ELBO optimum, not for want of steps: see
``docs/engines.md``, "Mean-field SVI on small data")."""


def check_learned_noise(post, *, advice: str = "") -> None:
    """Warn when a ``BNN``'s learned homoscedastic Gaussian noise is at least :data:`NOISE_OVER_SPREAD_MAX` times the
    sd of its (single-output) training targets; ``advice``: what to try, specific to the engine. Silent where
    :func:`collapse_message` applies (the same noise, with the fit's R^2 and the signal it left unused, is said once by
    :func:`check_noise_collapse`)."""
    from bnn_pyro.likelihoods import Gaussian
    from bnn_pyro.model import BNN

    model, y = post.model, post.y
    if not isinstance(model, BNN) or type(model.likelihood) is not Gaussian or y is None or y.shape[0] < 2:
        return
    noise = {k: post.samples[k] for k in model.likelihood.sites() if k in post.samples}
    if not noise or y.reshape(y.shape[0], -1).shape[1] != 1 or not y.dtype.is_floating_point:
        return
    sigma = float(model.likelihood.noise_scale(noise).double().median())
    sd = float(y.double().std())
    if sd > 0 and sigma >= NOISE_OVER_SPREAD_MAX * sd and collapse_message(post) is None:  # a collapse is said once
        _warn(
            f"{post.method}: the learned noise sd ({sigma:.3g}, posterior median) is at least the training targets' "
            f"sd ({sd:.3g}; threshold {NOISE_OVER_SPREAD_MAX:g}x): the fit ascribes all of y's variance to noise "
            f"and its f explains none of it. {advice}"
        )


def check_guide_gap(post) -> None:
    """Warn when a chain's full-rank guide stopped short of its family's ELBO optimum: in some unconstrained coordinate
    the Newton step to the optimum (``post.history[GAP]``, :mod:`bnn_pyro.infer.svi_gap`) exceeds :data:`GAP_MAX`
    guide sds and :data:`GAP_Z` standard errors. The ELBO check cannot see it: under the cosine schedule the parameters
    freeze at the end wherever they are, so the loss's last windows agree. A chain without a verdict has NaN gaps (the
    reason in ``post.config["guide_gap"]``) and is not judged."""
    if GAP not in post.history or GAP_SE not in post.history:
        return
    gap, se = post.history[GAP].double(), post.history[GAP_SE].double()
    short = (gap.abs() > GAP_MAX) & (gap.abs() > GAP_Z * se)
    if not bool(short.any()):
        return
    labels = post.config.get("guide_coordinates") or [f"coordinate {i}" for i in range(gap.shape[-1])]
    chain, i = divmod(int(torch.where(short, gap.abs(), torch.zeros_like(gap)).argmax()), gap.shape[-1])
    n = int(short.any(0).sum())  # coordinates, not chains x coordinates
    steps = post.config.get("num_steps")
    more = f"num_steps={4 * steps}" if isinstance(steps, int) else "more num_steps"
    _warn(
        f"{post.method}: the {post.config.get('guide')} guide stopped short of its best fit: its mean of "
        f"{labels[i]} is {abs(float(gap[chain, i])):.2g} of its sds (+- {float(se[chain, i]):.1g}) from where the "
        f"ELBO's gradient puts the optimum (chain {chain}; {n} unconstrained coordinate(s) of {gap.shape[-1]} over "
        f"{GAP_MAX:g} sd and {GAP_Z:g} standard errors), a miss the ELBO trace does not show (the rate falls to 1% "
        f"of lr at the end). Try {more} (the schedule then keeps the rate up longer), or method='nuts' for the exact "
        "posterior of a small model; post.history['guide_gap'] holds the gaps."
    )


def check_svi(post):
    """Every SVI check (:func:`check_elbo` on ``history["loss"]``, :func:`check_guide_gap`, :func:`check_predictive`
    and :func:`check_learned_noise` with :func:`svi_advice`); returns ``post``."""
    check_guide_gap(post)
    if "loss" in post.history:
        unscaled = unscaled_targets(post.model, post.y)
        factor = post.config.get("guide") in ("full_rank", "low_rank")  # a higher lr speeds its factor's random walk
        check_elbo(
            post.history["loss"],
            method=post.method,
            lr=post.config.get("lr"),
            advice=f"The cause is likely the units, not the budget: {unscaled}"
            if unscaled is not None
            else "Try more num_steps (not a higher lr: with a covariance factor that speeds the random walk of its "
            "entries, bnn_pyro.infer.svi_lr.default_lr)"
            if factor
            else None,
        )
    advice = svi_advice(post)
    check_predictive(post, advice=advice)
    check_learned_noise(post, advice=advice)
    return post


TARGET_SD_MAX = 10.0
""":func:`unscaled_targets`: targets whose standard deviation exceeds 10 are in raw units for a BNN whose
weights have unit-scale priors: such a net's outputs, a priori, are O(1) (a sum of unit-variance terms
through bounded or unit-slope activations), so reaching them takes weights far out in the prior's tails."""
NOISE_FRACTION_MIN = 0.1
"""... and the fixed Gaussian noise is below a tenth of that sd: the likelihood then claims the net explains
more than 99% of the targets' variance in their raw units, its curvature is ``(sd_y / scale)^2`` times
that of a standardized fit (the step sizes that suit the prior are far too large for it), and the fit
ends worse than predicting the mean."""


def unscaled_targets(model, y) -> str | None:
    """What is wrong, when regression targets ``y`` are in raw units under a fixed Gaussian noise far below
    their spread (:data:`TARGET_SD_MAX`, :data:`NOISE_FRACTION_MIN`), and what to do; else ``None``.
    Only a ``BNN`` with a homoscedastic ``Gaussian(scale=<number>)`` likelihood is judged: a learned noise
    adapts to the units (the prior's mismatch remains, but the fit does not break)."""
    from bnn_pyro.likelihoods import Gaussian
    from bnn_pyro.model import BNN

    if y is None or not isinstance(model, BNN) or type(model.likelihood) is not Gaussian:
        return None
    scale = model.likelihood.scale
    if not isinstance(scale, (int, float)) or y.shape[0] < 2 or not y.dtype.is_floating_point:
        return None
    sd = float(y.double().reshape(y.shape[0], -1).std(0, correction=0).max())
    if not (sd > TARGET_SD_MAX and scale < NOISE_FRACTION_MIN * sd):
        return None
    return (
        f"the targets y have standard deviation {sd:.3g} (raw units; above {TARGET_SD_MAX:g}) but the "
        f"likelihood's fixed noise is Gaussian(scale={scale:g}), {sd / scale:.3g} times smaller: a unit-prior net "
        "cannot reach such targets and the likelihood is too sharp to optimize or sample. Standardize y "
        "(from bnn_pyro.data.splits import Standardizer; ys = Standardizer.fit(y); fit on ys.transform(y); map predictions back with "
        "ys.inverse(pred.mean) and ys.inverse_std(pred.std)) and set the noise in standardized units, or learn "
        "it: bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))."
    )


def check_targets(model, y) -> None:
    """Warn before a fit when :func:`unscaled_targets` finds raw-unit targets under a too-small fixed noise."""
    problem = unscaled_targets(model, y)
    if problem is not None:
        _warn(f"unscaled targets: {problem}")


def _classifies(post) -> bool:
    """Whether ``post``'s model is a classifier (its likelihood's ``task`` is ``"classification"``): the off-data
    checks judge only those (regression fits and plain Pyro models have no such likelihood)."""
    return getattr(getattr(post.model, "likelihood", None), "task", None) == "classification"


def check_off_data(post, reason: str):
    """Warn, for a classification fit (a ``BNN`` whose likelihood's ``task`` is ``"classification"``), that nothing
    in the engine makes its predictive less sure on inputs far from the training data (its entropy and mutual
    information rise there only by accident of the input's direction), and why: ``reason``, the engine's structural limit,
    one sentence. Regression fits and plain Pyro models are not judged. Returns ``post``."""
    if not _classifies(post):
        return post
    _warn(
        f"{post.method}: off-data uncertainty is not represented: {reason} So the predictive's entropy and mutual "
        "information need not rise on inputs unlike the training data (on public tabular sets, Gaussian-noise inputs "
        "were told apart from test rows with an AUROC well below the 0.8 that NUTS reaches; docs/ood.md). For "
        "out-of-distribution detection use method='nuts' (the exact posterior, which also keeps the test log loss) "
        "or method='ensemble' (anchored members, the default; it pays test log loss on small data sets)."
    )
    return post


QUADRATIC_RATIO_MAX = 4.0
""":func:`check_quadratic` warns when a Laplace classifier's draws fit the training rows worse than its mean by more
than this many times ``gamma / 2``, the excess the quadratic model of the log likelihood predicts (1 were it exact;
:mod:`bnn_pyro.infer.laplace.quadratic`). Measured at the defaults (last layer): 1.6-2.3 on iris, wine and
breast_cancer splits 0-1, where the test log loss stays within 0.03-0.04 of logistic regression's; 10.7 and more on
digits, where it is 3x the exact last-layer posterior's (``benchmarks/results/laplace_classification/``)."""


def check_quadratic(post, *, cause: str = ""):
    """Warn when a Laplace classifier's Gaussian puts its draws where the log likelihood is not quadratic: its
    draws' mean excess negative log likelihood on the training rows over its mean's exceeds
    :data:`QUADRATIC_RATIO_MAX` times ``gamma / 2`` (``post.config["quadratic_excess"]``, per chain, written by
    :func:`~bnn_pyro.infer.laplace.fit_laplace` where the network is linear in the covered weights). The predictive
    is then less sure than the posterior on the data themselves. ``cause``: the likely reason, one sentence.
    Returns ``post``."""
    record = post.config.get("quadratic_excess")
    if not record:
        return post
    worst = max(record if isinstance(record, list) else [record], key=lambda r: r["excess"] / max(r["expected"], 1e-12))
    ratio = worst["excess"] / max(worst["expected"], 1e-12)
    if ratio > QUADRATIC_RATIO_MAX:
        _warn(
            f"{post.method}: the Gaussian is far wider than the posterior on the data themselves: its draws fit the "
            f"training rows {worst['excess']:.3g} nats worse than its mean, {ratio:.1f} times the "
            f"{worst['expected']:.3g} its quadratic model predicts (gamma / 2, threshold {QUADRATIC_RATIO_MAX:g}x), "
            f"so its predictions are underconfident on inputs like the training rows (its test log loss can be "
            f"several times the posterior's). {cause}Use method='nuts' (the exact posterior; for the last layer alone "
            "it removed the gap on digits) or method='svi' / 'sghmc'; a larger prior_precision narrows the Gaussian "
            "but changes the model's prior (docs/ood.md)."
        )
    return post


def check_scale_free_off_data(post, reason: str):
    """Warn, for a classification fit of variational or sparse variational dropout, that its spread in the weight
    directions the training rows leave free is not the model's prior's, and why: ``reason``, the variant's structural
    limit, one sentence (``docs/ood.md`` derives it: a Gaussian with ``sd <= |theta|`` under a scale-free prior keeps
    the initial ``|theta|`` there, or prunes the weight). Regression fits and plain Pyro models are not judged.
    Returns ``post``."""
    if not _classifies(post):
        return post
    _warn(
        f"{post.method}: off-data uncertainty is limited by its variational family, not set by the data: {reason} So "
        "the predictive's entropy and mutual information rise less on inputs unlike the training data than the "
        "posterior's (on public tabular sets, Gaussian-noise inputs were told apart from test rows with an AUROC of "
        "0.44-0.78 by mutual information, below the 0.8 that NUTS and SG-HMC reach; docs/ood.md). For "
        "out-of-distribution detection use method='nuts' (the exact posterior, small models) or method='sghmc' (met "
        "that target on every tabular split measured); method='svi' (mean field, a free sd under the model's own "
        "prior) comes closer."
    )
    return post


def check_anchored_log_loss(post, *, units: str):
    """Warn, for a classification fit (a ``BNN`` whose likelihood's ``task`` is ``"classification"``) whose ``units``
    (``"members"``, ``"chains"``, ``"cycles"``) are anchored (:mod:`bnn_pyro.infer.anchor`), that their mixture's
    test log loss can be well above the exact posterior's. Regression fits and plain Pyro models are not judged.
    Returns ``post``.

    Each anchored unit is the mode of a randomized objective, not a posterior draw; for a linear-Gaussian model the
    two agree only with the targets perturbed too, and a Categorical likelihood has no such exact perturbation (a
    linear term ``eps^T f`` with the Fisher's covariance makes the objective unbounded below whenever ``y - eps``
    leaves the simplex). On wine the mixture converges to a test log loss of about 0.13 where the posterior's is
    0.087, and what each remedy tried changed (``benchmarks/results/classification/experiments_anchored_remedies.md``)
    rules out the fit-time criteria at hand: members whose training log loss was raised to a posterior draw's
    (weighted likelihood bootstrap) kept the gap, so the members' training log loss does not tell; early stopping
    closed it only by giving up the off-data spread. So the note is given for every such fit, with the reason and
    what to use instead, rather than on a criterion that was measured not to predict the gap."""
    if not _classifies(post):
        return post
    _warn(
        f"{post.method}: the test log loss may be well above the posterior's: its anchored {units} are modes of "
        "randomized objectives, not posterior draws, and for a classifier their mixture does not converge to the "
        "posterior predictive (wine: 40 anchored members reached a test log loss of 0.131 where the exact "
        "posterior's is 0.087). Their spread on inputs unlike the training data holds; no variant of the anchored "
        f"{units} tried closed the gap without losing that spread (docs/ood.md). For both use method='nuts' (the "
        "exact posterior, for models this small) or method='sghmc'; anchored=False keeps the log loss of plain MAP "
        "fits and loses that spread."
    )
    return post


def check_spread(post, reason: str):
    """Warn that the spread of ``post``'s draws is not the model's posterior spread, and why: ``reason``, the
    engine's structural limit, one sentence (e.g. SWA: one point per chain). Every task and model. Returns
    ``post``."""
    _warn(
        f"{post.method}: its draws' spread is not this model's posterior: {reason} So post.summary()'s sds and "
        "the predictive's epistemic spread do not estimate the posterior's (on an exact Bayesian linear "
        "regression: docs/reference_suite.md). For posterior uncertainty use method='nuts' (exact, small models), "
        "'laplace', 'swag' or 'ensemble'."
    )
    return post


NARROW_MAX = 1.5
""":func:`check_narrow` warns when the draws' sd of some coordinate is below ``1 / 1.5`` of the Laplace
approximation's at their mean (the bound SVI's start check uses, ``svi_start.SHRINK_MAX``: on a Gaussian posterior
the Laplace sd is exact, and a mean-field optimum's is ``1 / sqrt(H_ii)``; MacKay 2003, section 33.5) ..."""
NARROW_TAIL = 1e-3
"""... after the chance that ``n`` exact draws give so small an sd: the threshold is multiplied by the ``1e-3``
quantile of ``sqrt(chi2_{n-1} / (n - 1))`` (0.15 for 5 draws, 0.90 for 1,000), so 5 ensemble members or snapshots
are not flagged for the spread of 5 numbers."""
NARROW_MAX_DIM = 200
"""Largest number of latent coordinates :func:`check_narrow` takes the dense Hessian of (``NARROW_MAX_DIM`` gradient
passes over the training data): the small models whose posteriors users check; larger ones are not judged."""


def unconstrained_draws(post, *, init: str):
    """``(pot, flat)``: the generic potential of ``post``'s model on its training tensors (started by ``init``) and
    ``post``'s draws as an ``(n, P)`` tensor of its unconstrained coordinates, in the draws' dtype; or ``None`` where
    they are not judged: a model the generic potential cannot trace, more than :data:`NARROW_MAX_DIM` coordinates, or
    a latent site missing from ``post.samples``."""
    from bnn_pyro.infer._potential import Potential
    from bnn_pyro.infer.training_data import Data

    n = post.num_chains * post.num_draws
    try:
        with torch.random.fork_rng(devices=[]):
            pot = Potential(post.model, Data(post.x, post.y), init=init, fast_path=False)
    except (ValueError, RuntimeError, TypeError):  # a model the generic potential cannot trace: not judged
        return None
    if pot.dim > NARROW_MAX_DIM or not set(pot.shapes) <= set(post.samples):
        return None
    with torch.no_grad():
        draws = {k: post.samples[k].to(post.x.device).reshape(n, *post.samples[k].shape[2:]) for k in pot.shapes}
        return pot, pot.flatten(pot.unconstrain(draws)).reshape(n, pot.dim)


def check_narrow(post, *, cause: str = "", sd: dict[str, torch.Tensor] | None = None, functions: bool = False):
    """Warn when ``post``'s draws are narrower, in some unconstrained coordinate, than the Laplace approximation at
    their mean by more than :data:`NARROW_MAX` (with :data:`NARROW_TAIL`'s allowance for few draws). Judged only
    for a ``BNN`` (and, with ``functions=True``, a Pyro function: its latent sites, the potential started at their
    prior medians) with training tensors, at most :data:`NARROW_MAX_DIM` latent coordinates, every latent site in
    ``post.samples``, and a positive definite Hessian there (a mixture's mean between modes is not judged).
    ``cause``: the engine's likely reason, one sentence. ``sd``: the approximation's own sd per site (unconstrained,
    the site's shape), where the engine fitted a distribution whose sd it knows (a Gaussian ``q``): it is judged
    instead of the draws' sample sd, with no allowance for few draws (none are needed to know it; variational
    dropout's 200 draws would otherwise lower the threshold to 0.565 and let an sd of 0.57 of the exact one pass).
    ``anchored=False`` members of a Pyro function from its prior median (:func:`_one_start_plain_members`) are told
    they are one point, with their own advice, instead of ``cause``. Returns ``post``."""
    from scipy import stats

    from bnn_pyro.infer._potential import dense_precision
    from bnn_pyro.model import BNN

    n = post.num_chains * post.num_draws
    is_bnn = isinstance(post.model, BNN)
    if not (is_bnn or functions) or post.x is None or post.y is None or n < 2:
        return post
    judged = unconstrained_draws(post, init="net" if is_bnn else "median")
    if judged is None:
        return post
    pot, flat = judged
    dtype, flat = flat.dtype, flat.double()  # the weights' dtype, not the inputs' (token ids are integers)
    mean, spread = flat.mean(0), flat.std(0)
    known = None
    if sd is not None and set(pot.shapes) <= set(sd):
        known = pot.flatten({k: sd[k].to(flat.device) for k in pot.shapes}).double()
    chol = dense_precision(pot.flat_fn(), mean.to(dtype))[1]
    if chol is None:
        return post
    laplace_sd = torch.cholesky_inverse(chol).diagonal().sqrt()
    if known is None:
        ratio, allowed = spread / laplace_sd, math.sqrt(stats.chi2.ppf(NARROW_TAIL, n - 1) / (n - 1)) / NARROW_MAX
    else:
        ratio, allowed = known / laplace_sd, 1.0 / NARROW_MAX
    worst = int(ratio.argmin())
    if float(ratio[worst]) < allowed:
        names = [f"{k}[{i}]" for k, shape in pot.shapes.items() for i in range(math.prod(shape))]
        judged = (
            f" for {n} draws: 1/{NARROW_MAX:g}, less what chance allows so few"
            if known is None
            else f": 1/{NARROW_MAX:g}, judged on the fitted distribution's own sd"
        )
        if known is None and _one_start_plain_members(post, is_bnn):  # anchored=False: another cause, other advice
            _warn(_one_point_message(post, names[worst], float(ratio[worst]), f"{allowed:.2g}{judged}"))
            return post
        _warn(
            f"{post.method}: the draws are too narrow: the sd of {names[worst]} (unconstrained) is "
            f"{float(ratio[worst]):.2g} times the Laplace approximation's at their mean (threshold {allowed:.2g}"
            f"{judged}), so intervals and the predictive's "
            f"epistemic spread are too small. {cause}Try method='laplace' or 'nuts' on a model this small, or "
            "standardize (center) the inputs so that the weights decorrelate."
        )
    return post


# ------------------------------------------------ check_narrow, anchored=False members of a Pyro function
def _one_start_plain_members(post, is_bnn: bool) -> bool:
    """Whether ``post``'s draws are plain MAP fits (``anchored=False`` and no observation weights, ``bootstrap=False``
    or nothing to weight: one point per chain) of one objective from one start: a Pyro function's members start at its prior median (``config["init"] == "median"``, the default there)
    and minimize the same log joint, so they reach the same minimum and their spread is the optimizer's (none once
    :func:`bnn_pyro.infer.map_fit.converge` has finished them), not the posterior's; the anchored cause
    :func:`check_narrow` is given does not apply."""
    config = post.config
    weighted = "scheme" in (config.get("observation_weights") or {})  # weighted members differ by their weights
    plain = config.get("anchored") is False and not weighted
    return not is_bnn and plain and config.get("init") == "median" and post.num_draws == 1


def _one_point_message(post, name: str, ratio: float, threshold: str) -> str:
    """:func:`check_narrow`'s warning for :func:`_one_start_plain_members`' case: the members are one point; the
    remedies are members that differ by design (the default ``anchored=True``) or the exact posterior (NUTS)."""
    return (
        f"{post.method}: the draws are one point, not posterior draws: the sd of {name} (unconstrained) is {ratio:.2g} "
        f"times the Laplace approximation's at their mean (threshold {threshold}). With anchored=False the members "
        "are plain MAP fits of one objective, and on a Pyro function each starts at the prior median, so they all "
        "reach the same mode: their spread is the optimizer's, not the posterior's, and intervals and the "
        "predictive's epistemic spread are near zero. Use the default anchored=True (each member minimizes its own "
        "objective, anchored at its own prior draw) or method='nuts' (the exact posterior, for models this small)."
    )


def check_descent(post, *, start: int = 0):
    """Warn when a chain's potential (``history["potential"]``, the negative log joint) is higher, on average over the
    run's last :data:`ELBO_WINDOW`, than at its first step by more than the number of latent coordinates ``P``: the
    run diverged (a step size too large for the model's curvature) and its draws sit wherever it ended. An optimizer
    (snapshot ensembles) descends; a sampler (SG-MCMC) from a start off the posterior descends too, to a potential
    that fluctuates around its posterior mean, ``P / 2`` above the minimum for a Gaussian posterior, so a rise of
    more than ``P`` is not posterior noise. It judges divergence, not convergence: a run that rose and came partly
    back, or that is still creeping down a flat direction, ends below its start and passes (main's snapshot on the
    logistic reference started at 10,170, rose to 758,428 by its first snapshot and ended at 3,444, thousands of nats
    above the mode); without the mode's level that is not visible in the trace, and for a Pyro function
    :func:`check_typical` judges the draws against the mode. ``start``: the step the end is compared with (default
    0, the run's first); a run whose objective changes between cycles (a snapshot ensemble's weighted cycles, whose
    potentials differ by the weights, by about ``sqrt(n)`` nats on ``n`` rows) passes its last cycle's first step, and
    the window is kept within that cycle. Returns ``post``."""
    trace = post.history.get("potential")
    if trace is None or trace.shape[-1] - start < 2 * ELBO_MIN_WINDOW:
        return post
    trace = torch.as_tensor(trace).double().reshape(-1, trace.shape[-1])[:, start:]
    width = max(int(trace.shape[-1] * ELBO_WINDOW), ELBO_MIN_WINDOW)
    start, end = trace[:, 0], trace[:, -width:].mean(-1)
    dim = sum(v[0, 0].numel() for v in post.samples.values())
    worse = (end > start + dim) | ~torch.isfinite(end)
    if bool(worse.any()):
        c = int(worse.nonzero()[0, 0])
        step = post.history.get("step_size")
        peak = "" if step is None else f" (its step size peaked at {float(torch.as_tensor(step)[c].max()):.3g})"
        _warn(
            f"{post.method}: chain {c} diverged: its potential (negative log joint) ended at {float(end[c]):.4g} on "
            f"average over the last {width} steps, above the {float(start[c]):.4g} it started from{peak}, so its "
            f"draws are wherever the run ended, not near a mode. Standardize the inputs (a covariate on a scale far "
            f"from 1 makes the curvature uneven), or pass a smaller lr (now {post.config.get('lr')!r}); "
            "post.history['potential'] shows the trace."
        )
    return post


def check_training_noise(method: str, n: int, *, rows: int) -> None:
    """Warn, at the start of a fit of an engine that starts from a point fit (a MAP), that its learned Gaussian
    noise will be the training residual: the data (``n`` rows) are too few to hold ``rows`` rows out
    (:mod:`bnn_pyro.infer.holdout`) and still train on as many. An over-parameterized net nearly interpolates
    small data, so that residual is far below the test error (friedman1, 90 rows: a Laplace noise sd near 0 and
    test log-likelihoods of -1e7 nats per point; ``benchmarks/results/uci/small_data_noise.md``), and the predictive
    is overconfident."""
    _warn(
        f"{method}: the learned observation noise will be the training residual of a point fit: {n} rows are too "
        f"few to hold out {rows} for choosing it (at least {2 * rows} are needed), and a net that fits its training "
        "rows closely sets the noise far below the test error, so the predictive is overconfident. Pass held-out "
        "data, validation=(x_val, y_val), or a fixed noise in the targets' units, "
        "likelihood=bp.likelihoods.Gaussian(scale=...)."
    )


def check_gaussian(post, *, cause: str = ""):
    """Warn when the importance ratios ``p(z, y) / q(z)`` of ``post``'s draws from its Gaussian ``q`` have a Pareto
    ``k_hat`` above :data:`~bnn_pyro.posterior.psis.K_HAT_MAX` (0.7; Yao, Vehtari, Simpson & Gelman 2018): the
    posterior is then far from ``q`` (skewed, heavy-tailed, or centred elsewhere than ``q``'s mode) and neither
    ``q``'s moments nor reweighted ones can be trusted. The warning names the coordinate whose mean the smoothed
    importance weights move most, in ``q``'s sds: where ``q`` is wrong. Judged for a Pyro function model (a few
    interpretable sites; a network's ``k_hat`` is large in any case) whose draws record ``log q`` and that holds its
    training tensors, at most :data:`NARROW_MAX_DIM` latent coordinates and at least
    :data:`~bnn_pyro.posterior.psis.RELIABLE_DRAWS_PER_CHAIN` (100) draws per chain: each chain is smoothed on its own
    and ``k_hat`` is the largest over chains, and the Pareto fit takes the largest ``min(S / 5, 3 sqrt(S))`` ratios,
    so with fewer draws per chain a good ``q`` is judged far in a large share of runs (1 in 4 at 4-5 chains of 21-25
    draws; below 21 ``k_hat`` is undefined). ``cause``: the engine's likely reason, one sentence. Returns ``post``."""
    from bnn_pyro.model import BNN
    from bnn_pyro.posterior.psis import K_HAT_MAX, RELIABLE_DRAWS_PER_CHAIN, psis

    n = post.num_chains * post.num_draws
    if isinstance(post.model, BNN) or "log_q" not in post.sample_stats or post.x is None or post.y is None:
        return post
    if post.num_draws < RELIABLE_DRAWS_PER_CHAIN:  # too few draws per chain for k_hat to judge q by
        return post
    judged = unconstrained_draws(post, init="median")  # the coordinates in which q is a Gaussian (log tau for tau)
    if judged is None:
        return post
    pot, flat = judged
    flat = flat.double()
    names = [
        f"{k} (unconstrained)" if math.prod(shape) == 1 else f"{k}[{i}] (unconstrained)"
        for k, shape in pot.shapes.items()
        for i in range(math.prod(shape))
    ]
    try:
        result = psis(post, warn=False)
    except FloatingPointError:  # a draw where p or q is zero or overflows: the ratios' tail is unbounded
        k_hat, where = math.inf, "some draws have a non-finite density ratio"
    else:
        k_hat = result.k_hat
        w = result.weights.reshape(-1, 1).to(flat)
        shift = ((w * flat).sum(0) / w.sum() - flat.mean(0)).abs() / flat.std(0).clamp_min(1e-300)
        worst = int(shift.argmax())
        where = f"reweighting them moves the mean of {names[worst]} by {float(shift[worst]):.2g} of its sd"
    if k_hat > K_HAT_MAX:
        _warn(
            f"{post.method}: the posterior is far from the fitted Gaussian: the Pareto k_hat of the importance ratios "
            f"p/q of its {n} draws is {k_hat:.2f} (threshold {K_HAT_MAX}; Yao et al. 2018), and {where}, "
            f"so its means, sds and intervals are unreliable. {cause}Use method='nuts' for this model."
        )
    return post


COLLAPSE_R2_MAX = 0.1
""":func:`check_noise_collapse` warns when the posterior predictive mean explains less than 10% of the training
targets' variance (``R^2 = 1 - MSE / Var(y)`` on the training rows): "almost none" of it. The zoo's
``mlp_regression`` card fitted by mean-field SVI ends at a training ``R^2`` of -0.01 to 0.01 over seeds 0-2; fits of
those data that use them reach 0.79-0.96 (a full-rank guide, which uses them in part, 0.40-0.41;
``benchmarks/results/zoo_svi_collapse/``)."""
COLLAPSE_NOISE_MIN = 0.9
"""... and its learned Gaussian noise sd (posterior median) is at least 0.9 of the training targets' sd: the noise
absorbs what the mean leaves. A fit that explains a fraction ``R^2`` of ``Var(y)`` and puts the rest in the noise has
``sigma = sqrt(1 - R^2) sd(y)``, 0.95 at ``R^2 = 0.1``; 0.9 leaves room for a noise prior that pulls ``sigma`` down."""
COLLAPSE_SIGNAL_MIN = 0.3
"""... while a plain regression on the same rows explains at least 30% of the targets' variance out of sample: the
larger of the leave-one-out ``R^2`` of ridge regression (penalty 1, inputs standardized) and of
:data:`COLLAPSE_NEIGHBOURS`-nearest-neighbour regression (standardized inputs). So the data carry signal that the fit
left unused; where ``y`` does not depend on ``x`` (both near or below 0) explaining nothing is the right answer and
nothing is said. Both references are weak in many dimensions, so the gate errs towards silence there."""
COLLAPSE_NEIGHBOURS = 5
"""Neighbours of the nearest-neighbour reference of :data:`COLLAPSE_SIGNAL_MIN`: a smoother that needs no tuning and
finds a nonlinear signal of a few inputs (the zoo's one-input sine, friedman1's five of ten)."""


def reference_r2(x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
    """The larger leave-one-out ``R^2`` of two plain regressions of ``y`` (``(N,)``) on ``x`` (``(N, ...)``, flattened
    and standardized per column), and which one: ridge regression with penalty 1 (its leave-one-out residuals in
    closed form, ``e_i / (1 - H_ii)`` with the hat matrix ``H``; Hastie, Tibshirani & Friedman 2009, eq. 7.52) and the
    mean of the :data:`COLLAPSE_NEIGHBOURS` nearest other rows (Euclidean). Used by :func:`check_noise_collapse`."""
    x = x.reshape(x.shape[0], -1).double()
    y = y.reshape(-1).double()
    n = x.shape[0]
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-12)
    yc = y - y.mean()
    total = float(yc.pow(2).sum())
    if n < 2 * COLLAPSE_NEIGHBOURS or total <= 0:
        return math.nan, "none"
    # ridge in its kernel form (any number of columns): H = K (K + I)^-1 with K = x x^T; the intercept is the mean
    kernel = x @ x.T
    hat = torch.linalg.solve(kernel + torch.eye(n, dtype=x.dtype, device=x.device), kernel)
    resid = (yc - hat @ yc) / (1.0 - hat.diagonal() - 1.0 / n).clamp_min(1e-12)
    ridge = 1.0 - float(resid.pow(2).sum()) / total
    dist = torch.cdist(x, x)
    dist.fill_diagonal_(math.inf)
    near = dist.topk(COLLAPSE_NEIGHBOURS, largest=False).indices
    knn = 1.0 - float((y - y[near].mean(-1)).pow(2).sum()) / total
    return (ridge, "ridge regression") if ridge >= knn else (knn, f"{COLLAPSE_NEIGHBOURS}-nearest-neighbour regression")


def check_noise_collapse(post):
    """Warn when a regression fit of a ``BNN`` with a learned Gaussian noise "predicts the mean"
    (:func:`collapse_message`: its predictive mean explains less than :data:`COLLAPSE_R2_MAX` of the training targets'
    variance, its noise sd is at least :data:`COLLAPSE_NOISE_MIN` of their sd, and a plain regression explains at least
    :data:`COLLAPSE_SIGNAL_MIN` of it out of sample). With a learned noise that collapse can be the model's best fit
    (mean-field SVI's best ELBO on the zoo's ``mlp_regression``, whose fits that use the data end at worse ELBOs:
    ``benchmarks/results/zoo_svi_collapse/``), so no other check sees its cause. For any engine (``bp.fit`` runs it on
    every posterior); :func:`check_predictive` and :func:`check_learned_noise`, which see its symptoms, stay silent on
    such a fit, so the collapse is said once. Returns ``post``."""
    message = collapse_message(post)
    if message is not None:
        _warn(message)
    return post


def collapse_message(post) -> str | None:
    """The warning :func:`check_noise_collapse` gives for ``post``, or ``None`` where the fit did not collapse (see
    there; ``None`` too for a model or data it does not judge). Judged on up to :data:`PREDICTIVE_ROWS` training rows
    and :data:`PREDICTIVE_DRAWS` draws (a fixed seed, the global random state left untouched), single-output
    targets only."""
    from bnn_pyro.likelihoods import Gaussian
    from bnn_pyro.model import BNN

    model, x, y = post.model, post.x, post.y
    if not isinstance(model, BNN) or not isinstance(model.likelihood, Gaussian) or x is None or y is None:
        return None
    noise = {k: post.samples[k] for k in model.likelihood.sites() if k in post.samples}
    if not noise or not isinstance(x, torch.Tensor) or not y.dtype.is_floating_point or y.shape[0] < 2:
        return None
    if y.reshape(y.shape[0], -1).shape[1] != 1:
        return None
    x, y, fitted = _fitted_on_rows(post, x, y)
    if fitted is None:
        return None
    target = y.double().reshape(-1)
    sd = float(target.std())
    mean = fitted[0].mean(0).reshape(-1)
    r2 = 1.0 - float((mean - target).pow(2).mean()) / float((target - target.mean()).pow(2).mean())
    sigma = float(model.likelihood.noise_scale(noise).double().median())
    if not (sd > 0 and r2 < COLLAPSE_R2_MAX and sigma >= COLLAPSE_NOISE_MIN * sd):
        return None
    signal, which = reference_r2(x, target)
    if not signal >= COLLAPSE_SIGNAL_MIN:
        return None
    svi = post.method == "svi"
    mean_field = svi and post.config.get("guide") == "mean_field"
    return (
        f"{post.method}: the fit predicts the mean and its learned noise absorbs the rest: its predictive mean's R^2 "
        f"on the training rows is {r2:.2f} (threshold {COLLAPSE_R2_MAX:g}) and the noise sd ({sigma:.3g}, posterior "
        f"median) is {sigma / sd:.2f} of the targets' sd ({sd:.3g}), while "
        f"{which} on the same rows explains {100 * signal:.0f}% of it out of sample (leave-one-out): the data carry "
        "signal the fit does not use. With a learned noise, 'f constant, sigma ~ sd(y)' can be the model's best fit"
        + (" (for SVI with a mean-field guide it can be the best ELBO, which more steps only approach)" if svi else "")
        + ". Try a fixed noise in y's units, likelihood=bp.likelihoods.Gaussian(scale=...), or a tighter noise prior "
        "(e.g. scale=dist.HalfNormal(0.1 * y.std()))"
        + (", kl_warmup=0.9 (it stops short of that optimum; docs/engines.md)" if svi else "")
        + (", guide='low_rank' or 'full_rank'" if mean_field else "")
        + (", or method='nuts' (the exact posterior, for models this small)." if post.method != "nuts" else ".")
    )


ACTIVE_UNIT_SNR = 2.0
""":func:`check_gaussian_guide_off_data` counts a hidden unit as carrying the fit when one of its output weights has a
fitted mean larger than 2 of its sds (its sign holds in about 98% of draws); the others are pruned, their output
weights centred near 0 (Trippe & Turner 2018, "Overpruning in variational Bayesian neural networks")."""


def active_units(post) -> tuple[int, int] | None:
    """``(active, total)`` hidden units feeding ``post``'s output layer (its last sampled weight matrix), a unit active
    when one of its output weights' ``|mean| / sd`` over the draws exceeds :data:`ACTIVE_UNIT_SNR`; ``None`` without
    a hidden layer (fewer than two sampled weight matrices: a linear model's inputs are not units)."""
    names = [k for k, v in post.samples.items() if k.endswith("weight") and v.dim() == 4]
    if len(names) < 2:
        return None
    w = post.samples[names[-1]].double()
    w = w.reshape((-1,) + w.shape[2:])
    ratio = (w.mean(0).abs() / w.std(0).clamp_min(1e-300)).amax(0)
    return int((ratio > ACTIVE_UNIT_SNR).sum()), ratio.numel()


def check_gaussian_guide_off_data(post):
    """Warn, for a classification fit of a ``BNN`` with a hidden layer by SVI with a Gaussian guide (mean-field,
    low-rank or full-rank), that its off-data uncertainty can fall short of the posterior's, and why (``docs/ood.md``,
    "Mean-field SVI off the data"): the guide carries the fit in a few hidden units with well-determined weights
    (:func:`active_units`) and prunes the rest, so its mean function extrapolates like one network and its draws agree
    on the class on inputs unlike the training rows more often than the posterior's do. A full-rank guide fitted four
    times longer from a wider start ends the same way, so it is the Gaussian family, not the factorization. No quantity of the fit was found to tell the splits where
    that costs the noise AUROC from those where it does not, so every such fit is told. Returns ``post``."""
    from bnn_pyro.model import BNN

    gaussian = ("mean_field", "low_rank", "full_rank")
    if post.config.get("guide") not in gaussian or not isinstance(post.model, BNN) or not _classifies(post):
        return post
    units = active_units(post)
    if units is None:  # no hidden units to prune: a linear model's Gaussian guide is not what this is about
        return post
    carried = (
        f" (here {units[0]} of the output layer's {units[1]} inputs have an output weight whose mean exceeds "
        f"{ACTIVE_UNIT_SNR:g} sds; the rest are pruned)"
    )
    _warn(
        f"{post.method}: off-data uncertainty can fall short of the posterior's with a Gaussian guide "
        f"(guide={post.config['guide']!r}): it carries the fit in a few hidden units with well-determined "
        f"weights{carried}, so its mean function extrapolates like one network and its draws agree on the class on "
        "inputs unlike the training data more often than posterior draws do (on public tabular sets the mean-field "
        "guide's noise AUROC by mutual information was 0.10-0.19 below NUTS's on the 4 splits compared and below 0.8 "
        "on 2 of 6, and a full-rank guide's no better; kl_warmup, init_scale, the closed-form KL, more particles and "
        "inputs rotated to their principal axes left it there; docs/ood.md). For out-of-distribution detection use "
        "method='nuts' (the exact posterior, for models this small) or method='sghmc' (met that target on every "
        "tabular split measured)."
    )
    return post


TYPICAL_TAIL = 1e-3
""":func:`check_typical` warns when the median draw's potential exceeds the mode's by more than the ``1 - 1e-3``
quantile of ``chi2_P / 2``: for a Gaussian posterior in ``P`` unconstrained coordinates ``2 (U(z) - U(z*))`` of an
exact draw is ``chi2_P``, so even one exact draw passes that with probability 1e-3, and the median of many far less
often (a skewed posterior such as eight schools' puts its median draw well inside it: ``docs/reference_suite.md``)."""
TYPICAL_DRAWS = 200
"""Draws (evenly spaced over the chains and draws) whose potential :func:`check_typical` evaluates: the median of
200 is known to within a few percent of the spread of ``U``, ample for a threshold that far-off fits miss by orders
of magnitude; it bounds the check's cost (200 traces of the model and a Newton search of its mode, and where no
mode is near the best draw, the Laplace start's L-BFGS search: a few seconds for 46 coordinates)."""
TYPICAL_NEWTON_STEPS = 50
"""Newton steps :func:`check_typical` takes from the best draw towards the mode (each halved until ``U`` does not
rise): where the search stops short, the gap it reports is smaller than the true one, never larger."""


def check_typical(post, *, cause: str = ""):
    """Warn when ``post``'s draws lie where the posterior has almost no mass: the median over its draws (up to
    :data:`TYPICAL_DRAWS`) of ``U(z) - U(z*)``, the potential (negative log joint, unconstrained coordinates) above
    the mode ``z*``, exceeds :data:`TYPICAL_TAIL`'s quantile of ``chi2_P / 2`` (``P`` coordinates). The mode is found
    by Newton steps from the best draw (:func:`~bnn_pyro.infer._potential.newton_mode`), or, where the Hessian there
    is not positive definite (no mode nearby), by the search SVI's Laplace start makes from the prior median
    (:func:`~bnn_pyro.infer.svi_start.laplace_start`), whichever is lower: a search that stops short understates the
    gap, so the check can miss, not false-alarm, by it. Judged for a Pyro function model (a few
    interpretable sites with one mode, where the chi-square law of ``U`` holds near a Gaussian posterior; a
    network's posterior has many modes at different heights) that holds its training tensors and has at most
    :data:`NARROW_MAX_DIM` coordinates. The reference suite found ensemble members and SWAG chains on a regression
    with a covariate near 100 (kidiq) hundreds to thousands of posterior sds off, silently: first-order steps from
    prior draws had not reached the posterior. ``cause``: the engine's likely reason, one sentence. Returns
    ``post``."""
    from scipy import stats

    from bnn_pyro.infer._potential import newton_mode
    from bnn_pyro.infer.svi_start import laplace_start
    from bnn_pyro.infer.training_data import Data
    from bnn_pyro.model import BNN

    if isinstance(post.model, BNN) or post.x is None or post.y is None:
        return post
    judged = unconstrained_draws(post, init="median")
    if judged is None:
        return post
    pot, flat = judged
    if pot.dim == 0:  # no latent coordinate: nothing to judge
        return post
    fn, n = pot.flat_fn(), flat.shape[0]
    keep = flat[torch.linspace(0, n - 1, min(n, TYPICAL_DRAWS)).round().long()]
    with torch.no_grad():
        u = torch.stack([fn(z) for z in keep]).double()
    u = torch.where(torch.isfinite(u), u, torch.full_like(u, math.inf))
    best = int(u.argmin())
    if not math.isfinite(float(u[best])):
        return post  # no draw has a finite density: the engine's own checks speak for it
    with torch.random.fork_rng(devices=[]):
        mode, hess = newton_mode(fn, keep[best].detach(), steps=TYPICAL_NEWTON_STEPS)
        # no mode near the best draw (Hessian not positive definite there): search from the prior median
        searched = laplace_start(post.model, Data(post.x, post.y)) if hess is None else None
        if searched is not None and searched.converged and set(searched.z) == set(pot.shapes):
            other = pot.flatten(searched.z).to(keep)
            with torch.no_grad():
                if float(fn(other)) < float(fn(mode)):
                    mode, hess = other, searched.precision
        with torch.no_grad():
            u_mode = min(float(fn(mode)), float(u[best]))
    gap = float((u - u_mode).median())
    threshold = float(stats.chi2.isf(TYPICAL_TAIL, pot.dim)) / 2
    if not gap > threshold:
        return post
    where = ""
    if hess is not None:
        sd = torch.linalg.inv(hess).diagonal().clamp_min(0).sqrt()
        shift = (keep.double().median(0).values - mode.double()).abs() / sd.clamp_min(1e-300)
        worst = int(shift.argmax())
        names = [
            k if math.prod(shape) == 1 else f"{k}[{i}]"
            for k, shape in pot.shapes.items()
            for i in range(math.prod(shape))
        ]
        where = (
            f" The median draw's {names[worst]} (unconstrained) is {float(shift[worst]):.3g} sds of the Laplace "
            "approximation from the mode."
        )
    _warn(
        f"{post.method}: the draws lie far from the posterior's mass: the median draw's log density is {gap:.4g} nats "
        f"below the mode's (exact draws: below {threshold:.3g} but for a 1e-3 chance, the quantile of chi2_{pot.dim} "
        f"/ 2), so its means, sds and intervals describe another distribution.{where} {cause}Standardize the "
        "inputs (a covariate far from unit scale slows first-order steps), or use method='laplace' or 'nuts' on a "
        "model this small."
    )
    return post


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
