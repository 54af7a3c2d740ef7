"""Speed side by side: bnn_pyro's engines against stock Pyro, hand-written torch and the peers.

Every workload and its baseline run in this one invocation, on a one-hidden-layer tanh MLP with a
Normal(0, 1) prior on every weight and a Gaussian likelihood (sigma 0.1); ratios are to the
baseline measured here, so they hold on any machine even where the absolute figures do not.

- ``svi``: one optimizer step (Adam, mean-field Gaussian, one particle), 8-50-1, N = 1,000 full
  batch. bnn_pyro (fast path, and with ``fast_path=False``: Pyro's ``Trace_ELBO``), stock Pyro as a
  user writes it (``PyroModule`` + ``AutoNormal`` + ``Trace_ELBO`` / ``JitTrace_ELBO``),
  bayesian-torch if installed; baseline: a hand-written torch Bayes-by-Backprop loop.
  ms per step = (time of 550 steps - time of 50) / 500, so set-up costs drop out.
- ``particles``: the same step with 8 particles; baseline: one bnn_pyro particle (and a
  hand-written batched ``bmm`` loop beside it).
- ``nuts``: 1-50-1, N = 200, ``--nuts-warmup`` + ``--nuts-draws`` NUTS iterations, tree depth
  <= ``--nuts-depth``, one chain, one thread; bnn_pyro (fast path, jit) and with Pyro's potential;
  baseline: NumPyro on the identical model, data, start and settings, if installed: its second run
  of the same MCMC object, compiled (its first run, compilation included, beside it). ESS is ArviZ's
  bulk ESS of each weight (median over weights) per second of wall time (warm-up and compile
  included); ms per leapfrog = wall / (mean leapfrog steps per kept draw x all iterations).
- ``predict``: predictive mean and std at 10,000 points from 500 draws, each implementation in a
  fresh process (peak RSS above the process's RSS before the call; an untimed call on 10 points
  first); bnn_pyro's ``Posterior.predict(interval=None)`` (mean and std) and with 95% intervals,
  Pyro's ``Predictive``; baseline: a hand-written loop over chunks of 50 draws with ``bmm``.
- ``chains``: two NUTS chains in parallel against one (``benchmarks/chains.py``'s workload).

Usage: ``python benchmarks/performance.py [--quick] [--out benchmarks/results]`` writes
``performance.md`` and ``performance.csv``. NumPyro, JAX and bayesian-torch are optional (the
``bench`` extra, and ``pip install --no-deps bayesian-torch``); rows for a missing one are skipped.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import torch

import bnn_pyro as bp

sys.path.insert(0, str(Path(__file__).parent))
from chains import markdown  # noqa: E402  (the shared Markdown writer)

SIGMA = 0.1


# ---------------------------------------------------------------------- data and models
def regression(n: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g) * 4 - 2
    y = torch.sin(2 * x.mean(1)) + SIGMA * torch.randn(n, generator=g)
    return x, y


def mlp(d: int, width: int = 50, seed: int = 0, depth: int = 1) -> torch.nn.Sequential:
    """A tanh MLP with ``depth`` hidden layers of ``width`` units."""
    torch.manual_seed(seed)
    layers, size = [], d
    for _ in range(depth):
        layers += [torch.nn.Linear(size, width), torch.nn.Tanh()]
        size = width
    return torch.nn.Sequential(*layers, torch.nn.Linear(size, 1))


def bnn(d: int, width: int = 50, depth: int = 1) -> bp.BNN:
    return bp.BNN(mlp(d, width, depth=depth), prior=bp.priors.Normal(0.0, 1.0),
                  likelihood=bp.likelihoods.Gaussian(scale=SIGMA))


def per_step(run, short: int, long: int, repeats: int) -> float:
    """Median over ``repeats`` of (time of ``long`` steps - time of ``short``) / (long - short), in ms."""
    figures = []
    run(2)  # untimed: compilation (JitTrace_ELBO) and first-call costs
    for _ in range(repeats):
        start = time.perf_counter()
        run(short)
        middle = time.perf_counter()
        run(long)
        end = time.perf_counter()
        figures.append(((end - middle) - (middle - start)) / (long - short) * 1e3)
    return statistics.median(figures)


# ---------------------------------------------------------------------- SVI
def bbb_loop(x, y, particles: int = 1):
    """Hand-written mean-field Bayes-by-Backprop: softplus scales, the Monte Carlo ELBO, Adam."""
    d = x.shape[1]
    shapes = [(50, d), (50,), (1, 50), (1,)]
    net = mlp(d)
    mu = [p.detach().clone().requires_grad_() for p in net.parameters()]
    rho = [torch.full(s, -4.6, requires_grad=True) for s in shapes]  # softplus(-4.6) ~ 0.01
    opt = torch.optim.Adam(mu + rho, lr=1e-2)
    n = x.shape[0]

    def run(steps):
        for _ in range(steps):
            opt.zero_grad()
            scale = [torch.nn.functional.softplus(r) for r in rho]
            eps = [torch.randn((particles,) + s) for s in shapes]
            w = [m + s * e for m, s, e in zip(mu, scale, eps)]
            h = torch.tanh(torch.baddbmm(w[1][:, None, :], x.expand(particles, n, d), w[0].transpose(1, 2)))
            f = torch.baddbmm(w[3][:, None, :], h, w[2].transpose(1, 2))[..., 0]
            log_lik = torch.distributions.Normal(f, SIGMA).log_prob(y).sum(-1)
            log_prior = sum(torch.distributions.Normal(0.0, 1.0).log_prob(v).flatten(1).sum(-1) for v in w)
            log_q = sum(torch.distributions.Normal(m, s).log_prob(v).flatten(1).sum(-1) for m, s, v in zip(mu, scale, w))
            loss = -(log_lik + log_prior - log_q).mean()
            loss.backward()
            opt.step()

    return run


def bp_loop(x, y, particles: int = 1, fast_path: bool = True):
    model = bnn(x.shape[1])
    return lambda steps: bp.fit(model, x, y, method="svi", num_steps=steps, num_particles=particles, num_samples=1,
                                progress=False, fast_path=fast_path)


def pyro_loop(x, y, jit: bool):
    """Stock Pyro as a user writes it: a PyroModule net, AutoNormal, (Jit)Trace_ELBO, pyro.optim.Adam."""
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.nn import PyroModule, PyroSample

    net = PyroModule[torch.nn.Sequential](PyroModule[torch.nn.Linear](x.shape[1], 50), torch.nn.Tanh(),
                                          PyroModule[torch.nn.Linear](50, 1))
    for layer in (net[0], net[2]):
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))

    def model(x, y=None):
        f = net(x)[..., 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(f, SIGMA), obs=y)

    pyro.clear_param_store()
    guide = AutoNormal(model, init_scale=0.01)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), (JitTrace_ELBO if jit else Trace_ELBO)(ignore_jit_warnings=True))

    def run(steps):
        for _ in range(steps):
            svi.step(x, y)

    return run


def bayesian_torch_loop(x, y):
    from bayesian_torch.layers import LinearReparameterization

    layers = torch.nn.ModuleList([LinearReparameterization(x.shape[1], 50), LinearReparameterization(50, 1)])
    opt = torch.optim.Adam(layers.parameters(), lr=1e-2)

    def run(steps):
        for _ in range(steps):
            opt.zero_grad()
            h, kl1 = layers[0](x)
            f, kl2 = layers[1](torch.tanh(h))
            loss = -torch.distributions.Normal(f[:, 0], SIGMA).log_prob(y).sum() + kl1 + kl2
            loss.backward()
            opt.step()

    return run


def svi_rows(args) -> list[dict]:
    x, y = regression(1000, 8)
    short, long = (10, 60) if args.quick else (50, 550)
    rows, reps = [], args.repeats
    base = per_step(bbb_loop(x, y), short, long, reps)
    rows.append(dict(workload="svi", implementation="hand-written torch BBB (baseline)", value=base))
    rows.append(dict(workload="svi", implementation="bnn_pyro (fast path)", value=per_step(bp_loop(x, y), short, long, reps)))
    rows.append(dict(workload="svi", implementation="bnn_pyro, fast_path=False",
                     value=per_step(bp_loop(x, y, fast_path=False), short, long, reps)))
    rows.append(dict(workload="svi", implementation="stock Pyro, Trace_ELBO", value=per_step(pyro_loop(x, y, False), short, long, reps)))
    rows.append(dict(workload="svi", implementation="stock Pyro, JitTrace_ELBO", value=per_step(pyro_loop(x, y, True), short, long, reps)))
    try:
        rows.append(dict(workload="svi", implementation="bayesian-torch (KL per tensor)",
                         value=per_step(bayesian_torch_loop(x, y), short, long, reps)))
    except ImportError:
        print("bayesian-torch is not installed: its row is skipped")
    for r in rows:
        r.update(unit="ms/step", baseline=base)
    one = per_step(bp_loop(x, y, 1), short, long, reps)
    part = [dict(workload="particles", implementation="bnn_pyro, 1 particle (baseline)", value=one)]
    part.append(dict(workload="particles", implementation="bnn_pyro, 8 particles", value=per_step(bp_loop(x, y, 8), short, long, reps)))
    part.append(dict(workload="particles", implementation="bnn_pyro, 8 particles, fast_path=False",
                     value=per_step(bp_loop(x, y, 8, fast_path=False), short, long, reps)))
    part.append(dict(workload="particles", implementation="hand-written bmm, 8 particles",
                     value=per_step(bbb_loop(x, y, 8), short, long, reps)))
    for r in part:
        r.update(unit="ms/step", baseline=one)
    return rows + part


# ---------------------------------------------------------------------- NUTS
def nuts_rows(args) -> list[dict]:
    import arviz as az
    import numpy as np

    x, y = regression(200, 1)
    warmup, draws, depth = args.nuts_warmup, args.nuts_draws, args.nuts_depth
    found = {}
    for label, fast in (("bnn_pyro (fast path, jit)", True), ("bnn_pyro, fast_path=False (Pyro's jit potential)", False)):
        model = bnn(1)
        # untimed: the process's one-time costs (lazy imports, TorchScript's first runs); NumPyro's are
        # outside its timing too (imports, and its compiled second run is the baseline)
        bp.fit(model, x, y, method="nuts", num_warmup=3, num_samples=3, seed=0, progress=False, fast_path=fast)
        start = time.perf_counter()
        post = bp.fit(model, x, y, method="nuts", num_warmup=warmup, num_samples=draws, max_tree_depth=depth,
                      seed=0, progress=False, fast_path=fast)
        wall = time.perf_counter() - start
        w = np.concatenate([v.reshape(1, draws, -1).numpy() for v in post.samples.values()], axis=-1)
        found[label] = (wall, float(post.sample_stats["n_steps"].float().mean()), w)
    try:
        found["NumPyro, first run (compilation included)"], found["NumPyro"] = numpyro_nuts(x, y, warmup, draws, depth)
    except ImportError:
        print("numpyro is not installed: its row is skipped")
    rows = []
    for label, (wall, steps, w) in found.items():
        ess = float(np.median(az.ess(az.convert_to_dataset(w), method="bulk")["x"].values))
        rows.append(dict(workload="nuts", implementation=label, value=ess / wall, unit="ESS/s (median weight)",
                         ms_per_leapfrog=wall / (steps * (warmup + draws)) * 1e3, wall_s=wall, ess=ess))
    base = rows[-1]["value"] if "NumPyro" in found else rows[0]["value"]
    for r in rows:
        r["baseline"] = base
    if "NumPyro" in found:
        rows[-1]["implementation"] = "NumPyro, compiled: second run of the same MCMC (baseline)"
    return rows


def numpyro_nuts(x, y, warmup, draws, depth):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as nd
    from numpyro.infer import MCMC, NUTS, init_to_value

    jax.config.update("jax_platform_name", "cpu")
    net = mlp(1)
    start = {"w1": net[0].weight, "b1": net[0].bias, "w2": net[2].weight, "b2": net[2].bias}
    start = {k: jnp.asarray(v.detach().numpy()) for k, v in start.items()}

    def model(x, y):
        w = {k: numpyro.sample(k, nd.Normal(0.0, 1.0).expand(v.shape).to_event(v.ndim)) for k, v in start.items()}
        f = jnp.tanh(x @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("obs", nd.Normal(f[:, 0], SIGMA), obs=y)

    kernel = NUTS(model, max_tree_depth=depth, target_accept_prob=0.8, init_strategy=init_to_value(values=start))
    mcmc = MCMC(kernel, num_warmup=warmup, num_samples=draws, progress_bar=False)
    runs = []
    for seed in (0, 1):  # the first run compiles; the second reuses the compiled sampler
        begin = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(x.numpy()), jnp.asarray(y.numpy()), extra_fields=("num_steps",))
        wall = time.perf_counter() - begin
        samples = mcmc.get_samples()
        w = np.concatenate([np.asarray(samples[k]).reshape(1, draws, -1) for k in start], axis=-1)
        runs.append((wall, float(np.asarray(mcmc.get_extra_fields()["num_steps"]).mean()), w))
    return runs[0], runs[1]


# ---------------------------------------------------------------------- prediction
def predict_child(kind: str, draws: int, points: int) -> dict:
    """Run in a fresh process: one prediction, its wall time and peak RSS above the start. Each
    implementation first runs once, untimed, on 10 points: lazy imports and first-call costs are
    the process's, not the workload's."""
    model = bnn(1)
    g = torch.Generator().manual_seed(1)
    samples = {n: 0.5 * torch.randn((1, draws) + s, generator=g) for n, s in model.param_shapes.items()}
    x_train, y_train = regression(50, 1)
    post = bp.Posterior(samples=samples, model=model, method="svi", x=x_train, y=y_train)
    x = regression(points, 1, seed=2)[0]

    def run(x):
        if kind.startswith("bnn_pyro"):  # mean and std only, or with 95% intervals (quantiles of predictive draws)
            pred = post.predict(x, interval=0.95 if kind == "bnn_pyro_interval" else None)
            return pred.mean, pred.std
        if kind == "pyro":
            from pyro.infer import Predictive

            flat = {n: v[0] for n, v in samples.items()}
            out = Predictive(lambda x: model(x, dataset_size=len(x)), posterior_samples=flat,
                             return_sites=["f", "obs"])(x)
            return out["obs"].mean(0), out["obs"].std(0)
        total, total_sq = torch.zeros(len(x)), torch.zeros(len(x))
        w = {n: v[0] for n, v in samples.items()}
        for i in range(0, draws, 50):
            c = slice(i, i + 50)
            h = torch.tanh(torch.baddbmm(w["0.bias"][c, None], x.expand(w["0.weight"][c].shape[0], -1, -1),
                                         w["0.weight"][c].transpose(1, 2)))
            f = torch.baddbmm(w["2.bias"][c, None], h, w["2.weight"][c].transpose(1, 2))[..., 0]
            total += f.sum(0)
            total_sq += f.pow(2).sum(0)
        mean = total / draws
        return mean, (total_sq / draws - mean**2 + SIGMA**2).clamp_min(0).sqrt()

    run(x[:10])
    watch = RssWatch()
    start = time.perf_counter()
    mean, std = run(x)
    wall = time.perf_counter() - start
    return dict(wall_s=wall, peak_mb=watch.stop(), mean0=float(mean[0]), std0=float(std[0]))


class RssWatch:
    """Peak resident memory above the current level, sampled every millisecond by a thread (the
    process's lifetime peak, ``ru_maxrss``, would include the imports)."""

    def __init__(self):
        self.before = self.peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def _watch(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return (max(self.peak, self._rss()) - self.before) / 2**20


def predict_rows(args) -> list[dict]:
    draws, points = (100, 2000) if args.quick else (500, 10000)
    found = {}
    for kind in ("hand-written chunked", "bnn_pyro", "bnn_pyro_interval", "pyro"):
        best = None
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--predict-child", kind, str(draws), str(points)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            best = r if best is None or r["wall_s"] < best["wall_s"] else best
        found[kind] = best
    base = found["hand-written chunked"]
    labels = {"hand-written chunked": "hand-written chunked bmm (baseline)",
              "bnn_pyro": "bnn_pyro Posterior.predict(interval=None)",
              "bnn_pyro_interval": "bnn_pyro Posterior.predict, with 95% intervals", "pyro": "Pyro Predictive"}
    return [dict(workload="predict", implementation=labels[k], value=r["wall_s"] * 1e3, unit="ms", baseline=base["wall_s"] * 1e3,
                 peak_mb=r["peak_mb"], memory_ratio=r["peak_mb"] / max(base["peak_mb"], 1.0)) for k, r in found.items()]


# ---------------------------------------------------------------------- chains
def chain_rows(args) -> list[dict]:
    import chains

    draws = 20 if args.quick else 100
    one = chains.run(1, "sequential", draws)["leapfrog_per_s"]
    two = chains.run(2, "parallel", draws)["leapfrog_per_s"]
    return [dict(workload="chains", implementation="1 chain (baseline)", value=one, unit="leapfrog/s", baseline=one),
            dict(workload="chains", implementation="2 chains, parallel", value=two, unit="leapfrog/s", baseline=one)]


TARGETS = {"svi": "<= 1.0x hand-written", "particles": "<= 2x one particle", "nuts": "within 3x of NumPyro ESS/s",
           "predict": "<= 1.0x time, <= 1.5x memory", "chains": ">= 1.7x one chain"}


def main(args) -> pd.DataFrame:
    torch.set_num_threads(1)  # as bp.fit does by default: every implementation on one thread
    rows = []
    for name, fn in (("svi", svi_rows), ("nuts", nuts_rows), ("predict", predict_rows), ("chains", chain_rows)):
        if name in args.only:
            print(f"running {name} ...", flush=True)
            rows += fn(args)
    table = pd.DataFrame(rows)
    table["ratio"] = table["value"] / table["baseline"]
    table["target"] = table["workload"].map(TARGETS)
    columns = [c for c in ("workload", "implementation", "value", "unit", "ratio", "ms_per_leapfrog", "wall_s", "ess",
                           "peak_mb", "memory_ratio", "target") if c in table]
    table = table[columns].round(3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "performance.csv", index=False)
    header = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{'quick settings' if args.quick else 'full settings'}; ratio = value / the workload's baseline\n\n")
    (out / "performance.md").write_text(header + markdown(table.fillna("")))
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--predict-child":
        torch.set_num_threads(1)
        print(json.dumps(predict_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nuts-warmup", type=int, default=300)
    parser.add_argument("--nuts-draws", type=int, default=300)
    parser.add_argument("--nuts-depth", type=int, default=6)
    parser.add_argument("--only", nargs="+", default=["svi", "nuts", "predict", "chains"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    main(parser.parse_args())
