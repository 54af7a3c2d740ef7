"""Why last-layer Laplace is underconfident on digits' own test rows (issue 26 item 1; docs/ood.md).

On one split of ``benchmarks/classification.py`` (same data, split, net, prior and seed), the Laplace approximation
at a ``BNN``'s defaults (``structure="last_layer"``, GGN, ``prior_precision="model"``) and at the settings named by
``--settings``; per setting, on the test rows:

- ``nll_map``: the plug-in softmax at the MAP (no spread at all), and ``train_nll_map`` on the training rows;
- ``nll_mc`` / ``nll_mc10k`` / ``nll_probit``: the GLM predictive by Monte Carlo over the linearized logits (1,000
  and 10,000 draws) and by MacKay's probit approximation (:func:`bnn_pyro.infer.laplace.glm.predictive_probs`);
- ``logit_var``: the linearized logits' variance per row and class ``diag(J H^-1 J^T)`` averaged over classes, its
  median and 90th percentile over test rows; ``phi2``: ``|phi(x)|^2 + 1`` (features and bias) at the test rows,
  the variance each logit would have under the prior ``N(0, 1)`` of the last layer alone;
- the GGN's eigenvalues (``H - delta I``, the likelihood's curvature in the covered weights): how many exceed the
  prior precision ``delta`` (the effective number of parameters the data determine, MacKay 1992's ``gamma``
  counts ``lambda / (lambda + delta)``) out of the covered dimension;
- the prior precision used (``delta``; 1 for the model's ``Normal(0, 1)``);
- for the last layer, the Gaussian's draws on the training rows (:func:`_draws_on_training_rows`): their excess
  negative log likelihood over the mean's against ``gamma / 2``, the quadratic model's, and the PSIS ``k_hat``;
- with ``--deltas``, a post-hoc scan of the defaults' fit (the MAP and its GGN kept, ``H = GGN + delta I``, as
  laplace-torch's post-hoc prior precision): per ``delta``, the test NLL, ECE and the noise AUROC by mutual
  information (the benchmark's 2,000 noise rows), from 1,000 draws of the linearized logits: the frontier between
  in-data calibration and off-data spread that the prior precision alone can reach; with the post-hoc log evidence
  (relative to ``delta = 1``'s, the MAP kept: ``-(delta - 1)|w|^2 / 2 + k log(delta) / 2 - log det(GGN + delta I) / 2
  + log det(GGN + I) / 2``), ``gamma = sum lambda / (lambda + delta)`` and ``|w|^2`` of the covered weights.

Usage::

    python benchmarks/laplace_classification_cause.py --dataset digits --max-rows 600 --split 0
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import time

import pandas as pd
import torch

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.infer import laplace as lap
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.laplace.glm import functional_moments, predictive_probs

try:
    from classification import NOISE_ROWS, load_dataset, make_model, make_split, ood_inputs, subset
    from uci import git_commit, parse_options
except ImportError:  # pragma: no cover
    from benchmarks.classification import NOISE_ROWS, load_dataset, make_model, make_split, ood_inputs, subset
    from benchmarks.uci import git_commit, parse_options
from _common import results_dir, write_result  # noqa: E402 - classification put benchmarks/ on sys.path


def measure(dataset: str, split: int, options: dict, max_rows: int | None) -> dict:
    """One setting's row (see the module docstring)."""
    x, y = subset(load_dataset(dataset), max_rows)
    s = make_split(x, y, split)
    k = int(y.max()) + 1
    model = make_model(x.shape[1], k, split)
    approx = lap.laplace_approximation(model, Data(x=s["x_train"], y=s["y_train"]), seed=split, **options)
    net, center = approx.model.net, approx.center()  # the MAP (the expansion point) of every weight
    with torch.no_grad():
        logits_test = torch.func.functional_call(net, center, (s["x_test"],))
        logits_train = torch.func.functional_call(net, center, (s["x_train"],))
    row = dict(dataset=dataset, split=split, setting=str(options or "defaults"))
    row["nll_map"] = metrics.nll(torch.softmax(logits_test, -1), s["y_test"])
    row["train_nll_map"] = metrics.nll(torch.softmax(logits_train, -1), s["y_train"])
    for name, link, n in (("nll_mc", "mc", 1000), ("nll_mc10k", "mc", 10000), ("nll_probit", "probit", 1)):
        probs = predictive_probs(approx, s["x_test"], link=link, num_samples=n, seed=0)
        row[name] = metrics.nll(probs, s["y_test"])
        if name == "nll_mc":
            row["acc_mc"] = metrics.accuracy(probs, s["y_test"])
            row["ece_mc"] = metrics.ece(probs, s["y_test"])
    _, cov = functional_moments(approx, s["x_test"])
    var = cov.diagonal(dim1=-2, dim2=-1).mean(-1)
    row["logit_var_median"] = float(var.median())
    row["logit_var_p90"] = float(var.quantile(0.9))
    if isinstance(net, torch.nn.Sequential):
        last = f"{len(net) - 1}."
        body = {n: v for n, v in center.items() if not n.startswith(last)}
        with torch.no_grad():
            phi = torch.func.functional_call(net[:-1], body, (s["x_test"],))
        row["phi2_median"] = float((phi.pow(2).sum(-1) + 1).median())
    delta = approx.prior_precision
    d = 1.0 if delta is None else float(sum(delta.values()) / len(delta))
    row["delta"] = d
    hess = approx.precision
    if isinstance(hess, torch.Tensor) and hess.dim() == 2:
        ggn = torch.linalg.eigvalsh(hess) - d  # single-delta settings; layerwise ones report the mean delta
        row["dim"] = len(ggn)
        row["ggn_above_delta"] = int((ggn > d).sum())
        row["gamma"] = float((ggn.clamp_min(0) / (ggn.clamp_min(0) + d)).sum())
        row["ggn_max"] = float(ggn.max())
    if options.get("structure", "last_layer") == "last_layer" and isinstance(net, torch.nn.Sequential):
        with torch.no_grad():
            phi_train = torch.func.functional_call(net[:-1], body, (s["x_train"],))
        row.update(_draws_on_training_rows(approx, phi_train.double(), s["y_train"], k, row.get("gamma", math.nan)))
    return row


