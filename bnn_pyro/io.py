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
import hashlib
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__all__ = ["save", "load", "PosteriorFileError", "ModelNotBoundError", "UnboundModel", "FORMAT_VERSION"]

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
            "model": fingerprint(post.model), "sha256": _digest(tensors)}
    return _write_atomic(path, tensors, {"bnn_pyro": json.dumps(meta)})


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    """Write a safetensors file to a temporary file beside ``path``, fsync it, rename it over ``path``.

    The file gets the permissions the umask gives any new file (``0o644`` under the usual umask 022):
    the temporary file is created exclusively (``O_EXCL``) with mode ``0o666`` less the umask, and
    that mode is set again after safetensors has written it (``save_file`` leaves ``0o600``, as
    ``tempfile.mkstemp`` would). Shared by :func:`save` and :mod:`bnn_pyro.infer.checkpoint`."""
    tmp = _new_temporary(path)
    try:
        mode = tmp.stat().st_mode & 0o777
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _new_temporary(path: Path) -> Path:
    """An empty file ``.<name>.<random>.tmp`` beside ``path``, created by this call (never an existing
    file or a link), with the permissions the umask gives a new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"path: could not create a temporary file in {str(path.parent)!r} (100 names taken); "
                          "remove stale .*.tmp files there and try again.")


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
    if _digest(tensors) != meta.get("sha256"):
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


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
