"""The figures the README states: its quickstart block run as written, at its own settings, timed and measured.

The block is read from ``README.md`` (the ``## Quickstart`` section, the block ``tests/test_readme.py`` runs with
tiny settings), executed once in this process with ``bp.fit`` wrapped to time each fit, and what the README says
about the run is measured from the objects the block leaves behind:

- wall time of each ``bp.fit`` call (SVI, then NUTS started from it);
- NUTS: adapted step size per chain, the share of kept draws at ``max_tree_depth`` (10), divergences;
- function-space R-hat and bulk / tail ESS of ``f(x)`` at the training inputs (``summary(space="function")``);
- the epistemic sd of ``f`` in the gap (x = 0) and on the data (x = -1.5), and their ratio;
- the ``DiagnosticWarning`` messages the fits raised.

Usage: ``python benchmarks/readme_figures.py [--out DIR]`` writes ``quickstart.md`` and ``quickstart.csv`` under
``benchmarks/results/readme/`` with a header (date, commit, machine, threads, load average before and after).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import markdown, thread_note  # noqa: E402

import bnn_pyro as bp  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_code() -> str:
    """The first ``python`` block of the README's ``## Quickstart`` section."""
    section = README.read_text().split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main(args) -> pd.DataFrame:
    load_before = os.getloadavg()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()  # the code that runs: read before the run
    walls: list[tuple[str, float]] = []
    fit = bp.fit

    def timed_fit(*a, **k):
        start = time.perf_counter()
        post = fit(*a, **k)
        walls.append((k.get("method", "svi"), time.perf_counter() - start))
        return post

    bp.fit = timed_fit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # the block writes trace.png and posterior.bnn into the working folder
    namespace: dict = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(quickstart_code(), "README quickstart", "exec"), namespace)
    finally:
        bp.fit = fit
        os.chdir(cwd)
        for name in ("trace.png", "posterior.bnn"):
            (out / name).unlink(missing_ok=True)
    mc = namespace["mc"]
    stats = mc.sample_stats
    depth = torch.as_tensor(stats["tree_depth"])
    table = mc.summary(space="function", warn=False)
    probe = mc.predict(torch.tensor([[0.0], [-1.5]]), seed=0)
    sd_gap, sd_data = (float(v) for v in probe.epistemic_std)
    step = torch.as_tensor(stats["step_size"])[:, -1] if "step_size" in stats else None
    rows = [dict(figure=f"{method} fit wall time (s)", value=round(wall, 1)) for method, wall in walls]
    rows += [
        dict(figure="NUTS chains x kept draws", value=f"{depth.shape[0]} x {depth.shape[1]}"),
        dict(
            figure="NUTS adapted step size per chain",
            value=" ".join(f"{float(s):.2g}" for s in step) if step is not None else "n/a",
        ),
        dict(figure="share of kept draws at max_tree_depth 10", value=round(float((depth >= 10).float().mean()), 3)),
        dict(figure="divergent transitions", value=int(torch.as_tensor(stats["diverging"]).sum())),
        dict(figure="R-hat of f(x), min-max", value=f"{table.r_hat.min():.2f}-{table.r_hat.max():.2f}"),
        dict(figure="bulk ESS of f(x), min-max", value=f"{table.ess_bulk.min():.0f}-{table.ess_bulk.max():.0f}"),
        dict(figure="tail ESS of f(x), min-max", value=f"{table.ess_tail.min():.0f}-{table.ess_tail.max():.0f}"),
        dict(figure="epistemic sd of f at x = 0 (in the gap)", value=round(sd_gap, 3)),
        dict(figure="epistemic sd of f at x = -1.5 (on the data)", value=round(sd_data, 3)),
        dict(figure="gap / data epistemic sd", value=round(sd_gap / sd_data, 1)),
    ]
    messages = sorted(
        {
            f"{w.category.__name__}: {str(w.message).splitlines()[0][:400]}"
            for w in caught
            if w.category.__name__ == "DiagnosticWarning"
        }
    )
    frame = pd.DataFrame(rows)
    load_after = os.getloadavg()
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {os.cpu_count()} CPU cores "
        f"(affinity {len(os.sched_getaffinity(0))}), {thread_note()}, torch {torch.__version__}; load average "
        f"(1/5/15 min) before {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f}, after "
        f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f}; README.md's quickstart block, run once "
        f"as written"
    )
    frame.to_csv(out / "quickstart.csv", index=False)
    body = (
        markdown(frame.astype(object))
        + "\n\nDiagnosticWarnings raised by the fits:\n\n"
        + ("\n".join(f"- {m}" for m in messages) or "- none")
        + "\n"
    )
    (out / "quickstart.md").write_text(header + "\n\n" + body)
    print(header)
    print(frame.to_string(index=False))
    print("\n".join(messages))
    return frame


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "readme"))
    main(parser.parse_args())
