"""Priors: built-ins, hierarchical hyper sites, and the three ways to write a custom prior."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

import bnn_pyro as bp

NET = nn.Sequential(nn.Linear(4, 10), nn.Tanh(), nn.Linear(10, 1))


def _prior_sites(prior, **kwargs):
    model = bp.BNN(NET, prior=prior, likelihood=bp.likelihoods.Gaussian(scale=1.0), **kwargs)
    tr = poutine.trace(model).get_trace(torch.randn(3, 4))
    return model, {n: s for n, s in tr.nodes.items() if s["type"] == "sample" and n not in ("data", "f", "obs")}


@pytest.mark.parametrize(
    "scaling, std0, std2",
    [
        ("radford", 1 / math.sqrt(4), 1 / math.sqrt(10)),
        ("xavier", math.sqrt(2 / 14), math.sqrt(2 / 11)),
        ("kaiming", math.sqrt(2 / 4), math.sqrt(2 / 10)),
    ],
)
def test_layerwise_normal_scales_by_fan(scaling, std0, std2):
    _, sites = _prior_sites(bp.priors.LayerwiseNormal(scaling, scale=2.0))
    for name, std in [("0.weight", std0), ("0.bias", std0), ("2.weight", std2), ("2.bias", std2)]:
        assert sites[name]["fn"].base_dist.scale.flatten()[0].item() == pytest.approx(2.0 * std)


def test_iid_priors_have_the_right_log_density():
    w = torch.randn(1, 10)
    for prior, ref in [
        (bp.priors.Normal(1.0, 2.0), dist.Normal(1.0, 2.0)),
        (bp.priors.Laplace(0.0, 0.5), dist.Laplace(0.0, 0.5)),
        (bp.priors.StudentT(3.0, 0.0, 1.5), dist.StudentT(3.0, 0.0, 1.5)),
    ]:
        _, sites = _prior_sites(prior)
        assert torch.allclose(sites["2.weight"]["fn"].log_prob(w), ref.log_prob(w).sum())
    _, sites = _prior_sites(bp.priors.ScaleMixtureNormal(0.25, 1.0, 0.01))
    v = torch.tensor([[0.0] * 9 + [0.5]])
    mix = torch.logsumexp(
        torch.stack(
            [math.log(0.25) + dist.Normal(0, 1.0).log_prob(v), math.log(0.75) + dist.Normal(0, 0.01).log_prob(v)]
        ),
        0,
    )
    assert torch.allclose(sites["2.weight"]["fn"].log_prob(v), mix.sum())


def test_hierarchical_normal_adds_a_scale_site_per_tensor():
    model, sites = _prior_sites(bp.priors.HierarchicalNormal(dist.HalfNormal(2.0)))
    assert model.hyper_names == ["0.weight_scale", "0.bias_scale", "2.weight_scale", "2.bias_scale"]
    s = sites["2.weight_scale"]["value"]
    assert torch.allclose(sites["2.weight"]["fn"].base_dist.scale, s.expand(1, 10))


def test_horseshoe_local_scales_per_input_unit():
    model, sites = _prior_sites(bp.priors.Horseshoe(global_scale=0.5))
    assert sites["0.weight_lambda"]["value"].shape == (4,) and sites["0.weight_tau"]["value"].shape == ()
    expected = sites["0.weight_tau"]["value"] * sites["0.weight_lambda"]["value"].expand(10, 4)
    assert torch.allclose(sites["0.weight"]["fn"].base_dist.scale, expected)
    assert sites["0.weight_tau"]["fn"].scale == 0.5


def test_custom_priors_lambda_dict_and_subclass():
    model, sites = _prior_sites(lambda name, module, param: dist.Laplace(0.0, 3.0) if param.dim() == 2 else None)
    assert model.sample_names == ["0.weight", "2.weight"] and model.point_names == ["0.bias", "2.bias"]
    model, sites = _prior_sites({"0.*": dist.Normal(0.0, 5.0), "*.bias": None, "2.weight": bp.priors.LayerwiseNormal()})
    assert model.sample_names == ["0.weight", "0.bias", "2.weight"]
    assert sites["0.bias"]["fn"].base_dist.scale.flatten()[0] == 5.0

    class Wide(bp.priors.Prior):
        def __call__(self, name, module, param):
            return dist.Normal(0.0, 10.0) if isinstance(module, nn.Linear) else None

    model, sites = _prior_sites(Wide())
    assert len(model.sample_names) == 4 and sites["0.weight"]["fn"].base_dist.scale.flatten()[0] == 10.0


def test_full_shape_distribution_and_bad_prior_arguments():
    model, sites = _prior_sites({"2.weight": dist.Normal(torch.zeros(1, 10), 1.0).to_event(2)})
    assert sites["2.weight"]["fn"].event_shape == (1, 10)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        bp.priors.Normal(0.0, -1.0)
    with pytest.raises(
        ValueError, match="scaling: unknown value 'lecun'; choose one of 'radford', 'xavier', 'kaiming'"
    ):
        bp.priors.LayerwiseNormal("lecun")
    with pytest.raises(TypeError, match="prior: expected a bnn_pyro.priors.Prior, a callable"):
        bp.BNN(NET, prior=3.0, likelihood=bp.likelihoods.Gaussian(scale=1.0))


TORCH_DISTRIBUTIONS = [
    torch.distributions.Normal(0.5, 2.0),
    torch.distributions.Laplace(0.0, 0.5),
    torch.distributions.StudentT(3.0, 0.0, 1.5),
    torch.distributions.Normal(torch.zeros(3), 1.0).expand([2, 3]),
    torch.distributions.Categorical(probs=torch.tensor([0.2, 0.3, 0.5])),
    torch.distributions.MultivariateNormal(torch.zeros(2), torch.tensor([[2.0, 0.5], [0.5, 1.0]])),
    torch.distributions.Independent(torch.distributions.Normal(torch.zeros(3), 2.0), 1),
    torch.distributions.LogNormal(0.0, 0.5),
    torch.distributions.Uniform(-1.0, 3.0),
    torch.distributions.MixtureSameFamily(
        torch.distributions.Categorical(torch.tensor([0.3, 0.7])),
        torch.distributions.Normal(torch.tensor([-1.0, 2.0]), torch.tensor([0.5, 1.0])),
    ),
    torch.distributions.TransformedDistribution(
        torch.distributions.Normal(0.0, 1.0), [torch.distributions.transforms.AffineTransform(1.0, 3.0)]
    ),
]


@pytest.mark.parametrize("torch_dist", TORCH_DISTRIBUTIONS, ids=lambda d: type(d).__name__)
def test_a_torch_distribution_becomes_the_pyro_one_of_the_same_name_and_parameters(torch_dist):
    from pyro.distributions.torch_distribution import TorchDistributionMixin

    prior = bp.priors.as_prior(torch_dist)(None, None, None)
    assert isinstance(prior, TorchDistributionMixin) and type(prior).__name__ == type(torch_dist).__name__
    assert prior.batch_shape == torch_dist.batch_shape and prior.event_shape == torch_dist.event_shape
    value = torch_dist.sample(torch.Size([5]))
    assert torch.allclose(prior.log_prob(value), torch_dist.log_prob(value))


def test_torch_priors_give_the_same_model_as_pyro_priors():
    """A single distribution, a dict's values, a callable's return value and a hierarchical hyperprior may be
    torch.distributions ones: the model is the one the pyro.distributions of the same name give."""
    td = torch.distributions
    cases = [
        (td.Laplace(0.0, 2.0), dist.Laplace(0.0, 2.0)),
        ({"0.*": td.Normal(0.0, 3.0), "*": td.StudentT(3.0)}, {"0.*": dist.Normal(0.0, 3.0), "*": dist.StudentT(3.0)}),
        (
            lambda n, m, p: td.Normal(0.0, 0.5) if p.dim() == 2 else None,
            lambda n, m, p: dist.Normal(0.0, 0.5) if p.dim() == 2 else None,
        ),
        (bp.priors.HierarchicalNormal(td.HalfNormal(2.0)), bp.priors.HierarchicalNormal(dist.HalfNormal(2.0))),
    ]
    for torch_prior, pyro_prior in cases:
        pyro.set_rng_seed(0)
        model, torch_sites = _prior_sites(torch_prior)
        pyro.set_rng_seed(0)  # the same hyper draws, so that the conditional weight priors are comparable
        _, pyro_sites = _prior_sites(pyro_prior)
        assert sorted(torch_sites) == sorted(pyro_sites) and model.sample_names
        for name, site in torch_sites.items():
            value = pyro_sites[name]["value"]
            assert type(site["fn"]) is type(pyro_sites[name]["fn"])
            assert torch.allclose(site["fn"].log_prob(value), pyro_sites[name]["fn"].log_prob(value))


def test_a_torch_prior_fits():
    x = torch.linspace(-1, 1, 8)[:, None]
    model = bp.BNN(
        nn.Linear(1, 1),
        prior=torch.distributions.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=torch.distributions.HalfNormal(1.0)),
    )
    post = bp.fit(
        model, x, 2 * x[:, 0], method="nuts", num_chains=1, num_samples=5, num_warmup=5, progress=False, seed=0
    )
    assert set(post.samples) == {"weight", "bias", "sigma"} and torch.isfinite(post.predict(x).mean).all()


def test_dict_patterns_are_checked_against_the_parameter_names():
    patterns = bp.priors.Patterns({"0.*": dist.Normal(0.0, 1.0), "*.bias": None, "2.weight": dist.Laplace(0.0, 1.0)})
    patterns.check_names(["0.weight", "0.bias", "2.weight", "2.bias"])  # every pattern decides some parameter
    with pytest.raises(
        ValueError, match=r"pattern '2\.weight' matches no parameter.*\['0\.weight', '0\.bias', '2\.bias'\]"
    ):
        patterns.check_names(["0.weight", "0.bias", "2.bias"])
    with pytest.raises(
        ValueError, match=r"pattern '\*\.bias' is never used.*\['0\.bias'\].*matched first by \['0\.\*'\]"
    ):
        patterns.check_names(["0.weight", "0.bias", "2.weight"])
