"""One fitted posterior's row of :func:`bnn_pyro.compare`'s table: held-out metrics and diagnostics.

Every number comes from the public metrics (:mod:`bnn_pyro.metrics`), the function-space summary
(:meth:`Posterior.summary`) and PSIS (:meth:`Posterior.psis`), computed from all of the posterior's draws.
"""

from __future__ import annotations

import math
import warnings

import torch

from bnn_pyro import metrics
from bnn_pyro.posterior import Posterior
from bnn_pyro.predictions import ClassificationPrediction

__all__ = ["REGRESSION", "CLASSIFICATION", "DIAGNOSTICS", "score", "diagnose"]

REGRESSION = ("test_ll", "rmse", "coverage_95", "width_95")
"""Regression columns: mean log predictive density per test point (y's units), RMSE of the predictive mean,
coverage and mean width of the exact central 95% interval of the predictive mixture."""
CLASSIFICATION = ("test_ll", "accuracy", "nll", "ece", "brier")
"""Classification columns: mean log predictive probability of the label (``= -nll``), accuracy of the
model-averaged probabilities, their negative log-likelihood, expected calibration error (15 bins), Brier score."""
DIAGNOSTICS = ("r_hat_max", "ess_bulk_min", "divergences", "k_hat")
"""Diagnostic columns: function-space R-hat (largest) and bulk ESS (smallest) of ``f`` at up to 20 training
inputs, the number of divergent transitions, and the PSIS Pareto k-hat on the training data (NaN where a
quantity is not defined for the method: R-hat with one chain, divergences without a Hamiltonian sampler, k-hat
without a density of the approximation)."""


def score(post: Posterior, x_test, y_test, *, ood=None) -> dict[str, float]:
    """Held-out metrics of ``post`` on ``(x_test, y_test)`` (and ``ood_auroc`` when ``ood`` inputs are given),
    plus ``test_ll_se``: the standard error of ``test_ll`` over the test points (sd of the pointwise log
    predictive density / sqrt(N))."""
    lpd = metrics.log_predictive_density(post, x_test, y_test).double()
    row = {
        "test_ll": float(lpd.mean()),
        "test_ll_se": float(lpd.std() / math.sqrt(len(lpd))) if len(lpd) > 1 else math.nan,
    }
    pred = post.predict(x_test, seed=0)
    if isinstance(pred, ClassificationPrediction):
        row.update(
            accuracy=metrics.accuracy(pred, y_test),
            nll=metrics.nll(pred, y_test),
            ece=metrics.ece(pred, y_test),
            brier=metrics.brier(pred, y_test),
        )
    else:
        lower, upper = _interval(post, x_test, pred)
        y = torch.as_tensor(y_test).reshape(lower.shape).double()
        row.update(
            rmse=metrics.rmse(pred, y_test),
            coverage_95=float(((lower <= y) & (y <= upper)).double().mean()),
            width_95=float((upper - lower).mean()),
        )
    if ood is not None:
        row["ood_auroc"] = metrics.ood_auroc(_ood_score(pred), _ood_score(post.predict(ood, seed=0)))
    return row


def _interval(post: Posterior, x, pred) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact 95% interval of the predictive mixture; the quantiles of the predictive draws where the
    likelihood has no (inverse) CDF or the model is a Pyro function."""
    try:
        return metrics.predictive_interval(post, x, level=0.95)
    except (TypeError, ValueError):
        return pred.lower.reshape(-1).double(), pred.upper.reshape(-1).double()


def _ood_score(pred) -> torch.Tensor:
    """Higher = more likely out of distribution: the entropy of the model-averaged class probabilities
    (classification), the predictive standard deviation (regression: the entropy of a Gaussian with that sd
    grows with it, so both rank inputs alike)."""
    if isinstance(pred, ClassificationPrediction):
        return pred.entropy.reshape(-1)
    return pred.std.reshape(pred.std.shape[0], -1).mean(-1)


def diagnose(post: Posterior) -> dict[str, float]:
    """The :data:`DIAGNOSTICS` of ``post`` (NaN where one is not defined)."""
    row = dict.fromkeys(DIAGNOSTICS, math.nan)
    if post.num_chains * post.num_draws > 3 and post.x is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ArviZ's small-sample notes; the values speak for themselves
            try:
                table = post.summary(space="function", warn=False)
                row["r_hat_max"] = float(table["r_hat"].max())
                row["ess_bulk_min"] = float(table["ess_bulk"].min())
            except (ValueError, TypeError):  # a model without an "f" site
                pass
    from bnn_pyro.posterior import diagnostics  # ArviZ: imported on first use

    diverging = diagnostics.sample_stats(post).get("diverging")  # under ArviZ's name, whatever the engine's
    if diverging is not None:
        row["divergences"] = float(diverging.sum())
    try:
        row["k_hat"] = float(post.psis(warn=False).k_hat)
    except (ValueError, TypeError):  # psis says why it is undefined (a Markov chain, point masses, no data)
        pass
    return row
