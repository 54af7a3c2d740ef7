r"""Bayesian compression: fixed-point bit precision per layer from the posterior's variances.

Louizos, Ullrich & Welling (2017) use the posterior's uncertainty to choose how finely a layer's
weights need to be stored: a weight known only to within ``sigma`` gains nothing from digits far below
``sigma``. Per weight tensor (a *layer*) and per chain:

- the **retained** weights are those non-zero in some draw (sparse VD sets a pruned weight to exactly
  0 in every draw; the other engines retain every weight);
- each retained weight's posterior mean ``mu_i`` and standard deviation ``sigma_i`` are estimated from
  the chain's draws (sample mean and sample sd, ``S`` draws: a relative error of about
  ``1 / sqrt(2 (S - 1))`` on ``sigma_i``, 5 % at sparse VD's 200 draws);
- the grid step is the **smallest** posterior sd among them, ``delta = min_i sigma_i`` (the paper's
  unit round-off from the smallest marginal variance, taken in weight units), so rounding moves every
  retained weight by at most ``delta / 2 <= sigma_i / 2``, half a posterior sd;
- the **dynamic range** is the largest ``|mu_i|``: the rounded weights are ``k_i delta`` with integers
  ``|k_i| <= K = max_i |round(mu_i / delta)|``, which a signed fixed-point code holds in
  ``bits = 1 + ceil(log2(K + 1))`` bits (one sign bit plus the magnitude). A layer pruned away
  entirely needs 0 bits.

:func:`quantization_report` gives, per layer, ``total`` and ``kept`` weights, ``bits``, the ``step``
``delta``, ``max_abs`` (the range) and ``compression = 32 total / (bits kept)``: the float32 tensor's size
over the retained weights' size at ``bits`` each (the positions of the retained weights in a sparse
layer are not counted; a layer whose rows/columns are pruned away entirely shrinks without them).
:func:`quantize` returns the deterministic network these numbers describe, as a one-draw
:class:`~bnn_pyro.Posterior`: the layers' posterior means rounded to their grids (pruned weights 0),
every other latent site (biases, noise scales) at its posterior mean, unrounded.

Supported engines, those whose posterior is a Gaussian per weight (so that the marginal sd is
the whole of the weight's uncertainty): ``method="sparse_vd"``, ``"variational_dropout"`` (their VD
weights, ``post.config["vd_weights"]``) and ``"svi"`` with ``guide="mean_field"`` (the Bayesian
``nn.Linear``/``nn.Conv`` weights of a :class:`~bnn_pyro.BNN`). Any other posterior is refused with a
clear error. With several chains (independent restarts that prune and place their weights
independently) each chain gets its own grid; the report gives the mean ``kept`` and the largest
``bits`` over the chains.

Reference: Louizos, C., Ullrich, K. & Welling, M. (2017). Bayesian compression for deep learning. NeurIPS.

Example
-------
>>> post = bp.fit(model, x, y, method="sparse_vd", seed=0)
>>> quantization_report(post)            # per layer: total, kept, bits, step, max_abs, compression
>>> small = quantize(post)               # rounded posterior-mean net, a one-draw Posterior
>>> small.predict(x_test).predicted
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

from bnn_pyro.infer.variational_dropout import Variant, vd_weight_names
from bnn_pyro.posterior import Posterior

__all__ = ["quantization_report", "quantize", "supported_methods"]

FLOAT_BITS = 32
supported_methods = ("sparse_vd", "variational_dropout", "svi (guide='mean_field')")


@dataclass(frozen=True)
class _Layer:
    """One weight tensor of one chain on its grid."""

    total: int
    kept: int
    bits: int
    step: float  # nan when nothing is kept
    max_abs: float
    rounded: torch.Tensor  # the rounded posterior mean (pruned weights 0)


def _weight_names(posterior: Posterior) -> list[str]:
    """The weight tensors to quantize, or a clear error for an unsupported posterior."""
    if not isinstance(posterior, Posterior):
        raise TypeError(f"posterior: expected a bnn_pyro.Posterior (from bp.fit), got {type(posterior).__name__}.")
    if posterior.method in {v.value for v in Variant}:
        names = str(posterior.config.get("vd_weights", "")).split(",")
    elif posterior.method == "svi" and posterior.config.get("guide") == "mean_field":
        try:
            names = vd_weight_names(posterior.model)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"posterior: quantization acts on the Bayesian nn.Linear/nn.Conv weights of a bp.BNN; "
                f"this svi posterior has none ({err})"
            ) from err
    else:
        guide = f" with guide={posterior.config.get('guide')!r}" if posterior.method == "svi" else ""
        raise ValueError(
            f"posterior: quantization needs a posterior that is a Gaussian per weight, from one of "
            f"{', '.join(supported_methods)}; got method={posterior.method!r}{guide}. Refit with "
            "method='sparse_vd' (which also prunes) or method='svi', guide='mean_field'."
        )
    missing = [n for n in names if n not in posterior.samples]
    if missing:
        raise ValueError(
            f"posterior: the weights {missing} named by its config are not among its samples "
            f"{list(posterior.samples)}; was the posterior edited after fitting?"
        )
    if posterior.num_draws < 2:
        raise ValueError(
            f"posterior: the posterior sd of each weight is estimated from its draws, which needs at "
            f"least 2 draws per chain; this posterior has {posterior.num_draws}. Refit with more "
            "num_samples (e.g. the engine's default)."
        )
    return names


def _quantize_layer(draws: torch.Tensor) -> _Layer:
    """``draws``: one chain's draws of one weight tensor, shaped ``(S, *shape)``."""
    kept = (draws != 0).any(0)
    mean = draws.mean(0).masked_fill(~kept, 0.0)
    total, num_kept = mean.numel(), int(kept.sum())
    if num_kept == 0:
        return _Layer(total, 0, 0, math.nan, 0.0, mean)
    step = draws.double().std(0, correction=1)[kept].min().item()
    if step <= 0.0:
        raise ValueError(
            "posterior: a retained weight has zero posterior sd in its draws (all draws equal), so "
            "its grid step would be 0; quantization needs a posterior with spread per weight."
        )
    k = torch.round(mean.double() / step)
    bits = 1 + math.ceil(math.log2(int(k.abs().max()) + 1))
    return _Layer(total, num_kept, bits, step, mean.abs().max().item(), (k * step).to(mean.dtype))


