"""``chain_method="vectorized"``: every MCMC chain of a fit advanced together as ONE batched computation.

:func:`run` does for ``C`` chains at once what :func:`bnn_pyro.infer.mcmc._run_chain` does for one: each chain
starts where chain ``c`` of ``chain_method="sequential"`` starts (its ``init`` under the seed ``seed + c``), then
:class:`~bnn_pyro.infer._batched.BatchedChains` runs the transition of every chain as one computation on the
analytic potential (:meth:`~bnn_pyro.infer._analytic.StackPotential.leapfrog_batch`), one torch thread (the draws
must not depend on the machine's cores), one progress bar for all chains, and returns one
:class:`~bnn_pyro.infer.driver.ChainRun` per chain, shaped as the other executions' (per-draw statistics, the
adapted inverse mass matrix). Checkpoints: ONE file for the batch, ``FOLDER/chain0.ckpt`` (every chain's state,
draws and statistics), every ``checkpoint_every`` iterations and after the last.
"""

from __future__ import annotations

import pyro
import torch
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer import _logjoint
from bnn_pyro.infer._analytic_batched import OneChain
from bnn_pyro.infer._batched import BatchedChains, hmc_transition
from bnn_pyro.infer._common import point_values, progress_bar, quiet_model
from bnn_pyro.infer._kernels import DrawStats, sample_stats
from bnn_pyro.infer._nuts import nuts_transition
from bnn_pyro.infer._one_chain import analytic_applies, flat_layout, seeded_generator
from bnn_pyro.infer.driver import ChainRun, chain

__all__ = ["check", "run"]

_INSTEAD = "use chain_method='auto' (forked processes) or 'sequential'"


def check(kind: str, joint, x, y) -> None:
    """A clear error where ``chain_method="vectorized"`` cannot run: only NUTS and HMC on the analytic fast path."""
    if kind not in ("nuts", "hmc"):
        raise ValueError(
            f"chain_method='vectorized' applies to method='nuts' and 'hmc' only, not {kind!r}; {_INSTEAD}."
        )
    if joint is None:
        raise ValueError(
            "chain_method='vectorized' needs the fast path (fast_path=True and a bp.BNN without "
            f"hierarchical priors or BatchNorm); {_INSTEAD}, or fast_path=True."
        )
    if not analytic_applies(joint, x, y):
        raise ValueError(
            "chain_method='vectorized' needs the analytic potential: a stack of nn.Linear layers and "
            "elementwise activations with Normal priors and a Gaussian likelihood (see "
            f"bnn_pyro.infer._analytic); this model is not one, so {_INSTEAD}."
        )
    _transition(kind, None)


def _transition(kind: str, settings):
    """The batched transition of ``kind`` and its options (``settings``: the engine's config)."""
    if kind == "hmc":
        if settings is None:
            return hmc_transition, {}
        length = (
            dict(num_steps=settings.num_leapfrog)
            if settings.num_leapfrog is not None
            else dict(trajectory_length=settings.trajectory_length)
        )
        return hmc_transition, dict(length, jitter=settings.leapfrog_jitter)
    return nuts_transition, ({} if settings is None else dict(max_tree_depth=settings.max_tree_depth))


