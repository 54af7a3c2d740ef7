"""Facts about a method are read from its declaration (bnn_pyro/infer/registry.py's REGISTRY), never from lists of
method names: checkpoints, PSIS's Markov-chain refusal, subspace's inner engines, the accept/reject health check,
the chains that resume=Posterior extends. Each test walks the registry and, where it can, flips a declared fact to
show that the behaviour follows the declaration."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro import psis
from bnn_pyro.infer import REGISTRY, Method
from bnn_pyro.infer.health_mixing import check_sampler
from bnn_pyro.infer.subspace import inner_engines


def _declared(method: Method, **facts):
    """``method``'s declaration with its capabilities changed by ``facts``."""
    declared = REGISTRY[method]
    return dataclasses.replace(declared, capabilities=dataclasses.replace(declared.capabilities, **facts))


def test_every_declared_method_is_a_member_of_method_and_back():
    assert [m.value for m in Method] == [m.value for m in REGISTRY]
    assert all(isinstance(m, Method) and m == m.value for m in REGISTRY)


@pytest.mark.parametrize("method", list(Method))
def test_psis_refuses_a_markov_chain_by_its_declaration(method, monkeypatch):
    post = SimpleNamespace(method=method.value, sample_stats={}, config={})
    for markov in (False, True):
        monkeypatch.setitem(REGISTRY, method, _declared(method, markov_chain=markov))
        with pytest.raises(ValueError) as err:
            psis._require_density(post)
        assert ("draws from a Markov chain" in str(err.value)) == markov, (method, markov, str(err.value))


def test_subspace_inner_engines_are_the_methods_declared_to_fit_a_function_model(monkeypatch):
    declared = {m.value for m, d in REGISTRY.items() if d.capabilities.function_model}
    assert set(inner_engines()) == declared
    assert {"nuts", "hmc", "metropolis", "svi", "sgld", "sghmc", "csgmcmc"} <= declared  # the inner engines before
    monkeypatch.setitem(REGISTRY, Method.NUTS, _declared(Method.NUTS, function_model=False))
    assert "nuts" not in inner_engines()
    x, y = torch.randn(8, 1), torch.randn(8)
    model = bp.BNN(torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(1.0))
    with pytest.raises(ValueError, match=r"inner: expected one of 'svi', 'hmc', .*got 'nuts'"):
        bp.fit(model, x, y, method="subspace", inner="nuts", progress=False)


@pytest.mark.parametrize("acceptance", [False, True])
def test_the_stuck_chain_check_applies_where_the_declaration_says_accept_reject(acceptance):
    samples = {"w": torch.zeros(2, 50, 3)}  # two chains that never moved
    stats = {"step_size": torch.full((2, 50), 0.1)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_sampler("some_kernel", samples, stats, target_accept=0.5, acceptance=acceptance)
    stuck = [w for w in caught if "some_kernel: chain 0 accepted 0.0%" in str(w.message)]
    assert bool(stuck) == acceptance
    declared = {m.value for m, d in REGISTRY.items() if d.capabilities.accept_reject}
    assert "metropolis" in declared and not {"nuts", "hmc"} & declared


def test_checkpoints_and_resume_extension_follow_the_declarations():
    from bnn_pyro.infer import mcmc

    for method, declared in REGISTRY.items():
        assert declared.capabilities.checkpoint == ("checkpoint" in bp.infer.options(method)), method
        if declared.capabilities.markov_chain and not declared.capabilities.minibatches:
            assert issubclass(declared.fit_function().config_type, mcmc.MCMCConfig), method
    assert set(mcmc.extendable_methods()) == {"nuts", "hmc", "mala"}
