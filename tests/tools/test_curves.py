"""Tests for bnn_pyro/tools/curves.py: mode connectivity (Garipov et al. 2018).

Known answers. The Bezier and polyline formulas are checked exactly at t = 0, 1/4, 1/2, 1 (the
coefficients are polynomials with exact binary values there). The curve's objective is checked
against Pyro's own log joint (the ``Potential`` every MAP engine uses, with the log-Jacobian added
back as an ensemble member's loss), to float rounding.

Behaviour. On two moons (200 points, noise 0.2), a 2-32-32-2 tanh classifier with a Normal(0, 1)
prior, two members of a ``method="ensemble"`` fit (600 steps each, default validation) are separated
by a barrier on the straight segment, and ``fit_curve`` at its defaults (quadratic Bezier, 1000 steps)
removes it. Measured (loss = negative log joint per training point; training accuracy):

    seed 0: ends 5.790 / 5.771, line midpoint 6.258, curve max 5.790; accuracy ends 0.950 / 0.965,
            line midpoint 0.615, curve min 0.950
    seed 2: ends 5.786 / 5.796, line midpoint 6.169, curve max 5.796; accuracy ends 0.955 / 0.945,
            line midpoint 0.715, curve min 0.945

So the barrier (midpoint minus the higher end) is 0.47 and 0.38, and the curve never rises above its
higher end. The test asserts a barrier above 0.2 and a curve at most 0.02 above the higher end.
"""

import math

import matplotlib.axes
import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import curves
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.map_fit import energy


def _regression(bayesian="all"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = bp.BNN(
        net,
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
        bayesian=bayesian,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, 40).reshape(-1, 1)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(40, generator=g)
    return model, x, y


def _random_end(model, seed):
    g = torch.Generator().manual_seed(seed)
    end = {n: torch.randn(model.param_shapes[n], generator=g) for n in model.sample_names}
    end["sigma"] = torch.tensor(0.2 + seed * 0.3)
    return end


# ------------------------------------------------------------------ exact formulas
def test_bezier_and_polyline_coefficients_exactly():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    bez = curves.coefficients("bezier", t, 1)
    assert torch.equal(bez, torch.tensor([[1.0, 0, 0], [0.5625, 0.375, 0.0625], [0.25, 0.5, 0.25], [0, 0, 1.0]]))
    poly = curves.coefficients("polyline", t, 1)
    assert torch.equal(poly, torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0, 1.0, 0], [0, 0, 1.0]]))
    assert torch.equal(curves.coefficients("line", t, 0), torch.stack([1 - t, t], 1))
    cubic = curves.coefficients("bezier", torch.tensor([0.5]), 2)  # two bends: C(3, k) / 8
    assert torch.equal(cubic, torch.tensor([[1.0, 3.0, 3.0, 1.0]]) / 8)
    with pytest.raises(ValueError, match="kind: unknown value 'spline'"):
        curves.coefficients("spline", t, 1)


def test_points_on_a_bezier_curve_at_0_half_and_1():
    model, x, y = _regression()
    w0, w1 = _random_end(model, 1), _random_end(model, 2)
    line = curves.line(model, ends=(w0, w1))
    theta = {n: torch.full_like(v[0], 0.5) for n, v in line.controls.items()}  # sigma: exp(0.5) on the curve
    controls = {n: torch.stack([c[0], theta[n], c[1]]) for n, c in line.controls.items()}
    curve = curves.Curve(model, "bezier", controls)
    at = curve.points(torch.tensor([0.0, 0.5, 1.0]))
    for n in model.sample_names:
        assert torch.equal(at[n][0], w0[n]) and torch.equal(at[n][2], w1[n])
        assert torch.allclose(at[n][1], 0.25 * w0[n] + 0.5 * theta[n] + 0.25 * w1[n], rtol=0, atol=1e-6)
    # the noise scale moves in log space (its unconstrained coordinate) and stays positive
    expected = math.exp(0.25 * math.log(0.5) + 0.5 * 0.5 + 0.25 * math.log(0.8))
    assert torch.allclose(at["sigma"], torch.tensor([0.5, expected, 0.8]), atol=1e-6)
    straight = line.points(torch.tensor([0.5]))
    for n in model.sample_names:
        assert torch.allclose(straight[n][0], 0.5 * (w0[n] + w1[n]), atol=1e-6)


