"""How the held-out early-stopping rule chooses on small held-out sets, and what other rules would choose.

With 200+ rows the point-fit engines hold out 10% of the rows, score the fit on them every ``num_steps // 50``
steps (``bnn_pyro/infer/holdout.py``'s ``BestOnHoldout``, ``patience=None``: the best score of the run) and
refit on all rows to the chosen step (the median over members of ``best_step + 1``). On 20-60 held-out rows
that choice may land far too early (issue 26 item 2). This script measures it without changing the library:
it replaces, for the length of a fit, the ``BestOnHoldout`` that ``bnn_pyro.infer.map_fit`` builds (the MAP
search of ensemble and laplace) by a recorder that keeps every check (step, held-out score, the per-row
held-out log-likelihoods, the state, the member's own test metric) and answers ``best_step`` / ``state`` by a
chosen rule. Everything after the choice is the library's own default pipeline (the noise chosen on the
held-out rows, the refit on all rows to the chosen step), so each rule's row is what that rule would give as
the default.

Rules (each applied per member, then the library's median over members):

* ``argmax``: the library's rule, the best held-out score of the run. Since 4f01664 the library's refit runs the
  schedule of the fit that chose, stopped at the chosen step (``holdout.Chosen.schedule``), so ``argmax`` is then
  the same fit as ``argmax_truncated``; the committed results before ``refit_default_*`` ran the older refit (a
  cosine over the chosen steps).
* ``one_se``: the latest check whose held-out score is within one standard error of the best, the standard
  error from the per-row held-out log-likelihood differences paired against the best check
  (``sd(l_best - l_t) / sqrt(n)``; the one-standard-error rule of Breiman et al. 1984 / Hastie et al. 2009,
  sec. 7.10, applied to the stopping time).
* ``floor20``: the best held-out score among checks at or after 20% of the budget.
* ``last``: the last check (the whole budget), the held-out rows used for the noise only.
* ``argmax_truncated``: today's rule, with the refit on the *same* learning-rate schedule as the fit that chose
  (cosine over the whole budget, stopped at the chosen step) instead of a cosine over the chosen steps: the state
  the held-out rows scored is then what the refit reproduces (on all rows). Ensemble only (laplace's MAP search
  takes no schedule).
* ``one_se_truncated``: the ``one_se`` choice with the ``argmax_truncated`` refit (the two proposals together).
* ``oracle``: the check with the member's best *test* metric (test NLL for classification, test RMSE for
  regression): what a perfect held-out set would choose (not a usable rule; the ceiling).
* ``end``: ``validation=None``, the whole budget on all rows (the rule "hold nothing out" below some N).

Data: two moons (``noise=0.2``, 200 / 400 / 1000 training rows, 500 test rows, a 2-32-32-2 tanh net), breast
cancer (benchmarks/classification.py's split and model: 455 training rows), diabetes and friedman1
(benchmarks/uci.py's split and model, standardized targets: 398 and 450 training rows; test LL and RMSE in
standardized units). Seeds 0..S-1 (the data split / the two-moons draw and the fit's seed). Engines at their
defaults otherwise (5 members, 1000 steps, cosine schedule); laplace only where it holds rows out by default
(a learned Gaussian noise: the regression sets).

Usage::

    python benchmarks/holdout_choice.py                                    # everything, 3 seeds
    python benchmarks/holdout_choice.py --datasets moons200 --seeds 1 --methods ensemble   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import pandas as pd
import pyro.distributions as dist
import torch
from pyro import poutine

import bnn_pyro as bp
import bnn_pyro.infer.map_fit as map_fit_module
from bnn_pyro import metrics
from bnn_pyro.infer.holdout import BestOnHoldout, heldout_score
from bnn_pyro.infer.optim import FINAL_LR_FRACTION

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
import classification  # noqa: E402
import uci  # noqa: E402
from _common import markdown, results_dir, write_result  # noqa: E402

RULES = ("argmax", "one_se", "floor20", "last", "oracle", "end")
EXTRA_RULES = ("argmax_truncated", "one_se_truncated")
BUDGET = 1000  # the engines' default num_steps
METHODS = ("ensemble", "laplace")
DATASETS = ("moons200", "moons400", "moons1000", "breast_cancer", "diabetes", "friedman1")


# ---------------------------------------------------------------------------------------------- data
def load(name: str, seed: int) -> dict:
    """Training and test tensors, the model builder and the task of data set ``name`` under ``seed``."""
    if name.startswith("moons"):
        n = int(name[len("moons") :])
        x, y = bp.datasets.two_moons(n=n, noise=0.2, seed=seed)
        xt, yt = bp.datasets.two_moons(n=500, noise=0.2, seed=1000 + seed)

        def model():
            torch.manual_seed(seed)
            net = torch.nn.Sequential(
                torch.nn.Linear(2, 32),
                torch.nn.Tanh(),
                torch.nn.Linear(32, 32),
                torch.nn.Tanh(),
                torch.nn.Linear(32, 2),
            )
            return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())

        return dict(x=x, y=y, xt=xt, yt=yt, model=model, task="classification")
    if name == "breast_cancer":
        x, y = classification.load_dataset(name)
        s = classification.make_split(x, y, seed)
        return dict(
            x=s["x_train"],
            y=s["y_train"],
            xt=s["x_test"],
            yt=s["y_test"],
            model=lambda: classification.make_model(x.shape[1], 2, seed),
            task="classification",
        )
    if name in ("diabetes", "friedman1"):
        split = uci.make_splits(dataset=name, n_splits=seed + 1)[seed]
        return dict(
            x=split.x_train,
            y=split.y_train,
            xt=split.x_test,
            yt=split.y_test,
            model=lambda: uci.make_model(split.x_train.shape[1], seed),
            task="regression",
        )
    raise SystemExit(f"--datasets: unknown data set {name!r}; choose from {', '.join(DATASETS)}.")


# ---------------------------------------------------------------------------------------------- recording
def observation(model, values: dict[str, torch.Tensor], x, y) -> dist.Distribution:
    """``p(y | x, values)`` of ``model`` with its latent sites fixed at ``values``."""
    with torch.no_grad():
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    return trace.nodes["obs"]["fn"]


def _base(fn):
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def per_row_heldout(model, values, holdout) -> torch.Tensor:
    """The per-row terms whose mean is ``heldout_score``: log p(y_n | x_n) for classification; for a Normal, the
    log-density with the scale multiplied by the common factor ``c`` profiled on the held-out rows (as the score)."""
    fn = observation(model, values, holdout.x, holdout.y)
    base = _base(fn)
    if isinstance(base, dist.Normal):
        z2 = ((holdout.y.reshape(base.loc.shape) - base.loc) / base.scale).double().pow(2)
        c2 = z2.mean()
        rows = -0.5 * math.log(2 * math.pi) - 0.5 * (torch.log(c2) + z2 / c2) - torch.log(base.scale.double())
        return rows.reshape(holdout.y.shape[0], -1).sum(-1)
    return fn.log_prob(holdout.y).double().reshape(holdout.y.shape[0], -1).sum(-1)


def member_test(model, values, x, y) -> float:
    """The member's own test metric (lower is better): NLL for a Categorical, RMSE for a Normal."""
    fn = observation(model, values, x, y)
    base = _base(fn)
    if isinstance(base, dist.Normal):
        return float((base.loc.reshape(y.shape) - y).double().pow(2).mean().sqrt())
    return float(-fn.log_prob(y).double().mean())


