"""Laplace fits that factorize their precision once: this checkout against an earlier revision, interleaved in one run.

A Laplace fit used to factorize its dense posterior precision ``H`` five times (the positive-definiteness check, the
Newton step, the evidence, the draws and their density), and with ``structure="kron"`` under a prior that splits a
layer's block into a weight and a bias block, to eigendecompose the split blocks' factors again at every candidate of
the held-out noise search; and ``newton_mode`` (the Newton polish of a Pyro function's MAP search, and of
``check_typical``) went on recomputing the same Hessian and factor once a step left the point unchanged. Now the
check's Cholesky factor is kept and reused, the split blocks are made once and ``newton_mode`` stops there. The
answers must not move: each side reports a digest (SHA-256 of the bytes) of the Gaussian's mean, precision and
Cholesky factor (``laplace_approximation``; "before" has no kept factor: ``torch.linalg.cholesky(H)``, as its own fit
computed it), of ``bp.fit``'s draws and their ``log_q``, and the log evidence.

Cases (one thread, seed 0; every net a tanh MLP, ``Normal(0, 1)`` prior unless said):

- ``full``: ``bp.BNN`` 2-48-48-1 regression (2,545 coordinates), ``sigma = 0.1`` known, ``structure="full"``, N = 200;
- ``last_layer``: 20-400-10 classifier (4,010 last-layer coordinates: the default structure, ``gamma`` formed too),
  N = 500;
- ``kron``: 8-100-100-1 regression, a learned noise (``HalfNormal(1)``) chosen on held-out rows (the default
  ``validation``), bias prior ``Normal(0, 3)`` (each layer's block splits), ``structure="kron"``, N = 500;
- ``function``: a Pyro-function logistic regression (6 coefficients; ``full`` exact Hessian): the answers only, its
  ``H`` is 7 x 7.

The MAP searches are short (``num_steps`` 20, ``polish_steps`` 5; ``kron``: 20 and the default 0) so that the fit's
time is mostly what follows the search. Figures per case and side: ``bp.fit``'s thread CPU time (``time.thread_time``,
the minimum over ``--repeats`` alternating repeats; a busy machine inflates it less than wall time) and the calls of
``torch.linalg.cholesky`` / ``cholesky_ex`` / ``eigh`` during it (the MAP search's own Newton steps included).

``--before REV`` (default ``55708de``): that revision's ``bnn_pyro`` is extracted by ``git archive`` into a temporary
folder; each side runs in a child process of its own (``PYTHONPATH`` set to its tree).

Usage: ``python benchmarks/laplace_factor_ab.py [--before REV] [--repeats 3] [--out DIR]`` writes
``factor_once_ab.md`` (headed by the run's provenance) and ``factor_once_ab.csv`` in
``benchmarks/results/laplace_speed/``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CASES = ("full", "last_layer", "kron", "function")
FACTORIZATIONS = ("cholesky", "cholesky_ex", "eigh")


def _case(name: str):
    """``(model, x, y, config)`` of a case (built on the CPU from fixed seeds: the same on both sides)."""
    import pyro
    import pyro.distributions as dist
    import torch

    import bnn_pyro as bp

    g = torch.Generator().manual_seed(0)
    quick = dict(num_steps=20, polish_steps=5)

    def mlp(*widths):
        torch.manual_seed(0)
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers[:-1])

    if name == "full":
        x = torch.rand(200, 2, generator=g) * 4 - 2
        y = torch.sin(2 * x.mean(1)) + 0.1 * torch.randn(200, generator=g)
        model = bp.BNN(mlp(2, 48, 48, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(0.1))
        return model, x, y, dict(structure="full", **quick)
    if name == "last_layer":
        x = torch.randn(500, 20, generator=g)
        y = (x[:, :10] + 0.5 * torch.randn(500, 10, generator=g)).argmax(1)
        model = bp.BNN(mlp(20, 400, 10), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
        return model, x, y, quick
    if name == "kron":
        x = torch.rand(500, 8, generator=g) * 4 - 2
        y = torch.sin(2 * x.mean(1)) + 0.1 * torch.randn(500, generator=g)
        prior = {"*.weight": dist.Normal(0.0, 1.0), "*.bias": dist.Normal(0.0, 3.0)}
        lik = bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))
        return bp.BNN(mlp(8, 100, 100, 1), prior=prior, likelihood=lik), x, y, dict(structure="kron", num_steps=20)

    def logistic(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([6]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Bernoulli(logits=x @ w + b), obs=y)

    x = torch.randn(100, 6, generator=g)
    y = (x @ torch.linspace(-1.0, 1.0, 6) + 0.5 * torch.randn(100, generator=g) > 0).float()
    return logistic, x, y, {}


def _digest(*tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _child(settings: dict) -> list[dict]:
    """In a child process: per case, ``bp.fit``'s CPU time and factorization calls, and the answers' digests, for
    the bnn_pyro on ``sys.path``."""
    import time
    import warnings
    from collections import Counter

    import torch

    import bnn_pyro as bp
    from bnn_pyro.infer._common import Data
    from bnn_pyro.infer.laplace import laplace_approximation

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the fits' health notes: the same on both sides, not what is measured
    calls = Counter()
    for name in FACTORIZATIONS:
        real = getattr(torch.linalg, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(torch.linalg, name, spy)
    rows = []
    for case in settings["cases"]:
        model, x, y, config = _case(case)
        calls.clear()
        start = time.thread_time()
        post = bp.fit(model, x, y, method="laplace", num_samples=200, seed=0, progress=False, **config)
        seconds = time.thread_time() - start
        counted = dict(calls)
        model, x, y, config = _case(case)
        approx = laplace_approximation(model, Data(x=x, y=y), seed=0, **config)
        h = approx.precision
        dense = torch.is_tensor(h) and h.dim() == 2
        factor = (approx.cholesky() if hasattr(approx, "cholesky") else torch.linalg.cholesky(h)) if dense else None
        rows.append(
            dict(
                case=case,
                fit_s=seconds,
                **{name: counted.get(name, 0) for name in FACTORIZATIONS},
                mean=_digest(approx.mean),
                precision=_digest(h)
                if torch.is_tensor(h)
                else _digest(*(b.g for b in h.blocks), *(b.a for b in h.blocks)),
                factor=_digest(factor) if dense else "-",
                draws=_digest(*(post.samples[k] for k in sorted(post.samples))),
                log_q=_digest(post.sample_stats["log_q"]),
                log_evidence=repr(post.config["log_evidence"]),
            )
        )
    return rows


def main(args) -> str:
    settings = dict(cases=args.cases.split(","))
    sys.path.insert(0, str(HERE))
    from _common import alternating, exported, results_dir, side_result, write_result  # this checkout's bnn_pyro

    with exported(args.before) as before:
        sides = {f"before ({args.before})": before, "after (this checkout)": ROOT}
        runs = alternating(sides, args.repeats, lambda tree: side_result(tree, "laplace_factor_ab", "_child", settings))
    answers = ("mean", "precision", "factor", "draws", "log_q", "log_evidence")
    lines = [
        "| case | side | bp.fit CPU s (min) | cholesky | cholesky_ex | eigh | answers |",
        "|---|---|---|---|---|---|---|",
    ]
    table = []
    (b_name, b_runs), (a_name, a_runs) = runs.items()
    for i, case in enumerate(settings["cases"]):
        best = {}
        for name, reps in runs.items():
            row = reps[0][i]
            same_reps = all(all(r[i][k] == row[k] for k in answers) for r in reps)  # each side deterministic
            best[name] = min(r[i]["fit_s"] for r in reps)
            same = all(b_runs[0][i][k] == a_runs[0][i][k] for k in answers)
            verdict = (
                "identical to before"
                if same
                else "DIFFER: " + ", ".join(k for k in answers if b_runs[0][i][k] != a_runs[0][i][k])
            ) + ("" if same_reps else "; not repeatable")
            lines.append(
                f"| {case} | {name} | {best[name]:.3f} | {row['cholesky']} | {row['cholesky_ex']} | {row['eigh']} | "
                f"{verdict} |"
            )
            table.append(
                {"case": case, "side": name, "fit_s_min": best[name], **{k: row[k] for k in row if k != "case"}}
            )
        lines.append(f"| {case} | ratio after / before | {best[a_name] / best[b_name]:.2f} | | | | |")
    lines += [
        "",
        f"Thread CPU time of one `bp.fit` (num_samples 200), minimum of {args.repeats} alternating repeats, 1 thread; "
        "the factorization counts and answers are the first repeat's (each side's repeats agree unless the table says "
        f"not). Answers: digests of {', '.join(answers)} compared between the sides (the digests are in the CSV). "
        f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared: compare the ratios).",
    ]
    text = "\n".join(lines) + ("\n\n" + args.note if args.note else "")
    print(text)
    out = results_dir("laplace_speed", args.out)
    with open(out / f"{args.name}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    write_result(out / f"{args.name}.md", text + "\n")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="55708de", help="the git revision measured as 'before'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--name", default="factor_once_ab", help="the files written: <name>.md and <name>.csv")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None, help="the folder written (default benchmarks/results/laplace_speed/)")
    main(parser.parse_args())
