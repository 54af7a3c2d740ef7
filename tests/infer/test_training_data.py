"""The training data a posterior keeps are its own: a user's array edited in place after the fit leaves the fitted
posterior's ``x`` and ``y`` (its LOO, its predictions at the training inputs, its file) as they were."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.utils.checks import owned


def _model(task: str) -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2 if task == "clf" else 1))
    like = bp.likelihoods.Categorical() if task == "clf" else bp.likelihoods.Gaussian(scale=0.1)
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=like)


def _data(kind: str, task: str):
    """The user's arrays (mutated later) and what is passed to bp.fit (their views, not copies)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 2)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) if task == "clf" else x.sum(1)
    given = {
        "numpy": (x, y),
        "torch": (torch.from_numpy(x), torch.from_numpy(y)),  # shares the arrays' memory
        "pandas": (pd.DataFrame(x, columns=["a", "b"], copy=False), pd.Series(y, copy=False)),
    }[kind]
    return x, y, given


@pytest.mark.parametrize("task", ["reg", "clf"])
@pytest.mark.parametrize("kind", ["numpy", "torch", "pandas"])
def test_editing_the_users_data_after_the_fit_leaves_the_posterior_unchanged(kind, task):
    x, y, given = _data(kind, task)
    post = bp.fit(_model(task), *given, method="svi", num_steps=5, num_samples=4, progress=False)
    kept_x, kept_y = post.x.clone(), post.y.clone()
    before = post.predict(post.x, seed=0)
    x[:] = 7.0  # in place, as a user's preprocessing (scaling, imputing) would
    y[:] = 1
    assert torch.equal(post.x, kept_x) and torch.equal(post.y, kept_y)
    after = post.predict(post.x, seed=0)
    key = "probs" if task == "clf" else "mean"
    assert torch.equal(getattr(after, key), getattr(before, key))


def test_only_tensors_that_share_the_users_memory_are_copied():
    user = torch.arange(6.0).reshape(3, 2)
    cast = user.double()  # a new tensor already: kept as it is
    assert owned(cast, user) is cast
    view = user.detach()
    copy = owned(view, user)
    assert copy is not view and torch.equal(copy, user)
    assert copy.untyped_storage().data_ptr() != user.untyped_storage().data_ptr()
    assert owned(user[1:], user).untyped_storage().data_ptr() != user.untyped_storage().data_ptr()  # a view too
    assert owned(None, None) is None


def test_a_loader_of_batches_is_not_stored_so_its_data_are_not_copied():
    """The way docs/devices.md gives for training data near the device's memory: batches from a loader are converted
    one at a time and the posterior keeps none of them (no second copy of the data set)."""
    x, y, (tx, ty) = _data("torch", "reg")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tx, ty), batch_size=8)
    post = bp.fit(_model("reg"), loader, method="svi", num_steps=5, num_samples=4, progress=False)
    assert post.x is None and post.y is None
    tensor_post = bp.fit(_model("reg"), tx, ty, method="svi", num_steps=5, num_samples=4, progress=False)
    assert tensor_post.x.untyped_storage().data_ptr() != tx.untyped_storage().data_ptr()  # a tensor: its own copy
