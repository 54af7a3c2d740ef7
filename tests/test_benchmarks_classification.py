"""benchmarks/classification.py on iris with tiny budgets: the row's numbers are recomputed by hand here (the
script is loaded from its file: benchmarks/ is no package)."""

from __future__ import annotations

import math

import arviz as az
import pandas as pd
import pytest
import torch

from bnn_pyro import metrics
from bnn_pyro.posterior.diagnostics import function_draws


@pytest.fixture(scope="module")
def cls(load_benchmark):
    return load_benchmark("classification")  # it imports its sibling uci.py


def test_split_is_standardized_on_its_training_rows(cls):
    x, y = cls.load_dataset("iris")
    s = cls.make_split(x, y, 3)
    assert len(s["x_test"]) == 30 and len(s["x_train"]) == 120
    torch.testing.assert_close(s["x_train"].mean(0), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(s["x_train"].std(0), torch.ones(4), atol=1e-5, rtol=0)


def test_row_scores_recomputed_by_hand(cls):
    from sklearn.linear_model import LogisticRegression

    data = cls.load_dataset("iris")
    row = cls.run_one("logreg", data, 0)
    assert row["error"] == ""
    s = cls.make_split(*data, 0)
    clf = LogisticRegression(C=1.0, max_iter=5000).fit(s["x_train"].numpy(), s["y_train"].numpy())
    p = torch.tensor(clf.predict_proba(s["x_test"].numpy()), dtype=torch.float64)
    assert row["accuracy"] == pytest.approx(float((p.argmax(-1) == s["y_test"]).double().mean()))
    assert row["nll"] == pytest.approx(float(-p[torch.arange(len(p)), s["y_test"]].log().mean()), rel=1e-6)
    noise = cls.ood_inputs(s, 0, noise_rows=cls.NOISE_ROWS)["noise"]  # the default: 2,000 rows, not 30
    assert noise.shape == (2000, 4) and noise.std().item() == pytest.approx(3.0, rel=0.05)
    few = cls.ood_inputs(s, 0)["noise"]  # the scoring before --noise-rows: as many rows as test rows
    assert few.shape == (30, 4)

    def h(q):
        return -(q * q.log()).sum(-1)

    def proba(z):
        return torch.tensor(clf.predict_proba(z.numpy()), dtype=torch.float64)

    auc = metrics.ood_auroc(h(p), h(proba(noise)))
    assert row["auroc_noise_entropy"] == pytest.approx(auc)
    assert row["se_noise_entropy"] == pytest.approx(cls.auroc_se(auc, 2000, 30))
    assert row["sedraw_noise_entropy"] == pytest.approx(cls.auroc_se_draw(h(p), h(proba(noise))))
    assert row["auroc_noise_ntest_entropy"] == pytest.approx(metrics.ood_auroc(h(p), h(proba(few))))
    for col in ("auroc_noise_mi", "se_noise_mi", "sedraw_noise_mi", "auroc_noise_ntest_mi"):
        assert math.isnan(row[col])  # logistic regression has no mutual information
    keep = s["y_train"] < 2
    clf2 = LogisticRegression(C=1.0, max_iter=5000).fit(s["x_train"][keep].numpy(), s["y_train"][keep].numpy())
    held = s["y_test"] == 2
    q = torch.tensor(clf2.predict_proba(s["x_test"].numpy()), dtype=torch.float64)
    assert row["auroc_class_entropy"] == pytest.approx(metrics.ood_auroc(h(q[~held]), h(q[held])))


def test_an_engine_row_has_every_score(cls):
    row = cls.run_one("ensemble", cls.load_dataset("iris"), 1, {"num_chains": 2, "num_steps": 20})
    assert row["error"] == ""
    for m in cls.METRICS:
        assert 0.0 <= row[m] and math.isfinite(row[m]), m
    assert not set(cls.CHAIN_CHECKS) & set(row)  # one draw per member: no chain checks


def test_run_one_scores_the_fit_it_is_given(cls):
    data = cls.load_dataset("iris")
    calls = []

    def uniform(method, x, y, num_classes, split, options):
        calls.append((method, len(x), num_classes, split))
        return lambda xs: torch.full((len(xs), num_classes), 1.0 / num_classes, dtype=torch.float64)

    row = cls.run_one("mine", data, 0, held_out_class=False, fit=uniform)
    assert row["error"] == "" and calls == [("mine", 120, 3, 0)]
    assert row["nll"] == pytest.approx(math.log(3)) and row["auroc_noise_entropy"] == pytest.approx(0.5)


def test_chain_scores_of_an_mcmc_row_recomputed_per_chain(cls):
    data = cls.load_dataset("iris")
    options = {"num_chains": 3, "num_samples": 30, "num_warmup": 30, "max_tree_depth": 5, "chain_method": "sequential"}
    row = cls.run_one("nuts", data, 0, options, held_out_class=False, noise_rows=None)
    assert row["error"] == ""
    s = cls.make_split(*data, 0)
    post = cls._fit("nuts", s["x_train"], s["y_train"], 3, 0, options).posterior
    total = post.num_chains * post.num_draws
    per_chain = []
    for c in range(post.num_chains):  # chain c's own model average, through predict's draw weights
        w = torch.zeros(post.num_chains, post.num_draws)
        w[c] = 1.0
        probs = post.predict(s["x_test"], weights=w, num_samples=total, seed=0).probs
        per_chain.append(metrics.nll(probs, s["y_test"]))
    per_chain = torch.tensor(per_chain)
    assert row["nll_chain_se"] == pytest.approx(float(per_chain.std() / math.sqrt(3)), rel=1e-4)
    assert row["nll_chain_min"] == pytest.approx(float(per_chain.min()), rel=1e-4)
    assert row["nll_chain_max"] == pytest.approx(float(per_chain.max()), rel=1e-4)
    assert row["nll_chain_mean"] == pytest.approx(float(per_chain.mean()), rel=1e-4)
    assert row["nll_chain_min"] <= row["nll"] <= row["nll_chain_max"] + 0.05  # pooling averages the chains
    # nll_mc_bias, row by row: v_i / (2 p_i^2 n_i) for each test row's probability of its own label
    probs = torch.softmax(function_draws(post, s["x_test"]).double(), -1)  # (chains, draws, rows, classes)
    terms = []
    for i, label in enumerate(s["y_test"].tolist()):
        p_i = probs[:, :, i, label].numpy()
        terms.append(p_i.var(ddof=1) / (2 * p_i.mean() ** 2 * float(az.ess(p_i))))
    assert row["nll_mc_bias"] == pytest.approx(sum(terms) / len(terms), rel=1e-6)
    assert row["nll_mc_bias"] > 0.0
    for col in ("rhat_f_max", "rhat_f_test_max"):
        assert 1.0 <= row[col] < 10.0, col  # 3 chains of 30 draws: defined, not a tight check of mixing
    for col in ("ess_f_min", "ess_f_test_min"):
        assert 0.0 < row[col] <= 4 * total, col
    depth = post.config["max_tree_depth"]
    assert row["max_depth_frac"] == pytest.approx(float((post.sample_stats["tree_depth"] >= depth).double().mean()))
    assert row["n_steps_mean"] >= 1.0


def test_max_rows_takes_a_fixed_random_subset_of_distinct_rows(cls):
    x, y = cls.load_dataset("iris")
    xs, ys = cls.subset((x, y), 50)
    again, _ = cls.subset((x, y), 50)
    assert xs.shape == (50, 4) and torch.equal(xs, again)  # seed 0: the same rows every run
    rows = {tuple(r) for r in x.tolist()}
    assert all(tuple(r) in rows for r in xs.tolist()) and len(set(ys.tolist())) == 3  # real rows, every class
    assert not torch.equal(xs, x[:50])  # drawn at random, not the first rows (iris is sorted by class)
    assert cls.subset((x, y), None)[0] is x and cls.subset((x, y), 10_000)[0] is x


def test_no_class_skips_the_second_fit_and_first_split_offsets_the_splits(cls, tmp_path):
    data = cls.load_dataset("iris")
    row = cls.run_one("logreg", data, 0, held_out_class=False)
    assert row["error"] == "" and "auroc_class_entropy" not in row and math.isfinite(row["auroc_noise_entropy"])
    assert row["nll"] == pytest.approx(cls.run_one("logreg", data, 0)["nll"])
    out = cls.main(
        [
            "--dataset",
            "iris",
            "--methods",
            "logreg",
            "--first-split",
            "2",
            "--splits",
            "2",
            "--no-class",
            "--out",
            str(tmp_path),
        ]
    )
    rows = pd.read_csv(tmp_path / "iris_splits.csv")
    assert rows["split"].tolist() == [2, 3] and "auroc_class_entropy" not in rows
    assert out["iris"]["splits_ok"].tolist() == [2]


# ---------------------------------------------------------------------------------------- the noise AUROC's se
def test_auroc_se_is_the_mann_whitney_null_variance_at_one_half(cls):
    # at A = 1/2 (Q1 = Q2 = 1/3) Hanley-McNeil is exactly the Mann-Whitney null variance (n + m + 1) / (12 n m)
    for n_out, n_in in ((2000, 30), (30, 30), (5, 400)):
        exact = math.sqrt((n_out + n_in + 1) / (12 * n_out * n_in))
        assert cls.auroc_se(0.5, n_out, n_in) == pytest.approx(exact, rel=1e-12)
    assert cls.auroc_se(1.0, 2000, 30) == 0.0  # perfect separation: no spread
    with pytest.raises(ValueError, match="n_out, n_in"):
        cls.auroc_se(0.8, 0, 30)


def _batch_auroc(s_in: torch.Tensor, s_out: torch.Tensor) -> torch.Tensor:
    """AUROC per row of a batch of continuous scores (no ties): the count of test scores below each off-data
    score, by a batched sorted search."""
    below = torch.searchsorted(s_in.sort(-1).values.contiguous(), s_out.contiguous())
    return below.double().mean(-1) / s_in.shape[-1]


def test_auroc_se_matches_the_spread_over_redrawn_exponential_samples(cls):
    # Exponential scores are Hanley-McNeil's model: in ~ Exp(1), out ~ Exp(r) give A = 1 / (1 + r) and its Q1, Q2
    # exactly, so the formula is the AUROC's exact sd; the sample sd of R = 4000 replicates has relative error
    # ~ 1 / sqrt(2 R) = 0.011, the tolerance is 4 of those. Swapping n_in and n_out would be off by 40%.
    rate, n_in, n_out, reps = 0.25, 30, 200, 4000
    g = torch.Generator().manual_seed(0)
    s_in = torch.empty(reps, n_in, dtype=torch.float64).exponential_(1.0, generator=g)
    s_out = torch.empty(reps, n_out, dtype=torch.float64).exponential_(rate, generator=g)
    aucs = _batch_auroc(s_in, s_out)
    a = 1 / (1 + rate)
    se = cls.auroc_se(a, n_out, n_in)
    assert float(aucs.std()) == pytest.approx(se, rel=4 / math.sqrt(2 * reps))
    assert float(aucs.mean()) == pytest.approx(a, abs=4 * se / math.sqrt(reps))
    assert cls.auroc_se(a, n_in, n_out) > 1.3 * se  # the argument order matters


def test_auroc_se_draw_is_the_spread_over_redrawn_noise_rows_with_the_test_rows_fixed(cls):
    # Test rows fixed, off-data scores o ~ Exp(r): the placement V = share of test scores below o has the exact
    # moments E V = mean_i exp(-r s_i), E V^2 = mean_{i,k} exp(-r max(s_i, s_k)); the AUROC's sd over redraws of
    # n_out rows is sqrt(Var V / n_out). Both the function on one large sample (its sd estimate: relative error
    # ~ 1 / sqrt(2 n)) and the sd over 3000 redrawn AUROCs (~ 1 / sqrt(2 R)) must match it within 4 of those.
    rate, n_in = 0.25, 30
    g = torch.Generator().manual_seed(1)
    s_in = torch.empty(n_in, dtype=torch.float64).exponential_(1.0, generator=g)
    mean_v = torch.exp(-rate * s_in).mean()
    mean_v2 = torch.exp(-rate * torch.maximum(s_in[:, None], s_in[None, :])).mean()
    sd_v = float((mean_v2 - mean_v**2).sqrt())

    big = torch.empty(20_000, dtype=torch.float64).exponential_(rate, generator=g)
    assert cls.auroc_se_draw(s_in, big) == pytest.approx(sd_v / math.sqrt(len(big)), rel=4 / math.sqrt(2 * len(big)))

    n_out, reps = 200, 3000
    redrawn = torch.empty(reps, n_out, dtype=torch.float64).exponential_(rate, generator=g)
    spread = float(_batch_auroc(s_in.expand(reps, n_in), redrawn).std())
    assert spread == pytest.approx(sd_v / math.sqrt(n_out), rel=4 / math.sqrt(2 * reps))


def test_aurocs_row_against_a_direct_count_on_a_small_example(cls):
    # a fake predictive returning class probabilities (entropy only, as logistic regression): 3 test rows,
    # 4 noise rows, one tie; the AUROC is the pair count by hand: 8.5 of 12 pairs
    probs = {0.1: [0.9, 0.1], 0.2: [0.8, 0.2], 0.3: [0.7, 0.3], 0.4: [0.6, 0.4], 0.5: [0.5, 0.5]}

    def predict(x):
        return torch.tensor([probs[round(float(v), 1)] for v in x[:, 0]], dtype=torch.float64)

    x_in = torch.tensor([[0.1], [0.3], [0.4]])
    x_out = torch.tensor([[0.2], [0.3], [0.5], [0.5]])
    row = cls._aurocs(predict, x_in, {"noise": x_out}, se=("noise",))
    # entropy rises with p(class 1) up to 0.5: noise 0.2 beats 1 test row, 0.3 beats 1 and ties 1, 0.5 beats 3 (x2)
    assert row["auroc_noise_entropy"] == pytest.approx((1 + 1.5 + 3 + 3) / 12)
    assert row["se_noise_entropy"] == pytest.approx(cls.auroc_se(8.5 / 12, 4, 3))
    v = torch.tensor([1 / 3, 1.5 / 3, 1.0, 1.0], dtype=torch.float64)  # placements of the 4 noise rows
    assert row["sedraw_noise_entropy"] == pytest.approx(float(v.std() / 2))
    assert math.isnan(row["auroc_noise_mi"]) and math.isnan(row["se_noise_mi"])


def test_noise_rows_are_fixed_per_split_and_independent_of_the_fit_seed(cls):
    x, y = cls.load_dataset("iris")
    s = cls.make_split(x, y, 0)
    torch.manual_seed(123)
    a = cls.ood_inputs(s, 0, noise_rows=500)["noise"]
    state = torch.get_rng_state()
    torch.manual_seed(7)  # another fit seed: the rows do not change
    b = cls.ood_inputs(s, 0, noise_rows=500)["noise"]
    assert torch.equal(a, b) and a.shape == (500, 4)
    torch.manual_seed(123)
    cls.ood_inputs(s, 0, noise_rows=500)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG (the fit's) is not advanced
    assert not torch.equal(cls.ood_inputs(s, 1, noise_rows=500)["noise"], a)  # a new set per split
    few = cls.ood_inputs(s, 0)["noise"]
    assert few.shape == (30, 4) and not torch.equal(few, a[:30])  # a stream apart from the test-row-sized set
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="noise_rows: expected an int >= 2"):
            cls.ood_inputs(s, 0, noise_rows=bad)


def test_verdicts_compare_each_engine_with_logistic_regression_on_its_split(cls):
    nan = math.nan
    base = dict(error="", auroc_noise_ntest_mi=0.9, sedraw_noise_mi=0.004)
    rows = pd.DataFrame(
        [
            dict(base, split=0, method="logreg", accuracy=0.95, nll=0.10, auroc_noise_mi=nan, auroc_noise_entropy=0.4,
                 se_noise_entropy=0.05, se_noise_mi=nan, sedraw_noise_entropy=0.01, auroc_noise_ntest_entropy=0.4),
            dict(base, split=0, method="a", accuracy=0.93, nll=0.12, auroc_noise_mi=0.82, se_noise_mi=0.02),
            dict(base, split=0, method="b", accuracy=0.95, nll=0.14, auroc_noise_mi=0.95, se_noise_mi=0.02),
            dict(base, split=0, method="c", accuracy=0.95, nll=0.10, auroc_noise_mi=0.70, se_noise_mi=0.02,
                 auroc_noise_ntest_mi=0.81),
            dict(base, split=1, method="a", accuracy=0.95, nll=0.10, auroc_noise_mi=0.9, se_noise_mi=0.02),
        ]
    )  # fmt: skip
    v = cls.verdicts(rows).set_index("method")
    assert list(v.index) == ["a", "b", "c"]  # split 1 has no logistic regression: left out
    assert v.loc["a", "met"] and v.loc["a", "z"] == pytest.approx(1.0) and v.loc["a", "score"] == "mi"
    assert v.loc["a", "accuracy_gap"] == pytest.approx(-0.02) and v.loc["a", "nll_gap"] == pytest.approx(0.02)
    assert not v.loc["b", "met"] and not v.loc["b", "met_ntest"]  # NLL 0.04 above logistic regression
    assert not v.loc["c", "met"] and v.loc["c", "met_ntest"] and v.loc["c", "z"] == pytest.approx(-5.0)
    text = cls.verdicts_markdown(cls.verdicts(rows))
    assert "| 0 | a | -0.020 | +0.020 | 0.820 ± 0.020 | 0.004 | +1.0 | ✓ (< 2 se) | 0.900 | ✓ |" in text


def test_verdicts_against_nuts_judge_each_engine_by_the_exact_posterior_too(cls):
    base = dict(error="", auroc_noise_ntest_mi=0.9, sedraw_noise_mi=0.004, se_noise_mi=0.02)
    rows = pd.DataFrame(
        [
            dict(base, split=0, method="logreg", accuracy=0.95, nll=0.10, auroc_noise_mi=math.nan,
                 auroc_noise_entropy=0.4, se_noise_entropy=0.05, sedraw_noise_entropy=0.01,
                 auroc_noise_ntest_entropy=0.4),
            dict(base, split=0, method="nuts", accuracy=0.94, nll=0.15, auroc_noise_mi=0.99),
            dict(base, split=0, method="a", accuracy=0.95, nll=0.17, auroc_noise_mi=0.95),
            dict(base, split=0, method="b", accuracy=0.95, nll=0.19, auroc_noise_mi=0.95),
            dict(base, split=0, method="c", accuracy=0.95, nll=0.16, auroc_noise_mi=0.70),
            dict(base, split=1, method="logreg", accuracy=0.95, nll=0.10, auroc_noise_mi=math.nan,
                 auroc_noise_entropy=0.4, se_noise_entropy=0.05, sedraw_noise_entropy=0.01,
                 auroc_noise_ntest_entropy=0.4),
            dict(base, split=1, method="a", accuracy=0.95, nll=0.11, auroc_noise_mi=0.95),
        ]
    )  # fmt: skip
    v = cls.verdicts(rows).set_index(["split", "method"])
    assert not v.loc[(0, "a"), "met"] and v.loc[(0, "a"), "met_ref"]  # 0.07 above logreg, 0.02 above NUTS
    assert v.loc[(0, "a"), "nll_gap_ref"] == pytest.approx(0.02)
    assert v.loc[(0, "a"), "accuracy_gap_ref"] == pytest.approx(0.01)
    assert not v.loc[(0, "b"), "met_ref"]  # 0.04 above NUTS
    assert not v.loc[(0, "c"), "met_ref"]  # the AUROC half still counts
    assert not v.loc[(0, "nuts"), "met"] and math.isnan(v.loc[(0, "nuts"), "nll_gap_ref"])  # not its own reference
    assert v.loc[(1, "a"), "met"] and not v.loc[(1, "a"), "met_ref"]  # no NUTS row on split 1
    assert math.isnan(v.loc[(1, "a"), "nll_gap_ref"])
    text = cls.verdicts_markdown(cls.verdicts(rows))
    assert "## Per split: the same target against nuts" in text
    assert "| 0 | a | +0.010 | +0.020 | 0.950 | ✓ |" in text and "| 0 | b | +0.010 | +0.040 | 0.950 | ✗ |" in text
    assert "| 1 | a |" not in text.split("against nuts")[1]  # only splits with a NUTS row
    assert "against nuts" not in cls.verdicts_markdown(cls.verdicts(rows[rows["method"] != "nuts"]))


def test_noise_rows_option_reaches_the_scores_and_the_verdicts_file(cls, tmp_path):
    args = ["--dataset", "iris", "--methods", "logreg,laplace", "--quick", "--no-class", "--out", str(tmp_path)]
    cls.main([*args, "--noise-rows", "0"])  # 0: as many as test rows, the scoring before
    rows = pd.read_csv(tmp_path / "iris_splits.csv")
    assert (rows["auroc_noise_mi"].dropna() == rows["auroc_noise_ntest_mi"].dropna()).all()
    v = pd.read_csv(tmp_path / "iris_verdicts.csv")
    assert v["method"].tolist() == ["laplace"] and "Per split: issue 26" in (tmp_path / "iris.md").read_text()
    with pytest.raises(SystemExit, match="--noise-rows"):
        cls.main([*args, "--noise-rows", "1"])


def test_per_split_file_has_one_header_for_rows_with_and_without_chain_checks(cls, tmp_path, monkeypatch):
    def fake_run_one(method, data, split, options=None, **kwargs):  # a reference row, then an MCMC row
        scores = {m: 0.5 for m in cls.METRICS}
        row = dict(scores, method=method, split=split, n_train=120, error="", warnings="", accuracy=0.9, nll=0.2)
        return row if method == "logreg" else dict(row, nll_chain_se=0.01, rhat_f_max=1.01, ess_f_min=900.0)

    monkeypatch.setattr(cls, "run_one", fake_run_one)
    cls.main(["--dataset", "iris", "--methods", "logreg,nuts", "--splits", "2", "--no-class", "--out", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "iris_splits.csv")  # appended row by row: the MCMC row's extra cells fit the header
    assert rows["method"].tolist() == ["logreg", "nuts", "logreg", "nuts"]
    assert rows["nll_chain_se"].isna().tolist() == [True, False, True, False]
    assert rows.loc[1, "rhat_f_max"] == pytest.approx(1.01) and rows.loc[3, "ess_f_min"] == pytest.approx(900.0)
