"""Active learning: which unlabelled inputs to label next, from a classifier's posterior draws.

Every score reads the per-draw class probabilities ``p_s(y | x)`` (``pred.draws``, shaped
``(S, N, K)``) of a :class:`~bnn_pyro.predictions.ClassificationPrediction`, whichever engine made it, block
by block of inputs (:meth:`~bnn_pyro.predictions.ClassificationPrediction.blocks`), so a large pool never
holds every draw at every input at once. Higher means "label this one first".

* ``"bald"``: the mutual information between the label and the weights (Houlsby et al. 2011),
  ``I[y; w | x] = H[(1/S) sum_s p_s] - (1/S) sum_s H[p_s]``: high where the draws disagree.
* ``"entropy"``: the predictive entropy ``H[(1/S) sum_s p_s]`` (max entropy; no weight uncertainty needed).
* ``"variation_ratios"``: ``1 - f_mode / S``, where ``f_mode`` counts the draws whose most likely class
  is the most common one (Gal et al. 2017, "Deep Bayesian active learning with image data").
* ``"random"``: uniform scores from ``seed`` (the baseline).
* ``"batchbald"``: greedy BatchBALD (Kirsch et al. 2019). The ``i``-th pick maximizes the *joint*
  mutual information ``I[y_1, ..., y_i; w]`` of the batch so far plus the candidate; the joint
  entropy is computed **exactly** by enumerating the ``K^i`` label configurations over the draws,
  ``P(y_1..y_i) = (1/S) sum_s prod_j p_s(y_j)``, so ``K^(k-1)`` must stay below ``max_configurations``
  (e.g. ``k <= 5`` for 10 classes). It avoids the near-duplicate picks of top-``k`` BALD.

Example
-------
>>> from bnn_pyro import acquisition
>>> idx = acquisition.acquire(post, pool_x, 10, strategy="bald", num_samples=100, seed=0)
>>> x_train = torch.cat([x_train, pool_x[idx]])     # label pool_x[idx], refit, repeat
"""

from __future__ import annotations

import torch

from bnn_pyro.predictions import ClassificationPrediction, entropy, mutual_information
from bnn_pyro.utils.checks import positive_int

__all__ = ["STRATEGIES", "scores", "select", "acquire", "joint_mutual_information"]

STRATEGIES = ("bald", "entropy", "variation_ratios", "random", "batchbald")
_CHUNK = 2**22  # entries of the (configurations, candidates, K) joint table computed at a time


def _checked(pred) -> ClassificationPrediction:
    if not isinstance(pred, ClassificationPrediction):
        raise TypeError(
            f"pred: expected a ClassificationPrediction (post.predict(x) of a classifier), got "
            f"{type(pred).__name__}; pass post.predict(pool_x) of a classifier."
        )
    return pred


def _strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: unknown value {strategy!r}; choose one of {', '.join(map(repr, STRATEGIES))}.")
    return strategy


def _per_row(pred: ClassificationPrediction, score) -> torch.Tensor:
    """``score(p)`` (float64 per-draw probabilities ``(S, r, K)`` of a block of rows -> ``(r,)``) for every
    row, block by block (:meth:`ClassificationPrediction.blocks`): never every draw at every input at once."""
    out = torch.empty(pred.probs.shape[0], dtype=torch.float64)
    for rows, p in pred.blocks():
        out[rows] = score(p.double())
    return out


def scores(pred: ClassificationPrediction, strategy: str = "bald", *, seed: int | None = 0) -> torch.Tensor:
    """One acquisition score per input, shaped ``(N,)`` (float64; higher = acquire first), computed block by
    block of inputs. ``"batchbald"`` scores one input alone, which is its BALD score."""
    pred = _checked(pred)
    strategy = _strategy(strategy)
    if strategy in ("bald", "batchbald"):
        return _per_row(pred, mutual_information)  # exactly 0 where the draws agree (a point estimate's are all 0)
    if strategy == "entropy":
        return _per_row(pred, lambda p: entropy(p.mean(0)))
    if strategy == "variation_ratios":

        def ratios(p):
            votes = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).sum(0)  # (r, K)
            return 1.0 - votes.max(-1).values.double() / p.shape[0]

        return _per_row(pred, ratios)
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    return torch.rand(pred.probs.shape[0], generator=g, dtype=torch.float64)


def _columns(pred: ClassificationPrediction, indices: list[int]) -> torch.Tensor:
    """The per-draw probabilities of the inputs ``indices`` (float64 ``(S, len(indices), K)``), block by block."""
    wanted = torch.as_tensor(indices, dtype=torch.long)
    out = None
    for rows, p in pred.blocks():
        inside = (wanted >= rows.start) & (wanted < rows.stop)
        if out is None:
            out = torch.empty((p.shape[0], len(indices), p.shape[-1]), dtype=torch.float64)
        if inside.any():
            out[:, inside] = p[:, wanted[inside] - rows.start].double()
    return out


