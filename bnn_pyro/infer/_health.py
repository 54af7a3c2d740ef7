"""Warnings about a finished MCMC run that the user should not miss: divergences above a
threshold (NUTS, HMC) and a Metropolis chain that (almost) never moved.

:func:`bnn_pyro.summary` reports divergences too; this check runs at the end of every fit, so
a run that cannot be trusted is flagged even when nobody looks at the summary.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_sampler", "DIVERGENCE_MAX", "ACCEPT_MIN"]

DIVERGENCE_MAX = 0.01  # warn when more than 1% of the kept draws diverged
ACCEPT_MIN = 0.01  # warn when a Metropolis chain accepted fewer than 1% of its proposals


def check_sampler(kind: str, samples: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], *,
                  target_accept: float, stacklevel: int = 2) -> None:
    """Warn (:class:`~bnn_pyro.diagnostics.DiagnosticWarning`) about divergences above
    :data:`DIVERGENCE_MAX` of the draws, or a Metropolis chain with an acceptance below
    :data:`ACCEPT_MIN`. ``samples`` and ``stats`` are shaped ``(chains, draws, ...)``."""
    from bnn_pyro.diagnostics import DiagnosticWarning

    diverging = stats.get("diverging")
    if diverging is not None and diverging.numel() and diverging.float().mean() > DIVERGENCE_MAX:
        frac = float(diverging.float().mean())
        warnings.warn(
            f"{kind}: {100 * frac:.1f}% of the draws diverged ({int(diverging.sum())} of {diverging.numel()}; "
            f"threshold {100 * DIVERGENCE_MAX:.0f}%), so the draws may be biased. Try a higher target_accept "
            f"(now {target_accept}; e.g. 0.95), more num_warmup, or a reparameterized (non-centered) prior.",
            DiagnosticWarning, stacklevel=stacklevel)
    if kind != "metropolis" or not samples:
        return
    draws = next(iter(samples.values())).shape[1]
    if draws < 2:
        return
    moved = torch.zeros(next(iter(samples.values())).shape[:1] + (draws - 1,), dtype=torch.bool)
    for v in samples.values():
        moved |= (v[:, 1:] != v[:, :-1]).reshape(v.shape[0], draws - 1, -1).any(-1)
    for chain, rate in enumerate(moved.float().mean(1).tolist()):
        if rate < ACCEPT_MIN:
            warnings.warn(
                f"metropolis: chain {chain} accepted {100 * rate:.1f}% of its {draws - 1} proposals after warm-up "
                f"(threshold {100 * ACCEPT_MIN:.0f}%): it barely moved, so its draws do not describe the posterior. "
                "Try more num_warmup (the step size adapts during warm-up), a smaller step_size, or method='nuts'.",
                DiagnosticWarning, stacklevel=stacklevel)
