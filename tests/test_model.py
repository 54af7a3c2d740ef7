"""BNN: conversion of any nn.Module into a Pyro model, site conventions, the functional path."""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

import bnn_pyro as bp


def _trace(model, *args, **kwargs):
    return poutine.trace(model).get_trace(*args, **kwargs)


def gaussian():
    return bp.likelihoods.Gaussian(scale=0.1)


class Custom(nn.Module):
    """A nested custom module with a parameter directly on the root."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(2 * 6, 1)
        self.offset = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.head(self.body(x)) + self.offset


def test_sites_follow_the_conventions():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())
    x, y = torch.randn(5, 3), torch.randn(5)
    tr = _trace(model, x, y)
    assert [n for n in tr.nodes if tr.nodes[n]["type"] == "sample"] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "data",
        "f",
        "obs",
    ]
    assert tr.nodes["0.weight"]["fn"].event_shape == (4, 3)
    assert tr.nodes["obs"]["is_observed"] and tr.nodes["f"]["value"].shape == (5, 1)
    assert [f.name for f in tr.nodes["obs"]["cond_indep_stack"]] == ["data"]
    tr.compute_log_prob()
    expected = sum(dist.Normal(0.0, 1.0).log_prob(tr.nodes[n]["value"]).sum() for n in model.sample_names)
    f = net_output = model.forward_draws({n: tr.nodes[n]["value"][None] for n in model.sample_names}, x)[0, :, 0]
    expected = expected + dist.Normal(net_output, 0.1).log_prob(y).sum()
    assert torch.allclose(tr.log_prob_sum(), expected)
    assert torch.allclose(f, tr.nodes["f"]["value"][:, 0])


def test_user_net_is_copied_not_modified():
    net = nn.Linear(2, 1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())
    assert type(net) is nn.Linear and all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize(
    "net, x",
    [
        (Custom(), torch.randn(4, 1, 8)),
        (
            nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 1)),
            torch.randn(4, 1, 6, 6),
        ),
        (nn.Sequential(nn.Sequential(nn.Linear(2, 3), nn.Tanh()), nn.Linear(3, 1)), torch.randn(4, 2)),
    ],
    ids=["custom-conv1d", "conv2d-batchnorm", "nested"],
)
def test_any_module_becomes_a_model_and_fits(net, x):
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian="no_batchnorm")
    y = torch.randn(4)
    tr = _trace(model, x, y)
    assert set(model.sample_names) <= set(tr.nodes)
    assert all(
        "BatchNorm" not in type(model.net.get_submodule(n.rpartition(".")[0])).__name__ for n in model.sample_names
    )
    post = bp.fit(model, x, y, num_steps=3, num_samples=4, progress=False)
    pred = post.predict(x)
    assert pred.mean.shape == (4,) and torch.isfinite(pred.std).all()


def test_deterministic_parameters_are_params_and_point_estimated():
    net = nn.Sequential(nn.Linear(1, 3), nn.Tanh(), nn.Linear(3, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian="weights")
    assert model.point_names == ["0.bias", "2.bias"]
    tr = _trace(model, torch.randn(5, 1), torch.randn(5))
    assert tr.nodes["0.bias"]["type"] == "param"
    x = torch.linspace(-1, 1, 20)[:, None]
    post = bp.fit(model, x, 3.0 + 0 * x[:, 0], guide="map", num_steps=300, lr=0.05, progress=False)
    assert post.point["2.bias"].shape == (1, 1)
    assert not torch.allclose(post.point["2.bias"][0], net[2].bias)  # it moved toward the data


def test_selector_by_patterns_and_predicate():
    net = nn.Sequential(nn.Linear(1, 3), nn.Tanh(), nn.Linear(3, 1))
    by_name = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian=["2.*"])
    assert by_name.sample_names == ["2.weight", "2.bias"]
    by_fn = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian=lambda n, m, p: p.dim() == 2)
    assert by_fn.sample_names == ["0.weight", "2.weight"]
    with pytest.raises(
        ValueError, match="bayesian: unknown value 'some'; choose one of 'all', 'weights', 'no_batchnorm'"
    ):
        bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian="some")


@pytest.mark.parametrize(
    "make_net, bayesian, stacked",
    [
        (lambda: nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 2)), "all", True),
        (
            lambda: nn.Sequential(nn.Sequential(nn.Linear(2, 5, bias=False), nn.GELU()), nn.ReLU(), nn.Linear(5, 2)),
            "all",
            True,
        ),
        (lambda: nn.Sequential(nn.Linear(2, 5), nn.LeakyReLU(0.2), nn.Linear(5, 2)), "weights", True),  # fixed biases
        (lambda: nn.Sequential(nn.Linear(2, 5), nn.Dropout(0.0), nn.Linear(5, 2)), "all", False),  # vmap path
    ],
)
def test_forward_draws_matches_one_draw_at_a_time(make_net, bayesian, stacked):
    from bnn_pyro.model import _linear_stack

    model = bp.BNN(make_net(), prior=bp.priors.Normal(), likelihood=gaussian(), bayesian=bayesian)
    assert (_linear_stack(model._template) is not None) == stacked  # batched matrix products, or vmap
    draws = {n: torch.randn(2, 3, *model.param_shapes[n]) for n in model.sample_names}  # two draw dimensions
    x = torch.randn(7, 2)
    batched = model.forward_draws(draws, x)
    assert batched.shape == (2, 3, 7, 2)
    for a in range(2):
        for b in range(3):
            tr = _trace(poutine.condition(model, data={n: v[a, b] for n, v in draws.items()}), x)
            assert torch.allclose(batched[a, b], tr.nodes["f"]["value"], atol=1e-6)


@pytest.mark.parametrize("rows", [7, 16_000])  # batched products; one draw at a time (16,000 x 5 >= 2**15 elements)
@pytest.mark.parametrize(
    "make_net",
    [
        lambda: nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 2)),  # 1 input
        lambda: nn.Sequential(
            nn.Linear(3, 5, bias=False), nn.LeakyReLU(0.2), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)
        ),
        lambda: nn.Sequential(
            nn.Tanh(), nn.Linear(1, 5), nn.ELU(0.5), nn.Linear(5, 5), nn.SiLU(), nn.GELU(), nn.Linear(5, 2)
        ),
        lambda: nn.Sequential(
            nn.Linear(2, 5), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2), nn.GELU()
        ),  # ends in an activation
        lambda: nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 2, bias=False), nn.Sigmoid()),
    ],
)
def test_linear_stack_without_autograd_equals_the_tracked_path(make_net, rows):
    # without autograd the stack runs activations in place and a one-input first layer as an outer product, or
    # one draw at a time into reused buffers: the same outputs as the tracked path, x untouched, and gradients
    # still flow where they are recorded
    from bnn_pyro.model import _linear_stack
    from bnn_pyro.utils.linear_stack import runs_per_draw

    model = bp.BNN(make_net(), prior=bp.priors.Normal(), likelihood=gaussian())
    draws = {n: torch.randn(4, *model.param_shapes[n], requires_grad=True) for n in model.sample_names}
    x = torch.randn(rows, model._template[0 if isinstance(model._template[0], nn.Linear) else 1].in_features)
    assert runs_per_draw(_linear_stack(model._template), x, model._template) == (rows == 16_000)
    # the per-draw loop is a CPU rule: on any other device (meta here, CUDA alike) the draws run batched, in chunks
    # under the accelerator's budget, not the CPU cache's
    assert not runs_per_draw(_linear_stack(model._template), x.to("meta"), model._template)
    big = torch.empty(100_000, x.shape[1])
    assert model.draws_per_chunk(big.to("meta")) > model.draws_per_chunk(big)
    assert model.points_per_chunk(big.to("meta")) >= model.points_per_chunk(big)
    # a budget the caller gives is used as given, on any device (e.g. to bound a GPU's memory)
    assert model.draws_per_chunk(big.to("meta"), 2**20) == model.draws_per_chunk(big, 2**20) < 64
    before = x.clone()
    tracked = model.forward_draws(draws, x)
    with torch.no_grad():
        fast = model.forward_draws(draws, x)
    torch.testing.assert_close(fast, tracked.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before) and tracked.requires_grad and not fast.requires_grad
    tracked.sum().backward()  # in-place work would have broken the graph ("modified by an inplace operation")
    assert all(p.grad is not None for p in draws.values())


def test_only_plain_sequential_stacks_run_as_batched_products():
    from bnn_pyro.model import _linear_stack

    assert _linear_stack(Custom()) is None
    hooked = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
    hooked[1].register_forward_hook(lambda module, args, out: out * 2)
    assert _linear_stack(hooked) is None
    assert _linear_stack(nn.Sequential(nn.Linear(2, 3), nn.ReLU(inplace=True))) is None  # would write into x
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert _linear_stack(nn.Sequential(nn.Linear(2, 3), nn.Tanh())) is None  # a global hook sees every call
    finally:
        handle.remove()
    layers = _linear_stack(nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 1))))
    assert [path for path, _ in layers] == ["0", "1.0", "1.1"]
    assert layers[0][1] is None and isinstance(layers[1][1], nn.Tanh) and layers[2][1] is None


def test_vectorized_particles_match_sequential_particles():
    """The same guide draws give the same ELBO whether the particles are batched or looped."""
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Horseshoe(), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)))
    guide = pyro.infer.autoguide.AutoNormal(model, init_scale=0.1)
    x, y = torch.randn(9, 2), torch.randn(9)
    with pyro.get_param_store().scope():
        guide(x, y)
        with poutine.trace() as capture, pyro.plate("particles", 5, dim=-2):
            guide(x, y)
        latent = model.sample_names + model.hyper_names + ["sigma"]
        draws = {n: capture.trace.nodes[n]["value"] for n in latent}
        with pyro.plate("particles", 5, dim=-2):
            batched = _trace(poutine.condition(model, data=draws), x, y)
        batched.compute_log_prob()
        for p in range(5):
            one = _trace(poutine.condition(model, data={n: v[p, 0] for n, v in draws.items()}), x, y)
            one.compute_log_prob()
            assert torch.allclose(batched.nodes["obs"]["log_prob"][p], one.nodes["obs"]["log_prob"], atol=1e-5)


def test_bad_models_are_explained():
    with pytest.raises(ValueError, match="net has no parameters"):
        bp.BNN(nn.Tanh(), prior=bp.priors.Normal(), likelihood=gaussian())
    with pytest.raises(TypeError, match="net: expected a torch.nn.Module"):
        bp.BNN(lambda x: x, prior=bp.priors.Normal(), likelihood=gaussian())
    with pytest.raises(TypeError, match="likelihood: expected a bnn_pyro.likelihoods.Likelihood.*Gaussian"):
        bp.BNN(nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood="gaussian")
    with pytest.raises(
        TypeError, match=r"prior for '0.weight' returned float; expected a pyro.distributions.Distribution"
    ):
        bp.BNN(nn.Sequential(nn.Linear(1, 1)), prior=lambda n, m, p: 1.0, likelihood=gaussian())
    with pytest.raises(ValueError, match=r"prior for 'weight': .*batch_shape \(3,\).*parameter's shape \(1, 2\)"):
        bp.BNN(nn.Linear(2, 1), prior=lambda n, m, p: dist.Normal(torch.zeros(3), 1.0), likelihood=gaussian())
    with pytest.raises(ValueError, match=r"net must map \(N, \.\.\.\) inputs to \(N, out\) outputs"):
        bp.fit(
            bp.BNN(nn.Conv1d(1, 1, 2), prior=bp.priors.Normal(), likelihood=gaussian()),
            torch.randn(4, 1, 5),
            torch.randn(4),
        )


def test_parameters_no_dict_pattern_matches_stay_deterministic_and_are_listed():
    net = nn.Sequential(nn.Linear(1, 3), nn.Tanh(), nn.Linear(3, 1))
    model = bp.BNN(net, prior={"0.*": dist.Normal(0.0, 1.0)}, likelihood=gaussian())
    assert model.sample_names == ["0.weight", "0.bias"] and model.point_names == ["2.weight", "2.bias"]
    assert "deterministic=['2.weight', '2.bias']" in repr(model)
    tr = _trace(model, torch.randn(4, 1), torch.randn(4))
    assert tr.nodes["0.weight"]["type"] == "sample" and tr.nodes["2.weight"]["type"] == "param"


def test_posterior_attributes_on_an_unfitted_bnn_say_to_fit_first():
    import dataclasses

    model = bp.BNN(nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood=gaussian())
    names = {n for n in dir(bp.Posterior) if not n.startswith("_")} | {f.name for f in dataclasses.fields(bp.Posterior)}
    assert {"predict", "summary", "to_inference_data", "sample", "samples", "plot_trace", "save"} <= names
    for name in sorted(names):
        with pytest.raises(
            AttributeError, match=rf"model\.{name}: this BNN is not fitted.*post = bp\.fit\(model, x, y"
        ):
            getattr(model, name)
    assert not hasattr(model, "predict")  # still an AttributeError: duck typing keeps working
    with pytest.raises(AttributeError, match="'BNN' object has no attribute 'no_such_thing'"):
        model.no_such_thing
    assert isinstance(model.net, nn.Module)  # nn.Module's own lookups are unchanged


class _Broken(nn.Module):
    """x fits the first layer; the second does not fit the first one's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 3), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "net, x, match",
    [
        (
            nn.Linear(3, 1),
            torch.ones(8),
            r"x has shape \(8,\), which the net cannot take \(its first layer, Linear, takes inputs shaped \(N, 3\)\).*1-D",
        ),
        (
            nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)),
            torch.ones(8, 2),
            r"x has shape \(8, 2\).*first layer, '0', Linear, takes inputs shaped \(N, 3\)",
        ),
        (
            nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 3 * 3, 1)),
            torch.ones(8, 1, 5, 5),
            r"x has shape \(8, 1, 5, 5\).*first layer, '0', Conv2d, takes inputs shaped \(N, 3, \.\.\., \.\.\.\)",
        ),
        (
            nn.Sequential(nn.Linear(2, 3), nn.Linear(4, 1)),
            torch.ones(8, 2),
            r"x fits its first layer, '0', Linear, but a later layer does not fit.*Check the layer sizes",
        ),
        (
            _Broken(),
            torch.ones(8, 2),
            r"x has shape \(8, 2\), which the net cannot take \(the error it raised is chained",
        ),
    ],
    ids=["linear-1d", "sequential-features", "conv-channels", "sequential-broken", "custom-broken"],
)
def test_shape_errors_are_in_our_words_with_torchs_error_chained(net, x, match):
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())
    with pytest.raises(RuntimeError) as inner:
        net(x[:2])
    with pytest.raises(ValueError, match=match) as info:
        model.output_dim(x)
    assert str(inner.value) not in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


