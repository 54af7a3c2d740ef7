"""A posterior fitted on a pandas DataFrame records its column names (``Posterior.feature_names``) and matches a
DataFrame given later by name: a net reads its inputs by position, so columns in another order used to give
other predictions silently."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.io import PosteriorFileError


def _model() -> bp.BNN:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


@pytest.fixture(scope="module")
def fitted():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=g)
    frame = pd.DataFrame(x.numpy(), columns=["age", "dose"])
    y = pd.Series((x[:, 0] - 2 * x[:, 1]).numpy())
    post = bp.fit(_model(), frame, y, method="svi", num_steps=50, num_samples=30, progress=False, seed=0)  # psis: >= 21
    return post, frame, y


def test_the_fit_records_the_columns_and_predict_finds_them_by_name(fitted):
    post, frame, _ = fitted
    assert post.feature_names == ["age", "dose"]
    expected = post.predict(frame, seed=0).mean
    swapped = post.predict(frame[["dose", "age"]], seed=0).mean
    assert torch.equal(swapped, expected)  # before: the columns were read by position (max difference ~1 here)
    assert torch.equal(post.predict(frame.to_numpy(), seed=0).mean, expected)  # arrays: by position, as fitted


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda f: f.assign(extra=1.0), r"unexpected: \['extra'\]"),
        (lambda f: f[["age"]], r"missing: \['dose'\]"),
        (lambda f: f.rename(columns={"dose": "Dose"}), r"missing: \['dose'\]; unexpected: \['Dose'\]"),
    ],
    ids=["extra", "missing", "renamed"],
)
def test_other_columns_are_refused_naming_them(fitted, change, named):
    post, frame, _ = fitted
    with pytest.raises(ValueError, match=rf"x: the DataFrame's columns are not the 2 .*{named}.*\['age', 'dose'\]"):
        post.predict(change(frame))


def test_arviz_data_and_a_saved_posterior_match_columns_too(fitted, tmp_path):
    post, frame, y = fitted
    idata = post.to_inference_data(x=frame[["dose", "age"]], y=y)
    assert (idata.constant_data["x"].values == frame.to_numpy()).all()
    path = post.save(tmp_path / "post.bnn")
    again = bp.load(path, model=_model())
    assert again.feature_names == ["age", "dose"]
    assert torch.equal(again.predict(frame[["dose", "age"]], seed=0).mean, post.predict(frame, seed=0).mean)


def test_a_file_whose_column_names_are_not_text_is_refused(fitted, tmp_path):
    post, _, _ = fitted
    odd = bp.Posterior(**{**vars(post), "feature_names": [1, 2]})
    path = odd.save(tmp_path / "odd.bnn")
    with pytest.raises(PosteriorFileError, match="field 'feature_names' is not a list of column names"):
        bp.load(path)


def test_tensor_fits_record_no_names_and_take_any_frame_by_position():
    post = bp.fit(
        _model(), torch.randn(10, 2), torch.randn(10), method="svi", num_steps=2, num_samples=2, progress=False
    )
    assert post.feature_names is None
    assert post.predict(pd.DataFrame({"b": [0.0], "a": [1.0]})).mean.shape == (1,)


def test_psis_metrics_and_a_function_posterior_read_a_dataframe_by_name_too(fitted):
    import pyro
    import pyro.distributions as dist

    from bnn_pyro import metrics

    post, frame, y = fitted
    swapped = frame[["dose", "age"]]
    assert post.psis(x=swapped, y=y).k_hat == post.psis(x=frame, y=y).k_hat
    assert metrics.test_log_likelihood(post, swapped, y) == metrics.test_log_likelihood(post, frame, y)

    def linear(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(x @ w, 0.5), obs=y)

    plain = bp.fit(linear, frame, y, method="svi", num_steps=20, num_samples=5, progress=False, seed=0)
    assert plain.feature_names == ["age", "dose"]
    assert torch.equal(plain.predict(swapped, seed=0).mean, plain.predict(frame, seed=0).mean)
    assert metrics.test_log_likelihood(plain, swapped, y) == metrics.test_log_likelihood(plain, frame, y)
