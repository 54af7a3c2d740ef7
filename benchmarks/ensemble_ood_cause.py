"""Why the anchored ensemble at its defaults misses the noise-AUROC target on a split (issue 26; ``docs/ood.md``).

``benchmarks/classification.py``'s protocol (its split, standardization, ``Linear(D, 50) - ReLU - Linear(50, K)`` net
with a ``Normal(0, 1)`` prior, ``seed=split``, noise inputs of sd 3): one ensemble of ``--members`` anchored members
at the engine's defaults (member ``k`` uses seed ``split + k`` for its start and anchor, so its first 5 members are
the default 5-member fit: checked against a separate 5-member fit, ``engine_5``) and NUTS at its defaults on the same
split. Each draw's logits are computed in float64 from its weights (``svi_ood_cause._logits``), so the mutual
information (MI) is free of float32 saturation. Rows (``predictor``):

- ``engine_5``: the engine's own 5-member fit scored by ``post.predict`` (as ``classification.py``);
- ``ensemble_K``: the first ``K`` members (``K`` = 5, 10, 20, ``--members``);
- ``ensemble_K_of_M``: random ``K``-member subsets (``K`` = 5, 10) of the ``M`` members (``--subsets`` of them: mean
  and sd; ``*_sd`` columns: their sd);
- ``ensemble_5_drop_j``: the default 5 members without member ``j`` (is the AUROC driven by one member?);
- ``nuts_all``: every NUTS draw; ``nuts_K``: random ``K``-draw subsets of the NUTS draws (``--subsets`` of them, mean
  and sd): the posterior with as many draws as the ensemble has members, the control for the member count.

Columns: ``auroc_mi`` / ``auroc_entropy`` on the benchmark's noise rows (as many as test rows, ``ood_inputs``);
``auroc_mi_big``: the same against ``--big-noise`` fresh noise rows (seed 7,000 + split): is the miss the benchmark's
few noise rows?; ``nll``; ``unanimous``: the share of the benchmark's noise rows where every draw picks the same
class; ``mi_noise_median`` and ``mi_test_max`` (nats); ``f_noise`` / ``sd_f_noise``: the mean over noise rows and
classes of ``|E f|`` and of the draws' sd of ``f``; ``top_class_share``: the share of noise rows whose mixture's most
probable class is the most common one there.

A second table (``*_layers``) compares the weights per layer: root mean square over entries of the members' sd, of
the anchors' sd (the prior's is 1), of NUTS's sd, the members' root mean square distance to their own anchors and
the root mean square ``|w|`` of each.

Run from the repository root: ``python benchmarks/ensemble_ood_cause.py --dataset iris --split 0``. Writes
``benchmarks/results/classification/<stem>.md`` and ``.csv`` (``--name``; default ``ensemble_ood_cause_<set><split>``).
One torch thread (NUTS: its default chain processes).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import pandas as pd
import torch
from _common import markdown, results_dir, write_result
from anchor_free_directions import Recorder
from classification import load_dataset, make_model, make_split, ood_inputs
from svi_ood_cause import _logits, _mutual_information

import bnn_pyro as bp
from bnn_pyro import metrics

LAYERS = ("0.weight", "0.bias", "2.weight", "2.bias")


def _entropy(f: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(f, -1).mean(0)
    return -(p * p.clamp_min(1e-300).log()).sum(-1)


def score(f_test: torch.Tensor, f_noise: torch.Tensor, f_big: torch.Tensor, y_test: torch.Tensor) -> dict:
    """The columns of one predictor from its draws' logits ``(S, N, K)`` at the test, noise and big-noise rows."""
    mi_test, mi_noise, mi_big = (_mutual_information(f) for f in (f_test, f_noise, f_big))
    votes = f_noise.argmax(-1)  # (S, N)
    mixture = torch.softmax(f_noise, -1).mean(0).argmax(-1)
    return dict(
        auroc_mi=metrics.ood_auroc(mi_test, mi_noise),
        auroc_entropy=metrics.ood_auroc(_entropy(f_test), _entropy(f_noise)),
        auroc_mi_big=metrics.ood_auroc(mi_test, mi_big),
        nll=metrics.nll(torch.softmax(f_test, -1).mean(0), y_test),
        unanimous=float((votes == votes[0]).all(0).double().mean()),
        mi_noise_median=float(mi_noise.median()),
        mi_test_max=float(mi_test.max()),
        f_noise=float(f_noise.mean(0).abs().mean()),
        sd_f_noise=float(f_noise.std(0).mean()) if len(f_noise) > 1 else 0.0,
        top_class_share=float(torch.bincount(mixture).max() / len(mixture)),
    )


def subsets(f: tuple, size: int, count: int, seed: int) -> dict:
    """Mean and sd of :func:`score`'s columns over ``count`` random ``size``-draw subsets of the draws ``f``."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        score(*(t[idx] for t in f[:3]), f[3])
        for idx in (torch.randperm(len(f[0]), generator=g)[:size] for _ in range(count))
    ]
    table = pd.DataFrame(rows)
    out = table.mean().to_dict()
    out.update({f"{k}_sd": v for k, v in table.std().items() if k.startswith("auroc")})
    return out


class AnchorRecorder(Recorder):
    """:class:`anchor_free_directions.Recorder` that keeps every site's anchor (``w0 = -g`` under ``Normal(0, 1)``)."""

    def __call__(self, pot, z, data, **kwargs):
        if kwargs.get("tilted") is not None:
            self.full = getattr(self, "full", []) + [{n: -v.detach().clone() for n, v in kwargs["tilted"].items()}]
        return super().__call__(pot, z, data, **kwargs)

    @property
    def anchors(self) -> dict:
        return {n: torch.stack([c[n] for c in self.full]).double() for n in LAYERS}


