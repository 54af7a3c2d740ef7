"""Safe, atomic saving and loading of a :class:`~bnn_pyro.Posterior`.

A file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file: the tensors (samples,
point, sample_stats, history, per-draw buffers, the model's buffers, x, y) plus one JSON metadata
entry (format and version, method, config, a fingerprint of the model, and a SHA-256 of the tensors and,
from format version 2, of the metadata itself; every field is checked on load). Loading parses JSON and raw tensor bytes only; it never unpickles, so it never runs code
from the file. Writing goes to a temporary file in the same folder, is fsynced, then renamed over
the target (``os.replace``), so a crash mid-save leaves the previous file intact; the file gets the
permissions the umask gives any new file (``0o644`` under umask 022).

The model itself (its Python code) is not stored. ``bp.load(path, model=model)`` re-binds the
posterior to a model built the same way, after checking its fingerprint (site names and shapes,
the net's architecture, each site's prior, the likelihood); without ``model=`` the posterior supports
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors

from bnn_pyro.inputs import Inputs
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior
from bnn_pyro.posterior.posterior_file import (
    FORMAT,
    FORMAT_VERSION,
    ModelMismatchError,
    ModelNotBoundError,
    PosteriorFileError,
    UnboundModel,
    fingerprint,
    save,
)
from bnn_pyro.posterior.posterior_file import (
    GROUPS as _GROUP_NAMES,
)
from bnn_pyro.posterior.tensor_files import digest

__all__ = [
    "save",
    "load",
    "PosteriorFileError",
    "ModelMismatchError",
    "ModelNotBoundError",
    "UnboundModel",
    "FORMAT_VERSION",
]


def load(path: str | os.PathLike, model: BNN | Callable | None = None) -> Posterior:
    """Read a posterior written by :meth:`Posterior.save`; ``model=`` re-binds it for prediction.

    Raises :class:`PosteriorFileError` (a ``ValueError`` naming the path, and the field where one is at fault)
    for a corrupted, truncated, edited, foreign or newer-format file, and its subclass
    :class:`ModelMismatchError` when ``model`` differs from the model the posterior was fitted with (the net,
    the prior of a site, the likelihood: the message names what differs). The checksum covers the tensors and,
    from format version 2 on, the metadata; files of version 1 (bnn_pyro before it) still load.

    Example
    -------
    >>> post = bp.load("fit.bnn", model=bp.BNN(net, prior=prior, likelihood=likelihood))
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"path: {str(path)!r} does not exist or is not a file; check the path (files are "
            "written by post.save(path))."
        )
    raw = path.read_bytes()
    meta = _metadata(raw, path)
    try:
        tensors = load_tensors(raw)
    except Exception as err:  # safetensors raises its own error type for malformed payloads
        raise PosteriorFileError(
            f"{str(path)!r}: the tensor data is unreadable ({err}); the file is corrupted."
        ) from None
    covered = {k: v for k, v in meta.items() if k != "sha256"} if meta["format_version"] >= 2 else None
    if digest(tensors, covered) != meta.get("sha256"):
        raise PosteriorFileError(
            f"{str(path)!r}: checksum mismatch (field 'sha256': the tensors or the metadata "
            "changed after saving); the file is corrupted or was edited. Save the posterior again."
        )
    groups, data = _contents(meta, tensors, path)
    saved, method, config = meta["model"], meta["method"], meta["config"]
    bound = UnboundModel(str(path), saved, groups["buffers"]) if model is None else _rebind(model, saved, groups, path)
    return Posterior(
        samples=groups["samples"],
        model=bound,
        method=method,
        config=config,
        point=groups["point"],
        sample_stats=groups["sample_stats"],
        history=groups["history"],
        x=data.get("x"),
        y=data.get("y"),
        draw_buffers=groups.get("draw_buffers", {}),  # absent from files written before it existed
        feature_names=_feature_names(meta, path),
    )


