"""One rank of tests/infer/test_distributed.py, launched twice by ``python -m torch.distributed.run``.

Writes ``rank<r>.pt`` into the folder given as the first argument: the data-parallel SVI fits' loss
traces and draws (full shards, and minibatches of BATCH rows per rank), and the ensemble members
gathered from all ranks."""

from __future__ import annotations

import sys

import torch
from test_distributed import BATCH, ENSEMBLE, SVI, data, model  # the test module sits beside this file

import bnn_pyro as bp

if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world = bp.distributed.init("gloo")
    x, y = data()
    xs, ys = bp.distributed.shard(x, y)
    post = bp.fit(model(), xs, ys, method="svi", distributed=True, **SVI)
    minibatched = bp.fit(model(), xs, ys, method="svi", distributed=True, batch_size=BATCH, **SVI)
    members = bp.fit(model(), x, y, method="ensemble", num_chains=1, **{**ENSEMBLE, "seed": ENSEMBLE["seed"] + rank})
    merged = bp.distributed.gather_posterior(members)
    torch.save(
        {
            "loss": post.history["loss"],
            "samples": post.samples,
            "config": post.config,
            "minibatch_loss": minibatched.history["loss"],
            "minibatch_samples": minibatched.samples,
            "ensemble": merged.samples,
            "ensemble_loss": merged.history["loss"],
            "ensemble_chains": merged.num_chains,
        },
        f"{sys.argv[1]}/rank{rank}.pt",
    )
    torch.distributed.destroy_process_group()
