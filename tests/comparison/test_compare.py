"""``bp.compare``: its numbers are the posteriors' own (test LL against a hand-written mixture density), a failing
method becomes an error row, a resumed run equals an uninterrupted one, classification and OOD columns, the
methods that apply come from the registry's declarations, and bad arguments get clear errors."""

from __future__ import annotations

import math

import pandas as pd
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
import bnn_pyro.comparison as comparison
from bnn_pyro.infer import REGISTRY, Method, unfit_reason

TINY = {
    "svi": dict(num_steps=40, num_samples=30),
    "laplace": dict(num_steps=40, num_samples=30),
    "ensemble": dict(num_chains=2, num_steps=40),
    "nuts": dict(num_samples=8, num_warmup=8, max_tree_depth=3),
    "swag": dict(pretrain_steps=20, num_steps=20, collect_every=2, swag_rank=3, num_samples=30, num_chains=2),
}


def _regression(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    return x, torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)


@pytest.fixture
def reg_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(0.5)))


@pytest.fixture
def clf_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


def _hand_lpd(post: bp.Posterior, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log (1/S) sum_s N(y | f_s(x), sigma_s^2), written out from the posterior's draws."""
    f = post.network_outputs(x)[..., 0].double()  # (S, N)
    sigma = post.samples["sigma"].reshape(-1).double()  # (S,)
    log_p = -0.5 * ((y.double() - f) / sigma[:, None]) ** 2 - sigma[:, None].log() - 0.5 * math.log(2 * math.pi)
    return torch.logsumexp(log_p, 0) - math.log(log_p.shape[0])


def test_test_ll_is_the_hand_written_log_predictive_density_of_each_posterior(reg_model):
    x, y = _regression()
    x_test, y_test = _regression(30, seed=1)
    result = bp.compare(
        reg_model,
        x,
        y,
        test=(x_test, y_test),
        methods=["svi", "laplace", "ensemble", "nuts"],
        options={m: TINY[m] for m in ("svi", "laplace", "ensemble", "nuts")},
        progress=False,
    )
    assert list(result.table.index) == ["svi", "laplace", "ensemble", "nuts"]
    assert (result.table["error"] == "").all(), result.table["error"]
    for method, post in result.posteriors.items():
        lpd = _hand_lpd(post, x_test, y_test)
        row = result.table.loc[method]
        assert row["test_ll"] == pytest.approx(float(lpd.mean()), abs=1e-5), method
        assert row["test_ll_se"] == pytest.approx(float(lpd.std() / math.sqrt(len(lpd))), rel=1e-4), method
        pred = post.predict(x_test, seed=0)
        assert row["rmse"] == pytest.approx(float((pred.mean - y_test).pow(2).mean().sqrt()), rel=1e-5)
        assert row["fit_s"] > 0
    # diagnostics where defined: NUTS has divergence counts and no k-hat; SVI and Laplace a k-hat; one chain: no R-hat
    assert result.table.loc["nuts", "divergences"] >= 0 and math.isnan(result.table.loc["nuts", "k_hat"])
    assert not math.isnan(result.table.loc["svi", "k_hat"]) and math.isnan(result.table.loc["svi", "divergences"])
    assert math.isnan(result.table.loc["svi", "r_hat_max"]) and result.table.loc["svi", "ess_bulk_min"] > 0
    assert "max_tree_depth" in result.table.loc["nuts", "warnings"]  # the health warning of its tiny fit, as text


def test_coverage_and_width_are_those_of_the_exact_mixture_interval(reg_model):
    x, y = _regression()
    x_test, y_test = _regression(30, seed=1)
    result = bp.compare(
        reg_model, x, y, test=(x_test, y_test), methods=["swag"], options={"swag": TINY["swag"]}, progress=False
    )
    post, row = result.posteriors["swag"], result.table.loc["swag"]
    lower, upper = bp.metrics.predictive_interval(post, x_test)
    f = post.network_outputs(x_test)[..., 0].double()
    sigma = post.samples["sigma"].reshape(-1, 1).double()
    for bound, q in ((lower, 0.025), (upper, 0.975)):  # the mixture's CDF at the bounds, by hand
        assert torch.distributions.Normal(f, sigma).cdf(bound).mean(0) == pytest.approx(torch.full((30,), q), abs=1e-6)
    assert row["width_95"] == pytest.approx(float((upper - lower).mean()), rel=1e-6)
    assert row["coverage_95"] == pytest.approx(float(((lower <= y_test) & (y_test <= upper)).double().mean()))


def test_predictive_interval_of_one_gaussian_is_mean_plus_minus_1_96_sd(reg_model):
    x, y = _regression()
    post = bp.fit(reg_model, x, y, method="svi", guide="map", num_steps=30, num_samples=1, progress=False)
    lower, upper = bp.metrics.predictive_interval(post, x[:5])
    f = post.network_outputs(x[:5])[0, :, 0].double()
    sigma = float(post.samples["sigma"].reshape(-1)[0])
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.975, dtype=torch.float64)))
    assert lower == pytest.approx(f - z * sigma, abs=1e-5) and upper == pytest.approx(f + z * sigma, abs=1e-5)