def _feature_names(meta: dict[str, Any], path: Path) -> list[str] | None:
    """The fitted DataFrame's column names, ``None`` when the fit had none (and in files older than the field)."""
    names = meta.get("feature_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise PosteriorFileError(
            f"{str(path)!r}: field 'feature_names' is not a list of column names; the file is corrupted or was "
            "edited. Save the posterior again."
        )
    return names


def _contents(meta: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path):
    """The groups and the data of a file's metadata, each field checked: a :class:`PosteriorFileError` naming the
    field for one that is missing, of the wrong type, names an absent tensor, or holds tensors whose shapes do
    not fit the draws and the model (a file edited by hand would otherwise fail later, inside ``predict``)."""

    def bad(field: str, what: str) -> PosteriorFileError:
        return PosteriorFileError(
            f"{str(path)!r}: field {field!r} {what}; the file is corrupted or was edited. Save the posterior again."
        )

    expected = {"method": str, "config": dict, "groups": dict, "data": list, "x_form": str, "model": dict}
    for field, kind in expected.items():
        if not isinstance(meta.get(field), kind):
            raise bad(
                field,
                f"is {'missing' if field not in meta else type(meta[field]).__name__}, expected a {kind.__name__}",
            )
    if meta["x_form"] not in ("tuple", "dict", "tensor"):
        raise bad("x_form", f"is {meta['x_form']!r}, expected 'tuple', 'dict' or 'tensor'")
    if meta["model"].get("kind") not in ("BNN", "function"):
        raise bad("model", f"has kind {meta['model'].get('kind')!r}, expected 'BNN' or 'function'")
    required = ("samples", "point", "sample_stats", "history", "buffers")
    for g in (*required, *meta["groups"]):
        names = meta["groups"].get(g)
        if g not in _GROUP_NAMES or not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise bad(
                f"groups.{g}",
                "is missing or unknown"
                if g not in meta["groups"] or g not in _GROUP_NAMES
                else "is not a list of names",
            )
        absent = [n for n in names if f"{g}/{n}" not in tensors]
        if absent:
            raise bad(f"groups.{g}", f"names tensors the file does not hold ({absent})")
    absent = [k for k in meta["data"] if not isinstance(k, str) or k not in tensors]
    if absent:
        raise bad("data", f"names tensors the file does not hold ({absent})")
    groups = {g: {n: tensors[f"{g}/{n}"] for n in names} for g, names in meta["groups"].items()}
    _check_shapes(groups, meta["model"], bad)
    data = {k: tensors[k] for k in meta["data"]}
    parts = {k[2:]: v for k, v in data.items() if k.startswith("x/")}
    if parts:  # in the order saved (a tuple's positions)
        data["x"] = Inputs(args=tuple(parts.values())) if meta["x_form"] == "tuple" else Inputs(kwargs=parts)
    rows = {k: int(v.shape[0]) for k, v in data.items() if torch.is_tensor(v) and v.dim()}
    if len(set(rows.values())) > 1:
        raise bad("data", f"holds inputs and targets of different numbers of rows ({rows})")
    return groups, data


def _check_shapes(groups, model: dict[str, Any], bad) -> None:
    """Every draw tensor shaped ``(chains, draws, *shape)`` with the same chains and draws (the sites' draws
    floating point); for a BNN, every site's and point parameter's shape that of the model's parameter."""
    lead = {n: tuple(t.shape[:2]) for n, t in groups["samples"].items()}
    if any(t.dim() < 2 for t in groups["samples"].values()) or len(set(lead.values())) > 1:
        raise bad("groups.samples", f"holds draws that are not shaped (chains, draws, ...) alike ({lead})")
    chains, draws = next(iter(lead.values()), (None, None))
    for g in ("samples", "draw_buffers") if lead else ():
        for n, t in groups.get(g, {}).items():
            if t.dim() < 2 or tuple(t.shape[:2]) != (chains, draws) or g == "samples" and not t.is_floating_point():
                kind = "floating point draws" if g == "samples" else "per-draw buffers"  # a buffer may be a count
                raise bad(
                    f"groups.{g}",
                    f"holds {n!r} as {t.dtype} {tuple(t.shape)}; expected {kind} shaped "
                    f"({chains}, {draws}, ...) like the sites' draws",
                )
    if model.get("kind") != "BNN":
        return
    shapes = model.get("param_shapes")
    if not isinstance(shapes, dict):
        raise bad("model.param_shapes", "is missing")
    for g, lead_dims in (("samples", 2), ("point", 1)):
        for n, t in groups[g].items():
            if n in shapes and list(t.shape[lead_dims:]) != shapes[n]:
                raise bad(
                    f"groups.{g}",
                    f"holds {n!r} shaped {tuple(t.shape)}, but the model's parameter is shaped {tuple(shapes[n])}",
                )


