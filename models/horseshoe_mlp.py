"""An MLP under a horseshoe prior that finds which of its 10 inputs matter (2 of them do).

The horseshoe gives each input unit of a layer a local scale ``lambda_j ~ HalfCauchy(1)`` under a
per-layer global scale ``tau``: most weights are shrunk hard to zero, a few escape. The posterior
of the first layer's ``lambda`` (``entry.input_relevance(post)``) ranks the inputs.
"""

import pyro.distributions as dist
import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "Horseshoe MLP: automatic input relevance",
    "summary": "A horseshoe prior on the weights shrinks the 8 irrelevant inputs of a 10-input regression "
    "toward zero; the first layer's local scales rank the inputs.",
    "prior": "bp.priors.Horseshoe(global_scale=0.1) on the weights (per-layer tau, per-input-unit lambda): "
    "sparsity with heavy tails, so relevant inputs are not shrunk; Normal(0, 1) on the biases.",
    "likelihood": "Gaussian, noise sigma ~ HalfNormal(0.5) (site 'sigma'), learned.",
    "default_method": "svi",
    "default_settings": {
        "svi": {
            "guide": "mean_field",
            "num_steps": 2500,
            "lr": 0.02,
            "lr_schedule": "cosine",
            "num_particles": 4,
            "num_samples": 500,
        },
        "nuts": {"num_samples": 200, "num_warmup": 300, "num_chains": 2, "max_tree_depth": 8, "target_accept": 0.95},
    },
    "data": "Synthetic: x ~ N(0, I_10), y = sin(2 x_0) + 0.5 x_1 + N(0, 0.1^2); 200 training points "
    "(torch seed 0), 200 test points (seed 1). Only inputs 0 and 1 are relevant.",
    "references": [
        "Carvalho, C. M., Polson, N. G. & Scott, J. G. (2010). The horseshoe estimator for sparse "
        "signals. Biometrika 97(2).",
        "Ghosh, S., Yao, J. & Doshi-Velez, F. (2019). Model selection in Bayesian neural networks via "
        "horseshoe priors. JMLR 20(182).",
    ],
}


def make_data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return x, torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.1 * torch.randn(n, generator=g)


def build(*, hidden: int = 20, global_scale: float = 0.1, seed: int = 0) -> Entry:
    x, y = make_data(200, seed)
    x_test, y_test = make_data(200, seed + 1)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(10, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    prior = {"*.weight": bp.priors.Horseshoe(global_scale=global_scale), "*.bias": dist.Normal(0.0, 1.0)}
    model = bp.BNN(net, prior=prior, likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(0.5)))

    def input_relevance(posterior) -> torch.Tensor:
        """Posterior median of ``tau * lambda_j`` for each of the 10 inputs (first layer)."""
        s = posterior.samples
        scale = s["0.weight_tau"].reshape(-1, 1) * s["0.weight_lambda"].reshape(-1, 10)
        return scale.median(0).values

    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="horseshoe_mlp",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
        extras={"input_relevance": input_relevance},
    )
