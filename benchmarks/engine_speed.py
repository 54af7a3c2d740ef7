"""The engines built on ``Potential`` with its fast path on and forced off, side by side in one run.

``Potential`` (bnn_pyro/infer/_potential.py) evaluates ``U(z; batch)`` for SG-MCMC, SWA/SWAG, ensembles, Laplace's MAP
and MC dropout. With the fast path it is the analytic potential (a Linear/elementwise stack, Normal priors, Gaussian
likelihood, no deterministic parameters) or the torch ``LogJoint`` (any other ``BNN`` without hierarchical priors);
forced off it is Pyro's traced potential (``Potential(..., fast_path=False)``, here by making the fast path decline
every model, as the tests do).

- ``potential``: ms per call of ``U(z; batch)`` plus its backward on a minibatch of 32 of N = 1,000 rows, 8-50-1 tanh
  MLP: fixed noise and learned noise (analytic), and the biases deterministic (``bayesian="weights"``: LogJoint).
- ``fit``: ms per step of ``bp.fit`` for each engine at its defaults but for the step counts (minibatches of 32 where
  the engine takes ``batch_size``), 8-50-1 tanh MLP, Normal(0, 1) prior, Gaussian noise sigma 0.1, N = 1,000:
  (time of a fit of ``--long`` steps - time of one of ``--short``) / (long - short), so that set-up (tracing the
  model, held-out split, curvature, drawing) cancels. Laplace's steps are its MAP search's Adam steps.

- ``hmc``: ms per leapfrog step of ``bp.fit(method="hmc")`` (16 leapfrog steps per draw, warm-up included) on the
  1-50-1 tanh BNN of ``_common`` (N = 200, sigma 0.1): the flat kernel (``bnn_pyro/infer/_one_chain.py``, the default:
  here on the analytic potential) against Pyro's ``HMC`` over dicts of sites on the log joint's potential traced by
  TorchScript (what ``bp.fit`` ran before 0158693 where the analytic potential did not apply; here by swapping
  ``HMCConfig.kernel``); (long - short) draws differenced. ``--only hmc`` runs it alone. (Pyro's HMC on the analytic
  potential, the side of this row up to 0158693, is no longer built by the library.)

Each figure is the minimum of ``--repeats`` repetitions, interleaved between the two paths (the machine may be shared:
minima are the least disturbed); ratio = fast / Pyro's, measured in the same run. One torch thread.

Usage: ``python benchmarks/engine_speed.py [--quick] [--out DIR] [--name hmc]`` writes ``<name>.md`` (headed by the
run's provenance) and ``<name>.csv`` (default ``results``) in ``benchmarks/results/engine_speed/``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyro
import pyro.distributions as dist
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import markdown, regression, results_dir, thread_note, torch_threads, write_result  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import _potential  # noqa: E402
from bnn_pyro.infer._common import Data  # noqa: E402
from bnn_pyro.infer._potential import Potential  # noqa: E402

N, D, WIDTH, BATCH, SIGMA = 1000, 8, 50, 32, 0.1

# engine -> kwargs of bp.fit for about ``steps`` optimizer steps
ENGINES = {
    "sgld": lambda steps: dict(batch_size=BATCH, num_warmup=10, num_samples=steps, thin=1),
    "sghmc": lambda steps: dict(batch_size=BATCH, num_warmup=10, num_samples=steps, thin=1),
    # two cycles, exploration 0.8, thin 1: 2 * ceil(num_samples / 2 / 0.2) = 5 * num_samples steps
    "csgmcmc": lambda steps: dict(batch_size=BATCH, num_cycles=2, num_samples=2 * max(1, steps // 10), thin=1),
    "swag": lambda steps: dict(
        batch_size=BATCH,
        pretrain_steps=steps // 2,
        num_steps=steps // 2,
        burn_in=0,
        collect_every=1,
        swag_rank=5,
        num_samples=20,
    ),
    "ensemble": lambda steps: dict(batch_size=BATCH, num_chains=1, num_steps=steps),
    "laplace": lambda steps: dict(num_steps=steps, num_samples=20),
    "mc_dropout": lambda steps: dict(batch_size=BATCH, num_steps=steps, num_samples=20),
}


def model(kind: str = "fixed") -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(D, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    noise = dist.HalfNormal(1.0) if kind == "learned" else SIGMA
    bayesian = "weights" if kind == "deterministic biases" else "all"
    return bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=noise), bayesian=bayesian
    )


@contextmanager
def pyro_path(off: bool):
    """``Potential``'s fast path declines every model inside the block (``off``), as ``fast_path=False`` does."""
    build = _potential._FastEnergy.__dict__["build"]
    if off:
        _potential._FastEnergy.build = classmethod(lambda cls, *args: None)
    try:
        yield
    finally:
        _potential._FastEnergy.build = build


