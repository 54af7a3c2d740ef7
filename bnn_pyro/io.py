"""Safe, atomic saving and loading of a :class:`~bnn_pyro.Posterior`.

A file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file: the tensors (samples,
point, sample_stats, history, per-draw buffers, the model's buffers, x, y) plus one JSON metadata
entry (format and version, method, config, a SHA-256 of the tensors and a fingerprint of the
model). Loading parses JSON and raw tensor bytes only; it never unpickles, so it never runs code
from the file. Writing goes to a temporary file in the same folder, is fsynced, then renamed over
the target (``os.replace``), so a crash mid-save leaves the previous file intact; the file gets the
permissions the umask gives any new file (``0o644`` under umask 022).

The model itself (its Python code) is not stored. ``bp.load(path, model=model)`` re-binds the
posterior to a model built the same way, after checking its fingerprint (site names and shapes,
the net's architecture, the likelihood); without ``model=`` the posterior supports
``summary``/``to_inference_data`` of its samples, and ``predict`` explains that it needs a model.

Example
-------
>>> post.save("fit.bnn")
>>> again = bp.load("fit.bnn", model=model)       # the same BNN(net, prior, likelihood) recipe
>>> again.predict(x_test, seed=0)
"""

from __future__ import annotations

import copy
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as load_tensors

from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.posterior_file import (FORMAT, FORMAT_VERSION, ModelNotBoundError, PosteriorFileError, UnboundModel,
                                     fingerprint, save)
from bnn_pyro.tensor_files import digest

__all__ = ["save", "load", "PosteriorFileError", "ModelNotBoundError", "UnboundModel", "FORMAT_VERSION"]


def load(path: str | os.PathLike, model: BNN | Callable | None = None) -> Posterior:
    """Read a posterior written by :meth:`Posterior.save`; ``model=`` re-binds it for prediction.

    Raises :class:`PosteriorFileError` (a ``ValueError`` naming the path) for a corrupted,
    truncated, foreign or newer-format file, and a ``ValueError`` when ``model`` does not match
    the model the posterior was fitted with.

    Example
    -------
    >>> post = bp.load("fit.bnn", model=bp.BNN(net, prior=prior, likelihood=likelihood))
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: {str(path)!r} does not exist or is not a file; check the path (files are "
                                "written by post.save(path)).")
    raw = path.read_bytes()
    meta = _metadata(raw, path)
    try:
        tensors = load_tensors(raw)
    except Exception as err:  # safetensors raises its own error type for malformed payloads
        raise PosteriorFileError(f"{str(path)!r}: the tensor data is unreadable ({err}); the file is corrupted.") from None
    if digest(tensors) != meta.get("sha256"):
        raise PosteriorFileError(f"{str(path)!r}: checksum mismatch; the file is corrupted. Save the posterior again.")
    try:
        groups = {g: {n: tensors[f"{g}/{n}"] for n in names} for g, names in meta["groups"].items()}
        data = {k: tensors[k] for k in meta["data"]}
        parts = {k[2:]: v for k, v in data.items() if k.startswith("x/")}
        if parts:  # in the order saved (a tuple's positions)
            data["x"] = Inputs(args=tuple(parts.values())) if meta["x_form"] == "tuple" else Inputs(kwargs=parts)
        saved = meta["model"]
        method, config = meta["method"], meta["config"]
    except (KeyError, TypeError) as err:
        raise PosteriorFileError(f"{str(path)!r}: incomplete bnn_pyro metadata (missing {err}); the file is corrupted.") from None
    bound = UnboundModel(str(path), saved, groups["buffers"]) if model is None else _rebind(model, saved, groups, path)
    return Posterior(samples=groups["samples"], model=bound, method=method, config=config, point=groups["point"],
                     sample_stats=groups["sample_stats"], history=groups["history"], x=data.get("x"), y=data.get("y"),
                     draw_buffers=groups.get("draw_buffers", {}))  # absent from files written before it existed


def _metadata(raw: bytes, path: Path) -> dict[str, Any]:
    where = str(path)
    if len(raw) < 8:
        raise PosteriorFileError(f"{where!r}: the file is empty or truncated ({len(raw)} bytes); it is no bnn_pyro posterior. "
                                 "Save the posterior again with post.save(path).")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise PosteriorFileError(f"{where!r}: the file is truncated or not a bnn_pyro posterior (header of {size} bytes, "
                                 f"file of {len(raw)}). Save the posterior again with post.save(path).")
    try:
        meta = json.loads(json.loads(raw[8 : 8 + size])["__metadata__"]["bnn_pyro"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise PosteriorFileError(f"{where!r}: not a bnn_pyro posterior file (no bnn_pyro header). Files are written by "
                                 "Posterior.save; pickles and plain safetensors files are not read.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("format_version"), int):
        raise PosteriorFileError(f"{where!r}: not a bnn_pyro posterior file (format {meta.get('format')!r}).")
    if meta["format_version"] > FORMAT_VERSION:
        raise PosteriorFileError(f"{where!r}: written in format version {meta['format_version']} by a newer bnn_pyro; "
                                 f"this version reads up to {FORMAT_VERSION}. Upgrade bnn_pyro to load it.")
    return meta


def _rebind(model, saved: dict[str, Any], groups, path: Path):
    given = fingerprint(model)
    if saved.get("kind") == "function" or given["kind"] == "function":
        if given["kind"] != saved.get("kind"):
            raise ValueError(f"model: {str(path)!r} was fitted with a {saved.get('kind')} model, got a {given['kind']} "
                             "model. Pass the same kind of model it was fitted with.")
        return model
    diff = [k for k in saved if saved[k] != given.get(k)]
    if diff:
        details = "; ".join(f"{k}: saved {saved[k]!r}, given {given.get(k)!r}" for k in diff)
        raise ValueError(f"model: does not match the model the posterior in {str(path)!r} was fitted with ({details}). "
                         "Build the model with the same net, prior selection and likelihood.")
    model = copy.deepcopy(model)  # the user's model is never modified
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if name in groups["point"]:
                p.copy_(groups["point"][name][-1])  # like a fitted posterior: the last chain's values
        for name, b in model.net.named_buffers():
            if name in groups["buffers"]:
                b.copy_(groups["buffers"][name])
    return model
