"""Tests for the free start of SWAG's anchored chains and snapshot's anchored cycles (bnn_pyro/infer/anchor.py,
"Where a member starts"; the deep ensemble's own tests are tests/infer/test_free_start.py).

Known answers. Along an input column that is zero on every fitted row the data term does not depend on the first
layer's weights on it, and the anchored prior's gradient ``(w - w0) / s^2`` is exactly zero at the anchor ``w0``:
a chain (a cycle) started there has a zero gradient there at every step, so it stays there to the bit. A snapshot
ensemble's cycle ``c`` (``free_start=True``, not the default, for both engines) starts there at its own anchor (seed ``seed + c * ANCHOR_CYCLE_OFFSET``), so each snapshot
is at its cycle's anchor to the bit. A SWAG chain's iterates there are all its anchor: the SWA mean is (float64
running mean of one float32 value), and the draws add ``sqrt(sq_mean - mean^2)`` noise, whose float64 rounding is
below 1e-7 of the weight's scale. The old start (the layer's initializer, then the prior's pull at the rate the
optimizers' steps allow, with early stopping on 10% held-out rows and then the refit) left those weights away
from the anchor. Without a free direction the fit is bit-identical to the old start.
"""

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import snapshot, swag
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.anchor import FREE_START_PRECISION, anchor

pytestmark = pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")

SNAPSHOT_QUICK = dict(num_cycles=3, cycle_length=60, progress=False, seed=0)
SWAG_QUICK = dict(pretrain_steps=60, num_steps=60, swag_rank=2, num_chains=2, progress=False, seed=0)


def _classifier() -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return bp.BNN(net, prior=dist.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())


def _rows(n: int, zero_column: int | None = 1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    if zero_column is not None:
        x[:, zero_column] = 0.0
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    return x, y


def _anchor(model, x, y, seed: int) -> torch.Tensor:
    return anchor(model, Potential(model, Data(x=x, y=y)), (x, y), seed=seed)[1]["0.weight"]


RECORD = {"free_directions": 1, "site": "0.weight", "threshold": FREE_START_PRECISION / 240, "rows": 240}


@pytest.mark.slow  # the defaults' 1,000-step cycles, run twice (held-out stops, then the refit)
def test_snapshot_free_start_a_weight_on_an_all_zero_input_column_is_at_each_cycles_anchor():
    x, y = _rows(240)
    model = _classifier()
    post = bp.fit(
        model, x, y, method="snapshot", num_cycles=3, free_start=True, progress=False, seed=0
    )  # else the defaults
    assert post.config["validation"]["final_fit_rows"] == 240  # held-out stopping, then the refit on every row
    assert post.config["anchor"] == RECORD
    w = post.samples["0.weight"][0]  # (cycles, 8, 3)
    for c in range(3):
        w0 = _anchor(model, x, y, seed=c * snapshot.ANCHOR_CYCLE_OFFSET)
        assert torch.equal(w[c][:, 1], w0[:, 1]), c  # the free column: at this cycle's anchor, to the bit
        assert (w[c][:, [0, 2]] - w0[:, [0, 2]]).abs().max() > 0.3  # the data's columns: fitted, not at it


@pytest.mark.slow  # the defaults' 2,000 pre-training steps per chain, three chains, run twice (the refit)
def test_swag_free_start_a_weight_on_an_all_zero_input_column_starts_and_ends_at_its_anchor():
    x, y = _rows(240)
    model = _classifier()
    post = bp.fit(model, x, y, method="swag", num_samples=20, free_start=True, progress=False, seed=0)
    assert post.config["validation"]["final_fit_rows"] == 240
    assert post.config["anchor"] == RECORD
    w = post.samples["0.weight"]  # (chains, draws, 8, 3)
    for k in range(post.config["num_chains"]):
        w0 = _anchor(model, x, y, seed=k)
        torch.testing.assert_close(w[k][..., 1], w0[:, 1].expand_as(w[k][..., 1]), rtol=0, atol=1e-6)
        assert (w[k][..., [0, 2]] - w0[:, [0, 2]]).abs().amax(dim=(1, 2)).min() > 0.3  # fitted columns


@pytest.mark.parametrize("method, module, quick", [("snapshot", snapshot, SNAPSHOT_QUICK), ("swag", swag, SWAG_QUICK)])
def test_by_default_the_free_directions_are_recorded_and_not_applied(monkeypatch, method, module, quick):
    x, y = _rows(60)
    post = bp.fit(_classifier(), x, y, method=method, **quick)
    assert post.config["anchor"] == {
        "free_directions": 1,
        "site": "0.weight",
        "threshold": FREE_START_PRECISION / 60,
        "rows": 60,
        "skipped": module.NOT_FREE,
    }
    monkeypatch.setattr(module, "free_directions", lambda model, x: None)  # the start before the free start
    before = bp.fit(_classifier(), x, y, method=method, **quick)
    for name, v in post.samples.items():
        assert torch.equal(v, before.samples[name]), name


def test_snapshot_and_swag_without_anchoring_have_no_free_start():
    x, y = _rows(60)
    plain = bp.fit(_classifier(), x, y, method="snapshot", anchored=False, **SNAPSHOT_QUICK)
    assert "anchor" not in plain.config or plain.config["anchor"] is None
    plain = bp.fit(_classifier(), x, y, method="swag", anchored=False, **SWAG_QUICK)
    assert "anchor" not in plain.config or plain.config["anchor"] is None


@pytest.mark.parametrize(
    "method, module, quick",
    [
        ("snapshot", snapshot, {**SNAPSHOT_QUICK, "free_start": True}),
        ("swag", swag, {**SWAG_QUICK, "free_start": True}),
    ],
)
def test_without_a_free_direction_the_fit_is_bit_identical_to_the_old_start(monkeypatch, method, module, quick):
    x, y = _rows(60, zero_column=None)  # standardized-like columns: every eigenvalue far above 4 / 60
    post = bp.fit(_classifier(), x, y, method=method, **quick)
    assert post.config["anchor"]["free_directions"] == 0 and "skipped" not in post.config["anchor"]
    monkeypatch.setattr(module, "free_directions", lambda model, x: None)  # the start before the free start
    before = bp.fit(_classifier(), x, y, method=method, **quick)
    for name, v in post.samples.items():
        assert torch.equal(v, before.samples[name]), name
