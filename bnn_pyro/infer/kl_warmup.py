"""KL annealing (warm-up) for SVI: ``bp.fit(..., method="svi", kl_warmup=0.2)``.

The ELBO ``E_q[log p(y | w)] - KL(q || p)`` is optimized with the KL term weighted by ``beta``, rising linearly
from ``1 / W`` to 1 over the first ``W = kl_warmup * num_steps`` steps and 1 after them (Blundell et al. 2015,
section 3.4; Sønderby et al. 2016, "warm-up"): early steps fit the data before the prior pulls the guide's weights
towards it, which is meant to keep a mean-field guide out of the over-pruned optimum (units switched off at the
prior) that it can otherwise settle in on small data sets. After the warm-up the objective is the ELBO itself, so
the fitted guide answers the same question; only the path to it changes.

How: a Pyro ``Messenger`` (:class:`KLWeight`) around both the model and the guide multiplies the log density of
every latent (not observed) sample site by ``beta``; with ``Trace_ELBO`` the estimator is then
``log p(y | w) + beta * (log p(w) - log q(w))``, an unbiased estimate of the weighted objective, and with the
closed-form KL (``elbo="mean_field"``) the KL of each site is scaled by the same ``beta``. SVI's flat fast path
weighs the same terms in its hand-written gradient (:func:`bnn_pyro.infer._analytic_elbo.negative_elbo`); with the
closed-form KL a warm-up runs Pyro's path.

Example
-------
>>> weight = KLWeight(warmup_steps=1000)
>>> weight.at(499)        # beta at step 499 (0-based): 0.5
"""

from __future__ import annotations

from pyro.poutine.messenger import Messenger

__all__ = ["KLWeight", "kl_weight", "warmup_steps"]


def warmup_steps(kl_warmup: float, num_steps: int) -> int:
    """The number of warm-up steps for ``kl_warmup`` (a fraction of the run in ``[0, 1)``); 0 for none.

    Raises ``ValueError`` naming ``kl_warmup`` when it is not a number in ``[0, 1)``."""
    if isinstance(kl_warmup, bool) or not isinstance(kl_warmup, (int, float)) or not 0.0 <= kl_warmup < 1.0:
        raise ValueError(
            f"kl_warmup: expected the fraction of num_steps over which the KL weight rises from 0 to 1, a number in "
            f"[0, 1), got {kl_warmup!r}; try 0.2, or 0 for none."
        )
    return round(kl_warmup * num_steps)


def kl_weight(step: int, warmup_steps: int) -> float:
    """The KL weight ``beta`` at the 0-based ``step`` of a warm-up over ``warmup_steps`` steps: ``(step + 1) / W`` up
    to 1 (1 throughout without a warm-up); shared with variational dropout's ``kl_warmup``."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


class KLWeight(Messenger):
    """Multiplies the log density of every latent sample site by :attr:`beta` (see the module docstring);
    :meth:`at` sets it for a step."""

    def __init__(self, warmup_steps: int):
        super().__init__()
        self.warmup_steps = warmup_steps
        self.beta = kl_weight(0, warmup_steps)

    def at(self, step: int) -> float:
        """Set and return ``beta`` for the 0-based ``step`` (:func:`kl_weight`)."""
        self.beta = kl_weight(step, self.warmup_steps)
        return self.beta

    def _process_message(self, msg):
        if msg["type"] == "sample" and not msg["is_observed"] and self.beta != 1.0:
            msg["scale"] = msg["scale"] * self.beta
