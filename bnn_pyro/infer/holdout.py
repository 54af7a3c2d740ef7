"""Held-out validation inside a fit: the split, early stopping, and the observation noise chosen where it
is identifiable.

Engines that start from a point fit (a MAP: ensembles, Laplace, SWA/SWAG, MC dropout) cannot learn the
observation noise from the training data: an over-parameterized net fits the training targets far better
than it predicts new ones, and the noise that maximizes the training likelihood is then the training
residual, not the test error (UCI Boston, split 0: a MAP noise sd of 0.7-0.9 against a test RMSE of
2.8-3.7, and test log-likelihoods of -4 to -11 nats per point where NUTS gets -2.3). Held-out data make it
identifiable. With ``validation=`` (the default ``0.1``, at least :data:`MIN_ROWS` rows, for those engines):

1. :func:`split` keeps a random ``validation`` fraction of the training rows aside (:func:`default_rows`) (seeded by the fit's
   ``seed``; the same rows for every chain or member); the engine fits on the rest.
2. :class:`BestOnHoldout` scores the point fit on the held-out rows every ``every`` steps
   (:func:`heldout_score`) and keeps the best state (early stopping; Prechelt 1998). The training budget
   (``num_steps``) stays an upper bound; ``patience`` evaluations without improvement end it early.
3. :func:`select_noise` sets a learned Gaussian noise (a ``"sigma"`` or ``"precision"`` site) to the value
   that maximizes the held-out log predictive density of the *fitted predictive* (every draw's network
   output, the engine's own spread included): ``sigma* = argmax_s mean_n log (1/S) sum_k N(y_n | f_k(x_n),
   s)``, one scalar for all draws, found on a log grid. The draws' noise sites are replaced by it and
   ``post.config["noise"]`` records how it was chosen.

4. :func:`refit` then fits again on *every* training row with what was chosen (the published protocols'
   last step, e.g. Hernandez-Lobato & Adams 2015, Gal & Ghahramani 2016): the stopping point scaled to the
   full data (the same number of epochs: ``steps * ceil(N_all / B) / ceil(N_train / B)`` for minibatches of
   ``B`` rows, the same number of steps for full-batch training) on the learning-rate schedule of the run that
   chose, and the chosen noise. The schedule is laid over that run's whole budget (its ``num_steps``, SWA/SWAG's
   ``pretrain_steps``, scaled the same way: the *horizon*) and the refit stops at the chosen step
   (:meth:`Chosen.schedule`, :class:`~bnn_pyro.infer.optim.Horizon`), so it reproduces the state the held-out
   rows scored, on all rows; a schedule laid over the chosen steps alone would anneal the default cosine to 1%
   of ``lr`` by then, a far less trained fit than the one scored (two moons, 400 rows, members stopped near step
   100 of 1,000: test accuracy 0.910 against 0.957 on the scored schedule;
   ``benchmarks/results/holdout_choice/truncated.md``). A user's ``"constant"`` schedule is the same either way,
   ``"exponential"`` decays over the horizon, and a callable ``lr_schedule`` sets its own horizon (it is stepped
   as in the run that chose). csgmcmc and snapshot rerun their whole cyclical plan and replay each stage's stop
   (``stops``), which is their scored run's schedule already. The posterior returned is the refit;
   ``post.config["validation"]["chosen"]`` records what the held-out rows chose (``num_steps``, the stop, and
   ``horizon``; ``sigma``; ``stops``) and ``["final_fit_rows"]`` that the final fit used all rows. Without the
   refit the posterior is fitted on 90% of the rows: on Bayesian linear regression with 200 rows, Laplace's mean
   sat 2.6 posterior sd off the exact one.

The cost: a second fit (on all rows, without scoring), and a forward pass over the held-out rows per
evaluation of the first. ``validation=None`` turns it all off (the noise is then the engine's own estimate, e.g.
the MAP's); ``validation=(x_val, y_val)`` uses given held-out data and trains on every training row. A
known noise (``Gaussian(scale=0.1)``) is the user's setting and is never changed; a heteroscedastic
likelihood's noise is a network output and is left to the early-stopped fit.

The default holds out 10% of tensor data, and for a model with a learned Gaussian noise at least
:data:`MIN_ROWS` rows (:func:`default_rows`: the fraction ``max(0.1, MIN_ROWS / N)``, so every ``N`` from
``2 * MIN_ROWS`` to 199 holds out ``MIN_ROWS``; without a noise to choose, nothing below ``N = 200``). Small
data need it most: a net that nearly interpolates ~100 rows drives a MAP's noise to its training residual
(friedman1, 90 rows: Laplace's noise sd ~0, a test log-likelihood of -1e7 per point; the ensemble's 0.08, -190 to
-410; ``benchmarks/results/uci/small_data_noise.md``), and the refit gives the held-out rows back. Below
``2 * MIN_ROWS`` rows (``MIN_ROWS`` held out would leave fewer to train on), or for a loader of batches (rows
cannot be set aside from a stream), the fit runs on all rows and ``post.config["validation"]`` says why; with a
learned Gaussian noise on such small tensor data a fit-time ``DiagnosticWarning``
(:func:`~bnn_pyro.infer._health.check_training_noise`) says the noise will be the training residual and what
to pass instead. An explicit fraction that leaves fewer than :data:`MIN_ROWS` rows on either side is an error.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pyro.distributions as dist
import torch
from pyro import poutine

from bnn_pyro.infer._common import Data, quiet_model
from bnn_pyro.infer.optim import Horizon
from bnn_pyro.likelihoods import HALF_LOG_2PI

__all__ = [
    "Holdout",
    "split",
    "heldout_score",
    "BestOnHoldout",
    "select_noise",
    "maximize_on_log_grid",
    "DEFAULT",
    "MIN_ROWS",
    "default_rows",
    "Chosen",
    "chosen",
    "refit",
    "scaled_steps",
    "refit_config",
]

DEFAULT = 0.1  # the held-out fraction of the training rows for the engines that use one by default
MIN_ROWS = 20  # fewer held-out rows make early stopping and the noise estimate too noisy (sd of a noise sd ~1/sqrt(2n))


@dataclass(frozen=True)
class Holdout:
    """Held-out rows (``x``, ``y``) and, when they were split off the training data, their ``rows``."""

    x: torch.Tensor
    y: torch.Tensor
    rows: torch.Tensor | None = None
    of: int | None = None  # the number of training rows ``rows`` were split from

    @property
    def size(self) -> int:
        return self.x.shape[0]


def default_rows(n: int, fraction: float = DEFAULT) -> int:
    """The rows the default holds out of ``n`` for a model with a learned Gaussian noise: ``round(fraction * n)``,
    raised to :data:`MIN_ROWS` where that leaves at least :data:`MIN_ROWS` to train on (``N >= 2 * MIN_ROWS``): the
    fraction ``max(fraction, MIN_ROWS / N)``. On small data a net interpolates its training rows, so a noise learned
    without held-out rows is the training residual, far below the test error; :data:`MIN_ROWS` held-out rows
    identify it (then the refit on all rows, :func:`refit`, gives the rows back). Without a noise to choose the
    default keeps ``round(fraction * n)`` (none below ``MIN_ROWS``): early stopping alone on fewer rows is too
    noisy to pay for them."""
    rows = int(round(fraction * n))
    return MIN_ROWS if rows < MIN_ROWS <= n - MIN_ROWS else rows


def split(
    data: Data, validation, *, seed: int, method: str, convert=None, default=DEFAULT, model=None
) -> tuple[Data, Holdout | None, str | None]:
    """``(train, holdout, reason)``: the data to fit on, the held-out rows (or ``None``) and, when none are
    held out under the default, why (for ``post.config``).

    ``validation`` is a fraction in ``(0, 0.5]``, ``None``/``0`` (no held-out rows), the engine's default
    (``default`` is passed by the engine, ``"default"`` marks it: :func:`default_rows` rows when ``model`` learns a
    Gaussian noise), or an ``(x_val,
    y_val)`` pair. ``convert(x, y)`` checks and converts a given pair as the training data were. When the default
    holds nothing out of tensor data (fewer than ``2 * MIN_ROWS`` rows) and ``model`` learns a Gaussian noise,
    :func:`~bnn_pyro.infer._health.check_training_noise` warns that the noise will be the training residual.
    """
    is_default = isinstance(validation, str) and validation == "default"
    if is_default:
        validation = default
    if validation is None or validation is False or (isinstance(validation, (int, float)) and validation == 0):
        return data, None, None
    if isinstance(validation, (tuple, list)):
        if len(validation) != 2:
            raise ValueError(
                f"validation: expected a fraction such as 0.1, None, or an (x_val, y_val) pair, got a "
                f"{type(validation).__name__} of {len(validation)}."
            )
        x, y = convert(*validation) if convert is not None else validation
        if x.shape[0] < 1:
            raise ValueError("validation: the (x_val, y_val) pair holds no rows.")
        return data, Holdout(x, y), None
    if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0.0 < validation <= 0.5:
        raise ValueError(
            f"validation: expected a fraction in (0, 0.5] of the training rows to hold out (e.g. 0.1), "
            f"None to hold none out, or an (x_val, y_val) pair; got {validation!r}."
        )
    if data.loader is not None:
        if is_default:
            return data, None, "a loader of batches: no rows set aside (pass validation=(x_val, y_val))"
        raise ValueError(
            f"validation={validation}: rows cannot be set aside from a loader of batches; pass "
            f"validation=(x_val, y_val) with held-out tensors, or validation=None."
        )
    n = data.x.shape[0]
    noise = noise_site(model) is not None
    rows = default_rows(n, validation) if is_default and noise else int(round(validation * n))
    if rows < MIN_ROWS or n - rows < MIN_ROWS:
        if is_default:
            reason = (
                f"{n} rows: fewer than {2 * MIN_ROWS}, so {MIN_ROWS} cannot be held out and {MIN_ROWS} kept"
                if noise
                else f"{n} rows and no learned Gaussian noise: fewer than {MIN_ROWS} would be held out"
            )
            if noise:
                from bnn_pyro.infer._health import check_training_noise

                check_training_noise(method, n, rows=MIN_ROWS)
            return data, None, reason
        raise ValueError(
            f"validation={validation}: {n} training rows give {rows} held-out rows, fewer than "
            f"{MIN_ROWS}; hold out a larger fraction, pass validation=(x_val, y_val), or None."
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    held, kept = perm[:rows].sort().values, perm[rows:].sort().values
    held_d, kept_d = held.to(data.x.device), kept.to(data.x.device)
    train = Data(x=data.x[kept_d], y=data.y[kept_d], batch_size=data.batch_size)
    return train, Holdout(data.x[held_d], data.y[held_d], held, n), None


def describe(holdout: Holdout | None, fraction, reason: str | None) -> dict:
    """The JSON-friendly ``post.config["validation"]`` entry: the rows held out and, for rows split off the training
    data, the fraction actually held out (``rows / N``, 4 decimals). Where :func:`default_rows` raised the rows above
    the requested ``fraction`` (small data with a learned noise: at least :data:`MIN_ROWS`), the requested fraction
    too, as ``"requested_fraction"``, so the record never states a fraction that was not used."""
    if holdout is None:
        return {"rows": 0, **({"reason": reason} if reason else {})}
    if holdout.rows is None:
        return {"rows": holdout.size, "source": "given"}
    out = {"rows": holdout.size, "source": "split", "fraction": fraction}
    if holdout.of:
        out["fraction"] = round(holdout.size / holdout.of, 4)
        if isinstance(fraction, (int, float)) and holdout.size != int(round(fraction * holdout.of)):
            out["requested_fraction"] = fraction
    return out


# ---------------------------------------------------------------------------------------------- scoring
def _observation(model, values: dict[str, torch.Tensor], x, y) -> dist.Distribution:
    """``p(y | x, values)``: the model run once with its latent sites fixed at ``values``."""
    with torch.no_grad():  # checks off: the rows were checked when the fit started
        trace = poutine.trace(poutine.condition(quiet_model(model, None), data=values)).get_trace(x, y)
    return trace.nodes["obs"]["fn"]


def heldout_score(model, values: dict[str, torch.Tensor], holdout: Holdout) -> float:
    """Mean held-out log-likelihood per row of the point fit ``values`` (constrained site values).

    For a Normal observation model the noise is profiled out: the scale of every row is multiplied by the
    common factor ``c`` that maximizes the held-out likelihood (``c^2 = mean(((y - loc) / scale)^2)``), so
    the score ranks fits by their held-out standardized error, not by a noise estimate that overfits along
    with them. Other likelihoods (classification) are scored as they are.
    """
    fn = _observation(model, values, holdout.x, holdout.y)
    base = fn
    while isinstance(base, (dist.Independent, dist.MaskedDistribution)):
        base = base.base_dist
    y = holdout.y
    if isinstance(base, dist.Normal):
        loc, scale = base.loc, base.scale
        z2 = ((y.reshape(loc.shape) - loc) / scale).double().pow(2)
        c2 = z2.mean()
        ll = -HALF_LOG_2PI - 0.5 * (torch.log(c2) + 1.0) - torch.log(scale.double()).expand_as(z2).mean()
        return float(ll) * (z2.numel() / y.shape[0])
    return float(fn.log_prob(y).double().sum()) / y.shape[0]


class BestOnHoldout:
    """Early stopping: score every ``every`` steps, keep the best state, stop after ``patience`` scores
    without improvement.

    >>> best = BestOnHoldout(every=50, patience=20)
    >>> for step in range(num_steps):
    ...     ...  # one optimizer step
    ...     if best.due(step) and best.record(step, heldout_score(model, values, holdout), state):
    ...         break
    >>> state = best.state           # the best state seen (a deep copy)
    """

    def __init__(self, every: int = 50, patience: int | None = 20):
        self.every, self.patience = int(every), patience
        self.best_score, self.best_step, self.state = -math.inf, -1, None
        self.scores: list[tuple[int, float]] = []
        self._since = 0

    def due(self, step: int) -> bool:
        return step % self.every == self.every - 1

    def record(self, step: int, score: float, state) -> bool:
        """Record ``score`` at ``step``; returns True when patience has run out (stop now)."""
        self.scores.append((step, score))
        if score > self.best_score or self.state is None:
            self.best_score, self.best_step, self.state = score, step, copy.deepcopy(state)
            self._since = 0
        else:
            self._since += 1
        return self.patience is not None and self._since >= self.patience

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """For a checkpoint: the best state (a list of tensors) as tensors, the rest as JSON."""
        state = {} if self.state is None else {str(i): t for i, t in enumerate(self.state)}
        return state, {
            "best_score": self.best_score,
            "best_step": self.best_step,
            "scores": self.scores,
            "since": self._since,
            "has_state": self.state is not None,
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.best_score, self.best_step, self._since = meta["best_score"], meta["best_step"], meta["since"]
        self.scores = [tuple(s) for s in meta["scores"]]
        self.state = [tensors[str(i)].clone() for i in range(len(tensors))] if meta["has_state"] else None


# --------------------------------------------------------------------------------------- noise selection
def noise_site(model) -> str | None:
    """The learned homoscedastic Gaussian noise site of a ``BNN`` (``"sigma"`` or ``"precision"``), else None."""
    from bnn_pyro.likelihoods import Gaussian
    from bnn_pyro.model import BNN

    if not isinstance(model, BNN) or type(model.likelihood) is not Gaussian:
        return None
    sites = model.likelihood.sites()
    return next(iter(sites), None)


def maximize_on_log_grid(objective, center: torch.Tensor) -> tuple[float, float]:
    """``(s*, objective(s*))`` for a scalar ``s > 0``: ``objective`` maps a 1-D float64 tensor of candidates to
    their values. A log grid over ``[1e-3, 10] * center`` (121 points), then two refinements between the best
    point's neighbours (21 points each): a final spacing of ~1e-3 in ``log s``."""
    on = dict(dtype=torch.float64, device=center.device)  # the candidates live where ``objective``'s data do
    log_s = torch.linspace(math.log(1e-3), math.log(10.0), 121, **on) + torch.log(center.double())
    for _ in range(3):
        values = objective(log_s.exp())
        i = int(values.argmax())
        best = (float(log_s[i].exp()), float(values[i]))
        log_s = torch.linspace(float(log_s[max(i - 1, 0)]), float(log_s[min(i + 1, len(log_s) - 1)]), 21, **on)
    return best


