"""Bayesian linear regression: a BNN with no hidden layer, whose posterior is known exactly.

``y = w^T x + b + N(0, s^2)`` with ``w, b ~ N(0, prior_scale^2)`` and known noise ``s`` is conjugate:
with the design ``X1 = [X, 1]`` the posterior is Gaussian with precision
``L = X1^T X1 / s^2 + I / prior_scale^2`` and mean ``m = L^-1 X1^T y / s^2``. ``entry.exact_posterior()``
returns ``(m, L^-1)`` (float64; weights first, then the bias), the yardstick for every engine.
"""

import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "Bayesian linear regression (exact posterior)",
    "summary": "A BNN without hidden layers is conjugate Bayesian linear regression: the exact Gaussian "
    "posterior is available (entry.exact_posterior()), so any engine can be checked against it.",
    "prior": "Normal(0, 1) on the weights and the bias: the conjugate prior, which makes the posterior exact.",
    "likelihood": "Gaussian with known noise scale 0.5 (known noise keeps the model conjugate).",
    "default_method": "nuts",
    "default_settings": {
        "nuts": {"num_samples": 500, "num_warmup": 300, "num_chains": 2},
        "svi": {"guide": "full_rank", "num_steps": 1500, "lr": 0.02},
    },
    "data": "Synthetic: 40 inputs x ~ N(0, I_2) with correlation 0.8 between the columns, "
    "y = 1.5 x1 - 0.7 x2 + 0.3 + N(0, 0.5^2), generated with torch seed 0 (test: 200 more, seed 1).",
    "references": [
        "Bishop, C. M. (2006). Pattern Recognition and Machine Learning, section 3.3. Springer.",
        "Magnusson, M. et al. (2023). posteriordb: testing, benchmarking and developing Bayesian "
        "inference algorithms. arXiv:2407.04967.",
    ],
}


def make_data(n: int, seed: int, correlation: float = 0.8, noise: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 1, generator=g)
    x = correlation**0.5 * z + (1 - correlation) ** 0.5 * torch.randn(n, 2, generator=g)
    y = x @ torch.tensor([1.5, -0.7]) + 0.3 + noise * torch.randn(n, generator=g)
    return x, y


def build(*, n: int = 40, noise: float = 0.5, prior_scale: float = 1.0, seed: int = 0) -> Entry:
    x, y = make_data(n, seed, noise=noise)
    x_test, y_test = make_data(200, seed + 1, noise=noise)
    torch.manual_seed(seed)
    model = bp.BNN(
        torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, prior_scale), likelihood=bp.likelihoods.Gaussian(scale=noise)
    )

    def exact_posterior():
        """``(mean, cov)`` of ``[weight_1, weight_2, bias]`` in float64."""
        X1 = torch.cat([x, torch.ones(len(x), 1)], 1).double()
        precision = X1.T @ X1 / noise**2 + torch.eye(3, dtype=torch.double) / prior_scale**2
        cov = torch.linalg.inv(precision)
        return cov @ X1.T @ y.double() / noise**2, cov

    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="bayesian_linear_regression",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
        extras={"exact_posterior": exact_posterior},
    )
