"""Speed side by side: bnn_pyro against the tightest baselines an expert writes, at both sides' thread settings.

Every workload and its baseline run in this one invocation on a tanh MLP (Normal(0, 1) prior on
every weight, Gaussian likelihood, sigma 0.1; ``_common``); ratios are to the baseline measured here.
Every torch workload is measured at 1 thread and at torch's default (one per core), NumPyro at XLA's
default thread pool and at 1 thread; ``user default`` marks the setting a user gets without asking
(``bp.fit``: ``num_threads=1``; ``Posterior.predict``, hand-written torch and stock Pyro: torch's
default; NumPyro: XLA's). The summary table compares each side at its best setting and at its default.

- ``svi``: ms per Adam step, mean-field Gaussian, one particle, 8-50-1, N = 1,000 full batch
  ((time of ``long`` steps - time of ``short``) / their difference, so set-up drops out). Baseline:
  ``baselines.svi_loop`` (flat parameters, analytic KL, fused Adam); beside it the same loop with the
  Monte Carlo KL (the estimator of bnn_pyro's default ``elbo="trace"``), bnn_pyro's fast path, its
  ``elbo="mean_field"`` (analytic KL), stock Pyro (``AutoNormal`` + ``Trace_ELBO`` / ``JitTrace_ELBO``),
  bayesian-torch if installed.
- ``particles``: the same with 8 particles; baseline: the flat loop with one ``baddbmm`` per layer.
- ``nuts``: 1-50-1, N = 200 and 8-50-50-1, N = 1,000; ``--nuts-warmup`` + ``--nuts-draws``, tree depth
  <= ``--nuts-depth``, one chain, from the net's initial weights (``init="net"``). Baseline: NumPyro
  on the identical model, data, start and settings (``numpyro_peer``), the second run of the same
  MCMC with its XLA compile seconds subtracted (``ms_per_leapfrog_traceless``: JAX's tracing seconds
  removed too, a lower bound); its first run (compilation included) beside it.
  ms/leapfrog = wall / (mean leapfrog steps per kept draw x all iterations); ESS/s: ArviZ bulk ESS per
  second of wall time (warm-up included), in weight space (median over weights) and in function space
  (median over 5 test inputs of the network output f(x)). bnn_pyro's MCMC runs one torch thread per
  chain whatever the setting, so it has one row.
- ``predict``: predictive mean and std from 500 draws at 10,000 points, each implementation in a fresh
  process (an untimed call on 10 points first; peak memory above the start: RSS on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA); baseline ``baselines.predict_loop``.
- ``chains``: chains x iterations per second for 1, 2, 4, 8 NUTS chains (``chains.py``).

Usage: ``python benchmarks/performance.py [--quick] [--device cuda] [--out DIR] [--name run1]``
writes ``NAME.md`` (headed by the run's provenance) / ``.csv`` in ``benchmarks/results/performance/``. NumPyro and
JAX (the ``bench`` extra) and bayesian-torch
(``pip install --no-deps bayesian-torch``) are optional: rows for a missing one are skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
import baselines  # noqa: E402
import numpyro_peer  # noqa: E402
from _common import (
    DEFAULT_THREADS,
    SIGMA,
    bnn,
    bulk_ess,
    check_device,
    forward_draws,
    markdown,
    now,
    per_step,  # noqa: E402
    predict_workload,
    probe_points,
    regression,
    results_dir,
    thread_note,
    thread_settings,
    torch_threads,
    write_result,
)


def row(workload, implementation, value, unit, *, threads, default, role="other", **extra) -> dict:
    """``role``: "ours" (bnn_pyro's headline figure), "baseline" (the peer) or "other"."""
    return dict(
        workload=workload,
        implementation=implementation,
        threads=threads,
        user_default=default,
        value=value,
        unit=unit,
        role=role,
        **extra,
    )


# ---------------------------------------------------------------------- SVI
def bp_loop(x, y, particles: int = 1, threads: int = 1, **options):
    model = bnn(x.shape[1], device=x.device)
    return lambda steps: bp.fit(
        model,
        x,
        y,
        method="svi",
        num_steps=steps,
        num_particles=particles,
        num_samples=1,
        progress=False,
        num_threads=threads,
        **options,
    )


def pyro_loop(x, y, jit: bool):
    """Stock Pyro as a user writes it: a PyroModule net, AutoNormal, (Jit)Trace_ELBO, pyro.optim.Adam."""
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.nn import PyroModule, PyroSample

    dev = x.device
    net = PyroModule[torch.nn.Sequential](
        PyroModule[torch.nn.Linear](x.shape[1], 50), torch.nn.Tanh(), PyroModule[torch.nn.Linear](50, 1)
    ).to(dev)
    zero, one = torch.zeros((), device=dev), torch.ones((), device=dev)
    for layer in (net[0], net[2]):
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, PyroSample(dist.Normal(zero, one).expand(p.shape).to_event(p.dim())))

    def model(x, y=None):
        f = net(x)[..., 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(f, SIGMA), obs=y)

    pyro.clear_param_store()
    guide = AutoNormal(model, init_scale=0.01)
    svi = SVI(
        model, guide, pyro.optim.Adam({"lr": 1e-2}), (JitTrace_ELBO if jit else Trace_ELBO)(ignore_jit_warnings=True)
    )
    return lambda steps: [svi.step(x, y) for _ in range(steps)]