class _ValueBranch(nn.Module):
    """A layer whose forward reads values: a Python branch on a tensor, or a boolean-mask index."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, h):
        if self.how == "item":
            return torch.tanh(h) if h.sum() > 0 else h
        if self.how == "mask":
            return torch.tanh(h) if h[h > 0].numel() > 0.6 * h.numel() else h
        return h + torch.zeros(h.shape[-1])  # a tensor made on the CPU, not on h's device


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # 5 SVI steps
@pytest.mark.parametrize("how", ["item", "mask", "device"])
def test_a_forward_the_meta_device_cannot_run_is_checked_on_real_rows_and_fits(how):
    """Review 20 finding 6, then review 22 finding 10: the meta-device shape probe cannot run a forward that reads
    values or makes tensors on another device. It blamed a layer size (20), then refused the net with no way out (22),
    though every engine runs such a net on real tensors. Now the check runs it once on two real rows at the net's
    initial weights, and the fit's draws give the net's own outputs (each draw's f equals the net's forward at it)."""
    net = nn.Sequential(nn.Linear(2, 3), _ValueBranch(how), nn.Linear(3, 1))
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    assert net(x).shape == (8, 1)  # the sizes fit
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())
    with pytest.raises(NotImplementedError if how == "mask" else RuntimeError):
        copy.deepcopy(net).to("meta")(x[:2].to("meta"))  # what the meta probe cannot do
    assert model.output_shape(x) == (1,)
    post = bp.fit(model, x, x[:, 0], method="svi", num_steps=5, progress=False, seed=0)
    assert post.predict(x).mean.shape == (8,)
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn((3, *shape), generator=g) for n, shape in model.param_shapes.items()}
    f = model.forward_draws(params, x)
    for k in range(3):
        one = copy.deepcopy(net)
        for n, p in one.named_parameters():
            p.data.copy_(params[n][k])
        assert torch.allclose(f[k], one(x), atol=1e-6), k


def test_the_real_forward_of_the_shape_check_leaves_buffers_and_the_random_state_alone():
    """The check's real forward runs in eval mode: a value-reading net with BatchNorm and dropout in training mode
    keeps its running statistics and the global generator's state (a seeded fit after it draws as before), and the
    modules' training flags are restored."""
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Dropout(0.5), _ValueBranch("item"), nn.Linear(3, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian()).train()
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)) * 5 + 3
    before = {n: b.clone() for n, b in model.buffers_dict().items()}
    state = torch.get_rng_state()
    assert model.output_shape(x) == (1,)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(model.buffers_dict()[n], b) for n, b in before.items())
    assert all(m.training for m in model._template.modules())


