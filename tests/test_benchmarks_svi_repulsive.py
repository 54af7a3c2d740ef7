"""benchmarks/svi_repulsive.py (mean-field guides pushed apart, a prototype): the coupling terms against their exact
values, and a tiny run through classification.run_one's scoring (its ``fit=``) and the report."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch


@pytest.fixture(scope="module")
def rep(load_benchmark):
    return load_benchmark("svi_repulsive")  # it imports its siblings classification.py, classification_splits.py


def test_mixture_log_q_is_the_mixture_density(rep):
    g = torch.Generator().manual_seed(0)
    loc = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(3, 2, generator=g)}
    sd = {n: 0.5 + torch.rand(v.shape, generator=g) for n, v in loc.items()}
    w = {n: v + 0.3 * torch.randn(v.shape, generator=g) for n, v in loc.items()}
    flat = lambda d, k: torch.cat([d[n][k] for n in d])  # noqa: E731
    exact = torch.stack(
        [
            torch.stack(
                [torch.distributions.Normal(flat(loc, j), flat(sd, j)).log_prob(flat(w, i)).sum() for j in range(3)]
            ).logsumexp(0)
            - math.log(3)
            for i in range(3)
        ]
    )
    torch.testing.assert_close(rep._log_q(w, loc, sd, True), exact)
    own = torch.stack(
        [torch.distributions.Normal(flat(loc, i), flat(sd, i)).log_prob(flat(w, i)).sum() for i in range(3)]
    )
    torch.testing.assert_close(rep._log_q(w, loc, sd, False), own)
    far = {n: v + 100.0 * torch.arange(3.0)[:, None] for n, v in loc.items()}  # components apart: no overlap
    w_far = {n: far[n] + w[n] - loc[n] for n in w}
    torch.testing.assert_close(rep._log_q(w_far, far, sd, True), rep._log_q(w_far, far, sd, False) - math.log(3))


def test_kde_entropy_against_its_exact_value(rep):
    p = torch.softmax(torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(0)), -1)  # 4 particles
    h = rep._kde_entropy(p)  # bandwidth: the median squared distance over log 4
    d2 = torch.cdist(p.flatten(1), p.flatten(1)).square()
    bw = d2[~torch.eye(4, dtype=torch.bool)].median() / math.log(4)
    exact = -((-d2 / bw).exp().mean(-1).log().mean())
    torch.testing.assert_close(h, exact)
    torch.testing.assert_close(rep._kde_entropy(p[:1].expand(4, 5, 3)), torch.tensor(0.0))  # one function: no entropy
    # equidistant particles: the median bandwidth puts every other particle's kernel at exp(-log 4) = 1/4
    torch.testing.assert_close(rep._kde_entropy(torch.eye(4) * 1e3), torch.tensor(math.log(4) - math.log(1.75)))


def test_a_tiny_run_writes_rows_verdicts_and_paired_differences(rep, tmp_path):
    rep.main(
        [
            "--splits", "2", "--variants", "independent,function=1", "--guides", "2",
            "--num-steps", "20", "--num-samples", "10", "--prefix", "t", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    rows = pd.read_csv(tmp_path / "t_iris_splits.csv")
    assert rows["method"].tolist() == ["svirep_independent", "svirep_function=1"] and (rows["error"].isna()).all()
    assert rows[["auroc_noise_mi", "nll", "elbo", "agree_noise", "sd_f_noise"]].notna().all().all()
    text = (tmp_path / "t_iris.md").read_text()
    assert "svirep_function=1 - svi (committed rows)" in text and "svirep_independent - nuts" in text
    rep.main(["--splits", "2", "--variants", "independent", "--prefix", "t", "--out", str(tmp_path), "--report-only"])
    assert pd.read_csv(tmp_path / "t_iris_splits.csv").equals(rows)  # no fit, no row added
    text = (tmp_path / "t_iris.md").read_text()
    assert "Per split" in text and "svirep_independent - svi" in text and "svirep_function=1 - svi" not in text


def test_variants_are_checked(rep):
    assert rep._variant("function=100@1.5") == ("function", 100.0, 1.5)
    assert rep._variant("mixture") == ("mixture", 0.0, rep.REPULSION_SD)
    with pytest.raises(SystemExit, match="--variants"):
        rep._variant("function")
    for bad in ("svgd=1", "function=x", "function=1@0", "independent=1"):
        with pytest.raises(SystemExit, match="--variants"):
            rep._variant(bad)
