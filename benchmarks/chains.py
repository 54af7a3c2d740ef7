"""Multi-chain throughput: one chain, two chains one after another, two chains in parallel.

Workload: HMC with exactly 20 leapfrog steps per draw on a 1-50-1 tanh BNN (Normal(0, 1) prior,
Gaussian noise 0.1), N = 200, so every chain does the same number of gradient evaluations. The
figure is leapfrog steps per second of wall time; ratios are to one chain, measured in the same run.

Usage: ``python benchmarks/chains.py [--draws 100] [--out benchmarks/results]`` writes
``chains.md`` and ``chains.csv``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp


def workload(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(200, 1, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(200, generator=g)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)), x, y


def run(chains: int, chain_method: str, draws: int) -> dict:
    model, x, y = workload()
    start = time.perf_counter()
    post = bp.fit(model, x, y, method="hmc", num_leapfrog=20, step_size=1e-3, num_samples=draws, num_warmup=draws,
                  num_chains=chains, chain_method=chain_method, seed=0, progress=False)
    wall = time.perf_counter() - start
    steps = chains * 2 * draws * 20
    return dict(setting=f"{chains} chain(s), {chain_method}", execution=post.config["chain_execution"],
                wall_s=round(wall, 2), leapfrog_per_s=round(steps / wall, 1))


def main(args) -> pd.DataFrame:
    rows = [run(1, "sequential", args.draws), run(2, "sequential", args.draws), run(2, "parallel", args.draws)]
    table = pd.DataFrame(rows)
    table["ratio_to_one_chain"] = (table["leapfrog_per_s"] / table["leapfrog_per_s"].iloc[0]).round(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "chains.csv", index=False)
    (out / "chains.md").write_text(markdown(table))
    print(table.to_string(index=False))
    return table


def markdown(table: pd.DataFrame) -> str:
    """A GitHub Markdown table (pandas' to_markdown needs the optional tabulate package)."""
    rows = [list(table.columns), ["---"] * table.shape[1]] + table.astype(str).values.tolist()
    return "".join("| " + " | ".join(map(str, r)) + " |\n" for r in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100, help="warm-up draws and kept draws per chain")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    main(parser.parse_args())
