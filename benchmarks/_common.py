"""What the speed benchmarks share: data, nets, devices, thread settings, timing, ESS and Markdown.

Every benchmark builds the same tanh MLP (Normal(0, 1) prior on every weight, Gaussian noise
``SIGMA``) on the same generated data, so the peers see identical models, data and starting weights.
The data and the starting weights are drawn on the CPU from fixed seeds (the same numbers on every
device) and moved once to ``device``; everything made inside a timed loop is made on the device.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp

SIGMA = 0.1
RESULTS = Path(__file__).resolve().parent / "results"
"""benchmarks/results/: one folder per benchmark (see benchmarks/README.md)."""
# The load average when the benchmark started (this module is imported before any measuring), for the header.
START_LOAD = os.getloadavg() if hasattr(os, "getloadavg") else None
# The torch intra-op threads a user gets (one per core unless OMP_NUM_THREADS says otherwise), read at
# import, before any benchmark changes it.
DEFAULT_THREADS = torch.get_num_threads()


def regression(n: int, d: int, seed: int = 0, device="cpu"):
    """``n`` points in [-2, 2]^d, ``y = sin(2 mean(x)) + SIGMA * noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * 4 - 2
    y = torch.sin(2 * x.mean(1)) + SIGMA * torch.randn(n, generator=g)
    return x.to(device), y.to(device)


def mlp(d: int, width: int = 50, seed: int = 0, depth: int = 1, device="cpu") -> torch.nn.Sequential:
    """A tanh MLP ``d-width-...-width-1`` with ``depth`` hidden layers, torch's default initialisation."""
    torch.manual_seed(seed)
    layers, size = [], d
    for _ in range(depth):
        layers += [torch.nn.Linear(size, width), torch.nn.Tanh()]
        size = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(size, 1)).to(device)


def bnn(d: int, width: int = 50, depth: int = 1, device="cpu") -> bp.BNN:
    return bp.BNN(
        mlp(d, width, depth=depth, device=device),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=SIGMA),
    )


def predict_workload(draws: int, points: int, device="cpu", *, training_data: bool = True):
    """The prediction benchmarks' workload: ``(post, x, layers)``, a Posterior of :func:`bnn` (one input) holding
    ``draws`` draws ``0.5 * N(0, 1)`` (seed 1; drawn on the CPU, moved to ``device``), with 50 training rows when
    ``training_data``; ``points`` inputs ``x`` (:func:`regression`, seed 2); ``layers``: ``(W, b)`` per Linear layer
    for the hand-written loops of ``baselines``."""
    model = bnn(1, device=device)
    g = torch.Generator().manual_seed(1)
    shapes = model.param_shapes.items()
    samples = {n: (0.5 * torch.randn((1, draws) + s, generator=g)).to(device) for n, s in shapes}
    data = dict(zip(("x", "y"), regression(50, 1, device=device))) if training_data else {}
    post = bp.Posterior(samples=samples, model=model, method="svi", **data)
    layers = [(samples[f"{i}.weight"][0], samples[f"{i}.bias"][0]) for i in (0, 2)]
    return post, regression(points, 1, seed=2, device=device)[0], layers


def layer_shapes(d: int, width: int = 50, depth: int = 1) -> list[tuple[int, int]]:
    """(out, in) of each Linear layer of :func:`mlp`."""
    sizes = [d] + [width] * depth + [1]
    return list(zip(sizes[1:], sizes[:-1]))