# ------------------------------------------------------------------ the objective is the model's log joint
def test_path_loss_is_pyros_negative_log_joint_per_point():
    model, x, y = _regression(bayesian="weights")  # deterministic biases ride on the curve too
    w0, w1 = _random_end(model, 1), _random_end(model, 2)
    w1.update({n: torch.full(model.param_shapes[n], 0.3) for n in model.point_names})
    line = curves.line(model, ends=(w0, w1))
    found = curves.path_metrics(line, (x, y), ts=[0.3])
    values = line.points(torch.tensor([0.3]))
    # Pyro's potential (a fresh parameter store) reads the deterministic parameters from the net
    with pyro.get_param_store().scope():
        pot = Potential(_with_points(model, {n: values[n][0] for n in model.point_names}), Data(x, y), init="median")
        z = pot.unconstrain({n: values[n][0] for n in pot.shapes})
        expected = energy(pot, z, (x, y)).item() / len(x)
    assert found.loss.item() == pytest.approx(expected, rel=1e-5)
    sigma = values["sigma"][0]
    f = model.forward_draws({n: values[n] for n in model.sample_names + model.point_names}, x)[0, :, 0]
    nll = -torch.distributions.Normal(f, sigma).log_prob(y).mean()
    assert found.nll.item() == pytest.approx(nll.item(), rel=1e-5)
    assert found.rmse.item() == pytest.approx(((f - y) ** 2).mean().sqrt().item(), rel=1e-5) and found.accuracy is None


def _with_points(model, points):
    import copy

    fitted = copy.deepcopy(model)
    with torch.no_grad():
        for n, v in points.items():
            fitted.net.get_parameter(n).copy_(v)
    return fitted


# ------------------------------------------------------------------ fitting, ensembling along the curve
@pytest.fixture(scope="module")
def fitted():
    model, x, y = _regression()
    ens = bp.fit(model, x, y, method="ensemble", num_chains=2, num_steps=300, seed=0, progress=False)
    curve = curves.fit_curve(ens, x, y, num_steps=200, seed=0, progress=False)
    return ens, curve, x, y


def test_fit_curve_lowers_the_expected_loss_below_the_straight_segment(fitted):
    ens, curve, x, y = fitted
    assert curve.kind == "bezier" and curve.num_bends == 1 and curve.history["loss"].shape == (200,)
    assert (
        curve.config["lr"] == 0.05
        and curve.config["num_steps"] == 200
        and curve.config["ends"] == {"start": 0, "end": 1}
    )
    on_curve, on_line = (curves.path_metrics(c, (x, y), ts=41) for c in (curve, curve.line()))
    assert torch.equal(on_curve.t, torch.linspace(0, 1, 41, dtype=on_curve.t.dtype))
    # same ends (to float rounding), a lower average along the path: what fit_curve minimises
    assert torch.allclose(on_curve.loss[[0, -1]], on_line.loss[[0, -1]], rtol=1e-5)
    assert on_curve.loss.mean() < on_line.loss.mean() - 0.01, (on_curve.loss.mean(), on_line.loss.mean())
    assert on_curve.rmse is not None and on_curve.accuracy is None
    assert bool((curve.points(torch.linspace(0, 1, 11))["sigma"] > 0).all())