class Context:
    """What the recorder needs from the current fit: the rule and the test rows; and what it recorded."""

    rule = "argmax"
    xt = yt = None
    pending: tuple | None = None  # (per-row held-out terms, member test metric) of the last scored state
    recorders: list = []


def scoring(model, values, holdout) -> float:
    """``heldout_score`` as the library computes it, with the per-row terms and the member's test metric kept."""
    score = heldout_score(model, values, holdout)
    rows = per_row_heldout(model, values, holdout)
    assert abs(float(rows.mean()) - score) < 1e-4 * max(1.0, abs(score)), (float(rows.mean()), score)
    Context.pending = (rows, member_test(model, values, Context.xt, Context.yt))
    return score


class Recorder(BestOnHoldout):
    """Keeps every check; ``best_step`` and ``state`` are the check :func:`choose` picks under ``Context.rule``."""

    def __init__(self, every: int = 50, patience: int | None = None):
        self.every, self.patience = int(every), patience
        self.scores, self.rows, self.tests, self.states = [], [], [], []
        self.best_score = -math.inf
        Context.recorders.append(self)

    def record(self, step: int, score: float, state) -> bool:
        rows, test = Context.pending
        self.scores.append((step, score))
        self.rows.append(rows)
        self.tests.append(test)
        self.states.append(copy.deepcopy(state))
        self.best_score = max(self.best_score, score)
        return False

    @property
    def index(self) -> int:
        return choose(Context.rule, self)

    @property
    def best_step(self) -> int:
        return self.scores[self.index][0] if self.scores else -1

    @property
    def state(self):
        return self.states[self.index] if self.states else None


