"""Mean-field guides pushed apart: a prototype for issue 26 item 1 (``docs/ood.md``, "Mean-field SVI off the data").

Independent mean-field guides (``bp.fit(..., method="svi", num_chains=K)``) end at nearly the same function off the
data, so their mixture's mutual information does not rise there. Here ``K`` mean-field Gaussians over the weights of
``benchmarks/classification.py``'s model (its net, prior, split, seed and scoring, through ``classification.run_one``)
are fitted jointly, one reparameterized draw per guide per step, by one of (``--variants``):

- ``independent``: the sum of the ``K`` guides' own ELBOs (nothing couples them: ``num_chains=K`` restarts, the
  control that checks this torch loop against the committed SVI rows);
- ``mixture``: the ELBO of the uniform mixture ``q(w) = (1/K) sum_k N(w; m_k, s_k^2)`` with one draw per component
  (stratified), ``log q`` the mixture's log density (Morningstar et al. 2021): a guide gains entropy, at most
  ``log K``, by moving away from the others in weight space;
- ``function=W``: the guides' own ELBOs plus ``W K`` times a kernel estimate of the entropy of their predictions off
  the data (D'Angelo & Fortuin 2021, "Repulsive deep ensembles are Bayesian", the function-space KDE term, with the
  guides' draws as the particles): ``H = -(1/K) sum_i log((1/K) sum_j k(p_i, p_j))``, ``p_k`` the class
  probabilities of guide ``k``'s draw at :data:`REPULSION_ROWS` inputs ``N(0, 3^2 I)`` in standardized units
  (``function=W@sd``: ``N(0, sd^2 I)``), fresh
  each step from their own generator (seed :data:`REPULSION_SEED` ``+ split``; not the scored noise rows, but the
  same distribution: this favours the method, and a user would have to choose such inputs), ``k`` an RBF kernel
  whose bandwidth is the median squared distance over ``log K`` (SVGD's rule). ``W = 1`` is the paper's weight.

Everything else is SVI's defaults (``bnn_pyro.infer.svi``): 5,000 steps, Adam at ``lr = 0.01`` on the cosine
schedule to 1% (``bnn_pyro.infer.optim.make_schedule``), initial sd 0.01 (softplus-parameterized), guide ``k``'s means
at the net's initialization under seed ``split + k``, ``num_samples = 1000`` draws per guide, pooled as ``K`` chains
of one ``bp.Posterior``. Per split, beside ``classification.run_one``'s columns: ``elbo``, the guides' mean ELBO over
the last 500 steps (their own, without the coupling term: what pushing apart costs the fit); ``agree_noise``, the
share of the scored noise rows where every guide's mean prediction picks the same class; ``mean_f_noise`` /
``sd_f_noise``, the mixture's mean ``|E[f]|`` and ``sd[f]`` of the logits there (as ``svi_ood_cause.py``).

Usage (from the repository root, one torch thread)::

    OMP_NUM_THREADS=1 python benchmarks/svi_repulsive.py --dataset iris --splits 0-9 --variants independent,function=1

appends one row per split and variant to ``<prefix>_<set>_splits.csv`` in ``--out`` (default
``benchmarks/results/classification/``), then writes ``<prefix>_<set>.md``: the rows per split and, where the splits
have committed rows, per variant the joint target over them (``classification_splits.aggregate``) and the paired
differences to the committed mean-field SVI and NUTS rows (``refit_ab.compare``). ``--report-only`` rewrites that
report from the per-split file without fitting.
"""

from __future__ import annotations

import argparse
import math
import warnings
from functools import partial

import pandas as pd
import torch
import torch.nn.functional as F
from _common import markdown, results_dir, write_result
from classification import (
    NOISE_ROWS,
    SPLIT_COLUMNS,
    load_dataset,
    make_model,
    make_split,
    ood_inputs,
    run_one,
    verdicts,
)
from classification_splits import aggregate, read_rows
from refit_ab import compare

import bnn_pyro as bp
from bnn_pyro.infer.optim import make_schedule
from bnn_pyro.infer.svi_lr import DEFAULT_LR

REPULSION_ROWS = 100
REPULSION_SD = 3.0
REPULSION_SEED = 20_000
COMMITTED = {"iris": ["noiserows", "splits10", "noiserows_nuts", "splits10_nuts"]}
COMMITTED["wine"] = COMMITTED["iris"]
"""The committed per-split files (``<prefix>_<set>_splits.csv``) holding logistic regression's, SVI's and NUTS's rows."""
COMPARED = ["auroc_noise_mi", "nll", "accuracy"]
PER_SPLIT = [
    "split",
    "method",
    *COMPARED,
    "auroc_far_mi",
    "agree_noise",
    "mean_f_noise",
    "sd_f_noise",
    "elbo",
    "time_s",
]


