"""The zoo entry ``bayesian_last_layer`` (models/bayesian_last_layer.py): a frozen, locally trained backbone
and a Bayesian head, fitted by SVI, Laplace and NUTS.

What is checked
---------------
- **Frozen.** After a fit by each engine the backbone's values are bit-identical to the pretrained net's,
  and the posterior's draws hold the head's two sites only (no point estimates either).
- **Better than a stated baseline at the card's defaults** (slow): the baseline is the pretrained
  deterministic net itself (backbone and its own trained head). Each engine's head must keep its accuracy
  (at most 1.5 points below: the same features, so the posterior mean head classifies alike; 1.5 points is
  5 of the 359 test digits) and must tell out-of-distribution inputs (``entry.ood()``) from test digits by
  predictive entropy better than the deterministic net does (a larger AUROC), the property a Bayesian last
  layer exists for (Kristiadi et al. 2020).
- **Exact on a closed form.** A Gaussian last layer on fixed features with a Gaussian likelihood of known
  noise is Bayesian linear regression in the features ``phi(x)`` (tests/blr.py with ``x = phi(x)``): Laplace
  must give its exact mean and precision (to float tolerance: the potential is quadratic and the GGN is its
  Hessian), and Laplace's iid draws and NUTS's draws must match its mean and covariance within Monte Carlo
  error: ``z = (estimate - exact) / MCSE``, ``MCSE = sd / sqrt(ESS)`` with the exact ``sd`` (``sqrt(C_ii)``
  for a mean, ``sqrt(C_ii C_jj + C_ij^2)`` for a covariance entry) and ArviZ's ESS of the same quantity
  (iid draws: ESS ~ S). ``|z| < 4`` fails with probability ~6e-5 per quantity, ~1e-3 over the 14 of a
  4-coordinate posterior. Seeds are fixed.
"""

from __future__ import annotations

import pytest
import torch
from blr import BLR, mcse_z_scores  # tests/ is on sys.path (pytest puts conftest.py's folder there)
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer import laplace as lap
from bnn_pyro.infer._common import Data

HEAD = {"1.weight", "1.bias"}
Z_MAX, PREC_TOL, MAP_TOL = 4.0, 1e-6, 1e-4  # MAP / precision tolerances derived in tests/infer/test_laplace.py


@pytest.fixture(scope="module")
def entry():
    return bp.zoo.load("bayesian_last_layer")


def _backbone_values(post) -> dict[str, torch.Tensor]:
    return {n: b for n, b in post.model.net.named_buffers() if n.startswith("0.")}


def _assert_frozen_head_only(entry, post):
    pretrained = entry.deterministic_net()
    for name, value in _backbone_values(post).items():
        index, _, attr = name[2:].partition(".")  # "0.<layer>.<attr>"
        source = pretrained[int(index)] if int(index) < 4 else None  # layer 4: the fixed standardization
        expected = getattr(source, attr) if source is not None else dict(entry.model.net.named_buffers())[name]
        assert torch.equal(value, expected), f"{post.method}: frozen {name} changed"
    assert len(_backbone_values(post)) == 6  # 3 Linear layers x (weight, bias)
    assert set(post.samples) == HEAD and not post.point, post.method


def test_model_is_a_bayesian_head_on_a_frozen_backbone(entry):
    model = entry.model
    assert model.sample_names == ["1.weight", "1.bias"] and model.point_names == []
    assert len(model.frozen_names) == 6 and all(n.startswith("0.") for n in model.frozen_names)
    feats = entry.features(entry.x)
    assert feats.shape == (len(entry.x), 32)
    torch.testing.assert_close(feats.mean(0), torch.zeros(32), atol=1e-4, rtol=0)  # standardized on training rows
    ood = entry.ood()
    assert ood.shape == entry.x_test.shape and torch.equal(ood.sort(1).values, entry.x_test.sort(1).values)
    with torch.no_grad():  # the pretrained baseline is a good classifier
        assert bp.metrics.accuracy(entry.deterministic_net()(entry.x_test).softmax(-1), entry.y_test) > 0.95


@pytest.mark.parametrize(
    "method, tiny",
    [
        ("svi", dict(num_steps=20, num_samples=5)),
        ("laplace", dict(num_steps=20, num_samples=5)),
        ("nuts", dict(num_samples=5, num_warmup=5, num_chains=1)),
    ],
)
def test_every_engine_keeps_the_backbone_frozen_and_draws_the_head_only(entry, method, tiny):
    post = entry.fit(method, **tiny)
    _assert_frozen_head_only(entry, post)