def choose(rule: str, rec: Recorder) -> int:
    """The index of the check ``rule`` picks from a member's recorded checks."""
    scores = torch.tensor([s for _, s in rec.scores], dtype=torch.float64)
    steps = [t for t, _ in rec.scores]
    best = int(scores.argmax())
    if rule in ("argmax", "argmax_truncated"):
        return best
    if rule in ("one_se", "one_se_truncated"):
        n = rec.rows[best].numel()
        for i in range(len(scores) - 1, -1, -1):
            diff = rec.rows[best] - rec.rows[i]
            se = float(diff.std()) / math.sqrt(n) if n > 1 else 0.0
            if scores[i] >= scores[best] - se:
                return i
    if rule == "floor20":
        budget = steps[-1] + 1
        late = [i for i, t in enumerate(steps) if t + 1 >= 0.2 * budget]
        return max(late, key=lambda i: float(scores[i]))
    if rule == "last":
        return len(steps) - 1
    if rule == "oracle":
        return min(range(len(rec.tests)), key=lambda i: rec.tests[i])
    raise ValueError(f"rule: unknown rule {rule!r}; choose from {', '.join(RULES)}.")


# ---------------------------------------------------------------------------------------------- one case
def evaluate(post, d: dict) -> dict:
    pred = post.predict(d["xt"])
    if d["task"] == "classification":
        return dict(accuracy=metrics.accuracy(pred, d["yt"]), nll=metrics.nll(pred, d["yt"]))
    return dict(test_ll=metrics.test_log_likelihood(post, d["xt"], d["yt"]), rmse=metrics.rmse(pred, d["yt"]))


