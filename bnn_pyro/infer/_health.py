"""End-of-fit health checks: warnings about a finished fit that the user should not miss.

Every check issues a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning` that says what was seen, the
threshold, and what to try. They run at the end of every fit of the engines that call them, so a
fit that cannot be trusted is flagged even when nobody looks at :func:`bnn_pyro.summary`. Each is
cheap: no extra fits, at most one pass of :data:`PREDICTIVE_DRAWS` posterior and as many prior
draws over :data:`PREDICTIVE_ROWS` training rows.

- :func:`check_elbo` (SVI): a loss still falling (or rising) at the end of the run.
- :func:`check_guide_gap` (SVI with a full-rank or low-rank guide on a small Pyro function, a mean-field or low-rank one
  on a larger one: :mod:`bnn_pyro.infer.svi_gap`): the guide's mean stopped short of its
  family's ELBO optimum by one Newton step (:mod:`bnn_pyro.infer.svi_gap`), which the ELBO trace does not show.
- :func:`check_predictive` (any engine): a posterior predictive that fits the training data no
  better than a constant, as the prior's does (posterior ~ prior).
- :func:`check_targets` (any engine, before the fit, from ``bp.fit``): regression targets in raw units
  (their sd far above the O(1) outputs of a unit-prior net) under a fixed Gaussian noise far below
  their sd; :func:`check_elbo` then gives the same advice instead of "more steps".
- :func:`check_training_noise` (engines that start from a point fit, before the fit, from
  :func:`bnn_pyro.infer.holdout.split`): a learned Gaussian noise on data too small to hold rows out for it.
- :func:`check_noise_collapse` (any engine, from ``bp.fit``): a regression fit with a learned Gaussian noise whose
  predictive mean explains almost none of the training targets' variance while the noise absorbs it, on data where a
  ridge or nearest-neighbour regression finds signal out of sample. Mean-field SVI on the zoo's ``mlp_regression`` ends
  there as its best ELBO (``benchmarks/results/zoo_svi_collapse/``). Such a fit also ignores the data
  (:func:`check_predictive`) and has a learned noise at the targets' sd (:func:`check_learned_noise`): both stay silent
  there, so one cause gives one warning, with its figures and advice.

The other families, each in its own module: the chains' mixing (:mod:`bnn_pyro.infer.health_mixing`), notes on a
classifier's off-data uncertainty (:mod:`bnn_pyro.infer.health_off_data`), and the draws' spread and location
(:mod:`bnn_pyro.infer.health_spread`); subspace inference's :func:`bnn_pyro.infer.subspace_held.check_subspace`.

The thresholds are module constants; each one's docstring says where it comes from.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer.health_warn import warn_diagnostic as _warn

__all__ = [
    "check_svi",
    "svi_advice",
    "check_elbo",
    "check_guide_gap",
    "GAP",
    "GAP_SE",
    "GAP_MAX",
    "GAP_Z",
    "gap_z",
    "gap_thresholds",
    "check_predictive",
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
    "check_noise_collapse",
    "collapse_message",
    "check_training_noise",
]

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
"""... and the gap exceeds :func:`gap_thresholds` standard errors, at least 4: the two-sided normal chance at 4
standard errors, 6.3e-5, is the chance that a fit whose guide means sit at their optimum warns on Monte Carlo error
alone, for the whole fit (every chain and coordinate judged), not per coordinate. Why a family-wise chance: judged
coordinate by coordinate at 4 standard errors, ``d`` coordinates of pure noise warn with a chance of about ``6.3e-5 d``
(6.6% at 1,000 coordinates where the standard error is above the floor, ``GAP_MAX / 4``; review 14), so a converged fit
of a large model would warn at random; with the chance per coordinate set by Sidak's rule (:func:`gap_z`: 5.4 standard
errors at 1,000 coordinates of the normal), the fit's stays at 6.3e-5 whatever ``d`` (exactly that for independent
coordinates, less where they correlate: Sidak 1967). The floor :data:`GAP_MAX` is kept, and counted
(:func:`gap_thresholds`): a gap under it never warns, so a coordinate whose standard error is far under ``GAP_MAX / z``
can warn only over the floor, at almost no chance, and takes almost none of the fit's; the threshold for the others is
then lower (about 4 where one coordinate is noisy and 999 are precise, 5.4 where all 1,000 are noisy; review 17). A
standard error from ``n`` draws (the dense path's record gives ``draws``: 1,000), ``n`` antithetic pairs (a full-rank
guide's gap on the mean step's draws past the refinement's bounds gives ``pairs``: 500) or ``n`` batch means (the
conjugate-gradient path's gives ``batches``: :data:`~bnn_pyro.infer.svi_gap_cg.BATCHES`) takes Student's t on ``n -
1`` degrees of freedom at the same chance (4.02 at one coordinate and 1,000 draws, 5.45 at 1,000 noisy ones; 5.1 at one
coordinate and 20 batches, 8.5 at 1,000). A gap over the floor warns wherever its standard error is small enough (below
``GAP_MAX / z``), as on a converged fit of a near-Gaussian posterior."""
PREDICTIVE_ROWS = 1000
"""Training rows (evenly spaced) used by :func:`check_predictive`, which bounds its cost (one pass of
the posterior and prior draws over these rows)."""


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
    """Warn when a chain's Gaussian guide (where :mod:`bnn_pyro.infer.svi_gap` takes its gap) stopped short of its family's ELBO optimum: in some unconstrained coordinate
    the Newton step to the optimum (``post.history[GAP]``, :mod:`bnn_pyro.infer.svi_gap`) exceeds :data:`GAP_MAX`
    guide sds and :func:`gap_thresholds` standard errors (at the chance :data:`GAP_Z` states for the whole fit, over
    every chain's coordinates with the floor counted, Student's t on the draws, antithetic pairs or batch means of the chain's
    ``post.config["guide_gap"]`` record). The ELBO check cannot see it: under the cosine schedule the parameters freeze
    at the end wherever they are, so the loss's last windows agree. A chain without a verdict has NaN gaps (the reason
    in ``post.config["guide_gap"]``) and is not judged.

    What it can see after a refinement. Where the engine first took the guide's mean the rest of the way by Newton
    steps (:mod:`bnn_pyro.infer.svi_refine`, :mod:`bnn_pyro.infer.svi_refine_cg`), the gap is measured on the step's
    own draws: at the step's fixed point it is that step's last undamped move (under ``svi_refine.TOL``, 0.01 sd), so
    it says whether the step converged and what the step could not take (a refinement stopped short, a covariance the
    step left as trained), not how far the draws' own optimum is from the true one. That distance is the step's Monte
    Carlo error, about the gap's standard error per coordinate; the check cannot see it (the chains show it, as their
    spread), and the conjugate-gradient step's record gives it (``post.config["guide_refinement"]``, key
    :data:`bnn_pyro.infer.svi.STEP_SE`, the largest over the coordinates, in guide sds)."""
    if GAP not in post.history or GAP_SE not in post.history:
        return
    gap, se = post.history[GAP].double(), post.history[GAP_SE].double()
    records = post.config.get("guide_gap")
    records = records if isinstance(records, list) and len(records) == gap.shape[0] else [{}] * gap.shape[0]
    # a chain without a verdict (NaN) is not judged; each chain's standard errors from its batch means, antithetic
    # pairs (a full-rank guide's gap on the mean step's draws, svi_gap) or draws
    samples = [r.get("batches") or r.get("pairs") or r.get("draws") for r in records]
    z = gap_thresholds(gap, se, samples).to(gap)[:, None]
    short = (gap.abs() > GAP_MAX) & (gap.abs() > z * se)
    if not bool(short.any()):
        return
    labels = post.config.get("guide_coordinates") or [f"coordinate {i}" for i in range(gap.shape[-1])]
    chain, i = divmod(int(torch.where(short, gap.abs(), torch.zeros_like(gap)).argmax()), gap.shape[-1])
    n = int(short.any(0).sum())  # coordinates, not chains x coordinates
    steps = post.config.get("num_steps")
    more = f"num_steps={4 * steps}" if isinstance(steps, int) else "more num_steps"
    refined = post.config.get("guide_refinement")
    refined = refined[chain] if isinstance(refined, list) and len(refined) > chain else None
    refined = refined if isinstance(refined, dict) else {}
    stopped = refined.get("stopped")
    cap = refined.get("max_evaluations")  # svi.EVALUATIONS_CAP: the fit's cost capped the refinement's evaluations
    iterations = refined.get("max_iterations")  # svi.ITERATIONS_CAP: ... the mean step's conjugate-gradient solves
    if not refined.get("accepted"):
        advice = (
            f"Try {more} (the schedule then keeps the rate up longer), or method='nuts' for the exact posterior of a "
            "small model"
        )
    elif cap and stopped == "evaluation limit":  # stopped by the fit's length: a longer fit allows more
        advice = (
            f"Try {more}: the refinement after the fit stopped at the {cap} evaluations that the fit's cost allows "
            "(svi_gap_cg.FIT_SHARE; post.config['guide_refinement']), and a longer fit allows more"
        )
    elif iterations and stopped == "no solve at the new mean":  # its solve ran out of the iterations the fit allows
        advice = (
            f"Try {more}: the refinement after the fit stopped with no solve at the new mean in the {iterations} "
            "conjugate-gradient iterations that the fit's cost allows (svi_gap_cg.FIT_SHARE; "
            "post.config['guide_refinement']), and a longer fit allows more, up to svi_gap_cg.MAX_ITERATIONS"
        )
    elif stopped.startswith("no solve with more Hessian draws"):  # the re-solve after a rejected candidate: did
        # not converge (the bare form), or found H not positive definite or its products not finite (": <reason>")
        found = (
            "did not converge in svi_gap_cg.MAX_ITERATIONS iterations"
            if stopped == "no solve with more Hessian draws"
            else f"found {stopped.split(': ', 1)[-1]}"
        )
        advice = (
            "The refinement after the fit stopped where its conjugate-gradient solve with more Hessian draws (taken "
            f"after a rejected step, post.config['guide_refinement']) {found}: the posterior's curvature there is far "
            "from the Gaussian the step assumes; try method='nuts' for the exact posterior of a small model, or more "
            "num_steps, which start the step closer"
        )
    elif stopped == "share spent":  # svi_refine_cg.SHARE_SPENT: the step spent the fit's share (choose_path)
        advice = (
            f"Try {more}: the refinement after the fit stopped where it had spent the share of the fit's cost it may "
            "take (svi_gap_cg.FIT_SHARE; post.config['guide_refinement']), and a longer fit allows more"
        )
    elif stopped == "evaluation limit":  # its evaluations ran out (kept or halved steps alike): a longer fit starts
        # it closer (a 110 x 100 logistic default fit warned at 5,000 steps, not at 20,000: docs/reference_suite.md)
        advice = (
            f"The refinement's {refined['accepted']} Newton step(s) after the fit stopped at their evaluation limit "
            f"(post.config['guide_refinement']): try {more}, which starts them closer to the optimum, or "
            "method='nuts' for the exact posterior of a small model"
        )
    else:  # Newton steps after the fit moved the mean and stopped short too: Adam's longer schedule cannot help
        advice = (
            f"The refinement's {refined['accepted']} Newton step(s) after the fit did not close it either (stopped: "
            f"{stopped}; post.config['guide_refinement']), so more num_steps would not: the posterior is far from "
            "what the guide's family can match here; use method='nuts' for the exact posterior of a small model"
        )
    _warn(
        f"{post.method}: the {post.config.get('guide')} guide stopped short of its best fit: its mean of "
        f"{labels[i]} is {abs(float(gap[chain, i])):.2g} of its sds (+- {float(se[chain, i]):.1g}) from where the "
        f"ELBO's gradient puts the optimum (chain {chain}; {n} unconstrained coordinate(s) of {gap.shape[-1]} over "
        f"{GAP_MAX:g} sd and {float(z[chain]):.2g} standard errors), a miss the ELBO trace does not show (the rate "
        f"falls to 1% of lr at the end). {advice}; post.history['guide_gap'] holds the gaps."
    )


def gap_z(samples: int | None, tests: int = 1) -> float:
    """The standard errors a gap must exceed (:data:`GAP_Z`) when ``tests`` gaps (every chain's coordinates with a
    verdict) are judged together and none is decided by the floor: each at the two-sided chance ``p = 1 - (1 -
    a)^(1 / tests)`` (Sidak), ``a`` the normal's at :data:`GAP_Z` (6.3e-5), so that pure Monte Carlo noise warns for
    the whole fit with a chance of at most ``a``: for a standard error from ``samples`` draws or batch means, Student's
    t on ``samples - 1`` degrees of freedom (4.02 at one test and 1,000 draws, 5.45 at 1,000 tests; 5.1 at one test and
    20 batches, 8.5 at 1,000), the normal's quantile where ``samples`` is ``None`` (4 at one test, 5.4 at 1,000).
    :func:`gap_thresholds` is the rule with the floor."""
    if tests < 1:
        raise ValueError(f"tests must be at least 1 (the gaps judged together), got {tests}")
    return float(_ratio_law(samples).isf(_per_test(tests) / 2))


def gap_thresholds(gap: torch.Tensor, se: torch.Tensor, samples: list[int | None]) -> torch.Tensor:
    """Per chain, the standard errors a gap must exceed so that pure Monte Carlo noise warns for the whole fit with the
    chance ``a`` of :data:`GAP_Z` (6.3e-5), counting the floor: a coordinate warns only where its ratio ``T = gap /
    se`` exceeds ``max(GAP_MAX / se, z)``, so the threshold is the ``z`` at which ``prod_i (1 - P(|T_i| > max(GAP_MAX /
    se_i, z))) = 1 - a`` over every chain's coordinates with a verdict (finite ``gap`` and ``se``, both ``(chains,
    dim)``). Why: a coordinate whose standard error is far under ``GAP_MAX / z`` can warn only over the floor, at a
    chance of almost nothing, so it should not raise ``z`` for the noisy coordinates, where real gaps hide (Sidak over
    every coordinate, :func:`gap_z`, sent a 0.45-sd gap at 7.5 standard errors among 999 precise coordinates unwarned:
    review 17). Where no floor binds this is :func:`gap_z` at every coordinate; the chance is exact for independent
    coordinates whose ratios follow the stated law (the dense path's 1,000 draws), below ``a`` where the floor is in
    reach of standard errors from the conjugate-gradient path's 20 batch means (conservative: review 18 simulated 3e-5
    to 1e-7 at 1,000 coordinates), and at most ``a`` where normal gaps correlate (Sidak's inequality holds for any thresholds per
    coordinate: Sidak 1967; for studentized ratios sharing draws, approximately). ``samples`` per chain: the draws or batch means its standard errors are from (Student's t on
    ``samples - 1`` degrees of freedom, the normal where ``None``); one ``z`` per chain at one common chance per
    coordinate over the floor."""
    import numpy as np
    from scipy import optimize, stats  # lazily: bnn_pyro's import stays light

    gap, se = torch.as_tensor(gap).double().cpu(), torch.as_tensor(se).double().cpu()
    if gap.dim() != 2 or se.shape != gap.shape or len(samples) != gap.shape[0]:
        raise ValueError(
            f"gap and se must be (chains, dim) of one shape and samples one entry per chain, got {tuple(gap.shape)}, "
            f"{tuple(se.shape)} and {len(samples)}"
        )
    judged = torch.isfinite(gap) & torch.isfinite(se)
    laws = [_ratio_law(n) for n in samples]
    chance = 2 * stats.norm.sf(GAP_Z)
    low, high = _per_test(max(1, int(judged.sum()))), chance  # the per-coordinate chance lies between (Sidak, one)
    floors = [(GAP_MAX / se[c][judged[c]]).numpy() for c in range(gap.shape[0])]  # se 0: an infinite floor
    fixed, free = 0.0, []  # floors over the largest z decide their coordinates whatever z
    for law, floor in zip(laws, floors):
        top = law.isf(low / 2)
        fixed -= float(np.log1p(-2 * law.sf(floor[floor >= top])).sum())
        free.append(floor[floor < top])

    def excess(log_p: float) -> float:  # the fit's -log P(no warning) at the chance log_p, less the target's
        p = math.exp(log_p)
        spent = sum(-np.log1p(-2 * law.sf(np.maximum(f, law.isf(p / 2)))).sum() for law, f in zip(laws, free))
        return fixed + float(spent) + math.log1p(-chance)

    if not sum(f.size for f in free) or excess(math.log(high)) <= 0:
        per_test = high
    elif excess(math.log(low)) >= 0:
        per_test = low
    else:
        per_test = math.exp(optimize.brentq(excess, math.log(low), math.log(high), xtol=1e-12, rtol=1e-12))
    return torch.tensor([float(law.isf(per_test / 2)) for law in laws], dtype=torch.float64, device=gap.device)


def _per_test(tests: int) -> float:
    """Sidak's two-sided chance per test that keeps ``tests`` independent ones at :data:`GAP_Z`'s normal chance."""
    from scipy import stats

    return -math.expm1(math.log1p(-2 * stats.norm.sf(GAP_Z)) / tests)


def _ratio_law(samples: int | None):
    """The law of a gap over its standard error from ``samples`` draws or batch means: Student's t on ``samples - 1``
    degrees of freedom, or the normal where ``samples`` is ``None`` (or under 2)."""
    from scipy import stats

    return stats.t(samples - 1) if samples and samples >= 2 else stats.norm()


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
