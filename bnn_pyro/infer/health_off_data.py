"""Fit-time notes on a classifier's uncertainty off the training data, and on its log loss, that an engine's
structure limits.

Each issues a :class:`~bnn_pyro.posterior.diagnostics.DiagnosticWarning`
(:func:`bnn_pyro.infer.health_warn.warn_diagnostic`) at the end of every classification fit of the engines that call
them, with the reason and what to use instead (``docs/ood.md``; the other families: :mod:`bnn_pyro.infer._health`,
:mod:`bnn_pyro.infer.health_mixing`, :mod:`bnn_pyro.infer.health_spread`). Regression fits and plain Pyro models are
not judged.

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
- :func:`check_gaussian_guide_off_data` (classification fits of a ``BNN`` by SVI with a Gaussian guide: mean-field,
  low-rank, full-rank): the guide carries the fit in a few hidden units and prunes the rest, so its off-data
  uncertainty can fall short of the posterior's (``docs/ood.md``, "Mean-field SVI off the data").
- :func:`check_quadratic` (Laplace classifiers linear in the covered weights): draws that fit the training rows far
  worse than the Gaussian's mean, beyond what its quadratic model predicts, so the predictive is underconfident.

The thresholds are module constants; each one's docstring says where it comes from.
"""

from __future__ import annotations

from bnn_pyro.infer.health_warn import warn_diagnostic as _warn

__all__ = [
    "check_off_data",
    "QUADRATIC_RATIO_MAX",
    "check_quadratic",
    "check_scale_free_off_data",
    "check_anchored_log_loss",
    "ACTIVE_UNIT_SNR",
    "active_units",
    "check_gaussian_guide_off_data",
]


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


ACTIVE_UNIT_SNR = 2.0
""":func:`check_gaussian_guide_off_data` counts a hidden unit as carrying the fit when one of its output weights has a
fitted mean larger than 2 of its sds (its sign holds in about 98% of draws); the others are pruned, their output
weights centred near 0 (Trippe & Turner 2018, "Overpruning in variational Bayesian neural networks")."""


def active_units(post) -> tuple[tuple[int, ...], int] | None:
    """``(active, total)``: per chain, how many of the ``total`` hidden units feeding ``post``'s output layer (its last
    sampled weight matrix) are active, a unit active when one of its output weights' ``|mean| / sd`` over the chain's
    draws exceeds :data:`ACTIVE_UNIT_SNR`; ``None`` without a hidden layer (fewer than two sampled weight matrices: a
    linear model's inputs are not units). Counted chain by chain because restarts (SVI's ``num_chains``) carry the fit
    in different units, with either sign: pooled, a unit that carries one restart's fit and is pruned in another has
    a mean small against its sd, and the count falls towards none. With one draw per chain (no sd within a chain) the
    draws are pooled and counted once."""
    names = [k for k, v in post.samples.items() if k.endswith("weight") and v.dim() == 4]
    if len(names) < 2:
        return None
    w = post.samples[names[-1]].double()  # (chains, draws, out, units)
    if w.shape[1] < 2:  # one draw per chain has no sd: the chains' draws pooled, as one
        w = w.reshape((1, -1) + w.shape[2:])
    ratio = (w.mean(1).abs() / w.std(1).clamp_min(1e-300)).amax(1)
    return tuple(int(n) for n in (ratio > ACTIVE_UNIT_SNR).sum(-1)), ratio.shape[-1]


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
    counts = units[0]
    here = f"{counts[0]}" if len(counts) == 1 else f"{', '.join(map(str, counts))} (per restart)"
    carried = (
        f" (here {here} of the output layer's {units[1]} inputs have an output weight whose mean exceeds "
        f"{ACTIVE_UNIT_SNR:g} sds; the rest are pruned)"
    )
    _warn(
        f"{post.method}: off-data uncertainty can fall short of the posterior's with a Gaussian guide "
        f"(guide={post.config['guide']!r}): it carries the fit in a few hidden units with well-determined "
        f"weights{carried}, so its mean function extrapolates like one network and its draws agree on the class on "
        "inputs unlike the training data more often than posterior draws do (on public tabular sets the mean-field "
        "guide's noise AUROC by mutual information was 0.10-0.19 below NUTS's on the 4 splits compared and below 0.8 "
        "on 2 of 6, and a full-rank guide's no better; kl_warmup, init_scale, the closed-form KL, more particles, "
        "inputs rotated to their principal axes and restarts pooled as a mixture (num_chains=3 or 5) left it there; "
        "docs/ood.md). For out-of-distribution detection use "
        "method='nuts' (the exact posterior, for models this small) or method='sghmc' (met that target on every "
        "tabular split measured)."
    )
    return post
