"""Subspace inference's count of the directions the SWA deviations span (``spanned_directions``: the numerical rank of
float32 iterates' deviations) and its default ``subspace_dim``, lowered to what a small or partly data-free model
allows instead of an error (bnn_pyro/infer/subspace.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.infer.mcmc import NUTSConfig
from bnn_pyro.infer.subspace import DEFAULT_SUBSPACE_DIM, spanned_directions
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

K, D = 20, 10  # SWA's default deviations kept, and a 10-weight model


def _float32_matrix(singular: list[float], seed: int = 0) -> torch.Tensor:
    """A ``K x D`` matrix with the given nonzero singular values (random orthonormal factors), rounded to float32 as
    the SWA iterates are, then back in float64 as the moments keep them."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(K, len(singular), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(D, len(singular), generator=g, dtype=torch.float64))[0]
    exact = u @ torch.diag(torch.tensor(singular, dtype=torch.float64)) @ v.T
    return exact.float().double()


def test_float32_rounding_is_not_counted_as_a_direction():
    """Rank 4, rounded to float32: the SVD returns the 6 directions it does not span with singular values of float32
    rounding, above the former fixed tolerance ``1e-8 * s_max``; the count is 4, as ``torch.linalg.matrix_rank`` says
    of the float32 matrix itself, and the floor sits between the rounding and the smallest true direction."""
    m = _float32_matrix([3.0, 1.0, 0.2, 0.05])
    s = torch.linalg.svdvals(m)
    assert int((s > 1e-8 * s[0]).sum()) > 4  # the rounding passed the former rule: this matrix tells them apart
    spanned, tolerance = spanned_directions(s, m.float())
    assert spanned == 4 == int(torch.linalg.matrix_rank(m.float()))
    assert float(s[4]) < tolerance < float(s[3]) / 1000


def test_a_small_true_direction_well_above_the_tolerance_is_kept():
    """The smallest of 5 true directions at 1e-4 of the largest, far above float32's rounding of entries of this
    size: counted; float64 iterates' rounding is smaller still."""
    m = _float32_matrix([1.0, 0.3, 0.01, 1e-3, 1e-4], seed=1)
    s = torch.linalg.svdvals(m)
    spanned, tolerance = spanned_directions(s, m.float())
    assert spanned == 5 and float(s[4]) > 10 * tolerance
    assert spanned_directions(s, m)[0] >= 5  # float64 iterates: a far smaller floor
    assert spanned_directions(torch.zeros(3), torch.zeros(K, D))[0] == 0  # no spread at all: nothing spanned


@pytest.mark.parametrize(
    "k, d, half_range, singular, former",
    [
        # a 200-100-1 net's size and spectrum: matrix_rank's max(K, d) * eps * s_max (0.24% of s_max) counted 6
        (20, 20_000, 0.25, [0.8, 0.02, 0.01, 5e-3, 3e-3, 2e-3, 1e-3, 5e-4, 3e-4, 2e-4, 1e-4], "matrix_rank"),
        # the gap data's 1-50-1 net: weights of rms 0.73 (up to 2.5) against deviations of s_max 0.04, the tenth at 4e-6;
        # a floor of sqrt-sized eps * max(s_max, max |w|) (5.1e-6) cut it, and the default lowered itself
        (20, 151, 1.25, [0.04, 9e-3, 6e-3, 1e-3, 5e-4, 1.6e-4, 1e-4, 2.6e-5, 9e-6, 4e-6], "largest_weight"),
    ],
    ids=["wide_net", "large_weights"],
)
def test_every_real_direction_stands_above_the_rounding_floor(k, d, half_range, singular, former):
    """``k`` deviations of ``d`` float32 iterates with known directions (``singular``) around a mean of entries
    uniform in ``+-half_range`` (one of them at twice that, the net's largest weight), the iterates rounded to float32 and their mean held in float64 (as the moments are):
    every true direction is counted and none of the rounding; the floor sits below the smallest true one."""
    g = torch.Generator().manual_seed(0)
    singular = torch.tensor(singular, dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(k, len(singular), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(d, len(singular), generator=g, dtype=torch.float64))[0]
    mean = (torch.rand(d, generator=g, dtype=torch.float64) - 0.5) * 2 * half_range
    mean[0] = 2 * half_range
    iterates = (mean + u @ torch.diag(singular) @ v.T).float()  # the SGD iterates, float32
    s = torch.linalg.svdvals(iterates.double() - mean)
    spanned, tolerance = spanned_directions(s, iterates)
    n = len(singular)
    assert spanned == n
    assert float(s[n]) > 1e-8 * float(s[0])  # the rounding is there (the fixed 1e-8 rule counted it) ...
    assert float(s[n]) < tolerance < float(s[n - 1]) / 5  # ... and sits below the floor, the last true one above
    eps = torch.finfo(torch.float32).eps
    floors = {
        "matrix_rank": max(k, d) * eps * float(s[0]),
        "largest_weight": (k**0.5 + d**0.5) * eps * max(float(s[0]), float(mean.abs().max())),
    }
    assert int((s > floors[former]).sum()) < n  # the former rule dropped a real direction


def _softmax_head() -> tuple[bp.BNN, torch.Tensor, torch.Tensor]:
    """A frozen 3-4 tanh backbone and a trainable ``Linear(4, 2)`` head under a 2-class softmax: 10 weights, of
    which the logits' sum ``w0 + w1`` (5 directions) gets no likelihood gradient, so the SWA deviations span only the
    5 others (tests/test_model.py's frozen-parameter model, where a GPU found the default failing)."""
    torch.manual_seed(0)
    x = torch.randn(60, 3)
    y = (x[:, 0] + x[:, 1] > 0).long()
    backbone = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).requires_grad_(False)
    net = nn.Sequential(backbone, nn.Linear(4, 2))
    return bp.BNN(net, prior=bp.priors.Normal(), likelihood=bp.likelihoods.Categorical()), x, y