def test_a_value_reading_forward_that_fails_on_real_rows_is_named_with_its_error():
    """Where the real forward fails too (here a later layer of the wrong size behind a value branch), the error says
    the forward reads values, that it was run on two real rows, and what failed, with torch's error chained."""
    net = nn.Sequential(nn.Linear(2, 3), _ValueBranch("item"), nn.Linear(4, 1))
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())
    with pytest.raises(ValueError, match=r"reads tensor values .* run once on two rows of x") as info:
        bp.fit(model, x, torch.zeros(8), method="svi", num_steps=1, progress=False)
    assert "a later layer does not fit the output of the one before" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError) and "shapes cannot be multiplied" in str(info.value.__cause__)


@pytest.mark.parametrize(
    "body",
    [
        lambda: nn.Sequential(nn.Linear(2, 4), nn.Tanh()),  # a Linear stack: batched matrix products
        lambda: nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4), nn.Tanh()),  # the general (vmap) path
    ],
)
def test_parameters_with_requires_grad_false_are_frozen_constants(body):
    torch.manual_seed(0)
    backbone = body().requires_grad_(False)
    net = nn.Sequential(backbone, nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())  # bayesian="all": frozen ones get no prior
    frozen = [f"0.{n}" for n, _ in backbone.named_parameters()]
    assert model.frozen_names == frozen and model.sample_names == ["1.weight", "1.bias"] and model.point_names == []
    assert f"frozen={len(frozen)} tensors" in repr(model)
    assert net[1].weight.requires_grad and not backbone[0].weight.requires_grad  # the user's net is not modified
    x = torch.randn(30, 2)
    tr = _trace(model, x, torch.randn(30))
    assert not any(n in tr.nodes for n in frozen)  # neither sample nor param sites
    w, b = torch.randn(3, 1, 4), torch.randn(3, 1)
    with torch.no_grad():
        expected = backbone(x) @ w.transpose(1, 2) + b[:, None]
    torch.testing.assert_close(model.forward_draws({"1.weight": w, "1.bias": b}, x), expected)
    # MAP by SVI trains what is not frozen (the same net unfrozen moves its first layer), never what is
    y = torch.sin(3 * x[:, 0])
    for post, moves in [
        (bp.fit(model, x, y, guide="map", num_steps=50, lr=0.05, progress=False), False),
        (
            bp.fit(
                bp.BNN(net.requires_grad_(True), prior=bp.priors.Normal(), likelihood=gaussian(), bayesian=["1.*"]),
                x,
                y,
                guide="map",
                num_steps=50,
                lr=0.05,
                progress=False,
            ),
            True,
        ),
    ]:
        first = post.point["0.0.weight"][0] if moves else dict(post.model.net.named_buffers())["0.0.weight"]
        assert torch.equal(first, backbone[0].weight) is not moves


