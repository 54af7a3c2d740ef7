"""A one-hidden-layer tanh BNN on 1-D data with a gap; the noise scale is learned under a prior.

Confident on the two clusters, uncertain inside the gap and beyond the data: the textbook picture
of epistemic uncertainty. The noise ``sigma`` is a latent site with its own prior, inferred jointly
with the weights (homoscedastic: one ``sigma`` for every input).
"""

import pyro.distributions as dist
import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "MLP regression on 1-D data with a gap (learned noise)",
    "summary": "Epistemic uncertainty grows in the gap between two data clusters and outside the data; "
    "the homoscedastic noise scale is learned jointly with the weights.",
    "prior": "Normal(0, 1) on every weight and bias (inputs and targets are of unit scale, so unit-variance "
    "weights give functions of the right amplitude and wiggliness).",
    "likelihood": "Gaussian, noise sigma ~ HalfNormal(0.5) (site 'sigma'), learned with the weights.",
    # nuts: at the svi settings below the mean-field guide collapses to a flat mean with sigma ~0.96
    # (test RMSE 0.66, as after 10 steps), and that is the ELBO's optimum here, not a short run: the
    # collapsed fit's loss (~190) beats a fit started from the MAP (~226, test RMSE 0.22) and a
    # full-rank guide (~233, RMSE 0.49); learned prior scales (empirical_bayes) collapse it too.
    # bp.fit warns about such a fit. nuts at its settings: test RMSE 0.097, log-likelihood 0.79. Seeds 0-2 and
    # variants (benchmarks/results/zoo_svi_collapse/results.md): kl_warmup=0.9 predicts well (test LL 0.01) at a
    # worse ELBO (loss ~224 against ~190), so these settings are not the cause and a warm-up would only stop short.
    "default_method": "nuts",
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
    "data": "bp.datasets.toy_gap(): 80 points, x in [-2, -0.5] and [0.5, 2], y = sin(3x) + 0.3x + N(0, 0.1^2) "
    "(bundled CSV, generated once with seed 0). Test: 200 fresh points from the same function on "
    "[-2, 2] (gap included), seed 1.",
    "references": [
        "MacKay, D. J. C. (1992). A practical Bayesian framework for backpropagation networks. "
        "Neural Computation 4(3).",
        "Neal, R. M. (1996). Bayesian Learning for Neural Networks. Springer.",
        "Foong, A. Y. K. et al. (2019). 'In-between' uncertainty in Bayesian neural networks. arXiv:1906.11537.",
    ],
}


def test_data(n: int = 200, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    return x, torch.sin(3 * x[:, 0]) + 0.3 * x[:, 0] + 0.1 * torch.randn(n, generator=g)


def build(*, hidden: int = 50, prior_scale: float = 1.0, noise_prior: float = 0.5, seed: int = 0) -> Entry:
    x, y = bp.datasets.toy_gap()
    x_test, y_test = test_data()
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    model = bp.BNN(
        net,
        prior=bp.priors.Normal(0.0, prior_scale),
        likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(noise_prior)),
    )
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="mlp_regression",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
    )