def _metadata(raw: bytes, path: Path) -> dict[str, Any]:
    where = str(path)
    if len(raw) < 8:
        raise PosteriorFileError(
            f"{where!r}: the file is empty or truncated ({len(raw)} bytes); it is no bnn_pyro posterior. "
            "Save the posterior again with post.save(path)."
        )
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise PosteriorFileError(
            f"{where!r}: the file is truncated or not a bnn_pyro posterior (header of {size} bytes, "
            f"file of {len(raw)}). Save the posterior again with post.save(path)."
        )
    try:
        meta = json.loads(json.loads(raw[8 : 8 + size])["__metadata__"]["bnn_pyro"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise PosteriorFileError(
            f"{where!r}: not a bnn_pyro posterior file (no bnn_pyro header). Files are written by "
            "Posterior.save; pickles and plain safetensors files are not read."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("format_version"), int):
        raise PosteriorFileError(f"{where!r}: not a bnn_pyro posterior file (format {meta.get('format')!r}).")
    if meta["format_version"] > FORMAT_VERSION:
        raise PosteriorFileError(
            f"{where!r}: written in format version {meta['format_version']} by a newer bnn_pyro; "
            f"this version reads up to {FORMAT_VERSION}. Upgrade bnn_pyro to load it."
        )
    return meta


def _rebind(model, saved: dict[str, Any], groups, path: Path):
    given = fingerprint(model)
    if saved.get("kind") == "function" or given["kind"] == "function":
        if given["kind"] != saved.get("kind"):
            raise ModelMismatchError(
                f"model: {str(path)!r} was fitted with a {saved.get('kind')} model, got a "
                f"{given['kind']} model. Pass the same kind of model it was fitted with."
            )
        return model
    diff = []
    for key in saved:  # a file of format version 1 holds no prior: it is not compared
        old, new = saved[key], given.get(key)
        if isinstance(old, dict) and isinstance(new, dict):  # by site: name the sites that differ
            diff += [
                f"{key} of {name!r}: saved {old.get(name, 'none')!s}, given {new.get(name, 'none')!s}"
                for name in sorted(set(old) | set(new))
                if old.get(name) != new.get(name)
            ]
        elif old != new:
            diff.append(f"{key}: saved {old!r}, given {new!r}")
    if diff:
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        raise ModelMismatchError(
            f"model: does not match the model the posterior in {str(path)!r} was fitted with "
            f"({shown}). Build the model with the same net, prior and likelihood."
        )
    own = dict(model.net.named_buffers())
    odd = {
        n: (tuple(t.shape), tuple(own[n].shape))
        for n, t in groups["buffers"].items()
        if n in own and t.shape != own[n].shape
    }
    if odd:
        raise PosteriorFileError(
            f"{str(path)!r}: field 'groups.buffers' holds buffers shaped unlike the model's "
            f"(name: (saved, model's): {odd}); the file was edited, or the model differs. Build "
            "the model the same way, or save the posterior again."
        )
    model = copy.deepcopy(model)  # the user's model is never modified
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if name in groups["point"]:
                p.copy_(groups["point"][name][-1])  # like a fitted posterior: the last chain's values
        for name, b in model.net.named_buffers():
            if name in groups["buffers"]:
                b.copy_(groups["buffers"][name])
    return model