def test_a_failing_method_becomes_an_error_row_and_the_table_is_kept(reg_model, tmp_path, capsys):
    x, y = _regression()
    x_test, y_test = _regression(30, seed=1)
    result = bp.compare(
        reg_model,
        x,
        y,
        test=(x_test, y_test),
        methods=["svi", "laplace"],
        options={"svi": {**TINY["svi"], "guide": "no_such_guide"}, "laplace": TINY["laplace"]},
    )
    assert "compare: laplace" in capsys.readouterr().err  # the default progress bar, over the methods
    assert result.table.loc["svi", "error"].startswith("ValueError: ") and "guide" in result.table.loc["svi", "error"]
    assert math.isnan(result.table.loc["svi", "test_ll"]) and "svi" not in result.posteriors
    assert result.table.loc["laplace", "error"] == "" and math.isfinite(result.table.loc["laplace", "test_ll"])
    paths = result.save(tmp_path / "out")
    assert {p.name for p in paths} >= {"table.csv", "table.md", "test_ll.png", "predictive.png"}
    saved = pd.read_csv(tmp_path / "out" / "table.csv", index_col="method", keep_default_na=False)
    assert saved.loc["svi", "error"] == result.table.loc["svi", "error"]
    assert "| svi |" in (tmp_path / "out" / "table.md").read_text()


def test_a_resumed_run_equals_an_uninterrupted_one(reg_model, tmp_path, monkeypatch):
    x, y = _regression(45)
    methods, options = ["svi", "laplace"], {m: TINY[m] for m in ("svi", "laplace")}
    whole = bp.compare(reg_model, x, y, splits=3, methods=methods, options=options, progress=False)
    assert list(whole.rows["split"]) == [0, 0, 1, 1, 2, 2] and (whole.table["splits_ok"] == 3).all()
    fit, calls = comparison.fit, []

    def interrupted(*args, **kwargs):  # Ctrl-C during the fourth fit
        calls.append(kwargs["method"])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return fit(*args, **kwargs)

    monkeypatch.setattr(comparison, "fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bp.compare(reg_model, x, y, splits=3, methods=methods, options=options, progress=False, cache=tmp_path)
    calls.clear()
    resumed = bp.compare(reg_model, x, y, splits=3, methods=methods, options=options, progress=False, cache=tmp_path)
    assert calls == ["laplace", "svi", "laplace"]  # only what the interrupted run had not finished
    columns = [c for c in whole.table.columns if not c.startswith(("fit_s", "score_s"))]  # wall times differ
    pd.testing.assert_frame_equal(resumed.table[columns], whole.table[columns], rtol=1e-6)
    for method in methods:  # the first split's posteriors come back from the cache
        assert torch.allclose(
            resumed.posteriors[method].predict(x, seed=0).mean, whole.posteriors[method].predict(x, seed=0).mean
        )
    calls.clear()
    changed = bp.compare(
        reg_model,
        x,
        y,
        splits=3,
        methods=["svi"],
        options={"svi": {**TINY["svi"], "lr": 0.02}},
        progress=False,
        cache=tmp_path,
    )
    assert calls == ["svi"] * 3 and changed.table.loc["svi", "test_ll"] != whole.table.loc["svi", "test_ll"]


def test_a_fit_past_the_time_limit_is_an_error_row_that_a_rerun_tries_again(reg_model, tmp_path):
    x, y = _regression()
    options = {"svi": {"num_steps": 10**7}, "laplace": TINY["laplace"]}
    # a first laplace fit outside the limit: it imports what torch loads lazily (seconds on a loaded machine), so
    # that the alarm cannot land inside an import (which would leave that module half-initialized)
    bp.fit(reg_model, x, y, method="laplace", progress=False, **TINY["laplace"])
    first = bp.compare(
        reg_model,
        x,
        y,
        test=(x, y),
        methods=["laplace", "svi"],
        options=options,
        progress=False,
        time_limit=5,
        cache=tmp_path,
    )
    assert first.table.loc["svi", "error"] == "FitTimeout: stopped after 5 s of wall time (the time limit)"
    assert first.table.loc["laplace", "error"] == "" and sorted(p.name for p in tmp_path.glob("*.json")) == [
        "laplace__split0.json"
    ]  # the error row is not cached: a rerun (with a longer limit) tries it again
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_classification_columns_and_ood_auroc(clf_model):
    x, y = bp.datasets.two_moons(n=60, seed=0)
    x_test, y_test = bp.datasets.two_moons(n=40, seed=1)
    far = torch.randn(25, 2, generator=torch.Generator().manual_seed(2)) * 0.5 + torch.tensor([8.0, 8.0])
    result = bp.compare(
        clf_model,
        x,
        y,
        test=(x_test, y_test),
        methods=["svi", "ensemble"],
        ood=far,
        options={m: TINY[m] for m in ("svi", "ensemble")},
        progress=False,
    )
    assert result.task == "classification"
    assert {"accuracy", "nll", "ece", "brier", "ood_auroc"} <= set(result.table.columns)
    assert "rmse" not in result.table.columns
    for method, post in result.posteriors.items():
        row, pred = result.table.loc[method], post.predict(x_test, seed=0)
        probs = pred.probs.double()
        assert row["accuracy"] == pytest.approx(float((probs.argmax(1) == y_test).double().mean()))
        assert row["nll"] == pytest.approx(float(-probs[torch.arange(40), y_test].log().mean()), rel=1e-5)
        assert row["test_ll"] == pytest.approx(-row["nll"], rel=1e-4)
        onehot = torch.nn.functional.one_hot(y_test, 2).double()
        assert row["brier"] == pytest.approx(float(((probs - onehot) ** 2).sum(1).mean()), rel=1e-6)
        entropy_in, entropy_out = pred.entropy.double(), post.predict(far, seed=0).entropy.double()
        wins = (entropy_out[:, None] > entropy_in[None]).double() + 0.5 * (
            entropy_out[:, None] == entropy_in[None]
        ).double()
        assert row["ood_auroc"] == pytest.approx(float(wins.mean()))
    assert set(result.plot()) == {"test_ll", "reliability"}


def test_methods_that_apply_come_from_the_declarations(reg_model):
    x, _ = _regression()
    assert all(unfit_reason(m, reg_model, x) is None for m in Method)  # a BNN MLP: every method

    def function_model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(w * x[:, 0], 0.1), obs=y)

    import pyro

    skipped = {m for m in Method if unfit_reason(m, function_model, x) is not None}
    assert skipped == {m for m in Method if REGISTRY[m].capabilities.layers or REGISTRY[m].capabilities.weight_sites}
    assert skipped == {Method.MC_DROPOUT, Method.VARIATIONAL_DROPOUT, Method.SPARSE_VD, Method.SUBSPACE}
    with pytest.raises(TypeError, match="method='subspace' needs a bnn_pyro.BNN"):  # what it said as an error row
        bp.fit(function_model, x, x[:, 0], method="subspace", progress=False)
    assert comparison._methods(function_model, None, x, None) == [m.value for m in Method if m not in skipped]