def time_potential(kind: str, calls: int, repeats: int, x, y) -> list[dict]:
    pots = {}
    for label, fast in (("fast", True), ("pyro", False)):
        pyro.clear_param_store()
        pots[label] = Potential(model(kind), Data(x=x, y=y, batch_size=BATCH), fast_path=fast)
    g = torch.Generator().manual_seed(0)
    batches = [(x[i], y[i]) for i in (torch.randint(N, (BATCH,), generator=g) for _ in range(calls))]
    best = {label: float("inf") for label in pots}
    for _ in range(repeats):
        for label, pot in pots.items():  # interleaved
            z = {k: v.clone().requires_grad_() for k, v in pot.init.items()}
            pot(z, batches[0]).backward()  # untimed first call
            start = time.perf_counter()
            for batch in batches:
                pot(z, batch).backward()
            best[label] = min(best[label], (time.perf_counter() - start) / calls * 1e3)
    return [
        dict(
            workload="potential",
            setting=f"8-50-1, {kind} noise" if kind != "deterministic biases" else "8-50-1, deterministic biases",
            path=f"{label} ({pots[label].path})",
            ms=best[label],
            unit="ms/call",
            ratio=best[label] / best["pyro"],
        )
        for label in pots
    ]


def time_engine(method: str, short: int, long: int, repeats: int, x, y) -> list[dict]:
    def fit(steps: int, off: bool) -> float:
        with pyro_path(off), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # short fits warn (ESS, convergence): not what is measured
            start = time.perf_counter()
            bp.fit(model(), x, y, method=method, seed=0, progress=False, **ENGINES[method](steps))
            return time.perf_counter() - start

    times = {(off, steps): float("inf") for off in (False, True) for steps in (short, long)}
    for off in (False, True):
        fit(short, off)  # untimed: first-call costs (imports, torch's first kernels) of this engine and path
    for _ in range(repeats):
        for off in (False, True):  # interleaved
            for steps in (short, long):
                times[off, steps] = min(times[off, steps], fit(steps, off))
    ms = {off: (times[off, long] - times[off, short]) / (long - short) * 1e3 for off in (False, True)}
    return [
        dict(
            workload="fit",
            setting=method,
            path="pyro" if off else "fast",
            ms=ms[off],
            unit="ms/step",
            ratio=ms[off] / ms[True],
        )
        for off in (False, True)
    ]


def pyro_hmc_kernel(x, y):
    """An ``HMCConfig.kernel`` that builds Pyro's HMC on the log joint's traced potential (module docstring)."""
    from pyro.infer.mcmc.util import initialize_model  # noqa: PLC0415

    from bnn_pyro.infer import _kernels, _logjoint  # noqa: PLC0415

    def kernel(config, model, chain):
        params, _, transforms, _ = initialize_model(
            model, model_args=(x, y), init_strategy=chain.init_strategy, skip_jit_warnings=True
        )
        pyro_hmc = _kernels.PyroHMC(
            potential_fn=_logjoint.potential(chain.joint, transforms, x, y, jit=config.jit),
            transforms=transforms,
            step_size=1.0,
            adapt_step_size=True,
            adapt_mass_matrix=True,
            full_mass=config.dense_mass,
            target_accept_prob=config.target_accept,
        )
        pyro_hmc.initial_params, pyro_hmc.resume, pyro_hmc.metric = params, None, None
        pyro_hmc.fixed_num_steps, pyro_hmc.leapfrog_jitter = config.num_leapfrog, config.leapfrog_jitter
        return pyro_hmc

    return kernel


