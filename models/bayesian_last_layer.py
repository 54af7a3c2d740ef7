"""A Bayesian last layer on a pretrained, frozen feature extractor (8x8 digits).

A deterministic MLP is trained by plain torch (Adam, cross-entropy; seconds, measured in
benchmarks/results/docstring_figures/results.md) on the
training digits; its hidden layers become a frozen backbone (``requires_grad_(False)``: every engine keeps
them at the trained values) and a fresh ``nn.Linear`` head on its features is the only Bayesian part
(``bayesian=["1.*"]``). The head's posterior is a Bayesian multinomial logistic regression on learned
features (Kristiadi et al. 2020; Laplace Redux), cheap enough for NUTS; SVI and Laplace fit it too.

Extras: ``entry.deterministic_net()`` (the pretrained net with its own trained head, the baseline),
``entry.features(x)`` (the backbone's output) and ``entry.ood()`` (out-of-distribution inputs: the test
images with their pixels shuffled by one fixed permutation, same pixel values, no digit structure).
"""

import copy

import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults
from bnn_pyro.infer.shared import torch_threads

CARD = {
    "title": "Bayesian last layer on a frozen, locally trained MLP backbone (8x8 digits)",
    "summary": "Only the head is Bayesian: a deterministic feature extractor trained in seconds with plain torch "
    "is frozen (requires_grad=False), and SVI, Laplace or NUTS give a posterior over the last "
    "nn.Linear layer alone (330 weights), a multinomial logistic regression on learned features.",
    "prior": "Normal(0, 1) on the head's weights and biases. The backbone ends in a fixed standardization of its "
    "32 features (zero mean, unit sd on the training rows), so a priori each logit has sd ~sqrt(33) ~ 5.7: "
    "confident predictions are plausible, not forced. Without the standardization (raw ReLU features, "
    "mean 3.9) the bias and the weights were strongly correlated and every NUTS transition took 127 "
    "leapfrog steps; with it, 63.",
    "likelihood": "Categorical(logits = head(backbone(x))) over the 10 digits.",
    "default_method": "laplace",
    "default_settings": {
        "laplace": {"num_samples": 500},
        "svi": {"guide": "mean_field", "num_steps": 1500, "lr": 0.02, "num_samples": 500},
        "nuts": {"num_samples": 200, "num_warmup": 200, "num_chains": 2, "max_tree_depth": 8},
    },
    "data": "scikit-learn's bundled 8x8 digits (bp.datasets.load_sklearn('digits'), 1,797 images, pixels in "
    "[0, 1]), stratified 80/20 split with seed 0; the backbone is trained on the training split only. "
    "OOD inputs (entry.ood()): the test images with pixels permuted by a fixed permutation (seed 0).",
    "references": [
        "Kristiadi, A., Hein, M., Hennig, P. (2020). Being Bayesian, even just a bit, fixes "
        "overconfidence in ReLU networks. ICML.",
        "Daxberger, E. et al. (2021). Laplace Redux: effortless Bayesian deep learning. NeurIPS.",
        "Snoek, J. et al. (2015). Scalable Bayesian optimization using deep neural networks. ICML "
        "(a Bayesian last layer on learned features).",
        "Alpaydin, E. & Kaynak, C. (1998). Optical recognition of handwritten digits. UCI Machine Learning Repository.",
    ],
}

BACKBONE_STEPS = 300  # full-batch Adam steps of the deterministic net (one torch thread; seconds)


def train_backbone(
    x: torch.Tensor, y: torch.Tensor, *, hidden: int, features: int, seed: int, steps: int = BACKBONE_STEPS
) -> nn.Sequential:
    """A deterministic MLP ``x -> hidden -> features -> classes`` (ReLU) trained by full-batch Adam
    (lr 1e-2, weight decay 1e-4) on cross-entropy; returns it in eval mode, its parameters trainable."""
    gen = torch.Generator().manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(x.shape[1], hidden),
        nn.ReLU(),
        nn.Linear(hidden, features),
        nn.ReLU(),
        nn.Linear(features, int(y.max()) + 1),
    )
    with torch.no_grad():  # seeded here, apart from torch's global generator
        for layer in (net[0], net[2], net[4]):
            bound = layer.in_features**-0.5
            layer.weight.copy_(torch.empty_like(layer.weight).uniform_(-bound, bound, generator=gen))
            layer.bias.copy_(torch.empty_like(layer.bias).uniform_(-bound, bound, generator=gen))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    with torch_threads(1):  # small tensors: extra threads only spin against other work (see bp.fit's num_threads)
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return net.eval()


def standardizer(h: torch.Tensor) -> nn.Linear:
    """A fixed ``nn.Linear`` mapping features ``h`` (``(N, F)``) to zero mean and unit sd per column on these
    rows (constant columns, e.g. dead ReLU units, to 0): decorrelates the head's bias from its weights, which
    NUTS with a diagonal mass matrix needs (raw ReLU features, mean 3.9: every transition at tree depth 7)."""
    mean, sd = h.mean(0), h.std(0)
    scale = torch.where(sd > 1e-6, 1.0 / sd, torch.zeros_like(sd))
    layer = nn.Linear(h.shape[1], h.shape[1])
    with torch.no_grad():
        layer.weight.copy_(torch.diag(scale))
        layer.bias.copy_(-mean * scale)
    return layer


def build(*, hidden: int = 64, features: int = 32, seed: int = 0) -> Entry:
    x, y, x_test, y_test = bp.datasets.train_test_split(
        *bp.datasets.load_sklearn("digits"), test_fraction=0.2, seed=seed, stratify=True
    )
    pretrained = train_backbone(x, y, hidden=hidden, features=features, seed=seed)
    backbone = nn.Sequential(*copy.deepcopy(pretrained[:4]), standardizer(pretrained[:4](x).detach()))
    backbone.requires_grad_(False)  # frozen: every engine keeps these values
    head = nn.Linear(features, pretrained[4].out_features)
    net = nn.Sequential(backbone, head)  # sites "1.weight", "1.bias"
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical(), bayesian=["1.*"])
    defaults = fit_defaults(CARD, seed=seed)
    perm = torch.randperm(x_test.shape[1], generator=torch.Generator().manual_seed(seed))

    def deterministic_net() -> nn.Sequential:
        """The pretrained net, backbone and its own trained head (a copy, frozen, in eval mode)."""
        return copy.deepcopy(pretrained).requires_grad_(False)

    @torch.no_grad()
    def features_of(inputs: torch.Tensor) -> torch.Tensor:
        """The frozen backbone's features of ``inputs`` (``(N, features)``)."""
        return backbone(inputs)

    def ood() -> torch.Tensor:
        """Out-of-distribution inputs: the test images with pixels permuted by one fixed permutation."""
        return x_test[:, perm]

    return Entry(
        name="bayesian_last_layer",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="classification",
        fit_defaults=defaults,
        card=CARD,
        extras={"deterministic_net": deterministic_net, "features": features_of, "ood": ood},
    )
