"""``Posterior``: the one object every inference engine returns.

Draws are a ``dict[name, Tensor]`` shaped ``(chains, draws, *shape)`` over every latent site of the
model (weights, hyper sites, likelihood noise). Methods without chains (SVI, Laplace, SWAG) draw from
their approximation, and independent restarts become chains, so chain diagnostics apply to them too.

Example
-------
>>> post = bp.fit(model, x, y, method="svi", guide="low_rank", num_steps=2000, seed=0)
>>> post.samples["0.weight"].shape            # (chains, draws, 50, 1)
>>> pred = post.predict(x_test)                # mean, std, epistemic_std, aleatoric_std, lower, upper
>>> draws = post.sample(100, seed=1)           # dict of (100, *shape)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from bnn_pyro import predictions
from bnn_pyro.model import BNN, check_model_data, fit_attributes
from bnn_pyro.posterior import posterior_file
from bnn_pyro.posterior.linearized import linearized_outputs
from bnn_pyro.predictive_draws import NetworkDraws, Observation
from bnn_pyro.utils.checks import match_columns, positive_int, probability
from bnn_pyro.utils.checks import seed as check_seed
from bnn_pyro.utils.targets import base_distribution

__all__ = ["Posterior"]


@dataclass
class Posterior:
    """Draws from a posterior (or its approximation) plus everything needed to use them.

    Attributes
    ----------
    samples:
        Latent site name -> draws shaped ``(chains, draws, *shape)``.
    model:
        The fitted model (a :class:`~bnn_pyro.BNN` or a Pyro function); deterministic parameters of
        a ``BNN`` hold their fitted values (those of the last chain; see ``point``).
    method:
        The engine's name, e.g. ``"svi"``.
    config:
        The engine's configuration (JSON-friendly values).
    point:
        Deterministic (point-estimated) parameters per chain, shaped ``(chains, *shape)``.
    sample_stats:
        Per-draw statistics shaped ``(chains, draws)`` (divergences, step size, ...; for svi, laplace and
        swag ``log_q``, the approximation's log density at each draw, read by :meth:`psis`).
    history:
        Per-step traces of the fit shaped ``(chains, steps)``, e.g. ``"loss"`` (the negative ELBO),
        and per-chain end states (NUTS/HMC: ``"inverse_mass_matrix"``, for extending the chains).
    draw_buffers:
        Per-draw buffers of a ``BNN`` shaped ``(chains, draws, *shape)``: BatchNorm running
        statistics recomputed for each draw (SWA, SWAG). Empty: every draw uses the model's own.
    feature_names:
        The column names of a pandas ``DataFrame`` ``x`` the fit was given (``None`` for arrays and tensors):
        a ``DataFrame`` given to :meth:`predict` (and the other methods that take ``x``) is matched to them by
        name, so its columns may come in any order, and a missing or unexpected column is an error.
    x, y:
        The training data (``None`` when the fit streamed batches from a loader); used for
        pointwise log-likelihoods, LOO and function-space diagnostics.
    """

    samples: dict[str, torch.Tensor]
    model: BNN | Callable
    method: str
    config: dict[str, Any] = field(default_factory=dict)
    point: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    history: dict[str, torch.Tensor] = field(default_factory=dict)
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    draw_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    feature_names: list[str] | None = None

    # ------------------------------------------------------------------ shapes
    @property
    def num_chains(self) -> int:
        return next(iter(self.samples.values())).shape[0]

    @property
    def num_draws(self) -> int:
        return next(iter(self.samples.values())).shape[1]

    def __repr__(self) -> str:
        sites = ", ".join(f"{k}{tuple(v.shape[2:])}" for k, v in list(self.samples.items())[:6])
        more = "" if len(self.samples) <= 6 else f", ... ({len(self.samples)} sites)"
        return f"Posterior(method={self.method!r}, chains={self.num_chains}, draws={self.num_draws}, sites=[{sites}{more}])"

    # ------------------------------------------------------------------ draws
    def draw_index(self, num_samples: int | None = None, seed: int | None = None) -> torch.Tensor:
        """Indices of pooled draws (chain-major, ``chain * num_draws + draw``): all of them in order without
        ``num_samples``; else ``num_samples`` picked at random (without replacement while there are enough)
        by a generator seeded by ``seed``. :meth:`sample`, :meth:`predict` and the metrics use it."""
        total = self.num_chains * self.num_draws
        if seed is not None:
            seed = check_seed("seed", seed)
        if num_samples is None:
            return torch.arange(total)
        num_samples = positive_int("num_samples", num_samples)
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        if num_samples <= total:
            return torch.randperm(total, generator=g)[:num_samples].sort().values
        return torch.randint(total, (num_samples,), generator=g)

    def sample(self, num_samples: int | None = None, *, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Draws pooled over chains: ``dict[name, Tensor (num_samples, *shape)]``.

        Without ``num_samples`` every stored draw is returned in order; with it, draws are picked at
        random (without replacement while there are enough) with a generator seeded by ``seed``.
        """
        idx = self.draw_index(num_samples, seed)
        return {k: v.reshape((-1,) + v.shape[2:])[idx] for k, v in self.samples.items()}

    _draw_index = draw_index  # its name before it was public

    def point_per_draw(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Deterministic parameters (their chain's values) and per-draw buffers of pooled draws ``idx``."""
        chain = torch.div(idx, self.num_draws, rounding_mode="floor")
        values = {k: v[chain] for k, v in self.point.items()}
        values.update({k: v.reshape((-1,) + v.shape[2:])[idx] for k, v in self.draw_buffers.items()})
        return values

    # ------------------------------------------------------------------ prediction
    def predict(
        self,
        x,
        *,
        num_samples: int | None = None,
        interval: float | None = 0.95,
        seed: int | None = None,
        draws_per_chunk: int | None = None,
        weights: torch.Tensor | None = None,
        points_per_chunk: int | None = None,
    ):
        """Posterior predictive summary at ``x``, in memory bounded by a chunk size, not by draws x points.

        Returns a :class:`~bnn_pyro.predictions.RegressionPrediction` (``mean``, ``std``,
        ``epistemic_std``, ``aleatoric_std``, ``lower``/``upper`` of the central ``interval``,
        ``draws``, ``mean_draws``) or a :class:`~bnn_pyro.predictions.ClassificationPrediction` (``probs``,
        ``predicted``, ``entropy``, ``aleatoric_entropy``, ``mutual_information``, ``draws``), by the likelihood's task.

        Every statistic is computed over blocks of ``points_per_chunk`` rows of ``x`` (all draws of a block at
        once: a row's statistics depend on its draws only, so they equal the unchunked computation). Default:
        as many rows as keep one block's per-draw network outputs near 32 MB
        (:data:`~bnn_pyro.predictive_draws.CHUNK_BYTES`), e.g. 8,388 rows for 1,000 draws of one float32
        output; lower it to lower the peak memory. Within a block the net runs ``draws_per_chunk`` draws at a time
        (default: :meth:`BNN.draws_per_chunk`, at most 64; for a stack of Linear layers the rows too,
        :meth:`BNN.points_per_chunk`), and the mean, sd and epistemic/aleatoric split are accumulated chunk of
        draws by chunk (Chan's pairwise combine, :class:`~bnn_pyro.predictive_draws.DrawMoments`): one pass, no
        draws x rows array. ``lower``/``upper`` are computed when first read (another pass over the
        net: quantiles of predictive samples, block by block); ``interval=None`` (regression): no interval.
        ``draws``/``mean_draws`` (``S x N`` values) are produced again when first read, from the same
        predictive samples as the interval: a prediction keeps references to this posterior and ``x``, not
        per-draw arrays.

        ``num_samples`` limits the number of posterior draws used (all by default); ``seed`` seeds their choice
        and the predictive samples of ``y`` (default: a seed drawn from torch's global generator).
        ``weights`` (one non-negative number per stored draw, ``(chains, draws)``, e.g. :meth:`psis`'s) reweights
        the draws: ``num_samples`` (default: as many as stored) are picked by systematic resampling
        (:func:`bnn_pyro.posterior.psis.resample`).
        """
        x = self.inputs(x)
        if interval is not None:
            interval = probability("interval", interval, suggestion="try 0.95 for a central 95% interval, or None")
        if points_per_chunk is not None:
            points_per_chunk = positive_int("points_per_chunk", points_per_chunk)
        if seed is not None:
            seed = check_seed("seed", seed)
        if weights is None:
            idx = self.draw_index(num_samples, seed)
        else:
            from bnn_pyro.posterior.psis import resample

            total = self.num_chains * self.num_draws
            if torch.as_tensor(weights).numel() != total:
                raise ValueError(
                    f"weights: expected one per stored draw ({self.num_chains} chains x {self.num_draws} "
                    f"draws = {total}), got {torch.as_tensor(weights).numel()}; e.g. post.psis().weights."
                )
            idx = resample(
                weights, total if num_samples is None else positive_int("num_samples", num_samples), seed=seed
            )
        base_seed = int(torch.randint(2**62, ())) if seed is None else seed
        if not isinstance(self.model, BNN):  # a Pyro function model: one trace per draw, arrays in memory
            state = torch.get_rng_state()
            torch.manual_seed(base_seed)  # every device's generator, as the traces sample wherever the model runs
            try:
                with torch.no_grad():
                    return self._predict_traced(x, idx, interval)
            finally:
                torch.set_rng_state(state)
        task = self.model.likelihood.task
        source = self.predictive_draws(
            x, idx, seed=base_seed, draws_per_chunk=draws_per_chunk, points_per_chunk=points_per_chunk
        )
        with torch.no_grad():
            return predictions.summarize(source, task, interval=interval)

    def predictive_draws(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        *,
        seed: int = 0,
        draws_per_chunk: int | None = None,
        points_per_chunk: int | None = None,
        linearized: bool = True,
    ) -> NetworkDraws:
        """The per-draw predictive quantities of a :class:`~bnn_pyro.BNN` at (checked) ``x`` for pooled draws
        ``idx``, produced block by block (:class:`~bnn_pyro.predictive_draws.NetworkDraws`): what
        :meth:`predict` summarizes and what :meth:`network_outputs` and :meth:`observation_distribution` return
        whole."""
        if draws_per_chunk is not None:
            draws_per_chunk = positive_int("draws_per_chunk", draws_per_chunk)
        likelihood = self.model.likelihood
        noise = {
            n: self.samples[n].reshape((-1,) + self.samples[n].shape[2:])[idx].unsqueeze(1) for n in likelihood.sites()
        }
        observe = Observation(likelihood, noise)
        probs = likelihood.probs if likelihood.task == "classification" else None
        glm = None
        if linearized and self.config.get("predictive") == "glm":  # a Laplace fit's linearized network
            glm = partial(linearized_outputs, self)
        return NetworkDraws(
            self,
            x,
            idx,
            seed=seed,
            draws_per_chunk=draws_per_chunk,
            points_per_chunk=points_per_chunk,
            linearized=glm,
            observe=observe,
            probs_of=probs,
        )

    def inputs(self, x):
        """``x`` checked and converted as the fit converted its training inputs (a ``DataFrame``'s columns matched to
        :attr:`feature_names` by name; as many dimensions as the training inputs; the model's device and
        float dtype; token ids kept integer, :mod:`bnn_pyro.inputs`), with a clear error for inputs the net
        cannot take (found without computation)."""
        x = check_model_data(self.model, match_columns(x, self.feature_names))[0]
        fitted = self.x if isinstance(self.x, torch.Tensor) and isinstance(self.model, BNN) else None
        if fitted is not None and isinstance(x, torch.Tensor) and x.dim() != fitted.dim():
            raise ValueError(  # a net that maps any rank (an MLP on (N, 1, d)) would answer another question
                f"x has {x.dim()} dimensions (shape {tuple(x.shape)}), but the posterior was fitted on inputs with "
                f"{fitted.dim()} (shape (N, {', '.join(map(str, fitted.shape[1:]))})); reshape x to rows shaped like "
                "the training inputs."
            )
        return x

    def observation_distribution(
        self, x: torch.Tensor, idx: torch.Tensor | None = None, *, draws_per_chunk: int | None = None
    ) -> dist.Distribution:
        """``p(y | x, w_s)`` batched over draws ``(S, N)`` for a :class:`~bnn_pyro.BNN` (all draws
        by default), from :meth:`network_outputs` (chunked; a Laplace fit's linearized network)."""
        idx = self.draw_index() if idx is None else idx
        return self.predictive_draws(x, idx, draws_per_chunk=draws_per_chunk).distribution(slice(None))

    def network_outputs(
        self,
        x: torch.Tensor,
        idx: torch.Tensor | None = None,
        *,
        draws_per_chunk: int | None = None,
        linearized: bool = True,
    ) -> torch.Tensor:
        """The network's output ``f(x)`` at pooled draws ``idx`` (all by default), shaped ``(S, N, ...)``, for a
        :class:`~bnn_pyro.BNN` in eval mode (:class:`~bnn_pyro.predictive_draws.NetworkDraws`: the one place
        where draws are pushed through the net in chunks). Draws are evaluated ``draws_per_chunk`` at a time
        (default: :meth:`BNN.draws_per_chunk`, chunks whose widest layer output stays near 8 MB) and, for a stack
        of Linear layers, the rows of ``x`` in chunks where one draw over all of them exceeds that
        (:meth:`BNN.points_per_chunk`). A Laplace posterior with ``config["predictive"] == "glm"`` (its default)
        evaluates the network linearized at its mode (:mod:`bnn_pyro.posterior.linearized`) unless
        ``linearized=False``."""
        idx = self.draw_index() if idx is None else idx
        return self.predictive_draws(x, idx, draws_per_chunk=draws_per_chunk, linearized=linearized).outputs(
            slice(None)
        )

    def trace_draw(self, i: int, x, y=None):
        """One run of a Pyro function model with every latent site fixed at pooled draw ``i`` and
        its ``pyro.param`` sites at that draw's chain values; returns the Pyro trace. When the model fails on an
        ``x`` whose row shape differs from the training inputs', the error says so (the model's own is chained)."""
        chain, within = divmod(int(i), self.num_draws)
        draw = {k: v[chain, within] for k, v in self.samples.items()}
        with pyro.get_param_store().scope():
            for name, value in self.point.items():
                pyro.param(name, value[chain])
            try:
                return poutine.trace(poutine.condition(self.model, data=draw)).get_trace(x, y)
            except (RuntimeError, ValueError, IndexError, TypeError) as err:
                fitted = self.x.shape[1:] if isinstance(self.x, torch.Tensor) else None
                if fitted is None or not isinstance(x, torch.Tensor) or x.shape[1:] == fitted:
                    raise
                raise ValueError(
                    f"x has shape {tuple(x.shape)}, but the model was fitted on inputs shaped (N, "
                    f"{', '.join(map(str, fitted))}), and running it on x failed (the error it raised is chained "
                    "above). Check that the columns of x are the fitted ones, in the same order."
                ) from err

    def _predict_traced(self, x, idx, interval):
        """Prediction for a plain Pyro function model: one conditioned trace per draw."""
        fns = [self.trace_draw(i, x).nodes["obs"]["fn"] for i in idx.tolist()]
        base = [base_distribution(fn) for fn in fns]
        if isinstance(base[0], dist.Categorical):
            return predictions.classification(torch.stack([d.probs for d in base]))
        if isinstance(base[0], dist.Bernoulli):
            return predictions.classification(torch.stack([torch.stack([1 - d.probs, d.probs], -1) for d in base]))
        return predictions.regression(
            torch.stack([d.mean for d in fns]),
            torch.stack([d.variance for d in fns]),
            torch.stack([d.sample() for d in fns]),
            interval=interval,
        )

    # ------------------------------------------------------------------ diagnostics, plots, files
    # Thin delegations: the work lives in bnn_pyro.posterior.diagnostics, bnn_pyro.posterior.plots and bnn_pyro.io.
    def to_inference_data(self, **kwargs):
        """An ``arviz.InferenceData``; see :func:`bnn_pyro.posterior.diagnostics.to_inference_data`."""
        from bnn_pyro.posterior import diagnostics

        return diagnostics.to_inference_data(self, **kwargs)

    def psis(self, x=None, y=None, *, num_samples: int | None = None, seed: int = 0, warn: bool = True):
        """Pareto-smoothed importance sampling check of an approximate posterior (k-hat, weights,
        reweighted predictions); see :func:`bnn_pyro.posterior.psis.psis`."""
        from bnn_pyro.posterior import psis

        return psis.psis(self, x, y, num_samples=num_samples, seed=seed, warn=warn)

    def summary(self, *, space: str = "weights", x=None, var_names=None, warn: bool = True):
        """ArviZ summary table with convergence warnings; see :func:`bnn_pyro.posterior.diagnostics.summary`."""
        from bnn_pyro.posterior import diagnostics

        return diagnostics.summary(self, space=space, x=x, var_names=var_names, warn=warn)

    def save(self, path):
        """Write this posterior to ``path`` (safe, atomic); read it with ``bp.load``. See :mod:`bnn_pyro.io`."""
        return posterior_file.save(self, path)

    def plot_trace(self, var_names=None, **kwargs):
        """Trace plot; see :func:`bnn_pyro.posterior.plots.plot_trace`."""
        from bnn_pyro.posterior import plots

        return plots.plot_trace(self, var_names, **kwargs)

    def plot_rank(self, params=None, **kwargs):
        """Rank plot; see :func:`bnn_pyro.posterior.plots.plot_rank`."""
        from bnn_pyro.posterior import plots

        return plots.plot_rank(self, params, **kwargs)

    def plot_pair(self, params=None, **kwargs):
        """Pair plot of chosen weights; see :func:`bnn_pyro.posterior.plots.plot_pair`."""
        from bnn_pyro.posterior import plots

        return plots.plot_pair(self, params, **kwargs)

    def plot_energy(self, **kwargs):
        """Energy plot (HMC/NUTS); see :func:`bnn_pyro.posterior.plots.plot_energy`."""
        from bnn_pyro.posterior import plots

        return plots.plot_energy(self, **kwargs)

    def plot_predictive(self, x=None, **kwargs):
        """Predictive band for 1-D regression; see :func:`bnn_pyro.posterior.plots.plot_predictive`."""
        from bnn_pyro.posterior import plots

        return plots.plot_predictive(self, x, **kwargs)

    def plot_reliability(self, x=None, y=None, **kwargs):
        """Reliability diagram for classification; see :func:`bnn_pyro.posterior.plots.plot_reliability`."""
        from bnn_pyro.posterior import plots

        return plots.plot_reliability(self, x, y, **kwargs)


# asked of an unfitted BNN, these names raise an error that says to fit first (bnn_pyro.model)
fit_attributes({n for n in dir(Posterior) if not n.startswith("_")} | {f.name for f in fields(Posterior)})
