"""Checkpoint and resume of the iterative engines: every method whose declaration says ``checkpoint=True``
(:class:`~bnn_pyro.infer.contract.Capabilities`; Laplace: its MAP search, subspace: each stage's own,
:mod:`bnn_pyro.infer.subspace`; MCMC's kernel state: :mod:`bnn_pyro.infer.mcmc`).

``bp.fit(..., checkpoint=FOLDER, checkpoint_every=N)`` writes one file per chain,
``FOLDER/chain{c}.ckpt``, every ``N`` steps and after the last one. A file holds the step, the
chain's state (SVI: the Pyro parameter store's unconstrained values, the optimizer's and the
learning-rate scheduler's state; the other engines, through :class:`StepCheckpoint`: the optimized
tensors, optimizer and scheduler, their per-step records and extra state (:class:`ExtraState`: early
stopping, an engine's own generator, e.g. MC dropout's masks, SWAG's moments); SG-MCMC and snapshot
ensembles: the position, the :class:`~bnn_pyro.infer.sgmcmc_step.SGMCMC` optimizer's momentum, step size,
power-iteration vector and noise generator, the draws kept so far and csgmcmc's held-out state),
everything recorded so far (losses, draws, statistics), and the random number generators (torch's
global generator and Python's and NumPy's, which Pyro draws from, every CUDA device's once CUDA is
initialised). The minibatch stream is replayed from its seed
up to the step, so a resumed run is bit-identical to an uninterrupted one (for a ``DataLoader`` only if the loader itself is
deterministic). ``resume=True`` continues every chain from its file (chains without one start
afresh); without it, an existing checkpoint in the folder is an error, so that none is overwritten.
``bp.fit`` also holds the folder's lock (one writer at a time) and checks on resume that the model and data are
those the checkpoints were written for (:mod:`bnn_pyro.infer.checkpoint_folder`).

Format: a safetensors file (tensors; byte tensors for the generator states) with one JSON metadata
entry (step, configuration, non-tensor state) and a SHA-256 of the tensors and the metadata (format version 2;
files of version 1, whose checksum covers the tensors only, still resume). Reading parses JSON and
raw tensor bytes only (nothing is unpickled). Writes go to a temporary file in the same folder, are
fsynced and renamed over the previous file (``os.replace``): a process killed mid-write leaves the
previous checkpoint intact. Files get the permissions the umask gives any new file (as
:func:`bnn_pyro.io.save`: both write through :func:`bnn_pyro.posterior.tensor_files.write_atomic`).

Example
-------
>>> post = bp.fit(model, x, y, method="svi", num_steps=20000, checkpoint="run1", checkpoint_every=1000)
>>> post = bp.fit(model, x, y, method="svi", num_steps=20000, checkpoint="run1", resume=True)  # after a crash
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors

from bnn_pyro.infer.declaration import RENAMED_OPTIONS
from bnn_pyro.posterior.tensor_files import digest, write_atomic
from bnn_pyro.utils.checks import positive_int

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "StepCheckpoint",
    "ExtraState",
    "write",
    "read",
    "FORMAT",
    "open_chains",
    "check_shapes",
    "checkpoint_folder",
    "current_names",
    "descent_state",
    "restore_descent",
]

FORMAT = "bnn_pyro.checkpoint"
FORMAT_VERSION = 2  # 2: the checksum covers the metadata too (1 still resumes)


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, or does not belong to the run that tries to resume from it."""