TINY_INNER = dict(num_samples=4, inner=NUTSConfig(num_warmup=4), seed=0, progress=False)


def test_the_default_uses_the_directions_spanned_records_why_and_warns_an_explicit_dim_above_them_raises():
    model, x, y = _softmax_head()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="subspace", **TINY_INNER)
    record = post.config["subspace"]
    assert record["spanned"] == 5 and record["rank"] == 5 and post.config["rank"] == 5
    assert record["subspace_dim"] == dict(
        requested=DEFAULT_SUBSPACE_DIM, used=5, given=False, lowered="the SWA deviations span only 5 directions"
    )
    said = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    ours = [m for m in said if "span only 5 of the 10 weight directions" in m]
    assert len(ours) == 1 and "subspace_dim is 5, not the default 10" in ours[0] and "method='nuts'" in ours[0]
    assert post.samples["1.weight"].shape == (1, 4, 2, 4)
    # the inner NUTS's own checks (4 draws, 1 chain: its ESS) name the fit called and where their options go here
    inner = [m for m in said if m.startswith("subspace (inner nuts): ")]
    where = (
        "(Inside method='subspace', set the inner engine's options in inner=NUTSConfig(...), and num_chains and "
        "num_samples on bp.fit, where num_chains defaults to 1.)"
    )
    assert inner and all(m.endswith(where) for m in inner)
    # the logit sum changes no prediction: check_subspace judges the logits centred over the classes, which the 5
    # spanned directions hold whole (judged raw, they kept a median 9%, and it warned "holds too little")
    held = record["held"]
    assert held["fired"] == [] and held["function_variance_held"]["min"] > 0.999
    assert not [m for m in said if "holds too little" in m]
    spans = r"subspace_dim=6: the SWA deviations span only 5 directions; lower subspace_dim, or keep more SWA "
    with pytest.raises(ValueError, match=spans + r"deviations \(swa=SWAGConfig\(swag_rank=\.\.\.\); 20 now\)"):
        bp.fit(model, x, y, method="subspace", subspace_dim=6, **TINY_INNER)


def test_the_default_on_a_model_with_fewer_weights_uses_them_all_without_a_warning():
    """3 weights (a linear regression, the reference suite's): the default 10 becomes 3, the whole weight space,
    which the deviations span; nothing is missed, so nothing is said about it. Given, 10 is still an error."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=g)
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 + 0.5 * torch.randn(40, generator=g)
    torch.manual_seed(0)
    model = bp.BNN(nn.Linear(2, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="subspace", **TINY_INNER)
    record = post.config["subspace"]
    assert record["subspace_dim"] == dict(
        requested=DEFAULT_SUBSPACE_DIM, used=3, given=False, lowered="the model has 3 weights with a prior"
    )
    assert record["spanned"] == 3 and record["held"]["variance_held"] == pytest.approx([1.0] * 3)
    assert not [w for w in caught if "weight directions" in str(w.message)]
    with pytest.raises(ValueError, match=r"subspace_dim=10 exceeds the number of weights with a prior \(3\)"):
        bp.fit(model, x, y, method="subspace", subspace_dim=10, **TINY_INNER)


def test_fewer_deviations_than_weights_are_said_as_measured_and_no_larger_subspace_is_advised():
    """A softmax regression ``Linear(3, 3)``: 12 weights, of which the 4 class-sum directions get no likelihood
    gradient, so the deviations span 8. With 10 deviations kept (fewer than the weights) the default is lowered to 8,
    and the span warning says only what was measured: 10 deviations could never span all 12 directions, so it does
    not claim that no gradient reaches the other 4. Every spanned direction is then in the subspace, so
    check_subspace, which finds the weights short of their variance, advises NUTS or Laplace and no larger
    subspace_dim (refused) or swag_rank."""
    from bnn_pyro.infer.swag import SWAGConfig

    torch.manual_seed(0)
    x = torch.randn(90, 3)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    model = bp.BNN(nn.Linear(3, 3), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Categorical())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="subspace", swa=SWAGConfig(swag_rank=10), **TINY_INNER)
    record = post.config["subspace"]
    assert record["spanned"] == record["rank"] == 8 and record["deviations"] == 10
    said = [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]
    (span,) = [m for m in said if "span only 8 of the 12 weight directions" in m]
    assert "The 10 deviations kept (swa=SWAGConfig(swag_rank=...)) have only 8 independent directions" in span
    assert "gradient" not in span and "at any subspace_dim" not in span
    assert record["held"]["fired"] == ["weights"] and record["held"]["suggested_subspace_dim"] is None
    (short,) = [m for m in said if "holds too little" in m]
    assert short.endswith(
        "Try method='nuts' or 'laplace' (a model this small: exact on a Gaussian posterior); the subspace already "
        "holds all 8 directions the SWA deviations span, so no larger subspace_dim is possible."
    )
    assert "swag_rank" not in short and "larger subspace_dim with" not in short