def _variant(text: str) -> tuple[str, float, float]:
    """``(kind, W, sd)`` of a ``--variants`` item: ``independent``, ``mixture``, ``function=W`` or ``function=W@sd``
    (the repulsion inputs' sd, :data:`REPULSION_SD` by default)."""
    kind, _, rest = text.partition("=")
    weight, _, sd = rest.partition("@")
    try:
        weight, sd = float(weight or 0.0), float(sd or REPULSION_SD)
    except ValueError:
        weight = math.nan
    if kind not in ("independent", "mixture", "function") or (kind == "function") != (weight > 0) or sd <= 0:
        raise SystemExit(
            f"--variants: expected independent, mixture, function=W or function=W@sd (W, sd > 0; e.g. function=1), "
            f"got {text!r}."
        )
    return kind, weight, sd


def _log_q(w: dict, loc: dict, sd: dict, mixture: bool) -> torch.Tensor:
    """``(K,)``: each draw's log density under its own guide, or (``mixture``) under the uniform mixture."""
    if not mixture:
        return sum(torch.distributions.Normal(loc[n], sd[n]).log_prob(w[n]).flatten(1).sum(-1) for n in w)
    k = len(next(iter(w.values())))
    pair = sum(  # (K draws, K components)
        torch.distributions.Normal(loc[n][None], sd[n][None]).log_prob(w[n][:, None]).flatten(2).sum(-1) for n in w
    )
    return pair.logsumexp(-1) - math.log(k)


def _kde_entropy(p: torch.Tensor) -> torch.Tensor:
    """The kernel estimate of the entropy of ``K`` particles ``p`` (``(K, ...)``), RBF kernel, median bandwidth."""
    flat = p.flatten(1)
    d2 = torch.cdist(flat, flat).square()
    k = len(flat)
    h = d2.detach()[~torch.eye(k, dtype=torch.bool, device=p.device)].median() / math.log(k)
    return -(torch.logsumexp(-d2 / h.clamp_min(1e-12), -1) - math.log(k)).mean()


