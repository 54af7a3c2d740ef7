"""Every private name of torch, Pyro and ArviZ that bnn_pyro relies on (bnn_pyro/_upstream_private.py) still
exists and behaves as used: an upgrade that removes one fails here, naming it, before anything else breaks."""

import logging

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.mcmc import HMC
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.nn import PyroModule, PyroSample

from bnn_pyro import _upstream_private as up


def test_torch_reparametrize_module_swaps_parameters_inside_the_context():
    lin = torch.nn.Linear(2, 1)
    values = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    with up.reparametrize_module(lin, values):
        assert torch.equal(lin(torch.ones(1, 2)), torch.full((1, 1), 2.0))
    assert not torch.equal(lin.weight, values["weight"])  # restored


def test_torch_function_mode_and_hook_queries():
    assert not up.function_mode_active()
    with torch.overrides.TorchFunctionMode():
        assert up.function_mode_active()
    lin = torch.nn.Linear(1, 1)
    assert not up.module_hooks(lin) and not up.global_module_hooks()
    handle = lin.register_forward_hook(lambda *a: None)
    assert up.module_hooks(lin)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert up.global_module_hooks()
    finally:
        handle.remove()


def test_pyro_context_caches_one_draw_per_site():
    module = PyroModule[torch.nn.Linear](1, 1)
    module.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 1]).to_event(2))
    with up.pyro_context(module):
        assert module.weight is module.weight  # inside the context a site is drawn once


def test_pyro_autoguide_setup_loc_scale_and_elbo_surrogate():
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    pyro.clear_param_store()
    guide = AutoNormal(model, init_scale=0.3)
    up.autoguide_setup(guide)
    loc, scale = up.autoguide_loc_scale(guide, "a")
    assert loc.shape == () and float(scale) == pytest.approx(0.3)
    pairs = list(up.elbo_traces(Trace_ELBO(num_particles=2), model, guide, (), {}))
    assert len(pairs) == 2
    for model_trace, guide_trace in pairs:
        assert "log_prob" in model_trace.nodes["a"] and "log_prob" in guide_trace.nodes["a"]


@pytest.mark.parametrize("cls, names", [(HMC, up.KERNEL_ATTRIBUTES["HMC"]),
                                        (WarmupAdapter, up.KERNEL_ATTRIBUTES["WarmupAdapter"])])
def test_pyro_kernel_attributes_read_by_the_mcmc_subclasses_exist(cls, names):
    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    obj = HMC(model)
    obj.setup(warmup_steps=5)
    if cls is WarmupAdapter:
        obj = obj._adapter
    missing = [n for n in names if not hasattr(obj, n)]
    assert not missing, f"pyro {pyro.__version__}: {cls.__name__} lost {missing}; update bnn_pyro/infer/_kernels.py"


def test_arviz_logger_is_the_one_arviz_logs_through():
    import arviz

    logger = up.arviz_logger()
    assert isinstance(logger, logging.Logger) and logger is getattr(arviz, "_log", logger)


def test_torch_routes_module_to_double_cuda_and_cpu_through_apply():
    """bnn_pyro.BNN overrides ``nn.Module._apply`` so that ``model.to(...)`` moves its initial values and priors."""
    calls = []

    class Probe(torch.nn.Linear):
        def _apply(self, fn, recurse=True):
            calls.append(fn)
            return super()._apply(fn, recurse)

    probe = Probe(1, 1)
    probe.to(torch.float64), probe.double(), probe.float(), probe.cpu(), probe.to("meta")
    assert len(calls) == 5
