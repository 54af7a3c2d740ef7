r"""Mode connectivity: low-loss curves between two solutions of one ``BNN`` (Garipov et al. 2018).

Garipov, T., Izmailov, P., Podoprikhin, D., Vetrov, D. & Wilson, A. G. (2018). Loss surfaces, mode
connectivity, and fast ensembling of DNNs. NeurIPS.

Two independently trained nets (say two members of a ``method="ensemble"`` posterior) are usually
separated by a barrier: the loss rises on the straight segment between them. Yet a simple curve with
the same ends often keeps the loss as low as at the ends. A curve ``w(t)``, ``t in [0, 1]``, with
``w(0) = w_0`` and ``w(1) = w_1`` fixed, has free control points ("bends") ``theta_1, ..., theta_m``:

- ``kind="bezier"`` (quadratic for one bend, the paper's choice):
  ``w(t) = sum_k C(m+1, k) t^k (1 - t)^(m+1-k) theta_k`` over ``theta_0 = w_0, ..., theta_{m+1} = w_1``;
  for one bend ``w(t) = (1 - t)^2 w_0 + 2 t (1 - t) theta + t^2 w_1``.
- ``kind="polyline"``: straight pieces through ``theta_0, ..., theta_{m+1}`` at ``t = k / (m + 1)``.
- :func:`line` (``kind="line"``): the straight segment ``(1 - t) w_0 + t w_1``, no bend, for comparison.

:func:`fit_curve` trains the bends to minimise the expected loss over ``t ~ U(0, 1)``,

.. math::

    \ell(\theta) = \mathbb{E}_{t \sim U(0, 1)}\Big[\frac{1}{N} U_c(w(t))\Big], \qquad
    U_c(w) = -\log p(w) - \sum_{i=1}^{N} \log p(y_i \mid x_i, w),

the model's negative log joint (prior plus likelihood, the likelihood scaled by ``N / B`` on
minibatches) per training point: the objective every deep-ensemble member minimises (weight decay
plus cross-entropy or Gaussian NLL for a Normal prior), so the ends are its minima. Each step draws
``points_per_step`` values of ``t``, evaluates all of them in one batched call of the project's log
density (:class:`~bnn_pyro.infer.shared.LogJoint`) and takes an optimizer step on the bends. The
curve lives in the unconstrained coordinates of each latent site (``biject_to(support)``: a learned
noise scale stays positive along it); deterministic parameters (those ``bayesian=`` leaves out) are
part of the curve too and enter only the likelihood. Needs a ``BNN`` whose priors are fixed
distributions (no hierarchical prior) and no BatchNorm.

:func:`path_metrics` scores points on a curve (loss, NLL, accuracy or RMSE), :func:`plot_path` draws
them, and :meth:`Curve.posterior` turns points on the curve into a :class:`~bnn_pyro.Posterior` (one
chain of one draw per point, like an ensemble), so ``predict`` and :mod:`bnn_pyro.metrics` ensemble
along the curve.

Example
-------
>>> ens = bp.fit(model, x, y, method="ensemble", num_chains=2, seed=0)
>>> curve = bp.curves.fit_curve(ens, x, y, ends=(0, 1), num_steps=1000, seed=0)
>>> on_curve = bp.curves.path_metrics(curve, (x_test, y_test))              # t = 0, 0.05, ..., 1
>>> on_line = bp.curves.path_metrics(curve.line(), (x_test, y_test))
>>> ax = bp.curves.plot_path({"Bezier": on_curve, "line": on_line}, metric="loss")
>>> pred = curve.posterior(num_points=10).predict(x_test)                   # ensemble along the curve
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch.distributions import biject_to

from bnn_pyro.infer.driver import descend
from bnn_pyro.infer.shared import Data, LogJoint, build, clean_config, is_identity
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import check_data, choice, owned, positive, positive_int

__all__ = ["Kind", "Curve", "PathMetrics", "fit_curve", "line", "path_metrics", "plot_path", "coefficients"]


class Kind(str, Enum):
    """The shape of a curve."""

    BEZIER = "bezier"
    POLYLINE = "polyline"
    LINE = "line"


def coefficients(kind, t: torch.Tensor, num_bends: int) -> torch.Tensor:
    """Weights ``(T, num_bends + 2)`` of the control points ``(w_0, theta_1, ..., theta_m, w_1)`` at ``t`` ``(T,)``:
    ``w(t) = sum_k coefficients[:, k] * theta_k``. ``"line"`` is the Bezier curve without a bend."""
    kind = choice("kind", kind, Kind)
    t = torch.as_tensor(t).reshape(-1, 1)
    n = num_bends + 1
    k = torch.arange(n + 1, dtype=t.dtype, device=t.device)
    if kind is Kind.POLYLINE:  # hat functions on the knots k / n
        return (1.0 - (n * t - k).abs()).clamp_min(0.0)
    binomial = torch.tensor([math.comb(n, i) for i in range(n + 1)], dtype=t.dtype, device=t.device)
    return binomial * t**k * (1.0 - t) ** (n - k)


@dataclass
class Curve:
    """A curve between two solutions of ``model`` (see the module docstring).

    Attributes
    ----------
    model:
        The ``BNN``.
    kind:
        ``"bezier"``, ``"polyline"`` or ``"line"``.
    controls:
        Site name -> control points ``(num_bends + 2, *shape)``, ends first and last, in unconstrained
        coordinates (latent sites) or as they are (deterministic parameters).
    config, history:
        The fit's settings, and ``history["loss"]`` ``(steps,)``: the loss ``U_c / N`` at each step's ``t`` draws.
    x, y:
        The data the curve was fitted on (``None`` for :func:`line`).
    """

    model: BNN
    kind: str
    controls: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)
    history: dict[str, torch.Tensor] = field(default_factory=dict)
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None

    @property
    def num_bends(self) -> int:
        return next(iter(self.controls.values())).shape[0] - 2

    @property
    def latent_names(self) -> list[str]:
        return [n for n in self.controls if n not in self.model.point_names]

    def points(self, t) -> dict[str, torch.Tensor]:
        """Values ``(T, *shape)`` on each site's support (and of the deterministic parameters) at ``t`` ``(T,)``."""
        ref = next(iter(self.controls.values()))
        t = torch.as_tensor(t, dtype=ref.dtype, device=ref.device).reshape(-1)
        return _constrain(_supports(self.model), _combine(self.controls, coefficients(self.kind, t, self.num_bends)))

    def line(self) -> Curve:
        """The straight segment between this curve's ends (for comparison)."""
        ends = {n: c[[0, -1]] for n, c in self.controls.items()}
        return Curve(self.model, Kind.LINE.value, ends, {"kind": Kind.LINE.value, "num_steps": 0}, x=self.x, y=self.y)

    def posterior(self, num_points: int = 10, *, ts=None, x=None, y=None) -> Posterior:
        """Points on the curve as a :class:`~bnn_pyro.Posterior`: one chain of one draw per point (like an
        ensemble's members), at ``ts`` (default ``num_points`` equally spaced values of ``t`` in ``[0, 1]``,
        ends included); ``sample_stats["t"]`` says where each draw lies. ``x``, ``y``: the training data
        (for ``to_inference_data``' log-likelihood; default: the data the curve was fitted on)."""
        ts = _grid(self, positive_int("num_points", num_points) if ts is None else ts)
        values = self.points(ts)
        samples = {n: values[n].unsqueeze(1) for n in self.latent_names}
        point = {n: values[n] for n in self.model.point_names}
        config = dict(self.config, ts=[round(float(t), 6) for t in ts])
        return Posterior(
            samples=samples,
            model=self.model,
            method="curve",
            config=config,
            point=point,
            sample_stats={"t": ts.reshape(-1, 1)},
            x=self.x if x is None else x,
            y=self.y if y is None else y,
        )