def fit(method: str, s: dict, k: int, split: int, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model(s["x_train"].shape[1], k, split)
        return bp.fit(model, s["x_train"], s["y_train"], method=method, seed=split, progress=False, **options)


def draws_of(samples: dict) -> dict:
    return {n: samples[n].reshape((-1,) + samples[n].shape[2:]).double() for n in LAYERS}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="iris")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--members", type=int, default=40)
    parser.add_argument("--subsets", type=int, default=200)
    parser.add_argument("--big-noise", type=int, default=3000)
    parser.add_argument("--nuts-draws", default=None, help="a torch.save'd dict of NUTS samples to reuse (else fit)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y = load_dataset(args.dataset)
    s, k = make_split(x, y, args.split), int(y.max()) + 1
    noise = ood_inputs(s, args.split)["noise"]
    big = 3.0 * torch.randn(args.big_noise, x.shape[1], generator=torch.Generator().manual_seed(7000 + args.split))
    rows_x = (s["x_test"].double(), noise.double(), big.double())

    def logits(draws: dict) -> tuple:
        return (*(_logits(draws, r) for r in rows_x), s["y_test"])

    rows = []
    engine = fit("ensemble", s, k, args.split)
    out, out_noise = engine.predict(s["x_test"], seed=0), engine.predict(noise, seed=0)
    rows.append(
        dict(
            predictor="engine_5",
            auroc_mi=metrics.ood_auroc(out.mutual_information, out_noise.mutual_information),
            auroc_entropy=metrics.ood_auroc(out.entropy, out_noise.entropy),
            nll=metrics.nll(out.probs, s["y_test"]),
            validation=str(engine.config.get("validation")),
        )
    )
    start = time.perf_counter()
    with AnchorRecorder(torch.zeros(x.shape[1], x.shape[1]), None) as rec:
        ens = fit("ensemble", s, k, args.split, num_chains=args.members)
    ens_s = time.perf_counter() - start
    f_ens = logits(draws_of(ens.samples))
    for size in sorted({n for n in (5, 10, 20) if n < args.members} | {args.members}):
        rows.append(dict(predictor=f"ensemble_{size}", **score(*(t[:size] for t in f_ens[:3]), f_ens[3])))
    for size in (5, 10):
        rows.append(dict(predictor=f"ensemble_{size}_of_{args.members}", **subsets(f_ens, size, args.subsets, size)))
    for j in range(5):
        keep = [i for i in range(5) if i != j]
        rows.append(dict(predictor=f"ensemble_5_drop_{j}", **score(*(t[keep] for t in f_ens[:3]), f_ens[3])))
    start = time.perf_counter()
    if args.nuts_draws and Path(args.nuts_draws).exists():
        nuts_samples = torch.load(args.nuts_draws)
        nuts_from = f"loaded from {Path(args.nuts_draws).name}, a bp.fit(method='nuts', seed=split) at its defaults"
    else:
        nuts_samples = fit("nuts", s, k, args.split).samples
        nuts_from = f"{time.perf_counter() - start:.0f} s"
    f_nuts = logits(draws_of(nuts_samples))
    rows.append(dict(predictor="nuts_all", **score(*f_nuts)))
    for size in sorted({5, 10, 20, args.members}):
        rows.append(dict(predictor=f"nuts_{size}", **subsets(f_nuts, size, args.subsets, 2)))
    table = pd.DataFrame(rows).round(3)
    print(table.to_string(), flush=True)

    layers = []
    ens_w, nuts_w = draws_of(ens.samples), draws_of(nuts_samples)
    anchors = rec.anchors
    for n in LAYERS:
        w, w0 = ens_w[n], anchors[n]
        rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
        layers.append(
            dict(
                layer=n,
                members_sd=rms(w.std(0)),
                anchors_sd=rms(w0.std(0)),
                nuts_sd=rms(nuts_w[n].std(0)),
                members_to_anchor=rms(w - w0),
                members_abs=rms(w),
                anchors_abs=rms(w0),
                nuts_abs=rms(nuts_w[n]),
            )
        )
    layer_table = pd.DataFrame(layers).round(3)
    print(layer_table.to_string(), flush=True)

    folder = results_dir("classification", args.out)
    stem = args.name or f"ensemble_ood_cause_{args.dataset}{args.split}"
    table.to_csv(folder / f"{stem}.csv", index=False)
    layer_table.to_csv(folder / f"{stem}_layers.csv", index=False)
    write_result(
        folder / f"{stem}.md",
        f"The anchored ensemble's noise AUROC on {args.dataset} split {args.split} against NUTS "
        "(benchmarks/ensemble_ood_cause.py's docstring defines every row and column). "
        f"{args.members} members at the engine's defaults ({ens_s:.0f} s), NUTS at its defaults "
        f"({len(f_nuts[0])} draws; {nuts_from}); random subsets: "
        f"{args.subsets} each; big noise: {args.big_noise} rows.\n\n"
        + markdown(table)
        + "\n\nWeights per layer (root mean square over entries; the prior's sd is 1):\n\n"
        + markdown(layer_table),
    )


if __name__ == "__main__":
    main()
