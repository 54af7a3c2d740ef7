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
