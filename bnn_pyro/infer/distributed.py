"""Multi-process fits on ``torch.distributed``: data-parallel SVI, and chains (or ensemble members)
as ranks merged into one :class:`~bnn_pyro.Posterior`.

Launch one process per rank with ``torchrun`` (it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), then in each process::

    bp.distributed.init()                      # gloo on CPU, nccl on CUDA
    x_shard, y_shard = bp.distributed.shard(x, y)
    post = bp.fit(model, x_shard, y_shard, method="svi", distributed=True, seed=0)

    $ torchrun --nproc_per_node=2 train.py

**Data-parallel SVI** (``bp.fit(..., method="svi", distributed=True)``): each rank holds its shard
of the data (tensors, or its own loader with ``dataset_size`` the total over all ranks; with tensors
the total is the sum of the shards' lengths). Every rank starts from the same seed, so the guide's
parameters and its Monte Carlo weight draws agree on all ranks; each rank's ELBO scales its
log-likelihood by ``N / b`` (``b`` its batch), and the gradients (and the loss) are averaged over
the ``R`` ranks before every optimizer step. The average is ``N / (R b)`` times the sum over the
global batch of ``R b`` rows, plus the same KL term: the gradient of the single-process ELBO on that
global batch. So the fit equals a one-process fit with the same global batch and seed up to the
order of floating-point additions, and every rank returns the same ``Posterior``. ``batch_size`` is
per rank (global batch = ``world_size * batch_size``); the equality needs the same batch size on
every rank (equal shards: :func:`shard` gives lengths that differ by at most one row), otherwise the
rows of rank ``r`` weigh ``N / (R b_r)`` (still unbiased, not the one-process gradient). Every rank
must run the same number of steps: give ``num_steps`` (``epochs`` is refused).

**Chains as ranks** (:func:`gather_posterior`): each rank fits its own chains (MCMC) or members
(``"ensemble"``) on the full data; rank ``r`` should pass ``seed=seed + r * num_chains`` so that
chain ``k`` of the merged posterior used seed ``seed + k``, the rule of a one-process
``num_chains`` fit. ``gather_posterior`` concatenates the chains of all ranks, in rank order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from bnn_pyro.infer._common import Data
from bnn_pyro.posterior import Posterior
from bnn_pyro.utils.checks import check_data

__all__ = ["init", "shard", "gather_posterior", "is_ready", "rank", "world_size"]


def is_ready() -> bool:
    """Whether a ``torch.distributed`` process group is initialized in this process."""
    return dist.is_available() and dist.is_initialized()


def _require(what: str) -> None:
    if not is_ready():
        raise RuntimeError(
            f"{what}: no torch.distributed process group in this process. Launch with "
            "`torchrun --nproc_per_node=2 script.py` and call bp.distributed.init() (or "
            "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on CUDA)) before fitting."
        )


def init(backend: str | None = None) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment (once) and return
    ``(rank, world_size)``. ``backend`` defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    if not is_ready():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return dist.get_rank(), dist.get_world_size()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_ready() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_ready() else 1


def shard(x, y=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's contiguous shard of ``x`` and ``y`` (rank ``r`` of ``R`` gets rows
    ``torch.tensor_split(range(N), R)[r]``). For data larger than memory, have each rank read its
    own part instead (a loader per rank, ``dataset_size`` the total)."""
    _require("shard")
    x, y = check_data(x, y)
    parts = torch.tensor_split(torch.arange(x.shape[0]), dist.get_world_size())
    idx = parts[dist.get_rank()]
    if len(idx) == 0:
        raise ValueError(
            f"x: {x.shape[0]} rows cannot be split over {dist.get_world_size()} ranks; give at least one row per rank."
        )
    return x[idx.to(x.device)], None if y is None else y[idx.to(y.device)]


# ------------------------------------------------------------------------ data-parallel SVI
def prepare(data: Data) -> Data:
    """``data`` with ``dataset_size`` the total over ranks (the sum of the shards' lengths for
    tensors; a loader's ``dataset_size`` is taken to be that total already)."""
    _require("distributed=True")
    if data.loader is not None:
        return data
    total = torch.tensor([float(data.x.shape[0])], device=data.x.device)
    dist.all_reduce(total)
    return dataclasses.replace(data, dataset_size=int(total.item()))


def average_gradients(params: list[torch.Tensor], value: float) -> float:
    """Average the gradients of ``params`` (in place) and the loss ``value`` over all ranks, in one
    all-reduce; returns the averaged loss."""
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_tensor([value])])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return float(flat[-1])


def config() -> dict:
    """What a data-parallel fit records in ``post.config``."""
    return {"world_size": dist.get_world_size(), "backend": str(dist.get_backend())}


# ------------------------------------------------------------------------ chains as ranks
def gather_posterior(post: Posterior) -> Posterior:
    """One ``Posterior`` with the chains of every rank's ``post``, in rank order (returned on every
    rank). Every rank must have fitted the same model with the same method and settings (the same
    sites and draws per chain); ``x``, ``y`` and the model are this rank's."""
    _require("gather_posterior")
    world = dist.get_world_size()
    fields = {}
    for name in ("samples", "point", "sample_stats", "history", "draw_buffers"):
        local = getattr(post, name)
        _same_on_all_ranks(name, sorted((k, tuple(v.shape)) for k, v in local.items()))
        merged = {}
        for key in sorted(local):
            value = local[key].contiguous().to(_device())
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value)
            merged[key] = torch.cat(parts).to(local[key].device)
        fields[name] = merged
    config = {**post.config, "gathered_ranks": world}
    for key in ("num_chains", "num_members"):  # a count of chains now counts those of every rank
        if key in config:
            config[key] = config[key] * world
    return dataclasses.replace(post, config=config, **fields)


def _device() -> torch.device:
    """Where collectives run: the current CUDA device for nccl, the CPU otherwise."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _same_on_all_ranks(name: str, layout: list) -> None:
    text = repr(layout).encode()
    length = torch.tensor([len(text)], device=_device())
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    size = int(max(lengths).item())
    code = torch.zeros(size, dtype=torch.uint8, device=_device())
    code[: len(text)] = torch.tensor(list(text), dtype=torch.uint8, device=_device())
    codes = [torch.zeros_like(code) for _ in lengths]
    dist.all_gather(codes, code)
    if any(not torch.equal(c, codes[0]) for c in codes):
        raise ValueError(
            f"post.{name}: the ranks' posteriors differ in sites or shapes; fit the same model "
            "with the same method, num_samples and num_chains on every rank."
        )
