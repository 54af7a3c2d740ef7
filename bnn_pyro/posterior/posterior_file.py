"""The posterior file format of :mod:`bnn_pyro.io`, on the writing side: :func:`save` (``Posterior.save``),
the model's :func:`fingerprint`, the stand-in :class:`UnboundModel` of a posterior loaded without its
model, and the errors. It works on any object with a posterior's fields and does not import
:mod:`bnn_pyro.posterior`, so that ``Posterior.save`` can use it (:mod:`bnn_pyro.io` adds ``load``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN
from bnn_pyro.posterior.tensor_files import digest, write_atomic

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = [
    "save",
    "fingerprint",
    "describe",
    "PosteriorFileError",
    "ModelMismatchError",
    "ModelNotBoundError",
    "UnboundModel",
    "FORMAT",
    "FORMAT_VERSION",
    "GROUPS",
]

FORMAT = "bnn_pyro.posterior"
FORMAT_VERSION = 2  # 2: the checksum covers the metadata too, and the model's fingerprint its prior (1 still loads)
GROUPS = ("samples", "point", "sample_stats", "history", "draw_buffers", "buffers")  # the model's buffers last


class PosteriorFileError(ValueError):
    """The file is not a readable bnn_pyro posterior (corrupted, truncated, edited, foreign or too new), or the
    model given to load it with is not the one it was fitted with (:class:`ModelMismatchError`)."""


class ModelMismatchError(PosteriorFileError):
    """``bp.load(path, model=model)``: ``model`` differs from the fitted one (architecture, prior or likelihood)."""


class ModelNotBoundError(TypeError):
    """A loaded posterior was asked for something that needs the model, which files do not store."""


class UnboundModel:
    """Stands in for the model of a posterior loaded without ``model=``; calling it explains why
    that does not work and what to do."""

    is_unbound = True

    def __init__(self, path: str, fingerprint: dict[str, Any], buffers: dict[str, torch.Tensor] | None = None):
        self.path, self.fingerprint, self.buffers = path, fingerprint, dict(buffers or {})
        self.is_bnn = fingerprint.get("kind") == "BNN"

    def __call__(self, *args, what: str = "predict", **kwargs):
        raise ModelNotBoundError(
            f"cannot {what}: this Posterior was loaded from {self.path!r} without its model (files store the "
            "draws, not the Python code). Rebuild the model the same way and pass it: "
            f"bp.load({self.path!r}, model=model)."
        )

    def __getattr__(self, name: str):  # e.g. .likelihood or .forward_draws of the missing BNN
        if name.startswith("_"):
            raise AttributeError(name)
        self(what=f"use model.{name}")

    def __repr__(self) -> str:
        return f"UnboundModel(path={self.path!r}, kind={self.fingerprint.get('kind')!r})"


def fingerprint(model) -> dict[str, Any]:
    """What identifies a model across sessions: its sites and shapes, architecture, prior and likelihood.

    The prior is each random site's distribution as the model draws it (:meth:`~bnn_pyro.BNN.prior_distributions`,
    described by :func:`describe`), so a lambda or a custom ``Prior`` is compared by what it gives, not by its code."""
    if isinstance(model, UnboundModel):
        return model.fingerprint
    if isinstance(model, BNN):
        return {
            "kind": "BNN",
            "sample_names": list(model.sample_names),
            "hyper_names": list(model.hyper_names),
            "point_names": list(model.point_names),
            "param_shapes": {n: list(s) for n, s in model.param_shapes.items()},
            "noise_sites": sorted(model.likelihood.sites()),
            "likelihood": repr(model.likelihood),
            "net": repr(model._template),
            "prior": {name: describe(d) for name, d in model.prior_distributions().items()},
        }
    return {"kind": "function", "name": f"{getattr(model, '__module__', '?')}.{getattr(model, '__qualname__', '?')}"}


def describe(d) -> str:
    """A distribution (or a transform) as text that is equal for equal ones: its type, shapes, parameters (a
    constant tensor by its value, any other by a hash of its values to 6 significant digits) and inner
    distributions and transforms, e.g. ``Independent(Normal(loc=0, scale=1; batch (3, 1)); 2)``."""
    if isinstance(d, torch.distributions.Independent):
        return f"Independent({describe(d.base_dist)}; {d.reinterpreted_batch_ndims})"
    parts = []
    for name in getattr(d, "arg_constraints", {}):  # every form (probs and logits): lazily derived ones too
        try:
            value = getattr(d, name)
        except (AttributeError, NotImplementedError):
            continue
        if torch.is_tensor(value) or isinstance(value, (int, float)):
            parts.append(f"{name}={_values(torch.as_tensor(value))}")
    for value in vars(d).values():  # inner distributions (a base, a mixture's parts) and transforms
        if isinstance(value, (torch.distributions.Distribution, torch.distributions.Transform)):
            parts.append(describe(value))
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.distributions.Transform):
            parts += [describe(t) for t in value]
    if not isinstance(d, torch.distributions.Distribution):  # a transform: its own tensors (an affine's loc, scale)
        parts += [
            f"{k}={_values(torch.as_tensor(v))}"
            for k, v in sorted(vars(d).items())
            if not k.startswith("_") and (torch.is_tensor(v) or isinstance(v, (int, float))) and not isinstance(v, bool)
        ]
        return f"{type(d).__name__}({', '.join(parts)})"
    shapes = f"; batch {tuple(d.batch_shape)}" + (f", event {tuple(d.event_shape)}" if d.event_shape else "")
    return f"{type(d).__name__}({', '.join(parts)}{shapes})"


def _values(t: torch.Tensor) -> str:
    t = t.detach().to("cpu", torch.float64)
    if t.numel() and bool((t == t.reshape(-1)[0]).all()):
        return f"{t.reshape(-1)[0].item():.6g}"
    rounded = [f"{v:.6g}" for v in t.reshape(-1).tolist()]
    return "#" + hashlib.sha256(",".join(rounded).encode()).hexdigest()[:12]


def save(post: Posterior, path: str | os.PathLike) -> Path:
    """Write ``post`` to ``path`` atomically (see the module docstring) and return the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: the folder {str(path.parent)!r} does not exist; create it first.")
    tensors, seen = {}, set()
    groups = {g: dict(getattr(post, g)) for g in GROUPS[:-1]}
    groups["buffers"] = (
        post.model.buffers_dict()
        if isinstance(post.model, BNN)
        else post.model.buffers
        if isinstance(post.model, UnboundModel)
        else {}
    )
    data = {k: v for k, v in (("x", post.x), ("y", post.y)) if v is not None}
    if isinstance(post.x, Inputs):  # several inputs: "x/0", "x/1" (a tuple) or "x/tokens" (a dict)
        del data["x"]
        named = post.x.kwargs or {str(i): t for i, t in enumerate(post.x.args)}
        data.update({f"x/{k}": t for k, t in named.items()})
    for key, value in [(f"{g}/{n}", v) for g, d in groups.items() for n, v in d.items()] + list(data.items()):
        t = torch.as_tensor(value).detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if ptr in seen and t.numel() else t  # safetensors refuses shared storage
        seen.add(ptr)
    try:
        config = json.loads(json.dumps(post.config))
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"post.config must be JSON-friendly to be saved ({err}); store values as str, "
            "int, float, bool, None, lists or dicts."
        ) from None
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": post.method,
        "config": config,
        "groups": {g: list(d) for g, d in groups.items()},
        "data": list(data),
        "x_form": "tuple"
        if isinstance(post.x, Inputs) and post.x.args
        else "dict"
        if isinstance(post.x, Inputs)
        else "tensor",
        "model": fingerprint(post.model),
    }
    if post.feature_names is not None:  # a DataFrame's columns (absent from older files)
        meta["feature_names"] = list(post.feature_names)
    meta["sha256"] = digest(tensors, meta)  # the checksum covers the metadata too (format version 2)
    return write_atomic(path, tensors, {"bnn_pyro": json.dumps(meta)})