def _layers(posterior: Posterior) -> dict[str, list[_Layer]]:
    return {n: [_quantize_layer(chain) for chain in posterior.samples[n]] for n in _weight_names(posterior)}


def quantization_report(posterior: Posterior) -> pd.DataFrame:
    """Per weight tensor: ``total``, ``kept``, ``bits``, ``step``, ``max_abs`` and ``compression`` vs
    float32 (see the module docstring for the rule), plus an ``"all"`` row (``bits`` there is the mean
    over the kept weights; ``compression`` that of the whole set).

    Example
    -------
    >>> quantization_report(bp.fit(model, x, y, method="sparse_vd"))["bits"]
    """
    rows = {}
    for name, chains in _layers(posterior).items():
        kept = sum(c.kept for c in chains) / len(chains)
        rows[name] = {
            "total": chains[0].total,
            "kept": kept,
            "bits": max(c.bits for c in chains),
            "step": min(c.step for c in chains),
            "max_abs": max(c.max_abs for c in chains),
        }
    stored = {n: r["bits"] * r["kept"] for n, r in rows.items()}
    total, kept = sum(r["total"] for r in rows.values()), sum(r["kept"] for r in rows.values())
    rows["all"] = {
        "total": total,
        "kept": kept,
        "bits": sum(stored.values()) / kept if kept else 0.0,
        "step": math.nan,
        "max_abs": max(r["max_abs"] for r in rows.values()),
    }
    stored["all"] = sum(stored.values())
    table = pd.DataFrame.from_dict(rows, orient="index")
    table["compression"] = [FLOAT_BITS * table.at[n, "total"] / s if s else math.inf for n, s in stored.items()]
    return table


def quantize(posterior: Posterior) -> Posterior:
    """The compressed deterministic network: each supported layer's posterior mean rounded to its grid
    (pruned weights 0), the other latent sites at their posterior means; one draw per chain.

    The result predicts like any posterior (``quantize(post).predict(x)``); its
    ``config["quantized_bits"]`` gives the bits per layer and chain.

    Example
    -------
    >>> acc = (quantize(post).predict(x_test).predicted == y_test).float().mean()
    """
    layers = _layers(posterior)
    samples = {k: v.mean(1, keepdim=True) for k, v in posterior.samples.items()}
    for name, chains in layers.items():
        samples[name] = torch.stack([c.rounded for c in chains]).unsqueeze(1)
    config = {
        **posterior.config,
        "quantized": "louizos2017",
        "quantized_bits": {n: [c.bits for c in chains] for n, chains in layers.items()},
    }
    return Posterior(
        samples=samples,
        model=posterior.model,
        method=posterior.method,
        config=config,
        point=dict(posterior.point),
        history=dict(posterior.history),
        x=posterior.x,
        y=posterior.y,
        feature_names=posterior.feature_names,  # a DataFrame given to predict is matched by name, as before
    )