def test_frozen_parameters_cannot_be_selected():
    frozen = nn.Linear(2, 3).requires_grad_(False)
    net = nn.Sequential(frozen, nn.Tanh(), nn.Linear(3, 1))
    with pytest.raises(
        ValueError,
        match=r"bayesian: the pattern '0\.\*' matches only frozen parameters.*"
        r"requires_grad_\(True\)",
    ):
        bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian(), bayesian=["0.*"])
    with pytest.raises(ValueError, match=r"no trainable parameters \(all 2 have requires_grad=False\)"):
        bp.BNN(frozen, prior=bp.priors.Normal(), likelihood=gaussian())


@pytest.mark.parametrize("method", [m.value for m in bp.infer.Method])
def test_every_engine_keeps_frozen_parameters_and_draws_the_rest(method, tmp_path):
    """Tiny runs of every registered engine: the frozen layer is bit-identical after the fit (and after a
    save/load round trip), and the draws hold the trainable head only."""
    torch.manual_seed(0)
    x = torch.randn(60, 3)
    y = (x[:, 0] + x[:, 1] > 0).long()
    backbone = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).requires_grad_(False)
    model = bp.BNN(
        nn.Sequential(backbone, nn.Linear(4, 2)), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Categorical()
    )
    tiny = dict(num_steps=60, num_samples=4, num_warmup=4, num_cycles=2, swag_rank=3, num_chains=1, pretrain_steps=30)
    options = bp.infer.options(method)
    post = bp.fit(model, x, y, method=method, progress=False, seed=0, **{k: v for k, v in tiny.items() if k in options})
    assert set(post.samples) == {"1.weight", "1.bias"} and not post.point
    for fitted in (post, bp.load(post.save(tmp_path / "post.bnn"), model=model)):
        buffers = dict(fitted.model.net.named_buffers())
        assert torch.equal(buffers["0.0.weight"], backbone[0].weight) and torch.equal(
            buffers["0.0.bias"], backbone[0].bias
        )