def test_bad_arguments_get_clear_errors(reg_model):
    x, y = _regression()
    with pytest.raises(ValueError, match="test=.*or splits=, not both"):
        bp.compare(reg_model, x, y, test=(x, y), splits=2, methods=["svi"])
    with pytest.raises(ValueError, match="options: settings for \\['nuts'\\]"):
        bp.compare(reg_model, x, y, test=(x, y), methods=["svi"], options={"nuts": {}})
    with pytest.raises(ValueError, match=r"methods: expected distinct method names, got \['svi', 'svi'\]"):
        bp.compare(reg_model, x, y, test=(x, y), methods=["svi", "svi"])
    with pytest.raises(ValueError, match="no_such"):
        bp.compare(reg_model, x, y, test=(x, y), methods=["no_such"])
    with pytest.raises(ValueError, match="k: expected an integer number of folds"):
        bp.compare(reg_model, x, y, splits=1, methods=["svi"])
    with pytest.raises(ValueError, match="leave x and y out"):
        bp.compare(reg_model, x, y, splits=[(x, y, x, y)], methods=["svi"])
    with pytest.warns(UserWarning, match="in-sample"):
        result = bp.compare(reg_model, x, y, methods=["svi"], options={"svi": TINY["svi"]}, progress=False)
    assert result.table.loc["svi", "error"] == ""


def test_k_fold_tests_every_row_once():
    x = torch.arange(23.0)[:, None]
    folds = bp.splits.k_fold(x, x[:, 0], 4, seed=3)
    tested = torch.cat([f[2][:, 0] for f in folds])
    assert sorted(tested.tolist()) == list(range(23)) and [len(f[2]) for f in folds] == [6, 6, 6, 5]
    for x_train, _, x_test, _ in folds:
        assert len(set(x_train[:, 0].tolist()) & set(x_test[:, 0].tolist())) == 0 and len(x_train) + len(x_test) == 23