def now(device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_device(name: str) -> str:
    """``--device``: a torch device this machine has (a clear exit otherwise)."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise SystemExit(f"--device: expected a torch device such as cpu or cuda, got {name!r} ({error}).") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
            "run on a machine with a GPU and a CUDA build of torch, or use --device cpu."
        )
    return name


def per_step(run, short: int, long: int, repeats: int, device="cpu") -> float:
    """(fastest of ``repeats`` timings of ``long`` steps - fastest of ``short``) / (long - short), in ms:
    set-up and first-call costs drop out, and the minimum of each keeps other processes' bursts out."""
    shorts, longs = [], []
    run(2)  # untimed: compilation and first-call costs
    for _ in range(repeats):
        start = now(device)
        run(short)
        middle = now(device)
        run(long)
        end = now(device)
        shorts.append(middle - start)
        longs.append(end - middle)
    return (min(longs) - min(shorts)) / (long - short) * 1e3


def time_calls(module, name: str, seconds: list) -> None:
    """Replace ``module.name`` by a wrapper that appends each call's seconds to ``seconds``: a stage timed inside a
    fit that calls it through its module (the SVI refinement, gap and mean step). For the rest of the process."""
    inner = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(module, name, timed)


@contextmanager
def switched_off(*stages: tuple):
    """Inside the block each ``(module, name)`` in ``stages`` is a function that does nothing (returns ``None``):
    a fit without those stages, e.g. the one-step fit whose seconds are a fit's fixed cost."""
    saved = [(module, name, getattr(module, name)) for module, name in stages]
    for module, name, _ in saved:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for module, name, inner in saved:
            setattr(module, name, inner)


def default_fit_seconds(fit_s: float, stage_s: float, fixed_s: float, steps: int, default_steps: int) -> dict:
    """A default-length fit's seconds, extrapolated from a fit of ``steps`` steps that took ``fit_s`` seconds, of
    which ``stage_s`` were stages after its steps, and a one-step fit without them that took ``fixed_s`` (start,
    draws): ``fixed + default_steps x`` the seconds per step. Returns the columns ``fixed_s``, ``step_ms`` and the
    extrapolated ``default_s``."""
    per = max(fit_s - stage_s - fixed_s, 0.0) / (steps - 1)
    return dict(fixed_s=round(fixed_s, 2), step_ms=round(1e3 * per, 2), default_s=fixed_s + default_steps * per)


@contextmanager
def torch_threads(n: int):
    """Torch intra-op threads ``n`` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_settings() -> list[int]:
    """The torch thread settings every torch workload is measured at: 1 and the user's default."""
    return sorted({1, DEFAULT_THREADS})


def thread_note() -> str:
    """What decides the thread counts on this machine, for the tables' headers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = ", ".join(
        f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS") if k in os.environ
    )
    return f"{cores} cores; torch default {DEFAULT_THREADS} intra-op threads" + (
        f" ({env})" if env else " (no thread variables set)"
    )


# ---------------------------------------------------------------------- function space and ESS
def forward_draws(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The tanh MLP's output at ``x`` (points, d) for every draw: ``layers`` holds (W, b) per layer with
    W (chains, draws, out, in) and b (chains, draws, out); returns (chains, draws, points)."""
    h = np.broadcast_to(x, layers[0][0].shape[:2] + x.shape)
    for i, (w, b) in enumerate(layers):
        h = np.einsum("cspi,csoi->cspo", h, w) + b[:, :, None, :]
        if i < len(layers) - 1:
            h = np.tanh(h)
    return h[..., 0]


def bulk_ess(draws: np.ndarray) -> float:
    """Median over the last axis of ArviZ's bulk ESS of ``draws`` (chains, draws, k)."""
    import arviz as az

    return float(np.median(az.ess(az.convert_to_dataset(draws), method="bulk")["x"].values))


def probe_points(d: int) -> np.ndarray:
    """The few inputs at which function-space ESS is measured (the same for every sampler)."""
    return regression(5, d, seed=3)[0].numpy()


def markdown(table: pd.DataFrame) -> str:
    """A GitHub Markdown table (pandas' to_markdown needs the optional tabulate package)."""
    rows = [list(table.columns), ["---"] * table.shape[1]] + table.astype(str).values.tolist()
    return "".join("| " + " | ".join(map(str, r)) + " |\n" for r in rows)


# ---------------------------------------------------------------------- where results go, and their header
def results_dir(benchmark: str, out: str | os.PathLike | None = None) -> Path:
    """The folder a benchmark writes into, created: ``out`` when given (``--out``), else
    ``benchmarks/results/<benchmark>/``."""
    folder = Path(out) if out is not None else RESULTS / benchmark
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu model unknown"


def _load(values) -> str:
    return "unknown" if values is None else " / ".join(f"{v:.2f}" for v in values)


def provenance() -> str:
    """One line for the top of a result: when (UTC), which code (commit, and whether the tree had uncommitted
    changes to bnn_pyro/, models/ or benchmarks/ outside benchmarks/results/), which machine, which torch and thread settings, and the load average
    (1/5/15 min) at the start (this module's import) and at the end (now)."""
    commit = _git("rev-parse", "--short=10", "HEAD") or "unknown"
    # results are this code's outputs, not code: a table written before its .md (save_table) is no change to either
    dirty = _git("status", "--porcelain", "--", "bnn_pyro", "benchmarks", "models", ":(exclude)benchmarks/results")
    code = commit + (" with uncommitted changes" if dirty else "")
    end = os.getloadavg() if hasattr(os, "getloadavg") else None
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Run {when}; commit {code}; {platform.machine()} {_cpu_model()}, {thread_note()}; "
        f"torch {torch.__version__}; load average (1/5/15 min) at start {_load(START_LOAD)}, at end {_load(end)}."
    )


