"""Tests for the anchored ensemble's free start (bnn_pyro/infer/anchor.py, "Where a member starts").

Known answers. Along an input column that is zero on every fitted row the data term does not depend on the first
layer's weights on it, and the anchored prior's gradient ``(w - w0) / s^2`` is zero at the anchor ``w0``: a member
started there has a zero gradient there at every step, so Adam leaves it there exactly (no tolerance: the start is
computed in float64 and rounds to the anchor itself). The old start (the initializer) is ``O(1)`` away from the
anchor there, and early stopping on held-out rows (240 rows: 24 held out, then the refit) ends it short of it.
The free directions of a second moment with a known spectrum are its eigenvectors below ``4 / (N s^4)``.
"""

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import ensemble
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.anchor import FREE_START_PRECISION, anchor, free_directions

QUICK = dict(num_chains=2, num_steps=50, progress=False, seed=0)


def _classifier(inputs: int = 3, prior=None) -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(inputs, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return bp.BNN(net, prior=prior or dist.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


def _rows(n: int, zero_column: int | None = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    if zero_column is not None:
        x[:, zero_column] = 0.0
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    return x, y


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_a_weight_on_an_all_zero_input_column_starts_and_ends_at_its_anchor_at_the_defaults():
    x, y = _rows(240)
    model = _classifier()
    post = bp.fit(model, x, y, method="ensemble", num_chains=2, seed=0, progress=False)  # else the defaults
    assert post.config["validation"]["final_fit_rows"] == 240  # held-out stopping, then the refit on every row
    assert post.config["anchor"] == {
        "free_directions": 1,
        "site": "0.weight",
        "threshold": FREE_START_PRECISION / 240,
        "rows": 240,
    }
    w = post.samples["0.weight"][:, 0]
    for k in range(2):
        w0 = anchor(model, Potential(model, Data(x=x, y=y)), (x, y), seed=k)[1]["0.weight"]
        assert torch.equal(w[k][:, 1], w0[:, 1])  # the free column: at the anchor, to the bit
        assert (w[k][:, [0, 2]] - w0[:, [0, 2]]).abs().max() > 0.3  # the data's columns: fitted, not at the anchor


def test_free_directions_are_the_second_moments_eigenvectors_below_the_threshold():
    n = 200
    x, _ = _rows(n, zero_column=None)
    x[:, 2] = 0.01 * x[:, 2]  # second moment ~1e-4, below 4 / (200 * 2**4) = 1.25e-3 for a prior sd of 2
    free = free_directions(_classifier(prior=dist.Normal(0.0, 2.0)), x)
    assert free.record == {"free_directions": 1, "site": "0.weight", "threshold": 4.0 / (n * 2.0**4), "rows": n}
    lam, vec = torch.linalg.eigh(x.double().T @ x.double() / n)
    assert lam[0] < free.record["threshold"] < lam[1]
    torch.testing.assert_close(free.projector, torch.outer(vec[:, 0], vec[:, 0]))
    x[:, 2] = 0.1 * x[:, 2] / 0.01  # second moment ~1e-2: above the threshold, no free direction
    assert free_directions(_classifier(prior=dist.Normal(0.0, 2.0)), x).projector is None
    x[:, 2] = 1.0  # constant, not zero: covariance 0 but second moment 1 (it acts as a bias), so not free
    assert free_directions(_classifier(prior=dist.Normal(0.0, 2.0)), x).projector is None


@pytest.mark.parametrize(
    "net, prior, why",
    [
        (torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(3, 2)), None, "nn.Sequential starting with an nn.Linear"),
        (torch.nn.Linear(3, 2), None, "nn.Sequential starting with an nn.Linear"),
        (
            torch.nn.Sequential(torch.nn.Linear(3, 2)),
            lambda name, module, p: dist.Normal(0.0, 1.0) if name.endswith("bias") else None,
            "'0.weight' has no prior",
        ),
        (
            torch.nn.Sequential(torch.nn.Linear(3, 2)),
            bp.priors.HierarchicalNormal(),
            "hierarchical prior",
        ),
    ],
)
def test_models_outside_the_rule_say_why(net, prior, why):
    model = bp.BNN(net, prior=prior or dist.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    free = free_directions(model, _rows(50)[0])
    assert free.projector is None and free.record["free_directions"] == 0 and why in free.record["skipped"]


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_a_loader_and_plain_members_record_what_was_done():
    x, y = _rows(60)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=20)
    post = bp.fit(_classifier(), loader, method="ensemble", **QUICK)
    assert post.config["anchor"]["free_directions"] == 0 and "loader" in post.config["anchor"]["skipped"]
    plain = bp.fit(_classifier(), x, y, method="ensemble", anchored=False, **QUICK)
    assert plain.config["anchor"] is None  # no anchor, so no free start


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")
def test_without_a_free_direction_the_fit_is_bit_identical_to_the_initializers_start(monkeypatch):
    x, y = _rows(60, zero_column=None)  # standardized-like columns: every eigenvalue far above 4 / 60
    post = bp.fit(_classifier(), x, y, method="ensemble", **QUICK)
    assert post.config["anchor"]["free_directions"] == 0 and "skipped" not in post.config["anchor"]
    monkeypatch.setattr(ensemble, "free_directions", lambda model, x: None)  # the start before the free start
    before = bp.fit(_classifier(), x, y, method="ensemble", **QUICK)
    for name, v in post.samples.items():
        assert torch.equal(v, before.samples[name]), name
    assert torch.equal(post.history["loss"], before.history["loss"])
