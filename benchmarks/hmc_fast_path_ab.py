"""HMC per leapfrog step on classification nets: this checkout against an earlier revision, alternating in one run.

Up to 3821398, ``bp.fit(..., method="hmc")`` ran the library's flat-vector kernel (``FlatHMC``) only where the
analytic potential applies (Normal priors, a Gaussian likelihood) and Pyro's ``HMC`` on the generic compiled
potential otherwise (a ``Categorical`` likelihood); since then it runs ``FlatHMC`` wherever the fast path builds a
log joint, as NUTS does. On ``benchmarks/classification.py``'s model (``Linear(D, 50) - ReLU - Linear(50, K)``,
``Normal(0, 1)`` prior, ``Categorical`` likelihood) for breast_cancer and iris, split ``--split``: one chain
(``chain_method="sequential"``, so in the measuring process), HMC at its defaults (32 jittered leapfrog steps per
draw) for ``--warmup`` warm-up and ``--draws`` kept draws, seed = split. Per side: the measuring thread's CPU time
(``time.thread_time``) of the kept draws' transitions divided by their leapfrog steps (``sample_stats["n_steps"]``),
and the whole fit's wall time (compilation and warm-up included).

``--nets uncompiled``: instead, two nets whose potential's gradient cannot be recorded as one graph (the fast path
warns and falls back), on synthetic data of 100 rows: ``Conv1d(1, 4, 3) - ReLU - Flatten - Linear(24, 3)`` with a
``Categorical`` likelihood, and ``Linear(4, 16) - LayerNorm - Tanh - Linear(16, 1)`` with a ``Bernoulli`` one. Up to
fcaf34e HMC ran Pyro's HMC on them (the energy traced by TorchScript, autograd per step); from 0158693 ``FlatHMC`` on
the eager gradient; since the traced-energy fallback (``_logjoint._compiled``), ``FlatHMC`` on the traced energy.
``--method nuts``: the same for NUTS (``FlatNUTS`` throughout, ms per leapfrog step from ``sample_stats["n_steps"]``).

``--before REV`` (default ``3821398``): that revision's ``bnn_pyro`` is extracted by ``git archive``; each side runs in
a child process of its own, the sides alternating ``--repeats`` times; each figure is the median over repeats and
the ratio is after / before.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/hmc_fast_path_ab.py [--before REV] [--nets classification|uncompiled]
[--method hmc|nuts] [--repeats 3] [--out DIR] [--name results]`` writes ``<name>.md`` (headed by the run's
provenance) in ``benchmarks/results/hmc_fast_path_ab/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATASETS = ("breast_cancer", "iris")
UNCOMPILED = ("conv1d categorical", "layernorm bernoulli")


def _uncompiled(name: str):
    """``(model, x, y)`` of one of :data:`UNCOMPILED` (synthetic data, 100 rows, seeded)."""
    import torch

    import bnn_pyro as bp

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    nn = torch.nn
    if name == "conv1d categorical":
        x, y = torch.randn(100, 1, 8, generator=g), torch.randint(3, (100,), generator=g)
        net, likelihood = nn.Sequential(nn.Conv1d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3)), "Categorical"
    else:
        x = torch.randn(100, 4, generator=g)
        y = (x[:, 0] > 0).float()
        net, likelihood = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1)), "Bernoulli"
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=getattr(bp.likelihoods, likelihood)()), x, y


def _child(settings: dict) -> list[dict]:
    """In a child process: per data set, ms per leapfrog step of the kept draws and the fit's wall time."""
    import warnings

    from classification import load_dataset, make_model, make_split

    import bnn_pyro as bp
    from bnn_pyro.infer import mcmc

    spent = {"cpu": 0.0, "steps": 0, "calls": 0}
    config = mcmc.HMCConfig if settings["method"] == "hmc" else mcmc.NUTSConfig
    original = config.kernel

    def timed(self, model, chain, *model_args):  # model_args: up to 0158693's interface
        built = original(self, model, chain, *model_args)
        kernel = built[0] if isinstance(built, tuple) else built  # (kernel, params, transforms) up to 0158693
        sample, spent["kernel"] = kernel.sample, type(kernel).__name__  # FlatHMC, FlatNUTS or PyroHMC (Pyro's HMC)

        def run(p):
            start = time.thread_time()
            out = sample(p)
            spent["calls"] += 1
            if spent["calls"] > settings["warmup"]:  # kept draws only: the step size no longer changes
                spent["cpu"] += time.thread_time() - start
                spent["steps"] += int(kernel.stats.n_steps)
            return out

        kernel.sample = run
        return built

    config.kernel = timed
    rows = []
    for name in settings["datasets"]:
        spent.update(cpu=0.0, steps=0, calls=0)
        if name in UNCOMPILED:
            model, x_train, y_train = _uncompiled(name)
        else:
            x, y = load_dataset(name)
            s = make_split(x, y, settings["split"])
            model = make_model(s["x_train"].shape[1], int(y.max()) + 1, settings["split"])
            x_train, y_train = s["x_train"], s["y_train"]
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # short fits warn (ESS); the uncompiled nets' fallback warns
            bp.fit(
                model,
                x_train,
                y_train,
                method=settings["method"],
                num_samples=settings["draws"],
                num_warmup=settings["warmup"],
                num_chains=1,
                chain_method="sequential",
                seed=settings["split"],
                progress=False,
            )
        wall = time.perf_counter() - start
        rows.append(
            dict(
                dataset=name,
                kernel=spent["kernel"],
                ms_per_leapfrog=1e3 * spent["cpu"] / spent["steps"],
                steps=spent["steps"],
                fit_s=wall,
            )
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="3821398")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--draws", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--nets", choices=["classification", "uncompiled"], default="classification")
    parser.add_argument("--method", choices=["hmc", "nuts"], default="hmc")
    parser.add_argument("--name", default="results", help="the result file's name (default results)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import pandas as pd
    from _common import alternating, exported, markdown, results_dir, side_result, write_result

    names = DATASETS if args.nets == "classification" else UNCOMPILED
    settings = dict(datasets=list(names), split=args.split, warmup=args.warmup, draws=args.draws, method=args.method)
    with exported(args.before) as before:
        sides = {f"before ({args.before})": before, "after (this tree)": ROOT}
        runs = alternating(sides, args.repeats, lambda tree: side_result(tree, "hmc_fast_path_ab", "_child", settings))
    rows = []
    for side, results in runs.items():
        for i, name in enumerate(names):
            per = [r[i] for r in results]
            rows.append(
                dict(
                    dataset=name,
                    side=side,
                    kernel=per[0]["kernel"],
                    ms_per_leapfrog=statistics.median(r["ms_per_leapfrog"] for r in per),
                    leapfrog_steps=per[0]["steps"],
                    fit_s=statistics.median(r["fit_s"] for r in per),
                )
            )
    table = pd.DataFrame(rows)
    base = table[table.side.str.startswith("before")].set_index("dataset")
    table["ratio_to_before"] = [r.ms_per_leapfrog / base.loc[r.dataset, "ms_per_leapfrog"] for r in table.itertuples()]
    table["fit_ratio_to_before"] = [r.fit_s / base.loc[r.dataset, "fit_s"] for r in table.itertuples()]
    text = (
        f"{args.method.upper()} at its defaults on "
        + ("classification.py's model" if args.nets == "classification" else "the uncompiled nets (module docstring)")
        + f", split {args.split}, one chain: {args.warmup} warm-up and "
        f"{args.draws} kept draws; ms per leapfrog step over the kept draws (thread CPU time), fit wall time; "
        f"medians of {args.repeats} alternating repeats per side; ratios to the before side of this run.\n\n"
        + markdown(table.round(4))
    )
    path = write_result(results_dir("hmc_fast_path_ab", args.out) / f"{args.name}.md", text)
    print(path.read_text())


if __name__ == "__main__":
    main()
