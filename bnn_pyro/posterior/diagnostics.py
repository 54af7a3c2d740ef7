"""ArviZ diagnostics for every engine: :func:`to_inference_data` and :func:`summary`.

The ``InferenceData`` is built directly from a :class:`~bnn_pyro.Posterior` (not with
``arviz.from_pyro``, which fails on random-walk kernels), so every engine gets the same groups:
``posterior`` (one variable per latent site, dims ``"0.weight_dim_0"``, ...), ``sample_stats``
(ArviZ's names: ``diverging``, ``acceptance_rate``, ``step_size``, ``tree_depth``, ``n_steps``,
``energy``, ``lp``), ``log_likelihood`` (``"obs"`` pointwise, ``(chain, draw, data)``: ready for
``az.loo`` and ``az.waic``), ``posterior_predictive``, ``observed_data`` and ``constant_data``, at
the training data by default. New inputs alone (``x=x_new``) give ``posterior_predictive`` and
``constant_data`` only: a log-likelihood needs the observations at those inputs (``y=``).

Thresholds of :func:`summary`'s warnings: R-hat above :data:`RHAT_MAX` (1.01) and bulk or tail ESS
below :data:`ESS_PER_CHAIN` (100) times the number of chains, as recommended by Vehtari et al.
(2021), "Rank-normalization, folding, and localization: an improved R-hat".

Example
-------
>>> idata = post.to_inference_data()
>>> az.loo(idata)
>>> post.summary(space="function")          # R-hat and ESS of f(x) at 20 training inputs
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

import arviz as az
import numpy as np
import pandas as pd
import torch

from bnn_pyro.model import BNN, check_model_data
from bnn_pyro.utils import user_warnings
from bnn_pyro.utils.checks import choice, flag, match_columns, positive_int
from bnn_pyro.utils.upstream_private import PARETO_MIN_DRAWS, arviz_log_level

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = ["to_inference_data", "summary", "function_draws", "DiagnosticWarning", "Space", "RHAT_MAX", "ESS_PER_CHAIN"]

RHAT_MAX = 1.01
ESS_PER_CHAIN = 100
NUM_FUNCTION_INPUTS = 20
_STAT_ALIASES = {
    "diverging": ("diverging", "divergences", "divergent", "divergence"),
    "acceptance_rate": (
        "acceptance_rate",
        "accept_prob",
        "acceptance_prob",
        "mean_accept_prob",
        "accept_rate",
        "accept_stat",
    ),
    "step_size": ("step_size", "stepsize"),
    "tree_depth": ("tree_depth", "treedepth", "depth"),
    "n_steps": ("n_steps", "num_steps", "n_leapfrog", "num_leapfrog"),
    "energy": ("energy", "hamiltonian"),
    "lp": ("lp", "log_density", "log_joint"),
}
_ARVIZ_NAME = {alias: name for name, aliases in _STAT_ALIASES.items() for alias in aliases}


class Space(str, Enum):
    """Where :func:`summary` measures convergence: the weights or the network's outputs."""

    WEIGHTS = "weights"
    FUNCTION = "function"


class DiagnosticWarning(UserWarning):
    """A convergence problem found by :func:`summary` (divergences, high R-hat, low ESS), or an approximation
    that misses posterior mass found by :func:`bnn_pyro.posterior.psis.psis` (Pareto k-hat > 0.7)."""


def _require_model(post: Posterior, what: str) -> None:
    if getattr(post.model, "is_unbound", False):
        post.model(what=what)  # raises ModelNotBoundError with the file's path and what to do


def sample_stats(post: Posterior) -> dict[str, np.ndarray]:
    """The engine's per-draw statistics under ArviZ's names, each ``(chains, draws)`` (without ``log_q``, the
    density of an approximation at its draws, which :mod:`bnn_pyro.posterior.psis` reads)."""
    shape = (post.num_chains, post.num_draws)
    out = {}
    for name, value in post.sample_stats.items():
        if name == "log_q":  # q's density at each draw (approximations; post.psis()), not a sampler's statistic
            continue
        arr = torch.as_tensor(value).detach().cpu().numpy()
        if name == "potential_energy":
            name, arr = "lp", -arr
        name = _ARVIZ_NAME.get(name, name)
        if arr.shape in ((), (shape[0],)):
            arr = np.broadcast_to(arr.reshape(arr.shape + (1,) * (2 - arr.ndim)), shape)
        if arr.shape[:2] != shape:
            raise ValueError(
                f"sample_stats[{name!r}] has shape {arr.shape}; expected (chains, draws) = {shape}, one value per "
                "draw (or one per chain). Fix the engine that produced this Posterior."
            )
        out[name] = arr.astype(bool) if name == "diverging" else arr
    return out


