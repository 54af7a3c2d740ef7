"""Fit-time health checks of a posterior's spread and location: draws whose spread is not the posterior's (too
narrow, one point, a structural limit), that lie far from its mass, or a run that diverged.

Each issues a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning`
(:func:`bnn_pyro.infer.health_warn.warn_diagnostic`) that says what was seen, the threshold, and what to try, at the
end of every fit of the engines that call them (the other families: :mod:`bnn_pyro.infer._health`,
:mod:`bnn_pyro.infer.health_mixing`, :mod:`bnn_pyro.infer.health_off_data`).

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
  next to the Laplace curvature it uses): an output of the net at the training inputs that keeps less than
  ``SUBSPACE_HELD_MIN`` of its linearized Laplace variance once the weights are confined to the subspace
  ``w_hat + P z``, which no inner engine can exceed, or, for a net whose outputs are linear in its weights, a weight
  that does. On the linear BNN reference at ``subspace_dim=2`` (of 3 weights) ``weight[1]``'s sd was 0.36 of the
  exact one, silently (``docs/reference_suite.md``).
- :func:`check_gaussian` (Laplace on a Pyro function model): the posterior is far from the fitted Gaussian by the
  Pareto ``k_hat`` of the importance ratios ``p / q`` of its draws (Yao et al. 2018). On eight schools the
  Gaussian at the joint mode (``tau`` ~29, where the posterior mean is 3.6) was 14 posterior sds off in ``tau``,
  silently; its ``k_hat`` is 1.03 (1,000 draws).
- :func:`check_typical` (every approximation and point fit of a Pyro function model, from ``bp.fit``): the median
  draw's log density far below the mode's, beyond what the chi-square law of exact draws allows. On kidiq (a
  covariate near 100) ensemble members and SWAG chains were 171 and 4,899 posterior sds off, silently.
- :func:`check_descent` (snapshot ensembles and SG-MCMC): a run whose potential (negative log joint) ends well
  above where it started diverged; on the logistic BNN with an unstandardized covariate (``lr="auto"`` peaking at a
  step of 5.9) the snapshots were hundreds of posterior sds off, and SGLD's draws 10^5 sds, silently.

The thresholds are module constants; each one's docstring says where it comes from.
"""

from __future__ import annotations

import math

import torch

from bnn_pyro.infer import _health  # ELBO_WINDOW, ELBO_MIN_WINDOW: read there at call time, one home for both checks
from bnn_pyro.infer.health_warn import warn_diagnostic as _warn

__all__ = [
    "check_spread",
    "NARROW_MAX",
    "NARROW_TAIL",
    "NARROW_MAX_DIM",
    "unconstrained_draws",
    "check_narrow",
    "check_descent",
    "check_gaussian",
    "TYPICAL_TAIL",
    "TYPICAL_DRAWS",
    "TYPICAL_NEWTON_STEPS",
    "check_typical",
]


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
    run's last :data:`~bnn_pyro.infer._health.ELBO_WINDOW`, than at its first step by more than the number of latent
    coordinates ``P``: the run diverged (a step size too large for the model's curvature) and its draws sit wherever it
    ended. An optimizer (snapshot ensembles) descends; a sampler (SG-MCMC) from a start off the posterior descends too, to a potential
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
    if trace is None or trace.shape[-1] - start < 2 * _health.ELBO_MIN_WINDOW:
        return post
    trace = torch.as_tensor(trace).double().reshape(-1, trace.shape[-1])[:, start:]
    width = max(int(trace.shape[-1] * _health.ELBO_WINDOW), _health.ELBO_MIN_WINDOW)
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
