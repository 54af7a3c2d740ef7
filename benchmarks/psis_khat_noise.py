"""How often PSIS's ``k_hat`` (the largest over chains) exceeds 0.7 when ``q`` is GOOD, by draws per chain.

``p = N(0, I_d)`` and ``q = N(0, (1.2)^2 I_d)``, ``d = 3``: ``q`` is 1.2 times wider than ``p`` in every direction,
so the importance ratios ``r = p / q`` are bounded (their true Pareto shape is ``k <= 0``, far below 0.5) and a
``k_hat > 0.7`` is a false alarm. Each run draws ``C`` chains of ``S`` draws of ``q``, smooths each chain's
log-ratios on its own (``arviz.psislw``, ``reff=1``, as :func:`bnn_pyro.posterior.psis.psis` does) and takes the
largest ``k_hat`` over chains, as ``psis`` reports it and :func:`~bnn_pyro.infer.health_spread.check_gaussian` judges
it. The rate is the share of ``--reps`` runs with ``k_hat > 0.7``, with its Monte Carlo standard error
``sqrt(p (1 - p) / reps)``.

Usage::

    python benchmarks/psis_khat_noise.py                        # C in {1, 4, 5}, S in 21..200, 1000 reps
    python benchmarks/psis_khat_noise.py --reps 200 --draws 21,100
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import pandas as pd
from _common import markdown, results_dir, write_result  # noqa: E402 - the script's folder is on sys.path

from bnn_pyro.posterior.psis import K_HAT_MAX

DIM, WIDER = 3, 1.2


def log_ratios(rng: np.random.Generator, runs: int, chains: int, draws: int) -> np.ndarray:
    """``log p(z) - log q(z)`` of ``z ~ q``, shaped ``(runs, chains, draws)`` (constants dropped: they cancel)."""
    z = WIDER * rng.standard_normal((runs, chains, draws, DIM))
    sq = (z**2).sum(-1)
    return -0.5 * sq + 0.5 * sq / WIDER**2 + DIM * math.log(WIDER)


def alarm_rate(chains: int, draws: int, reps: int, seed: int) -> float:
    """Share of ``reps`` runs whose largest per-chain ``k_hat`` exceeds :data:`K_HAT_MAX`."""
    import arviz as az

    lr = log_ratios(np.random.default_rng(seed), reps, chains, draws)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ's own "k_hat > 0.7" warning: counted here instead
        _, k = az.psislw(lr.reshape(reps * chains, draws), reff=1.0)
    worst = np.asarray(k).reshape(reps, chains).max(1)
    return float((worst > K_HAT_MAX).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1000)
    parser.add_argument("--chains", default="1,4,5")
    parser.add_argument("--draws", default="21,25,30,40,50,75,100,150,200")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for c in map(int, args.chains.split(",")):
        for s in map(int, args.draws.split(",")):
            p = alarm_rate(c, s, args.reps, seed=1000 * c + s)
            rows.append(
                {"chains": c, "draws_per_chain": s, "false_alarm_rate": p, "mc_se": math.sqrt(p * (1 - p) / args.reps)}
            )
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    folder = results_dir("psis_khat_noise", args.out)
    table.to_csv(folder / "rates.csv", index=False)
    write_result(
        folder / "rates.md",
        f"False-alarm rate of max-over-chains k_hat > {K_HAT_MAX} for q {WIDER}x wider than p (d = {DIM}, true k <= 0), "
        f"{args.reps} runs per row (`benchmarks/psis_khat_noise.py`).\n\n" + markdown(table) + "\n",
    )


if __name__ == "__main__":
    main()