def to_inference_data(
    post: Posterior,
    *,
    x=None,
    y=None,
    log_likelihood: bool | None = None,
    posterior_predictive: bool = True,
    seed: int = 0,
    draws_per_chunk: int = 64,
    points_per_chunk: int = 4096,
) -> az.InferenceData:
    """An ``arviz.InferenceData`` for ``post`` (see the module docstring for its groups).

    Parameters
    ----------
    post:
        Any engine's posterior.
    x, y:
        Data for the pointwise groups. Neither: the training data (``post.x``, ``post.y``). ``x``
        alone (new inputs): ``posterior_predictive`` and ``constant_data`` at ``x``, and no
        ``log_likelihood`` or ``observed_data`` (there is nothing observed at ``x``; the training
        ``y`` is never paired with other inputs, whatever their number). ``x`` and ``y`` (e.g.
        held-out data): every group, at those pairs. ``y`` alone is an error. Without data (a fit
        from a loader) or without a bound model (``bp.load`` without ``model=``) only ``posterior``
        and ``sample_stats`` are built.
    log_likelihood:
        Whether to compute the pointwise log-likelihood; ``None`` (default): wherever ``y`` is
        known. ``True`` with new ``x`` but no ``y`` is an error.
    posterior_predictive:
        Whether to draw the posterior predictive (one pass over the draws with the log-likelihood,
        ``draws_per_chunk`` draws by ``points_per_chunk`` data points at a time, so memory stays
        bounded for large ``N``).
    seed:
        Seed of the posterior predictive draws (the global RNG state is left untouched).

    Example
    -------
    >>> idata = bp.diagnostics.to_inference_data(post)
    >>> az.waic(idata)
    >>> held_out = post.to_inference_data(x=x_test, y=y_test)       # log_likelihood at the test pairs
    >>> new = post.to_inference_data(x=x_new)                        # posterior_predictive at x_new only
    """
    draws_per_chunk = positive_int("draws_per_chunk", draws_per_chunk)
    points_per_chunk = positive_int("points_per_chunk", points_per_chunk)
    if x is None and y is not None:
        raise ValueError(
            "y: given without x. y is paired row by row with the inputs it was observed at; pass "
            "both (x=x_test, y=y_test), or neither to use the training data."
        )
    if x is None:
        x, y = post.x, post.y
    posterior_predictive = flag("posterior_predictive", posterior_predictive)
    log_likelihood = y is not None if log_likelihood is None else flag("log_likelihood", log_likelihood)
    if log_likelihood and x is not None and y is None:
        raise ValueError(
            "log_likelihood=True needs the observations at x: pass y= with x=, or drop "
            "log_likelihood to get the posterior predictive at x alone."
        )
    groups = {
        "posterior": {k: v.detach().cpu().numpy() for k, v in post.samples.items()},
        "sample_stats": sample_stats(post),
    }
    unbound = getattr(post.model, "is_unbound", False)
    if x is None and (log_likelihood or posterior_predictive):
        user_warnings.warn(
            "to_inference_data: no data for the log_likelihood and posterior_predictive groups (the fit streamed its "
            "batches, so the posterior holds no training data); LOO and WAIC need them: pass x= and y= (e.g. a subset "
            "that fits in memory), or log_likelihood=False, posterior_predictive=False to silence this.",
            UserWarning,
        )
    if x is not None:
        x, y = check_model_data(post.model, match_columns(x, post.feature_names), y)  # clear errors for bad inputs
        if y is not None:
            groups["observed_data"] = {"obs": y.cpu().numpy()}
        named = {"": x} if isinstance(x, torch.Tensor) else (x.kwargs or {str(i): t for i, t in enumerate(x.args)})
        groups["constant_data"] = {"x" + (f"_{k}" if k else ""): t.cpu().numpy() for k, t in named.items()}
        if (log_likelihood or posterior_predictive) and not unbound:
            ll, pp = _pointwise(post, x, y if log_likelihood else None, seed, draws_per_chunk, points_per_chunk)
            if log_likelihood:
                groups["log_likelihood"] = {"obs": ll}
                total = post.num_chains * post.num_draws
                if total < PARETO_MIN_DRAWS:  # az.loo pools chains: its Pareto fit sees `total` draws per point
                    user_warnings.warn(
                        f"to_inference_data: this {post.method} posterior has {total} draw{'s' if total != 1 else ''} "
                        f"in all ({post.num_chains} chain(s) of {post.num_draws}), so LOO is undefined on its "
                        "log_likelihood group: az.loo pools the chains, and its Pareto smoothing needs at least "
                        f"{PARETO_MIN_DRAWS} draws in all (with fewer every pointwise k is inf; with one draw it "
                        "fails with an IndexError); az.waic's penalty, a variance over draws, rests on as few (0 with "
                        f"one draw). For them fit >= {PARETO_MIN_DRAWS} draws in all (e.g. num_chains >= "
                        f"{PARETO_MIN_DRAWS} for SWA, one draw per chain) or use an engine that draws "
                        "(method='nuts', 'swag', 'laplace'); the group itself is kept.",
                        UserWarning,
                    )
            if posterior_predictive:
                groups["posterior_predictive"] = {"obs": pp}
    return from_dict(**groups, dims={"obs": ["data"], "x": ["data"]})


