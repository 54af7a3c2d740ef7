"""What every engine with its own chains or step loop shares, written once.

* :func:`run_chains` and :func:`chain` — one chain's world: its own copy of the model, its own (scoped) Pyro
  parameter store, and the global generators seeded with the chain's seed. Everything an engine draws or
  learns for one chain happens inside it, so chains never see each other's parameters and a seed fixes a
  chain. Chains run one after another or in forked processes (:class:`ChainMethod`; never forked once CUDA
  is initialised, nor where a forked child could not run autograd: :func:`autograd_survives_fork`).
* :func:`descend` — the gradient loop of the optimization-based engines: minibatches (full batch,
  shuffled minibatches, a loader or a one-shot stream, replayed on resume; or an engine's own stream), the
  optimizer and its learning-rate schedule, the progress bar, the stop with advice when the loss stops being finite,
  data-parallel gradient averaging, per-step callbacks and checkpoint/resume.
* :class:`ChainRun` and :func:`assemble` — what a chain returns, and the one place where chains are
  stacked into the :class:`~bnn_pyro.Posterior` (every engine's draws shaped ``(chains, draws, ...)``).

Example
-------
>>> def one_chain(fitted, info):                           # inside the chain's own copy and param store
...     params, objective = ...                              # the engine's state and its loss on a batch
...     losses = descend(objective, params, data, num_steps=1000, lr=1e-2, seed=info.seed,
...                      method="svi", desc=f"svi chain {info.index}")
...     return ChainRun(fitted, samples=..., point=..., history={"loss": losses})
>>> post = assemble(run_chains(model, num_chains, seed, one_chain), method="svi", config=config, data=data)
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import pyro
import torch

from bnn_pyro.infer._common import Data, progress_bar
from bnn_pyro.infer.optim import make_optimizer, make_schedule
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import choice
from bnn_pyro.utils.user_warnings import warn

__all__ = [
    "run_chains",
    "chain_execution",
    "fork_refusal",
    "autograd_survives_fork",
    "ChainMethod",
    "ChainInfo",
    "chain",
    "descend",
    "ChainRun",
    "assemble",
    "stack",
    "Resumable",
    "Objective",
    "divergence_advice",
]

# the loss of one minibatch: (the tensor to differentiate, the value to record); ``step`` is the step index
Objective = Callable[[tuple, int], "tuple[torch.Tensor, float]"]


class ChainMethod(str, Enum):
    """How chains run: ``"sequential"`` in this process, ``"parallel"`` in forked processes (one per core),
    ``"auto"`` parallel where it can be (fork available, 2+ cores, CUDA not initialised, a forked child able to run
    autograd: :func:`autograd_survives_fork`), else sequential;
    ``"vectorized"`` (MCMC's NUTS/HMC on the analytic fast path only: :mod:`bnn_pyro.infer._vectorized`) all chains
    as one batched computation in this process, never chosen by ``"auto"`` (its draws differ from the others')."""

    AUTO = "auto"
    SEQUENTIAL = "sequential"
    PARALLEL = "parallel"
    VECTORIZED = "vectorized"


@dataclass(frozen=True)
class ChainInfo:
    """Which chain a body runs: its ``index``, its ``seed`` (``seed + index``) and the terminal ``line`` of its
    progress bar (0 unless chains run side by side)."""

    index: int
    seed: int
    line: int = 0


def run_chains(
    model,
    num_chains: int,
    seed: int,
    body: Callable[[object, ChainInfo], ChainRun],
    *,
    how: ChainMethod | str = ChainMethod.SEQUENTIAL,
    copy_model: bool = True,
    method: str = "fit",
    decided: bool = False,
) -> list[ChainRun]:
    """``body(fitted, info)`` for chains ``0 .. num_chains - 1``, each inside :func:`chain` (with
    ``copy_model=False`` every chain uses ``model`` itself, e.g. MCMC's shared deterministic parameters).
    ``how``: see :class:`ChainMethod` and :func:`chain_execution`; a forked chain's model copy stays in its
    process (its :class:`ChainRun` comes back with ``model`` set to this process's ``model``). ``decided``: ``how``
    is already :func:`chain_execution`'s answer (MCMC decides before it opens its checkpoints), not asked again."""

    def one(c: int, line: int) -> ChainRun:
        with chain(model, seed + c, copy_model=copy_model) as fitted:
            return body(fitted, ChainInfo(c, seed + c, line))

    execution = ChainMethod(how).value if decided else chain_execution(num_chains, how, method)
    if execution == "vectorized":  # MCMC runs its batched chains itself (bnn_pyro.infer._vectorized)
        raise ValueError(
            f"chain_method='vectorized' applies to method='nuts' and 'hmc' only, not {method!r}; use "
            "chain_method='auto', 'parallel' or 'sequential'."
        )
    if execution == "sequential":
        return [one(c, 0) for c in range(num_chains)]

    def remote(c: int, line: int) -> ChainRun:
        run = one(c, line)
        run.model = None  # not sent back: the parent's model stands in for it
        return run

    runs, workers = [], min(num_chains, _cores())
    for first in range(0, num_chains, workers):
        jobs = [_start(remote, c, c - first) for c in range(first, min(first + workers, num_chains))]
        runs += [_finish(*job, method) for job in jobs]
    for run in runs:
        run.model = model
    return runs


def chain_execution(num_chains: int, how: ChainMethod | str, method: str = "fit") -> str:
    """``"sequential"``, ``"parallel"`` or ``"vectorized"``: how ``num_chains`` chains will run for ``how``.
    ``"parallel"`` needs the fork start method, 2+ cores, no CUDA context in this process (a forked child
    cannot use its parent's CUDA context; the chain bodies are closures, which spawned processes cannot
    receive) and a forked child that can run autograd (:func:`autograd_survives_fork`), else it is an error;
    ``"auto"`` then falls back to sequential with a warning. ``"vectorized"`` is returned for
    ``how="vectorized"`` only (whatever the cores). Decided where the chains start, after the parent's own
    gradient work (a start, a MAP of the deterministic parameters), which is what can make the fork unsafe."""
    how = choice("chain_method", how, ChainMethod)
    if how is ChainMethod.VECTORIZED:
        return "vectorized"
    if num_chains == 1 or how is ChainMethod.SEQUENTIAL:
        return "sequential"
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    forkable = "fork" in mp.get_all_start_methods() and _cores() > 1 and not cuda
    refusal = fork_refusal() if forkable else None
    if forkable and refusal is None:
        return "parallel"
    why = (
        "CUDA is initialised in this process (forked processes cannot use it)"
        if cuda
        else f"only {_cores()} core available"
        if _cores() < 2
        else "the 'fork' start method is unavailable"
        if not forkable
        else refusal
    )
    if how is ChainMethod.PARALLEL:
        raise ValueError(
            f"chain_method='parallel' cannot run here: {why}. It needs the 'fork' start method, 2+ "
            "cores, no CUDA context and autograd that survives a fork; use chain_method='auto' or 'sequential'."
        )
    warn(
        f"{method}: {why}, so the {num_chains} chains run one after another (config['chain_execution'] = 'sequential')."
    )
    return "sequential"


def _accelerator() -> str | None:
    """The non-CPU device type torch sees (without initialising it), or None: what makes autograd start device
    threads."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, XPU, MPS, ...
    if accelerator is not None:
        return accelerator.current_accelerator().type if accelerator.is_available() else None
    return "cuda" if torch.cuda.is_available() else None


def _accelerator_visible() -> bool:
    return _accelerator() is not None


_TORCH_REFUSED = 3  # the probe child's exit code for torch's own refusal (any other failure exits 4)


def _backward_or_exit() -> None:
    try:
        x = torch.ones(1, requires_grad=True)
        (2 * x).sum().backward()
    except RuntimeError as err:  # torch's refusal names fork-based multiprocessing; anything else is another failure
        os._exit(_TORCH_REFUSED if "fork-based multiprocessing" in str(err) else 4)
    except BaseException:  # noqa: BLE001 - any failure in the child is an answer, never a traceback
        os._exit(4)
    os._exit(0)


PROBE_SECONDS = 60.0  # a probe child that has not answered by then is killed and the chains run in this process
_refused: str | None = None  # a probe's refusal, kept for the process (below)


def fork_refusal() -> str | None:
    """``None`` where a child forked now can run a backward pass, else why not (the reason a warning or an error
    gives). In a process where torch sees an accelerator (a CUDA build with a visible GPU, even when every tensor is
    on the CPU), the first backward pass starts one autograd thread per device, and every backward pass in a child
    forked after that raises ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"): a parallel chain would fail at its first gradient. Torch exposes no such flag, so where an
    accelerator is visible a forked child tries one backward pass: exit code 0 is yes; torch's refusal, any other
    failure (an exit code, a signal such as macOS's fork-safety abort, named as the likely cause on an MPS device)
    or no answer within :data:`PROBE_SECONDS` (the child is killed) is no, each named as such. A no is kept for the
    process: autograd's device threads are never stopped, and a child that hung or crashed once would again, each
    time at a fit's start. Without an accelerator the threads are never started and nothing is forked."""
    global _refused
    if _refused is not None:
        return _refused
    kind = _accelerator()
    if kind is None:
        return None
    probe = mp.get_context("fork").Process(target=_backward_or_exit, daemon=True)
    probe.start()
    probe.join(PROBE_SECONDS)
    if probe.is_alive():
        probe.kill()
        probe.join()
        _refused = (
            f"a forked process did not finish one backward pass within driver.PROBE_SECONDS ({PROBE_SECONDS:g} s; "
            "not asked again in this process)"
        )
    elif probe.exitcode == 0:
        return None
    elif probe.exitcode != _TORCH_REFUSED:
        how = f"signal {-probe.exitcode}" if probe.exitcode < 0 else f"exit code {probe.exitcode}"
        cause = ""
        if kind == "mps" and probe.exitcode < 0:  # macOS: the Objective-C runtime aborts a child forked after its use
            cause = (
                ": on macOS most likely the Objective-C runtime's fork safety, which kills such a child "
                "(docs/devices.md)"
            )
        _refused = (
            f"a forked process running one backward pass ended with {how}{cause} (not asked again in this process)"
        )
    else:
        if kind == "cuda":
            hide = "HIP_VISIBLE_DEVICES" if getattr(torch.version, "hip", None) else "CUDA_VISIBLE_DEVICES"
            way_out = f"to fit on the CPU in parallel chains, hide the GPU before Python starts: {hide}=''"
        else:
            way_out = "to run them in parallel, fit in a process that has run no backward pass before"
        _refused = (
            f"a forked process could not run autograd: torch sees an accelerator ({kind}), so the backward passes "
            f"already run in this process started autograd's device threads, which a fork cannot carry ({way_out})"
        )
    return _refused


def autograd_survives_fork() -> bool:
    """Whether a child forked now can run a backward pass (:func:`fork_refusal` gives the reason where not)."""
    return fork_refusal() is None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _start(run_chain, index: int, line: int):
    receive, send = mp.get_context("fork").Pipe(duplex=False)

    def work():
        torch.set_num_threads(1)  # one thread per process: two per process oversubscribe the cores
        try:
            result = ("ok", run_chain(index, line))
        except BaseException as err:  # noqa: BLE001 - report any failure to the parent
            result = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        buffer = io.BytesIO()  # plain bytes: torch's shared-memory pickling needs this process alive
        torch.save(result, buffer)
        send.send_bytes(buffer.getvalue())

    process = mp.get_context("fork").Process(target=work, daemon=True)
    process.start()
    send.close()
    return index, process, receive


def _finish(index: int, process, receive, method: str):
    try:  # the parent reads back what its own forked child wrote (a trusted pipe, not a file)
        status, value = torch.load(io.BytesIO(receive.recv_bytes()), weights_only=False)
    except EOFError:
        status, value = "error", f"the process died (exit code {process.join() or process.exitcode})"
    process.join()
    if status != "ok":
        raise RuntimeError(
            f"{method}: chain {index} failed in its process: {value}\n"
            "Try chain_method='sequential' to debug it in this process."
        )
    return value


@contextlib.contextmanager
def chain(model, seed: int, *, copy_model: bool = True) -> Iterator[object]:
    """One chain's copy of ``model`` (a ``torch.nn.Module`` is deep-copied unless ``copy_model=False``; a Pyro
    function is itself), inside a scoped parameter store, with Pyro's generators (torch, ``random``, NumPy)
    seeded by ``seed``."""
    fitted = copy.deepcopy(model) if copy_model and isinstance(model, torch.nn.Module) else model
    with pyro.get_param_store().scope():
        pyro.set_rng_seed(seed)
        yield fitted


class Resumable(Protocol):
    """What :func:`descend` needs to checkpoint a run: :meth:`restore` the saved state into the optimizer,
    scheduler and losses (returns the step to continue from, 0 without a file), :meth:`due` and :meth:`save`."""

    def restore(self, opt, sched, losses: torch.Tensor) -> int: ...

    def due(self, step: int, num_steps: int) -> bool: ...

    def save(self, step: int, opt, sched, losses: torch.Tensor) -> None: ...


def descend(
    objective: Objective,
    params: list[torch.Tensor],
    data: Data,
    *,
    num_steps: int,
    lr: float,
    optimizer="adam",
    lr_schedule="constant",
    seed: int,
    method: str,
    desc: str,
    progress: bool = True,
    quantity: str = "loss",
    hint: str = "",
    on_step: Callable[[int, float], None] | None = None,
    after_step: Callable[[], None] | None = None,
    reduce=None,
    resumable: Resumable | None = None,
    opt=None,
    batches: Callable[[int], Iterator[tuple]] | None = None,
    where: Callable[[int], str] | None = None,
    record_dtype: torch.dtype | None = None,
    backward: bool = True,
    check_every: int = 1,
) -> torch.Tensor:
    """Minimize ``objective`` over ``params`` for ``num_steps`` optimizer steps; returns the recorded losses.

    Parameters
    ----------
    objective:
        ``objective(batch, step) -> (tensor to differentiate, value to record)`` on one ``(x, y)`` batch. The
        value is a float, or a 0-dim tensor recorded where it lies (no host read per step; see ``check_every``).
    params, optimizer, lr, lr_schedule:
        The tensors to optimize; ``optimizer`` and ``lr_schedule`` as :func:`~bnn_pyro.infer.optim.make_optimizer`
        and :func:`~bnn_pyro.infer.optim.make_schedule` take them (or a ready optimizer as ``opt``).
    seed:
        Seeds the minibatch order (its own generator, so the model's draws do not shift it).
    method, desc, progress, quantity, hint:
        Name the engine and the run in the progress bar and in the error raised when the recorded value
        stops being finite (``quantity``: what is recorded, e.g. ``"ELBO"``; ``hint``: extra advice).
    on_step, after_step:
        ``on_step(step, value)`` after every step (history, early-stopping scores); ``after_step()`` right
        after the optimizer's update (e.g. a projection of the parameters).
    reduce:
        Data-parallel: ``reduce(params, value) -> value`` averages the gradients (and the value) over ranks.
    resumable:
        Checkpoint/resume (:class:`Resumable`): the run continues from the saved step, the minibatch stream
        replayed up to it, so that a resumed run is bit-identical to an uninterrupted one.
    batches:
        ``batches(start)``: the stream of ``(x, y)`` batches from step ``start`` on (0, or the step a checkpoint
        resumed from), for an engine that draws its own (e.g. SWAG's minibatches drawn with replacement, whose
        generator the checkpoint restores). Default: ``data``'s, shuffled per epoch by ``seed``, replayed up to
        ``start``.
    where:
        ``where(step)`` names the step in the error raised when the run diverges (default ``"step {step} (of
        {num_steps}) of {desc}"``), e.g. the phase and learning rate of an engine that runs several phases.
    record_dtype:
        The dtype of the returned losses (default torch's default dtype).
    backward, check_every:
        The hooks of a hand-written gradient (e.g. SVI's flat mean-field step, :mod:`bnn_pyro.infer._svi_flat`):
        ``backward=False``: ``objective`` has set the parameters' ``.grad`` itself (assigned, not accumulated: the
        optimizer's ``zero_grad`` is not called) and returns ``(None, value)``;
        a tensor value's finiteness is checked every ``check_every`` steps (and before a checkpoint and at the
        last step), naming the first step whose value was not: an accelerator then synchronises once per
        ``check_every`` steps, not per step. Default ``True``, 1: autograd, a check before every update.
    """
    losses = torch.empty(num_steps, dtype=record_dtype)
    if not num_steps:
        return losses
    opt = make_optimizer(optimizer, params, lr) if opt is None else opt
    sched = make_schedule(lr_schedule, opt, num_steps)
    start = 0 if resumable is None else resumable.restore(opt, sched, losses)
    if batches is None:
        stream = data.batches(torch.Generator().manual_seed(seed))
        for _ in range(start):  # replay the minibatch stream up to the restored step
            next(stream)
    else:
        stream = batches(start)
    where = where or (lambda step: f"step {step} (of {num_steps}) of {desc}")

    def advice() -> str:  # the optimizer's rate at the failing step (a schedule or a later phase may have changed it)
        return divergence_advice(opt.param_groups[0]["lr"], hint)

    record, checked = None, start  # tensor values: recorded in `record` (on their device), checked up to `checked`

    def check(stop: int, value: torch.Tensor) -> None:  # the values of steps checked .. stop - 1 are finite, or stop
        if math.isfinite(float(value)) if stop - checked == 1 else bool(torch.isfinite(record[checked:stop]).all()):
            return
        bad = checked + int((~torch.isfinite(record[checked:stop])).nonzero()[0, 0])
        raise FloatingPointError(f"{method}: the {quantity} became {float(record[bad])} at {where(bad)}. {advice()}")

    with progress_bar(num_steps, desc, progress) as bar:
        bar.update(start)
        for step in range(start, num_steps):
            batch = next(stream)
            if backward:  # (without, the objective sets every .grad itself: nothing to clear)
                opt.zero_grad(set_to_none=True)
            try:
                loss, value = objective(batch, step)
            except ValueError as err:  # an earlier step worked: the optimizer drove a parameter out of its support
                if step == start:
                    raise
                first = str(err).splitlines()[0].rstrip(":")
                raise FloatingPointError(
                    f"{method}: the optimization diverged at {where(step)}: {first}. {advice()}"
                ) from None
            if reduce is not None:  # data-parallel: average gradients and loss over the ranks
                if backward:
                    loss.backward()
                value = reduce(params, value)
            due = resumable is not None and resumable.due(step + 1, num_steps)
            if isinstance(value, torch.Tensor):
                if record is None:
                    record = losses if value.device.type == "cpu" else losses.to(value.device)
                record[step] = value
                if step + 1 - checked >= check_every or due or step == num_steps - 1:
                    check(step + 1, value)  # before the update
                    checked = step + 1
            elif not math.isfinite(value):
                raise FloatingPointError(f"{method}: the {quantity} became {value} at {where(step)}. {advice()}")
            if backward and reduce is None:
                loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            if after_step is not None:
                after_step()
            if record is None:
                losses[step] = value
            if on_step is not None:
                on_step(step, value)
            if due:
                if record is not None and record is not losses:
                    losses[: step + 1] = record[: step + 1].cpu()
                resumable.save(step + 1, opt, sched, losses)
            if step % 50 == 0 or step == num_steps - 1:
                bar.set_postfix(loss=f"{float(value):.4g}", refresh=False)
            bar.update()
    if record is not None and record is not losses:
        losses.copy_(record.cpu())
    return losses


def divergence_advice(lr: float, hint: str = "") -> str:
    """What the non-finite stop of :func:`descend` advises (``lr``: the optimizer's rate now; ``hint``: the engine's
    own advice, e.g. ``", a smaller init_scale"``)."""
    return (
        f"Try a lower learning rate (lr={lr:.3g} now){hint}, standardized inputs and targets, or check the batch "
        "for NaN/Inf values."
    )


@dataclass
class ChainRun:
    """One chain's result: its fitted model copy, draws ``(draws, *shape)`` per site, point-estimated
    parameters, per-step ``history``, per-draw ``stats`` and per-draw module ``buffers`` ``(draws, *shape)``
    (e.g. BatchNorm statistics recomputed for each draw; the Posterior's ``draw_buffers``), and ``record``: facts
    about the chain as JSON values (e.g. HMC's ``step_size_origin``), which :func:`assemble` lists in the
    posterior's config, one per chain."""

    model: object
    samples: dict[str, torch.Tensor]
    point: dict[str, torch.Tensor] = field(default_factory=dict)
    history: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    record: dict = field(default_factory=dict)


def stack(runs: list[ChainRun], part: str) -> dict[str, torch.Tensor]:
    """The chains' ``part`` (``"samples"``, ``"point"``, ``"history"``, ``"stats"``, ``"buffers"``) stacked on a
    leading axis."""
    first = getattr(runs[0], part)
    return {k: torch.stack([getattr(r, part)[k] for r in runs]) for k in first}


def assemble(runs: list[ChainRun], *, method: str, config: dict, data: Data, **extra) -> Posterior:
    """The :class:`~bnn_pyro.Posterior` of ``runs`` (the last chain's model is the posterior's model); ``config``
    becomes its config (updated in place: MCMC adds to it after), with each entry of any chain's ``record`` added as a
    list of one value per chain (``None`` for a chain without it: a third-party kernel may record for some chains
    only, and a missing entry must not lose the fit after every chain has run)."""
    keys = dict.fromkeys(k for r in runs for k in r.record)
    config.update({k: [r.record.get(k) for r in runs] for k in keys})
    return Posterior(
        samples=stack(runs, "samples"),
        model=runs[-1].model,
        method=method,
        config=config,
        point=stack(runs, "point"),
        sample_stats=stack(runs, "stats"),
        history=stack(runs, "history"),
        draw_buffers=stack(runs, "buffers"),
        x=data.x,
        y=data.y,
        **extra,
    )
