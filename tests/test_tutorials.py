"""The tutorials run top to bottom in fast mode (``BNN_PYRO_FAST=1``) against the installed package.

Each notebook's code cells are executed in one namespace in this process (no Jupyter kernel, so a
stale kernelspec on the machine cannot make the test pass or fail), with matplotlib's Agg backend.
Each test then checks something real in the namespace the notebook leaves behind. The outputs stored
in the notebooks are checked too (without running anything): one full-mode run, top to bottom, with
no path of the machine that made them.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"


def run_notebook(name: str, monkeypatch) -> dict:
    path = TUTORIALS / name
    if not path.exists():
        pytest.skip(f"{path} not found: the tutorials are in the source tree, not in the installed package")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("BNN_PYRO_FAST", "1")
    notebook = json.loads(path.read_text(encoding="utf-8"))
    assert notebook["nbformat"] == 4
    namespace: dict = {"__name__": "__tutorial__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence warnings are expected from fast-mode runs
        for number, cell in enumerate(notebook["cells"]):
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            try:
                exec(compile(source, f"{name}[cell {number}]", "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"{name}, code cell {number} failed: {err!r}\n--- cell ---\n{source}") from err
    plt.close("all")
    assert namespace["FAST"] is True
    return namespace


# an absolute path of the machine that ran the notebook: a home or work folder, a virtual
# environment's site-packages, a Windows drive
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:home|Users|root|work|tmp|opt|usr)/|site-packages|\b[A-Za-z]:\\")


def stored_text(cell: dict) -> str:
    """The text a code cell's stored outputs show (streams, plain text, HTML, tracebacks; no images)."""
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        parts.extend("".join(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
        parts.extend(output.get("traceback", []))
    return "".join(parts)


@pytest.mark.parametrize("path", sorted(TUTORIALS.glob("*.ipynb")), ids=lambda p: p.name)
def test_stored_outputs_are_one_full_mode_run_without_machine_paths(path):
    code = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not one run top to bottom: {counts}"
    assert stored_text(code[0]).strip() == "full mode", f"{path.name}: the first cell's stored output"
    for number, cell in enumerate(code):
        found = MACHINE_PATH.search(stored_text(cell))
        assert found is None, f"{path.name}, code cell {number}: stored output shows a machine path ({found.group()!r})"


def finite(t) -> bool:
    return bool(torch.isfinite(torch.as_tensor(t)).all())


def test_01_first_bnn(monkeypatch):
    ns = run_notebook("01_first_bnn.ipynb", monkeypatch)
    for name in ("vi", "mc"):
        post = ns[name]
        pred = post.predict(ns["grid"], seed=0)
        assert finite(pred.mean) and finite(pred.std) and (pred.epistemic_std > 0).all(), name
    assert ns["vi"].method == "svi" and ns["mc"].method == "nuts" and ns["mc"].num_chains == 2


def test_02_custom_priors(monkeypatch):
    ns = run_notebook("02_custom_priors.ipynb", monkeypatch)
    draws = ns["prior_draws"]
    assert len(draws) == 6
    for name, f in draws.items():
        assert f.shape == (ns["num_draws"], ns["grid"].shape[0]) and finite(f), name
        assert f.std(0).mean() > 0, name  # the functions differ: they are draws, not one net
    assert ns["hier"].hyper_names and set(ns["hier"].hyper_names) <= set(ns["post"].samples)
    assert ns["horseshoe"].hyper_names and ns["student"].point_names  # biases kept deterministic
    assert finite(ns["post"].predict(ns["grid"], seed=0).mean)


def test_03_diagnostics(monkeypatch):
    ns = run_notebook("03_diagnostics.ipynb", monkeypatch)
    comparison = ns["comparison"]
    assert len(comparison) == 2 and set(comparison.index) == {"Normal(0, 1)", "Normal(0, 0.1)"}
    assert all(math.isfinite(v) for v in comparison["elpd_loo"])
    assert len(ns["function"]) == 20 and len(ns["weights"]) == 31  # 1-10-1 net: 10 + 10 + 10 + 1 weights
    assert ns["mc"].sample_stats["diverging"].shape == (2, ns["nuts"]["num_samples"])


def test_04_classification(monkeypatch):
    ns = run_notebook("04_classification.ipynb", monkeypatch)
    pred = ns["pred"]
    assert finite(pred.probs) and torch.allclose(
        pred.probs.sum(-1), torch.ones(len(pred.probs), dtype=pred.probs.dtype)
    )
    assert (ns["pred_map"].mutual_information.abs() < 1e-6).all()  # one network: no disagreement
    assert ns["metrics"].accuracy(pred, ns["y_te"]) > 0.7
    auroc = ns["auroc"]
    assert auroc.shape == (2, 3) and ((auroc >= 0) & (auroc <= 1)).all().all()


def test_05_methods_compared(monkeypatch):
    ns = run_notebook("05_methods_compared.ipynb", monkeypatch)
    reg, cls = ns["regression_table"], ns["digits_table"]
    import bnn_pyro as bp

    assert list(reg.index) == [m.value for m in bp.infer.Method]  # methods=None: every method applies to this BNN
    assert set(cls.index) == set(reg.index) - {"nuts", "hmc", "metropolis", "mala"}
    for table in (reg, cls):
        assert (table["error"] == "").all(), table["error"]
        assert table["test_ll"].notna().all() and (table["fit_s"] > 0).all()
    assert ((reg["coverage_95"] >= 0) & (reg["coverage_95"] <= 1)).all()
    assert cls["ood_auroc"].between(0, 1).all() and cls["accuracy"].between(0, 1).all()
    assert all(ns["regression"].posteriors[m].method == m for m in reg.index)
    assert set(ns["gap_table"].index) == set(reg.index)


def test_06_calibration_checks(monkeypatch):
    ns = run_notebook("06_calibration_checks.ipynb", monkeypatch)
    checks = ns["checks"]
    assert set(checks) == {"mean_field", "full_rank"}
    assert all(math.isfinite(c.k_hat) and 0 < c.ess <= c.num_draws for c in checks.values())
    assert finite(ns["reweighted"].mean) and ns["reweighted"].mean.shape == (5,)
    ranks = ns["result"].ranks
    assert ranks.shape == (1, 20) and int(ranks.min()) >= 0 and int(ranks.max()) <= 9


def test_10_compression(monkeypatch):
    ns = run_notebook("10_compression.ipynb", monkeypatch)
    table = ns["random_labels"]
    assert list(table.index) == ["real", "shuffled"] and table["pruned"].between(0, 1).all()
    assert (table["kept"] <= table["of"]).all()
    report, post, small = ns["report"], ns["post"], ns["small"]
    assert list(report.index) == ["0.weight", "2.weight", "all"]
    for name in ("0.weight", "2.weight"):
        draws = post.samples[name][0]
        kept = (draws != 0).any(0)
        assert 1 <= report.loc[name, "bits"] < 32
        error = (small.samples[name][0, 0] - draws.mean(0))[kept].abs()
        assert (error <= report.loc[name, "step"] / 2 * (1 + 1e-5)).all()  # the rule: within half a grid step
    assert ns["before_after"].between(0, 1).all() and len(ns["before_after"]) == 2


def test_11_mode_connectivity(monkeypatch):
    ns = run_notebook("11_mode_connectivity.ipynb", monkeypatch)
    train, test = ns["train"], ns["test"]
    assert (
        set(train) == {"line", "Bezier", "polyline"} and ns["bezier"].kind == "bezier" and ns["poly"].kind == "polyline"
    )
    for name in train:  # every path has the same two ends, scored at the same 21 points
        assert train[name].t.shape == (21,) and finite(train[name].loss) and finite(test[name].accuracy)
        assert torch.allclose(train[name].loss[[0, -1]], train["line"].loss[[0, -1]], rtol=1e-5)
        if name != "line":  # a trained curve lowers the average loss it was trained on below the straight segment's
            assert train[name].loss.mean() < train["line"].loss.mean(), name
    post = ns["on_curve"]
    assert post.method == "curve" and (post.num_chains, post.num_draws) == (10, 1)
    assert (
        list(ns["summary"].columns) == ["test accuracy", "test NLL", "test ECE"] and ns["summary"].notna().all().all()
    )


def test_07_active_learning(monkeypatch):
    ns = run_notebook("07_active_learning.ipynb", monkeypatch)
    from bnn_pyro import acquisition

    engines, strategies, seeds = list(ns["ENGINES"]), ns["STRATEGIES"], ns["SEEDS"]
    rounds, k, initial = ns["ROUNDS"], ns["K"], ns["INITIAL"]
    assert len(engines) >= 2 and {"bald", "random"} <= set(strategies)
    assert list(ns["labels_acquired"]) == [initial + k * r for r in range(rounds + 1)]
    curves = ns["curves"]
    assert set(curves) == {(m, s) for m in engines for s in strategies}
    for acc in curves.values():
        assert acc.shape == (len(seeds), rounds + 1) and ((acc >= 0) & (acc <= 1)).all()
    for m in engines:  # round 0 is the same first fit for every strategy
        assert len({tuple(curves[m, s][:, 0]) for s in strategies}) == 1
    n_pool = len(ns["y_pool"])
    for (_m, _s, seed), batches in ns["acquired"].items():
        assert len(batches) == rounds and all(b.shape == (k,) for b in batches)
        chosen = torch.cat([ns["initial_set"](seed), *batches])
        assert (
            len(set(chosen.tolist())) == initial + k * rounds and 0 <= int(chosen.min()) and int(chosen.max()) < n_pool
        )
    # BALD's first batch is what acquire() picks from the first posterior over the unlabelled pool
    m, seed = engines[0], seeds[0]
    unlabelled = torch.ones(n_pool, dtype=torch.bool)
    unlabelled[ns["initial_set"](seed)] = False
    pool = unlabelled.nonzero().flatten()
    first = pool[
        acquisition.acquire(
            ns["first_posts"][m, seed], ns["x_pool"][pool], k, strategy="bald", num_samples=ns["DRAWS"], seed=seed
        )
    ]
    assert torch.equal(first, ns["acquired"][m, "bald", seed][0])
    assert not torch.equal(first, ns["acquired"][m, "random", seed][0])
    # the table's areas are the trapezoid means of the curves, in [0, 1]
    areas = ns["areas"]
    assert set(areas.index) == set(curves)
    for key, acc in curves.items():
        budget = ns["labels_acquired"][-1] - ns["labels_acquired"][0]
        expected = sum((acc[:, i] + acc[:, i + 1]) / 2 * k for i in range(rounds)) / budget
        assert math.isclose(areas.loc[key, "area"], float(expected.mean()), rel_tol=1e-9)
        assert 0 <= areas.loc[key, "area"] <= 1


def test_08_ood_and_rejection(monkeypatch):
    ns = run_notebook("08_ood_and_rejection.ipynb", monkeypatch)
    from bnn_pyro import selective

    engines, scores, ood = list(ns["ENGINES"]), ns["SCORES"], ns["ood"]
    assert len(engines) >= 3 and set(scores) == {"entropy", "mutual_information", "max_prob"}
    assert len(ood) == 3 and all(x.shape[1] == 64 for x in ood.values())
    assert int(ns["y_train"].max()) < ns["KNOWN"] and int(ns["y_test"].max()) < ns["KNOWN"]
    assert len(ood["held-out classes"]) == int((ns["y_all"] >= ns["KNOWN"]).sum())
    for table in (ns["auroc"], ns["aupr"], ns["fpr95"]):
        assert list(table.index) == engines and table.shape == (len(engines), len(ood) * len(scores))
        assert ((table >= 0) & (table <= 1)).all().all()
    # the table holds what ood_detection returns for the stored predictions
    p = ns["preds"]["laplace"]
    again = selective.ood_detection(p["in"], p["rotated"], score="mutual_information")
    assert math.isclose(ns["auroc"].loc["laplace", ("rotated", "mutual_information")], again["auroc"], rel_tol=1e-12)
    # FGSM: eps-sized moves inside the pixel bounds
    eps, x_test = 0.1, ns["x_test"]
    for name, x_adv in ns["x_adv"].items():
        assert x_adv.shape == x_test.shape and x_adv.min() >= 0 and x_adv.max() <= 1, name
        assert ((x_adv - x_test).abs() <= eps + 1e-6).all() and not torch.equal(x_adv, x_test), name
    adv = ns["adversarial_table"]
    assert list(adv.index) == engines and adv.notna().all().all()
    # rejection: the curve starts at the plain accuracy and its mean is the table's area
    table = ns["rejection_table"]
    for name in engines:
        for label in ns["REJECT_ON"]:
            for score in scores:
                fraction, acc = ns["curves"][name, label, score]
                assert fraction[0] == 0 and math.isclose(float(acc[0]), table.loc[name, (label, "accuracy")])
                assert math.isclose(float(acc.mean()), table.loc[name, (label, f"AUC {score}")], rel_tol=1e-12)
    # a point estimate's draws agree: its mutual information is exactly 0, so it cannot rank anything
    assert (ns["preds"]["map"]["in"].mutual_information == 0).all()
    assert ns["auroc"].loc["map", ("rotated", "mutual_information")] == 0.5


def test_09_bayesian_last_layer(monkeypatch):
    ns = run_notebook("09_bayesian_last_layer.ipynb", monkeypatch)
    table, posts = ns["table"], ns["posts"]
    assert list(table.index) == ["deterministic", "svi", "laplace", "nuts"]
    assert (table["accuracy"] > 0.9).all() and table.drop(columns=["ood_auroc_mi", "fit_seconds"]).notna().all().all()
    for method, post in posts.items():
        assert set(post.samples) == {"1.weight", "1.bias"} and post.method == method
        fitted = dict(post.model.net.named_buffers())
        assert all(torch.equal(fitted[n], v) for n, v in ns["frozen_before"].items()), method
    assert ns["model"].frozen_names and not ns["model"].point_names