def from_dict(**groups) -> az.InferenceData:
    """``arviz.from_dict`` for arrays that are ``(chains, draws, ...)`` by construction: without its
    FutureWarning about its own refactor, and without its shape guess "more chains than draws",
    which is wrong for ensembles and SWA (one draw per chain)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        warnings.filterwarnings("ignore", message="More chains", category=UserWarning)
        return az.from_dict(**groups)


def _pointwise(post: Posterior, x, y, seed, draws_per_chunk, points_per_chunk):
    """Log-likelihood ``(C, D, N)`` of ``y`` (``None`` without ``y``) and posterior predictive draws
    ``(C, D, N, ...)`` of ``"obs"`` at ``x``."""
    total, n = post.num_chains * post.num_draws, x.shape[0]
    ll = None if y is None else np.empty((total, n))
    pp = None
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for i in range(0, total, draws_per_chunk):
            idx = torch.arange(i, min(i + draws_per_chunk, total))
            for j in range(0, n, points_per_chunk):
                rows = slice(j, j + points_per_chunk)
                if isinstance(post.model, BNN):
                    d = post.observation_distribution(x[rows], idx, draws_per_chunk=draws_per_chunk)
                    lp = None if y is None else d.log_prob(y[rows])
                    sample = d.sample()
                else:
                    sites = [post.trace_draw(int(k), x[rows], None if y is None else y[rows]).nodes["obs"] for k in idx]
                    lp = None if y is None else torch.stack([s["fn"].log_prob(s["value"]) for s in sites])
                    sample = torch.stack([s["fn"].sample() for s in sites])
                if pp is None:
                    pp = np.empty((total, n) + tuple(sample.shape[2:]), dtype=sample.cpu().numpy().dtype)
                if lp is not None:
                    ll[idx.numpy(), rows] = lp.reshape(len(idx), -1).cpu().numpy()
                pp[idx.numpy(), rows] = sample.cpu().numpy()
    shape = (post.num_chains, post.num_draws)
    return (None if ll is None else ll.reshape(shape + ll.shape[1:])), pp.reshape(shape + pp.shape[1:])


def function_draws(post: Posterior, x, *, draws_per_chunk: int = 64) -> torch.Tensor:
    """The network output ``f(x)`` at every draw, shaped ``(chains, draws, N, out)``.

    A ``BNN`` is evaluated in batches of draws; a Pyro function model is traced once per draw and
    must record ``pyro.deterministic("f", ...)``.
    """
    _require_model(post, "evaluate the network in function space")
    x = post.inputs(x)  # checked as the fit checked its inputs (a Pyro function model: check_data's defaults)
    total = post.num_chains * post.num_draws
    with torch.no_grad():
        if isinstance(post.model, BNN):  # the network alone (not a Laplace fit's linearization), in chunks of draws
            f = post.network_outputs(
                x, draws_per_chunk=positive_int("draws_per_chunk", draws_per_chunk), linearized=False
            )
        else:
            traces = [post.trace_draw(i, x) for i in range(total)]
            if "f" not in traces[0].nodes:
                raise ValueError(
                    "space='function' needs the model to record pyro.deterministic('f', net_output); "
                    "this model has no site 'f'. Add it, or use space='weights'."
                )
            f = torch.stack([t.nodes["f"]["value"] for t in traces])
    f = f if f.dim() > 2 else f.unsqueeze(-1)
    return f.reshape((post.num_chains, post.num_draws) + f.shape[1:])


def site_names(post: Posterior, var_names: str | Sequence[str] | None) -> list[str]:
    """The sites ``var_names`` names: every site for ``None``, one for a string (as ArviZ takes it; ``list("2.bias")``
    would be its characters), else each of the sequence; an unknown name is a ``ValueError`` listing the sites."""
    names = list(post.samples) if var_names is None else [var_names] if isinstance(var_names, str) else list(var_names)
    unknown = [n for n in names if n not in post.samples]
    if unknown:
        raise ValueError(
            f"var_names: unknown site(s) {unknown}; this posterior has {list(post.samples)}. Pass one of them "
            "(a string) or a list of them."
        )
    return names


def summary(
    post: Posterior, *, space: str = "weights", x=None, var_names: Sequence[str] | None = None, warn: bool = True
) -> pd.DataFrame:
    """``arviz.summary`` (mean, sd, hdi_3%, hdi_97%, mcse_mean, mcse_sd, ess_bulk, ess_tail, r_hat).

    Parameters
    ----------
    space:
        ``"weights"``: one row per scalar of each latent site (``var_names`` picks sites).
        ``"function"``: one row per network output ``f(x)`` at inputs ``x`` (default: up to 20
        evenly spaced training inputs, labelled by row). Weight-space R-hat overstates problems in
        BNNs, whose posteriors are symmetric under hidden-unit permutations and sign flips; the
        function is what to judge convergence by.
    warn:
        Issue a :class:`DiagnosticWarning` for divergences, R-hat above 1.01 and ESS below
        100 per chain. With one chain R-hat is NaN; that is noted in ``table.attrs["notes"]``.

    Example
    -------
    >>> post.summary(var_names=["sigma"])
    >>> post.summary(space="function", x=x_test[:10])
    """
    kind = choice("space", space, Space)
    if kind is Space.WEIGHTS:
        if x is not None:
            raise ValueError("x: only used with space='function'; drop x or pass space='function'.")
        names = site_names(post, var_names)
        data = {n: post.samples[n].detach().cpu().numpy() for n in names}
        dims, coords = None, None
    else:
        if var_names is not None:
            raise ValueError("var_names: only used with space='weights'; with space='function' choose inputs with x=.")
        rows = None
        if x is None:
            if post.x is None:
                raise ValueError("x: this posterior has no training inputs (fit from a loader); pass x= explicitly.")
            rows = torch.linspace(0, post.x.shape[0] - 1, min(NUM_FUNCTION_INPUTS, post.x.shape[0])).round().long()
            x = post.x[rows]
        data = {"f": function_draws(post, x).cpu().numpy()}
        dims = {"f": ["input", "output"]}
        coords = {"input": (rows if rows is not None else torch.arange(data["f"].shape[2])).tolist()}
    with arviz_log_level(logging.ERROR), warnings.catch_warnings():  # ArviZ's 1-chain warning: our note below
        if post.num_draws == 1:  # numpy's ddof warnings for the NaN statistics the note explains
            warnings.simplefilter("ignore", RuntimeWarning)
        table = az.summary(from_dict(posterior=data, dims=dims, coords=coords), kind="all")
    table.attrs["notes"] = []
    if post.num_draws == 1:
        table.attrs["notes"].append(
            "One draw per chain (an ensemble member or an SWA point per chain): R-hat, ESS "
            "and MCSE need several draws per chain and are NaN; mean and sd are over chains."
        )
    elif post.num_chains == 1:
        table.attrs["notes"].append(
            "R-hat needs at least 2 chains and is NaN here; fit with num_chains >= 2 "
            "(independent restarts for SVI) to check convergence between chains."
        )
    if warn:
        for message in _problems(post, table, kind):
            user_warnings.warn(" ".join([message] + table.attrs["notes"]), DiagnosticWarning)
    return table


def _problems(post: Posterior, table: pd.DataFrame, space) -> list[str]:
    messages = []
    stats = sample_stats(post)
    if "diverging" in stats and stats["diverging"].any():
        count = int(stats["diverging"].sum())
        chains = int(stats["diverging"].any(1).sum())
        messages.append(
            f"{count} of {stats['diverging'].size} transitions diverged ({chains} of {post.num_chains} chains): the "
            "sampler could not follow the posterior's curvature, so the draws may be biased. Try a higher "
            "target_accept (e.g. 0.95), more warm-up, or a reparameterized (non-centered) prior."
        )
    bad_rhat = int((table["r_hat"] > RHAT_MAX).sum())
    if bad_rhat:
        msg = (
            f"{bad_rhat} of {len(table)} parameters have R-hat > {RHAT_MAX} (max {table['r_hat'].max():.3g}): "
            "the chains disagree. Try longer runs or more warm-up."
        )
        if space is Space.WEIGHTS and (isinstance(post.model, BNN) or getattr(post.model, "is_bnn", False)):
            msg += (
                " Weight-space R-hat is misleading for BNNs: hidden units can be permuted and sign-flipped "
                "without changing the function, so chains in different modes disagree on weights but not "
                "on predictions. Check summary(space='function')."
            )
        messages.append(msg)
    threshold = ESS_PER_CHAIN * post.num_chains
    low = (table["ess_bulk"] < threshold) | (table["ess_tail"] < threshold)
    if int(low.sum()):
        messages.append(
            f"{int(low.sum())} of {len(table)} parameters have bulk or tail ESS below {threshold} "
            f"({ESS_PER_CHAIN} per chain; min {min(table['ess_bulk'].min(), table['ess_tail'].min()):.0f}): "
            "means, quantiles and R-hat are unreliable. Try more draws, more warm-up or thinning less."
        )
    return messages
