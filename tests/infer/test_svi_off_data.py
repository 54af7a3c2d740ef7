"""SVI's off-data uncertainty in classification (issue 26, item 1; ``docs/ood.md``, "Mean-field SVI off the data"): a
classification fit of a ``BNN`` with a Gaussian guide (the default mean-field one; low-rank and full-rank end the same
way) says that its noise AUROC can fall short of the posterior's, with the fit's own count of the hidden units that
carry it; a MAP guide and regression fits do not get that note."""

from __future__ import annotations

import warnings

import torch

import bnn_pyro as bp
from bnn_pyro.infer import health_off_data
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

NOTE = "off-data uncertainty can fall short of the posterior's with a Gaussian guide"


def _blobs():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]])
    y = torch.arange(3).repeat_interleave(30)
    return centres[y] + 0.7 * torch.randn(90, 2, generator=g), y


def _fit(likelihood, y, **options):
    x, _ = _blobs()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3 if y.dtype == torch.long else 1)
    )
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        post = bp.fit(model, x, y, method="svi", num_steps=600, num_samples=200, seed=0, progress=False, **options)
    return post, [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


def test_a_mean_field_classifier_says_so_with_its_active_units():  # the default guide
    _, y = _blobs()
    post, messages = _fit(bp.likelihoods.Categorical(), y)
    said = [m for m in messages if NOTE in m]
    assert len(said) == 1, messages
    w = post.samples["2.weight"].reshape(-1, 3, 20).double()  # counted here from the draws, not by the check
    active = int(((w.mean(0).abs() / w.std(0)).amax(0) > health_off_data.ACTIVE_UNIT_SNR).sum())
    assert 0 < active < 20
    assert health_off_data.active_units(post) == ((active,), 20)
    assert f"here {active} of the output layer's 20 inputs" in said[0] and "guide='mean_field'" in said[0]
    assert "method='nuts'" in said[0] and "method='sghmc'" in said[0] and "docs/ood.md" in said[0]


def test_a_low_rank_classifier_says_so_too_and_a_map_or_regression_fit_does_not():
    _, y = _blobs()
    _, messages = _fit(bp.likelihoods.Categorical(), y, guide="low_rank")
    assert [m for m in messages if NOTE in m and "guide='low_rank'" in m], messages
    _, messages = _fit(bp.likelihoods.Categorical(), y, guide="map")
    assert not [m for m in messages if NOTE in m], messages
    x, _ = _blobs()
    _, messages = _fit(bp.likelihoods.Gaussian(scale=0.3), torch.sin(x[:, 0]))
    assert not [m for m in messages if NOTE in m], messages


def test_restarts_are_counted_per_chain_and_said_per_restart():
    # restart 0 carries the fit in unit 0, restart 1 in unit 0 with the opposite sign and in unit 1: pooled, neither
    # unit's output weight is large against its sd (the count was 0); chain by chain: 1 and 2
    g = torch.Generator().manual_seed(0)
    w2 = 0.1 * torch.randn(2, 100, 3, 4, generator=g)
    w2[0, :, 0, 0] += 5.0
    w2[1, :, 0, 1] += 5.0
    w2[1, :, 0, 0] -= 5.0
    post = type("Post", (), {"samples": {"0.weight": torch.zeros(2, 100, 4, 2), "2.weight": w2}})()
    assert health_off_data.active_units(post) == ((1, 2), 4)
    # one draw per restart has no sd within a chain (NaN ratios, counted as none): the draws are pooled instead
    w1 = 5.0 + 0.1 * torch.randn(3, 1, 1, 4, generator=g)
    post1 = type("Post", (), {"samples": {"0.weight": torch.zeros(3, 1, 4, 2), "2.weight": w1}})()
    assert health_off_data.active_units(post1) == ((4,), 4)
    _, y = _blobs()
    post, messages = _fit(bp.likelihoods.Categorical(), y, num_chains=2)
    counts = health_off_data.active_units(post)[0]
    said = [m for m in messages if NOTE in m]
    assert len(said) == 1 and f"here {counts[0]}, {counts[1]} (per restart) of" in said[0], messages
    assert all(0 < c < 20 for c in counts)
