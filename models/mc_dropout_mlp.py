"""MC dropout (Gal & Ghahramani 2016) on the 1-D regression with a gap, with the model's own prior.

Dropout as approximate inference: the variational family is ``W = M diag(z)`` with Bernoulli masks
``z`` on each layer's input units, and the weight decay is the Normal prior (see
:mod:`bnn_pyro.infer.dropout` for the derivation). The card is candid about the method: a fixed
rate adds noise that the fit cannot remove, and a learned rate shrinks towards no dropout at all.
"""

import pyro.distributions as dist
import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "MC dropout MLP on 1-D data with a gap",
    "summary": "Dropout masks as a variational family: the predictive averages over masks. With the fixed rate "
    "p = 0.1 the mask noise (sd ~0.2) exceeds the data noise (0.1), so the fit is loose on the data "
    "and, like other single-mode families, barely wider in the gap (Foong et al. 2019); "
    "rate='concrete' or 'reinforce' learns p (it falls towards 0 here: near-MAP, little uncertainty).",
    "prior": "Normal(0, 1) on every weight and bias; under Bernoulli masks it acts as the weight decay "
    "(1 - p) / (2 s^2 N) per datum of Gal's objective.",
    "likelihood": "Gaussian, noise sigma ~ HalfNormal(0.5) (site 'sigma'), point-estimated (MAP) beside the masks.",
    "default_method": "mc_dropout",
    "default_settings": {
        "mc_dropout": {"p": 0.1, "num_steps": 3000, "lr": 0.01, "num_samples": 500},
        "svi": {
            "guide": "mean_field",
            "num_steps": 3000,
            "lr": 0.02,
            "lr_schedule": "cosine",
            "num_particles": 4,
            "num_samples": 500,
        },
    },
    "data": "bp.datasets.toy_gap() (80 points, x in [-2, -0.5] and [0.5, 2]); test: 200 fresh points on [-2, 2], "
    "gap included (as in mlp_regression).",
    "references": [
        "Gal, Y. & Ghahramani, Z. (2016). Dropout as a Bayesian approximation: representing model "
        "uncertainty in deep learning. ICML.",
        "Gal, Y., Hron, J. & Kendall, A. (2017). Concrete dropout. NeurIPS.",
        "Foong, A. Y. K. et al. (2019). 'In-between' uncertainty in Bayesian neural networks. arXiv:1906.11537.",
    ],
}


def build(*, hidden: int = 50, p: float = 0.1, seed: int = 0) -> Entry:
    from bnn_pyro.models.mlp_regression import test_data

    x, y = bp.datasets.toy_gap()
    x_test, y_test = test_data()
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    model = bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(0.5))
    )
    defaults = fit_defaults(CARD, seed=seed)
    defaults["mc_dropout"]["p"] = p
    return Entry(
        name="mc_dropout_mlp",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
    )