def current_names(saved: dict, run: dict) -> dict:
    """``saved`` (a file's run description) with the options renamed since it was written under their new names:
    ``old`` becomes ``new`` where the file has ``old`` but not ``new`` and this ``run`` has ``new`` but not ``old``
    (so one old name renamed differently by two engines, e.g. ``rank``, follows the engine's own)."""
    out = dict(saved)
    for old, new in RENAMED_OPTIONS:
        if old in out and new not in out and new in run and old not in run:
            out[new] = out.pop(old)
    return out


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` and the JSON-friendly ``meta`` to ``path`` atomically (module docstring)."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "meta": meta}
    header["sha256"] = digest(tensors, header)
    return write_atomic(Path(path), tensors, {"bnn_pyro": json.dumps(header)})


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of a checkpoint written by :func:`write`; :class:`CheckpointError`
    for a truncated, corrupted or foreign file."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(json.loads(raw[8 : 8 + size])["__metadata__"]["bnn_pyro"])
        tensors = load_tensors(raw)
    except Exception:  # truncated, not safetensors, or no bnn_pyro header
        raise CheckpointError(
            f"checkpoint: {str(path)!r} is not a readable bnn_pyro checkpoint (truncated or "
            "foreign file). Delete it to start afresh, or pass the folder of an intact run."
        ) from None
    header = header if isinstance(header, dict) else {}
    kind, version = header.get("format"), header.get("format_version")
    if kind != FORMAT or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint: {str(path)!r} has format {kind!r} version {version!r}; this bnn_pyro "
            f"reads {FORMAT} up to {FORMAT_VERSION}."
        )
    covered = {k: v for k, v in header.items() if k != "sha256"} if version >= 2 else None
    if digest(tensors, covered) != header.get("sha256") or not isinstance(header.get("meta"), dict):
        raise CheckpointError(
            f"checkpoint: {str(path)!r} fails its checksum (the tensors or the metadata changed "
            "after writing: corrupted or edited). Delete it to start afresh."
        )
    return tensors, header["meta"]


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The global generators Pyro draws from (torch, Python ``random``, NumPy, and every CUDA device's once
    CUDA is initialised) as tensors + JSON."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_py = random.getstate()
    tensors = {"rng/torch": torch.get_rng_state(), "rng/numpy": torch.from_numpy(keys.astype(np.int64))}
    if _cuda_in_use():
        tensors.update({f"rng/cuda/{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    meta = {"numpy": [kind, int(pos), int(has_gauss), float(gauss)], "random": [version, list(internal), gauss_py]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(tensors["rng/torch"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_py = meta["random"]
    random.setstate((version, tuple(internal), gauss_py))
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k[9:]))]
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            raise CheckpointError(
                f"resume: the checkpoint holds the random state of {len(cuda)} CUDA device(s), "
                f"but this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                "; resume it where it ran (a resumed run is bit-identical only on the same devices)."
            )
        torch.cuda.set_rng_state_all(cuda)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def flatten_state(prefix: str, state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A ``state_dict`` (nested dicts/lists of tensors and plain values) as JSON, its tensors moved
    into ``tensors`` under ``prefix/...`` and replaced by ``{"__tensor__": key}``."""
    if torch.is_tensor(state):
        tensors[prefix] = state
        return {"__tensor__": prefix}
    if isinstance(state, dict):
        return {"__dict__": [[k, flatten_state(f"{prefix}/{k}", v, tensors)] for k, v in state.items()]}
    if isinstance(state, (list, tuple)):
        return [flatten_state(f"{prefix}/{i}", v, tensors) for i, v in enumerate(state)]
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(
        f"checkpoint: cannot store a {type(state).__name__} in the optimizer or scheduler state "
        f"({prefix}); use a built-in optimizer and lr_schedule, or checkpoint=None."
    )


def unflatten_state(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten_state` (tuples come back as lists)."""
    if isinstance(state, dict) and "__tensor__" in state:
        return tensors[state["__tensor__"]]
    if isinstance(state, dict):
        return {k: unflatten_state(v, tensors) for k, v in state["__dict__"]}
    if isinstance(state, list):
        return [unflatten_state(v, tensors) for v in state]
    return state


def descent_state(step: int, opt, sched, losses: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What every descent's checkpoint holds besides its parameters, after ``step`` steps: the first ``step``
    losses (into ``tensors`` as ``"losses"``) and the optimizer's and scheduler's states (their tensors into
    ``tensors``, :func:`flatten_state`), returned as the metadata entries ``"optimizer"`` and ``"scheduler"``.
    :func:`restore_descent` reads them back."""
    tensors["losses"] = losses[:step]
    return {
        "optimizer": flatten_state("optimizer", opt.state_dict(), tensors),
        "scheduler": None if sched is None else flatten_state("scheduler", sched.state_dict(), tensors),
    }


def restore_descent(tensors: dict[str, torch.Tensor], meta: dict[str, Any], opt, sched, losses: torch.Tensor) -> int:
    """Load what :func:`descent_state` saved into ``opt``, ``sched`` and the first ``step`` entries of ``losses``
    (``step``: the file's, ``meta["step"]``); returns ``step``."""
    opt.load_state_dict(unflatten_state(meta["optimizer"], tensors))
    if sched is not None:
        sched.load_state_dict(unflatten_state(meta["scheduler"], tensors))
    step = meta["step"]
    losses[:step] = tensors["losses"]
    return step


