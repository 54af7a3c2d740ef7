"""Posterior predictive summaries: what :meth:`Posterior.predict` returns.

Regression uses the law of total variance over posterior draws ``s``:
``Var[y] = E_s[Var[y | w_s]] + Var_s[E[y | w_s]]`` = aleatoric + epistemic.
Classification reports the Bayesian model average ``p(y | x) = E_s[p(y | x, w_s)]``, its entropy
(total uncertainty), and the mutual information between ``y`` and the weights (epistemic part):
``MI = H[E_s p_s] - E_s H[p_s]``.

Memory. The summaries are computed block by block over the rows of ``x`` (from a
:class:`~bnn_pyro.predictive_draws.PredictiveDraws` source; the regression moments streamed over chunks of draws,
the rest with every draw of a block at once), so peak memory is set by the block size, not by draws x points.
A statistic of one row depends only on that row's draws, so a block's statistics are exactly
those of the unchunked computation. What is not read costs nothing: ``lower``/``upper`` (quantiles of
predictive samples) are computed when first read, and ``draws``/``mean_draws`` (``(S, N, ...)``, the only
parts whose size is draws x points) are produced again from the source when first read, then kept;
``blocks`` gives them a block of rows at a time without keeping them (what a per-row statistic of the draws
reads: PIT, acquisition scores, a predictive band). See ``docs/predict.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bnn_pyro.predictive_draws import AffineDraws, PredictiveDraws, StoredDraws

__all__ = [
    "RegressionPrediction",
    "ClassificationPrediction",
    "regression",
    "classification",
    "summarize",
    "quantiles",
    "entropy",
    "mutual_information",
]


@dataclass(frozen=True, eq=False, init=False)
class RegressionPrediction:
    """Predictive summary for regression. Shapes: ``(N,)`` or ``(N, out)`` (``(N, T, ...)`` for sequences).

    ``lower``/``upper`` (the central ``interval`` of predictive samples of ``y``; ``None`` when
    ``interval=None``) are computed when first read, block by block. ``draws`` (predictive samples of ``y``)
    and ``mean_draws`` (``E[y | x, w_s]``) carry a leading draw dimension ``S``: they are materialized
    (``S x N`` values) when first read and kept; read them only when you need every draw.

    Built by hand (``lower``, ``upper``, ``draws``, ``mean_draws`` given as tensors, no ``source``) or by
    ``dataclasses.replace(pred, lower=..., upper=..., interval=...)``, the given values are used as they are.

    A prediction pickles with the posterior and inputs its ``source`` refers to (so that what was not read can
    be produced after loading, the same predictive samples from the same seed); to keep only the summaries,
    read what you need and store those tensors."""

    mean: torch.Tensor
    std: torch.Tensor
    epistemic_std: torch.Tensor
    aleatoric_std: torch.Tensor
    interval: float | None
    source: PredictiveDraws | None = field(repr=False)
    _cache: dict = field(init=False, repr=False)

    def __init__(
        self,
        mean: torch.Tensor,
        std: torch.Tensor,
        epistemic_std: torch.Tensor,
        aleatoric_std: torch.Tensor,
        lower: torch.Tensor | None = None,
        upper: torch.Tensor | None = None,
        interval: float | None = None,
        draws: torch.Tensor | None = None,
        mean_draws: torch.Tensor | None = None,
        *,
        source: PredictiveDraws | None = None,
    ):
        for name, value in (
            ("mean", mean),
            ("std", std),
            ("epistemic_std", epistemic_std),
            ("aleatoric_std", aleatoric_std),
            ("interval", interval),
            ("source", source),
        ):
            object.__setattr__(self, name, value)
        cache = {"draws": draws, "mean_draws": mean_draws}
        if lower is not None or upper is not None:
            cache["bounds"] = (lower, upper)
        object.__setattr__(self, "_cache", {k: v for k, v in cache.items() if v is not None})

    @property
    def lower(self) -> torch.Tensor | None:
        return self._bounds()[0]

    @property
    def upper(self) -> torch.Tensor | None:
        return self._bounds()[1]

    @property
    @torch.no_grad()
    def draws(self) -> torch.Tensor:
        """Predictive samples ``y ~ p(y | x, w_s)``, one per draw ``(S, N, ...)``."""
        if "draws" not in self._cache:
            source = self._source("draws")
            self._cache["draws"] = torch.cat([source.samples(r) for r in source.chunks(aligned=True)], 1)
        return self._cache["draws"]

    @property
    @torch.no_grad()
    def mean_draws(self) -> torch.Tensor:
        """``E[y | x, w_s]``, one per draw ``(S, N, ...)``."""
        if "mean_draws" not in self._cache:
            source = self._source("mean_draws")
            self._cache["mean_draws"] = torch.cat([source.moments(r)[0] for r in source.chunks()], 1)
        return self._cache["mean_draws"]

    @torch.no_grad()
    def blocks(self, of: str = "draws") -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows, values)`` over blocks of rows, ``values`` the per-draw array ``of`` (``"draws"``: predictive
        samples, ``"mean_draws"``: per-draw means) at those rows, ``(S, r, ...)``: what a per-row statistic of the
        draws reads in memory bounded by the block size. One block of every row where that array was read (and
        kept) already; otherwise produced block by block from the source, as the array would be (the same
        predictive samples), and not kept."""
        if of not in ("draws", "mean_draws"):
            raise ValueError(f"of: expected 'draws' or 'mean_draws', got {of!r}.")
        if of in self._cache:
            yield slice(0, self._cache[of].shape[1]), self._cache[of]
            return
        source = self._source(of)
        if of == "draws":
            for rows in source.chunks(aligned=True):
                yield rows, source.samples(rows)
        else:
            for rows in source.chunks():
                yield rows, source.moments(rows)[0]

    @torch.no_grad()
    def quantiles(self, levels) -> torch.Tensor:
        """Quantiles of the predictive samples (``draws``) at ``levels`` in [0, 1], ``(len(levels), N, ...)``,
        computed block by block (never all draws x points at once, unless ``draws`` was read already)."""
        levels = torch.as_tensor(levels, dtype=self.mean.dtype, device=self.mean.device).reshape(-1)
        if "draws" in self._cache:
            return quantiles(self._cache["draws"], levels)
        source = self._source("draws")
        return _by_block(source, lambda r: (quantiles(source.samples(r), levels),), aligned=True, dim=1)[0]

    def _bounds(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if "bounds" in self._cache or self.interval is None:
            return self._cache.get("bounds", (None, None))
        alpha = (1.0 - self.interval) / 2.0
        q = self.quantiles([alpha, 1.0 - alpha])
        self._cache["bounds"] = (q[0], q[1])
        return self._cache["bounds"]

    def _source(self, name: str) -> PredictiveDraws:
        if self.source is None:
            raise ValueError(
                f"{name}: this prediction was built without per-draw values; predict with "
                "post.predict(x), or pass draws= and mean_draws= when building it by hand."
            )
        return self.source

    def affine(self, shift, scale) -> RegressionPrediction:
        """The prediction of ``shift + scale * y`` (``shift``, ``scale`` broadcastable to ``mean``; ``scale > 0``):
        a change of units, or a spread about the mean. Every statistic, bound and draw is mapped alike, without
        computing anything not yet read."""
        shift = torch.as_tensor(shift, dtype=self.mean.dtype, device=self.mean.device)
        scale = torch.as_tensor(scale, dtype=self.mean.dtype, device=self.mean.device)
        if not (scale > 0).all():
            raise ValueError(
                "scale: expected positive values (a change of units or a spread about the mean); "
                f"got a minimum of {float(scale.min()):.3g}."
            )

        def move(t):
            return None if t is None else shift + scale * t

        sd = torch.broadcast_to(scale, self.mean.shape)
        source = None if self.source is None else AffineDraws(self.source, shift, scale, self.mean.shape)
        lower, upper = self._cache.get("bounds", (None, None))
        return RegressionPrediction(
            move(self.mean),
            sd * self.std,
            sd * self.epistemic_std,
            sd * self.aleatoric_std,
            move(lower),
            move(upper),
            self.interval,
            move(self._cache.get("draws")),
            move(self._cache.get("mean_draws")),
            source=source,
        )


@dataclass(frozen=True, eq=False, init=False)
class ClassificationPrediction:
    """Predictive summary for classification. ``probs`` is ``(N, K)``; ``draws`` (per-draw probabilities
    ``(S, N, K)``) is materialized when first read and kept."""

    probs: torch.Tensor
    predicted: torch.Tensor
    entropy: torch.Tensor
    aleatoric_entropy: torch.Tensor
    mutual_information: torch.Tensor
    source: PredictiveDraws | None = field(repr=False)
    _cache: dict = field(init=False, repr=False)

    def __init__(
        self,
        probs: torch.Tensor,
        predicted: torch.Tensor,
        entropy: torch.Tensor,
        aleatoric_entropy: torch.Tensor,
        mutual_information: torch.Tensor,
        draws: torch.Tensor | None = None,
        *,
        source: PredictiveDraws | None = None,
    ):
        for name, value in (
            ("probs", probs),
            ("predicted", predicted),
            ("entropy", entropy),
            ("aleatoric_entropy", aleatoric_entropy),
            ("mutual_information", mutual_information),
            ("source", source),
        ):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_cache", {} if draws is None else {"draws": draws})

    @property
    @torch.no_grad()
    def draws(self) -> torch.Tensor:
        if "draws" not in self._cache:
            source = self._source()
            self._cache["draws"] = torch.cat([source.probs(r) for r in source.chunks()], 1)
        return self._cache["draws"]

    @torch.no_grad()
    def blocks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(rows, probs)`` over blocks of rows, ``probs`` the per-draw class probabilities at those rows
        ``(S, r, K)``: what a per-row statistic of the draws reads in memory bounded by the block size. One block
        of every row where ``draws`` was read already; otherwise produced block by block, and not kept."""
        if "draws" in self._cache:
            yield slice(0, self._cache["draws"].shape[1]), self._cache["draws"]
            return
        source = self._source()
        for rows in source.chunks():
            yield rows, source.probs(rows)

    def _source(self) -> PredictiveDraws:
        if self.source is None:
            raise ValueError(
                "draws: this prediction was built without per-draw values; predict with "
                "post.predict(x), or pass draws= when building it by hand."
            )
        return self.source


def summarize(source: PredictiveDraws, task: str, *, interval: float | None = 0.95):
    """The prediction of ``task`` (``"regression"`` or ``"classification"``) from ``source``, block by block."""
    if task == "classification":
        probs, entropy, aleatoric, mi = _by_block(source, lambda rows: _classification_block(source.probs(rows)))
        return ClassificationPrediction(probs, probs.argmax(-1), entropy, aleatoric, mi, source=source)
    if interval is not None and not 0.0 < interval < 1.0:
        raise ValueError(f"interval must lie in (0, 1) or be None, got {interval}; e.g. 0.95 for a 95% interval.")

    mean, epistemic, aleatoric = _by_block(source, source.moment_summary)
    return RegressionPrediction(
        mean, (epistemic + aleatoric).sqrt(), epistemic.sqrt(), aleatoric.sqrt(), interval=interval, source=source
    )


def _by_block(source: PredictiveDraws, block, *, aligned: bool = False, dim: int = 0) -> tuple[torch.Tensor, ...]:
    """``block(rows)`` (a tuple of per-row results, rows along ``dim``) for every block, written into results
    allocated once: small results kept between the blocks' large temporaries would fragment the C heap (the
    resident set grew by about a block per block; ``benchmarks/results/predict/one_million_points.md``)."""
    out = None
    for rows in source.chunks(aligned=aligned):
        parts = block(rows)
        if out is None:
            out = tuple(p.new_empty(p.shape[:dim] + (source.num_rows,) + p.shape[dim + 1 :]) for p in parts)
        for o, p in zip(out, parts):
            o.narrow(dim, rows.start, rows.stop - rows.start).copy_(p)
    return out


def regression(means: torch.Tensor, variances: torch.Tensor, y_draws: torch.Tensor, *, interval: float | None = 0.95):
    """Summarize per-draw means and variances ``(S, N, ...)`` and predictive draws of ``y`` held in memory.
    ``interval=None``: no ``lower``/``upper``."""
    return summarize(StoredDraws(means=means, variances=variances, samples=y_draws), "regression", interval=interval)


def classification(probs: torch.Tensor):
    """Summarize per-draw class probabilities ``(S, N, K)`` held in memory."""
    return summarize(StoredDraws(probs=probs), "classification")


def quantiles(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``torch.quantile(y, levels, dim=0)`` (linear interpolation; NaN where a column holds NaN), the same
    numbers, from the few order statistics each level needs (``topk`` from the nearer end) instead of
    sorting every column: a tail level reads a few of the draws' order statistics, not all of them."""
    n = y.shape[0]
    levels = levels.to(y.dtype)
    if ((levels < 0) | (levels > 1)).any():
        raise ValueError(f"levels: expected probabilities in [0, 1], got {levels.tolist()}.")
    rank = levels * (n - 1)
    below, above, weight = rank.long(), rank.ceil().long(), rank - rank.long()
    out = []
    for lo, hi, w in zip(below.tolist(), above.tolist(), weight):
        if hi + 1 <= n - lo:  # the hi + 1 smallest, ascending
            v = torch.topk(y, hi + 1, dim=0, largest=False, sorted=True).values
            out.append(torch.lerp(v[lo], v[hi], w))
        else:  # the n - lo largest, descending
            v = torch.topk(y, n - lo, dim=0, largest=True, sorted=True).values
            out.append(torch.lerp(v[n - 1 - lo], v[n - 1 - hi], w))
    q = torch.stack(out)
    return torch.where(y.isnan().any(0), torch.nan, q) if y.is_floating_point() else q


def _classification_block(probs: torch.Tensor):
    average = probs.mean(0)
    return average, entropy(average), entropy(probs).mean(0), mutual_information(probs)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_k p_k log p_k`` over the last dimension (``0 log 0 = 0``), in nats."""
    return -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)


def mutual_information(probs: torch.Tensor) -> torch.Tensor:
    """``I[y; w] = E_s KL(p_s || p_bar)`` per input from per-draw probabilities ``(S, N, K)``.

    Equal to ``H[p_bar] - E_s H[p_s]``, but that difference of two nearly equal entropies leaves
    rounding noise (up to ~5e-7 in float32) where the draws agree, enough to rank a point estimate's
    inputs at random. Here a class on which every draw gives the same probability contributes exactly
    0, so identical draws (MAP, one network) have exactly zero mutual information."""
    tiny = torch.finfo(probs.dtype).tiny
    log_ratio = probs.clamp_min(tiny).log() - probs.mean(0).clamp_min(tiny).log()
    log_ratio = torch.where((probs == probs[:1]).all(0), 0.0, log_ratio)
    return (probs * log_ratio).sum(-1).mean(0).clamp_min(0.0)
