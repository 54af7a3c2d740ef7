"""NumPyro's BNN example as a plain Pyro function: one ``pyro.sample`` per weight matrix.

The zoo is not only converted ``nn.Module``\\ s: any Pyro function that follows the site conventions
(``pyro.deterministic("f", ...)`` for the network output, ``"obs"`` inside ``pyro.plate("data")``,
a ``dataset_size=`` keyword for minibatches) works with every engine, prediction and diagnostic.
"""

from functools import partial

import numpy as np
import pyro
import pyro.distributions as dist
import torch

from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "Explicit two-hidden-layer BNN (NumPyro's BNN example as a Pyro function)",
    "summary": "A hand-written Pyro model, one sample site per weight matrix (w1, w2, w3) and a learned "
    "observation precision: the zoo and every engine take plain Pyro functions, not only nn.Modules.",
    "prior": "Normal(0, 1) on every weight matrix (no biases), as in the NumPyro example; Gamma(3, 1) on "
    "the observation precision.",
    "likelihood": "Gaussian, sigma = 1 / sqrt(prec_obs), prec_obs learned (site 'prec_obs').",
    "default_method": "nuts",
    "default_settings": {
        "nuts": {"num_samples": 150, "num_warmup": 150, "num_chains": 2, "max_tree_depth": 7, "init": "prior"},
        "svi": {"guide": "mean_field", "num_steps": 2000, "lr": 0.02, "num_samples": 200},
    },
    "data": "Synthetic, as in NumPyro's examples/bnn.py: N = 50 inputs on [-1, 1] with features (1, x, x^2), "
    "y = X W + 0.5 (0.5 + x)^2 sin(4x) + N(0, 0.05^2), W ~ 0.5 N(0, I) (numpy seed 0), y standardized; "
    "test: 100 inputs on [-1.3, 1.3] with the noise-free function, standardized alike.",
    "references": [
        "NumPyro examples: Bayesian neural network, https://num.pyro.ai/en/stable/examples/bnn.html",
        "Neal, R. M. (1996). Bayesian Learning for Neural Networks. Springer.",
    ],
}


def model(x, y=None, *, hidden: int = 5, dataset_size: int | None = None):
    d = x.shape[1]
    w1 = pyro.sample("w1", dist.Normal(torch.zeros(d, hidden), 1.0).to_event(2))
    w2 = pyro.sample("w2", dist.Normal(torch.zeros(hidden, hidden), 1.0).to_event(2))
    w3 = pyro.sample("w3", dist.Normal(torch.zeros(hidden, 1), 1.0).to_event(2))
    prec_obs = pyro.sample("prec_obs", dist.Gamma(3.0, 1.0))
    f = torch.tanh(torch.tanh(x @ w1) @ w2) @ w3
    with pyro.plate("data", size=dataset_size or x.shape[0], subsample=torch.arange(x.shape[0])):
        pyro.deterministic("f", f, event_dim=1)
        return pyro.sample("obs", dist.Normal(f[:, 0], prec_obs.rsqrt()), obs=y)


def make_data(n: int = 50, n_test: int = 100, sigma_obs: float = 0.05):
    rng = np.random.RandomState(0)
    features = lambda t: np.power(t[:, None], np.arange(3))  # noqa: E731 - (1, x, x^2)
    w = 0.5 * rng.randn(3)
    truth = lambda X: X @ w + 0.5 * (0.5 + X[:, 1]) ** 2 * np.sin(4.0 * X[:, 1])  # noqa: E731
    x, x_test = features(np.linspace(-1, 1, n)), features(np.linspace(-1.3, 1.3, n_test))
    y = truth(x) + sigma_obs * rng.randn(n)
    mean, std = y.mean(), y.std()
    as_t = lambda a: torch.tensor(a, dtype=torch.get_default_dtype())  # noqa: E731
    return as_t(x), as_t((y - mean) / std), as_t(x_test), as_t((truth(x_test) - mean) / std)


def build(*, hidden: int = 5, seed: int = 0) -> Entry:
    x, y, x_test, y_test = make_data()
    fn = partial(model, hidden=hidden)
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="explicit_mlp",
        model=fn,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="regression",
        fit_defaults=defaults,
        card=CARD,
    )