def joint_mutual_information(pred: ClassificationPrediction, indices) -> float:
    """``I[y_i1, ..., y_im; w]`` of the inputs ``indices``: the joint entropy of their labels under the
    predictive minus the sum of their expected per-draw entropies (exact, ``K^m`` configurations)."""
    idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    p = _columns(_checked(pred), idx.tolist())
    joint = torch.ones(p.shape[0], 1, dtype=torch.float64)
    for i in range(len(idx)):
        joint = (joint[:, :, None] * p[:, i, None, :]).reshape(p.shape[0], -1)
    return float(entropy(joint.mean(0)) - entropy(p).mean(0).sum())


def select(
    pred: ClassificationPrediction,
    k: int,
    strategy: str = "bald",
    *,
    seed: int | None = 0,
    max_configurations: int = 100_000,
) -> torch.Tensor:
    """Indices (``LongTensor (k,)``) of the ``k`` inputs to label next: the top-``k`` scores, or for
    ``"batchbald"`` the greedy joint choice (see the module's docstring)."""
    k = positive_int("k", k)
    pred = _checked(pred)
    strategy = _strategy(strategy)
    n, c = pred.probs.shape[0], pred.probs.shape[-1]
    if k > n:
        raise ValueError(f"k: asked for {k} inputs but the pool has only {n}; pass k <= len(pool_x).")
    if strategy != "batchbald":
        return scores(pred, strategy, seed=seed).topk(k).indices
    positive_int("max_configurations", max_configurations)
    if c ** (k - 1) > max_configurations:
        raise ValueError(
            f"k: exact BatchBALD with {c} classes tracks {c}^(k-1) = "
            f"{c ** (k - 1)} label configurations, more than max_configurations="
            f"{max_configurations}; use a smaller k (acquire in several rounds), raise "
            "max_configurations, or strategy='bald'."
        )
    return _batchbald(pred, k)


def _batchbald(pred: ClassificationPrediction, k: int) -> torch.Tensor:
    """Greedy BatchBALD over the pool's blocks: each pick reads the per-draw probabilities block by block
    (:meth:`ClassificationPrediction.blocks`; produced again per pick unless ``pred.draws`` was read), so memory
    is one block and the batch's joint table, never every draw at every input."""
    n = pred.probs.shape[0]
    expected = _per_row(pred, lambda p: entropy(p).mean(0))  # (N,) E_s H[p_s(y_n)]
    joint = None  # per-draw probability of each configuration of the batch so far, (S, configurations)
    chosen: list[int] = []
    taken = torch.zeros(n, dtype=torch.bool)
    base = 0.0  # sum of expected entropies of the batch so far
    for _ in range(k):
        h = torch.empty(n, dtype=torch.float64)
        for rows, block in pred.blocks():
            p = block.double()
            s, c = p.shape[0], p.shape[-1]
            if joint is None:
                joint = torch.ones(s, 1, dtype=torch.float64)
            step = max(1, _CHUNK // (joint.shape[1] * c))
            for r in range(0, p.shape[1], step):
                # P(configuration, y_candidate) = (1/S) sum_s joint_s(config) p_s(y_candidate)
                table = torch.einsum("sc,snk->nck", joint, p[:, r : r + step]) / s
                h[rows.start + r : rows.start + r + table.shape[0]] = entropy(table.reshape(table.shape[0], -1))
        gain = h - base - expected
        gain[taken] = -float("inf")
        best = int(gain.argmax())
        chosen.append(best)
        taken[best] = True
        base += float(expected[best])
        p_best = _columns(pred, [best])[:, 0]
        joint = (joint[:, :, None] * p_best[:, None, :]).reshape(joint.shape[0], -1)
    return torch.tensor(chosen, dtype=torch.long)


def acquire(
    post,
    pool_x,
    k: int,
    *,
    strategy: str = "bald",
    num_samples: int | None = 100,
    seed: int | None = 0,
    max_configurations: int = 100_000,
) -> torch.Tensor:
    """Indices into ``pool_x`` of the ``k`` inputs to label next, by ``strategy`` (see :data:`STRATEGIES`).

    Predicts at ``pool_x`` with ``num_samples`` posterior draws (``None``: all of them) picked with
    ``seed``, then :func:`select`. Works for any engine's :class:`~bnn_pyro.Posterior` of a classifier.
    """
    _strategy(strategy)
    pred = post.predict(pool_x, num_samples=num_samples, seed=seed)
    if not isinstance(pred, ClassificationPrediction):
        raise TypeError(
            "post: acquisition needs a classifier (a Categorical or Bernoulli likelihood); "
            f"this posterior predicts {type(pred).__name__}; use a classifier's posterior."
        )
    return select(pred, k, strategy, seed=seed, max_configurations=max_configurations)