@dataclass(frozen=True)
class PathMetrics:
    """Scores at points ``t`` ``(T,)`` of a curve, each ``(T,)``: ``loss`` is the negative log joint per row of
    the data, ``-(log p(w(t)) + sum_i log p(y_i | x_i, w(t))) / n`` (on the training rows: the curve's
    objective); ``nll`` the likelihood part alone, ``-(1/n) sum_i log p(y_i | x_i, w(t))``; ``accuracy``
    (classification) or ``rmse`` of the mean (regression), the other ``None``."""

    t: torch.Tensor
    loss: torch.Tensor
    nll: torch.Tensor
    accuracy: torch.Tensor | None = None
    rmse: torch.Tensor | None = None


def fit_curve(
    source,
    x,
    y,
    *,
    ends=(0, 1),
    kind="bezier",
    num_bends: int = 1,
    num_steps: int = 1000,
    lr: float = 0.05,
    optimizer="adam",
    lr_schedule="cosine",
    batch_size: int | None = None,
    points_per_step: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> Curve:
    """Train a curve between two solutions of one ``BNN`` on ``(x, y)`` (see the module docstring).

    Parameters
    ----------
    source:
        A :class:`~bnn_pyro.Posterior` of a ``BNN`` (its model is used) or a ``BNN``.
    ends:
        The two ends: pooled draw indices of ``source`` (``(0, 1)``: an ensemble's first two members), or
        dicts of site values (every latent site of the model; deterministic parameters default to the
        model's current values), or one of each.
    kind, num_bends:
        ``"bezier"`` (default; one bend: quadratic) or ``"polyline"``, with ``num_bends`` free control points;
        the bends start on the straight segment, equally spaced.
    num_steps, lr, optimizer, lr_schedule, batch_size:
        Optimizer steps and the optimizer (as in ``bp.fit``: ``"adam"``/``"adamw"``/``"sgd"`` and
        ``"constant"``/``"cosine"``/``"exponential"``); ``batch_size`` rows per step (default: all).
    points_per_step:
        Values of ``t ~ U(0, 1)`` per step, evaluated together (the expected loss is their mean).
    seed, progress:
        Seeds the draws of ``t`` and the minibatch order; ``progress=False`` hides the progress bar.
    """
    model = _bnn(source)
    kind = choice("kind", kind, Kind)
    if kind is Kind.LINE:
        raise ValueError(
            "kind: 'line' has no bend to train; use bp.curves.line(source, ends=...) for the straight "
            "segment, or kind='bezier' / 'polyline'."
        )
    num_bends = positive_int("num_bends", num_bends)
    num_steps, points_per_step = positive_int("num_steps", num_steps), positive_int("points_per_step", points_per_step)
    lr = positive("lr", lr)
    given = (x, y)
    x, y = _checked(model, x, y)
    x, y = owned(x, given[0]), owned(y, given[1])  # the curve keeps them: never the user's memory
    data = Data(x, y, batch_size=None if batch_size is None else positive_int("batch_size", batch_size))
    joint = _joint(model, data.size).unvalidated()
    supports = _supports(model)
    start, end = _ends(source, model, ends)
    alpha = torch.linspace(0.0, 1.0, num_bends + 2, dtype=model.dtype, device=model.device)[1:-1]
    bends = {
        n: (start[n] + alpha.reshape((-1,) + (1,) * start[n].dim()) * (end[n] - start[n])).requires_grad_()
        for n in start
    }
    draws_t = torch.Generator().manual_seed(seed)  # the values of t (the driver seeds the minibatch order)

    def objective(batch, step):
        t = torch.rand(points_per_step, generator=draws_t).to(dtype=model.dtype, device=model.device)
        controls = {n: torch.cat([start[n][None], bends[n], end[n][None]]) for n in start}
        values = _constrain(supports, _combine(controls, coefficients(kind, t, num_bends)))
        loss = -_log_joint(joint, model, values, *batch).mean() / data.size
        return loss, loss.item()

    losses = descend(
        objective,
        list(bends.values()),
        data,
        num_steps=num_steps,
        lr=lr,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        seed=seed,
        method="fit_curve",
        desc=f"curve ({kind.value})",
        progress=progress,
        hint=", or check that both ends are finite fits of this model",
    )
    controls = {n: torch.cat([start[n][None], bends[n].detach(), end[n][None]]) for n in start}
    config = clean_config(
        dict(
            kind=kind.value,
            num_bends=num_bends,
            num_steps=num_steps,
            lr=lr,
            optimizer=getattr(optimizer, "value", optimizer),
            lr_schedule=getattr(lr_schedule, "value", lr_schedule),
            batch_size=batch_size,
            points_per_step=points_per_step,
            seed=seed,
            dataset_size=data.size,
            ends={k: e if isinstance(e, int) else "values" for k, e in zip(("start", "end"), ends)},
        )
    )
    return Curve(model, kind.value, controls, config, {"loss": losses}, x=x, y=y)


def line(source, *, ends=(0, 1)) -> Curve:
    """The straight segment ``(1 - t) w_0 + t w_1`` between two solutions (``source``, ``ends`` as in
    :func:`fit_curve`), in the same coordinates as a trained curve."""
    model = _bnn(source)
    _joint(model, 1)
    start, end = _ends(source, model, ends)
    controls = {n: torch.stack([start[n], end[n]]) for n in start}
    return Curve(model, Kind.LINE.value, controls, {"kind": Kind.LINE.value, "num_steps": 0})


@torch.no_grad()
def path_metrics(curve: Curve, data, ts=21) -> PathMetrics:
    """Scores of the points ``w(t)`` of ``curve`` on ``data`` (an ``(x, y)`` pair): see :class:`PathMetrics`.
    ``ts``: a number of equally spaced values of ``t`` in ``[0, 1]`` (default 21), or the values themselves."""
    if not isinstance(curve, Curve):
        raise TypeError(f"curve: expected a bp.curves.Curve (from fit_curve or line), got {type(curve).__name__}.")
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError("data: expected an (x, y) pair, e.g. path_metrics(curve, (x_test, y_test)).")
    model = curve.model
    x, y = _checked(model, *data)
    ts = _grid(curve, ts)
    joint = _joint(model, x.shape[0])
    classify = model.likelihood.task == "classification"
    out = {k: [] for k in ("loss", "nll", "score")}
    for chunk in ts.split(model.draws_per_chunk(x)):
        values = curve.points(chunk)
        d = _observation(model, values, x)
        log_lik = d.log_prob(y).double()
        log_lik = log_lik.reshape(log_lik.shape[0], -1).sum(-1)
        out["nll"].append(-log_lik / x.shape[0])
        out["loss"].append(-(joint.log_prior({n: values[n] for n in joint.priors}).double() + log_lik) / x.shape[0])
        if classify:  # the summary's draws: class probabilities (T, n, K) at each point
            probs = model.likelihood.summarize(d).draws
            out["score"].append((probs.argmax(-1) == y.reshape(-1)).double().mean(-1))
        else:
            err = (d.mean - y).double() ** 2
            out["score"].append(err.reshape(err.shape[0], -1).mean(-1).sqrt())
    score = torch.cat(out["score"])
    return PathMetrics(
        t=ts,
        loss=torch.cat(out["loss"]),
        nll=torch.cat(out["nll"]),
        accuracy=score if classify else None,
        rmse=None if classify else score,
    )


def plot_path(paths, *, metric: str = "loss", ax=None):
    """Draw ``metric`` (``"loss"``, ``"nll"``, ``"accuracy"`` or ``"rmse"``) against ``t`` for one
    :class:`PathMetrics` or a dict ``label -> PathMetrics``; returns the matplotlib ``Axes``."""
    import matplotlib.pyplot as plt

    paths = {"curve": paths} if isinstance(paths, PathMetrics) else dict(paths)
    if not paths or not all(isinstance(p, PathMetrics) for p in paths.values()):
        raise TypeError("paths: expected a PathMetrics (from path_metrics) or a dict label -> PathMetrics.")
    if metric not in ("loss", "nll", "accuracy", "rmse"):
        raise ValueError(f"metric: unknown value {metric!r}; choose one of 'loss', 'nll', 'accuracy', 'rmse'.")
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3.5))
    for label, p in paths.items():
        values = getattr(p, metric)
        if values is None:
            raise ValueError(
                f"metric: {label!r} has no {metric!r} (accuracy is for classification, rmse for regression)."
            )
        ax.plot(p.t.numpy(), values.numpy(), marker=".", label=label)
    ax.set(xlabel="t (position on the path)", ylabel=metric, title=f"{metric} along the path")
    ax.legend()
    return ax