def bayesian_torch_loop(x, y):
    from bayesian_torch.layers import LinearReparameterization

    layers = torch.nn.ModuleList([LinearReparameterization(x.shape[1], 50), LinearReparameterization(50, 1)]).to(
        x.device
    )
    opt = torch.optim.Adam(layers.parameters(), lr=1e-2)

    def run(steps):
        for _ in range(steps):
            opt.zero_grad()
            h, kl1 = layers[0](x)
            f, kl2 = layers[1](torch.tanh(h))
            (-torch.distributions.Normal(f[:, 0], SIGMA).log_prob(y).sum() + kl1 + kl2).backward()
            opt.step()

    return run


def svi_rows(args) -> list[dict]:
    x, y = regression(1000, 8, device=args.device)
    short, long = (5, 45) if args.quick else (50, 550)
    time_it = lambda run: per_step(run, short, long, args.repeats, args.device)  # noqa: E731
    rows = []
    for t in thread_settings():
        user = t == DEFAULT_THREADS
        with torch_threads(t):
            for workload, p in (("svi", 1), ("particles", 8)):
                rows.append(
                    row(
                        workload,
                        f"hand-written flat loop, analytic KL, {p} particle{'s' * (p > 1)} (baseline)",
                        time_it(baselines.svi_loop(x, y, particles=p)),
                        "ms/step",
                        threads=t,
                        default=user,
                        role="baseline",
                    )
                )
                rows.append(
                    row(
                        workload,
                        f"hand-written flat loop, Monte Carlo KL (Trace_ELBO's estimator), {p} particle{'s' * (p > 1)}",
                        time_it(baselines.svi_loop(x, y, particles=p, kl="mc")),
                        "ms/step",
                        threads=t,
                        default=user,
                    )
                )
                rows.append(
                    row(
                        workload,
                        f"bnn_pyro (fast path, elbo='trace'), {p} particle{'s' * (p > 1)}",
                        time_it(bp_loop(x, y, p, t)),
                        "ms/step",
                        threads=t,
                        default=t == 1,
                        role="ours",
                    )
                )
            rows.append(
                row(
                    "svi",
                    "bnn_pyro, elbo='mean_field' (analytic KL)",
                    time_it(bp_loop(x, y, 1, t, elbo="mean_field")),
                    "ms/step",
                    threads=t,
                    default=t == 1,
                )
            )
            if not args.quick:
                for jit in (False, True):
                    rows.append(
                        row(
                            "svi",
                            f"stock Pyro, {'JitTrace_ELBO' if jit else 'Trace_ELBO'}",
                            time_it(pyro_loop(x, y, jit)),
                            "ms/step",
                            threads=t,
                            default=user,
                        )
                    )
            try:
                rows.append(
                    row(
                        "svi",
                        "bayesian-torch (KL per tensor: not the ELBO)",
                        time_it(bayesian_torch_loop(x, y)),
                        "ms/step",
                        threads=t,
                        default=user,
                    )
                )
            except ImportError:
                pass
    return rows