def write_result(path: str | os.PathLike, text: str) -> Path:
    """Write a Markdown result with :func:`provenance` as its first paragraph (CSV files stay plain tables; the
    Markdown result written beside them carries their header)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(provenance() + "\n\n" + text)
    return path


def size_pairs(spec: str) -> list[tuple[int, int]]:
    """A cost benchmark's ``--pairs`` (``"150x1000,500x1000"``): its (coordinates, rows) sizes."""
    return [tuple(map(int, pair.split("x"))) for pair in spec.split(",")]


def run_sizes(one, pairs: list[tuple[int, int]], guides: list[str], steps: int) -> pd.DataFrame:
    """One row per size and guide, ``one(dim, rows, steps, guide)``, each printed as it comes (a long run shows its
    progress)."""
    table = []
    for dim, rows in pairs:
        for guide in guides:
            table.append(one(dim, rows, steps, guide))
            print(table[-1], flush=True)
    return pd.DataFrame(table)


def save_table(frame: pd.DataFrame, benchmark: str, name: str, description: str) -> Path:
    """``frame`` as ``NAME.csv`` and as ``NAME.md`` (:func:`write_result`: ``description``, then the table) in the
    benchmark's results folder."""
    folder = results_dir(benchmark)
    frame.to_csv(folder / f"{name}.csv", index=False)
    return write_result(folder / f"{name}.md", description + "\n\n" + markdown(frame))


# ---------------------------------------------------------------------- A/B runs against an earlier revision
@contextmanager
def exported(revision: str):
    """``bnn_pyro/`` as of git ``revision``, extracted (``git archive``) into a temporary folder that is yielded
    (put it first on ``PYTHONPATH``) and removed afterwards: the "before" side of an A/B benchmark."""
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", revision, "bnn_pyro"], cwd=root, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield Path(tmp)


def side_result(tree: str | os.PathLike, module: str, function: str, settings: dict):
    """``module.function(settings)`` (a benchmark's child entry point, in ``benchmarks/``) run in a child process
    whose ``bnn_pyro`` is the one under ``tree`` (checked); returns its JSON result. Each side of an A/B runs
    in a process of its own, so that the two libraries never share an interpreter."""
    import json
    import sys
    import tempfile

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(here)]))
    code = (
        "import sys, json, importlib, bnn_pyro; tree = sys.argv[1]; "
        "assert bnn_pyro.__file__.startswith(tree), f'imported {bnn_pyro.__file__}, not from {tree}'; "
        "run = getattr(importlib.import_module(sys.argv[2]), sys.argv[3]); "
        "print(json.dumps(run(json.loads(sys.argv[4]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tree), module, function, json.dumps(settings)],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"the run on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternating(sides: dict[str, Path], repeats: int, run) -> dict[str, list]:
    """``run(tree)`` for every side, the sides alternating ``repeats`` times (a burst of load hits both alike);
    returns each side's results in order."""
    runs = {name: [] for name in sides}
    for _ in range(repeats):
        for name, tree in sides.items():
            runs[name].append(run(tree))
    return runs
