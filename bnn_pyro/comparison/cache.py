"""The on-disk cache of :func:`bnn_pyro.compare`: one JSON file per method and split, plus the posterior.

A row is JSON (numbers, with Python's NaN / Infinity literals, and text), never pickle; the posterior is written by
:meth:`Posterior.save` and read back by :func:`bnn_pyro.load`, neither of which executes code from a file.
Each row records a fingerprint of what produced it (the method, its options, the seed, the model's
description and initial parameters, the split's data) and of the code that produced it (:func:`code_identity`:
the versions of bnn_pyro, torch, Pyro, ArviZ, NumPy and SciPy, and a SHA-256 of the installed ``bnn_pyro``
package's source files): a row whose fingerprint differs from the current run's is fitted again rather than
reused. The code is part of the key because a changed default (or a fixed bug) changes a fit's result while its
arguments stay the same; a version number alone misses the edits made between releases.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

import torch

from bnn_pyro.posterior import Posterior

__all__ = ["Cache", "code_identity", "fingerprint"]

PACKAGE = Path(__file__).resolve().parents[1]  # the bnn_pyro package whose source files code_identity digests
# the distributions whose code computes a row: the fit (torch, Pyro), its scores and diagnostics (ArviZ, NumPy, SciPy)
LIBRARIES = ("bnn_pyro", "torch", "pyro-ppl", "arviz", "numpy", "scipy")


@functools.cache
def code_identity() -> str:
    """What identifies the code that fits and scores a row: each of :data:`LIBRARIES`' installed version and a
    SHA-256 of every ``.py`` file of the ``bnn_pyro`` package (its path inside the package and its bytes).

    Computed once per process (the package's sources, about 2 MB, are read once); an edit of any source file,
    an upgrade of any of these libraries or a new bnn_pyro version changes it.
    """
    versions = []
    for name in LIBRARIES:
        try:
            versions.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:  # a source checkout run without installing: the digest still holds
            versions.append(f"{name}==?")
    h = hashlib.sha256(" ".join(versions).encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def fingerprint(method: str, options: dict, seed: int, model, tensors) -> str:
    """A sha256 of everything that decides a fit's result, the code that fits it included (see the module
    docstring)."""
    h = hashlib.sha256(json.dumps([code_identity(), method, seed, repr(model)], default=repr).encode())
    h.update(json.dumps(options, sort_keys=True, default=repr).encode())
    state = model.state_dict().values() if isinstance(model, torch.nn.Module) else ()
    for t in [*state, *tensors]:
        t = torch.as_tensor(t).detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


class Cache:
    """Rows and posteriors under ``folder`` (created on first write); ``None``: nothing is cached."""

    def __init__(self, folder: str | os.PathLike | None):
        self.folder = None if folder is None else Path(folder)

    def _stem(self, method: str, split: int) -> Path:
        return self.folder / f"{method}__split{split}"

    def row(self, method: str, split: int, key: str) -> dict | None:
        """The cached row of ``method`` on ``split`` if it exists and was made with fingerprint ``key``."""
        if self.folder is None:
            return None
        path = self._stem(method, split).with_suffix(".json")
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or a partial write of an interrupted run: fit again
            return None
        if saved.get("fingerprint") != key:
            return None
        return saved["row"]

    def posterior(self, method: str, split: int, model) -> Posterior | None:
        """The cached posterior of ``method`` on ``split``, bound to ``model`` (``None`` if absent or unreadable)."""
        if self.folder is None:
            return None
        from bnn_pyro.io import load

        path = self._stem(method, split).with_suffix(".bnn")
        try:
            return load(path, model=model) if path.is_file() else None
        except (OSError, ValueError):
            return None

    def write(self, method: str, split: int, key: str, row: dict, post: Posterior | None) -> None:
        """Store ``row`` (and ``post``): the posterior first and the row last, each written atomically, so that a
        row on disk always comes after its posterior."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self._stem(method, split)
        if post is not None:
            try:
                post.save(stem.with_suffix(".bnn"))  # atomic itself
            except (OSError, ValueError, TypeError):  # a posterior the file format cannot hold: keep the row only
                pass
        tmp = stem.with_suffix(".tmp.json")
        tmp.write_text(json.dumps({"fingerprint": key, "row": row}, indent=1))  # NaN and +-inf as JSON5 literals
        os.replace(tmp, stem.with_suffix(".json"))
