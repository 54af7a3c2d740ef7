"""A small LeNet-style convolutional BNN on scikit-learn's 8x8 digit images.

Any ``torch.nn.Module`` becomes Bayesian, conv layers included: every kernel and bias gets a prior
(``PyroSample``); minibatch SVI scales the likelihood by ``dataset_size / batch``.
"""

import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "LeNet-style conv BNN on 8x8 digits",
    "summary": "A convolutional network (conv-pool-conv-pool-dense) made Bayesian without new layer "
    "classes, fitted by minibatch SVI on 1,437 images of handwritten digits.",
    "prior": "LayerwiseNormal('kaiming'): N(0, 2/fan_in) per layer (fan-in counts kernel size times input "
    "channels), the variance that keeps ReLU activations of stable scale through the layers.",
    "likelihood": "Categorical(logits = net(x)) over the 10 digits.",
    "default_method": "svi",
    "default_settings": {
        "svi": {
            "guide": "mean_field",
            "num_steps": 1500,
            "batch_size": 128,
            "lr": 0.01,
            "init_scale": 0.001,
            "num_samples": 100,
        }
    },
    "data": "bp.datasets.digits_images(): scikit-learn's bundled copy of the UCI optical digits, 1,797 images "
    "(1, 8, 8) with pixels in [0, 1]; stratified 80/20 split with seed 0.",
    "references": [
        "LeCun, Y. et al. (1998). Gradient-based learning applied to document recognition. Proc. IEEE.",
        "Blundell, C. et al. (2015). Weight uncertainty in neural networks. ICML.",
        "Alpaydin, E. & Kaynak, C. (1998). Optical recognition of handwritten digits. UCI Machine Learning Repository.",
    ],
}


def build(*, channels: tuple = (6, 16), hidden: int = 32, seed: int = 0) -> Entry:
    x, y = bp.datasets.digits_images()
    x, y, x_test, y_test = bp.datasets.train_test_split(x, y, test_fraction=0.2, seed=seed, stratify=True)
    c1, c2 = channels
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4 -> 2x2
        nn.Flatten(),
        nn.Linear(4 * c2, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )
    model = bp.BNN(net, prior=bp.priors.LayerwiseNormal("kaiming"), likelihood=bp.likelihoods.Categorical())
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="lenet",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="classification",
        fit_defaults=defaults,
        card=CARD,
    )
