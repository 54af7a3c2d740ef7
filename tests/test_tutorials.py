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
    assert finite(pred.probs) and torch.allclose(pred.probs.sum(-1), torch.ones(len(pred.probs), dtype=pred.probs.dtype))
    assert (ns["pred_map"].mutual_information.abs() < 1e-6).all()  # one network: no disagreement
    assert ns["metrics"].accuracy(pred, ns["y_te"]) > 0.7
    auroc = ns["auroc"]
    assert auroc.shape == (2, 3) and ((auroc >= 0) & (auroc <= 1)).all().all()


def test_05_methods_compared(monkeypatch):
    ns = run_notebook("05_methods_compared.ipynb", monkeypatch)
    reg, cls = ns["regression_table"], ns["digits_table"]
    import bnn_pyro as bp

    assert set(reg.index) == {m.value for m in bp.infer.Method} - {"hmc", "metropolis"}
    assert set(cls.index) == set(reg.index) - {"nuts"}
    assert reg.drop(columns="gap / data").notna().all().all() and cls.notna().all().all()
    assert ((reg["coverage_95"] >= 0) & (reg["coverage_95"] <= 1)).all()
    assert all(ns["reg_posts"][m].method == m for m in reg.index)


def test_06_calibration_checks(monkeypatch):
    ns = run_notebook("06_calibration_checks.ipynb", monkeypatch)
    checks = ns["checks"]
    assert set(checks) == {"mean_field", "full_rank"}
    assert all(math.isfinite(c.k_hat) and 0 < c.ess <= c.num_draws for c in checks.values())
    assert finite(ns["reweighted"].mean) and ns["reweighted"].mean.shape == (5,)
    ranks = ns["result"].ranks
    assert ranks.shape == (1, 20) and int(ranks.min()) >= 0 and int(ranks.max()) <= 9


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
