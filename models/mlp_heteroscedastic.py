"""A BNN whose second output is the input-dependent noise scale: aleatoric vs epistemic uncertainty.

The net outputs ``[mu(x), rho(x)]`` and ``y ~ Normal(mu, softplus(rho) + 1e-3)``. The predictive
variance splits by the law of total variance into the mean over draws of the noise variance
(aleatoric: ``pred.aleatoric_std``, it grows with ``x`` here as the data's noise does) and the
variance over draws of ``mu`` (epistemic: ``pred.epistemic_std``, it grows away from the data).
``entry.true_noise_sd(x)`` gives the generating noise to compare ``pred.aleatoric_std`` with.
"""

import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "Heteroscedastic MLP regression (aleatoric vs epistemic)",
    "summary": "The network predicts a mean and a noise scale per input; predictions separate the "
    "input-dependent data noise (aleatoric) from the uncertainty about the weights (epistemic).",
    "prior": "Normal(0, 1) on every weight and bias: unit-scale inputs and outputs, and a noise head "
    "whose softplus then ranges over plausible scales (about 0.05 to 2).",
    "likelihood": "HeteroscedasticGaussian: y ~ Normal(mu(x), softplus(rho(x)) + 1e-3).",
    "default_method": "svi",
    "default_settings": {
        "svi": {
            "guide": "mean_field",
            "num_steps": 3000,
            "lr": 0.02,
            "lr_schedule": "cosine",
            "num_particles": 4,
            "num_samples": 500,
        },
        "nuts": {"num_samples": 200, "num_warmup": 200, "num_chains": 2, "max_tree_depth": 8},
    },
    "data": "bp.datasets.heteroscedastic(n=200, seed=0): y = sin(x) + N(0, (0.05 + 0.1 (x + 3))^2); "
    "test: heteroscedastic(n=200, seed=1).",
    "references": [
        "Nix, D. A. & Weigend, A. S. (1994). Estimating the mean and variance of the target "
        "probability distribution. ICNN.",
        "Kendall, A. & Gal, Y. (2017). What uncertainties do we need in Bayesian deep learning for "
        "computer vision? NeurIPS.",
    ],
}


def build(*, hidden: int = 50, prior_scale: float = 1.0, n: int = 200, seed: int = 0) -> Entry:
    x, y = bp.datasets.heteroscedastic(n=n, seed=seed)
    x_test, y_test = bp.datasets.heteroscedastic(n=200, seed=seed + 1)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, prior_scale), likelihood=bp.likelihoods.HeteroscedasticGaussian())
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="mlp_heteroscedastic",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
        extras={"true_noise_sd": bp.datasets.heteroscedastic_noise_sd},
    )
