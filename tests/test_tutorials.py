"""The tutorials run top to bottom in fast mode (``BNN_PYRO_FAST=1``) against the installed package.

Each notebook's code cells are executed in one namespace in this process (no Jupyter kernel, so a
stale kernelspec on the machine cannot make the test pass or fail), with matplotlib's Agg backend.
Each test then checks something real in the namespace the notebook leaves behind.
"""

from __future__ import annotations

import json
import math
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