def test_prior_distributions_draw_each_site_and_keep_the_callers_state():
    """What a saved posterior's and a checkpoint's fingerprint reads: every random site's distribution (hyper
    sites too), without touching the caller's generators or Pyro parameter store (saving registered the
    deterministic parameters there)."""

    pyro.clear_param_store()
    pyro.param("mine", torch.ones(2))
    model = bp.BNN(
        torch.nn.Linear(2, 3),
        prior=bp.priors.HierarchicalNormal(),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
        bayesian="weights",
    )
    state = torch.get_rng_state()
    first, again = model.prior_distributions(), model.prior_distributions()
    assert list(first) == ["weight_scale", "weight"] and list(pyro.get_param_store().keys()) == ["mine"]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first["weight"].base_dist.scale, again["weight"].base_dist.scale)  # drawn under one seed
    pyro.clear_param_store()


def _two_feature_model() -> bp.BNN:
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    return bp.BNN(net, prior=bp.priors.Normal(), likelihood=gaussian())


def test_float64_targets_stay_float64_and_the_traced_engines_fit_them():
    """numpy data is float64. A fit keeps a float64 y as it is (its draws and checkpoint folders unchanged), so a
    traced log density is float64 under float32 weights: Metropolis drew its proposals in the energy's dtype and
    subspace's NUTS its momenta, and both then mixed float64 values with float32 ones deep inside torch. Metropolis'
    proposals now take the parameters' dtype, and subspace's inner fit gets y in the subspace's dtype."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, generator=g).numpy().astype(np.float64)
    y = x[:, 0] - x[:, 1]
    model = _two_feature_model()
    _, checked = bp.model.check_model_data(model, x, y)
    assert checked.dtype == torch.float64
    post = bp.fit(model, x, y, method="metropolis", num_samples=3, num_warmup=3, num_chains=1, progress=False, seed=0)
    assert post.samples["0.weight"].dtype == torch.float32 and torch.isfinite(post.samples["0.weight"]).all()
    swa = dict(pretrain_steps=6, num_steps=6, collect_every=2, rank=2)
    inner = dict(num_warmup=4, max_tree_depth=2)
    post = bp.fit(model, x, y, method="subspace", subspace_dim=2, num_samples=4, inner_options=inner, swa=swa, seed=0)
    assert torch.isfinite(post.samples["0.weight"]).all()


@pytest.mark.parametrize("length", [2, 5])
def test_a_1d_x_is_named_as_such_when_the_net_maps_one_row_to_one_output(length):
    """A 1-D x of N values fed to a Linear(2, .) net: one slice of it passes as a single input row, so the error
    said the net returned the wrong shape (add a Flatten layer); it must say that x is 1-D and how to reshape it."""
    model = _two_feature_model()
    with pytest.raises(ValueError, match=r"x has shape \(\d+,\).*takes inputs shaped \(N, 2\).*x is 1-D.*reshape"):
        bp.model.check_model_data(model, torch.randn(length), torch.randn(length))
