"""The NumPyro peer of the NUTS benchmarks, run in a child process of its own.

XLA reads its thread and host-device settings once, when JAX starts, so each setting needs a fresh
process: :func:`run` starts ``python numpyro_peer.py SPEC`` with the environment for ``threads``
(``"default"``: XLA's own thread pool, what a user gets; ``"1"``: ``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``) and 8 host devices (``chain_method="parallel"`` needs one per chain).

Each job is NUTS on the identical model (the tanh MLP of ``_common``, Normal(0, 1) priors, Gaussian
noise 0.1), data, starting weights (``init_to_value``: the torch net's initial weights, as bnn_pyro's
``init="net"``) and settings (warm-up, draws, ``max_tree_depth``, target acceptance 0.8, diagonal
mass). The same ``MCMC`` object runs twice (seeds 0 and 1): the second run is the compiled sampler.
NumPyro recompiles its sampling loop at every ``run`` (measured: ``jit(_fori_collect_loop)`` again in
the second run), so the seconds XLA reports compiling (``jax.monitoring``'s backend-compile events,
which do not nest) are subtracted from that run's wall time; ``compile_s`` reports them. Tracing and
lowering (``trace_s``: the sum of JAX's trace/lowering events, which nest, so an upper bound) stay in
the wall time: a few tenths of a second that an expert's compiled sampler would not pay again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def run(jobs: list[dict], threads: str = "default", device: str = "cpu", host_devices: int = 8) -> list[dict] | None:
    """Run ``jobs`` (dicts: d, width, depth, n, warmup, draws, tree_depth, chains, chain_method) in a
    child process; ``None`` (and a message) when NumPyro or JAX is not installed or JAX fails to start."""
    env = dict(os.environ)
    flags = [f"--xla_force_host_platform_device_count={host_devices}"] + ([ONE_THREAD] if threads == "1" else [])
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + flags).strip()
    env["JAX_PLATFORMS"] = "cuda" if str(device).startswith("cuda") else "cpu"
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(jobs)],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        print(f"NumPyro rows skipped: the NumPyro process failed ({tail[0]})")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(jobs: list[dict]) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as nd
    from _common import bulk_ess, forward_draws, mlp, probe_points, regression
    from numpyro.infer import MCMC, NUTS, init_to_value

    spent = {"compile": 0.0, "trace": 0.0}

    def listen(event: str, seconds: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            spent["compile"] += seconds
        elif event.startswith("/jax/core/compile/"):
            spent["trace"] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    results = []
    for job in jobs:
        x, y = regression(job["n"], job["d"])
        net = [m for m in mlp(job["d"], job["width"], depth=job["depth"]) if hasattr(m, "weight")]
        start = {}
        for i, layer in enumerate(net):
            start[f"w{i}"] = jnp.asarray(layer.weight.detach().numpy())
            start[f"b{i}"] = jnp.asarray(layer.bias.detach().numpy())

        def model(x, y, net=net, start=start):
            h = x
            for i in range(len(net)):
                w = numpyro.sample(f"w{i}", nd.Normal(0.0, 1.0).expand(start[f"w{i}"].shape).to_event(2))
                b = numpyro.sample(f"b{i}", nd.Normal(0.0, 1.0).expand(start[f"b{i}"].shape).to_event(1))
                h = h @ w.T + b
                h = jnp.tanh(h) if i < len(net) - 1 else h
            with numpyro.plate("data", x.shape[0]):
                numpyro.sample("obs", nd.Normal(h[:, 0], 0.1), obs=y)

        kernel = NUTS(
            model, max_tree_depth=job["tree_depth"], target_accept_prob=0.8, init_strategy=init_to_value(values=start)
        )
        mcmc = MCMC(
            kernel,
            num_warmup=job["warmup"],
            num_samples=job["draws"],
            num_chains=job["chains"],
            chain_method=job["chain_method"],
            progress_bar=False,
        )
        xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
        for seed in (0, 1):
            spent.update(compile=0.0, trace=0.0)
            begin = time.perf_counter()
            mcmc.run(jax.random.PRNGKey(seed), xj, yj, extra_fields=("num_steps",))
            jax.block_until_ready(mcmc.get_samples())
            wall = time.perf_counter() - begin
            samples = mcmc.get_samples(group_by_chain=True)
            steps = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["num_steps"])
            layers = [(np.asarray(samples[f"w{i}"]), np.asarray(samples[f"b{i}"])) for i in range(len(net))]
            flat = np.concatenate([np.asarray(samples[k]).reshape(job["chains"], job["draws"], -1) for k in start], -1)
            results.append(
                dict(
                    job,
                    run=seed + 1,
                    wall_s=wall,
                    compile_s=spent["compile"],
                    trace_s=spent["trace"],
                    mean_steps=float(steps.mean()),
                    devices=len(jax.devices()),
                    platform=jax.devices()[0].platform,
                    ess_weights=bulk_ess(flat),
                    ess_function=bulk_ess(forward_draws(layers, probe_points(job["d"]))),
                )
            )
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    print(json.dumps(_child(json.loads(sys.argv[1]))))
