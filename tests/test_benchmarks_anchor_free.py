"""benchmarks/anchor_free_directions.py's start rules and its simulated refit schedule, against exact answers (the
script is loaded from its file: benchmarks/ is no package).

A weight on an input column that is zero on every training row gets no data gradient and no Gauss-Newton curvature,
so every start rule that claims to move the free directions to the anchor must put it exactly at its anchor (to
float rounding), and leave the weights the data do constrain off it.
"""

from __future__ import annotations

import pytest
import torch

from bnn_pyro.infer.optim import make_schedule


@pytest.fixture(scope="module")
def af(load_benchmark):
    return load_benchmark("anchor_free_directions")  # it imports its siblings classification.py, uci.py, _common.py


def _case(sigma: bool = False):
    """Rows whose last input column is zero, initializer-sized weights ``z`` and prior-sized anchors ``w0`` of a
    3-8-2 ``Linear - ReLU - Linear`` net (a learned noise ``sigma`` on the log scale when asked)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    x[:, 2] = 0.0
    shapes = {"0.weight": (8, 3), "0.bias": (8,), "2.weight": (1 if sigma else 2, 8), "2.bias": (1 if sigma else 2,)}
    z = {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}
    w0 = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    if sigma:
        z["sigma"] = torch.tensor(-0.4)
    return x, z, w0


@pytest.mark.parametrize("sigma", [False, True], ids=["softmax", "gaussian"])
def test_curvature_start_puts_a_weight_the_data_leave_free_at_its_anchor(af, sigma):
    x, z, w0 = _case(sigma)
    start = af.curvature_start(z, w0, x)
    torch.testing.assert_close(start["0.weight"][:, 2], w0["0.weight"][:, 2], rtol=0, atol=1e-6)
    assert (start["0.weight"][:, :2] - w0["0.weight"][:, :2]).abs().max() > 0.1  # the data's weights are held back


def test_newton_start_is_the_anchor_where_the_data_leave_a_weight_free_and_the_map_is_at_the_prior_mode(af):
    x, z_map, w0 = _case()
    z_map["0.weight"][:, 2] = 0.0  # a MAP under a zero-mean prior: no data gradient there, so at the prior's mode
    start = af.newton_start(z_map, w0, x)
    torch.testing.assert_close(start["0.weight"][:, 2], w0["0.weight"][:, 2], rtol=0, atol=1e-6)
    assert (start["0.weight"][:, :2] - w0["0.weight"][:, :2]).abs().max() > 0.1


def test_linear_free_start_moves_only_the_free_input_direction_of_the_first_layer(af):
    x, z, w0 = _case()
    start = af.linear_free_start(z, w0, x)
    torch.testing.assert_close(start["0.weight"][:, 2], w0["0.weight"][:, 2], rtol=0, atol=1e-6)
    torch.testing.assert_close(start["0.weight"][:, :2], z["0.weight"][:, :2], rtol=0, atol=1e-6)


def test_whole_budget_cosine_follows_the_default_cosine_of_the_budget_and_stops_where_the_fit_stops(af):
    # the truncated refit's schedule: k steps of it are the first k steps of the default cosine over the budget, not
    # a cosine compressed into k steps (which is at its final rate by step k)
    budget, k = 1000, 120
    rates = {}
    for name, schedule in (("whole", af.whole_budget_cosine(budget)), ("default", "cosine"), ("compressed", "cosine")):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)
        sched = (
            schedule(opt) if callable(schedule) else make_schedule(schedule, opt, k if name == "compressed" else budget)
        )
        for _ in range(k):
            opt.step()
            sched.step()
        rates[name] = opt.param_groups[0]["lr"]
    assert rates["whole"] == pytest.approx(rates["default"], rel=1e-12)
    assert rates["whole"] > 5 * rates["compressed"]