def fit_guides(
    x, y, num_classes: int, split: int, *, variant: str, k: int, num_steps: int, num_samples: int, extras: dict
) -> bp.Posterior:
    """``K`` mean-field guides fitted jointly (this module's docstring), as ``K`` chains of a ``bp.Posterior``."""
    kind, weight, spread = _variant(variant)
    model = make_model(x.shape[1], num_classes, split)
    names = model.sample_names
    starts = [make_model(x.shape[1], num_classes, split + c).init_values for c in range(k)]
    loc = {n: torch.stack([s[n] for s in starts]).requires_grad_() for n in names}
    rho0 = math.log(math.expm1(0.01))  # softplus(rho0) = 0.01, SVI's init_scale
    rho = {n: torch.full_like(loc[n], rho0).requires_grad_() for n in names}
    prior = model.prior_distributions()
    opt = torch.optim.Adam([*loc.values(), *rho.values()], lr=DEFAULT_LR)
    schedule = make_schedule("cosine", opt, num_steps)
    torch.manual_seed(split)
    gen = torch.Generator(device=x.device).manual_seed(REPULSION_SEED + split)
    elbos = []
    for _ in range(num_steps):
        sd = {n: F.softplus(rho[n]) for n in names}
        w = {n: loc[n] + sd[n] * torch.randn_like(loc[n]) for n in names}
        f = model.forward_draws(w, x)  # (K, N, C)
        log_lik = torch.distributions.Categorical(logits=f).log_prob(y).sum(-1)
        log_prior = sum(prior[n].log_prob(w[n]).reshape(k, -1).sum(-1) for n in names)
        elbo = log_lik + log_prior - _log_q(w, loc, sd, kind == "mixture")
        loss = -elbo.sum()
        if weight:
            z = spread * torch.randn(REPULSION_ROWS, x.shape[1], generator=gen, device=x.device, dtype=x.dtype)
            loss = loss - weight * k * _kde_entropy(torch.softmax(model.forward_draws(w, z), -1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        elbos.append(elbo.detach().mean())
    extras["elbo"] = float(torch.stack(elbos[-500:]).mean())
    with torch.no_grad():
        samples = {
            n: loc[n][:, None]
            + F.softplus(rho[n])[:, None]
            * torch.randn(k, num_samples, *loc[n].shape[1:], device=x.device, dtype=x.dtype)
            for n in names
        }
    return bp.Posterior(samples=samples, model=model, method="svi", config=dict(prototype=variant, guides=k))


def _fit(
    variant: str, k: int, num_steps: int, num_samples: int, extras: dict, method, x, y, num_classes, split, options
):
    """``classification.run_one``'s ``fit=``: the guides' posterior's predictive, seed 0 (as ``classification._fit``)."""
    post = fit_guides(
        x, y, num_classes, split, variant=variant, k=k, num_steps=num_steps, num_samples=num_samples, extras=extras
    )
    extras.setdefault("posts", []).append(post)
    return partial(post.predict, seed=0)


def off_data(post: bp.Posterior, noise: torch.Tensor) -> dict:
    """``agree_noise``, ``mean_f_noise``, ``sd_f_noise`` of the guides at the scored noise rows (module docstring)."""
    with torch.no_grad():
        f = torch.stack(
            [
                post.model.forward_draws({n: v[c] for n, v in post.samples.items()}, noise)
                for c in range(post.num_chains)
            ]
        )
    classes = torch.softmax(f, -1).mean(1).argmax(-1)  # (K, rows): each guide's mean prediction
    pooled = f.flatten(0, 1).double()
    return dict(
        agree_noise=float((classes == classes[0]).all(0).double().mean()),
        mean_f_noise=float(pooled.mean(0).abs().mean()),
        sd_f_noise=float(pooled.std(0).mean()),
    )


def report(name: str, prefix: str, variants: list[str], folder) -> str:
    """This run's rows per split; the joint target per variant over the splits run and the paired differences to
    the committed SVI and NUTS rows, where the splits have committed rows."""
    methods = [f"svirep_{v}" for v in variants]
    ours = read_rows(folder, [prefix], name, methods)
    ours = ours[ours["method"] != "logreg"]
    lines = [
        "Per split (this run's rows; the module docstring defines the columns):",
        "",
        markdown(ours[PER_SPLIT].round(3)),
    ]
    rows = pd.concat([read_rows(results_dir("classification"), COMMITTED[name], name, ["svi", "nuts"]), ours])
    rows = rows[rows["split"].isin(ours["split"])]
    table = verdicts(rows)
    if table.empty:
        return "\n".join(lines) + "\nNo split run has a committed logistic-regression row: no verdicts.\n"
    summary = aggregate(table).round(4)
    lines += [
        "",
        "Joint target over the splits (classification_splits.aggregate; se over splits):",
        "",
        markdown(summary),
    ]
    for base in ("svi", "nuts"):
        before = rows[rows["method"] == base].assign(dataset=name)
        for m in methods:
            _, paired = compare(before.assign(method=m), ours[ours["method"] == m].assign(dataset=name), COMPARED)
            lines += ["", f"{m} - {base} (committed rows), paired by split:", "", markdown(paired)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="iris", choices=sorted(COMMITTED))
    parser.add_argument("--splits", default="0-9", help="first-last, e.g. 0-9")
    parser.add_argument("--variants", default="independent,mixture,function=1")
    parser.add_argument("--guides", type=int, default=5, help="K, the guides fitted jointly")
    parser.add_argument("--num-steps", type=int, default=5000)
    parser.add_argument("--num-samples", type=int, default=1000, help="draws per guide")
    parser.add_argument("--prefix", default="svirep")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from the per-split file, no fits"
    )
    parser.add_argument("--note", default="", help="a paragraph under the report's title (e.g. when the fits ran)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    first, _, last = args.splits.partition("-")
    splits = list(range(int(first), int(last or first) + 1))
    variants = args.variants.split(",")
    for v in variants:
        _variant(v)
    folder = results_dir("classification", args.out)
    path = folder / f"{args.prefix}_{args.dataset}_splits.csv"
    data = load_dataset(args.dataset)
    for split in [] if args.report_only else splits:
        s = make_split(*data, split)
        noise = ood_inputs(s, split, noise_rows=NOISE_ROWS)["noise"]
        for v in variants:
            extras = {}
            fit = partial(_fit, v, args.guides, args.num_steps, args.num_samples, extras)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = run_one(f"svirep_{v}", data, split, held_out_class=False, fit=fit)
            if not row["error"]:
                row.update(elbo=extras["elbo"], **off_data(extras["posts"][0], noise))
            row = dict(dataset=args.dataset, **row)
            columns = list(dict.fromkeys([c for c in SPLIT_COLUMNS if not c.startswith("auroc_class_")] + list(row)))
            pd.DataFrame([row], columns=columns).to_csv(path, mode="a", header=not path.exists(), index=False)
            print(
                f"[{args.dataset}] split {split} {v}: "
                + (row["error"] or " ".join(f"{m} {row[m]:.3f}" for m in [*COMPARED, "agree_noise", "elbo", "time_s"])),
                flush=True,
            )
    text = report(args.dataset, args.prefix, variants, folder)
    write_result(
        folder / f"{args.prefix}_{args.dataset}.md",
        f"# Mean-field guides pushed apart: {args.dataset}\n\n"
        + __doc__.split("\n\n")[0]
        + (f"\n\n{args.note}" if args.note else "")
        + "\n\n"
        + text,
    )


if __name__ == "__main__":
    main()
