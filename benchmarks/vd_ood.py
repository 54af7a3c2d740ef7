"""Why variational dropout misses the noise-AUROC half of issue 26's joint target (docs/ood.md): experiments.

Per set and split (``benchmarks/classification.py``'s protocol: its split, net, prior, likelihood, noise inputs and
scores), fits ``variational_dropout`` at its defaults and variants of it, and mean-field SVI for comparison, then
reports test accuracy / NLL, the noise AUROC by entropy and mutual information, and per weight layer what each
fit's Gaussian holds: the root mean square of its sd and of its mean ``theta`` (the prior's sd is 1; variant B's sd is
``sqrt(alpha) |theta| <= |theta|``), the median ``alpha = sd^2 / theta^2`` and the fraction of weights at
``alpha > 0.9`` (near variant B's bound 1).

Variants (``--variants``):

- ``default``: ``method="variational_dropout"`` at its defaults (learned ``alpha <= 1``, log-uniform prior);
- ``alpha_fixed_<a>``: ``alpha`` held at ``a`` for every weight (Gaussian dropout at rate ``a / (1 + a)``);
- ``init_prior``: ``init="prior"`` (the means start at a ``Normal(0, 1)`` draw instead of the layers' reset);
- ``normal_prior``: the same ``q`` (``sigma^2 = alpha theta^2``, ``alpha <= 1``) under the model's ``Normal(0, 1)``
  prior (closed-form KL), to tell the prior from the parameterization;
- ``normal_prior_init_prior``: both;
- ``sparse_vd`` and ``svi``: those engines at their defaults.

Usage::

    python benchmarks/vd_ood.py --dataset wine,iris --splits 0 --variants default,alpha_fixed_1,init_prior,svi
    python benchmarks/vd_ood.py --dataset wine --splits 0 --variants svi --seeds 0,1,2 --tag svi_seeds

writes ``vd_ood_<tag>.md`` and ``.csv`` to ``benchmarks/results/classification/``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import pandas as pd
import torch
from _common import markdown, results_dir, write_result  # noqa: E402
from classification import _aurocs, load_dataset, make_model, make_split, ood_inputs  # noqa: I001

import bnn_pyro as bp
from bnn_pyro.infer import variational_dropout as vd


@contextlib.contextmanager
def _patched(variant: str):
    """Monkeypatch ``_VDWeights`` for the experimental variants (restored on exit)."""
    cls = vd._VDWeights
    old_project, old_kl = cls.project, cls.kl
    if variant.startswith("alpha_fixed_"):
        log_a = math.log(float(variant.rpartition("_")[2]))

        @torch.no_grad()
        def project(self):
            for p in self.log_scale:
                p.fill_(log_a)

        cls.project = project
    if "normal_prior" in variant:

        def kl(self):
            total = 0.0
            for i in range(len(self.names)):
                var, mean2 = self.scale(i) ** 2 + 1e-16, self.theta[i] ** 2
                total = total + 0.5 * (var + mean2 - 1.0 - var.log()).sum()
            return total

        cls.kl = kl
    try:
        yield
    finally:
        cls.project, cls.kl = old_project, old_kl


def run_one(name: str, data, split: int, variant: str, seed: int | None = None) -> dict:
    """One fit of ``variant`` on ``split``; ``seed`` (default: the split, as ``classification.py``) seeds the net's
    initial weights and the fit."""
    seed = split if seed is None else seed
    x, y = data
    s = make_split(x, y, split)
    k = int(y.max()) + 1
    model = make_model(x.shape[1], k, seed)
    method = variant if variant in ("svi", "sparse_vd") else "variational_dropout"
    options = dict(init="prior") if "init_prior" in variant else {}
    start = time.perf_counter()
    with _patched(variant):
        post = bp.fit(model, s["x_train"], s["y_train"], method=method, seed=seed, progress=False, **options)
    row = dict(dataset=name, split=split, seed=seed, variant=variant, time_s=time.perf_counter() - start)
    out = post.predict(s["x_test"], seed=0)
    row.update(accuracy=bp.metrics.accuracy(out.probs, s["y_test"]), nll=bp.metrics.nll(out.probs, s["y_test"]))
    row.update(_aurocs(lambda xs: post.predict(xs, seed=0), s["x_test"], {"noise": ood_inputs(s, split)["noise"]}))
    weights = {n: post.samples[n] for n in ("0.weight", "0.bias", "2.weight", "2.bias") if n in post.samples}
    draws = {n: w.reshape(-1, *w.shape[2:]) for n, w in weights.items()}
    mean = {n: w.mean(0) for n, w in draws.items()}
    sd = {n: w.std(0) for n, w in draws.items()}
    for n in ("0.weight", "2.weight"):
        alpha = sd[n].pow(2) / mean[n].pow(2).clamp_min(1e-12)
        row[f"{n} rms sd"] = float(sd[n].pow(2).mean().sqrt())
        row[f"{n} rms theta"] = float(mean[n].pow(2).mean().sqrt())
        row[f"{n} median alpha"] = float(alpha.median())
        row[f"{n} alpha>0.9"] = float((alpha > 0.9).double().mean())
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="wine,iris")
    parser.add_argument("--splits", default="0")
    parser.add_argument("--variants", default="default,svi")
    parser.add_argument("--seeds", default="", help="comma list of seeds (default: each split's own)")
    parser.add_argument("--tag", default="experiments")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    rows = []
    for name in args.dataset.split(","):
        data = load_dataset(name)
        for split in (int(v) for v in args.splits.split(",")):
            for variant in args.variants.split(","):
                for seed in [int(v) for v in args.seeds.split(",")] if args.seeds else [None]:
                    rows.append(run_one(name, data, split, variant, seed))
                    print(pd.DataFrame([rows[-1]]).round(3).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    folder = results_dir("classification")
    table.to_csv(folder / f"vd_ood_{args.tag}.csv", index=False)
    text = f"# Variational dropout off the data: {args.tag}\n\n{args.note}\n\n" + markdown(table.round(3))
    write_result(folder / f"vd_ood_{args.tag}.md", text + "\n")
    return table


if __name__ == "__main__":
    main()
