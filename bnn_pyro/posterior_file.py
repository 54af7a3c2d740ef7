"""The posterior file format of :mod:`bnn_pyro.io`, on the writing side: :func:`save` (``Posterior.save``),
the model's :func:`fingerprint`, the stand-in :class:`UnboundModel` of a posterior loaded without its
model, and the errors. It works on any object with a posterior's fields and does not import
:mod:`bnn_pyro.posterior`, so that ``Posterior.save`` can use it (:mod:`bnn_pyro.io` adds ``load``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN
from bnn_pyro.tensor_files import digest, write_atomic

if TYPE_CHECKING:
    from bnn_pyro.posterior import Posterior

__all__ = ["save", "fingerprint", "PosteriorFileError", "ModelNotBoundError", "UnboundModel", "FORMAT", "FORMAT_VERSION"]

FORMAT = "bnn_pyro.posterior"
FORMAT_VERSION = 1
_GROUPS = ("samples", "point", "sample_stats", "history", "draw_buffers", "buffers")  # the model's buffers last


class PosteriorFileError(ValueError):
    """The file is not a readable bnn_pyro posterior (corrupted, truncated, foreign or too new)."""


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
    """What identifies a model across sessions: its sites and shapes, architecture and likelihood."""
    if isinstance(model, UnboundModel):
        return model.fingerprint
    if isinstance(model, BNN):
        return {"kind": "BNN", "sample_names": list(model.sample_names), "hyper_names": list(model.hyper_names),
                "point_names": list(model.point_names),
                "param_shapes": {n: list(s) for n, s in model.param_shapes.items()},
                "noise_sites": sorted(model.likelihood.sites()), "likelihood": repr(model.likelihood),
                "net": repr(model._template)}
    return {"kind": "function", "name": f"{getattr(model, '__module__', '?')}.{getattr(model, '__qualname__', '?')}"}


def save(post: Posterior, path: str | os.PathLike) -> Path:
    """Write ``post`` to ``path`` atomically (see the module docstring) and return the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: the folder {str(path.parent)!r} does not exist; create it first.")
    tensors, seen = {}, set()
    groups = {g: dict(getattr(post, g)) for g in _GROUPS[:-1]}
    groups["buffers"] = (post.model.buffers_dict() if isinstance(post.model, BNN)
                          else post.model.buffers if isinstance(post.model, UnboundModel) else {})
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
        raise TypeError(f"post.config must be JSON-friendly to be saved ({err}); store values as str, "
                        "int, float, bool, None, lists or dicts.") from None
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "method": post.method, "config": config,
            "groups": {g: list(d) for g, d in groups.items()}, "data": list(data),
            "x_form": "tuple" if isinstance(post.x, Inputs) and post.x.args else "dict" if isinstance(post.x, Inputs) else "tensor",
            "model": fingerprint(post.model), "sha256": digest(tensors)}
    return write_atomic(path, tensors, {"bnn_pyro": json.dumps(meta)})
