"""Writes tests/data/main_mcmc/: MCMC checkpoints and posteriors written by bnn_pyro at commit a7736d0 (before the
MCMC engines had typed configs), read by tests/infer/test_compat_files.py with today's code.

Run from a checkout of that commit (not today's code): ``PYTHONPATH=<checkout> python tests/data/make_main_mcmc_files.py
tests/data/main_mcmc``. For each kernel it fits the run of ``RUNS`` uninterrupted (saved as ``{kernel}.bnn``), then
again with ``checkpoint=`` and a crash when saving after iteration 10, leaving ``{kernel}/chain0.ckpt`` at
iteration 5 (inside the mass-matrix window). Data and model are those of ``blr_problem``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod

RUNS = {
    "nuts": dict(method="nuts", max_tree_depth=4),
    "hmc": dict(method="hmc", num_leapfrog=4),
    "metropolis": dict(method="metropolis"),
}
COMMON = dict(num_warmup=12, num_samples=8, num_chains=1, seed=4, progress=False)


def blr_problem():
    """Bayesian linear regression: 30 rows, 2 inputs, noise 0.5, Normal(0, 1) prior."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=g)
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 + 0.5 * torch.randn(30, generator=g)
    model = bp.BNN(
        torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5)
    )
    return model, x, y


class _Crash(Exception):
    pass


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save = ckpt_mod.Checkpoint.save
    for kernel, run in RUNS.items():
        model, x, y = blr_problem()
        bp.fit(model, x, y, **run, **COMMON).save(out / f"{kernel}.bnn")
        folder = out / kernel
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()

        def crashing(ckpt, step, *args):
            if step == 10:
                raise _Crash(step)
            return save(ckpt, step, *args)

        ckpt_mod.Checkpoint.save = crashing
        try:
            bp.fit(model, x, y, **run, **COMMON, checkpoint=str(folder), checkpoint_every=5)
        except _Crash:
            pass
        finally:
            ckpt_mod.Checkpoint.save = save


if __name__ == "__main__":
    main(Path(sys.argv[1]))
