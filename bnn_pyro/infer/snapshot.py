r"""Snapshot ensembles: ``bp.fit(model, x, y, method="snapshot", ...)``.

Huang, G., Li, Y., Pleiss, G., Liu, Z., Hopcroft, J. E. & Weinberger, K. Q. (2017). Snapshot ensembles:
train 1, get M for free. ICLR.

One run of SGD with momentum whose step follows ``num_cycles`` cosine cycles with warm restarts (their
eq. 2): step ``k = 0..K-1`` of every cycle of ``K = cycle_length`` steps uses

    ``eta_k = eta / 2 (cos(pi k / K) + 1)``,

large at the start of a cycle (the run leaves the mode it was in) and near zero at its end (it settles
into a mode). The iterate at the end of every cycle is one snapshot; the posterior is the equal-weight
mixture of the ``num_cycles`` snapshots, stored as one chain of ``num_cycles`` draws per run
(``num_chains`` independent runs, seeds ``seed + c``, become chains). ``predict`` averages the snapshots'
predictive distributions, as the paper averages their softmax outputs.

This is cyclical SG-MCMC (:mod:`bnn_pyro.infer.sgmcmc`, ``"csgmcmc"``) with the whole cycle spent in its
exploration stage: the same update ``v <- (1 - alpha) v - eta_k grad U~(z)``, ``z <- z + v`` on the
potential energy ``U~`` (the negative log joint, minibatch likelihood scaled to the data set: SGD on the
training loss with the prior as weight decay), the same cosine cycle, the same ``lr="auto"`` peak step
(``eta = (2 - alpha) / (2 lambda_max)``, re-estimated every 100 steps from the largest curvature, since
curvature grows as the net fits, a re-estimate raising it at most 2-fold, and at a dozen steps early in the first cycle, where it grows fastest) and the same checkpoint/resume. Without its sampling stage no noise is
added: each snapshot is a point near a mode. The snapshot is the iterate that enters a cycle's last step,
whose step factor ``(1 - cos(pi / K)) / 2`` (2.5e-6 at ``K = 1000``) leaves it where the cycle ended.

Held-out rows (:mod:`bnn_pyro.infer.holdout`, as csgmcmc's exploration stages): by default 10% of the training
rows (10% of tensor data of at least 200 rows; with a learned Gaussian noise at least 20 rows, of at least 40) are held out and the run trains on the rest. Every cycle scores the
states it reaches on them every 50 steps and at its end (noise profiled out), and its snapshot is the
best-scoring of those (early stopping within the cycle; the next cycle starts from it, momentum reset;
``history["exploration_stop"]``: the step of each snapshot); a learned Gaussian noise (``sigma`` or
``precision``) of every snapshot is then set to the value that maximizes the held-out log predictive density
of the snapshot mixture. Why: a cycle run to its end fits the training rows of a small data set far past the
best held-out state (its test log-likelihood falls below NUTS's, and scoring only the second half of each cycle
does not recover it). A cycle's own start, the previous snapshot, is not a candidate: every cycle adds a state of its
own trajectory, so the ensemble has ``num_cycles`` distinct members. (It was a candidate before: on
scikit-learn's diabetes and on digits every cycle after the first then found nothing better than the state it
restarted from and repeated the first snapshot, so the "ensemble" was one early-stopped MAP with no epistemic
spread.) The snapshots are then distinct in weight space but may stay close in function space. The diabetes and
digits runs behind these rules: ``docs/sgmcmc_measurements.md``. With fewer rows, a loader or ``validation=None`` the
cycles run to their ends and the snapshots keep their own (training-set) noise values.

Off-data inputs and anchored cycles (issue 26, ``docs/ood.md``). A plain snapshot is a point near a mode of
the same objective for every cycle, reached without noise: in the weight directions that no training row
constrains, only the prior's term acts, and it pulls every snapshot toward the same point, the prior's mode (as
plain MAP ensemble members). The snapshots then agree with each other far from the data, and the predictive is
as sure there as on test rows. So by default (``anchored=True``) cycle ``c`` of a run with seed ``s`` minimizes
the potential tilted by ``<z, grad log p(w_0^(c))>`` for its own prior draw ``w_0^(c)`` (drawn under seed
``s + c * ANCHOR_CYCLE_OFFSET``; :mod:`bnn_pyro.infer.anchor`, Pearce et al. 2020, as the deep ensemble's
members): for a Gaussian prior the weight decay ``|w|^2 / (2 s^2)`` becomes ``|w - w_0^(c)|^2 / (2 s^2)``, each
snapshot ends near its own randomized MAP (for a linear-Gaussian model the closed form of
:mod:`bnn_pyro.infer.anchor`, tested), and the snapshots spread in the free directions as the prior does. Measured on
wine, breast_cancer, iris and diabetes (how well the predictive's entropy and mutual information tell noise inputs from
test rows, and the test log loss, plain against anchored): ``docs/sgmcmc_measurements.md``. ``anchored=False`` gives the
paper's plain snapshots, and a classification fit then says that its off-data uncertainty is not represented
(:func:`~bnn_pyro.infer.health_off_data.check_off_data`, :data:`OFF_DATA`).

Pyro functions: whitened cycles from the mode (issue 26). On a small plain Pyro function (tensor data, no
``pyro.param`` sites, at most 2,000 latent coordinates) under ``lr="auto"`` the cycles run in the coordinates whitened
by the Hessian of ``U`` at the mode, ``u = L^T z`` with ``L L^T = H`` (:mod:`bnn_pyro.infer.sg_metric`: the mode by
L-BFGS and damped Newton from the prior median, ``H`` damped where it is not positive definite), and the run starts at
that mode (with the default ``init``; an ``init`` given starts there). The mode and ``L`` are found once per fit, on
the rows the run trains on, and shared by every chain and by the refit on all rows
(:func:`~bnn_pyro.infer.sgmcmc.fit_metric`). Why: in the raw coordinates the peak step
``(2 - alpha) / (2 lambda_max)`` takes about ``kappa = lambda_max / lambda_min`` steps per e-fold along the flattest
direction, and the reference posteriors whose covariates lie near 40 and 100 are conditioned so badly that the
snapshots ended far from the posterior (and, from a prior draw whose curvature is unlike the mode's, a run diverged).
A fixed positive definite preconditioner keeps every fixed point of the (tilted) objective and
makes every direction's curvature about 1 near the mode, so each cycle reaches its anchored minimum (the reference
suite's figures before and after: ``docs/sgmcmc_measurements.md``).
The data half of each cycle (issue 26; the deep ensemble's :mod:`bnn_pyro.infer.anchor`, "The data half"). Anchoring
alone left the spread narrow: each snapshot was the minimum of the potential tilted toward its own prior draw, which
for a linear-Gaussian model is ``A^{-1}(b + Lambda_0 w_0)`` (``A`` the posterior precision, ``Lambda_0`` the prior's),
so the snapshots' covariance was ``A^{-1} Lambda_0 A^{-1}``, not ``A^{-1}``: far narrower where the data dominate the
prior (on kidiq and logistic by one to two orders of magnitude: ``docs/sgmcmc_measurements.md``). So by default
(``bootstrap=True``) cycle ``c`` of a run with seed ``s`` on such a function also weights the log-likelihood of each
observation of the rows it fits by its own draw,

.. math::

    U_c(z) = -\log p(z) + \langle z, g_c \rangle - \sum_i v_{ci} \log p(y_i \mid x_i, z), \qquad
    v_c = n D_c,\ D_c \sim \mathrm{Dirichlet}(1, \ldots, 1),\ g_c = \nabla \log p(w_0^{(c)}),

drawn under the anchor's seed ``s + c * ANCHOR_CYCLE_OFFSET`` (:func:`~bnn_pyro.infer.anchor.bootstrap_weights`, which
adds its own offset: independent of the anchor) and applied to the observed sites by
:func:`~bnn_pyro.infer.anchor.weighted`, as the ensemble's members are: the weighted likelihood bootstrap (Newton &
Raftery 1994) with an anchored prior half, the posterior bootstrap (Fong, Lyddon & Holmes 2019). For a linear-Gaussian
model the snapshots' covariance is then ``S (X^T diag(r_i^2) X / sigma^4 + Lambda_0) S`` (``S = A^{-1}``, ``r_i`` the
residuals), the posterior's to first order in ``1 / n``; each whitened cycle ends at its own minimum (tested in closed
form) and the snapshots' whitened covariance is the identity within Monte Carlo error
(``tests/infer/test_snapshot_weighted.py``). The weights enter the step's potential and ``lr="auto"``'s curvature
estimate; the metric stays the one found at the unweighted mode (a fixed positive definite preconditioner keeps every
cycle's fixed point). With held-out rows the fit that chooses the stops weights its training rows and the refit on all
rows weights all of them, each cycle under the same seed. Where they apply: the whitened cycles above (``lr="auto"``)
on full batches of tensor data, through Pyro's traced potential, for the observed sites whose observations are not
one event (batch shape ``()``: left unweighted and named); ``config["observation_weights"]`` records the sites
weighted, or why none (``bootstrap=False``, minibatches). A checkpoint of such a run written before the weights
(its run record has no ``observation_weights``) is refused on resume (:func:`~bnn_pyro.infer.sgmcmc.refuse_unweighted`).
Constrained sites (a noise scale), which the anchor leaves alone, get their spread from the weights too. What remains
narrow is said by :func:`~bnn_pyro.infer.health_spread.check_narrow` (``functions=True``; :data:`NARROW_WEIGHTED`, or
:data:`NARROW_FUNCTION` for anchored cycles without weights): few snapshots, or a posterior far from Gaussian. A ``BNN`` fit is unchanged, bit for bit (a network's Hessian is neither small nor
positive definite, so it has no whitened cycles; csgmcmc, a sampler whose noise gives its spread, takes no weights).

Per-draw statistics: ``lp`` (``-U~`` at the snapshot, on its minibatch; with weighted cycles the log joint ``-U`` at
the snapshot, since the cycles' objectives differ by their weights) and ``step_size``; history (``(chains, steps)``):
``potential`` (of the step's own objective, tilted and weighted) and ``step_size`` (``eta_k`` on ``U``, every step). With one run
R-hat and ESS describe snapshots, not a Markov chain: read them with care.

Examples
--------
>>> post = bp.fit(model, x, y, method="snapshot", num_cycles=5, cycle_length=1000, seed=0)
>>> post.samples["0.weight"].shape       # (1, 5, 50, 1): run, snapshot, *shape
>>> post.history["step_size"][0, :1000]  # the first cosine cycle
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potentials
from bnn_pyro.infer.anchor import anchor, bootstrap_sites, bootstrap_weights, flat_tilt
from bnn_pyro.infer.contract import entry
from bnn_pyro.infer.health_off_data import check_anchored_log_loss, check_off_data
from bnn_pyro.infer.health_spread import check_descent, check_narrow
from bnn_pyro.infer.holdout import DEFAULT, describe, refit, refit_config, split
from bnn_pyro.infer.sgmcmc import SGOptions, fit_metric, run_plan
from bnn_pyro.infer.sgmcmc_step import ADAPT_EVERY, Plan, check_friction, check_lr, cosine_cycle
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import flag, positive_int

__all__ = ["fit_snapshot", "snapshot_plan", "SnapshotConfig"]


# lr="auto": extra curvature estimates early in the first cycle, at steps ~sqrt(2)^i, where the net leaves its
# random start and the curvature grows fastest (26-fold within 30 steps with a learned noise: without them the
# run diverged at step 9, as csgmcmc's does on the same data)
_EARLY = sorted({int(2 ** (i / 2)) for i in range(14)} - {0})


ANCHOR_CYCLE_OFFSET = 100_003  # cycle c's anchor is drawn under the run's seed plus c times this


def cycle_anchors(num_cycles: int, cycle_length: int):
    """``Plan.anchors`` of anchored cycles: cycle ``c`` of a run with seed ``s`` is tilted toward its own prior
    draw (:func:`~bnn_pyro.infer.anchor.anchor` under seed ``s + c * ANCHOR_CYCLE_OFFSET``)."""

    def make(fitted, pot, batch, seed: int):
        g = torch.stack(
            [
                flat_tilt(anchor(fitted, pot, batch, seed=seed + c * ANCHOR_CYCLE_OFFSET)[0], pot)
                for c in range(num_cycles)
            ]
        )
        return lambda t: g[min(t // cycle_length, num_cycles - 1)]

    return make


def cycle_weights(num_cycles: int, cycle_length: int):
    """``Plan.weights`` of weighted cycles: cycle ``c`` of a run with seed ``s`` weights the observations of the rows
    it fits by its own draw (:func:`~bnn_pyro.infer.anchor.bootstrap_weights` under the seed of its anchor,
    ``s + c * ANCHOR_CYCLE_OFFSET``; the weights' generator adds its own offset, so the two draws are independent)."""

    def make(fitted, pot, batch, seed: int):
        sites, like = bootstrap_sites(fitted, *batch), next(iter(pot.init.values()))
        weights = [bootstrap_weights(sites, seed=seed + c * ANCHOR_CYCLE_OFFSET, like=like) for c in range(num_cycles)]
        return lambda t: weights[min(t // cycle_length, num_cycles - 1)]

    return make


def observation_weights(model, rows: Data, *, bootstrap: bool, anchored: bool, fast_path: bool) -> dict:
    """``config["observation_weights"]`` of a whitened snapshot run of a Pyro function on ``rows``: the weighted sites
    (:func:`~bnn_pyro.infer.anchor.bootstrap_sites`), or why none (``"skipped"``): ``bootstrap=False``, minibatches (a
    weight per row of the data set, and a batch is a part of it), a potential evaluated without Pyro's tracing (the
    weights act through a messenger), or no observed site with observations to weight one by one."""
    skip = ""
    if not bootstrap:
        skip = "bootstrap=False"
    elif rows.batch_size is not None and rows.batch_size < rows.size:
        skip = "minibatches (batch_size < the rows): one weight per row of the data set, not of a batch"
    else:
        with torch.random.fork_rng(devices=[]):
            if Potentials(fast_path)(model, rows, init="median").fast_path:
                skip = "the potential is evaluated without Pyro's tracing: observation weights cannot act"
    return bootstrap_sites(model, rows.x, rows.y, skip=skip, anchored=anchored).record


def snapshot_plan(num_cycles: int, cycle_length: int, friction: float) -> Plan:
    """The :class:`~bnn_pyro.infer.sgmcmc.Plan` of one run: cosine cycles, no noise, one kept iterate per
    cycle (entering its last step), a cycle's start no candidate for its snapshot (``score_start=False``);
    ``lr="auto"`` re-estimates the peak step every ``ADAPT_EVERY`` steps of a cycle and, in the first cycle,
    also at steps 1, 2, 4, 5, 8, 11, 16, 22, 32, 45, 64 and 90."""
    k = torch.arange(cycle_length)
    last = k == cycle_length - 1
    adapt = (k % ADAPT_EVERY == 0).repeat(num_cycles)
    adapt[[t for t in _EARLY if t < cycle_length]] = True
    return Plan(
        scale=cosine_cycle(cycle_length).repeat(num_cycles),
        noisy=torch.zeros(num_cycles * cycle_length, dtype=torch.bool),
        keep=last.repeat(num_cycles),
        adapt=adapt,
        friction=friction,
        fraction=(2.0 - friction) / 2.0,
        score_start=False,
    )


@dataclass(frozen=True)
class SnapshotConfig(SGOptions):
    """The options of ``method="snapshot"`` and their defaults (see :func:`fit_snapshot`)."""

    num_cycles: int = 5
    cycle_length: int = 1000
    friction: float = 0.1
    validation: object = "default"
    anchored: bool = True
    bootstrap: bool = True


@entry(SnapshotConfig)
def fit_snapshot(model, data: Data, cfg: SnapshotConfig) -> Posterior:
    """Snapshot ensemble: SGD with cosine warm restarts, one snapshot per cycle (see the module docstring).

    Parameters
    ----------
    lr:
        ``"auto"`` (default: the peak step from the curvature, as csgmcmc's) or the peak learning rate on the
        mean loss ``U / N`` (the step on ``U`` is ``lr / N``; the paper's peak is 0.1-0.2 for its nets).
    num_cycles, cycle_length:
        Snapshots ``M`` per run (default 5, as in the paper's CIFAR runs) and steps per cycle (default 1,000):
        ``num_cycles * cycle_length`` steps in all.
    friction:
        ``alpha`` in (0, 1]: SGD momentum ``1 - alpha`` (default 0.1: momentum 0.9, the paper's).
    num_chains, init:
        Independent runs (seeds ``seed + c``), and their starts (``"reset"``, the default for a ``BNN``: the
        layers' initializers under the run's seed; ``"prior"``, ``"net"``, ``"median"``, a dict, a Posterior). A
        small Pyro function's runs start at its mode by default (module docstring, "Pyro functions").
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`) that pick each cycle's snapshot among its own states and
        then the noise: default 10% of tensor data of at least 200 rows (with a learned noise at least 20 rows, of at least 40). Then the run is repeated on every row,
        each cycle's snapshot taken at the step chosen (the same cyclical schedule: the refit replays the
        stops in the schedule that chose them), and the chosen noise replaces the run's
        (:func:`~bnn_pyro.infer.holdout.refit`; cost: a second run). A fraction, an ``(x_val, y_val)`` pair (no
        refit: every row is trained on already), or ``None`` (every snapshot is its cycle's end).
    anchored:
        ``True`` (default): each cycle's objective is anchored at its own prior draw (module docstring, "Off-data
        inputs and anchored cycles"); ``False``: the paper's plain cycles.
    bootstrap:
        ``True`` (default): on a small Pyro function (the whitened cycles) each cycle weights the observations by its
        own ``n * Dirichlet(1, ..., 1)`` draw (module docstring, "The data half of each cycle"), so that the snapshots
        spread where the data dominate the prior; ``config["observation_weights"]`` names the sites weighted, or why
        none. ``False``: every observation weighs 1. A ``bp.BNN`` is not affected either way.
    seed, progress, checkpoint, checkpoint_every, resume, fast_path:
        As in :func:`bnn_pyro.infer.sgmcmc.fit_sgld` (checkpoint/resume is bit-identical).

    Returns
    -------
    Posterior
        ``samples`` shaped ``(num_chains, num_cycles, *shape)``.
    """
    check_lr(cfg.lr)
    num_cycles = positive_int("num_cycles", cfg.num_cycles)
    cycle_length = positive_int("cycle_length", cfg.cycle_length)
    if cycle_length < 2:
        raise ValueError(
            f"cycle_length must be at least 2 steps (a cosine cycle from the peak step down to near "
            f"zero), got {cycle_length}; the default is 1000."
        )
    alpha, validation = check_friction("friction", cfg.friction), cfg.validation
    train, holdout, why = split(data, validation, seed=cfg.seed, method="snapshot", convert=data.convert, model=model)
    settings = dict(
        num_cycles=num_cycles,
        cycle_length=cycle_length,
        friction=alpha,
        validation=describe(holdout, validation if validation != "default" else DEFAULT, why),
    )
    plan = snapshot_plan(num_cycles, cycle_length, alpha)
    if not isinstance(model, BNN):  # a Pyro function: whitened cycles from its mode (module docstring)
        plan = replace(plan, metric="mode" if cfg.init is None else "start")
    anchored = flag("anchored", cfg.anchored)
    settings["anchored"] = anchored
    if anchored:
        plan = replace(plan, anchors=cycle_anchors(num_cycles, cycle_length))
    bootstrap = flag("bootstrap", cfg.bootstrap)
    metric = fit_metric(model, train, plan, cfg)  # once per fit: every chain's, and the refit's
    recorded = {}  # the rows a run fits -> its settings: which observations its cycles weight (module docstring)
    if metric is not None:  # a whitened Pyro function: each cycle weights the rows it fits by its own draw
        weigh = dict(bootstrap=bootstrap, anchored=anchored, fast_path=cfg.fast_path)
        recorded = {id(rows): observation_weights(model, rows, **weigh) for rows in (train, data)}
        # one plan serves the held-out fit and the refit on all rows: weighted in both or in neither (a batch_size
        # between the training rows and all rows minibatches the refit only)
        unweighted = [r["skipped"] for r in recorded.values() if "scheme" not in r]
        if not unweighted:
            plan = replace(plan, weights=cycle_weights(num_cycles, cycle_length))
        else:
            skip = {"skipped": f"the held-out fit and the refit take the same cycles, and one cannot: {unweighted[0]}"}
            recorded = {key: r if "scheme" not in r else skip for key, r in recorded.items()}

    def fitted_on(rows: Data) -> dict:
        weights = {"bootstrap": bootstrap, "observation_weights": recorded[id(rows)]} if recorded else {}
        return {**settings, **weights}

    post = run_plan(model, train, plan, "snapshot", fitted_on(train), cfg, holdout=holdout, full=data, metric=metric)
    # then every row, each cycle's snapshot taken at the step the held-out rows chose (holdout.refit), each cycle
    # weighting every row by its own draw
    post = refit(
        post,
        lambda chosen: run_plan(
            model, data, plan, "snapshot", fitted_on(data), refit_config(cfg), stops=chosen.stops, metric=metric
        ),
    )
    function = not isinstance(model, BNN)  # a Pyro function's snapshots reach their minima: judge their spread too
    whitened = function and anchored and post.config.get("preconditioner")  # the anchored, whitened cycles
    weighted = "scheme" in (post.config.get("observation_weights") or {})
    cause = NARROW_WEIGHTED if weighted else NARROW_FUNCTION if whitened else NARROW
    # weighted cycles minimize different potentials: the last one's end is judged against its own start
    descent = dict(start=(num_cycles - 1) * cycle_length) if weighted else {}
    check_narrow(check_descent(post, **descent), cause=cause, functions=function)
    return check_anchored_log_loss(post, units="cycles") if anchored else check_off_data(post, OFF_DATA)


OFF_DATA = (
    "with anchored=False every snapshot minimizes the same objective, whose prior term pulls the weight "
    "directions that no training row constrains toward the prior's mode, the same point for every snapshot "
    "(as plain MAP ensemble members; anchored=True, the default, tilts each cycle toward its own prior draw)."
)
"""The structural limit :func:`~bnn_pyro.infer.health_off_data.check_off_data` states for a classification fit (module
docstring: "Off-data inputs")."""


NARROW = (
    "The snapshots are the ends of a few SGD cycles, which may all settle in one basin close together; their "
    "spread is not sampled from the posterior. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for snapshot ensembles."""


NARROW_FUNCTION = (
    "On a Pyro function every snapshot is the minimum of the potential tilted toward its own prior draw (anchored, "
    "whitened cycles) and its observations are not weighted (config['observation_weights'] says why): the anchors "
    "randomize only the prior's term, so the snapshots spread by about the prior's share of the posterior precision, "
    "far less than a posterior sd where the data dominate the prior, and a constrained site (a noise scale), which "
    "the anchors leave alone, is nearly one value for every snapshot. "
)
"""The cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for anchored snapshots of a Pyro function whose
cycles weight no observation (``bootstrap=False``, minibatches, or no observed site to weight; module docstring, "Pyro
functions")."""


NARROW_WEIGHTED = (
    "On a Pyro function every cycle weights the observations by its own bootstrap draw (the data half) and, anchored, "
    "tilts the prior toward its own draw (the prior half), which matches the posterior's spread to first order; with "
    "num_cycles snapshots per run the spread itself is uncertain (relative sd about 1/sqrt(2 (M - 1)) for M "
    "snapshots in all), and a posterior far from Gaussian (a hierarchical scale near zero) is not reached by any "
    "minimum: more cycles or runs (num_cycles, num_chains) tell the two apart. "
)
"""The cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for snapshots of a Pyro function whose cycles
weight the observations (module docstring, "Pyro functions")."""
