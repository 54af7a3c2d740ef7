"""Multi-chain throughput: 1, 2, 4, 8 NUTS chains on this machine, bnn_pyro against NumPyro.

Workload: NUTS on the 1-50-1 tanh BNN of ``_common`` (Normal(0, 1) prior, Gaussian noise 0.1),
N = 200, every chain from the net's initial weights, tree depth <= ``--depth``, ``--draws`` warm-up
plus ``--draws`` kept iterations per chain. Figure: chains x iterations (warm-up and kept) per second
of wall time, and leapfrog steps per second (kept draws' mean trajectory length x all iterations x
chains / wall), since the two samplers' trajectories differ in length.

- bnn_pyro: ``bp.fit(..., method="nuts", num_chains=c)`` with its default ``chain_method="auto"``:
  forked processes, at most one per core, one torch thread each (after an untimed warm call); and
  ``chain_method="vectorized"`` (all chains as one batched computation in one process, one thread) for HMC with
  ``2**depth - 1`` leapfrog steps per draw (NUTS's most) and NUTS (lockstep, :func:`bnn_pyro.infer._nuts.nuts_transition`);
  HMC's process chains beside them (``chain_method="auto"``), same settings.
- NumPyro (``numpyro_peer``, XLA's default threads, 8 host devices): ``chain_method="parallel"`` (its
  default; ``pmap`` over host devices) and ``"vectorized"`` (``vmap``: all chains as one batched
  computation), the compiled second run of each, its compile seconds subtracted.

Usage: ``python benchmarks/chains.py [--quick] [--device cuda] [--out DIR] [--name vectorized]`` writes ``NAME.md``
and ``.csv`` (default ``results``) in ``benchmarks/results/chains/``; ``performance.py`` includes the same rows.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import pandas as pd

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
import numpyro_peer  # noqa: E402
from _common import bnn, check_device, markdown, now, regression, results_dir, thread_note, write_result  # noqa: E402

MODEL = dict(d=1, width=50, depth=1, n=200)


def ours(chains: int, draws: int, depth: int, device: str, method: str = "nuts", how: str = "auto") -> dict:
    x, y = regression(MODEL["n"], MODEL["d"], device=device)
    model = bnn(MODEL["d"], device=device)
    length = dict(max_tree_depth=depth) if method == "nuts" else dict(num_leapfrog=2**depth - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # costs are measured here (and one core: sequential chains, with a warning)
        start = now(device)
        post = bp.fit(
            model,
            x,
            y,
            method=method,
            num_chains=chains,
            num_warmup=draws,
            num_samples=draws,
            init="net",
            seed=0,
            progress=False,
            chain_method=how,
            **length,
        )
        wall = now(device) - start
    steps = float(post.sample_stats["n_steps"].float().mean())
    return dict(
        implementation=f"bnn_pyro {method}, chain_method='{how}' ({post.config['chain_execution']})",
        chains=chains,
        threads=1,
        role="ours" if (method, how) == ("nuts", "auto") else f"ours {method} {how}",
        wall_s=wall,
        mean_steps=steps,
    )


def _variants() -> list[tuple[str, str]]:
    """bnn_pyro's other rows: NUTS vectorized; HMC vectorized and in processes."""
    return [("nuts", "vectorized"), ("hmc", "vectorized"), ("hmc", "auto")]


def throughput(args) -> list[dict]:
    """Rows for every chain count in ``args.chains``: bnn_pyro, NumPyro parallel and vectorized."""
    draws, depth = (10, 4) if args.quick else (100, 5)
    ours(1, 3, depth, args.device)  # untimed: the process's one-time costs
    ours(1, 3, depth, args.device, "hmc", "vectorized")
    rows = [ours(c, draws, depth, args.device) for c in args.chains]
    rows += [ours(c, draws, depth, args.device, m, how) for m, how in _variants() for c in args.chains]
    if getattr(args, "no_numpyro", False):
        return _per_s(rows, draws)
    jobs = [
        dict(MODEL, warmup=draws, draws=draws, tree_depth=depth, chains=c, chain_method=m)
        for c in args.chains
        for m in ("parallel", "vectorized")
    ]
    for r in numpyro_peer.run(jobs, "default", args.device, host_devices=max(args.chains)) or []:
        if r["run"] == 2:
            rows.append(
                dict(
                    implementation=f"NumPyro, chain_method='{r['chain_method']}' (compiled, compile excluded)",
                    chains=r["chains"],
                    threads="XLA default",
                    role="baseline",
                    wall_s=r["wall_s"] - r["compile_s"],
                    mean_steps=r["mean_steps"],
                    default=r["chain_method"] == "parallel",
                    compile_s=r["compile_s"],
                )
            )
    return _per_s(rows, draws)


def _per_s(rows: list[dict], draws: int) -> list[dict]:
    for r in rows:
        r["chain_iterations_per_s"] = r["chains"] * 2 * draws / r["wall_s"]
        r["leapfrog_per_s"] = r["mean_steps"] * r["chains"] * 2 * draws / r["wall_s"]
    return rows


def main(args) -> pd.DataFrame:
    table = pd.DataFrame(throughput(args)).round(3)
    one = table[table.chains == 1].groupby("role").chain_iterations_per_s.first()
    table["ratio_to_own_one_chain"] = (table.chain_iterations_per_s / table.role.map(one)).round(2)
    out = results_dir("chains", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    write_result(
        out / f"{args.name}.md",
        f"device {args.device}, {thread_note()}; "
        f"{'quick' if args.quick else 'full'} settings\n\n"
        + (f"{args.note}\n\n" if args.note else "")
        + markdown(table.astype(object).fillna("")),
    )
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 + 10 iterations per chain, 1 and 2 chains")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chains", type=int, nargs="+", default=None, help="default 1 2 4 8 (1 2 with --quick)")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/chains/)")
    parser.add_argument("--name", default="results", help="the result files' name (default results)")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-numpyro", action="store_true", help="bnn_pyro's rows only")
    args = parser.parse_args()
    args.device = check_device(args.device)
    args.chains = args.chains or ([1, 2] if args.quick else [1, 2, 4, 8])
    started = time.perf_counter()
    main(args)
    print(f"whole run: {time.perf_counter() - started:.0f} s")