# ---------------------------------------------------------------------- NUTS
NUTS_MODELS = {
    "nuts 1-50-1, N=200": dict(d=1, width=50, depth=1, n=200),
    "nuts 8-50-50-1, N=1000": dict(d=8, width=50, depth=2, n=1000),
}


def nuts_rows(args) -> list[dict]:
    warmup, draws, tree = args.nuts_warmup, args.nuts_draws, args.nuts_depth
    rows, jobs = [], []
    for workload, m in NUTS_MODELS.items():
        x, y = regression(m["n"], m["d"], device=args.device)
        model = bnn(m["d"], m["width"], m["depth"], device=args.device)
        options = dict(method="nuts", max_tree_depth=tree, init="net", seed=0, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", bp.diagnostics.DiagnosticWarning
            )  # costs are measured here, not fit quality
            bp.fit(model, x, y, num_warmup=3, num_samples=3, **options)  # untimed: the process's one-time costs
            start = now(args.device)
            post = bp.fit(model, x, y, num_warmup=warmup, num_samples=draws, **options)
            wall = now(args.device) - start
        linear = sorted({int(k.split(".")[0]) for k in post.samples}, key=int)
        layers = [tuple(post.samples[f"{i}.{p}"].cpu().numpy() for p in ("weight", "bias")) for i in linear]
        flat = np.concatenate([v.reshape(1, draws, -1).cpu().numpy() for v in post.samples.values()], axis=-1)
        steps = float(post.sample_stats["n_steps"].float().mean())
        rows.append(
            _nuts_row(
                workload,
                "bnn_pyro (NUTS fast path)",
                wall,
                steps,
                warmup + draws,
                bulk_ess(flat),
                bulk_ess(forward_draws(layers, probe_points(m["d"]))),
                threads=1,
                default=True,
                role="ours",
            )
        )
        jobs.append(
            dict(m, warmup=warmup, draws=draws, tree_depth=tree, chains=1, chain_method="sequential", workload=workload)
        )
    for threads in ("default",) if args.quick else ("default", "1"):  # quick: XLA's default threads only
        for r in numpyro_peer.run(jobs, threads, args.device) or []:
            label = (
                "NumPyro, compiled (second run, compile excluded)"
                if r["run"] == 2
                else "NumPyro, first run (compilation included)"
            )
            if r["run"] == 1 and threads == "1":
                continue
            wall = r["wall_s"] - (r["compile_s"] if r["run"] == 2 else 0.0)
            rows.append(
                _nuts_row(
                    r["workload"],
                    label,
                    wall,
                    r["mean_steps"],
                    r["warmup"] + r["draws"],
                    r["ess_weights"],
                    r["ess_function"],
                    threads="XLA default" if threads == "default" else 1,
                    default=threads == "default",
                    role="baseline" if r["run"] == 2 else "other",
                    compile_s=round(r["compile_s"], 2),
                    trace_s=round(r["trace_s"], 2),
                    # tracing removed too: a lower bound on NumPyro's cost (JAX's trace events nest)
                    ms_per_leapfrog_traceless=max(wall - r["trace_s"], 0.0)
                    / (r["mean_steps"] * (r["warmup"] + r["draws"]))
                    * 1e3
                    if r["run"] == 2
                    else None,
                )
            )
    return rows


def _nuts_row(workload, label, wall, steps, iterations, ess_w, ess_f, **extra) -> dict:
    return row(
        workload,
        label,
        wall / (steps * iterations) * 1e3,
        "ms/leapfrog",
        wall_s=round(wall, 2),
        ess_weights=round(ess_w, 1),
        ess_w_per_s=ess_w / wall,
        ess_f_per_s=ess_f / wall,
        ess_function=round(ess_f, 1),
        **extra,
    )


