"""``init=``: the default ``"reset"`` re-draws the weights under the fit's seed (per chain), ``"net"``
starts from the net's own weights (a pretrained net), and every engine resolves both in one place
(:mod:`bnn_pyro.infer._init`). A step of size ~1e-9 leaves a point estimate at its start, which is
how these tests read where a fit started."""

from __future__ import annotations

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer._init import reset_values

STILL = 1e-6  # how far one Adam step with lr=1e-9 can move a value (|step| <= lr), with room for float32
TINY = {
    "svi": dict(guide="map", num_steps=1, lr=1e-9),
    "ensemble": dict(num_steps=1, lr=1e-9),
    "swa": dict(pretrain_steps=0, num_steps=2, burn_in=0, collect_every=1, lr=1e-9, momentum=0.0),
}


def _model() -> bp.BNN:
    torch.manual_seed(11)  # any weights: init="net" must start from exactly these
    net = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    with torch.no_grad():
        net[2].bias.fill_(3.0)  # a "pretrained" value no initializer draws (nn.Linear's are within 1/sqrt(5))
    return bp.BNN(
        net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.5), bayesian="weights"
    )  # biases are deterministic parameters: their start is checked too


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=g)
    return x, x[:, 0] + 0.1 * torch.randn(10, generator=g)


def _starts(post) -> list[dict[str, torch.Tensor]]:
    """Each chain's (member's) values: its first draw of every site and its deterministic parameters."""
    return [
        {**{n: v[c, 0] for n, v in post.samples.items()}, **{n: v[c] for n, v in post.point.items()}}
        for c in range(post.num_chains)
    ]


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[n], b[n], atol=STILL, rtol=0) for n in a)


@pytest.mark.parametrize("method", list(TINY))
def test_init_net_starts_every_chain_from_the_nets_own_weights(method):
    model, (x, y) = _model(), _data()
    chains = dict(num_chains=2) if method == "ensemble" else dict(num_chains=2)
    post = bp.fit(model, x, y, method=method, init="net", seed=3, progress=False, **chains, **TINY[method])
    assert post.config["init"] == "net"
    for start in _starts(post):
        assert set(start) == set(model.init_values) and _close(start, model.init_values)


@pytest.mark.parametrize("method", list(TINY))
def test_default_init_redraws_the_weights_under_each_chains_seed(method):
    model, (x, y) = _model(), _data()
    chains = dict(num_chains=2) if method == "ensemble" else dict(num_chains=2)
    post = bp.fit(model, x, y, method=method, seed=3, progress=False, **chains, **TINY[method])
    assert post.config["init"] == "reset"
    starts = _starts(post)
    for chain, start in enumerate(starts):
        assert _close(start, reset_values(model, 3 + chain))  # nn.Linear's initializer under seed + chain
    assert not torch.allclose(starts[0]["2.bias"], starts[1]["2.bias"])  # chains start apart
    assert (starts[0]["2.bias"] - 3.0).abs().item() > 1.0  # not the net's own value


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # 2 draws: not meant to mix
def test_mcmc_fixes_deterministic_parameters_at_the_joint_map_unless_init_gives_them():
    """Not at the start that init chooses (a random draw under init='reset'): at the joint MAP fitted from it
    (bnn_pyro.infer.mcmc's module docstring), the same for every chain; a dict naming them keeps its values."""
    from bnn_pyro.infer import map_fit
    from bnn_pyro.infer._common import Data
    from bnn_pyro.infer.map_fit import fit_map

    model, (x, y) = _model(), _data()
    config = dict(
        method="metropolis",
        num_samples=2,
        num_warmup=2,
        num_chains=2,
        chain_method="sequential",
        seed=5,
        progress=False,
    )
    for init in ("net", "reset"):
        post = bp.fit(model, x, y, init=init, **config)
        mode = fit_map(
            model,
            Data(x, y),
            init=init,
            num_steps=map_fit.POINT_MAP_STEPS,
            lr=map_fit.POINT_MAP_LR,
            seed=5,
            progress=False,
            polish_steps=map_fit.POINT_MAP_POLISH,
        )
        assert post.config["point_estimate"] == "map"
        for name in model.point_names:
            assert torch.equal(post.point[name], mode.point[name].expand_as(post.point[name])), (init, name)
            assert not torch.equal(mode.point[name], reset_values(model, 5)[name])  # not chain 0's random start
    given = {name: torch.full(model.param_shapes[name], 0.25) for name in model.point_names}
    post = bp.fit(model, x, y, init=given, **config)
    assert post.config["point_estimate"] == "init"
    for name in model.point_names:
        assert torch.equal(post.point[name], given[name].expand_as(post.point[name]))


def test_a_dict_may_set_deterministic_parameters_and_numbers_are_accepted():
    model, (x, y) = _model(), _data()
    start = {"0.weight": torch.zeros(5, 2), "2.bias": [0.5], "2.weight": 0.25 * torch.ones(1, 5)}
    post = bp.fit(model, x, y, method="svi", init=start, seed=0, progress=False, **TINY["svi"])
    (got,) = _starts(post)
    assert post.config["init"] == "dict"
    assert _close({n: got[n] for n in start}, {n: torch.as_tensor(v) for n, v in start.items()})
    assert _close({"0.bias": got["0.bias"]}, {"0.bias": reset_values(model, 0)["0.bias"]})  # not named: re-drawn


def test_reset_values_do_not_touch_the_global_generator():
    model = _model()
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    a = reset_values(model, 0)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a[n], v) for n, v in reset_values(model, 0).items())