def _draws_on_training_rows(approx, phi: torch.Tensor, y: torch.Tensor, k: int, gamma: float, num: int = 4000):
    """For the last layer (``W`` then ``b`` in the covered coordinates): the excess ``-log p(y | w_s) + log p(y | m)``
    of the Gaussian's draws over its mean on the training rows (summed over rows, averaged over draws) against
    ``gamma / 2``, its value were the log likelihood quadratic (``E (w - m)^T G (w - m) / 2 = tr(G Sigma) / 2``), and
    the Pareto ``k_hat`` of the importance ratios ``p(w, y) / q(w)`` (Yao et al. 2018; > 0.7: ``q`` unreliable)."""
    import arviz as az

    m, h = approx.mean[approx.active].double(), approx.precision
    chol = torch.linalg.cholesky(h)
    eps = torch.randn(num, len(m), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w = m + torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T
    d = phi.shape[1]

    def loglik(v):  # (S, dim) -> (S,)
        logits = torch.einsum("nd,skd->snk", phi, v[:, : k * d].reshape(-1, k, d)) + v[:, None, k * d :]
        return torch.log_softmax(logits, -1).gather(-1, y.expand(len(v), -1)[..., None]).squeeze(-1).sum(1)

    lik, lik0 = loglik(w), loglik(m[None])[0]
    delta = 1.0 if approx.prior_precision is None else next(iter(approx.prior_precision.values()))
    log_ratio = lik - delta * w.pow(2).sum(1) / 2 + eps.pow(2).sum(1) / 2  # log p(w, y) - log q(w) + const
    _, k_hat = az.psislw(log_ratio.numpy())
    excess = float((lik0 - lik).mean())
    return dict(
        draws_train_excess=excess, quadratic_excess=gamma / 2, excess_ratio=excess / (gamma / 2), k_hat=float(k_hat)
    )


def scan(dataset: str, split: int, deltas: list[float], max_rows: int | None) -> list[dict]:
    """The post-hoc ``delta`` scan of the defaults' fit (see the module docstring)."""
    x, y = subset(load_dataset(dataset), max_rows)
    s = make_split(x, y, split)
    model = make_model(x.shape[1], int(y.max()) + 1, split)
    approx = lap.laplace_approximation(model, Data(x=s["x_train"], y=s["y_train"]), seed=split)
    eye = torch.eye(len(approx.active), dtype=approx.precision.dtype)
    ggn = approx.precision - eye  # the model's Normal(0, 1): prior precision 1 on every covered weight
    noise = ood_inputs(s, split, noise_rows=NOISE_ROWS)["noise"]
    lam = torch.linalg.eigvalsh(ggn).clamp_min(0)
    w2 = float(approx.mean[approx.active].double().pow(2).sum())
    rows = []
    for delta in deltas:
        moved = dataclasses.replace(approx, precision=ggn + delta * eye)
        probs_in, mi_in = _draws(moved, s["x_test"])
        _, mi_out = _draws(moved, noise)
        rows.append(
            dict(
                dataset=dataset,
                split=split,
                delta=delta,
                nll=metrics.nll(probs_in, s["y_test"]),
                ece=metrics.ece(probs_in, s["y_test"]),
                auroc_noise_mi=metrics.ood_auroc(mi_in, mi_out),
                # the post-hoc log evidence against delta = 1's: the MAP kept, its gradient term dropped
                log_evidence_change=float(
                    -(delta - 1) * w2 / 2
                    + len(lam) * math.log(delta) / 2
                    - ((lam + delta).log() - (lam + 1).log()).sum() / 2
                ),
                gamma=float((lam / (lam + delta)).sum()),
                w2=w2,
            )
        )
        print(rows[-1], flush=True)
    return rows


def reference(dataset: str, split: int, max_rows: int | None, nuts: dict) -> list[dict]:
    """The last layer alone, as Bayesian multinomial logistic regression on the features ``phi(x)`` of the
    defaults' MAP (the layers below held there, as ``structure="last_layer"`` holds them), under the same
    ``Normal(0, 1)`` prior: its Laplace approximation (``bp.fit(..., method="laplace")`` on that one-layer net: the
    covariance is the last-layer fit's) against its exact posterior by NUTS; test NLL and ECE of each predictive."""
    x, y = subset(load_dataset(dataset), max_rows)
    s = make_split(x, y, split)
    k = int(y.max()) + 1
    model = make_model(x.shape[1], k, split)
    approx = lap.laplace_approximation(model, Data(x=s["x_train"], y=s["y_train"]), seed=split)
    net, center = approx.model.net, approx.center()
    last = f"{len(net) - 1}."
    body = {n: v for n, v in center.items() if not n.startswith(last)}
    with torch.no_grad():
        phi_train, phi_test = (torch.func.functional_call(net[:-1], body, (v,)) for v in (s["x_train"], s["x_test"]))
    rows = []
    for method, options in (("laplace", {}), ("nuts", nuts)):
        torch.manual_seed(split)
        head = bp.BNN(
            torch.nn.Linear(phi_train.shape[1], k),
            prior=bp.priors.Normal(0.0, 1.0),
            likelihood=bp.likelihoods.Categorical(),
        )
        start = time.perf_counter()
        post = bp.fit(head, phi_train, s["y_train"], method=method, seed=split, progress=False, **options)
        probs = post.predict(phi_test, seed=0).probs
        row = dict(dataset=dataset, split=split, method=method, options=str(options))
        row.update(nll=metrics.nll(probs, s["y_test"]), ece=metrics.ece(probs, s["y_test"]))
        row["accuracy"] = metrics.accuracy(probs, s["y_test"])
        row["time_s"] = time.perf_counter() - start
        if method == "nuts":
            summary = post.summary()
            row["r_hat_max"] = float(summary["r_hat"].max())
            row["ess_bulk_min"] = float(summary["ess_bulk"].min())
        rows.append(row)
        print(row, flush=True)
    return rows


def _draws(approx, x: torch.Tensor, num_samples: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictive class probabilities, mutual information) from draws of the linearized logits."""
    mean, cov = functional_moments(approx, x)
    chol = torch.linalg.cholesky(cov + 1e-9 * torch.eye(cov.shape[-1], dtype=cov.dtype))
    eps = torch.randn((num_samples,) + mean.shape, generator=torch.Generator().manual_seed(0), dtype=mean.dtype)
    probs = torch.softmax(mean + torch.einsum("nop,snp->sno", chol, eps), -1)
    avg = probs.mean(0)
    entropy = -(avg * avg.clamp_min(1e-300).log()).sum(-1)
    aleatoric = -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean(0)
    return avg, entropy - aleatoric


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument(
        "--settings",
        action="append",
        default=[],
        help="a setting as laplace:key=value[,laplace:key=value]; repeat per setting (the defaults always run)",
    )
    parser.add_argument("--deltas", default="", help="comma list of prior precisions for the post-hoc scan")
    parser.add_argument(
        "--reference", action="store_true", help="the last layer's Laplace against NUTS on the MAP's features"
    )
    parser.add_argument("--nuts", action="append", default=[], help="nuts:key=value for --reference")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = results_dir("laplace_classification", args.out)
    if args.deltas:
        deltas = [float(v) for v in args.deltas.split(",")]
        table = pd.DataFrame(scan(args.dataset, args.split, deltas, args.max_rows))
        name = f"delta_scan_{args.dataset}{args.split}{args.tag}"
        table.to_csv(out / f"{name}.csv", index=False)
        write_result(
            out / f"{name}.md", _markdown(table, f"Post-hoc prior precision: {args.dataset} split {args.split}", args)
        )
        return table
    if args.reference:
        nuts = parse_options(args.nuts).get("nuts", {})
        table = pd.DataFrame(reference(args.dataset, args.split, args.max_rows, nuts))
        name = f"reference_{args.dataset}{args.split}{args.tag}"
        table.to_csv(out / f"{name}.csv", index=False)
        title = f"The last layer's Laplace against its exact posterior: {args.dataset} split {args.split}"
        write_result(out / f"{name}.md", _markdown(table, title, args))
        return table
    settings = [{}] + [parse_options(s.split(",")).get("laplace", {}) for s in args.settings]
    rows = []
    for options in settings:
        rows.append(measure(args.dataset, args.split, options, args.max_rows))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    name = f"cause_{args.dataset}{args.split}{args.tag}"
    table.to_csv(out / f"{name}.csv", index=False)
    write_result(
        out / f"{name}.md",
        _markdown(table, f"Last-layer Laplace in-data calibration: {args.dataset} split {args.split}", args),
    )
    return table


def _markdown(table: pd.DataFrame, title: str, args) -> str:
    head = (
        f"Data: {args.dataset}, split {args.split}"
        + (f", a random {args.max_rows} rows" if args.max_rows else "")
        + f". Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__} on "
        f"{platform.machine()} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}), "
        f"{torch.get_num_threads()} torch thread(s), git {git_commit()}."
    )
    cols = list(table.columns)
    lines = [f"# {title}", "", head, ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        lines.append(
            "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v) for v in r) + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