def _ood_auroc(probs_in, probs_out) -> float:
    def entropy(p):
        return -(p * p.clamp_min(1e-30).log()).sum(-1)

    return bp.metrics.ood_auroc(entropy(probs_in), entropy(probs_out))


@pytest.mark.slow  # card defaults, measured on a shared 2-core machine at load ~6: laplace 17 s, svi 19 s, nuts 92 s
@pytest.mark.parametrize("method", ["laplace", "svi", "nuts"])
def test_each_engine_at_the_card_defaults_beats_the_deterministic_net(entry, method):
    with torch.no_grad():
        net = entry.deterministic_net()
        det_in, det_out = net(entry.x_test).softmax(-1), net(entry.ood()).softmax(-1)
    post = entry.fit(method)
    _assert_frozen_head_only(entry, post)
    pred_in, pred_out = post.predict(entry.x_test, seed=0), post.predict(entry.ood(), seed=0)
    acc, det_acc = bp.metrics.accuracy(pred_in, entry.y_test), bp.metrics.accuracy(det_in, entry.y_test)
    auroc, det_auroc = _ood_auroc(pred_in.probs, pred_out.probs), _ood_auroc(det_in, det_out)
    assert acc >= det_acc - 0.015, (acc, det_acc)
    assert auroc > det_auroc, (auroc, det_auroc)


# ------------------------------------------------------------------ exact: a Gaussian last layer is BLR
NOISE, PRIOR_SCALE = 0.5, 1.0


def _features_problem(n: int = 40):
    """A frozen feature map phi(x) = tanh(W x + b) (2 -> 3), a Bayesian Linear(3, 1) head, Gaussian noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    phi = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
    with torch.no_grad():
        phi[0].weight.copy_(torch.randn(3, 2, generator=g))
        phi[0].bias.copy_(torch.randn(3, generator=g) * 0.5)
        feats = phi(x)
    y = feats @ torch.tensor([1.0, -0.5, 0.8]) + 0.3 + NOISE * torch.randn(n, generator=g)
    model = bp.BNN(
        nn.Sequential(phi.requires_grad_(False), nn.Linear(3, 1)),
        prior=bp.priors.Normal(0.0, PRIOR_SCALE),
        likelihood=bp.likelihoods.Gaussian(scale=NOISE),
        bayesian=["1.*"],
    )
    return x, y, model, BLR(x=feats, y=y, noise=NOISE, prior_scale=PRIOR_SCALE), phi


def _assert_exact_draws(post, exact: BLR, phi):
    c, n = post.num_chains, post.num_draws
    w = torch.cat([post.samples["1.weight"].reshape(c, n, -1), post.samples["1.bias"].reshape(c, n, 1)], -1).double()
    z = mcse_z_scores(w, exact.mean, exact.cov)
    bad = {k: round(v, 2) for k, v in z.items() if not abs(v) < Z_MAX}
    assert not bad, f"{post.method}: off by more than {Z_MAX} MCSE: {bad}"
    assert torch.equal(_backbone_values(post)["0.0.weight"], phi[0].weight)


def test_laplace_of_a_gaussian_last_layer_is_the_exact_blr_posterior():
    x, y, model, exact, phi = _features_problem()
    approx = lap.laplace_approximation(model, Data(x=x, y=y), num_steps=0, progress=False)  # last layer by default
    sd = exact.cov.diag().sqrt()
    assert float(((approx.mean.double() - exact.mean).abs() / sd).max()) < MAP_TOL
    assert float(((approx.precision - exact.precision).abs() / exact.precision.abs().max()).max()) < PREC_TOL
    post = bp.fit(model, x, y, method="laplace", num_samples=4000, seed=3, progress=False)  # defaults otherwise
    _assert_exact_draws(post, exact, phi)


@pytest.mark.slow  # 2 chains x 800 iterations: 93 s on the loaded 2-core machine (load ~12), seconds idle
def test_nuts_on_a_gaussian_last_layer_recovers_the_exact_blr_posterior():
    x, y, model, exact, phi = _features_problem()
    post = bp.fit(model, x, y, method="nuts", num_samples=600, num_warmup=200, num_chains=2, seed=1, progress=False)
    _assert_exact_draws(post, exact, phi)
