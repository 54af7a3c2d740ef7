"""Same seed, same draws across a refactor: fits the engines rebuilt on the engine contract
(bnn_pyro/infer/contract.py) in a spread of settings, saves every posterior's samples, history,
sample statistics and point values, and compares two such files for bit-identity.

Run it once on a checkout of the old code and once on the new one, then compare::

    PYTHONPATH=/path/to/old/checkout python benchmarks/contract_parity.py save old.pt
    python benchmarks/contract_parity.py save new.pt
    python benchmarks/contract_parity.py compare old.pt new.pt

``save FILE sgld mc_dropout`` saves only the cases whose names start with those words.

Small models and short runs: it checks equality, not quality (a few seconds per case).
"""

from __future__ import annotations

import sys

import pyro
import pyro.distributions as dist
import torch

import bnn_pyro as bp


def _toy(n=120, classes=False):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    if classes:
        return x, (x[:, 0] * x[:, 1] > 0).long()
    return x, torch.sin(x[:, 0]) + 0.3 * x[:, 1] + 0.1 * torch.randn(n, generator=g)


def _bnn(noise=0.2, classes=False):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2 if classes else 1))
    lik = bp.likelihoods.Categorical() if classes else bp.likelihoods.Gaussian(scale=noise)
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=lik)


def _pyro_fn(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(x @ w, s), obs=y)


def _stream(x, y, batch=40):
    for _ in range(1000):
        for i in range(0, x.shape[0], batch):
            yield x[i : i + batch], y[i : i + batch]


CASES = {
    "svi_mean_field_fast": lambda: ("svi", dict(num_steps=30, num_samples=5, num_chains=2)),
    "svi_mean_field_pyro": lambda: ("svi", dict(num_steps=30, num_samples=5, fast_path=False)),
    "svi_full_rank_minibatch": lambda: ("svi", dict(guide="full_rank", num_steps=30, num_samples=5, batch_size=32)),
    "svi_low_rank_particles": lambda: ("svi", dict(guide="low_rank", num_steps=20, num_samples=5, num_particles=3)),
    "svi_map": lambda: ("svi", dict(guide="map", num_steps=30)),
    "svi_reinforce": lambda: ("svi", dict(elbo="reinforce", num_steps=10, num_samples=5)),
    "svi_local_reparam": lambda: ("svi", dict(estimator="local_reparam", num_steps=20, num_samples=5)),
    "svi_empirical_bayes": lambda: ("svi", dict(empirical_bayes=True, num_steps=20, num_samples=5)),
    "svi_learned_noise": lambda: ("svi", dict(num_steps=20, num_samples=5, _noise=True)),
    "svi_pyro_function": lambda: ("svi", dict(num_steps=20, num_samples=5, _fn=True)),
    "svi_stream": lambda: ("svi", dict(num_steps=20, num_samples=5, _stream=True)),
    "svi_epochs": lambda: ("svi", dict(epochs=2, batch_size=50, num_samples=5)),
    "ensemble_default": lambda: ("ensemble", dict(num_chains=2, num_steps=30)),
    "ensemble_no_validation_minibatch": lambda: (
        "ensemble",
        dict(num_chains=2, num_steps=20, validation=None, batch_size=32),
    ),
    "ensemble_adversarial_noise": lambda: (
        "ensemble",
        dict(num_chains=2, num_steps=20, adversarial_eps=0.05, _noise=True),
    ),
    "ensemble_classes": lambda: ("ensemble", dict(num_chains=2, num_steps=20, _classes=True)),
    "ensemble_stream": lambda: ("ensemble", dict(num_chains=2, num_steps=20, _stream=True)),
    "variational_dropout": lambda: ("variational_dropout", dict(num_steps=30, num_samples=5, num_chains=2)),
    "variational_dropout_warmup": lambda: (
        "variational_dropout",
        dict(num_steps=20, num_samples=5, kl_warmup=0.5, batch_size=32),
    ),
    "sparse_vd": lambda: ("sparse_vd", dict(num_steps=30, num_samples=5)),
    "sparse_vd_classes_epochs": lambda: ("sparse_vd", dict(epochs=3, batch_size=40, num_samples=5, _classes=True)),
    "sparse_vd_stream": lambda: ("sparse_vd", dict(num_steps=20, num_samples=5, _stream=True)),
    "laplace": lambda: ("laplace", dict(_small=True)),
    "laplace_learned_noise": lambda: ("laplace", dict(num_steps=30, num_samples=5, _noise=True, _rows=240)),
    "laplace_marglik": lambda: (
        "laplace",
        dict(num_steps=30, num_samples=5, prior_precision="marglik", validation=None, num_chains=2),
    ),
    "mc_dropout": lambda: ("mc_dropout", dict(num_steps=30, num_samples=5, num_chains=2)),
    "mc_dropout_learned_noise": lambda: ("mc_dropout", dict(num_steps=30, num_samples=5, _noise=True, _rows=240)),
    "mc_dropout_reinforce": lambda: ("mc_dropout", dict(rate="reinforce", num_steps=20, num_samples=5)),
    "mc_dropout_reinforce_baseline": lambda: (
        "mc_dropout",
        dict(rate="reinforce", num_particles=1, baseline_beta=0.5, num_steps=20, num_samples=5, batch_size=32),
    ),
    "mc_dropout_concrete_inputs": lambda: (
        "mc_dropout",
        dict(rate="concrete", temperature=0.2, dropout_inputs=True, num_steps=20, num_samples=5, num_particles=2),
    ),
    "mc_dropout_classes_epochs": lambda: (
        "mc_dropout",
        dict(epochs=3, batch_size=40, num_samples=5, validation=0.2, _classes=True),
    ),
    "mc_dropout_sgd_cosine_net": lambda: (
        "mc_dropout",
        dict(optimizer="sgd", lr_schedule="cosine", lr=0.002, init="net", p=0.3, num_steps=20, num_samples=5),
    ),
    "mc_dropout_stream": lambda: ("mc_dropout", dict(num_steps=20, num_samples=5, _stream=True)),
    "sgld_default_auto": lambda: ("sgld", dict(num_samples=10, thin=3, num_chains=2)),
    "sgld_init_net": lambda: ("sgld", dict(num_samples=5, thin=2, num_chains=2, init="net")),
    "sgld_lr_polynomial_minibatch": lambda: (
        "sgld",
        dict(lr=1e-2, lr_schedule="polynomial", num_samples=10, num_warmup=15, batch_size=32),
    ),
    "sgld_stream": lambda: ("sgld", dict(num_samples=10, thin=2, num_warmup=10, _stream=True)),
    "sgld_pyro_function_prior_init": lambda: ("sgld", dict(num_samples=10, thin=2, _fn=True)),
    "sghmc_default_noise": lambda: ("sghmc", dict(num_samples=10, thin=3, _noise=True)),
    "sghmc_friction_lr": lambda: ("sghmc", dict(lr=5e-3, friction=0.3, num_samples=8, thin=2, batch_size=40)),
    "csgmcmc_default": lambda: ("csgmcmc", dict(num_cycles=2, num_samples=10, thin=2, num_chains=2)),
    "csgmcmc_holdout_noise": lambda: ("csgmcmc", dict(num_cycles=2, num_samples=10, thin=10, _noise=True, _n=400)),
    "csgmcmc_no_validation_cslgd": lambda: (
        "csgmcmc",
        dict(num_cycles=2, num_samples=6, thin=2, friction=1.0, validation=None, _noise=True, exploration=0.5),
    ),
    "csgmcmc_classes_lr": lambda: (
        "csgmcmc",
        dict(lr=0.05, num_cycles=2, num_samples=4, thin=3, _classes=True, batch_size=30),
    ),
    "snapshot_small": lambda: ("snapshot", dict(num_cycles=3, cycle_length=20, num_chains=2)),
    "snapshot_holdout_noise": lambda: ("snapshot", dict(num_cycles=3, cycle_length=120, _noise=True, _n=400)),
    "snapshot_lr_minibatch": lambda: (
        "snapshot",
        dict(lr=0.05, num_cycles=2, cycle_length=15, batch_size=32, validation=None),
    ),
    "snapshot_stream": lambda: ("snapshot", dict(num_cycles=2, cycle_length=10, _stream=True)),
}