def _two_feature_model() -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def test_pandas_data_compare_as_their_arrays_with_test_columns_matched_by_name():
    """DataFrames raised "could not determine the shape of object type 'DataFrame'" (the cache's fingerprint);
    now each split is converted, the test and OOD frames' columns matched to the training frame's by name, so a
    test frame with its columns in another order scores as the arrays do."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=g)
    y = x[:, 0] - x[:, 1] + 0.1 * torch.randn(40, generator=g)
    frame = lambda t: pd.DataFrame(t.numpy(), columns=["a", "b"])  # noqa: E731
    settings = dict(methods=["svi"], options={"svi": TINY["svi"]}, progress=False)
    arrays = bp.compare(_two_feature_model(), x[:30], y[:30], test=(x[30:], y[30:]), ood=5 * x[30:], **settings)
    frames = bp.compare(
        _two_feature_model(),
        frame(x[:30]),
        pd.Series(y[:30].numpy()),
        test=(frame(x[30:])[["b", "a"]].set_axis(range(30, 40)), pd.Series(y[30:].numpy(), index=range(30, 40))),
        ood=frame(5 * x[30:])[["b", "a"]],
        **settings,
    )
    columns = ["test_ll", "rmse", "coverage_95", "ood_auroc"]
    assert frames.table["error"].eq("").all() and arrays.table["error"].eq("").all()
    pd.testing.assert_frame_equal(frames.table[columns], arrays.table[columns])


@pytest.mark.parametrize(
    "test, message",
    [
        (
            (torch.randn(10, 1), torch.randn(10)),
            r"^test: the test rows: x has shape \(10, 1\), which the net cannot take",
        ),
        ((torch.randn(10, 2), torch.randn(7)), r"^test: the test rows: x and y have different numbers of rows"),
    ],
    ids=["columns", "rows"],
)
def test_a_bad_test_set_is_refused_before_any_fit(monkeypatch, test, message):
    """It was found by scoring, once per method and after each fit: a table of error rows."""
    monkeypatch.setattr(comparison, "_run", lambda *a, **k: pytest.fail("a method was fitted"))
    x = torch.randn(20, 2)
    with pytest.raises(ValueError, match=message):
        bp.compare(_two_feature_model(), x, x.sum(1), test=test, methods=["svi", "nuts"], progress=False)


def test_a_row_cached_by_other_code_is_fitted_again(reg_model, tmp_path, monkeypatch):
    """The cache's key held the arguments only: a row made before a default changed was reused silently."""
    import bnn_pyro.comparison.cache as cache

    x, y = _regression(30)
    run = dict(test=(x, y), methods=["svi"], options={"svi": TINY["svi"]}, progress=False, cache=tmp_path)
    fit, calls = comparison.fit, []
    monkeypatch.setattr(comparison, "fit", lambda *a, **k: calls.append(k["method"]) or fit(*a, **k))
    bp.compare(reg_model, x, y, **run)
    bp.compare(reg_model, x, y, **run)
    assert calls == ["svi"]  # the same code: the row is reused
    monkeypatch.setattr(cache, "code_identity", lambda: "another bnn_pyro source digest")
    bp.compare(reg_model, x, y, **run)
    assert calls == ["svi", "svi"]


def test_the_code_identity_changes_with_any_source_file_and_library_version(tmp_path, monkeypatch):
    import bnn_pyro.comparison.cache as cache

    (tmp_path / "infer").mkdir()
    (tmp_path / "infer" / "svi.py").write_text("LR = 0.01\n")
    (tmp_path / "data.csv").write_text("1,2\n")
    monkeypatch.setattr(cache, "PACKAGE", tmp_path)
    digest = cache.code_identity.__wrapped__  # the uncached function: the cached one holds the real package's
    first = digest()
    assert digest() == first and len(first) == 64
    (tmp_path / "data.csv").write_text("3,4\n")  # not source: the data a fit reads are fingerprinted themselves
    assert digest() == first
    (tmp_path / "infer" / "svi.py").write_text("LR = 0.02\n")  # a default changed
    assert digest() != first
    second = digest()
    version = cache.metadata.version
    monkeypatch.setattr(cache.metadata, "version", lambda name: "9.9" if name == "pyro-ppl" else version(name))
    assert digest() != second
    assert cache.code_identity() == cache.code_identity()  # once per process


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_the_result_keeps_its_own_copy_of_the_split_it_plots(reg_model, kind):
    x, y = _regression()
    x_test, y_test = _regression(30, seed=1)
    if kind == "numpy":
        x, y, x_test, y_test = (t.numpy() for t in (x, y, x_test, y_test))
    result = bp.compare(
        reg_model, x, y, test=(x_test, y_test), methods=["swag"], options={"swag": TINY["swag"]}, progress=False
    )
    before = [torch.as_tensor(t).clone() for t in result.test]
    for t in (x, y, x_test, y_test):
        t[:] = 0  # the user's arrays edited in place after the comparison
    assert all(torch.equal(torch.as_tensor(a), b) for a, b in zip(result.test, before))