# ------------------------------------------------------------------------------------------ helpers
def _bnn(source) -> BNN:
    model = source.model if isinstance(source, Posterior) else source
    if not isinstance(model, BNN):
        raise TypeError(
            f"source: expected a bp.Posterior of a BNN or a bp.BNN, got {type(source).__name__}"
            f"{' of a ' + type(model).__name__ if isinstance(source, Posterior) else ''}; curves are "
            "drawn in the weight space of a BNN, e.g. between two members of bp.fit(model, x, y, method='ensemble')."
        )
    return model


def _joint(model: BNN, dataset_size: int) -> LogJoint:
    joint = build(model, dataset_size)
    if joint is None:
        raise ValueError(
            "source: curves need a BNN whose priors are fixed distributions (no hierarchical prior) and "
            "without BatchNorm; use e.g. bp.priors.Normal(0., 1.) and a net without BatchNorm layers."
        )
    return joint


def _ends(source, model: BNN, ends) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The two ends in unconstrained coordinates (latent sites) and as they are (deterministic parameters)."""
    if not (isinstance(ends, (tuple, list)) and len(ends) == 2):
        raise ValueError(
            f"ends: expected a pair (two draw indices or two dicts of site values), got {ends!r}; e.g. ends=(0, 1)."
        )
    latent = list(_joint(model, 1).priors)
    return tuple(_unconstrain(_supports(model), _end_values(source, model, e, latent, i)) for i, e in enumerate(ends))


def _end_values(source, model: BNN, end, latent: list[str], which: int) -> dict[str, torch.Tensor]:
    if isinstance(end, int) and not isinstance(end, bool):
        if not isinstance(source, Posterior):
            raise TypeError(
                f"ends[{which}]: a draw index needs a Posterior as source; with a BNN pass dicts of site values."
            )
        total = source.num_chains * source.num_draws
        if not 0 <= end < total:
            raise IndexError(
                f"ends[{which}]: draw index {end} out of range; this posterior holds {total} draws "
                f"({source.num_chains} chains x {source.num_draws}), pooled in chain order."
            )
        chain, draw = divmod(end, source.num_draws)
        values = {n: source.samples[n][chain, draw] for n in latent}
        values.update({n: source.point[n][chain] for n in model.point_names if n in source.point})
    elif isinstance(end, dict):
        missing = [n for n in latent if n not in end]
        if missing:
            raise ValueError(f"ends[{which}]: missing site(s) {missing}; give a value for every latent site {latent}.")
        values = dict(end)
    else:
        raise TypeError(
            f"ends[{which}]: expected a draw index (int) or a dict of site values, got {type(end).__name__}."
        )
    values = {**model.point_values(), **values}
    out = {}
    for n in latent + model.point_names:
        v = torch.as_tensor(values[n]).detach().to(dtype=model.dtype, device=model.device)
        expected = model.param_shapes.get(n)  # None for the likelihood's noise sites
        if expected is not None and v.shape != expected:
            raise ValueError(f"ends[{which}]: site {n!r} has shape {tuple(v.shape)}, expected {tuple(expected)}.")
        out[n] = v
    return out


def _unconstrain(supports: dict, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: supports[n].inv(v) if n in supports else v for n, v in values.items()}


def _constrain(supports: dict, z: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: supports[n](v) if n in supports else v for n, v in z.items()}


def _supports(model: BNN) -> dict:
    """Latent sites that do not live on the whole real line -> the map from unconstrained values onto their support."""
    maps = {n: biject_to(d.support) for n, d in _joint(model, 1).priors.items()}
    return {n: t for n, t in maps.items() if not is_identity(t)}


def _grid(curve: Curve, ts) -> torch.Tensor:
    """``ts`` equally spaced values of ``t`` in ``[0, 1]`` (an int), or the given values, checked."""
    ref = next(iter(curve.controls.values()))
    if isinstance(ts, int) and not isinstance(ts, bool):
        return torch.linspace(0.0, 1.0, positive_int("ts", ts), dtype=ref.dtype, device=ref.device)
    ts = torch.as_tensor(ts, dtype=ref.dtype, device=ref.device).reshape(-1)
    if ts.numel() == 0 or not bool(((ts >= 0) & (ts <= 1)).all()):
        raise ValueError("ts: expected values of t in [0, 1] (or a number of equally spaced ones), e.g. ts=21.")
    return ts


def _combine(controls: dict[str, torch.Tensor], coef: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum_k coef[:, k] * controls[name][k]`` for every site: values ``(T, *shape)``."""
    return {n: torch.tensordot(coef.to(c.dtype), c, dims=([1], [0])) for n, c in controls.items()}


def _observation(model: BNN, values: dict[str, torch.Tensor], x: torch.Tensor):
    """``p(y | x, w(t))`` batched over ``T`` points ``(T, n)``."""
    f = model.forward_draws({n: values[n] for n in model.sample_names + model.point_names}, x)
    noise = {n: values[n].unsqueeze(1) for n in model.likelihood.sites()}
    return model.likelihood.distribution(f, noise)


def _checked(model: BNN, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` as tensors on the model's device, ``y`` in the likelihood's layout."""
    x, y = check_data(x, y, float_dtype=model.dtype, device=model.device)
    return x, model.likelihood.check_target(y, model.output_dim(x))


def _log_joint(joint: LogJoint, model: BNN, values: dict[str, torch.Tensor], x, y) -> torch.Tensor:
    """``log p(w(t), y | x)`` ``(T,)``, the likelihood scaled to the data set (LogJoint's own rule)."""
    points = {n: values[n] for n in model.point_names}
    return joint({n: values[n] for n in joint.priors}, x, y, points)
