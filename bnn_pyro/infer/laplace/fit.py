"""The factory: ``fit_laplace`` (draws as a ``Posterior``) and ``laplace_approximation`` (the Gaussian), one chain
at a time: held-out rows, MAP (:mod:`bnn_pyro.infer.map_fit`), curvature (:mod:`.curvature`), prior precision
(:mod:`.marglik`), noise (:mod:`.noise`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import pyro
import torch

from bnn_pyro.infer import _density
from bnn_pyro.infer._common import Data, clean_config, point_values
from bnn_pyro.infer._init import chain_start, resolve_init
from bnn_pyro.infer._potential import Potential, Potentials, newton_mode
from bnn_pyro.infer.checkpoint import Checkpoint, open_chains
from bnn_pyro.infer.contract import PotentialRunOptions, entry
from bnn_pyro.infer.driver import ChainRun, assemble, chain, run_chains
from bnn_pyro.infer.health_off_data import check_off_data, check_quadratic
from bnn_pyro.infer.health_spread import check_gaussian
from bnn_pyro.infer.holdout import DEFAULT, Holdout, describe, noise_site, refit, split
from bnn_pyro.infer.laplace.approximation import (
    Hessian,
    LaplaceApproximation,
    Predictive,
    PriorPrecision,
    Settings,
    Structure,
)
from bnn_pyro.infer.laplace.curvature import checked, prior_terms, solve, terms
from bnn_pyro.infer.laplace.glm import CENTER
from bnn_pyro.infer.laplace.kron import Kron
from bnn_pyro.infer.laplace.marglik import NoiseTerms, log_evidence, optimize_precision
from bnn_pyro.infer.laplace.noise import choose_noise, with_noise
from bnn_pyro.infer.laplace.priors import normal_sites, potentials
from bnn_pyro.infer.laplace.quadratic import draws_excess, effective_parameters
from bnn_pyro.infer.laplace.structure import make_layout
from bnn_pyro.infer.map_fit import minimize
from bnn_pyro.infer.optim import check_lr
from bnn_pyro.likelihoods import HALF_LOG_2PI
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, positive, positive_int

POLISH_STEPS = 100  # L-BFGS iterations after Adam when no rows are held out
NEWTON_STEPS = 5  # Newton steps after them for a dense exact Hessian (fit.refines), each one dense Hessian
NEWTON_MAX_DIM = 2000  # at most this many coordinates (a dense Hessian costs one gradient pass per coordinate)


@dataclass(frozen=True)
class LaplaceConfig(PotentialRunOptions):
    """The options of ``bp.fit(..., method="laplace")``, with their defaults; each is described in
    :func:`fit_laplace`."""

    structure: str | None = None
    hessian: str | None = None
    prior_precision: str | float = "model"
    predictive: str | None = None
    validation: Any = "default"
    num_samples: int = 1000
    num_chains: int = 1
    num_steps: int | None = None
    lr: float = 1e-2
    polish_steps: int | None = None
    marglik_rounds: int = 1
    init: Any = None


@entry(LaplaceConfig)
def fit_laplace(model, data: Data, config: LaplaceConfig) -> Posterior:
    """Fit a Laplace approximation of the posterior of ``model`` and return its draws as a
    :class:`~bnn_pyro.Posterior` (see :mod:`bnn_pyro.infer.laplace` for the method).

    Parameters
    ----------
    structure:
        ``"last_layer"`` (default for a ``BNN``), ``"full"`` (default for a Pyro function; at most
        ``MAX_FULL_DIM`` coordinates), ``"diag"``, or ``"kron"`` (a ``BNN``'s Linear and Conv2d layers, KFAC:
        :mod:`bnn_pyro.infer.laplace.kfac`).
    hessian:
        ``"ggn"`` (default for a ``BNN``), ``"exact"`` (default for a Pyro function: the Hessian by autograd, not
        with ``"kron"``) or ``"fisher"`` (the empirical Fisher).
    prior_precision:
        ``"model"`` (default: the model's prior), ``"marglik"``, ``"marglik_layerwise"``, or a number
        ``delta``: Normal priors of the covered weights replaced by ``Normal(loc, delta^-1/2)``.
    predictive:
        ``"glm"`` (default for a ``BNN``): predictions from the network linearized at the mode, for every
        structure (:mod:`bnn_pyro.infer.laplace.glm`; it costs a Jacobian-vector product, ~2-3 forward passes,
        per chunk of draws); ``"nn"``: the network itself at each draw (the default, and only choice, for a
        Pyro function model).
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`): by default 10% of the training rows when the model has a
        learned homoscedastic Gaussian noise to choose (at least 20 rows of tensor data of at least 40 rows), the same
        for every chain; none otherwise (a known noise leaves nothing to choose, and the Laplace approximation
        belongs at the mode, which early stopping would leave). The MAP search keeps the state with the best
        held-out likelihood (scored every ``num_steps // 50`` steps: early stopping), and the noise is set to the
        value that maximizes the held-out log predictive density of the GLM predictive
        (:mod:`bnn_pyro.infer.laplace.noise`). Then the approximation is fitted again on every row
        (:func:`~bnn_pyro.infer.holdout.refit`): the MAP search for the chosen number of epochs, on the cosine of
        the search that chose (laid over all ``num_steps``, stopped there), with the chosen noise fixed, and its
        curvature (cost: a second MAP search). A fraction (the same, also for a known
        noise: early stopping alone), an ``(x_val, y_val)`` pair (no refit: every row is fitted already), or
        ``None`` (all rows, the noise at the MAP: overconfident on small data).
    num_samples, num_chains:
        Draws per chain from the Gaussian, and independent restarts (chains).
    num_steps, lr:
        Adam steps of the MAP search (default 1,000; 0 when ``init`` is a Posterior, e.g. a MAP fit) and
        its initial learning rate (cosine decay to 1%). Refits under a new prior take a quarter of them.
    polish_steps:
        L-BFGS iterations on the full data after Adam (default 100 without held-out rows, 0 with them: a
        polish would undo early stopping; skipped for data from a loader), then, for a dense exact Hessian, up to
        :data:`NEWTON_STEPS` Newton steps (:func:`refines`).
    marglik_rounds:
        Rounds of prior-precision search followed by a MAP refit under the new prior (default 1; more
        rounds iterate to a fixed point, stopping early once ``delta`` moves by less than 0.1%).
    init:
        Starting point: ``"reset"`` (default for a ``BNN``: the layers' ``reset_parameters()`` under chain
        ``c``'s seed ``seed + c``), ``"net"`` (a BNN's current weights), ``"prior"``, ``"median"`` (default for a
        Pyro function: its prior median), a dict of site values, or a :class:`Posterior` (its mean and point values);
        see :mod:`bnn_pyro.infer._init`.
    seed, progress:
        Random seed (chain ``c`` uses ``seed + c``; the held-out rows use ``seed``), and a progress bar.
    checkpoint, checkpoint_every, resume:
        A folder for one checkpoint file per chain of the MAP search (the iterative part), written every
        ``checkpoint_every`` Adam steps and after the last; ``resume=True`` continues each chain's search from its
        file, bit-identically (optimizer, schedule and early stopping included; see
        :mod:`bnn_pyro.infer.checkpoint`). What follows the search (polish, curvature, prior-precision rounds with
        their shorter refits, noise) is recomputed from the saved end of the search, so a run that dies there
        resumes bit-identically too.
    fast_path:
        ``True`` (default): the potential ``U`` of the MAP search and curvature is evaluated without tracing Pyro
        where the model allows it (same values; under a prior rewritten by ``prior_precision`` other than
        ``"model"``, ``U`` is a Pyro function: Pyro's path); ``False`` forces Pyro's traced potential.
        ``config["fast_path"]`` says whether every ``U`` built ran on the fast path, ``config["potential"]`` the
        paths (:class:`~bnn_pyro.infer._potential.Potentials`).

    Example
    -------
    >>> post = bp.fit(model, x, y, method="laplace", prior_precision="marglik", seed=0)

    A classification fit with ``structure="last_layer"`` (the default for a ``BNN``) of a net with Bayesian layers
    below the last issues the off-data note (:func:`~bnn_pyro.infer.health_off_data.check_off_data`,
    :data:`OFF_DATA`; not for a head on a frozen or deterministic body, where 'full' and 'kron' cover the same
    coordinates); a fit of a Pyro function model whose posterior is far from the Gaussian warns (:func:`~bnn_pyro.infer.health_spread.check_gaussian`,
    :data:`NOT_GAUSSIAN`).
    """
    post = _fit_laplace(model, data, **config.keywords())
    if not isinstance(model, BNN):
        return check_gaussian(post, cause=NOT_GAUSSIAN)
    post = check_quadratic(post, cause=NOT_QUADRATIC)
    if post.config.get("structure") != Structure.LAST_LAYER.value or _last_layer_is_all(model, post):
        return post
    return check_off_data(post, OFF_DATA)


def _last_layer_is_all(model: BNN, post) -> bool:
    """Whether the last layer holds every Bayesian weight of the model (a head on a frozen or deterministic body):
    ``structure="full"`` or ``"kron"`` would then cover the same coordinates, so :data:`OFF_DATA`'s limit and advice
    are not this fit's (what the body's features leave out is the model's choice, the same for every engine)."""
    return post.config.get("dim") == sum(math.prod(model.param_shapes[n]) for n in model.sample_names)


def _judges_quadratic(model, approx: LaplaceApproximation, data: Data) -> bool:
    """Whether :func:`check_quadratic`'s numbers are computed for this chain: a classifier (``BNN``) whose network
    is linear in the covered weights (the default last layer: the draws are the GLM predictive's own), on tensor
    data, with a dense or diagonal precision (``gamma`` is not formed for a Kronecker-factored one). :func:`fit_chain`
    forms ``gamma`` for these chains only."""
    return (
        getattr(getattr(model, "likelihood", None), "task", None) == "classification"
        and data.loader is None
        and not isinstance(approx.precision, Kron)
        and _linear_in(model, approx.linearized_sites())
    )


NOT_GAUSSIAN = (
    "The Gaussian sits at the joint mode of the unconstrained coordinates with the curvature there; a hierarchical "
    "scale (the funnel of eight schools: its mode at a tau far above the posterior's mass) or another skewed or "
    "heavy-tailed site puts the posterior's mass far from that mode. "
)
"""The likely cause :func:`~bnn_pyro.infer.health_spread.check_gaussian` states for a Laplace fit of a Pyro function
model. Measured (``tests/infer/test_reference_engines.py``): eight schools' ``tau`` 14 posterior sds off (its mode ~29,
the posterior mean 3.6), ``k_hat`` 1.03; on kidiq and the logistic regression Laplace matches and ``k_hat`` stays below
0.7."""


NOT_QUADRATIC = (
    "At a MAP that fits (nearly) every training row the GGN phi phi^T (diag p - p p^T) vanishes in the directions "
    "that would move rows across their decision boundaries, so the Gaussian spreads there with the prior's width "
    "where the likelihood is a wall, not a bowl. "
)
"""The cause :func:`~bnn_pyro.infer.health_off_data.check_quadratic` states for a classifier's Laplace fit
(:mod:`.quadratic`). Measured (``benchmarks/results/laplace_classification/``): on digits (600 rows) the last layer's
draws fit the training rows 388 nats worse than their mean against ``gamma / 2 = 36``, test log loss 0.50 against
0.145 for NUTS on the same last layer and features; on iris, wine and breast_cancer the ratio is 1.6-2.3."""


OFF_DATA = (
    "with structure='last_layer' (the default for a bp.BNN) every layer but the last stays at its MAP, so the "
    "features it feeds to the Gaussian last layer carry none of the posterior's spread in the weight directions "
    "the data leave free (there a MAP sits at the prior's mode, as a plain ensemble member does); the spread "
    "left grows with the features' size, not with how unlike the data an input is (structure='full' or 'kron' "
    "covers every layer and separates such inputs, at a cost in test log loss on small data: no structure and "
    "prior_precision met both on more than 3 of 8 public splits)."
)
"""The limit :func:`~bnn_pyro.infer.health_off_data.check_off_data` states for a last-layer classification fit. Measured
(benchmarks/classification.py, docs/ood.md): noise AUROC by mutual information 0.57-0.74 last-layer against
0.87-0.98 with ``structure="full"`` on iris and wine (splits 0, 1); over ``structure`` x ``prior_precision`` on iris,
wine, breast_cancer and digits splits 0-1 at most 3 of the 8 splits meet issue 26's joint target
(``benchmarks/results/laplace_classification/sweep_summary.md``)."""


def _fit_laplace(
    model,
    data: Data,
    *,
    structure,
    hessian,
    prior_precision,
    predictive,
    validation,
    num_samples,
    num_chains,
    num_steps,
    lr,
    polish_steps,
    marglik_rounds,
    init,
    seed,
    progress,
    checkpoint,
    checkpoint_every,
    resume,
    fast_path,
) -> Posterior:
    """:func:`fit_laplace` on its options as keywords."""
    settings = make_settings(
        model,
        data,
        structure=structure,
        hessian=hessian,
        prior_precision=prior_precision,
        num_steps=num_steps,
        lr=lr,
        polish_steps=polish_steps,
        marglik_rounds=marglik_rounds,
        init=init,
        predictive=predictive,
    )
    num_samples = positive_int("num_samples", num_samples)
    num_chains = positive_int("num_chains", num_chains)
    if isinstance(validation, str) and validation == "default" and noise_site(model) is None:
        train, holdout, why = data, None, "no learned Gaussian noise to choose (pass validation=0.1 to early-stop)"
    else:
        train, holdout, why = split(data, validation, seed=seed, method="laplace", convert=data.convert, model=model)

    def run(
        settings: Settings,
        train: Data,
        holdout: Holdout | None,
        why: str | None,
        ckpt_folder: str | None,
        sigma: list[float] | None = None,
    ) -> Posterior:
        head = dict(
            structure=settings.structure.value,
            hessian=settings.hessian.value,
            prior_precision=getattr(settings.prior_precision, "value", settings.prior_precision),
        )
        tail = dict(
            predictive=settings.predictive.value,
            num_samples=num_samples,
            num_chains=num_chains,
            num_steps=settings.num_steps,
            lr=settings.lr,
            polish_steps=_polish(settings, holdout),
            marglik_rounds=settings.marglik_rounds,
            init=settings.init if isinstance(settings.init, str) else type(settings.init).__name__,
            batch_size=data.batch_size,
            dataset_size=data.size,
            seed=seed,
            validation=describe(holdout, validation if validation != "default" else DEFAULT, why),
        )
        ckpts = open_chains(
            ckpt_folder,
            every=checkpoint_every if ckpt_folder else None,
            resume=resume and bool(ckpt_folder),
            num_chains=num_chains,
            run=dict(method="laplace", **clean_config({**head, **tail})),
        )
        x0, y0 = train.first()
        approxes, paths, quadratic = [], Potentials(fast_path), []

        def one_chain(fitted, info):
            approx = fit_chain(
                fitted,
                train,
                settings,
                info.seed,
                progress,
                f"laplace chain {info.index}",
                holdout,
                ckpt=ckpts[info.index],
                paths=paths,
                noise=None if sigma is None else sigma[info.index],
            )
            approxes.append(approx)
            draws = approx.sample(num_samples, seed=info.seed)
            if approx.effective_parameters is not None:  # formed for the chains check_quadratic judges only
                mean = {
                    k: v[0]
                    for k, v in approx.potential.constrain(approx.potential.unflatten(approx.mean[None])).items()
                }
                quadratic.append(
                    {
                        "excess": draws_excess(fitted, draws, mean, train.x, train.y),
                        "expected": approx.effective_parameters / 2,
                    }
                )
            return ChainRun(
                fitted,
                draws,
                point_values(fitted, x0, y0, train.size),
                history={
                    "loss": approx.loss,
                    **({} if holdout is None else {"best_step": torch.tensor([approx.best_step])}),
                }
                if settings.num_steps
                else {},
                stats={"log_q": _density.laplace(approx, draws)},
            )

        runs = run_chains(model, num_chains, seed, one_chain)
        deltas = [a.prior_precision for a in approxes]
        fitted_delta = (
            None
            if deltas[0] is None
            else (
                deltas[0]["all"]
                if num_chains == 1 and list(deltas[0]) == ["all"]
                else {g: [d[g] for d in deltas] for g in deltas[0]}
            )
        )
        evidence = approxes[0].log_evidence if num_chains == 1 else [a.log_evidence for a in approxes]
        noise = [a.noise for a in approxes if a.noise is not None]
        config = clean_config(
            {
                **head,
                "prior_precision_fitted": fitted_delta,
                "log_evidence": evidence,
                "dim": len(approxes[0].active),
                **tail,
            }
        )
        if noise:  # JSON-friendly as it is (as the ensemble's record from holdout.select_noise)
            config["noise"] = noise[0] if num_chains == 1 else noise
        if quadratic:  # the draws' training fit against the quadratic model's (check_quadratic)
            config["quadratic_excess"] = quadratic[0] if num_chains == 1 else quadratic
        paths.record(config)
        if settings.predictive is Predictive.GLM and not _linear_in(runs[-1].model, approxes[0].linearized_sites()):
            for run, approx in zip(runs, approxes):  # where each chain's network is linearized
                run.history.update({CENTER + name: approx.center()[name] for name in approx.linearized_sites()})
        return assemble(runs, method="laplace", config=config, data=data)

    post = run(settings, train, holdout, why, checkpoint)
    # the refit on every row (holdout.refit): the stopping point scaled on the schedule of the search that chose
    # (its cosine over the whole budget, stopped there), no polish (it would undo the stopping), the chosen noise
    # fixed; the MAP search after each prior-precision round as long as in the fit that chose (it is not
    # early-stopped there); not checkpointed (it is recomputed from the search that chose them)
    return refit(
        post,
        lambda chosen: run(
            replace(
                settings,
                num_steps=settings.num_steps if chosen.num_steps is None else chosen.num_steps,
                lr_schedule=chosen.schedule(settings.lr_schedule),
                polish_steps=_polish(settings, holdout),
                round_steps=settings.num_steps // 4,
            ),
            data,
            None,
            None,
            None,
            chosen.sigma,
        ),
    )


def laplace_approximation(
    model, data: Data, *, seed: int = 0, progress: bool = False, validation=None, fast_path: bool = True, **config
) -> LaplaceApproximation:
    """The Gaussian itself (one chain) for the options of :func:`fit_laplace` except ``num_samples``,
    ``num_chains`` and ``predictive``; ``model`` is copied and the copy, with its fitted point values, is
    ``.model``. No rows are held out unless ``validation`` says so (then the Gaussian is fitted on the rest)."""
    settings = make_settings(model, data, **config)
    train, holdout, _ = split(data, validation, seed=seed, method="laplace", convert=data.convert)
    with chain(model, seed) as fitted:
        return fit_chain(fitted, train, settings, seed, progress, "laplace", holdout, paths=Potentials(fast_path))


def make_settings(
    model,
    data: Data,
    *,
    structure=None,
    hessian=None,
    prior_precision="model",
    num_steps=None,
    lr=1e-2,
    polish_steps=None,
    marglik_rounds=1,
    init=None,
    predictive=None,
) -> Settings:
    is_bnn = isinstance(model, BNN)
    structure = choice("structure", structure or ("last_layer" if is_bnn else "full"), Structure)
    hessian = choice("hessian", hessian if hessian is not None else ("ggn" if is_bnn else "exact"), Hessian)
    predictive = choice("predictive", predictive or ("glm" if is_bnn else "nn"), Predictive)
    if not is_bnn and hessian is Hessian.GGN:
        raise ValueError(
            "hessian='ggn' needs a bp.BNN (a network output f and a likelihood to differentiate); "
            "for a Pyro function model use hessian='exact' (the default there) or 'fisher'."
        )
    if not is_bnn and structure in (Structure.LAST_LAYER, Structure.KRON):
        raise ValueError(
            f"structure={structure.value!r} needs a bp.BNN with nn.Linear (or nn.Conv2d) layers; for a "
            "Pyro function model use structure='full' or 'diag'."
        )
    if structure is Structure.KRON and hessian is Hessian.EXACT:
        raise ValueError(
            "hessian='exact' takes the dense Hessian of the covered coordinates, which structure='kron' never forms; "
            "use hessian='ggn' (the default) or 'fisher' with 'kron', or structure='full', 'diag' or 'last_layer'."
        )
    if not is_bnn and predictive is Predictive.GLM:
        raise ValueError(
            "predictive='glm' needs a bp.BNN (a network to linearize); for a Pyro function model use "
            "predictive='nn' (the default there)."
        )
    if isinstance(prior_precision, str):
        prior_precision = choice("prior_precision", prior_precision, PriorPrecision)
    else:
        prior_precision = positive("prior_precision", prior_precision)
    default_steps = 0 if isinstance(init, Posterior) else 1000
    return Settings(
        structure=structure,
        hessian=hessian,
        prior_precision=prior_precision,
        num_steps=positive_int("num_steps", default_steps if num_steps is None else num_steps, allow_zero=True),
        lr=check_lr(lr, method="laplace"),
        polish_steps=None if polish_steps is None else positive_int("polish_steps", polish_steps, allow_zero=True),
        marglik_rounds=positive_int("marglik_rounds", marglik_rounds),
        # a Pyro function's default start is its prior median (Pyro's and NumPyro's autoguides, their Laplace guide
        # included, start there), not a prior draw: a draw from a wide prior (kidiq: N(0, 100) coefficients on a
        # covariate near 100) starts the search where U is ~1e7 and no line search gets back
        init=resolve_init(model, "median" if init is None and not is_bnn else init, data),
        predictive=predictive,
    )


def _linear_in(model, sites: list[str]) -> bool:
    """Whether the network is linear in ``sites``: they are the weights of the last module of an ``nn.Sequential``,
    an ``nn.Linear`` (the default last-layer fit). Its draws are then exactly the GLM's and need no Jacobian."""
    net = getattr(model, "net", None)
    if not isinstance(net, torch.nn.Sequential) or not len(net) or not isinstance(net[-1], torch.nn.Linear):
        return False
    last = f"{len(net) - 1}."
    return bool(sites) and all(n.startswith(last) and "." not in n[len(last) :] for n in sites)


def _polish(s: Settings, holdout: Holdout | None) -> int:
    return s.polish_steps if s.polish_steps is not None else (0 if holdout is not None else POLISH_STEPS)


def _map(
    pot: Potential,
    z,
    data: Data,
    s: Settings,
    steps: int,
    seed: int,
    progress: bool,
    desc: str,
    holdout: Holdout | None,
    model,
    fixed=(),
    ckpt: Checkpoint | None = None,
    lr_schedule="cosine",
):
    """The shared MAP search on ``U(z)`` (unconstrained coordinates: Laplace's curvature is taken there), saved to
    and resumed from ``ckpt`` (:func:`~bnn_pyro.infer.map_fit.minimize`); Adam's rate on ``lr_schedule`` (the
    first search's is ``s.lr_schedule``, the prior-precision rounds' a cosine over their own steps)."""
    run = minimize(
        pot,
        pot.unflatten(z),
        data,
        model=model,
        num_steps=steps,
        lr=s.lr,
        lr_schedule=lr_schedule,
        seed=seed,
        progress=progress,
        desc=desc,
        holdout=holdout,
        polish_steps=_polish(s, holdout),
        jacobian=False,
        fixed=fixed,
        method="laplace",
        ckpt=ckpt,
    )
    z = pot.flatten(run.z).detach()
    if refines(s, holdout, data, fixed, z.numel()):
        z = newton_mode(pot.flat_fn((data.x, data.y)), z, steps=NEWTON_STEPS)[0].detach()
    return z, run.loss, run.best_step


def refines(s: Settings, holdout: Holdout | None, data: Data, fixed, dim: int) -> bool:
    """Whether the MAP search ends with :data:`NEWTON_STEPS` Newton steps on ``U`` (exact Hessian): the polish of a
    dense exact-Hessian fit (``hessian="exact"``, ``structure="full"``, the default for a Pyro function) on tensor
    data with nothing held fixed or out and at most :data:`NEWTON_MAX_DIM` coordinates. L-BFGS in float32 stops short
    of the mode on a badly conditioned posterior (kidiq: 2.4 posterior sds off in the intercept); Newton's step does
    not depend on the coordinates' scales."""
    return (
        s.hessian is Hessian.EXACT
        and s.structure is Structure.FULL
        and _polish(s, holdout) > 0
        and data.loader is None
        and not fixed
        and dim <= NEWTON_MAX_DIM
    )


def fit_chain(
    model,
    data: Data,
    s: Settings,
    seed: int,
    progress: bool,
    desc: str,
    holdout: Holdout | None = None,
    ckpt: Checkpoint | None = None,
    paths: Potentials | None = None,
    noise: float | None = None,
) -> LaplaceApproximation:
    """One chain: MAP, curvature, prior precision and noise; ``data`` are the training rows. ``noise``: a learned
    Gaussian noise's sd chosen before (on held-out rows, for the refit on all rows: :func:`~bnn_pyro.infer.holdout.refit`),
    held fixed through the MAP search and the curvature. ``ckpt`` checkpoints
    the first MAP search; the refits of the prior-precision rounds are not (a resumed run recomputes them from the
    end of that search: one-shot steps and short refits, deterministic given its state and generators). ``paths``
    builds the potentials (default: the fast path where the model allows it)."""
    paths = Potentials() if paths is None else paths
    pyro.set_rng_seed(seed)
    base = paths(model, data, init=chain_start(model, s.init, seed))
    marglik = s.prior_precision in (PriorPrecision.MARGLIK, PriorPrecision.MARGLIK_LAYERWISE)
    site = noise_site(model) if holdout is not None or marglik or noise is not None else None
    site = site if site in base.shapes else None  # a learned Gaussian noise: a hyperparameter, not covered
    layout = make_layout(model, base, s.structure, exclude=[site] if site else [])
    z = base.flatten(base.init)
    normal = None if s.prior_precision is PriorPrecision.MODEL else normal_sites(model, base, layout, data)
    delta = None if not isinstance(s.prior_precision, float) else {"all": s.prior_precision}
    pots = potentials(model, data, base, z, normal, delta, build=paths)
    if site is not None and noise is not None:
        z = with_noise(base, z, layout, site, noise)
    z, loss, best_step = _map(
        pots[0],
        z,
        data,
        s,
        s.num_steps,
        seed,
        progress,
        desc,
        holdout,
        model,
        ckpt=ckpt,
        fixed=[site] if site is not None and noise is not None else (),
        lr_schedule=s.lr_schedule,
    )
    lik, prior = terms(model, pots, z, data, layout, s)
    unit = None if not marglik else {g: 1.0 for g in normal.groups(s.prior_precision)}
    sigma = None
    for _ in range(s.marglik_rounds if marglik else 0):
        prior1 = prior_terms(potentials(model, data, base, z, normal, unit)[1], z, layout, s, data)
        terms_noise = None if site is None or noise is not None else _noise_terms(model, base, z, lik, data, site, s)
        new, sigma = optimize_precision(lik, prior1, normal, z, layout, delta or normal.initial(unit), terms_noise)
        if sigma is not None:
            z = with_noise(base, z, layout, site, sigma)
        pots = potentials(model, data, base, z, normal, new, build=paths)
        steps = s.num_steps // 4 if s.round_steps is None else s.round_steps
        z, _, _ = _map(pots[0], z, data, s, steps, seed, False, desc, holdout, model, fixed=[site] if site else ())
        lik, prior = terms(model, pots, z, data, layout, s)
        done = delta is not None and all(abs(math.log(new[g] / delta[g])) < 1e-3 for g in new)
        delta = new
        if done:
            break
    chosen, noise = noise, None if sigma is None else {"selected_on": "marglik", "sigma": sigma}
    if chosen is not None and site is not None:
        moved, noise = with_noise(base, z, layout, site, chosen), {"selected_on": "validation", "sigma": chosen}
        if not torch.equal(moved, z):  # else the search held the noise there: the curvature above is at z already
            z = moved
            lik, prior = terms(model, pots, z, data, layout, s)
    elif site is not None and holdout is not None:
        z, noise = choose_noise(model, base, z, layout, lik.hess, prior.hess, holdout, site, s.hessian)
        lik, prior = terms(model, pots, z, data, layout, s)
    (hess, chol), gradient = checked(lik.hess + prior.hess, s), lik.grad + prior.grad  # H factorized once: chol
    step = solve(hess, gradient) if chol is None else torch.cholesky_solve(gradient[:, None], chol)[:, 0]
    mean = z.clone()
    if float(gradient @ step) < 1.0:  # the quadratic model's mode, when within one posterior sd (package doc)
        mean[layout.active] -= step.to(z.dtype)
    else:  # a kink, an unconverged or early-stopped search: the plain Laplace evidence at z*
        gradient = torch.zeros_like(gradient)
    evidence = log_evidence(lik.value + prior.value, gradient, hess, chol=chol)
    approx = LaplaceApproximation(
        mean=mean,
        precision=hess,
        active=layout.active,
        expansion_point=z,
        structure=s.structure,
        potential=base,
        model=model,
        prior_precision=delta,
        log_evidence=float(evidence),
        loss=loss,
        noise=noise,
        best_step=best_step,
    )
    if chol is not None:  # draws, their density and covariance() use it too
        approx.keep_cholesky(chol)
    if _judges_quadratic(model, approx, data):  # gamma (an O(k^3) solve) only where check_quadratic reads it
        approx.effective_parameters = effective_parameters(lik.hess, hess, chol=chol)
    return approx


def _noise_terms(model, pot: Potential, z, lik, data: Data, site: str, s: Settings) -> NoiseTerms:
    """The Gaussian likelihood part as a function of the noise (:class:`.marglik.NoiseTerms`) at ``z``."""
    value = pot.constrain(pot.unflatten(z))[site]
    sigma0 = float(value if site == "sigma" else value.rsqrt())
    count = data.size * model.output_dim(data.first()[0])
    rss = 2 * sigma0**2 * (lik.value - count * (math.log(sigma0) + HALF_LOG_2PI))
    return NoiseTerms(
        sigma0=sigma0,
        rss=rss,
        count=count,
        power=4 if s.hessian is Hessian.FISHER else 2,  # the GGN and the exact Hessian scale as sigma^-2
        prior=model.likelihood.sites()[site],
        precision=site == "precision",
    )
