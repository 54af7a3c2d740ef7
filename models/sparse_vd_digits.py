"""Sparse variational dropout (Molchanov et al. 2017) on scikit-learn's 8x8 digits: a pruned BNN.

Each weight gets its own dropout rate ``alpha`` under a log-uniform prior; weights whose
``log alpha`` exceeds 3 carry no signal and are set to zero in every draw. The fitted posterior
reports per-layer sparsity (``bnn_pyro.infer.variational_dropout.sparsity_report``).
"""

import torch

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "Sparse variational dropout MLP on 8x8 digits",
    "summary": "A 64-100-10 MLP whose weights are pruned by their learned dropout rates: most weights "
    "are removed (compression |W| / |W != 0| of roughly 30x) at little cost in accuracy; "
    "sparsity_report(post) gives the per-layer table.",
    "prior": "Log-uniform p(|w|) ~ 1/|w| on the Linear weights (the prior that makes the KL a function of alpha "
    "alone, so alpha can grow without bound and prune). The biases keep the model's prior, "
    "LayerwiseNormal('radford'), with a mean-field Gaussian; the other engines use that prior for the "
    "weights too, sparse_vd replaces it and records config['prior'] = 'log-uniform'.",
    "likelihood": "Categorical(logits = net(x)) over the 10 digits.",
    "default_method": "sparse_vd",
    "default_settings": {
        "sparse_vd": {"num_steps": 2000, "lr": 0.01, "num_samples": 200},
        "svi": {"guide": "mean_field", "num_steps": 2000, "batch_size": 128, "lr": 0.02, "num_samples": 300},
    },
    "data": "scikit-learn's bundled 8x8 digits (1,797 images as 64 pixels in [0, 1]); stratified 80/20 split "
    "with seed 0 (as mlp_classifier with dataset='digits').",
    "references": [
        "Molchanov, D., Ashukha, A. & Vetrov, D. (2017). Variational dropout sparsifies deep neural networks. ICML.",
        "Kingma, D. P., Salimans, T. & Welling, M. (2015). Variational dropout and the local "
        "reparameterization trick. NeurIPS.",
        "Alpaydin, E. & Kaynak, C. (1998). Optical recognition of handwritten digits. UCI Machine Learning Repository.",
    ],
}


def build(*, hidden: int = 100, seed: int = 0) -> Entry:
    x, y, x_test, y_test = bp.datasets.train_test_split(
        *bp.datasets.load_sklearn("digits"), test_fraction=0.2, seed=seed, stratify=True
    )
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    model = bp.BNN(net, prior=bp.priors.LayerwiseNormal("radford"), likelihood=bp.likelihoods.Categorical())
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="sparse_vd_digits",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="classification",
        fit_defaults=defaults,
        card=CARD,
    )