def test_curve_posterior_ensembles_along_the_curve(fitted, tmp_path):
    ens, curve, x, y = fitted
    post = curve.posterior(num_points=5)
    assert isinstance(post, bp.Posterior) and post.method == "curve"
    assert (post.num_chains, post.num_draws) == (5, 1)
    assert torch.equal(post.sample_stats["t"][:, 0], torch.linspace(0, 1, 5))
    for n in ens.samples:  # its first and last draws are the two ensemble members
        assert torch.allclose(post.samples[n][[0, -1]], ens.samples[n], atol=1e-6)
    pred, members = post.predict(x), ens.predict(x)
    assert torch.allclose(pred.mean_draws[[0, -1]], members.mean_draws, atol=1e-5)
    assert pred.mean.shape == (40,) and math.isfinite(bp.metrics.nll(post, x, y))
    assert bp.metrics.rmse(pred, y) < 0.5  # the data's sd is ~0.7; a fitted ensemble is well below
    post.save(tmp_path / "curve.bnn")
    again = bp.load(tmp_path / "curve.bnn", model=ens.model)
    assert again.method == "curve" and torch.allclose(again.predict(x).mean, pred.mean)
    mid = curve.posterior(ts=[0.25, 0.75])
    assert mid.num_chains == 2 and mid.config["ts"] == [0.25, 0.75]


def test_fit_curve_from_a_bnn_and_value_dicts_with_a_polyline(fitted):
    ens, _, x, y = fitted
    model = ens.model
    w = [{n: v[k, 0] for n, v in ens.samples.items()} for k in range(2)]
    poly = curves.fit_curve(
        model,
        x,
        y,
        ends=(w[0], w[1]),
        kind="polyline",
        num_bends=2,
        num_steps=20,
        batch_size=16,
        seed=0,
        progress=False,
    )
    assert (
        poly.kind == "polyline" and poly.num_bends == 2 and poly.config["ends"] == {"start": "values", "end": "values"}
    )
    again = curves.fit_curve(
        model,
        x,
        y,
        ends=(w[0], w[1]),
        kind="polyline",
        num_bends=2,
        num_steps=20,
        batch_size=16,
        seed=0,
        progress=False,
    )
    assert all(torch.equal(poly.controls[n], again.controls[n]) for n in poly.controls)  # same seed, same curve
    at = poly.points(torch.tensor([0.0, 1.0]))
    assert all(
        torch.allclose(at[n], torch.stack(ws), atol=1e-6)
        for n, ws in ((n, [w[0][n], w[1][n]]) for n in model.sample_names)
    )


def test_the_curve_keeps_its_own_copy_of_the_training_data(fitted):
    """A curve keeps x and y (its posteriors score there): they shared the user's tensors' memory."""
    ens, _, x, y = fitted
    user_x, user_y = x.clone(), y.clone()
    curve = curves.fit_curve(ens, user_x, user_y, num_steps=2, seed=0, progress=False)
    user_x.mul_(10.0)  # edited in place after the fit
    user_y.zero_()
    assert torch.equal(curve.x, x) and torch.equal(curve.y, y)


def test_plot_path_returns_the_axes(fitted):
    _, curve, x, y = fitted
    paths = {
        "Bezier": curves.path_metrics(curve, (x, y), ts=5),
        "line": curves.path_metrics(curve.line(), (x, y), ts=5),
    }
    ax = curves.plot_path(paths, metric="rmse")
    assert isinstance(ax, matplotlib.axes.Axes) and len(ax.lines) == 2 and ax.get_ylabel() == "rmse"
    assert [line.get_label() for line in ax.lines] == ["Bezier", "line"]
    with pytest.raises(ValueError, match="has no 'accuracy'"):
        curves.plot_path(paths, metric="accuracy")
    with pytest.raises(ValueError, match="metric: unknown value 'error'"):
        curves.plot_path(paths, metric="error")


