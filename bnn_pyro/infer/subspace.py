"""Subspace inference: ``bp.fit(model, x, y, method="subspace", inner="nuts", ...)``.

Izmailov, P., Maddox, W. J., Kirichenko, P., Garipov, T., Vetrov, D. & Wilson, A. G. (2019). Subspace
inference for Bayesian deep learning. UAI.

0. **Pre-training** (default, tensor data): a MAP fit by :func:`bnn_pyro.infer.map_fit.fit_map` on full batches
   (or reshuffled epochs of ``batch_size`` rows) with SWA's pre-training settings (``swa``'s ``pretrain_steps``,
   ``pretrain_optimizer``, ``pretrain_lr``: by default 2,000 Adam steps at ``3e-2`` decaying to 1% on a cosine),
   early-stopped on the SWA run's held-out rows when it holds some out; the SWA run starts there with
   ``pretrain_steps=0``. Why: SWA's own pre-training drew its minibatches with replacement (the noise its SWA
   phase is built on) until SWA took the data's own batches for it too, and on small data with a learned noise
   that noise kept the net from fitting (the MAP start stays the default, unchanged). On the zoo's
   ``mlp_regression`` (80 points, 1-50-1 tanh, ``sigma`` learned; seed 0) SWA's pre-training ended at train loss
   ``U/N`` 1.95, sigma 0.23 and test RMSE 0.29 (the data's noise is 0.1), and subspace NUTS around that point gave
   RMSE 0.66, test NLL +1.97, 95% coverage 0.76 (confidently wrong); the same schedule on full batches reached
   ``U/N`` 1.19, sigma 0.096, RMSE 0.101 (seeds 1 and 2: sigma 0.125 and 0.106, RMSE 0.133 and 0.113 with
   replacement; 0.096 and 0.100, 0.119 and 0.108 on full batches), and subspace NUTS from there (100 + 100 draws)
   RMSE 0.108, NLL -0.80, coverage 0.935, gap/data sd 3.3. An explicit ``swa=SWAGConfig(init=...)`` keeps SWA's own
   pre-training (``pretrain_steps=0`` skips it); a loader of batches uses it too (its batches come in the loader's
   order).
1. **The subspace.** An SWA run (:mod:`bnn_pyro.infer.swag`, options in ``swa=SWAGConfig(...)``) gives the average
   ``w_hat`` of its iterates and the deviations ``D`` (``K x d``, the last ``K`` of them) of the iterates from
   the running average. Their principal components (the SVD ``D = U S V^T``) give the basis

       ``P = V_k S_k / sqrt(K - 1)``   (``d x k``, ``k = subspace_dim``),

   so that ``w = w_hat + P z`` moves along the ``k`` directions in which SGD wandered most, ``z_j = 1``
   being one standard deviation of the iterates along direction ``j`` (the paper's PCA subspace). The
   subspace covers the ``BNN``'s weight sites (``model.sample_names``, in the unconstrained coordinates of
   the SWA run, which for real-valued weights are the weights themselves).
2. **Inference over z** with any engine that fits a Pyro function model (``inner=``: ``"nuts"`` by default,
   ``"hmc"``, ``"metropolis"``, ``"svi"``, ``"sgld"``, ``"sghmc"``, ``"csgmcmc"``; its options in its
   typed config, e.g. ``inner=NUTSConfig(...)``). The model over ``z`` is the ``BNN`` itself with its weight
   sites conditioned on ``w_hat + P z``; its other latent sites (a learned noise, hierarchical scales) stay free and are inferred
   jointly with ``z`` (so the noise is sampled by the inner engine, not set by a point fit). Its
   deterministic parameters stay at their SWA averages.
   Inner coordinates: under the induced prior the inner engine samples ``u``, the displacement along the
   directions normalized to unit length (``w = w_hat + V_k u``, ``u_j = z_j s_j / sqrt(K - 1)``; its start, as
   ``z ~ N(0, I)``). Why: the iterates' sd falls by orders of magnitude from the first direction to the last,
   while along a direction the data leave free the posterior keeps the prior's spread in the weights, so in units
   of ``z`` its sds span those orders of magnitude too, which a dense mass matrix adapted in float32 during one
   chain's warm-up holds badly; in ``u`` they span only the posterior's own range. The isotropic prior is the
   paper's, in ``z``. With :data:`INNER_TARGET_ACCEPT` this took the inner NUTS's divergences at the defaults
   below the fit's 1% warning (``benchmarks/results/subspace_divergences/``).
3. **The posterior over the weights**: every draw of ``z`` becomes ``w = w_hat + P z``; ``post.samples``
   holds the net's sites as for any engine (``predict``, ``summary``, ArviZ), the inner engine's chains and
   per-draw statistics included.

Held-out rows (:mod:`bnn_pyro.infer.holdout`). With a learned Gaussian noise and tensor data the rows the SWA run
holds out (by default 10%, at least 20 rows, of at least 40 rows; ``swa=SWAGConfig(validation=...)``) stay out of the inner engine's
data too, and the noise of every draw is then set to the value that maximizes their log predictive density
under the subspace predictive, as for the other point-fit engines. Why: sampled jointly with ``z`` the noise
is the training residual of a net confined to ``w_hat + P z``, which carries little weight uncertainty, and the
predictive was overconfident: on scikit-learn's diabetes (benchmarks/uci.py protocol) the test log-likelihood
was -6.04 / -5.70 / -5.60 on splits 0-2 with 95% coverage 0.75 / 0.84 / 0.89 (NUTS on all weights: -5.54 /
-5.49 / -5.46, coverage 0.93-0.95).

Prior on z (``prior=``):

- ``"induced"`` (default): the net's own prior restricted to the subspace, ``p(z) ∝ p_w(w_hat + P z)``
  (the weight sites' log prior is evaluated at the conditioned values). The posterior over ``z`` is then
  the net's posterior conditioned on ``w`` lying in the subspace: when the subspace is the whole weight
  space (``subspace_dim = d``) it is exactly the net's posterior, mapped by an affine bijection (the test suite
  checks this against Bayesian linear regression's closed form).
- ``"isotropic"``: ``z ~ N(0, prior_scale^2 I)``, the paper's choice (their Section 4; the net's own prior
  is then not used for the weights).

Cost: the pre-training (2,000 Adam steps) and the SWA phase (200 epochs of SGD, as :func:`bnn_pyro.infer.swag.fit_swag`)
plus the inner engine on a ``k``-dimensional model (each of its steps evaluates the net on the data, as
for the full model). Cheap per step, not always per draw: on the gap data (rank 10, induced prior, 100
warm-up draws) NUTS took ~600 leapfrog steps per draw (tree depth 8.4), because the data pin some
directions of ``z`` while the prior alone bounds the others, which are wide in units of ``z``. BatchNorm
running statistics of every draw are those of the SWA average.

Checkpoint and resume (``checkpoint=FOLDER``, ``checkpoint_every=N``, ``resume=True``): each stage checkpoints
itself, in its own sub-folder of ``FOLDER`` (created): ``FOLDER/map`` the MAP start (:mod:`bnn_pyro.infer.map_fit`),
``FOLDER/swa`` the SWA run (pre-training and SWA phase, with its moments), ``FOLDER/inner`` the inner engine's
chains, each every ``N`` of its own steps and after its last. ``FOLDER/subspace.ckpt`` records this fit's
settings. After a crash in any stage, the same call with ``resume=True`` re-reads the finished stages' last
checkpoints and continues the interrupted one: the result is bit-identical to an uninterrupted run's. A resume
with other settings is an error (this fit's and each stage's own run identity), and so is one that counts another
``subspace_dim`` or span after the SWA stage (another device or version: :func:`_check_span`).

Examples
--------
>>> post = bp.fit(model, x, y, method="subspace", subspace_dim=10, num_samples=500, num_chains=2,
...               inner=bp.infer.mcmc.NUTSConfig(num_warmup=500, dense_mass=True), seed=0)
>>> post.config["subspace"]["singular_values"]     # the SWA iterates' spread along each direction
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from bnn_pyro.infer._common import Data, clean_config
from bnn_pyro.infer._init import resolve_init
from bnn_pyro.infer._potential import Potential, Potentials
from bnn_pyro.infer.checkpoint import Checkpoint, CheckpointError, read, write
from bnn_pyro.infer.contract import PotentialRunOptions, entry, renamed_options
from bnn_pyro.infer.driver import ChainRun, assemble
from bnn_pyro.infer.health_off_data import check_off_data
from bnn_pyro.infer.health_warn import warn_diagnostic
from bnn_pyro.infer.holdout import noise_site, select_noise, split
from bnn_pyro.infer.map_fit import fit_map
from bnn_pyro.infer.registry import REGISTRY, Method
from bnn_pyro.infer.subspace_held import check_subspace
from bnn_pyro.infer.swag import SWAConfig, fit_moments
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice, flag, positive, positive_int
from bnn_pyro.utils.user_warnings import speaking_for, warn

__all__ = [
    "fit_subspace",
    "SubspaceConfig",
    "Subspace",
    "SubspaceModel",
    "SubspacePrior",
    "inner_engines",
    "spanned_directions",
    "DEFAULT_SUBSPACE_DIM",
]

# pre-training on full batches (or reshuffled epochs) by the MAP engine: swag.py's pre-training budget and rate
_PRETRAIN_STEPS, _PRETRAIN_LR = 2000, 3e-2
_SET_BY_SUBSPACE = (
    "seed",
    "progress",
    "batch_size",
    "dataset_size",
    "num_threads",
    "num_samples",
    "num_chains",
    "fast_path",
    "checkpoint",
    "checkpoint_every",
    "resume",
)
INNER_TARGET_ACCEPT = 0.95
"""The inner NUTS's ``target_accept`` when ``inner="nuts"`` (NUTS's own default is Stan's 0.8). Why: the posterior over
the subspace is curved (a tanh net's outputs bend as ``z`` moves along the directions the data leave free), and at 0.8
the adapted step was too long for its high-curvature tail, where the divergent draws clustered: a 1-50-1 net's fit
diverged on 2.7% of its draws, above the fit's 1% warning; in weight units at 0.95 at most 0.2% of any fit's draws
diverged, at 0.9-1.6x the leapfrog steps per draw, test RMSE within 0.0005 and NLL within 0.003 of before
(``benchmarks/results/subspace_divergences/``). The price: on a smooth posterior the draws are less independent (on
diabetes the bulk ESS of f fell from 1,755 and 1,336 to 855 and 871 of 1,000 draws; on the 1-16-1 net at seed 0 from
448 to 359)."""
STAGES = ("map", "swa", "inner")  # the sub-folders of checkpoint=FOLDER, one per stage
DEFAULT_SUBSPACE_DIM = 10
"""``subspace_dim`` when it is not given (the paper uses 5 to 20; why 10: :func:`fit_subspace`). Not given, it is
lowered to what the model allows (:func:`fit_subspace`): the number of weights with a prior, the SWA deviations kept
(``swa=SWAGConfig(swag_rank=...)``) and the number of directions they span (:func:`spanned_directions`); given, a
value above any of these is an error naming it."""


def inner_engines() -> tuple[str, ...]:
    """The methods that can run over the subspace's coordinates: those whose declaration says they fit a Pyro
    function model (``Capabilities.function_model``; the point-fit engines need a ``BNN``)."""
    return tuple(m.value for m, declared in REGISTRY.items() if declared.capabilities.function_model)


class SubspacePrior(str, Enum):
    INDUCED = "induced"  # the net's own prior at w_hat + P z
    ISOTROPIC = "isotropic"  # z ~ N(0, prior_scale^2 I) (Izmailov et al. 2019)


class Subspace:
    """The affine map ``z -> w_hat + P z`` onto the weight sites (``center`` ``(d,)``, ``basis`` ``(d, k)``,
    the sites' ``shapes`` in flat order)."""

    def __init__(self, center: torch.Tensor, basis: torch.Tensor, shapes: dict[str, torch.Size]):
        self.center, self.basis, self.shapes = center, basis, dict(shapes)

    @classmethod
    def from_deviations(
        cls, center: torch.Tensor, deviations: torch.Tensor, rank: int, shapes: dict[str, torch.Size]
    ) -> tuple[Subspace, torch.Tensor]:
        """The PCA subspace of ``deviations`` (``K x d``) around ``center``, and all singular values."""
        _, s, vh = torch.linalg.svd(deviations, full_matrices=False)
        basis = vh[:rank].T * (s[:rank] / math.sqrt(deviations.shape[0] - 1))
        return cls(center, basis, shapes), s

    def orthonormal(self) -> tuple[Subspace, torch.Tensor]:
        """The same affine subspace with unit-length columns (``P``'s orthogonal columns divided by their norms, the
        SWA iterates' sd along each direction), and those norms: its coordinates are weight-space displacements."""
        norms = self.basis.norm(dim=0)
        return Subspace(self.center, self.basis / norms, self.shapes), norms

    def weights(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Site values for ``z`` shaped ``(..., k)``: ``(..., *shape)`` per weight site."""
        flat = self.center + z @ self.basis.T
        out, i = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            out[name] = flat[..., i : i + n].reshape(flat.shape[:-1] + tuple(shape))
            i += n
        return out


def spanned_directions(singular: torch.Tensor, iterates: torch.Tensor) -> tuple[int, float]:
    """The number of directions the SWA deviations span, and the tolerance used: of the deviations' singular values
    ``singular`` (descending), those above twice the spectral edge of the iterates' own rounding,

        ``2 * (sqrt(K) + sqrt(d)) * sigma``,   ``sigma^2 = mean(ulp(w)^2) / 12``

    over the ``K x d`` ``iterates`` as stored, in the model's dtype (``ulp(w)``: the spacing of that dtype's numbers at
    each entry).

    Why this rule: the SWA deviations are differences of float32 iterates, held and decomposed in float64, so the
    noise sits in the data, not in the SVD: each stored iterate is its value rounded to the nearest float32, an error
    uniform within half an ulp (sd ``ulp / sqrt(12)``), independent across entries. A ``K x d`` matrix of such errors
    has a largest singular value of about ``(sqrt(K) + sqrt(d)) * sigma`` (a random matrix's edge; Vershynin,
    *High-Dimensional Probability*, 4.4.5), so a direction in which the iterates never moved (a 2-class softmax's logit
    sum, which the likelihood's gradient never reaches) still carries a singular value up to that size, never zero;
    twice the edge leaves room for the errors' departures from independence. The floor is set by the weights' own
    magnitudes (their ulps), not by the deviations' largest singular value: on the gap data's 1-50-1 net (weights up to
    2.5, deviations' ``s_max`` 0.04) the ten directions a default subspace needs sit at 5e-6 and above, the rounding's
    own singular values at 9e-8 to 2e-7 (this floor: 6.5e-7), and a floor proportional to ``s_max`` or ``max |w|``
    cut the tenth (a default that lowered itself, with a warning, on one machine and not another).
    ``torch.linalg.matrix_rank``'s ``max(K, d) * eps * s_max`` bounds an SVD's error in the data's own precision
    instead and grows like ``d``: on a 200-100-1 net it dropped 14 of 20 real directions. The former fixed
    ``1e-8 * s_max`` sat below float32's rounding, which passed it or not by device (a frozen-backbone ``Linear(4,
    2)`` head's 5 true directions: 10 counted on a CPU, 9 on a GPU; now 5 on both, the rounding's at 1.3e-7 against a
    floor of 4.9e-7).

    Its limit: rounding also accumulates over the SGD steps (each update rounds to the iterate's grid), and the
    prior's pull moves the iterates along a direction the likelihood never reaches while it decays; the rule counts
    both as directions. Such a direction is a valid one of the iterates' spread: the subspace through it stays a
    valid subspace."""
    if singular.numel() == 0:
        return 0, 0.0
    size = math.sqrt(iterates.shape[0]) + math.sqrt(iterates.shape[1])
    magnitude = iterates.abs()
    ulp = (torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude).double()
    tolerance = 2.0 * size * float((ulp.square().mean() / 12).sqrt())
    return int((singular > tolerance).sum()), tolerance


class SubspaceModel:
    """The Pyro model over ``z``: the ``BNN`` with its weight sites conditioned on ``w_hat + P z``. ``prior_scale``
    (a number, or one per direction): the sd of ``z``'s base ``N(0, prior_scale^2)``, the prior under
    ``"isotropic"``; under ``"induced"`` its density is cancelled and it only sets where ``init="prior"`` starts."""

    def __init__(self, bnn: BNN, subspace: Subspace, prior: SubspacePrior, prior_scale: float | torch.Tensor):
        self.bnn, self.subspace, self.prior, self.prior_scale = bnn, subspace, prior, prior_scale

    @property
    def reads_values(self) -> bool:
        """The BNN's (:attr:`~bnn_pyro.model.BNN.reads_values`): the inner MCMC then runs eagerly, not traced."""
        return self.bnn.reads_values

    def __call__(self, x, y=None, dataset_size=None):
        k = self.subspace.basis.shape[1]
        zeros = self.subspace.basis.new_zeros(k)
        base = dist.Normal(zeros, zeros + self.prior_scale).to_event(1)
        z = pyro.sample("z", base)
        if self.prior is SubspacePrior.INDUCED:  # flat in z: the prior is the weights' own, below
            pyro.factor("z_base_removed", -base.log_prob(z))
        values = self.subspace.weights(z)
        hidden = list(values) if self.prior is SubspacePrior.ISOTROPIC else []  # their log prior not counted
        with poutine.block(hide=hidden), poutine.block(hide_types=["param"]), poutine.condition(data=values):
            return self.bnn(x, y, dataset_size=dataset_size)  # deterministic parameters: fixed, not trained


@dataclass(frozen=True)
class SubspaceConfig(PotentialRunOptions):
    """The options of ``bp.fit(..., method="subspace")``, each described in :func:`fit_subspace`; ``rank``, the
    former name of ``subspace_dim``, is accepted for one release with a ``FutureWarning``, and so are the dict forms
    of ``swa=`` and ``inner_options=`` (typed: ``swa=SWAGConfig(...)``, ``inner=NUTSConfig(...)``)."""

    RENAMED: ClassVar[dict[str, str]] = {"rank": "subspace_dim"}

    subspace_dim: int | None = None  # default: DEFAULT_SUBSPACE_DIM, fewer where the model allows fewer (fit_subspace)
    inner: Any = "nuts"
    num_samples: int | None = None
    num_chains: int = 1
    inner_options: dict | None = None  # deprecated: the options of inner= go in its typed config
    prior: str = "induced"
    prior_scale: float | None = None
    swa: Any = None  # a SWAGConfig (a dict: deprecated)


OFF_DATA = (
    "its draws move only along the subspace_dim directions in which the SWA iterates wandered around one solution, "
    "and those deviations are SGD's minibatch gradient noise, which lies in the weight directions the training rows' "
    "gradients reach; in the directions the data leave free, where the posterior keeps the prior's spread, every "
    "draw sits at the SWA mean."
)
"""The structural limit :func:`~bnn_pyro.infer.health_off_data.check_off_data` states for a classification fit: the
subspace is spanned by SWA's iterate deviations (Izmailov et al. 2019), which hold no spread where no training row's
gradient reaches, the same limit as plain SWAG's (:data:`bnn_pyro.infer.swag.OFF_DATA`); measured over ten splits in
docs/ood.md ("HMC, Metropolis, MALA and subspace over ten splits")."""


@entry(SubspaceConfig)
def fit_subspace(model, data: Data, config: SubspaceConfig) -> Posterior:
    """Subspace inference: a PCA subspace of the SWA trajectory, then ``inner`` over its coordinates.

    Parameters
    ----------
    subspace_dim:
        ``k``, the subspace's dimension (default :data:`DEFAULT_SUBSPACE_DIM`, 10; the paper uses 5 to 20). Given, it
        must be at most the number of weights with a prior, the SWA deviations kept (``swa["swag_rank"]``, default
        ``max(20, subspace_dim)``) and the number of directions they span (their numerical rank,
        :func:`spanned_directions`), or an error names it. Not given, the default is lowered to the smallest of
        these, so that a small model fits at the defaults; ``config["subspace"]["subspace_dim"]`` records the
        dimension requested and used and why (the last of these that lowered it). Lowered to the directions
        spanned, a ``DiagnosticWarning`` says so: where the deviations are at least as many as the weights, in the
        others the SWA iterates did not wander, no training row's gradient reaches them, and the posterior's prior
        spread there is missing from every draw; otherwise it gives the count measured. The used dimension and the
        directions spanned are recorded in a checkpoint, and a resume that counts others is refused. ``rank=``, its
        former name, still works for one release with a ``FutureWarning``. Why 10: on the
        bundled gap data (1-50-1 tanh net, noise 0.1, seed 0) the linearized posterior in the subspace is
        1.55x more uncertain in the gap than on the data at rank 5 (NUTS over z at rank 5: 1.55x too), 4.3x at
        rank 10 and 7.3x at rank 20 (NUTS on all weights: 6.6x): the top few directions of the SGD iterates
        change the fit on the data, the next ones bend the function in the gap.
    inner, num_samples, num_chains, inner_options:
        The engine run over ``z``: a method name (``"nuts"`` by default; see :func:`inner_engines`) or, to set its
        options, that engine's typed config (e.g. ``bp.infer.mcmc.NUTSConfig(num_warmup=500, dense_mass=True)``:
        all its options are passed on, its defaults included, so ``dense_mass`` is then the config's); its draws
        per chain (default: the engine's own) and its chains (default 1); ``seed``, ``progress`` and the data
        settings come from this fit. NUTS and HMC named by a string adapt a dense mass matrix here
        (``dense_mass=True``: ``k`` is small), and NUTS targets an acceptance of 0.95
        (:data:`INNER_TARGET_ACCEPT`: at Stan's 0.8 up to 2.7% of its draws diverged on the small nets measured). ``inner_options=dict(...)``, the former way to set the inner
        engine's options, still works for one release with a ``FutureWarning`` naming the typed config to use
        (one way per concept: the config checks its option names and types where it is made). The inner engine's
        fit-time warnings name the method called and the engine, ``"subspace (inner nuts): ..."``
        (:func:`~bnn_pyro.utils.user_warnings.speaking_for`).
    prior, prior_scale:
        ``"induced"`` (default: the net's prior at ``w_hat + P z``) or ``"isotropic"`` (``z ~ N(0,
        prior_scale^2 I)``, ``prior_scale`` default 1).
    swa:
        Options of the SWA run that builds the subspace, as ``bp.infer.swag.SWAGConfig(...)``: the fields given
        away from their defaults (``swag_rank``, the deviations kept, ``pretrain_steps``, ``num_steps``, ``lr``,
        ``validation``, ...; one chain). By default the pre-training is a full-batch MAP fit (step 0 of the module
        docstring); an explicit ``init`` here runs SWA's own pre-training instead. A dict of the same options, the
        former form, still works for one release with a ``FutureWarning``.
    seed, progress:
        Seeds both stages; ``progress=False`` turns the bars off. ``bp.fit``'s ``batch_size`` applies to the
        SWA run and to the stochastic-gradient inner engines (svi, sgld, sghmc, csgmcmc); nuts, hmc and
        metropolis see the full data at every step.
    fast_path:
        Passed to every stage (MAP pre-training, SWA, the inner engine; ``False``: Pyro's traced potential
        throughout). ``config["fast_path"]`` says whether every stage ran on the fast path (the inner engine's
        model over ``z`` is a Pyro function: Pyro's path); each stage's own config says which ran there.
    checkpoint, checkpoint_every, resume:
        A folder (it must exist) for the stages' checkpoints, one sub-folder each (``map``, ``swa``, ``inner``),
        written every ``checkpoint_every`` steps of each stage and after its last; ``resume=True`` continues
        from them, bit-identically (module docstring; :mod:`bnn_pyro.infer.checkpoint`).

    Returns
    -------
    Posterior
        The inner engine's chains and draws over the net's sites; ``config["subspace"]`` records the rank,
        the prior, the singular values and the inner engine's ``coordinates``, ``config["inner"]`` the inner engine's configuration.
        ``config["subspace"]["held"]``: the fraction of each weight's posterior variance and of the outputs'
        linearized variance at the training inputs that the subspace can hold at all
        (:func:`~bnn_pyro.infer.subspace_held.check_subspace`, which warns when an output keeps below 44%, or a
        weight does in a net linear in its weights: no draw moves outside the ``subspace_dim`` directions, so no
        inner engine gets more).
    """
    return _fit_subspace(model, data, **config.keywords())


def _string_defaults(method: str) -> dict:
    """The options this fit gives an inner engine named by a string: NUTS and HMC a dense mass matrix (``k`` is
    small and ``z``'s directions are correlated), NUTS also ``target_accept=INNER_TARGET_ACCEPT``."""
    if method == "nuts":
        return dict(dense_mass=True, target_accept=INNER_TARGET_ACCEPT)
    return dict(dense_mass=True) if method == "hmc" else {}


def _inner_method(inner) -> tuple[str, dict]:
    """``inner=`` as a method name and the options its typed config gives: all of them (its defaults included, e.g.
    ``dense_mass=False``) but those this fit sets (seed, chains, draws, checkpoints, ...), which are passed on, to be
    refused by name, only where they differ from their defaults."""
    if isinstance(inner, str) or not dataclasses.is_dataclass(inner):
        return inner, {}
    for method, declared in REGISTRY.items():
        if declared.capabilities.function_model and getattr(declared.fit_function(), "config_type", None) is type(
            inner
        ):
            return method.value, {
                f.name: getattr(inner, f.name)
                for f in dataclasses.fields(inner)
                if f.name not in _SET_BY_SUBSPACE or getattr(inner, f.name) != f.default
            }
    raise TypeError(
        f"inner: expected one of {', '.join(map(repr, inner_engines()))} or the config of one (e.g. "
        f"bp.infer.mcmc.NUTSConfig(num_warmup=500)), got {type(inner).__name__}."
    )


def _swa_options(swa) -> dict:
    """``swa=`` as a dict of the SWA run's options: a dict as it is, or a SWA/SWAG config
    (``bp.infer.swag.SWAGConfig(num_steps=...)``) whose fields set away from their defaults (the others keep this
    fit's defaults, e.g. its MAP pre-training)."""
    if swa is None:
        return {}
    if isinstance(swa, dict):
        options = ", ".join(f"{'swag_rank' if k == 'rank' else k}={v!r}" for k, v in swa.items())
        warn(
            f"swa=dict(...) is deprecated: pass the SWA run's options as swa=SWAGConfig({options}) (from "
            "bnn_pyro.infer.swag import SWAGConfig; the dict form works for one more release).",
            FutureWarning,
        )
        return dict(swa)
    if isinstance(swa, SWAConfig):
        return {
            f.name: getattr(swa, f.name) for f in dataclasses.fields(swa) if not _is_default(getattr(swa, f.name), f)
        }
    raise TypeError(
        f"swa: expected the SWA run's options as bp.infer.swag.SWAGConfig(...) or a dict, got "
        f"{type(swa).__name__}; e.g. swa=SWAGConfig(num_steps=2000, swag_rank=20)."
    )


def _inner_config(method: str) -> type | None:
    """The typed config of the inner engine ``method`` (e.g. ``NUTSConfig``), or ``None`` for a name that is not one."""
    declared = REGISTRY.get(Method(method)) if method in inner_engines() else None
    return getattr(declared.fit_function(), "config_type", None) if declared is not None else None


def _inner_options_deprecated(inner, options: dict) -> str:
    """The ``FutureWarning`` for ``inner_options=``: the typed config that says the same (NUTS and HMC keep this
    fit's dense mass matrix, which a config's own default would turn off)."""
    method = inner if isinstance(inner, str) else _inner_method(inner)[0]
    config = _inner_config(method)
    if config is None:
        return "inner_options= is deprecated: pass the inner engine's typed config as inner= instead."
    shown = dict(options)
    if isinstance(inner, str):
        shown.update({k: v for k, v in _string_defaults(method).items() if k not in shown})
    name, source = config.__qualname__, f"from {config.__module__} import {config.__qualname__}"
    fields = ", ".join(f"{k}={v!r}" for k, v in shown.items())
    where = f"inner={name}({fields})" if isinstance(inner, str) else f"fields of the {name} passed as inner= ({fields})"
    return (
        f"inner_options= is deprecated: pass the inner engine's options as {where} ({source}; inner_options= "
        "works for one more release)."
    )


def _is_default(value, f: dataclasses.Field) -> bool:
    return value is f.default or (
        isinstance(value, (bool, int, float, str)) and type(value) is type(f.default) and value == f.default
    )


def _fit_subspace(
    model,
    data: Data,
    *,
    subspace_dim,
    inner,
    num_samples,
    num_chains,
    inner_options,
    prior,
    prior_scale,
    swa,
    seed,
    progress,
    fast_path,
    checkpoint,
    checkpoint_every,
    resume,
) -> Posterior:
    """:func:`fit_subspace` on its options as keywords."""
    from bnn_pyro.infer import fit, options

    if not isinstance(model, BNN):
        raise TypeError(
            f"model: method='subspace' needs a bnn_pyro.BNN (its weight sites span the subspace), got "
            f"{type(model).__name__}; wrap the net as bp.BNN(net, prior=..., likelihood=...)."
        )
    given = subspace_dim is not None  # not given: DEFAULT_SUBSPACE_DIM, lowered to what the model allows
    rank = positive_int("subspace_dim", subspace_dim) if given else DEFAULT_SUBSPACE_DIM
    lowered = None  # why the default was lowered, if it was
    inner, typed = _inner_method(inner)
    if not (isinstance(inner, str) and inner in inner_engines()):
        raise ValueError(
            f"inner: expected one of {', '.join(map(repr, inner_engines()))} (an engine that fits a Pyro "
            f"function model), got {inner!r}; try inner='nuts'."
        )
    if inner_options is not None:
        warn(_inner_options_deprecated(inner, inner_options), FutureWarning)
    inner_options = {**typed, **(inner_options or {})}
    known = options(inner)
    for key in inner_options:
        if key in _SET_BY_SUBSPACE:
            raise ValueError(
                f"inner_options: {key!r} is set by the subspace fit itself; pass it to bp.fit(...) directly instead."
            )
        if key not in known:
            raise TypeError(
                f"inner_options: {key!r} is not an option of method={inner!r}; see "
                f"bp.infer.options({inner!r}) for its options."
            )
    inner_options["num_chains"] = positive_int("num_chains", num_chains)
    if num_samples is not None:
        inner_options["num_samples"] = positive_int("num_samples", num_samples)
    kind = choice("prior", prior, SubspacePrior)
    if prior_scale is not None and kind is SubspacePrior.INDUCED:
        raise ValueError(
            "prior_scale: applies to prior='isotropic' only (the induced prior is the net's own); "
            "drop it, or pass prior='isotropic'."
        )
    scale = positive("prior_scale", 1.0 if prior_scale is None else prior_scale)
    swa = _swa_options(swa)
    paths = Potentials(fast_path)
    for key in (
        "swag",
        "num_chains",
        "num_samples",
        "scale",
        "seed",
        "progress",
        "fast_path",
        "checkpoint",
        "checkpoint_every",
        "resume",
    ):
        if key in swa:
            raise ValueError(f"swa: {key!r} is set by the subspace fit (one SWA chain builds the subspace); drop it.")
    num_weights = sum(math.prod(model.param_shapes[n]) for n in model.sample_names)
    if rank > num_weights:
        if given:
            raise ValueError(
                f"subspace_dim={rank} exceeds the number of weights with a prior ({num_weights}); lower it."
            )
        rank, lowered = num_weights, f"the model has {num_weights} weights with a prior"
    swa = renamed_options(swa, {"rank": "swag_rank"})  # SWAG's rank is swag_rank (one name per concept)
    deviations = positive_int("swa['swag_rank']", swa.pop("swag_rank", max(20, rank)))
    if rank > deviations:
        if given:
            raise ValueError(
                f"subspace_dim={rank} exceeds the {deviations} SWA deviations kept (swa['swag_rank']); lower "
                f"subspace_dim or pass swa=SWAGConfig(swag_rank={rank}) or more."
            )
        rank, lowered = deviations, f"swa=SWAGConfig(swag_rank={deviations}) keeps {deviations} SWA deviations"
    stages = _stages(
        checkpoint,
        checkpoint_every,
        resume,
        dict(
            method="subspace",
            rank=rank,
            inner=inner,
            inner_options=inner_options,
            prior=kind.value,
            prior_scale=scale,
            coordinates=_coordinates(kind),  # a checkpoint of the inner stage in other units must not resume
            swa=dict(swa, rank=deviations),
            seed=seed,
            batch_size=data.batch_size,
            dataset_size=data.size,
        ),
    )

    if data.loader is None and "init" not in swa and swa.get("pretrain_steps") != 0:
        swa.update(init=_map_start(model, data, swa, seed, progress, paths, stages["map"]), pretrain_steps=0)
    swa_post, (moments,) = fit_moments(
        model,
        data,
        swag=True,
        swag_rank=deviations,
        num_samples=1,
        num_chains=1,
        seed=seed,
        progress=progress,
        fast_path=fast_path,
        **swa,
        **stages["swa"],
    )
    bnn = swa_post.model
    pot = Potential(bnn, data, init="net", fast_path=False)  # its sites and transforms only: U is not evaluated
    columns, shapes, start = [], {}, 0
    for name, shape in pot.shapes.items():
        n = math.prod(shape)
        if name in bnn.sample_names:
            probe = pot.init[name]
            if name in pot.transforms and pot.transforms[name].inv(probe) is not probe:
                raise ValueError(
                    f"model: the weight site {name!r} has a constrained prior support; the subspace "
                    "is built for real-valued weights (e.g. a Normal or Laplace prior)."
                )
            columns.append(torch.arange(start, start + n, device=probe.device))
            shapes[name] = shape
        start += n
    columns = torch.cat(columns)
    dtype = pot.init[next(iter(shapes))].dtype
    every, singular = Subspace.from_deviations(
        moments.mean[columns], moments.deviations[:, columns], len(columns), shapes
    )  # all the deviations' directions: the first rank span the subspace, the rest are what check_subspace weighs
    kept = int(moments.deviations.shape[0])  # K, the deviations kept (swag_rank, or fewer snapshots)
    # the iterates as the SWA run stored them (the model's dtype, not the float64 the moments are accumulated in)
    iterates = (every.center + moments.deviations[:, columns]).to(dtype)
    spanned, tolerance = spanned_directions(singular, iterates)
    if spanned == 0:
        raise ValueError(
            "swa: the SWA iterates never moved (their deviations span no direction), so there is no subspace to "
            "sample; check the SWA run's lr (swa=SWAGConfig(lr=...)) and that the data reach the weights."
        )
    if rank > spanned:
        if given:
            raise ValueError(
                f"subspace_dim={rank}: the SWA deviations span only {spanned} directions; lower subspace_dim, or "
                f"keep more SWA deviations (swa=SWAGConfig(swag_rank=...); {kept} now), which adds directions "
                "only where the iterates wander."
            )
        rank, lowered = spanned, f"the SWA deviations span only {spanned} directions"
        warn_diagnostic(_unspanned_message(spanned, num_weights, kept))
    _check_span(stages["inner"], dict(rank=rank, spanned=spanned))  # counted anew: a resume must count the same
    space = Subspace(every.center.to(dtype), every.basis[:, :rank].to(dtype), shapes)
    origin = every.center.new_zeros(every.center.shape)  # direction j at each site: row j of weights(I)
    directions = Subspace(origin, every.basis[:, :spanned], shapes).weights(
        torch.eye(spanned, dtype=origin.dtype, device=origin.device)
    )

    for key, value in _string_defaults(inner).items():
        inner_options.setdefault(key, value)  # a dense k x k mass matrix; NUTS's target_accept (INNER_TARGET_ACCEPT)
    if kind is SubspacePrior.INDUCED:  # the inner engine in weight units (docstring, "Inner coordinates")
        space, iterate_sd = space.orthonormal()
        zmodel = SubspaceModel(bnn, space, kind, iterate_sd)  # init="prior" starts as z ~ N(0, I) did
    else:
        zmodel = SubspaceModel(bnn, space, kind, scale)
    train, holdout = data, None  # a learned Gaussian noise: chosen on the rows the SWA run held out (docstring)
    if data.loader is None and noise_site(model) is not None:
        train, holdout, _ = split(
            data, swa.get("validation", "default"), seed=seed, method="subspace", convert=data.convert, model=model
        )
    # the inner fit's checks name what the user called, "subspace (inner nuts): ...", not "nuts: ...", and where the
    # options they advise are set here (not bp.fit's, whose defaults, e.g. num_chains, differ)
    config_name = getattr(_inner_config(inner), "__name__", "its config")
    note = (
        f"(Inside method='subspace', set the inner engine's options in inner={config_name}(...), and num_chains and "
        "num_samples on bp.fit, where num_chains defaults to 1.)"
    )
    with speaking_for(inner, f"subspace (inner {inner})", note):
        if data.loader is not None:
            inner_post = fit(
                zmodel,
                data.loader,
                None,
                method=inner,
                dataset_size=data.size,
                seed=seed,
                progress=progress,
                fast_path=fast_path,
                **inner_options,
                **stages["inner"],
            )
        else:
            # minibatches for the engines that take them (SVI, SG-MCMC); MCMC's accept/reject needs the full data
            batch = data.batch_size if REGISTRY[Method(inner)].capabilities.minibatches else None
            inner_post = fit(
                zmodel,
                train.x,
                # a float64 target in the subspace's dtype: Pyro's HMC works in its energy's dtype (momenta, metric)
                train.y.to(space.basis.dtype) if train.y.dtype.is_floating_point else train.y,
                method=inner,
                batch_size=batch,
                seed=seed,
                progress=progress,
                fast_path=fast_path,
                **inner_options,
                **stages["inner"],
            )
    samples = {k: v.detach().clone() for k, v in space.weights(inner_post.samples["z"]).items()}
    samples.update({k: v for k, v in inner_post.samples.items() if k != "z"})
    stats = {k: v for k, v in inner_post.sample_stats.items() if k != "log_q"}  # q(z) is not a density over w
    runs = [
        ChainRun(
            bnn,
            {k: v[c] for k, v in samples.items()},
            {k: v[0] for k, v in swa_post.point.items()},
            {k: v[c] for k, v in inner_post.history.items()},
            {k: v[c] for k, v in stats.items()},
        )
        for c in range(inner_post.num_chains)
    ]  # every chain: the SWA run's deterministic parameters
    config = clean_config(
        dict(
            rank=rank,
            inner=inner,
            prior=kind.value,
            prior_scale=scale if kind is SubspacePrior.ISOTROPIC else None,
            seed=seed,
            batch_size=data.batch_size,
            dataset_size=data.size,
            subspace=dict(
                rank=rank,
                subspace_dim=dict(
                    requested=subspace_dim if given else DEFAULT_SUBSPACE_DIM, used=rank, given=given, lowered=lowered
                ),
                spanned=spanned,
                rank_tolerance=tolerance,
                deviations=kept,
                singular_values=[float(s) for s in singular],
                coordinates=_coordinates(kind),
            ),
            inner_config=inner_post.config,
            swa=swa_post.config,
        )
    )
    paths.record(config, swa_post.config, inner_post.config)
    post = select_noise(assemble(runs, method="subspace", config=config, data=data), holdout)
    post = check_subspace(post, directions=directions, rank=rank, prior=kind.value, deviations=kept)
    return check_off_data(post, OFF_DATA)


def _unspanned_message(spanned: int, num_weights: int, deviations: int) -> str:
    """The warning of a default ``subspace_dim`` lowered to the ``spanned`` directions that the ``deviations`` SWA
    deviations span, of ``num_weights``. Where ``num_weights <= deviations`` the deviations could have spanned every
    weight direction, so in the others the SGD iterates did not wander beyond rounding: no training row's gradient
    reaches them, the posterior keeps its prior spread there, and a subspace of the iterates' deviations cannot hold
    it at any dimension. Where the weights outnumber the deviations, ``K`` deviations span at most ``K`` directions
    whatever the gradients do, so only the count measured is said. Said because a user reading the draws' weight sds
    (or predictions off the data) would not otherwise learn that part of the posterior is missing; a default lowered
    to the number of weights or to the deviations kept loses nothing the deviations held, and is only recorded."""
    said = (
        f"subspace: the SWA deviations span only {spanned} of the {num_weights} weight directions, so subspace_dim "
        f"is {spanned}, not the default {DEFAULT_SUBSPACE_DIM} (post.config['subspace']['subspace_dim']). "
    )
    if num_weights > deviations:
        return said + (
            f"The {deviations} deviations kept (swa=SWAGConfig(swag_rank=...)) have only {spanned} independent "
            "directions (their numerical rank): the SGD iterates wandered along no others, and every draw sits at "
            f"the SWA mean along the remaining weight directions. method='nuts' samples all {num_weights} weights."
        )
    return said + (
        f"Along the other {num_weights - spanned} the SGD iterates did not wander: no training row's gradient "
        "reaches them (e.g. the shift common to every class of a softmax, or a unit no row activates), so there the "
        "posterior keeps the prior's spread, while every draw sits at the SWA mean: post.summary()'s weight sds and "
        "any prediction that depends on those directions miss it. Subspace inference cannot hold it at any "
        f"subspace_dim; method='nuts' samples all {num_weights} weights."
    )


def _coordinates(kind: SubspacePrior) -> str:
    """What the inner engine samples (``config["subspace"]["coordinates"]``; docstring, "Inner coordinates"): under the
    induced prior the displacement along unit directions, in weight units; under the isotropic prior the paper's ``z``
    (one SWA iterate sd per unit). An inner engine's own ``lr``, ``init_scale`` or fixed ``step_size`` is in these units."""
    return "weight units" if kind is SubspacePrior.INDUCED else "z (SWA iterate sds)"


def _map_start(
    model: BNN, data: Data, swa: dict, seed: int, progress: bool, paths: Potentials, ckpt: dict
) -> dict[str, torch.Tensor]:
    """The SWA run's starting point: ``swa``'s ``pretrain_steps`` steps of its ``pretrain_optimizer`` at
    ``pretrain_lr`` (defaults 2,000, Adam, ``3e-2``) with a cosine decay, by the MAP engine on full batches
    (reshuffled epochs of ``batch_size`` rows), early-stopped on the held-out rows the SWA run will hold out
    (the same split); checkpointed with ``ckpt``'s options (:func:`_stages`; none when empty) under a run
    identity made of these settings."""
    train, holdout, _ = split(
        data, swa.get("validation", "default"), seed=seed, method="subspace", convert=data.convert, model=model
    )
    steps = positive_int("swa['pretrain_steps']", swa.get("pretrain_steps", _PRETRAIN_STEPS))
    lr, optimizer = swa.get("pretrain_lr", _PRETRAIN_LR), swa.get("pretrain_optimizer", "adam")
    identity = dict(
        method="subspace",
        stage="map",
        num_steps=steps,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        validation=swa.get("validation", "default"),
        batch_size=data.batch_size,
        dataset_size=data.size,
    )
    run = fit_map(
        model,
        train,
        init=resolve_init(model, None, train),
        num_steps=steps,
        lr=lr,
        optimizer=optimizer,
        lr_schedule="cosine",
        seed=seed,
        progress=progress,
        holdout=holdout,
        method="subspace",
        paths=paths,
        ckpt=Checkpoint(
            ckpt["checkpoint"], every=ckpt["checkpoint_every"], resume=ckpt["resume"], chain=0, run=_plain(identity)
        )
        if ckpt
        else None,
    )
    return {**run.point, **run.sample}


def _stages(checkpoint, every, resume, identity: dict) -> dict[str, dict]:
    """Each stage's checkpoint options (:data:`STAGES`; empty dicts without ``checkpoint``): its sub-folder of
    ``checkpoint`` (created), ``every`` and ``resume``. ``identity`` (this fit's settings) is written to
    ``checkpoint/subspace.ckpt``; a resume with other settings is refused before fitting."""
    if checkpoint is None:
        if every is not None or resume is not False:
            raise ValueError(
                "checkpoint_every= and resume= need checkpoint=FOLDER (the folder of the checkpoint files)."
            )
        return {stage: {} for stage in STAGES}
    folder, resume = Path(checkpoint), flag("resume", resume)
    every = None if every is None else positive_int("checkpoint_every", every)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"checkpoint: the folder {str(folder)!r} does not exist; create it first "
            "(method='subspace' writes one sub-folder per stage in it)."
        )
    run, path = json.loads(json.dumps(_plain(identity))), folder / "subspace.ckpt"
    if not resume and (path.exists() or any(any((folder / s).glob("*.ckpt")) for s in STAGES)):
        raise FileExistsError(
            f"checkpoint: {str(folder)!r} holds the checkpoints of a subspace run. Pass resume=True "
            "to continue that run, or another (empty) folder to start a new one; it is never "
            "overwritten."
        )
    if path.exists():
        saved = read(path)[1].get("run", {})
        if saved != run:
            diff = sorted(k for k in set(run) | set(saved) if run.get(k) != saved.get(k))
            raise CheckpointError(
                f"resume: {str(path)!r} belongs to another run (differs in {diff}). Resume with the "
                "same method and configuration, or pass another checkpoint folder."
            )
    else:
        write(path, {}, {"run": run})
    options = {}
    for stage in STAGES:
        (folder / stage).mkdir(exist_ok=True)
        options[stage] = dict(checkpoint=str(folder / stage), checkpoint_every=every, resume=resume)
    return options


def _plain(value):
    """``value`` as JSON for a run identity: numbers, strings, lists and dicts as they are, anything else (a
    tensor, a Posterior as ``init``) by its type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    return type(value).__name__


def _check_span(options: dict, span: dict) -> None:
    """Record the subspace's dimension used and the directions spanned (``span``) in ``subspace.ckpt`` on a first
    run, and refuse a resume that counts others, naming them (no-op without a checkpoint, ``options`` empty).

    Why: both are counted from the SWA deviations after the SWA stage, so the identity :func:`_stages` checks
    before fitting holds only the dimension requested; a resume on another device, or of a checkpoint written by a
    version that counted otherwise, could build a subspace of another dimension and fail deep inside the inner
    engine's checkpoint. A checkpoint without this record (written before it existed) used the dimension its
    identity names, which is compared once its inner stage has begun."""
    if not options:
        return
    inner = Path(options["checkpoint"])
    path = inner.parent / "subspace.ckpt"
    meta = read(path)[1]
    saved = meta.get("span")
    if saved is None and any(inner.glob("*.ckpt")):
        saved = {"rank": meta.get("run", {}).get("rank")}
    if saved is None:
        write(path, {}, {**meta, "span": span})
        return
    diff = sorted(k for k in saved if saved[k] != span.get(k))
    if diff:
        raise CheckpointError(
            f"resume: {str(path)!r} belongs to another run (differs in {diff}: the subspace's dimension "
            f"subspace_dim and the directions the SWA deviations span, here {span}, there {saved}). They are "
            "counted anew from the SWA deviations, and the count can differ on another device or in another "
            "bnn_pyro version; resume where the checkpoint was written, or pass another checkpoint folder."
        )