def time_hmc(short: int, long: int, repeats: int) -> list[dict]:
    from _common import bnn  # noqa: PLC0415
    from _common import regression as data

    from bnn_pyro.infer import mcmc  # noqa: PLC0415

    x, y = data(200, 1)
    flat_kernel, pyro_kernel = mcmc.HMCConfig.kernel, pyro_hmc_kernel(x, y)

    def fit(draws: int, flat: bool) -> float:
        mcmc.HMCConfig.kernel = flat_kernel if flat else pyro_kernel
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                bp.fit(
                    bnn(1), x, y, method="hmc", num_leapfrog=16, num_warmup=5, num_samples=draws, seed=0, progress=False
                )
                return time.perf_counter() - start
        finally:
            mcmc.HMCConfig.kernel = flat_kernel

    times = {(flat, n): float("inf") for flat in (True, False) for n in (short, long)}
    for flat in (True, False):
        fit(short, flat)  # untimed first-call costs
    for _ in range(repeats):
        for flat in (True, False):  # interleaved
            for n in (short, long):
                times[flat, n] = min(times[flat, n], fit(n, flat))
    ms = {flat: (times[flat, long] - times[flat, short]) / ((long - short) * 16) * 1e3 for flat in (True, False)}
    return [
        dict(
            workload="hmc",
            setting="1-50-1, N=200, 16 leapfrog/draw",
            path="flat (FlatHMC), analytic potential" if flat else "pyro HMC, traced potential",
            ms=ms[flat],
            unit="ms/leapfrog",
            ratio=ms[flat] / ms[False],
        )
        for flat in (True, False)
    ]


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/engine_speed/)")
    parser.add_argument("--name", default="results", help="the result files' name (default results)")
    parser.add_argument("--note", default="", help="a line on the machine's conditions, for the table's footer")
    parser.add_argument("--only", choices=["hmc"], default=None, help="only the HMC kernels' rows")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    short, long, calls = (10, 30, 20) if args.quick else (20, 120, 200)
    x, y = regression(N, D)
    rows = []
    with torch_threads(1):
        rows += time_hmc(*((5, 20) if args.quick else (10, 60)), repeats)  # as hmc_draws below
        print(rows[-2], rows[-1], flush=True)
        for kind in () if args.only else ("fixed", "learned", "deterministic biases"):
            rows += time_potential(kind, calls, repeats, x, y)
            print(rows[-2], rows[-1], flush=True)
        for method in () if args.only else ENGINES:
            rows += time_engine(method, short, long, repeats, x, y)
            print(rows[-2], rows[-1], flush=True)
    table = pd.DataFrame(rows)
    out = results_dir("engine_speed", args.out)
    table.to_csv(out / f"{args.name}.csv", index=False)
    shown = table.assign(ms=table.ms.map("{:.3f}".format), ratio=table.ratio.map("{:.2f}".format))
    hmc_draws = (5, 20) if args.quick else (10, 60)
    footer = (
        f"torch {torch.__version__}, pyro {pyro.__version__}, 1 torch thread ({thread_note()}); minimum of "
        f"{repeats} interleaved repeats; hmc: ({hmc_draws[1]} - {hmc_draws[0]}) draws of 16 leapfrog steps "
        "differenced"
        + ("" if args.only else f"; potential: {calls} calls; fit: ({long} - {short}) steps differenced")
        + "; ratio = fast (flat) / Pyro's path in the same run."
    )
    write_result(
        out / f"{args.name}.md", markdown(shown) + "\n\n" + footer + ("\n\n" + args.note if args.note else "") + "\n"
    )
    print(markdown(shown))
    return table


if __name__ == "__main__":
    main()