def _fit(case: str):
    method, config = CASES[case]()
    classes, noise, fn, stream = (config.pop(k, False) for k in ("_classes", "_noise", "_fn", "_stream"))
    if config.pop("_small", False):
        config.update(num_steps=30, num_samples=5)
    n = config.pop("_n", config.pop("_rows", 120))  # 240 rows: the default held-out split applies
    x, y = _toy(n=n, classes=classes)
    model = _pyro_fn if fn else _bnn(noise=dist.HalfNormal(1.0) if noise else 0.2, classes=classes)
    if stream:
        return bp.fit(model, _stream(x, y), method=method, dataset_size=x.shape[0], seed=3, progress=False, **config)
    return bp.fit(model, x, y, method=method, seed=3, progress=False, **config)


def save(path: str, prefixes: list[str]) -> None:
    """Save the cases whose names start with one of ``prefixes`` (all cases without any)."""
    print("bnn_pyro from", bp.__file__)
    out = {}
    for case in (c for c in CASES if not prefixes or c.startswith(tuple(prefixes))):
        post = _fit(case)
        out[case] = {
            part: {k: v for k, v in getattr(post, part).items() if torch.is_tensor(v)}
            for part in ("samples", "history", "sample_stats", "point")
        }
        out[case]["config"] = {k: repr(v) for k, v in post.config.items()}
        print(case, "done")
    torch.save(out, path)


def compare(old_path: str, new_path: str) -> int:
    old, new = torch.load(old_path), torch.load(new_path)
    bad, differing = 0, set()
    for case in old:
        for part, tensors in old[case].items():
            other = new[case][part]
            for name, value in tensors.items():
                same = name in other and (
                    value == other[name]
                    if isinstance(value, str)
                    else value.dtype == other[name].dtype and torch.equal(value, other[name])
                )
                if not same:
                    bad += 1
                    differing.add(case)
                    print(
                        f"DIFFERENT {case} {part}[{name!r}]: {value if isinstance(value, str) else ''} vs "
                        f"{other.get(name, 'missing') if isinstance(value, str) else ''}"
                    )
            for name in set(other) - set(tensors):
                bad += 1
                differing.add(case)
                print(f"NEW {case} {part}[{name!r}]")
    print(f"{len(old) - len(differing)}/{len(old)} cases bit-identical" + (f" ({bad} differences)" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
