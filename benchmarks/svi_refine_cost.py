"""The cost of the full-rank refinement (``bnn_pyro/infer/svi_refine.py``) against its fit's, by dimension: the basis of
``svi_refine.MAX_DIM``.

A Bayesian linear regression written as a Pyro function with ``dim - 1`` coefficients and a learned noise scale (``dim``
unconstrained coordinates), ``--rows`` rows, fitted by SVI with a full-rank guide (the default guide for such a model)
for ``--steps`` steps; the seconds of the whole fit, of the refinement inside it, and their ratio, per ``dim``. One
evaluation of the refinement takes ``dim`` gradient passes per draw, so its share grows with ``dim`` where a step of
the fit grows as ``dim^2`` only in its guide. With ``--max-dim`` the cap is lifted for the run (to measure past it).

Run from the repository root: ``python benchmarks/svi_refine_cost.py --dims 10,25,50,100,200 --steps 5000``; writes
``benchmarks/results/svi_convergence/refine_cost.md`` and ``.csv``. One torch thread.
"""

from __future__ import annotations

import argparse
import time
import warnings

import pandas as pd
import pyro
import pyro.distributions as dist
import torch
from _common import markdown, results_dir, write_result

import bnn_pyro as bp
from bnn_pyro.infer import svi_refine

_SECONDS: list = []


def _model(x, y=None):
    b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("data", size=x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ b, s), obs=y)


def one(dim: int, rows: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim - 1, generator=g)
    y = x @ torch.randn(dim - 1, generator=g) * 0.3 + 0.5 * torch.randn(rows, generator=g)
    _SECONDS.clear()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(_model, x, y, method="svi", guide="full_rank", num_steps=steps, seed=0, progress=False)
    fit_s = time.perf_counter() - start
    refined = post.config.get("guide_refinement", [{}])[0]
    refine_s = sum(_SECONDS)
    return dict(
        dim=dim,
        rows=rows,
        steps=steps,
        fit_s=round(fit_s, 2),
        refine_s=round(refine_s, 2),
        ratio=round(refine_s / (fit_s - refine_s), 4),
        accepted=refined.get("accepted", "-"),
        stopped=refined.get("stopped", "-"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="10,25,50,100,200")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--max-dim", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.max_dim is not None:
        svi_refine.MAX_DIM = args.max_dim
    refine = svi_refine.refine

    def timed(*a, **k):
        start = time.perf_counter()
        out = refine(*a, **k)
        _SECONDS.append(time.perf_counter() - start)
        return out

    svi_refine.refine = timed
    rows = []
    for dim in map(int, args.dims.split(",")):
        rows.append(one(dim, args.rows, args.steps))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    folder = results_dir("svi_convergence")
    table.to_csv(folder / "refine_cost.csv", index=False)
    write_result(
        folder / "refine_cost.md",
        f"The full-rank refinement's seconds against the rest of its fit's (`ratio`), by unconstrained dimension: a "
        f"linear regression with a learned noise scale, {args.rows} rows, {args.steps} steps, full-rank guide "
        f"(refinement cap lifted to {svi_refine.MAX_DIM}).\n\n" + markdown(table),
    )


if __name__ == "__main__":
    main()