def budget_cosine(opt):
    """The default cosine schedule over :data:`BUDGET` steps (``optim.make_schedule``'s), whatever ``num_steps``."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=BUDGET, eta_min=opt.defaults["lr"] * FINAL_LR_FRACTION)


def run_case(name: str, method: str, seed: int, rules=RULES) -> tuple[list[dict], list[dict]]:
    """One row per rule, and the recorded curves (one row per member and check) of the fit that chose."""
    d = load(name, seed)
    Context.xt, Context.yt = d["xt"], d["yt"]
    rows, curves = [], []
    base = dict(dataset=name, method=method, seed=seed, n_train=d["x"].shape[0])
    original = (map_fit_module.BestOnHoldout, map_fit_module.heldout_score)
    map_fit_module.BestOnHoldout, map_fit_module.heldout_score = Recorder, scoring
    try:
        for rule in rules:
            Context.rule, Context.recorders = rule, []
            options = dict(validation=None) if rule == "end" else {}
            if rule.endswith("_truncated"):
                options = dict(lr_schedule=budget_cosine)
            start = time.perf_counter()
            post = bp.fit(d["model"](), d["x"], d["y"], method=method, seed=seed, progress=False, **options)
            seconds = time.perf_counter() - start
            val = post.config.get("validation") or {}
            members = [r for r in Context.recorders if r.scores]
            rows.append(
                dict(
                    base,
                    rule=rule,
                    heldout_rows=val.get("rows", 0),
                    chosen_steps=val.get("chosen", {}).get("num_steps", post.config.get("num_steps")),
                    member_steps=" ".join(str(r.best_step + 1) for r in members),
                    fit_s=round(seconds, 1),
                    **evaluate(post, d),
                )
            )
            if rule == rules[0]:
                for k, r in enumerate(members):
                    for (step, score), test in zip(r.scores, r.tests):
                        curves.append(dict(base, member=k, step=step + 1, heldout=score, member_test=test))
    finally:
        map_fit_module.BestOnHoldout, map_fit_module.heldout_score = original
    return rows, curves


# ---------------------------------------------------------------------------------------------- tables
def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per data set, method and rule: the chosen steps and each test metric, mean over seeds, and the mean
    difference from today's rule (argmax) on the same seed."""
    metric_cols = [c for c in ("accuracy", "nll", "test_ll", "rmse") if c in rows]
    out = []
    for (name, method), group in rows.groupby(["dataset", "method"], sort=False):
        today = group[group.rule == "argmax"].set_index("seed")
        for rule, g in group.groupby("rule", sort=False):
            g = g.set_index("seed")
            row = dict(dataset=name, method=method, rule=rule, n_train=int(g.n_train.iloc[0]))
            row["chosen steps"] = " / ".join(str(int(s)) for s in g.chosen_steps)
            for c in metric_cols:
                if g[c].notna().any():
                    row[c] = g[c].mean()
                    row[f"{c} - argmax"] = (g[c] - today[c]).mean()
            out.append(row)
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--methods", default="ensemble,laplace")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rules", default=",".join(RULES), help=f"comma list of {', '.join(RULES + EXTRA_RULES)}")
    parser.add_argument("--name", default="holdout_choice", help="the result files' stem")
    parser.add_argument("--out", default=None, help="folder (default benchmarks/results/holdout_choice/)")
    args = parser.parse_args(argv)
    out = results_dir("holdout_choice", args.out)
    rows, curves = [], []
    for name in args.datasets.split(","):
        for method in args.methods.split(","):
            if method == "laplace" and load(name, 0)["task"] == "classification":
                continue  # laplace holds nothing out without a learned Gaussian noise
            for seed in range(args.seeds):
                r, c = run_case(name, method, seed, args.rules.split(","))
                rows += r
                curves += c
                print(pd.DataFrame(r).drop(columns=["member_steps"]).to_string(index=False), flush=True)
                pd.DataFrame(rows).to_csv(out / f"{args.name}_runs.csv", index=False)
                pd.DataFrame(curves).to_csv(out / f"{args.name}_curves.csv", index=False)
    table = summary(pd.DataFrame(rows))
    text = (
        f"# Held-out stopping rules ({args.name})\n\n"
        "Per data set, engine and rule: the steps chosen (per seed), the test metric (mean over seeds) and its "
        "mean paired difference from today's rule (`argmax`). Runs: "
        f"[{args.name}_runs.csv]({args.name}_runs.csv); curves of the fit that chose (per member and check: "
        f"held-out score, the member's test NLL or RMSE): [{args.name}_curves.csv]({args.name}_curves.csv).\n\n"
        + markdown(table.round(4))
        + "\n"
    )
    write_result(out / f"{args.name}.md", text)
    print(table.to_string(index=False))
    return table


if __name__ == "__main__":
    main()
