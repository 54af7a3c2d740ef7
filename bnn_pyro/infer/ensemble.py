r"""Deep ensembles: ``bp.fit(model, x, y, method="ensemble", ...)``.

Lakshminarayanan, B., Pritzel, A. & Blundell, C. (2017). Simple and scalable predictive uncertainty
estimation using deep ensembles. NeurIPS.

Each of ``num_chains`` members ``k`` is a MAP fit of the model from its own random start (seed
``seed + k``: initial weights and minibatch order), by default *anchored* (``anchored=True``; Pearce et al.
2020, :mod:`bnn_pyro.infer.anchor`): its objective below gets the term ``<w, grad log p(w_0^(k))>`` for its own
prior draw ``w_0^(k)``, which for a Gaussian prior turns the weight decay ``|w - mu|^2 / (2 s^2)`` into
``|w - w_0^(k)|^2 / (2 s^2)``. Why: plain MAP members all go to the prior's mode in the directions the data
leave free, so they agree with each other off the data. Measured (benchmarks/results/classification/, a
1-hidden-layer ReLU net, ``Normal(0, 1)`` prior; docs/ood.md): the AUROC of the predictive entropy separating test
rows from Gaussian-noise inputs rose from about 0.5 to 0.73-0.88, at a cost in test NLL that the exact posterior
(NUTS) does not pay: a mode of a randomized objective is not a posterior draw for a nonlinear classifier.
With a Gaussian likelihood of fixed scale ``sigma`` an anchored member also fits its own targets
``y + delta``, ``delta ~ N(0, sigma^2)`` (:func:`~bnn_pyro.infer.anchor.target_noise`; ``config["perturbed_targets"]``):
with both halves perturbed, a member of a linear-Gaussian model is an exact posterior draw (randomize-then-optimize),
where the anchor alone gives the covariance ``S S / s^2``, too narrow where the data dominate the prior. A learned
noise, a loader and classification fit ``y`` itself (no exact perturbation exists there: :mod:`bnn_pyro.infer.anchor`).
A plain Pyro function's members (tensor data; ``bootstrap=True``, the default) also weight each observation's
log-likelihood by ``n * Dirichlet(1, ..., 1)`` weights of their own (the weighted likelihood bootstrap, Newton &
Raftery 1994; with the anchor, the posterior bootstrap of Fong, Lyddon & Holmes 2019: :mod:`bnn_pyro.infer.anchor`,
"The data half"; ``config["observation_weights"]``) when they are converged to their minima. Why: such a model
has no exact target perturbation, and anchoring alone randomizes only the prior half, so where the data dominate
the members sat at one mode (kidiq: 0.001-0.07 of the exact sds; with the weights and 30 members 0.76-0.98).
``anchored=False`` gives the paper's plain members. Adam minimizes, on minibatches ``B`` of ``N``,

.. math::

    U_c(w) = -\log p(w) - \frac{N}{B} \sum_{i \in B} \log p(y_i \mid x_i, w)
           = U(z) + \log\left|\det \frac{\partial w}{\partial z}\right|,

the negative log joint over the latent sites ``w`` *in their own (constrained) coordinates*: the
shared :class:`~bnn_pyro.infer._potential.Potential` ``U(z)`` of the unconstrained ``z`` with the
log-Jacobian that ``U`` subtracts added back, so that a learned noise scale ``sigma`` goes to the
mode of ``p(sigma | ...)`` (as SVI's ``guide="map"``), not of ``p(log sigma | ...)``; for weights
(real-valued) the two agree. With a ``Normal`` prior the ``-log p(w)`` term is weight decay; the
likelihood term is the paper's proper scoring rule: Gaussian negative log-likelihood (a learned
``sigma`` site, or a ``HeteroscedasticGaussian`` net that outputs mean and scale: both are fitted
per member) or the cross-entropy for classification. Deterministic parameters (those that
``bayesian=...`` leaves out) are fitted per member too.

Initial values (``init=``, shared with every engine: :mod:`bnn_pyro.infer._init`): ``"reset"`` (a
``BNN``'s default) gives every parameter a fresh draw from its layer's own initializer
(``reset_parameters()`` under the member's seed), as in the paper; ``"prior"`` draws the latent sites
from their priors; ``"median"`` (a Pyro function's default) starts every member at the prior median, as Laplace's
search. A Pyro function's member (tensor data, no ``pyro.param`` sites) then finishes at the minimum of its own
objective, anchor and perturbed targets included: L-BFGS, then damped Newton steps
(:func:`~bnn_pyro.infer.map_fit.converge`; after the refit on all rows when rows are held out). Why: such models'
posteriors can be badly conditioned (a covariate near 100 beside an intercept: the Hessian's condition number
5e5 on kidiq), so first-order steps end far from the minimum (171 posterior sds there), and a prior draw of a
wide prior starts where the potential is ~1e6; Newton's step does not depend on the coordinates' scales. Hyper and noise sites start at their prior
medians under ``"reset"``. An anchored member of a ``BNN`` whose net starts with an ``nn.Linear`` starts that
layer's weight at its anchor along the input directions the fitted rows leave free (eigenvalues of ``X^T X / N``
below ``4 / (N s^4)``), where the anchored objective's minimizer is the anchor, so that early stopping cannot cut
its spread there short (:mod:`bnn_pyro.infer.anchor`, "Where a member starts"; ``config["anchor"]``). The other choices (``"net"``, ``"median"``, a dict, a ``Posterior``) start
every member at the same point, so that only the minibatch order tells members apart.

The posterior is the equal-weight mixture of the members, ``p(w | D) ~ (1/K) sum_k delta(w - w_k)``,
stored as ``K`` chains of one draw each (so per-member deterministic values pair with their draw).
Its predictive (``post.predict``) is the paper's mixture: mean ``(1/K) sum_k mu_k(x)``, variance
``(1/K) sum_k (sigma_k^2(x) + mu_k^2(x)) - mean^2`` (aleatoric ``E_k sigma_k^2`` plus epistemic
``Var_k mu_k``); classification averages the members' probabilities. ``predict(x)`` uses each member
once; for interval bounds ask for more predictive draws, e.g. ``predict(x, num_samples=2000, seed=0)``
(members are picked with replacement, each draw with its own observation noise). With one draw per
chain, R-hat and ESS are undefined (NaN in ``summary``, and ArviZ warns "More chains than draws"):
members are modes, not a Markov chain.

Adversarial training (section 2.3 of the paper; ``adversarial_eps > 0``): each step also evaluates
the fast-gradient-sign input ``x' = x + eps * sign(grad_x U)`` (Goodfellow et al. 2015) and
minimizes ``(U(x) + U(x')) / 2`` (the prior counted once). The paper uses ``eps`` = 1% of each
input's range; ``eps`` here is in input units (e.g. ``0.04`` for standardized inputs).

Example
-------
>>> post = bp.fit(model, x, y, method="ensemble", num_chains=5, num_steps=2000, lr=1e-2, seed=0)
>>> post.samples["0.weight"].shape        # (5, 1, 50, 1): member, draw, *shape
>>> pred = post.predict(x_test)            # mixture mean, std = sqrt(aleatoric + epistemic)
>>> post.history["loss"]                   # (members, steps): U_c on each step's minibatch
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from bnn_pyro.infer._common import Data, clean_config
from bnn_pyro.infer._init import Init, resolve_init
from bnn_pyro.infer._init import reset_values as _reset_values  # noqa: F401 - its former home (tests import it)
from bnn_pyro.infer._potential import Potentials
from bnn_pyro.infer.anchor import bootstrap_sites, bootstrap_weights, free_directions, target_noise
from bnn_pyro.infer.checkpoint import open_chains
from bnn_pyro.infer.contract import Loop, PotentialRunOptions, drive, entry
from bnn_pyro.infer.driver import ChainRun
from bnn_pyro.infer.health_off_data import check_anchored_log_loss
from bnn_pyro.infer.health_spread import check_narrow
from bnn_pyro.infer.holdout import DEFAULT, describe, refit, refit_config, select_noise, split
from bnn_pyro.infer.map_fit import adversarial_loss as _adversarial_loss  # noqa: F401 - former home (tests)
from bnn_pyro.infer.map_fit import converge, finish, map_engine, map_fit
from bnn_pyro.infer.map_fit import energy as _energy  # noqa: F401 - former home (tests)
from bnn_pyro.infer.optim import DEFAULT_SCHEDULE, check_lr
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import flag, positive_int

__all__ = ["fit_ensemble", "EnsembleConfig", "EnsembleInit"]


EnsembleInit = Init  # the shared choices; the name is kept for backward compatibility


@dataclass(frozen=True)
class EnsembleConfig(PotentialRunOptions):
    """The options of ``method="ensemble"`` and their defaults (documented in :func:`fit_ensemble`)."""

    RENAMED: ClassVar[dict[str, str]] = {"num_members": "num_chains"}  # deprecated alias, one release

    num_chains: int = 5
    num_steps: int = 1000
    lr: float = 1e-2
    optimizer: object = "adam"
    lr_schedule: object = DEFAULT_SCHEDULE
    init: object = None
    adversarial_eps: float = 0.0
    anchored: bool = True
    bootstrap: bool = True
    validation: object = "default"


@entry(EnsembleConfig)
def fit_ensemble(model, data: Data, cfg: EnsembleConfig) -> Posterior:
    """Fit a deep ensemble: ``num_chains`` MAP fits from different random starts (see the module docstring).

    Parameters
    ----------
    num_chains:
        Number of members ``K`` (the paper uses 5); each becomes one chain of one draw (``num_chains``, as every
        engine names its independent runs; formerly ``num_members``, still taken with a ``FutureWarning``).
    num_steps, lr, optimizer, lr_schedule:
        Optimizer steps per member and the optimizer, as in :func:`bnn_pyro.infer.svi.fit`
        (``"adam"``/``"adamw"``/``"sgd"`` or a callable; ``"cosine"``, the default of every optimizing engine,
        ``"constant"``/``"exponential"`` or a callable: :mod:`bnn_pyro.infer.optim` states what ``lr`` means and
        why cosine). Minibatches come from ``bp.fit(..., batch_size=...)``.
    init:
        ``"reset"`` (re-run the layers' initializers; default for a ``BNN``) or ``"prior"`` (a prior
        draw), or one start for every member (``"net"``, ``"median"``, a dict of site values, a ``Posterior``).
        ``"median"`` (the prior median) is a Pyro function's default: the anchors tell its members apart, and each
        is finished by Newton steps (module docstring). A ``BNN``'s deterministic parameters
        restart from their initializers except under ``"net"`` and a ``Posterior``.
    adversarial_eps:
        Size of the fast-gradient-sign input perturbation (0, the default, turns it off).
    anchored:
        ``True`` (default): each member's objective is anchored at its own prior draw (seed ``seed + k``; see the
        module docstring and :mod:`bnn_pyro.infer.anchor`) and, under a Gaussian likelihood of fixed scale, fits
        its own perturbed targets (the exact randomize-then-optimize draw for a linear-Gaussian model), and its
        first ``nn.Linear`` layer starts at the anchor along the input directions the data leave free
        (``config["anchor"]``: how many, or why not); ``False``: plain MAP members from ``init``.
    bootstrap:
        ``True`` (default): a plain Pyro function's members (tensor data, no adversarial term) weight each
        observation's log-likelihood by their own ``n * Dirichlet(1, ..., 1)`` draw (seed ``seed + k``) when they are
        converged to their minima (the weighted likelihood bootstrap: module docstring), so that they spread where
        the data dominate the prior; ``config["observation_weights"]`` names the sites weighted, or why none.
        ``False``: members fit the data unweighted. A ``bp.BNN`` is not affected either way.
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`): by default 10% of the training rows (when that is at least
        20 rows, with a learned noise at least 20 rows of at least 40, and the data are tensors), the same rows for every member. Each member keeps its state
        with the best held-out likelihood (scored every ``num_steps // 50`` steps: early stopping), and a
        learned Gaussian noise is then set to the value that maximizes the held-out log predictive density
        of the ensemble's mixture. Then the members are trained again on every row for the chosen number of
        epochs (the median over members of the best step, scaled to all rows) on the schedule of the fit that
        chose (laid over all ``num_steps``, stopped there: the state the held-out rows scored), and the chosen
        noise replaces theirs (:func:`~bnn_pyro.infer.holdout.refit`; cost: a second fit). A fraction, an ``(x_val, y_val)``
        pair (no refit: every row is fitted already), or ``None`` (all rows trained on, the members' own noise
        estimates kept: overconfident on small data).
    seed, progress:
        Member ``k`` uses seed ``seed + k``; ``progress=False`` turns the progress bar off.
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per member, written every ``checkpoint_every`` steps and after the
        last; ``resume=True`` continues each member from its file, bit-identically (early-stopping state
        included; see :mod:`bnn_pyro.infer.checkpoint`).
    fast_path:
        ``True`` (default): the potential is evaluated without tracing Pyro where the model allows it (same
        values); ``False`` forces Pyro's traced potential (see :class:`~bnn_pyro.infer._potential.Potentials`).
        ``config["fast_path"]`` says which ran, ``config["potential"]`` the path.

    Returns
    -------
    Posterior
        ``samples`` shaped ``(num_chains, 1, *shape)``, ``point`` ``(num_chains, *shape)``,
        ``history["loss"]`` ``(num_chains, num_steps)``, ``sample_stats["lp"]`` ``(num_chains, 1)``:
        each member's log joint ``-U_c`` at its mode (on the full data; on the first batch, scaled to
        the data set, for a loader).
    """
    # chosen on held-out rows (stopping point, noise), then fitted on every row with them (holdout.refit)
    post = refit(_fit(model, data, cfg), lambda chosen: _fit(model, data, refit_config(cfg, chosen)))
    weighted = "scheme" in (post.config.get("observation_weights") or {})
    cause = (NARROW_WEIGHTED if cfg.anchored else NARROW_WEIGHTS_ONLY) if weighted else NARROW
    check_narrow(post, cause=cause, functions=True)  # members at their minima
    return check_anchored_log_loss(post, units="members") if cfg.anchored else post


NARROW = (
    "The members are minima of the log joint tilted toward each member's prior draw: their spread is the anchors' "
    "spread mapped through the curvature, which is narrower than the posterior's where the data dominate the prior "
    "(on a logistic regression, 0.06-0.11 of the exact sds after 10,000 steps), and members still short of their "
    "minima lie wherever their steps left them. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for an ensemble whose data half is not
randomized (a ``BNN`` without perturbed targets, or a Pyro function whose observations could not be weighted:
``config["observation_weights"]``)."""

NARROW_WEIGHTED = (
    "The members' data half is randomized by bootstrap weights and their prior half by anchors, which matches the "
    "posterior's spread to first order; with few members the spread itself is uncertain (relative sd about "
    "1/sqrt(2 (K - 1)) for K members), and a posterior far from Gaussian (a hierarchical scale near zero) is not "
    "reached by any mode: more members (num_chains) tell the two apart. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for a Pyro function's weighted members."""


NARROW_WEIGHTS_ONLY = (
    "The members' data half is randomized by bootstrap weights but their prior half is not (anchored=False): where "
    "the prior, not the data, sets a parameter (a hierarchy's group effects), every member sits at the same point; "
    "the default anchored=True gives each member its own prior draw. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_narrow` names for weighted members without anchors."""


def _fit(model, data: Data, cfg: EnsembleConfig) -> Posterior:
    num_chains = positive_int("num_chains", cfg.num_chains)
    num_steps = positive_int("num_steps", cfg.num_steps)
    lr = check_lr(cfg.lr, method="ensemble")
    # a Pyro function's members start at its prior median (as Laplace's search does): a prior draw of a wide prior on
    # a badly scaled covariate starts where U is ~1e7 and Adam's steps never reach the posterior
    init = resolve_init(model, "median" if cfg.init is None and not isinstance(model, BNN) else cfg.init, data)
    try:
        eps = float(cfg.adversarial_eps)
    except (TypeError, ValueError):
        raise TypeError(f"adversarial_eps must be a number, got {cfg.adversarial_eps!r}.") from None
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(
            f"adversarial_eps must be a non-negative finite number, got {cfg.adversarial_eps!r}; "
            "0 turns adversarial training off, the paper uses 1% of each input's range."
        )
    anchored = flag("anchored", cfg.anchored)
    validation = cfg.validation
    train, holdout, why = split(data, validation, seed=cfg.seed, method="ensemble", convert=data.convert, model=model)
    perturbed = anchored and train.loader is None and target_noise(model, train.y, seed=cfg.seed) is not None
    free = free_directions(model, train.x if train.loader is None else None) if anchored else None
    bootstrap = flag("bootstrap", cfg.bootstrap)
    described = describe(holdout, validation if validation != "default" else DEFAULT, why)
    skip = (
        "bootstrap=False"
        if not bootstrap
        else "adversarial_eps > 0 (no member is converged)"
        if eps > 0
        else "validation rows were given (the members keep their held-out stops and are not refitted to their minima, "
        "where the weights act)"
        if described.get("source") == "given"
        else ""
    )
    sites = bootstrap_sites(
        model, *((train.x, train.y) if train.loader is None else (None, None)), skip=skip, anchored=anchored
    )
    config = clean_config(
        dict(
            num_chains=num_chains,
            num_steps=num_steps,
            lr=lr,
            optimizer=getattr(cfg.optimizer, "value", cfg.optimizer),
            lr_schedule=getattr(cfg.lr_schedule, "value", cfg.lr_schedule),
            init=init if isinstance(init, str) else type(init).__name__,
            adversarial_eps=eps,
            anchored=anchored,
            perturbed_targets=perturbed,
            anchor=None if free is None else free.record,
            bootstrap=bootstrap,
            observation_weights=sites.record,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=cfg.seed,
            validation=described,
        )
    )
    ckpts = open_chains(
        cfg.checkpoint,
        every=cfg.checkpoint_every,
        resume=cfg.resume,
        num_chains=num_chains,
        run=dict(method="ensemble", **config),
    )

    def member(state, history) -> ChainRun:
        kept = finish(state, train, history["loss"], holdout=holdout)
        weights = bootstrap_weights(sites, seed=state.seed, like=next(iter(state.z.values()), None))
        if holdout is None and eps == 0 and converge(state, train, weights=weights):  # a Pyro function: to its minimum
            kept = replace(kept, z={k: v.detach() for k, v in state.z.items()})
        fit = map_fit(state, kept, train)
        history = {"loss": fit.loss, **({} if holdout is None else {"best_step": torch.tensor([fit.best_step])})}
        return ChainRun(
            state.model,
            {n: v.unsqueeze(0) for n, v in fit.sample.items()},
            fit.point,
            history,
            stats={"lp": fit.lp.unsqueeze(0)},
        )

    paths = Potentials(cfg.fast_path)
    engine = map_engine(
        train,
        init=init,
        num_steps=num_steps,
        holdout=holdout,
        adversarial_eps=eps,
        draws=member,
        paths=paths,
        anchored=anchored,
        perturb_targets=perturbed,
        free=free,
    )
    loop = Loop(
        num_steps=num_steps,
        lr=lr,
        method="ensemble",
        desc="ensemble member {index}",
        optimizer=cfg.optimizer,
        lr_schedule=cfg.lr_schedule,
        progress=cfg.progress,
    )
    post = drive(
        model,
        train,
        engine,
        loop,
        num_chains=num_chains,
        seed=cfg.seed,
        config=config,
        checkpoints=ckpts,
        posterior_data=data,
    )
    paths.record(post.config)
    return select_noise(post, holdout)
