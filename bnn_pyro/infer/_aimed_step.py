"""HMC's step size after warm-up, aimed at ``target_accept``: the step at which a curve fitted to the last
adaptation window's ``(step, acceptance)`` pairs crosses the target.

Pyro's ``WarmupAdapter`` (Stan's scheme) ends warm-up at ``exp(x_bar)``, the weighted average of the dual-averaging
iterates ``x_t = log h_t`` of the window after the last metric update (50 iterations, restarted at
``log(10 h)``). Dual averaging makes the acceptance *averaged over those iterates* ~ the target, not the acceptance at
their average: where the acceptance falls from ~1 to ~0 over a narrow band of steps (the leapfrog's stability limit,
on a Gaussian and on a BNN alike), the iterates saw-tooth across the band (one rejection cuts ``h`` ~10x, a few
acceptances climb back) and their log-average lies below it, where the acceptance is 0.93-0.97 for a 0.8 target
(``benchmarks/results/hmc_acceptance/``). HMC with a fixed number of leapfrog steps then runs a trajectory shorter
than the target allows at the same cost per draw. Those same pairs locate the band: a decreasing logistic curve
``a = sigmoid(b0 - b1 log h)``, fitted by Newton on the binomial deviance with the acceptances as fractional
responses, crosses the target at the returned step (kept within the steps the window tried).

The realized acceptance lies ABOVE the target, by the curve's form: a logistic is symmetric in ``log h``, the
acceptance is not. It falls slowly from 1 (``1 - a`` grows as a power of ``h``, the leapfrog's energy error), then
over a cliff (the leapfrog's stability limit), and a symmetric curve fitted to pairs on both sides crosses the
target short of the step at which the acceptance meets it. On the exact Gaussian of ``tests/infer/test_mcmc.py``'s
HMC tests the returned step is 14% short and its exact acceptance 0.869 (0.78-0.91 over 30 seeds; 0.874 with
noise-free responses at the window's steps: the form's error, not the noise), against 0.95 at ``exp(x_bar)``
(``benchmarks/results/hmc_acceptance/bias.md``); BNN chains realized 0.835 (0.73-0.90 over 116 chains on five data
sets) against 0.91 (``benchmarks/results/hmc_acceptance/validation_fits.csv``). The error is on the cliff's safe
side, where an overshoot would cost every draw; the target is what the step aims at, not what it realizes.

Usage::

    aim = aimed_step([0.05, 0.4, 0.2, 0.6], [1.0, 0.7, 0.98, 0.0], target=0.8)  # None: keep exp(x_bar)
    aim.step, aim.origin  # the step, and "crossing" or "capped": which rule gave it (aimed_step's docstring)
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["aimed_step", "AimedStep"]

_NEWTON_STEPS = 100


class AimedStep(NamedTuple):
    """The step after warm-up and the rule that gave it: ``origin`` ``"crossing"`` (the fitted curve's crossing of
    the target, clamped to the steps tried) or ``"capped"`` (the fit did not converge and its crossing lay above the
    largest step that reached the target, which is the step). HMC records it per chain
    (``Posterior.config["step_size_origin"]``), so that a chain's step can be traced to its rule."""

    step: float
    origin: str


def aimed_step(steps: list[float], accepts: list[float], target: float) -> AimedStep | None:
    """The step where the logistic curve fitted to ``(steps, accepts)`` (module docstring) equals ``target``,
    clamped to ``[min(steps), max(steps)]``, and, where the fit does not converge (the steps accepted and rejected
    cleanly apart), to the largest step whose acceptance reached ``target`` (``min(steps)`` where none did), with the
    rule that gave it (:class:`AimedStep`: ``"capped"`` where that cap decided the step); ``None``
    where there is no decreasing curve to read (fewer than 3 pairs, the acceptances not falling with the step, a
    singular fit), and the caller keeps its step. A NaN acceptance (a divergent transition) counts as 0; one outside
    ``[0, 1]`` (or infinite) is a ``ValueError``: the curve is fitted to probabilities."""
    if len(steps) != len(accepts):
        raise ValueError(f"aimed_step: steps and accepts must pair up; got {len(steps)} and {len(accepts)} values.")
    if not 0.0 < target < 1.0:
        raise ValueError(f"aimed_step: target must be an acceptance probability in (0, 1); got {target!r}.")
    if not all(h > 0 and math.isfinite(h) for h in steps):
        raise ValueError(f"aimed_step: every step size must be finite and > 0; got {list(steps)[:8]}.")
    accepts = [0.0 if math.isnan(a) else float(a) for a in accepts]  # a divergent transition accepts nothing
    if not all(0.0 <= a <= 1.0 for a in accepts):  # the fit's responses are probabilities; +-inf is none either
        raise ValueError(
            f"aimed_step: every acceptance must be a probability in [0, 1] (NaN counts as 0); got {list(accepts)[:8]}."
        )
    if len(steps) < 3:
        return None
    logs = [math.log(h) for h in steps]
    centre = sum(logs) / len(logs)
    d = [centre - x for x in logs]  # the curve rises with d: a decreasing acceptance in log h
    b0 = b1 = 0.0
    converged = False
    for _ in range(_NEWTON_STEPS):
        g0 = g1 = h00 = h01 = h11 = 0.0
        for di, a in zip(d, accepts):
            p = _sigmoid(b0 + b1 * di)
            w = p * (1.0 - p)
            g0, g1 = g0 + (a - p), g1 + (a - p) * di
            h00, h01, h11 = h00 + w, h01 + w * di, h11 + w * di * di
        det = h00 * h11 - h01 * h01
        if not det > 0:
            break
        m0, m1 = (h11 * g0 - h01 * g1) / det, (h00 * g1 - h01 * g0) / det
        b0, b1 = b0 + m0, b1 + m1
        if max(abs(m0), abs(m1)) < 1e-10:
            converged = True
            break
    if not (math.isfinite(b0) and math.isfinite(b1) and b1 > 0):
        return None
    crossing = centre + (b0 - math.log(target / (1.0 - target))) / b1
    top = max(logs)
    if not converged:  # accepted and rejected steps cleanly apart: the deviance has no finite minimum, the slope runs
        # to its limit and the crossing lands mid-gap, above every accepted step (review 21: 40 accepts at 0.1 and one
        # reject at 10 aimed at 0.92; past a cliff, acceptance 0 after warm-up): no further than the largest step that
        # reached the target (the smallest tried, where none did)
        reached = [x for x, a in zip(logs, accepts) if a >= target]
        top = max(reached) if reached else min(logs)
    clamped = max(crossing, min(logs))
    return AimedStep(math.exp(min(clamped, top)), "capped" if not converged and clamped > top else "crossing")


def _sigmoid(eta: float) -> float:
    if eta >= 0:
        return 1.0 / (1.0 + math.exp(-eta))
    e = math.exp(eta)
    return e / (1.0 + e)