def check_shapes(path: Path, expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Refuse to resume from ``path`` when a saved tensor's shape is not this run's (another net: the folder's
    identity, :mod:`bnn_pyro.infer.checkpoint_folder`, usually says so first; files without one get here)."""
    for key, own in expected.items():
        if key in tensors and tensors[key].shape != own.shape:
            raise CheckpointError(
                f"resume: {str(path)!r} holds {key} shaped {tuple(tensors[key].shape)}; this run's is "
                f"shaped {tuple(own.shape)}: the checkpoint belongs to another model. Resume with "
                "the model it was written for, or pass another checkpoint folder."
            )


def checkpoint_folder(folder: str | os.PathLike) -> Path:
    """``checkpoint=``'s folder as a :class:`~pathlib.Path`; :class:`FileNotFoundError` when it is not an existing
    folder (a fit does not create it). The check of :func:`bnn_pyro.infer.checkpoint_folder.guard` and of each
    :class:`Checkpoint`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"checkpoint: the folder {str(folder)!r} does not exist; create it first "
            "(checkpoint= names a folder that gets one file per chain)."
        )
    return folder


class Checkpoint:
    """One chain's checkpoint file: :meth:`load` (the saved state, or ``None``) and :meth:`due` /
    :meth:`save` inside the step loop. ``run`` identifies the run (method and configuration):
    resuming from a file of another run is an error."""

    def __init__(self, folder: str | os.PathLike, *, every: int | None, resume: bool, chain: int, run: dict):
        folder = checkpoint_folder(folder)
        self.path = folder / f"chain{chain}.ckpt"
        self.every = None if every is None else positive_int("checkpoint_every", every)
        self.run = json.loads(json.dumps(run))
        if not resume and self.path.exists():
            raise FileExistsError(
                f"checkpoint: {str(self.path)!r} already exists. Pass resume=True to continue that "
                "run, or another (empty) folder to start a new one; it is never overwritten."
            )
        self.resume = resume

    def load(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The saved tensors and metadata to resume from (``None``: start afresh); restores the
        global generators."""
        if not (self.resume and self.path.exists()):
            return None
        tensors, meta = read(self.path)
        saved, run = run_identity(current_names(meta.get("run", {}), self.run)), run_identity(self.run)
        if saved != run:
            diff = sorted(k for k in set(run) | set(saved) if run.get(k) != saved.get(k))
            raise CheckpointError(
                f"resume: {str(self.path)!r} belongs to another run (differs in {diff}). Resume with "
                "the same method and configuration, or pass another checkpoint folder."
            )
        set_rng_state(tensors, meta["rng"])
        return tensors, meta

    def due(self, step: int, num_steps: int) -> bool:
        """Save after ``step`` steps? Every ``every`` steps, and after the last one."""
        return step == num_steps or (self.every is not None and step % self.every == 0)

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        rng_tensors, rng_meta = rng_state()
        write(self.path, {**tensors, **rng_tensors}, {**meta, "step": step, "run": self.run, "rng": rng_meta})


MEASURED = frozenset({"laplace_k_hat", "preconditioner_damping", "k_hat", "damping"})
"""Run-record keys (at any depth) measured from the data rather than chosen: a Laplace approximation's PSIS
``k_hat`` and the damping its Hessian needed. Their last bits follow the float reductions' order, which the thread
count changes, so they are recorded in ``post.config`` but kept out of a checkpoint's run identity
(:func:`run_identity`, applied to both sides when a resume compares them): what they decide (the start, the collection, the preconditioner) is recorded beside them."""


def run_identity(config: dict) -> dict:
    """``config`` without the :data:`MEASURED` keys (nested dicts included): what a checkpoint's run must match."""
    return {k: run_identity(v) if isinstance(v, dict) else v for k, v in config.items() if k not in MEASURED}


def open_chains(checkpoint, *, every: int | None, resume: bool, num_chains: int, run: dict) -> list[Checkpoint | None]:
    """One :class:`Checkpoint` per chain (``None`` each without ``checkpoint=``); the engines' shared checks."""
    if checkpoint is None:
        if every is not None or resume:
            raise ValueError(
                "checkpoint_every= and resume= need checkpoint=FOLDER (the folder of the checkpoint files)."
            )
        return [None] * num_chains
    return [Checkpoint(checkpoint, every=every, resume=resume, chain=c, run=run) for c in range(num_chains)]


class StepCheckpoint:
    """A run of :func:`~bnn_pyro.infer.driver.descend` as a checkpoint (its ``resumable``): the optimized
    tensors ``params`` (by position), the optimizer, the scheduler, the losses, the engine's per-step
    ``records`` (filled up to the step) and its ``extra`` state (an object with ``state_dict() -> (tensors,
    meta)`` and ``load_state_dict(tensors, meta)``, e.g. early stopping's best state)."""

    def __init__(
        self, ckpt: Checkpoint, params: list[torch.Tensor], records: dict[str, torch.Tensor] | None = None, extra=None
    ):
        self.ckpt, self.params, self.records, self.extra = ckpt, params, records or {}, extra

    def due(self, step: int, num_steps: int) -> bool:
        return self.ckpt.due(step, num_steps)

    def save(self, step: int, opt, sched, losses: torch.Tensor) -> None:
        tensors = {f"param/{i}": p for i, p in enumerate(self.params)}
        tensors.update({f"record/{k}": v[:step] for k, v in self.records.items()})
        meta = descent_state(step, opt, sched, losses, tensors)
        if self.extra is not None:
            extra_tensors, meta["extra"] = self.extra.state_dict()
            tensors.update({f"extra/{k}": v for k, v in extra_tensors.items()})
        self.ckpt.save(step, tensors, meta)

    def restore(self, opt, sched, losses: torch.Tensor) -> int:
        saved = self.ckpt.load()
        if saved is None:
            return 0
        tensors, meta = saved
        missing = [f"param/{i}" for i in range(len(self.params)) if f"param/{i}" not in tensors]
        if missing or "optimizer" not in meta:  # e.g. an SG-MCMC file of bnn_pyro before its engines ran on descend
            raise CheckpointError(
                f"resume: {str(self.ckpt.path)!r} holds another layout of this run's state (it lacks "
                f"{missing or ['the optimizer state']}): it was written by another bnn_pyro version. "
                "Resume it with the version that wrote it, or delete it to start afresh."
            )
        check_shapes(self.ckpt.path, {f"param/{i}": p for i, p in enumerate(self.params)}, tensors)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(tensors[f"param/{i}"])
        step = restore_descent(tensors, meta, opt, sched, losses)
        for k, v in self.records.items():
            v[:step] = tensors[f"record/{k}"]
        if self.extra is not None:
            self.extra.load_state_dict(
                {k[len("extra/") :]: v for k, v in tensors.items() if k.startswith("extra/")}, meta["extra"]
            )
        return step


class ExtraState:
    """Several pieces of an engine's state as the one ``extra`` of :class:`StepCheckpoint`, by name: a
    ``torch.Generator``; a list (of tensors, updated in place, or of JSON values, replaced); or an object with
    ``state_dict() -> (tensors, meta)`` and ``load_state_dict(tensors, meta)`` (e.g. early stopping's
    :class:`~bnn_pyro.infer.holdout.BestOnHoldout`).

    >>> extra = ExtraState(masks=generator, baseline=[], best=best)   # MC dropout's
    """

    def __init__(self, **parts):
        self.parts = parts

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = {}, {}
        for name, part in self.parts.items():
            if isinstance(part, torch.Generator):
                tensors[f"{name}/state"], meta[name] = part.get_state(), "generator"
            elif isinstance(part, list) and all(torch.is_tensor(v) for v in part):
                tensors.update({f"{name}/{i}": v for i, v in enumerate(part)})
                meta[name] = {"tensors": len(part)}
            elif isinstance(part, list):
                meta[name] = {"json": list(part)}
            else:
                own, meta[name] = part.state_dict()
                tensors.update({f"{name}/{k}": v for k, v in own.items()})
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            own = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(f"{name}/")}
            if isinstance(part, torch.Generator):
                part.set_state(own["state"])
            elif isinstance(part, list) and "json" in meta[name]:
                part[:] = meta[name]["json"]
            elif isinstance(part, list):
                with torch.no_grad():
                    for i, v in enumerate(part):
                        v.copy_(own[str(i)])
            else:
                part.load_state_dict(own, meta[name])


# ---------------------------------------------------------------------- the engines' states
def save_svi(ckpt: Checkpoint, step: int, opt, sched, losses: torch.Tensor) -> None:
    """Save an SVI chain after ``step`` steps: the param store (unconstrained), optimizer, scheduler, losses."""
    import pyro

    tensors = {f"param/{n}": p for n, p in pyro.get_param_store().named_parameters()}
    ckpt.save(step, tensors, descent_state(step, opt, sched, losses, tensors))


def restore_svi(ckpt: Checkpoint, opt, sched, losses: torch.Tensor) -> int:
    """Restore what :func:`save_svi` saved (if there is a file to resume from); returns the step."""
    import pyro

    saved = ckpt.load()
    if saved is None:
        return 0
    tensors, meta = saved
    store = dict(pyro.get_param_store().named_parameters())
    check_shapes(ckpt.path, {f"param/{n}": p for n, p in store.items()}, tensors)
    with torch.no_grad():
        for key, value in tensors.items():
            if key.startswith("param/"):
                name = key[len("param/") :]
                if name in store:
                    store[name].copy_(value)
                else:  # created after the first step (e.g. a REINFORCE baseline)
                    pyro.param(name, value.clone())
    return restore_descent(tensors, meta, opt, sched, losses)
