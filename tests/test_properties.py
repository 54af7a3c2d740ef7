"""Property-based tests (hypothesis) over input shapes: ``bp.fit`` (a few SVI steps) and
``Posterior.predict`` give outputs of the right shapes with finite values for every valid
combination of data size N, features D, outputs K, batch size and task (regression,
binary or multi-class classification), and a ValueError that names the problem for invalid ones
(targets of the wrong width, test inputs with the wrong number of features).

``derandomize=True``: the examples are a fixed function of the test, so CI runs the same cases
every time (the project's fixed-seed rule); ``deadline=None`` because a fit's first call compiles.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bnn_pyro as bp

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
TASKS = ("regression", "binary", "multiclass")


def _model(d: int, k: int, task: str) -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(d, 3), torch.nn.Tanh(), torch.nn.Linear(3, k))
    likelihood = {
        "regression": bp.likelihoods.Gaussian(scale=0.5),
        "binary": bp.likelihoods.Bernoulli(),
        "multiclass": bp.likelihoods.Categorical(),
    }[task]
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)


def _targets(n: int, k: int, task: str, g: torch.Generator) -> torch.Tensor:
    if task == "regression":
        return torch.randn((n,) if k == 1 else (n, k), generator=g)
    return torch.randint(0, 2 if task == "binary" else k, (n,), generator=g)


shapes = st.fixed_dictionaries(
    dict(
        n=st.integers(1, 12),
        d=st.integers(1, 3),
        k=st.integers(1, 3),
        m=st.integers(1, 5),
        batch_size=st.one_of(st.none(), st.integers(1, 14)),
        task=st.sampled_from(TASKS),
    )
).map(lambda s: dict(s, k=1 if s["task"] == "binary" else max(s["k"], 2) if s["task"] == "multiclass" else s["k"]))


def _fit(s, y=None, num_samples=3):
    g = torch.Generator().manual_seed(s["n"] * 100 + s["d"] * 10 + s["k"])
    x = torch.randn(s["n"], s["d"], generator=g)
    y = _targets(s["n"], s["k"], s["task"], g) if y is None else y
    return bp.fit(
        _model(s["d"], s["k"], s["task"]),
        x,
        y,
        method="svi",
        num_steps=2,
        num_samples=num_samples,
        batch_size=s["batch_size"],
        progress=False,
    )


@SETTINGS
@given(s=shapes)
def test_fit_and_predict_give_finite_outputs_of_the_right_shapes(s):
    post = _fit(s)
    assert all(v.shape[:2] == (1, 3) and torch.isfinite(v).all() for v in post.samples.values())
    x_test = torch.randn(s["m"], s["d"], generator=torch.Generator().manual_seed(1))
    pred = post.predict(x_test, seed=0)
    m, k = s["m"], s["k"]
    if s["task"] == "regression":
        shape = (m,) if k == 1 else (m, k)
        for field in ("mean", "std", "epistemic_std", "aleatoric_std", "lower", "upper"):
            value = getattr(pred, field)
            assert value.shape == shape and torch.isfinite(value).all(), field
        assert pred.draws.shape == (3,) + shape and (pred.lower <= pred.upper).all()
    else:
        classes = 2 if s["task"] == "binary" else k
        assert pred.probs.shape == (m, classes) and torch.isfinite(pred.probs).all()
        torch.testing.assert_close(pred.probs.sum(-1), torch.ones(m))
        assert pred.predicted.shape == (m,) and ((pred.predicted >= 0) & (pred.predicted < classes)).all()
        assert pred.entropy.shape == (m,) and torch.isfinite(pred.mutual_information).all()


@SETTINGS
@given(s=shapes.filter(lambda s: s["task"] == "regression"), extra=st.integers(1, 2))
def test_targets_of_the_wrong_width_are_a_clear_error(s, extra):
    y = torch.zeros(s["n"], s["k"] + extra)
    with pytest.raises(ValueError, match=rf"y has shape \({s['n']}, {s['k'] + extra}\).*Reshape y"):
        _fit(s, y=y)


@SETTINGS
@given(s=shapes, extra=st.integers(1, 2))
def test_predict_with_the_wrong_number_of_features_is_a_clear_error(s, extra):
    post = _fit(dict(s, batch_size=None), num_samples=2)
    with pytest.raises(ValueError, match=r"x has shape .*feature dimensions of x match the net's first layer"):
        post.predict(torch.zeros(s["m"], s["d"] + extra))
