"""Tests for bnn_pyro/infer/_aimed_step.py: the step after HMC's warm-up, where a logistic curve fitted to the last
window's (step, acceptance) pairs crosses the target (its use by HMC: tests/infer/test_mcmc.py's acceptance test)."""

from __future__ import annotations

import math

import pytest
import torch

from bnn_pyro.infer._aimed_step import aimed_step


def _curve(steps, b0, b1, centre):
    """The acceptance of the logistic curve ``sigmoid(b0 - b1 (log h - centre))`` at each step."""
    return [1.0 / (1.0 + math.exp(-(b0 - b1 * (math.log(h) - centre)))) for h in steps]


def test_pairs_on_a_logistic_curve_give_its_crossing_of_the_target():
    """Acceptances exactly on a decreasing logistic curve in log h: the fit is exact (the deviance's minimum), so
    the step is the curve's own crossing of the target, to Newton's convergence (1e-8 relative)."""
    steps = [0.05 * 1.2**k for k in range(20)]
    b0, b1, centre = 1.5, 4.0, math.log(0.2)
    for target in (0.6, 0.8, 0.95):
        exact = math.exp(centre + (b0 - math.log(target / (1 - target))) / b1)
        aim = aimed_step(steps, _curve(steps, b0, b1, centre), target)
        assert aim.step == pytest.approx(exact, rel=1e-8) and aim.origin == "crossing"


def test_noisy_acceptances_give_the_crossing_within_its_standard_error():
    """Bernoulli acceptances (0 or 1, the extreme of HMC's noise) from a known curve at 2,000 steps spread in log h,
    seed 0: the fitted crossing ``x* = log h*`` is within 4 standard errors of the curve's, the error from the fit's
    Fisher information (delta method on ``x* = centre + (b0 - logit(target)) / b1`` at the true coefficients)."""
    g = torch.Generator().manual_seed(0)
    n, b0, b1, target = 2000, 0.5, 3.0, 0.8
    logs = (torch.rand(n, generator=g, dtype=torch.float64) * 3 - 1.5).tolist()  # log h in [-1.5, 1.5]
    p = _curve([math.exp(x) for x in logs], b0, b1, 0.0)
    accepts = [float(u < q) for u, q in zip(torch.rand(n, generator=g, dtype=torch.float64).tolist(), p)]
    aim = aimed_step([math.exp(x) for x in logs], accepts, target)
    assert aim.origin == "crossing"  # the fit converged: 2,000 pairs are not cleanly apart
    fitted = math.log(aim.step)
    centre = sum(logs) / n  # the fit's parameterization: b0' - b1 (x - centre), b0' = b0 - b1 centre
    design = torch.tensor([[1.0, centre - x] for x in logs], dtype=torch.float64)
    w = torch.tensor([q * (1 - q) for q in p], dtype=torch.float64)
    cov = torch.linalg.inv(design.T @ (design * w[:, None]))
    c0, logit = b0 - b1 * centre, math.log(target / (1 - target))
    exact = centre + (c0 - logit) / b1
    grad = torch.tensor([1 / b1, -(c0 - logit) / b1**2], dtype=torch.float64)  # d x* / d (b0', b1)
    se = float(grad @ cov @ grad) ** 0.5
    assert abs(fitted - exact) < 4 * se, (fitted, exact, se)


def test_a_slow_fall_then_a_cliff_gives_a_step_short_of_the_crossing():
    """HMC's acceptance is no logistic curve: it falls slowly (here ``1 - a = 0.2 (h / 0.4)^2``, the leapfrog's energy
    error at leading order) and then over a cliff (here to 0 past 0.6: the stability limit). With noise-free responses
    at steps spread in log h across both, the symmetric fitted curve crosses the target (0.8, met at 0.4) short of it,
    on the cliff's safe side: the step is below 0.4, within 15% of it, and the acceptance there above the target (the
    module docstring: why HMC's realized acceptance lies above ``target_accept``). It pins that bias: an aim that
    removes it is expected to fail here, and test_mcmc's realized-acceptance test, until
    benchmarks/results/hmc_acceptance/bias.csv is regenerated (``benchmarks/hmc_acceptance_bias.py --seeds 0-29``)
    and this test updated."""

    def curve(h):
        return 1.0 - 0.2 * (h / 0.4) ** 2 if h <= 0.6 else 0.0

    for lo, hi in ((0.03, 2.0), (0.1, 1.0), (0.2, 0.8)):
        steps = [lo * (hi / lo) ** (k / 29) for k in range(30)]
        step = aimed_step(steps, [curve(h) for h in steps], 0.8).step
        assert 0.85 * 0.4 < step < 0.4 and curve(step) > 0.8, (lo, hi, step)


