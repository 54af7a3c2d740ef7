"""Where ``lr="auto"``'s bound on a rise of the step acts (``bnn_pyro.infer.sgmcmc_step.RISE``; docs/ood.md, "Ten
splits"): every SG-MCMC/snapshot engine at its defaults on the public protocols' splits, each curvature estimate
recorded (the step before it, the step ``fraction / lambda`` it asked for, the step it set), and the estimates whose
asked step exceeded ``RISE`` times the step before (the bound bound there).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/rise_bound_events.py --out benchmarks/results/rise_bound
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, classification, uci
import classification  # noqa: E402
import uci  # noqa: E402
from _common import markdown, results_dir, write_result  # noqa: E402

import bnn_pyro as bp  # noqa: E402
from bnn_pyro.infer import sgmcmc_step  # noqa: E402

CASES = ["wine:0", "wine:8", "diabetes:0"]
METHODS = ["snapshot", "csgmcmc", "sghmc", "sgld"]


def _spy(events: list[dict]):
    """Wrap :meth:`SGMCMC.adapt` so that each estimate appends ``t``, the step before, the asked and the set step."""
    adapt = sgmcmc_step.SGMCMC.adapt

    def spied(opt):
        before = opt.param_groups[0]["eta"]
        asked, curvature = [], opt.curvature

        def measured(*args):
            lam, vector = curvature(*args)
            asked.append(opt.plan.fraction / lam if lam > 0 else float("nan"))
            return lam, vector

        opt.curvature = None if curvature is None else measured
        try:
            adapt(opt)
        finally:
            opt.curvature = curvature
        if asked:
            t = opt.state[opt.param_groups[0]["params"][0]]["t"]
            events.append(dict(t=t, before=before, asked=asked[0], set=opt.param_groups[0]["eta"]))

    return spied


def _fit(case: str, method: str):
    name, split = case.split(":")
    split = int(split)
    if name == "diabetes":
        s = uci.make_splits(dataset="diabetes", n_splits=split + 1)[split]
        model, x, y = uci.make_model(s.x_train.shape[1], split), s.x_train, s.y_train
    else:
        x, y = classification.load_dataset(name)
        s = classification.make_split(x, y, split)
        model, x, y = classification.make_model(x.shape[1], int(y.max()) + 1, split), s["x_train"], s["y_train"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bp.fit(model, x, y, method=method, seed=split, progress=False)


def run(cases: list[str], methods: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, bound = [], []
    original = sgmcmc_step.SGMCMC.adapt
    try:
        for case in cases:
            for method in methods:
                events: list[dict] = []
                sgmcmc_step.SGMCMC.adapt = _spy(events)
                post = _fit(case, method)
                hits = [e for e in events if e["before"] is not None and e["asked"] > sgmcmc_step.RISE * e["before"]]
                bound += [dict(case=case, method=method, **e, ratio=e["asked"] / e["before"]) for e in hits]
                rows.append(
                    dict(
                        case=case,
                        method=method,
                        estimates=len(events),
                        bound=len(hits),
                        first_bound_steps=" ".join(str(e["t"]) for e in hits[:8]),
                        largest_asked_ratio=max((e["asked"] / e["before"] for e in hits), default=float("nan")),
                        recoveries=sum(len(r) for r in post.config.get("divergence_recovery", {}).values()),
                    )
                )
                print(rows[-1], flush=True)
    finally:
        sgmcmc_step.SGMCMC.adapt = original
    return pd.DataFrame(rows), pd.DataFrame(bound)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of dataset:split")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/rise_bound/)")
    args = parser.parse_args(argv)
    summary, bound = run(args.cases.split(","), args.methods.split(","))
    out = results_dir("rise_bound", args.out)
    bound.to_csv(out / "events.csv", index=False)
    write_result(
        out / "events.md",
        "# Where lr='auto''s step-rise bound acts\n\n"
        f"Each engine at its defaults (seed = split; wine: benchmarks/classification.py's split and model; diabetes:"
        f" benchmarks/uci.py's). `estimates`: the plan's curvature estimates, all chains (the"
        f" stability guard's own, which only lower the step, are not counted); `bound`: those whose asked step exceeded RISE = {sgmcmc_step.RISE:g} times the step before;"
        " `largest_asked_ratio`: the largest asked / before among them; `recoveries`: divergence recoveries, all chains."
        " Every bound estimate: [events.csv](events.csv).\n\n" + markdown(summary) + "\n",
    )


if __name__ == "__main__":
    main()