# ---------------------------------------------------------------------- prediction
def predict_child(kind: str, draws: int, points: int, device: str) -> dict:
    """In a fresh process: one prediction's wall time and peak memory above the start."""
    dev = torch.device(device)
    post, x, layers = predict_workload(draws, points, dev)
    model, samples = post.model, post.samples

    def run(x):
        if kind.startswith("bnn_pyro"):
            pred = post.predict(x, interval=0.95 if kind == "bnn_pyro_interval" else None)
            if kind == "bnn_pyro_interval":
                _ = pred.lower, pred.upper  # computed when first read
            return pred.mean, pred.std
        if kind == "pyro":
            from pyro.infer import Predictive

            out = Predictive(
                lambda x: model(x, dataset_size=len(x)),
                posterior_samples={n: v[0] for n, v in samples.items()},
                return_sites=["obs"],
            )(x)
            return out["obs"].mean(0), out["obs"].std(0)
        return baselines.predict_loop(layers, x)

    run(x[:10])
    watch = PeakMemory(dev)
    start = now(dev)
    mean, std = run(x)
    wall = now(dev) - start
    return dict(wall_s=wall, peak_mb=watch.stop(), mean0=float(mean[0]), std0=float(std[0]))


class PeakMemory:
    """Peak memory above the current level: CUDA's allocator statistics, or the resident set sampled
    every millisecond by a thread on the CPU (the lifetime peak, ``ru_maxrss``, would include the imports)."""

    def __init__(self, device: torch.device):
        import resource
        import threading

        self.cuda, self.page = device.type == "cuda", resource.getpagesize()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.before, self.device = torch.cuda.memory_allocated(device), device
            return
        self.before = self.peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _watch(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> float:
        if self.cuda:
            return (torch.cuda.max_memory_allocated(self.device) - self.before) / 2**20
        self._done.set()
        self._thread.join()
        return (max(self.peak, self._rss()) - self.before) / 2**20


def predict_rows(args) -> list[dict]:
    draws, points = (100, 2000) if args.quick else (500, 10000)
    labels = {
        "hand-written": "hand-written chunked bmm (baseline)",
        "bnn_pyro": "bnn_pyro Posterior.predict(interval=None)",
        "bnn_pyro_interval": "bnn_pyro Posterior.predict, with 95% intervals",
        "pyro": "Pyro Predictive",
    }
    rows = []
    for t in thread_settings():
        for kind, label in labels.items():
            best = None
            for _ in range(1 if args.quick else args.repeats):
                out = subprocess.run(
                    [sys.executable, __file__, "--predict-child", kind, str(draws), str(points), args.device, str(t)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                best = r if best is None or r["wall_s"] < best["wall_s"] else best
            role = "baseline" if kind == "hand-written" else "ours" if kind == "bnn_pyro" else "other"
            rows.append(
                row(
                    "predict",
                    label,
                    best["wall_s"] * 1e3,
                    "ms",
                    threads=t,
                    default=t == DEFAULT_THREADS,
                    role=role,
                    peak_mb=round(best["peak_mb"], 1),
                )
            )
    return rows


# ---------------------------------------------------------------------- chains
def chain_rows(args) -> list[dict]:
    import chains

    return [
        row(
            "chains",
            r["implementation"],
            r["chain_iterations_per_s"],
            "chains x iterations/s",
            threads=r["threads"],
            default=r.get("default", True),
            chains=r["chains"],
            role=r["role"] if r["role"] in ("ours", "baseline") else "other",
            leapfrog_per_s=r["leapfrog_per_s"],
            wall_s=round(r["wall_s"], 2),
            compile_s=r.get("compile_s"),
        )
        for r in chains.throughput(args)
    ]


# ---------------------------------------------------------------------- tables
def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per workload (and chain count): bnn_pyro's headline row against the baseline, each at its best
    thread setting and at its user default; ratio = bnn_pyro / baseline (time: < 1 is faster)."""
    out = []
    for key, part in table.groupby("group", sort=False):
        ours, base = part[part.role == "ours"], part[part.role == "baseline"]
        if ours.empty or base.empty:
            continue
        r = dict(workload=key, unit=part.unit.iloc[0])
        for side, rows in (("ours", ours), ("baseline", base)):
            best = rows.loc[rows.value.idxmax() if rows.unit.iloc[0].endswith("/s") else rows.value.idxmin()]
            user = rows[rows.user_default.astype(bool)].iloc[0] if rows.user_default.astype(bool).any() else best
            r[f"{side} best (threads)"] = f"{best.value:.4g} ({best.threads})"
            r[f"{side} default (threads)"] = f"{user.value:.4g} ({user.threads})"
            r[f"_{side}_best"], r[f"_{side}_user"] = best.value, user.value
        r["ratio at best"] = round(r.pop("_ours_best") / r.pop("_baseline_best"), 3)
        r["ratio at defaults"] = round(r.pop("_ours_user") / r.pop("_baseline_user"), 3)
        out.append(r)
    return pd.DataFrame(out)


def main(args) -> pd.DataFrame:
    started = time.perf_counter()
    rows = []
    for name, fn in (("svi", svi_rows), ("nuts", nuts_rows), ("predict", predict_rows), ("chains", chain_rows)):
        if name in args.only:
            print(f"running {name} ...", flush=True)
            rows += fn(args)
    table = pd.DataFrame(rows)
    chains = table["chains"] if "chains" in table else pd.Series(float("nan"), index=table.index)
    table.insert(0, "group", [w if pd.isna(c) else f"{w} x{int(c)}" for w, c in zip(table.workload, chains)])
    base = table[table.role == "baseline"].groupby("group").value
    best = base.max().where(table.groupby("group").unit.first().str.endswith("/s"), base.min())
    table["ratio"] = table.value / table.group.map(best)
    order = {g: i for i, g in enumerate(dict.fromkeys(table.group))}  # sections in the order they ran
    table = (
        table.assign(_o=table.group.map(order), _t=table.threads.astype(str))
        .sort_values(["_o", "_t"], kind="stable")
        .drop(columns=["_o", "_t", "workload"])
        .round(4)
    )
    out = results_dir("performance", args.out)
    name = args.name
    table.to_csv(out / f"{name}.csv", index=False)
    header = (
        f"torch {torch.__version__}, device {args.device}, {platform.processor() or platform.machine()}, {thread_note()}; "
        f"{'quick' if args.quick else 'full'} settings; whole run {time.perf_counter() - started:.0f} s. "
        "ratio = value / the workload's baseline at its best thread setting.\n\n"
        + (f"{args.note}\n\n" if args.note else "")
    )
    write_result(
        out / f"{name}.md",
        header
        + "## Summary: bnn_pyro / baseline\n\n"
        + markdown(summary(table))
        + "\n## All rows\n\n"
        + markdown(table.astype(object).fillna("")),
    )
    print(summary(table).to_string(index=False))
    print(f"whole run: {time.perf_counter() - started:.0f} s")
    return table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run: all sections in < 2 min idle)")
    p.add_argument("--device", default="cpu", help="torch device of every torch workload, e.g. cuda (default cpu)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repetitions per row (default 3; with --quick 2, predict 1)"
    )
    p.add_argument("--nuts-warmup", type=int, default=None, help="default 300 (20 with --quick)")
    p.add_argument("--nuts-draws", type=int, default=None, help="default 300 (20 with --quick)")
    p.add_argument("--nuts-depth", type=int, default=None, help="max tree depth; default 6 (4 with --quick)")
    p.add_argument(
        "--chains", type=int, nargs="+", default=None, help="chain counts; default 1 2 4 8 (1 2 with --quick)"
    )
    p.add_argument("--only", nargs="+", default=["svi", "nuts", "predict", "chains"])
    p.add_argument("--out", default=None, help="the folder written (default benchmarks/results/performance/)")
    p.add_argument("--name", default="results", help="the result files' name, NAME.md and NAME.csv (default results)")
    p.add_argument("--note", default="", help="a line written under the header (e.g. the machine's load)")
    return p


def resolve(args) -> argparse.Namespace:
    """Fill the settings left unset from --quick; check --device."""
    quick = args.quick
    for name, full, small in (
        ("repeats", 3, 2),
        ("nuts_warmup", 300, 20),
        ("nuts_draws", 300, 20),
        ("nuts_depth", 6, 4),
        ("chains", [1, 2, 4, 8], [1, 2]),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.device = check_device(args.device)
    return args


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--predict-child":
        torch.set_num_threads(int(sys.argv[6]))
        print(json.dumps(predict_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
        sys.exit(0)
    main(resolve(parser().parse_args()))