# ------------------------------------------------------------------ bad input
def test_bad_input_names_the_argument(fitted):
    ens, curve, x, y = fitted
    with pytest.raises(IndexError, match=r"ends\[1\]: draw index 5 out of range; this posterior holds 2 draws"):
        curves.fit_curve(ens, x, y, ends=(0, 5))
    with pytest.raises(ValueError, match="ends: expected a pair"):
        curves.line(ens, ends=(0,))
    with pytest.raises(TypeError, match=r"ends\[0\]: a draw index needs a Posterior"):
        curves.line(ens.model, ends=(0, 1))
    with pytest.raises(ValueError, match=r"ends\[0\]: missing site\(s\) \['sigma'\]"):
        curves.line(ens.model, ends=({n: v[0, 0] for n, v in ens.samples.items() if n != "sigma"}, {}))
    with pytest.raises(ValueError, match="kind: 'line' has no bend"):
        curves.fit_curve(ens, x, y, kind="line")
    with pytest.raises(ValueError, match="num_bends"):
        curves.fit_curve(ens, x, y, num_bends=0)
    with pytest.raises(ValueError, match=r"ts: expected values of t in \[0, 1\]"):
        curves.path_metrics(curve, (x, y), ts=[0.5, 1.5])
    with pytest.raises(TypeError, match="data: expected an"):
        curves.path_metrics(curve, x)
    hier = bp.BNN(
        torch.nn.Linear(1, 1), prior=bp.priors.HierarchicalNormal(), likelihood=bp.likelihoods.Gaussian(scale=0.1)
    )
    with pytest.raises(ValueError, match="no hierarchical prior"):
        curves.line(hier, ends=({}, {}))
    with pytest.raises(TypeError, match="source: expected a bp.Posterior of a BNN or a bp.BNN"):
        curves.line("model")


# ------------------------------------------------------------------ the behaviour the method exists for
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2])
def test_a_trained_curve_removes_the_barrier_of_the_straight_line(seed):
    x, y = bp.datasets.two_moons(n=200, noise=0.2, seed=0)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)
    )
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    ens = bp.fit(
        model,
        x,
        y,
        method="ensemble",
        num_chains=2,
        num_steps=600,
        anchored=False,
        lr_schedule="constant",
        seed=seed,
        progress=False,
    )  # MAP members at a constant rate (the setting measured below): the modes whose connection the curve is about
    curve = curves.fit_curve(ens, x, y, seed=seed, progress=False)  # the defaults: quadratic Bezier, 1000 steps
    on_curve, on_line = (curves.path_metrics(c, (x, y), ts=21) for c in (curve, curve.line()))
    ends = on_line.loss[[0, -1]].max().item()
    barrier, worst = on_line.loss[10].item() - ends, on_curve.loss.max().item() - ends
    print(
        f"seed {seed}: ends {on_line.loss[0]:.3f} / {on_line.loss[-1]:.3f}, line midpoint {on_line.loss[10]:.3f}, "
        f"curve max {on_curve.loss.max():.3f}; accuracy: ends {on_line.accuracy[[0, -1]].tolist()}, "
        f"line midpoint {on_line.accuracy[10]:.3f}, curve min {on_curve.accuracy.min():.3f}"
    )
    assert barrier > 0.2, barrier  # measured 0.47 (seed 0) and 0.38 (seed 2)
    assert worst < 0.02, worst  # measured 0.000 for both: the highest point of the curve is an end
    assert on_curve.accuracy.min() >= on_line.accuracy[[0, -1]].min() - 0.03
    assert on_line.accuracy[10] < on_line.accuracy[[0, -1]].min() - 0.05


def test_the_docs_section_runs_as_written():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "guide" / "using_a_posterior.md"  # moved from the README
    if not page.exists():
        pytest.skip("docs/ is not beside the tests (installed copy)")
    section = page.read_text().split("## Mode connectivity", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = re.sub(r"num_steps=\d+", "num_steps=20", code)
    code = re.sub(r"(fit\(.*|fit_curve\(.*)seed=0\)", r"\1seed=0, progress=False)", code)
    namespace: dict = {}
    exec(compile(code, "docs mode connectivity", "exec"), namespace)
    assert namespace["post"].num_chains == 10 and namespace["on_line"].accuracy.shape == (21,)
    assert isinstance(namespace["curve"], curves.Curve) and namespace["curve"].config["num_steps"] == 20