def _best_scale(f: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(sigma*, lpd)``: the noise sd maximizing the mean log predictive density of the equal mixture
    ``(1/S) sum_s N(y | f_s, sigma)``, ``f`` shaped ``(S, N, ...)``, and that density; searched around the
    residual sd of the mixture mean (:func:`maximize_on_log_grid`)."""
    f, y = f.double(), y.double().reshape(f.shape[1:])

    def lpd(sigmas):
        out = torch.empty_like(sigmas)
        for i, s in enumerate(sigmas):
            lp = dist.Normal(f, s).log_prob(y)  # (S, N, ...)
            lp = lp.reshape(lp.shape[0], lp.shape[1], -1).sum(-1)
            out[i] = (torch.logsumexp(lp, 0) - math.log(f.shape[0])).mean()
        return out

    return maximize_on_log_grid(lpd, (y - f.mean(0)).pow(2).mean().sqrt().clamp_min(1e-12))


def select_noise(post, holdout: Holdout | None):
    """Replace the learned Gaussian noise of ``post`` (all draws) by the value that maximizes the held-out
    log predictive density of its predictive, in place; returns ``post``. A no-op without held-out rows,
    for a known noise and for non-Gaussian likelihoods."""
    site = noise_site(post.model) if holdout is not None else None
    if site is None or site not in post.samples:
        return post
    d = post.observation_distribution(holdout.x)
    base = d.base_dist if isinstance(d, dist.Independent) else d
    sigma, lpd = _best_scale(base.loc, holdout.y)
    support = post.model.likelihood.sites()[site].support
    value = post.samples[site].new_tensor(sigma if site == "sigma" else sigma**-2.0)
    if not bool(support.check(value)):
        return post  # a prior that cannot hold it (e.g. a Uniform noise prior): keep the engine's estimate
    before = post.samples[site]
    post.samples[site] = torch.full_like(before, float(value))
    # the density q recorded at each draw (for post.psis) no longer describes draws whose noise was replaced
    post.sample_stats = {k: v for k, v in post.sample_stats.items() if k != "log_q"}
    post.config["noise"] = {
        "selected_on": "validation",
        site: float(value),
        "sigma": sigma,
        "heldout_lpd": lpd,
        "engine_sigma_median": float((before if site == "sigma" else before.rsqrt()).median()),
    }
    return post


# ------------------------------------------------------------------------------------ refit on all rows
@dataclass(frozen=True)
class Chosen:
    """What held-out rows chose for the refit on all rows (:func:`refit`).

    ``num_steps``: the stopping point scaled to all rows (:func:`scaled_steps` of the median over chains of
    ``best_step + 1``: the engines take one ``num_steps`` for all chains; the pre-training steps of SWA/SWAG),
    ``None`` where the engine recorded none. ``horizon``: the budget of the run that chose (the length of its
    learning-rate schedule: ``num_steps``, SWA/SWAG's ``pretrain_steps``) scaled to all rows the same way, ``None``
    with no ``num_steps``; the refit lays its schedule over it and stops at ``num_steps`` (:meth:`schedule`).
    ``sigma``: the chosen noise sd per chain (one value repeated for engines that choose one for all draws),
    ``None`` without a learned Gaussian noise. ``stops``: per chain, the step of each noise-free stage's kept state
    (csgmcmc's exploration stages, snapshot's cycles), else ``None``."""

    num_steps: int | None
    sigma: list[float] | None
    stops: list[list[int]] | None = None
    horizon: int | None = None

    def schedule(self, schedule):
        """``schedule`` (an ``lr_schedule=`` value) as the refit runs it: laid over :attr:`horizon` and stopped at
        :attr:`num_steps` (:class:`~bnn_pyro.infer.optim.Horizon`), so the refit's rates are the first
        ``num_steps`` rates of the run that chose and it reproduces the state the held-out rows scored (a schedule
        laid over the chosen steps alone would anneal to 1% of ``lr`` by then: a less trained fit). ``schedule``
        itself where the two coincide or nothing was chosen."""
        if self.horizon is None or self.num_steps is None or self.horizon == self.num_steps:
            return schedule
        return Horizon(getattr(schedule, "schedule", schedule), self.horizon)

    def record(self) -> dict:
        """The JSON-friendly ``post.config["validation"]["chosen"]`` entry: ``num_steps`` (the stop) and
        ``horizon`` (the schedule's length it stopped in), ``sigma``, ``stops``."""
        out = {}
        if self.num_steps is not None:
            out["num_steps"] = self.num_steps
        if self.horizon is not None:
            out["horizon"] = self.horizon
        if self.sigma is not None:
            out["sigma"] = self.sigma[0] if len(set(self.sigma)) == 1 else list(self.sigma)
        if self.stops is not None:
            out["stops"] = [list(s) for s in self.stops]
        return out


def scaled_steps(steps: int, *, rows_train: int, rows_all: int, batch_size: int | None) -> int:
    """``steps`` on ``rows_train`` rows as the same number of epochs on ``rows_all`` rows: unchanged for
    full-batch training (a step is an epoch), ``steps * ceil(rows_all / B) / ceil(rows_train / B)`` (rounded)
    for minibatches of ``B`` rows."""
    if not steps or not batch_size or batch_size >= rows_all:
        return int(steps)
    per_epoch = math.ceil(rows_all / batch_size) / math.ceil(rows_train / batch_size)
    return max(1, int(round(steps * per_epoch)))


def chosen(post, budget: str = "num_steps", batch_size=...) -> Chosen:
    """What the held-out rows of the fit ``post`` chose: its ``history["best_step"]`` (early stopping) and its
    ``config[budget]`` (the run's length, its schedule's horizon) scaled to all rows for minibatches of
    ``batch_size`` rows (``...``: ``config["batch_size"]``; ``None``: full batch), its
    ``history["exploration_stop"]`` (per-stage stops), and its noise (``config["noise"]``)."""
    rows_all = int(post.x.shape[0])
    rows_train = rows_all - int(post.config["validation"]["rows"])
    batch_size = post.config.get("batch_size") if batch_size is ... else batch_size
    scale = dict(rows_train=rows_train, rows_all=rows_all, batch_size=batch_size)
    steps = horizon = None
    if "best_step" in post.history:
        best = post.history["best_step"].reshape(post.history["best_step"].shape[0], -1)[:, -1].double() + 1
        steps = scaled_steps(int(best.median().round()), **scale)
        if isinstance(post.config.get(budget), int):
            horizon = max(steps, scaled_steps(post.config[budget], **scale))
    stops = None
    if "exploration_stop" in post.history:
        stops = [
            [int(t) for t in row]
            for row in post.history["exploration_stop"].reshape(post.history["exploration_stop"].shape[0], -1)
        ]
    noise = post.config.get("noise")
    sigma = None
    records = noise if isinstance(noise, list) else [noise] * post.num_chains if noise else []
    if records and all(r.get("selected_on") == "validation" for r in records):
        sigma = [float(r["sigma"]) for r in records]
    return Chosen(num_steps=steps, sigma=sigma, stops=stops, horizon=horizon)


def refit(post, fit_again: Callable[[Chosen], object], *, budget: str = "num_steps", batch_size=...):
    """The posterior to return after a fit that chose things on held-out rows split off the training rows:
    ``fit_again(chosen(post, budget, batch_size))``, the same engine on every row (no rows held out) with the
    stopping point, the schedule of the run that chose (:meth:`Chosen.schedule`; ``budget`` names the config entry
    of its length, ``batch_size`` the rows per step of the phase scored, by default ``config["batch_size"]``) and
    the noise chosen, its draws' learned noise set to the chosen value (as :func:`select_noise` did); ``post``
    itself when no rows were split off (none held out, or a given ``(x_val, y_val)`` pair: every training row
    was fitted already). ``config["validation"]`` keeps the split's record and adds ``"chosen"`` and
    ``"final_fit_rows"``; ``config["noise"]`` keeps the choice's record."""
    described = post.config.get("validation") or {}
    if not described.get("rows") or described.get("source") != "split" or post.x is None:
        return post
    choice = chosen(post, budget, batch_size)
    final = fit_again(choice)
    noise = post.config.get("noise")
    site = noise_site(final.model)
    if choice.sigma is not None and site is not None and site in final.samples:
        values = [s if site == "sigma" else s**-2.0 for s in choice.sigma]
        drawn = final.samples[site]
        target = drawn.new_tensor(values).reshape(-1, *([1] * (drawn.dim() - 1))).expand_as(drawn).clone()
        if not torch.allclose(drawn, target):  # an engine that does not take the noise in: set it, as select_noise
            final.samples[site] = target
            final.sample_stats = {k: v for k, v in final.sample_stats.items() if k != "log_q"}
        final.config["noise"] = noise
    final.config["validation"] = {**described, "chosen": choice.record(), "final_fit_rows": int(post.x.shape[0])}
    return final


def refit_config(
    cfg,
    choice: Chosen | None = None,
    *,
    steps: str | None = "num_steps",
    schedule: str | None = "lr_schedule",
    **options,
):
    """An engine config (a :class:`~bnn_pyro.infer.contract.RunOptions` dataclass) for the refit on all rows: no
    rows held out, no checkpoint (the refit is recomputed from the fit that chose; a resumed run resumes that
    fit, then refits), the ``choice``'s stop as the option named ``steps`` and its schedule (the option named
    ``schedule`` laid over the horizon of the run that chose: :meth:`Chosen.schedule`), and ``options``; options
    given as ``None`` keep the config's value."""
    chosen_options = {}
    if choice is not None and steps is not None:
        chosen_options[steps] = choice.num_steps
    if choice is not None and schedule is not None:
        chosen_options[schedule] = choice.schedule(getattr(cfg, schedule))
    return replace(
        cfg,
        validation=None,
        checkpoint=None,
        checkpoint_every=None,
        resume=False,
        **{k: v for k, v in {**chosen_options, **options}.items() if v is not None},
    )