def run(
    fitted, data, settings: list, *, kind: str, num_samples: int, num_warmup: int, seed: int, progress: bool, ckpt=None
) -> list[ChainRun]:
    """The chains of one fit, batched (module docstring): ``settings[c]`` is chain ``c``'s
    :class:`~bnn_pyro.infer.mcmc.KernelSettings` (its start and, extending a posterior, its adapted state)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the draws must not depend on the cores (and small tensors gain nothing from threads)
    try:
        with chain(fitted, seed, copy_model=False), pyro.validation_enabled(False):
            return _run(fitted, data, settings, kind, num_samples, num_warmup, seed, progress, ckpt)
    finally:
        torch.set_num_threads(threads)


def _run(fitted, data, settings, kind, num_samples, num_warmup, seed, progress, ckpt):
    quiet, x, y, first = quiet_model(fitted, data.size), data.x.detach(), data.y.detach(), settings[0]
    starts = []
    for c, s in enumerate(settings):
        pyro.set_rng_seed(seed + c)  # chain c starts where chain_method="sequential"'s chain c starts
        params, _, transforms, _ = initialize_model(
            quiet, model_args=(x, y), init_strategy=s.init_strategy, skip_jit_warnings=True
        )
        starts.append(params)
    pyro.set_rng_seed(seed)
    names, shapes, sizes = flat_layout(starts[0])
    pot = _logjoint.analytic(first.joint, names, shapes, x, y)
    if pot is None:  # the analytic potential disagreed with the generic one at its probe point (it warned)
        raise ValueError(
            "chain_method='vectorized': the analytic potential does not agree with the model's on this "
            f"model; {_INSTEAD}."
        )
    z = torch.stack([torch.cat([p[n].detach().reshape(-1) for n in names]) for p in starts])
    transition, options = _transition(kind, first.config)
    leapfrog = pot.leapfrog_batch if len(settings) > 1 else OneChain(pot)  # C = 1: FlatHMC's step
    chains = BatchedChains(
        pot.batch(len(settings)),
        leapfrog,
        z,
        names=names,
        sizes=sizes,
        warmup_steps=num_warmup,
        transition=transition,
        options=options,
        generator=seeded_generator(z),
        step_size=first.config.step_size,
        target_accept_prob=first.config.target_accept,
        dense_mass=first.config.dense_mass,
        resume=None if first.resume is None else [s.resume for s in settings],
        aim_final_step=kind == "hmc",
    )
    total, kept, draws, start = num_warmup + num_samples, [], [], 0
    label = f"{kind} chains 0-{len(settings) - 1}" if len(settings) > 1 else f"{kind} chain 0"
    with progress_bar(total, label, progress) as shown:
        if ckpt is not None and (saved := ckpt.load()) is not None:
            start = _restore(chains, saved, kept, draws)
            shown.update(start)
        for i in range(start, total):
            position = chains.sample()
            if i >= num_warmup:
                kept.append(position.clone())
                draws.append(chains.stats)
            if progress:
                shown.set_postfix(
                    {"phase": "warmup" if i < num_warmup else "sample", **chains.logging()}, refresh=False
                )
                shown.update()
            if ckpt is not None and ckpt.due(i + 1, total):
                _save(ckpt, i + 1, chains, kept, draws)
    flat, mass = torch.stack(kept, 1), chains.inverse_mass_matrix  # (C, draws, D)
    origins = chains.step_size_origins  # HMC: which rule gave each chain's step after warm-up
    point = point_values(fitted, data.x, data.y, data.size)
    runs = []
    for c in range(len(settings)):
        samples = {
            n: part.reshape((num_samples,) + tuple(shapes[n])) for n, part in zip(names, flat[c].split(sizes, -1))
        }
        samples = {k: transforms[k].inv(v) if k in transforms else v for k, v in samples.items()}
        runs.append(
            ChainRun(
                fitted,
                samples,
                {k: v.clone() for k, v in point.items()},
                {"inverse_mass_matrix": mass[c].clone()},
                stats=sample_stats([d[c] for d in draws]),
                record={"step_size_origin": origins[c]} if kind == "hmc" else {},  # where its step came from
            )
        )
    return runs


def _save(ckpt, step: int, chains: BatchedChains, kept: list, draws: list) -> None:
    """Every chain after ``step`` iterations: the batch's state, the kept positions ``(draws, C, D)`` and statistics."""
    tensors, meta = chains.state_dict()
    tensors = {f"kernel/{k}": v for k, v in tensors.items()}
    if kept:
        tensors["draws"] = torch.stack(kept)
    ckpt.save(step, tensors, {"kernel": meta, "stats": [[list(d) for d in row] for row in draws]})


def _restore(chains: BatchedChains, saved, kept: list, draws: list) -> int:
    tensors, meta = saved
    prefix = "kernel/"
    chains.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, meta["kernel"])
    kept[:] = list(tensors["draws"].to(chains.z.device)) if "draws" in tensors else []
    draws[:] = [[DrawStats(*d) for d in row] for row in meta["stats"]]
    return meta["step"]