def test_no_decreasing_curve_keeps_the_callers_step():
    """``None`` (the caller keeps exp(x_bar)): acceptances rising with the step, all equal, or fewer than 3 pairs."""
    steps = [0.1, 0.2, 0.4, 0.8]
    assert aimed_step(steps, [0.1, 0.5, 0.9, 1.0], 0.8) is None
    assert aimed_step(steps, [0.5] * 4, 0.8) is None
    assert aimed_step(steps[:2], [1.0, 0.0], 0.8) is None


def test_a_crossing_outside_the_tried_steps_is_clamped_to_them():
    """The window's steps bound the answer: a curve that crosses the target beyond them gives the nearest one."""
    steps = [0.1, 0.12, 0.14, 0.16]
    high = _curve(steps, 8.0, 2.0, math.log(0.1))  # crosses 0.8 far above 0.16
    low = _curve(steps, -8.0, 2.0, math.log(0.1))  # far below 0.1
    assert aimed_step(steps, high, 0.8) == (pytest.approx(0.16, rel=1e-12), "crossing")
    assert aimed_step(steps, low, 0.8) == (pytest.approx(0.1, rel=1e-12), "crossing")


def test_steps_cleanly_apart_give_the_largest_step_that_reached_the_target():
    """Where accepted and rejected steps are cleanly apart the deviance has no finite minimum, the fitted slope runs to
    its limit and the crossing lands mid-gap, above every accepted step (review 21: 40 accepts at 0.1 and one reject
    at 10 aimed at 0.92; dual averaging on a simulated acceptance cliff put 26 of 400 chains past it, acceptance 0
    after warm-up, and 1 of 400 with this rule). Such a fit gives the largest step that reached the target, and says
    so (``origin`` "capped", review 21 finding 5); a divergent transition's NaN acceptance counts as 0."""
    assert aimed_step([0.1] * 40 + [10.0], [1.0] * 40 + [0.0], 0.8) == (pytest.approx(0.1, rel=1e-12), "capped")
    steps = [0.1, 0.2, 0.3, 0.5, 0.6, 0.7]
    assert aimed_step(steps, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0], 0.8) == (pytest.approx(0.3, rel=1e-12), "capped")
    assert aimed_step(steps, [1.0, 1.0, 1.0, float("nan"), 0.0, 0.0], 0.8) == (pytest.approx(0.3, rel=1e-12), "capped")


@pytest.mark.parametrize(
    "steps, accepts, target, match",
    [
        ([0.1, 0.2], [1.0], 0.8, "steps and accepts must pair up"),
        ([0.1, 0.2, 0.3], [1.0, 0.5, 0.0], 1.0, "target must be an acceptance probability"),
        ([0.1, 0.0, 0.3], [1.0, 0.5, 0.0], 0.8, "every step size must be finite and > 0"),
        ([0.1, 0.2, 0.3], [1.0, 1.5, 0.0], 0.8, "every acceptance must be a probability in"),
        ([0.1, 0.2, 0.3], [1.0, -0.1, 0.0], 0.8, "every acceptance must be a probability in"),
        ([0.1, 0.2, 0.3], [1.0, float("inf"), 0.0], 0.8, "every acceptance must be a probability in"),
        ([0.1, 0.2, 0.3], [float("-inf"), 0.5, 0.0], 0.8, "every acceptance must be a probability in"),
    ],
)
def test_bad_input_names_the_argument(steps, accepts, target, match):
    with pytest.raises(ValueError, match=match):
        aimed_step(steps, accepts, target)
