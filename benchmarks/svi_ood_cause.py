"""Why mean-field SVI at its defaults misses the noise-AUROC target on some splits (issue 26; ``docs/ood.md``).

``benchmarks/classification.py``'s protocol (its split, standardization, ``Linear(D, 50) - ReLU - Linear(50, K)`` net
with a ``Normal(0, 1)`` prior, ``seed=split``, noise inputs of sd 3), one set and split, SVI at its defaults and at
variants that change one thing each, and NUTS on the same split. Per fit: test accuracy and NLL; the noise AUROC by
mutual information (as ``classification.py``); ``scaled``, the AUROC by mutual information of the test rows against
the same rows scaled to the noise inputs' mean norm (how much of the separation the inputs' norm alone gives), and of
those scaled rows against the noise (what the direction adds at equal norm); the draws' logits at the test rows and
at the noise, as the mean over rows and classes of ``|E[f]|`` (the mean function's size) and of ``sd[f]`` (their
spread over draws); and, from the draws of the hidden-to-output weights ``W2`` (``K x 50``), the hidden units
``active`` (a unit whose largest ``|mean| / sd`` over its ``K`` output weights exceeds 2) and the root mean square sd
of the other units' input and output weights (the prior's is 1). With several chains (e.g. ``num_chains=3``: SVI's
restarts, pooled as an equal mixture) the columns above are the mixture's, and ``chain_auroc_mi`` is the mean over
chains of each chain's own noise AUROC by mutual information (from its draws' logits, as ``scaled``), and
``chains_agree_noise`` the share of noise rows where every chain's mean prediction picks the same class (1 for one
chain): whether the restarts end at different functions off the data. ``active_units`` and the other units' sds are
each chain's, averaged over chains (pooled, restarts whose units are permuted would blur them).

Variants (``--variants``): ``default``; ``kl_warmup=0.5``, ``init_scale=0.1``, ``elbo=mean_field`` (the closed-form
KL), ``num_particles=8`` (a setting of ``bp.fit``); ``rotate`` (the inputs rotated to the principal axes of the
training rows, ``x V`` with ``V`` the eigenvectors of their covariance; the test and noise rows too: under the
isotropic ``Normal(0, 1)`` prior the same model and exact posterior, with the mean-field factors now along the
directions the data leave free); ``nuts`` (2 chains of 400 draws after 400 warm-up, shorter than its defaults). Any
other ``key=value`` of SVI's options is taken too, several joined by ``+`` (one fit each).

Run from the repository root: ``python benchmarks/svi_ood_cause.py --dataset wine --split 0``. Writes
``benchmarks/results/classification/svi_ood_cause_<set><split>.md`` and ``.csv``. One torch thread.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import pandas as pd
import torch
from _common import markdown, results_dir, write_result
from classification import load_dataset, make_model, make_split, ood_inputs

import bnn_pyro as bp
from bnn_pyro import metrics

DEFAULT_VARIANTS = "default,kl_warmup=0.5,init_scale=0.1,elbo=mean_field,num_particles=8,rotate,nuts"
ACTIVE_SNR = 2.0


def _options(variant: str) -> tuple[str, dict]:
    if variant == "nuts":
        return "nuts", dict(num_chains=2, num_samples=400, num_warmup=400)
    if variant in ("default", "rotate"):
        return "svi", {}
    options = {}
    for item in variant.split("+"):  # e.g. guide=full_rank+lr=0.001: several options in one fit
        key, value = item.split("=")
        try:
            value = float(value) if "." in value else int(value)
        except ValueError:
            pass
        options[key] = value
    return "svi", options


def _logits(samples: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``(S, N, K)`` logits of the one-hidden-layer ReLU net at ``x`` for every draw."""
    w1, b1, w2, b2 = (samples[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
    h = torch.relu(torch.einsum("sjd,nd->snj", w1, x) + b1[:, None, :])
    return torch.einsum("skj,snj->snk", w2, h) + b2[:, None, :]


def _mutual_information(f: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(f, -1)
    mean = p.mean(0)
    entropy = -(mean * mean.clamp_min(1e-300).log()).sum(-1)
    return entropy + (p * p.clamp_min(1e-300).log()).sum(-1).mean(0)


def _units(w1: torch.Tensor, w2: torch.Tensor) -> dict:
    """One chain's hidden units that carry the fit (``active_units``) and the others' root mean square sds."""
    off = (w2.mean(0).abs() / w2.std(0)).max(0).values <= ACTIVE_SNR
    return dict(
        active_units=int((~off).sum()),
        other_units_sd_in=float(w1.std(0)[off].pow(2).mean().sqrt()) if off.any() else math.nan,
        other_units_sd_out=float(w2.std(0)[:, off].pow(2).mean().sqrt()) if off.any() else math.nan,
    )


def run(name: str, split: int, variant: str) -> dict:
    x, y = load_dataset(name)
    s = make_split(x, y, split)
    noise = ood_inputs(s, split)["noise"]
    if variant == "rotate":
        xt = s["x_train"].double() - s["x_train"].double().mean(0)
        rot = torch.linalg.eigh(xt.T @ xt / (len(xt) - 1)).eigenvectors.to(x.dtype)
        s = {k: (v @ rot if v.is_floating_point() else v) for k, v in s.items()}
        noise = noise @ rot
    method, options = _options(variant)
    model = make_model(x.shape[1], int(y.max()) + 1, split)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(model, s["x_train"], s["y_train"], method=method, seed=split, progress=False, **options)
    seconds = time.perf_counter() - start
    pred, pred_noise = post.predict(s["x_test"], seed=0), post.predict(noise, seed=0)
    draws = {k: v.reshape((-1,) + v.shape[2:]).double() for k, v in post.samples.items() if k[0].isdigit()}
    test, far = s["x_test"].double(), noise.double()
    scaled = test * (far.norm(dim=-1).mean() / test.norm(dim=-1).mean())
    f_test, f_noise, f_scaled = _logits(draws, test), _logits(draws, far), _logits(draws, scaled)
    mi_test, mi_noise, mi_scaled = (_mutual_information(f) for f in (f_test, f_noise, f_scaled))
    chains = [{k: v[c].double() for k, v in post.samples.items() if k[0].isdigit()} for c in range(post.num_chains)]
    per_chain = [(_logits(d, test), _logits(d, far)) for d in chains]
    chain_auroc = [metrics.ood_auroc(_mutual_information(ft), _mutual_information(fn)) for ft, fn in per_chain]
    classes = torch.stack([torch.softmax(fn, -1).mean(0).argmax(-1) for _, fn in per_chain])
    units = [_units(d["0.weight"], d["2.weight"]) for d in chains]  # per chain: pooled restarts permute units
    return dict(
        dataset=f"{name} {split}",
        variant=variant,
        accuracy=metrics.accuracy(pred.probs, s["y_test"]),
        nll=metrics.nll(pred.probs, s["y_test"]),
        auroc_noise_mi=metrics.ood_auroc(pred.mutual_information, pred_noise.mutual_information),
        auroc_scaled_mi=metrics.ood_auroc(mi_test, mi_scaled),
        auroc_scaled_to_noise_mi=metrics.ood_auroc(mi_scaled, mi_noise),
        mean_f_test=float(f_test.mean(0).abs().mean()),
        sd_f_test=float(f_test.std(0).mean()),
        mean_f_noise=float(f_noise.mean(0).abs().mean()),
        sd_f_noise=float(f_noise.std(0).mean()),
        chain_auroc_mi=sum(chain_auroc) / len(chain_auroc),
        chains_agree_noise=float((classes == classes[0]).all(0).double().mean()),
        **{k: sum(u[k] for u in units) / len(units) for k in units[0]},
        fit_s=seconds,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="wine")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--name", default=None, help="the results' file stem (default svi_ood_cause_<set><split>)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = results_dir("classification", args.out)
    stem = args.name or f"svi_ood_cause_{args.dataset}{args.split}"
    rows = []
    for variant in args.variants.split(","):
        rows.append(run(args.dataset, args.split, variant))
        print(rows[-1], flush=True)
        table = pd.DataFrame(rows).round(3)
        table.to_csv(folder / f"{stem}.csv", index=False)
        write_result(
            folder / f"{stem}.md",
            f"Mean-field SVI's noise AUROC on {args.dataset} split {args.split}: defaults, variants and NUTS "
            "(benchmarks/svi_ood_cause.py's docstring defines every column; the prior's sd is 1). One fit per "
            "row (seed = split).\n\n" + markdown(table),
        )


if __name__ == "__main__":
    main()
