"""Per-draw predictive quantities at a set of inputs, produced one block of rows at a time.

A prediction never holds the ``(draws, points)`` arrays: it holds a *source* that can produce, for any block of
rows, every draw's predictive mean and variance, predictive samples of ``y`` and class probabilities. The
summaries in :mod:`bnn_pyro.predictions` stream over blocks, so peak memory is set by the block size
(``points_per_chunk``), not by draws x points, and the per-draw arrays are produced again when read.

Predictive samples of ``y`` are reproducible block by block: the noise of rows ``[256 b, 256 (b + 1))`` (all
draws) is drawn from a generator seeded by ``(seed, b)``, so they do not depend on how rows are chunked, and
reading ``draws`` twice, or ``lower`` then ``draws``, sees the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pyro
import torch
from torch.distributions import Distribution

__all__ = [
    "NOISE_ROWS",
    "CHUNK_BYTES",
    "PredictiveDraws",
    "StoredDraws",
    "NetworkDraws",
    "AffineDraws",
    "DrawMoments",
    "Observation",
    "evaluating",
]

NOISE_ROWS = 256  # rows whose predictive noise comes from one seeded generator (the unit of reproducibility)
CHUNK_BYTES = 32 * 2**20  # default size of one block's per-draw outputs (all draws x its rows)


class PredictiveDraws:
    """What a prediction reads: per-draw quantities for a block of rows ``rows`` (a ``slice``), all draws at once.

    Subclasses set ``num_draws``, ``num_rows`` and ``row_bytes`` (bytes of one row's per-draw outputs over all
    draws) and implement :meth:`moments`, :meth:`samples` and :meth:`probs`."""

    num_draws: int
    num_rows: int
    row_bytes: int
    points_per_chunk: int | None = None

    def chunk_rows(self, *, aligned: bool = False) -> int:
        """Rows per block: ``points_per_chunk`` if given, else as many as keep one block's per-draw outputs near
        :data:`CHUNK_BYTES` (at least one row). ``aligned``: a multiple of :data:`NOISE_ROWS` (predictive samples)."""
        rows = self.points_per_chunk or max(1, CHUNK_BYTES // max(self.row_bytes, 1))
        if aligned:
            rows = max(NOISE_ROWS, rows // NOISE_ROWS * NOISE_ROWS)
        return min(rows, max(self.num_rows, 1))

    def chunks(self, *, aligned: bool = False) -> Iterator[slice]:
        step = self.chunk_rows(aligned=aligned)
        return (slice(r, min(r + step, self.num_rows)) for r in range(0, self.num_rows, step))

    def moments(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-draw predictive means and variances of ``y``, each ``(S, r, ...)``."""
        raise NotImplementedError

    def samples(self, rows: slice) -> torch.Tensor:
        """Predictive samples of ``y`` ``(S, r, ...)``, one per draw; ``rows.start`` a multiple of :data:`NOISE_ROWS`."""
        raise NotImplementedError

    def probs(self, rows: slice) -> torch.Tensor:
        """Per-draw class probabilities ``(S, r, ..., K)``."""
        raise NotImplementedError

    def moment_summary(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Over the draws, at rows ``rows``: the mean and the variance of the per-draw predictive means (the
        predictive mean and the epistemic variance), and the mean of the per-draw variances (the aleatoric
        variance), each ``(r, ...)``. Here from :meth:`moments` by two passes (the mean, then the mean squared
        deviation: as stable as Welford); :class:`NetworkDraws` streams over chunks of draws instead."""
        means, variances = self.moments(rows)
        moments = DrawMoments()
        moments.add(means, variances)
        return moments.result()


class DrawMoments:
    """Mean and variance over draws of per-draw means, and the mean of per-draw variances, accumulated chunk of
    draws by chunk: within a chunk by two passes (its mean, then its sum of squared deviations), across chunks by
    the pairwise update of Chan, Golub & LeVeque (1979): with ``n`` draws so far and ``k`` in the chunk,
    ``delta = mean_chunk - mean``, ``mean += delta k / (n + k)``, ``M2 += M2_chunk + delta^2 n k / (n + k)``.
    Never a sum of squares minus a squared sum, so nothing cancels however large the mean is against the spread;
    memory is three arrays of one row block, whatever the number of draws."""

    def __init__(self):
        self.count = 0

    def add(self, means: torch.Tensor, variances: torch.Tensor) -> None:
        """Add a chunk of draws: per-draw means and variances ``(k, r, ...)``."""
        k = means.shape[0]
        mean = means.mean(0)
        if self.count == 0 or self.buffer.shape != means.shape:
            self.buffer = torch.empty_like(means, memory_format=torch.contiguous_format)
        m2 = torch.sub(means, mean, out=self.buffer).square_().sum(0)
        total = variances.sum(0)
        if not self.count:
            self.mean, self.m2, self.variance_sum = mean, m2, total
        else:
            n = self.count
            delta = mean.sub_(self.mean)
            self.mean.add_(delta, alpha=k / (n + k))
            self.m2.add_(m2).addcmul_(delta, delta, value=n * k / (n + k))
            self.variance_sum.add_(total)
        self.count += k

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean, epistemic variance, aleatoric variance)``: the variances over draws divide by the number of
        draws (the draws are the distribution, not a sample from it)."""
        return self.mean, self.m2 / self.count, self.variance_sum / self.count


class Observation:
    """``p(y | f, noise_s)`` for the network outputs ``f`` of draws ``draws`` (``(k, r, T, ..., out)``): the
    likelihood with each draw's noise values (``noise``: site name to ``(S, 1, ...)`` over all draws). A class,
    not a closure, so that a prediction's source pickles."""

    def __init__(self, likelihood, noise: dict[str, torch.Tensor]):
        self.likelihood, self.noise = likelihood, noise

    def __call__(self, f: torch.Tensor, draws: slice = slice(None)) -> Distribution:
        noise = {n: v[draws] for n, v in self.noise.items()}
        return self.likelihood.observed(f, noise, inner_dims=f.dim() - 3)


class StoredDraws(PredictiveDraws):
    """Per-draw arrays already in memory (``(S, N, ...)``; any may be ``None``): a Pyro function model's
    traced prediction, or one built by hand with :func:`bnn_pyro.predictions.regression`."""

    def __init__(self, *, means=None, variances=None, samples=None, probs=None, points_per_chunk: int | None = None):
        self._means, self._variances, self._samples, self._probs = means, variances, samples, probs
        first = next(t for t in (means, samples, probs) if t is not None)
        self.num_draws, self.num_rows = first.shape[0], first.shape[1]
        self.row_bytes = first[:, :1].numel() * first.element_size()
        self.points_per_chunk = points_per_chunk

    def moments(self, rows):
        return self._means[:, rows], self._variances[:, rows]

    def samples(self, rows):
        return self._samples[:, rows]

    def probs(self, rows):
        return self._probs[:, rows]


class AffineDraws(PredictiveDraws):
    """``shift + scale * y`` of another source (``shift``, ``scale`` broadcastable to the prediction's mean,
    ``(N, ...)``; ``scale > 0``): a change of units, or a spread about the mean."""

    def __init__(self, base: PredictiveDraws, shift: torch.Tensor, scale: torch.Tensor, shape: torch.Size):
        self.base, self.shift, self.scale = base, torch.broadcast_to(shift, shape), torch.broadcast_to(scale, shape)
        self.num_draws, self.num_rows, self.row_bytes = base.num_draws, base.num_rows, base.row_bytes
        self.points_per_chunk = base.points_per_chunk

    def moments(self, rows):
        m, v = self.base.moments(rows)
        return self.shift[rows] + self.scale[rows] * m, self.scale[rows].square() * v

    def moment_summary(self, rows):
        m, epistemic, aleatoric = self.base.moment_summary(rows)
        square = self.scale[rows].square()
        return self.shift[rows] + self.scale[rows] * m, square * epistemic, square * aleatoric

    def samples(self, rows):
        return self.shift[rows] + self.scale[rows] * self.base.samples(rows)


class NetworkDraws(PredictiveDraws):
    """``p(y | x, w_s)`` of a :class:`~bnn_pyro.BNN` posterior at ``x`` for pooled draws ``idx``, evaluated
    block by block: the rows of a block for all draws, ``draws_per_chunk`` draws at a time (default
    :meth:`BNN.draws_per_chunk` of the block's rows), and within a block, rows in pieces where one draw over all of them exceeds
    :meth:`BNN.points_per_chunk`'s budget. It keeps references (the posterior, ``x``, ``idx``), not copies.

    ``linearized(x, idx, params, draws_per_chunk, rows)``, if given, returns the outputs of a linearized net
    (:func:`bnn_pyro.posterior.linearized.linearized_outputs`), or ``None`` for the plain forward pass.
    ``observe(f)`` maps outputs ``(S, r, ...)`` of every draw to their distribution (the likelihood with the
    draws' noise); ``probs_of(d)`` gives class probabilities."""

    def __init__(
        self,
        post,
        x: torch.Tensor,
        idx: torch.Tensor,
        *,
        seed: int,
        draws_per_chunk: int | None = None,
        points_per_chunk: int | None = None,
        linearized: Callable | None = None,
        observe: Callable[[torch.Tensor], Distribution] | None = None,
        probs_of: Callable[[Distribution], torch.Tensor] | None = None,
    ):
        model = post.model
        self.post, self.x, self.idx, self.seed = post, x, idx, seed
        self.observe, self.probs_of = observe, probs_of
        self.draws_per_chunk = draws_per_chunk  # None: from each block's rows (BNN.draws_per_chunk)
        self.linearized = linearized
        self.num_draws, self.num_rows = len(idx), x.shape[0]
        out = model.output_shape(x).numel() if x.shape[0] else 1
        self.row_bytes = self.num_draws * out * torch.finfo(model.dtype).bits // 8
        self.points_per_chunk = points_per_chunk

    def _params(self, draws: slice) -> dict[str, torch.Tensor]:
        """Every parameter (and per-draw buffer) of the pooled draws ``idx[draws]``, indexed from the posterior."""
        idx, samples = self.idx[draws], self.post.samples
        params = {n: samples[n].reshape((-1,) + samples[n].shape[2:])[idx] for n in self.post.model.sample_names}
        params.update(self.post.point_per_draw(idx))
        return params

    def outputs(self, rows: slice) -> torch.Tensor:
        """The network's outputs ``(S, r, ...)`` at rows ``rows`` of ``x``, for every draw."""
        model, x = self.post.model, self.x[rows]
        per_chunk, rows_per_draw = self.draws_per_chunk or model.draws_per_chunk(x), model.points_per_chunk(x)
        # the block's outputs allocated first, before the net's temporaries: the hole the previous block's left
        # in the C heap is reused instead of growing the heap (the resident set grew by a block per block)
        f = torch.empty((self.num_draws, x.shape[0]) + model.output_shape(x), dtype=model.dtype, device=x.device)
        with evaluating(model):
            for draws in _slices(self.num_draws, per_chunk):
                self._chunk_outputs(draws, x, per_chunk, rows_per_draw, out=f[draws])
        return f

    def _chunk_outputs(
        self, draws: slice, x: torch.Tensor, per_chunk: int, rows_per_draw: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The outputs ``(k, r, ...)`` of draws ``draws`` at ``x`` (written into ``out`` if given), the rows in
        pieces of ``rows_per_draw``; the model in eval mode (the caller's :func:`evaluating`)."""
        model, params = self.post.model, self._params(draws)
        if self.linearized is not None:  # a Laplace fit's linearized network
            chunk = self.linearized(x, self.idx[draws], params, per_chunk, rows_per_draw)
            if chunk is not None:
                return chunk if out is None else out.copy_(chunk)
        if out is None:
            if rows_per_draw >= x.shape[0]:
                return model.forward_draws(params, x)
            out = torch.empty(
                (draws.stop - draws.start, x.shape[0]) + model.output_shape(x), dtype=model.dtype, device=x.device
            )
        for r in range(0, x.shape[0], rows_per_draw):
            out[:, r : r + rows_per_draw] = model.forward_draws(params, x[r : r + rows_per_draw])
        return out

    def moment_summary(self, rows):
        """:meth:`PredictiveDraws.moment_summary` streamed over chunks of draws (:class:`DrawMoments`): the
        ``(S, r)`` per-draw arrays are never formed, only one chunk's (``draws_per_chunk`` draws)."""
        model, x = self.post.model, self.x[rows]
        per_chunk, rows_per_draw = self.draws_per_chunk or model.draws_per_chunk(x), model.points_per_chunk(x)
        moments = DrawMoments()
        # the net's outputs and the posterior's noise draws: checked already
        with evaluating(model), pyro.validation_enabled(False):
            for draws in _slices(self.num_draws, per_chunk):
                d = self.observe(self._chunk_outputs(draws, x, per_chunk, rows_per_draw), draws)
                moments.add(d.mean, d.variance)
        return moments.result()

    def distribution(self, rows: slice) -> Distribution:
        f = self.outputs(rows)
        with pyro.validation_enabled(False):  # the net's outputs and the posterior's noise draws: checked already
            return self.observe(f)

    def moments(self, rows):
        d = self.distribution(rows)
        return d.mean, d.variance

    def probs(self, rows):
        return self.probs_of(self.distribution(rows))

    def samples(self, rows):
        f = self.outputs(rows)
        y = None
        for start in range(0, f.shape[1], NOISE_ROWS):
            block = rows.start + start
            if block % NOISE_ROWS:
                raise ValueError(
                    f"rows: predictive samples start at a multiple of {NOISE_ROWS} rows, got {rows.start}."
                )
            # the net's outputs and the posterior's noise draws: checked already
            with seeded(self.seed, block // NOISE_ROWS, f.device), pyro.validation_enabled(False):
                piece = self.observe(f[:, start : start + NOISE_ROWS]).sample()
            if y is None:
                y = piece.new_empty((f.shape[0], f.shape[1]) + piece.shape[2:])
            y[:, start : start + NOISE_ROWS] = piece
        return y


def _slices(total: int, step: int) -> Iterator[slice]:
    return (slice(i, min(i + step, total)) for i in range(0, total, step))


@contextmanager
def evaluating(model):
    """``model`` in eval mode inside the context (dropout off, BatchNorm's running statistics), its mode restored
    on the way out, also on an error. A model without a mode (a plain Pyro function) is left as it is."""
    was_training = getattr(model, "training", None)
    if was_training is not None:
        model.eval()
    try:
        yield
    finally:
        if was_training is not None:
            model.train(was_training)


@contextmanager
def seeded(seed: int, block: int, device: torch.device):
    """Seed torch's global generator (of ``device``) by ``(seed, block)`` inside the context and restore the
    caller's state on exit: ``Distribution.sample`` takes no generator. (The state is set from a seeded
    ``torch.Generator``: ``torch.manual_seed`` goes through torch's compiler guard on every call.)"""
    mixed = (seed * 0x9E3779B97F4A7C15 + block) % 2**63  # distinct, spread seeds per (seed, block)
    if device.type not in ("cpu", "cuda"):
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            torch.manual_seed(mixed)
            yield
        return
    rng = torch.cuda if device.type == "cuda" else torch
    where = (device,) if device.type == "cuda" else ()
    saved = rng.get_rng_state(*where)
    rng.set_rng_state(torch.Generator(device=device).manual_seed(mixed).get_state(), *where)
    try:
        yield
    finally:
        rng.set_rng_state(saved, *where)
