"""The method registry (bnn_pyro/infer/__init__.py): every declared method resolves to its engine."""

import inspect

import pytest

import bnn_pyro as bp
from bnn_pyro.infer import REGISTRY, Method, engine


@pytest.mark.parametrize("method", list(Method))
def test_every_method_resolves_to_an_engine_with_the_common_signature(method):
    fn = engine(method.value)
    assert callable(fn) and fn is engine(method)
    params = list(inspect.signature(fn).parameters)
    assert params[:2] == ["model", "data"], f"{method.value}: engines take (model, data, **config)"
    assert fn.__doc__, f"{method.value}: the engine needs a docstring (update rule and reference)"


def test_registry_covers_the_enum_and_unknown_methods_are_named():
    assert set(REGISTRY) == set(Method)
    with pytest.raises(ValueError, match="method: unknown value 'sgd'"):
        bp.fit(lambda x, y=None: None, [[0.0]], [0.0], method="sgd")


@pytest.mark.parametrize("num_threads, expected", [(1, 1), (None, "outer")])
def test_fit_runs_engines_with_the_requested_torch_threads_and_restores_them(num_threads, expected):
    import pyro
    import pyro.distributions as dist
    import torch

    seen = []

    def model(x, y=None):
        seen.append(torch.get_num_threads())
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=y)

    outer = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bp.fit(
            model,
            torch.ones(4, 1),
            torch.ones(4),
            method="svi",
            num_steps=2,
            num_samples=2,
            progress=False,
            num_threads=num_threads,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)
    assert set(seen) == {1 if expected == 1 else 2}
    with pytest.raises(ValueError, match="num_threads"):
        bp.fit(model, torch.ones(4, 1), torch.ones(4), num_threads=0)


@pytest.mark.parametrize("method", list(Method))
def test_options_are_the_engine_s_declared_keywords_and_every_one_binds(method):
    """``infer.options`` reads the signature (following ``**config`` to the function it is passed on to): every
    option it lists binds to the engine, and bp.fit's own keywords come first (minibatch ones only for a method
    that takes minibatches)."""
    opts = bp.infer.options(method)
    own = (
        ["batch_size", "dataset_size", "num_threads"] if REGISTRY[method].capabilities.minibatches else ["num_threads"]
    )
    assert list(opts)[: len(own)] == own
    assert {"seed", "progress"} <= set(opts)
    engine_opts = {k: v for k, v in opts.items() if k not in ("batch_size", "dataset_size", "num_threads")}
    inspect.signature(engine(method)).bind(None, None, **engine_opts)  # raises TypeError for an unknown name
    assert "kernel" not in opts and "swag" not in opts  # set by the engine itself, not by the user


def test_an_unknown_option_is_refused_before_the_fit_with_the_closest_name():
    calls = []
    model = lambda x, y=None: calls.append(1)  # noqa: E731 - never run: the option check comes first
    with pytest.raises(
        TypeError,
        match=r"num_step: not an option of method='svi'; drop it \(did you mean "
        r"'num_steps'\?\), or see help\(bnn_pyro\.infer\.svi\.fit\)",
    ):
        bp.fit(model, [[0.0]], [0.0], method="svi", num_step=10)
    assert calls == []


def test_another_methods_option_is_not_taken_for_a_misspelling():
    """num_steps given to nuts was answered 'did you mean num_threads?'; it is svi's (and others') option, so the
    error names the methods that take it and suggests no look-alike."""
    with pytest.raises(TypeError) as info:
        bp.fit(lambda x, y=None: None, [[0.0]], [0.0], method="nuts", num_steps=10)
    message = str(info.value)
    assert "num_steps: not an option of method='nuts'; drop it, use a method that takes it (svi, " in message
    assert "did you mean" not in message


@pytest.mark.parametrize(
    "given, closest",
    [(dict(method="NUTS"), "'nuts'"), (dict(method="svi", guide="lowrank"), "'low_rank'")],
)
def test_an_unknown_choice_names_the_closest_one(given, closest):
    """A choice off by case or an underscore (method='NUTS', guide='lowrank') listed the choices only."""
    with pytest.raises(ValueError, match=rf"unknown value .*; choose one of .*\. Did you mean {closest}\?$"):
        bp.fit(lambda x, y=None: None, [[0.0]], [0.0], **given)
