"""Every private name of torch, Pyro and ArviZ that bnn_pyro relies on (bnn_pyro/utils/upstream_private.py) still
exists and behaves as used: an upgrade that removes one fails here, naming it, before anything else breaks."""

import logging

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.mcmc import HMC, NUTS
from pyro.nn import PyroModule, PyroSample

from bnn_pyro.utils import upstream_private as up


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


@pytest.mark.parametrize("cls", [HMC, NUTS])
def test_pyro_mean_accept_prob_is_the_running_mean_of_the_draws_acceptance(cls):
    """The running mean that bnn_pyro.infer._kernels inverts per draw: after one warm-up step it is that
    step's acceptance probability, a number in [0, 1] that moves with the next draw."""

    def model():
        pyro.sample("a", dist.Normal(0.0, 1.0))

    pyro.set_rng_seed(0)
    kernel = cls(model, step_size=0.5, adapt_step_size=False)
    kernel.setup(warmup_steps=5)
    assert up.mean_accept_prob(kernel) == 0.0, f"pyro {pyro.__version__}: {cls.__name__} lost _mean_accept_prob"
    params = kernel.sample(kernel.initial_params)
    first = up.mean_accept_prob(kernel)
    assert isinstance(first, float) and 0.0 < first <= 1.0
    kernel.sample(params)
    assert up.mean_accept_prob(kernel) != first


def test_arviz_logger_is_the_one_arviz_logs_through():
    """``arviz._log`` itself (the fallback ``getLogger("arviz")`` would make an identity check vacuous), and ArviZ's
    one-chain shape complaint (what :func:`arviz_log_level` silences) reaches it before the block, not inside it,
    and again after it. (ArviZ logs each message text once per process: each call here has its own shape.)"""
    import arviz
    import numpy as np

    logger = up.arviz_logger()
    assert hasattr(arviz, "_log"), f"arviz {arviz.__version__} lost arviz._log"
    assert isinstance(logger, logging.Logger) and logger is arviz._log
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def one_chain(draws):  # logs "Shape validation failed: input_shape: (1, draws), ..." at WARNING
        arviz.rhat(np.random.default_rng(0).normal(size=(1, draws)))
        return [m for m in seen if m.startswith(f"Shape validation failed: input_shape: (1, {draws})")]

    handler = Seen()
    logger.addHandler(handler)
    try:
        assert len(one_chain(97)) == 1, seen
        with up.arviz_log_level(logging.ERROR):
            assert one_chain(98) == [], seen
        assert len(one_chain(99)) == 1, seen  # the level is back, and so are ArviZ's warnings
    finally:
        logger.removeHandler(handler)


def test_torch_fan_in_and_fan_out_counts_as_torch_initializers_do():
    assert up.fan_in_and_fan_out(torch.empty(50, 8)) == (8, 50)
    assert up.fan_in_and_fan_out(torch.empty(16, 3, 5, 5)) == (3 * 25, 16 * 25)  # a convolution kernel


def test_torch_distribution_validation_setting_is_read_and_switched_off():
    checked = dist.Normal(0.0, 1.0, validate_args=True)
    assert up.validates_args(checked) and not up.validates_args(dist.Normal(0.0, 1.0, validate_args=False))
    with pytest.raises(ValueError):
        checked.log_prob(torch.tensor(float("nan")))
    up.set_validates_args(checked, False)
    assert not up.validates_args(checked)
    assert torch.isnan(checked.log_prob(torch.tensor(float("nan"))))


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


def test_pyro_hmc_and_warmup_adapter_state_round_trip_mid_warmup():
    """``hmc_state``/``warmup_adapter_state`` read Pyro's private warm-up state (window index, dual averaging,
    Welford sums, cached position and gradient, counters) for MCMC checkpoints: a fresh kernel loaded with it
    mid-window continues exactly as the original through the window's end (where the Welford sums become the
    new mass matrix and the step-size search restarts) into sampling."""
    import json

    def model():
        pyro.sample("a", dist.Normal(torch.zeros(3), torch.tensor([1.0, 2.0, 0.5])).to_event(1))

    def kernel():
        pyro.set_rng_seed(0)
        k = HMC(model, step_size=0.3, num_steps=3)
        k.setup(warmup_steps=40)  # Pyro's schedule: buffer 0-5, mass-matrix window 6-35 (draws 6-12 in it by draw 12)
        return k

    def run(k, params, steps):
        out = []
        for _ in range(steps):
            params = k.sample(params)
            out.append((params["a"], k.step_size, dict(k.inverse_mass_matrix)))
        return out

    first = kernel()
    params = run(first, first.initial_params, 12)[-1][0]
    tensors, meta = up.hmc_state(first)
    json.dumps(meta)  # a checkpoint's metadata is JSON
    assert meta["adapter"]["window"] == 1 and meta["adapter"]["blocks"][0]["n"] == 7, f"pyro {pyro.__version__}"
    second = kernel()
    up.load_hmc_state(second, tensors, meta)
    rng = torch.get_rng_state()
    expected = run(first, {"a": params}, 40)
    torch.set_rng_state(rng)
    got = run(second, {"a": torch.zeros(3)}, 40)  # the position comes from the restored cache
    for (a, step, mass), (b, step_b, mass_b) in zip(expected, got):
        assert torch.equal(a, b) and step == step_b
        assert all(torch.equal(mass[k], mass_b[k]) for k in mass)
    assert not torch.equal(next(iter(expected[-1][2].values())), torch.ones(3))  # the window's end adapted it


def test_pyro_restart_step_size_search_reruns_it_under_the_current_metric():
    """``restart_step_size_search`` sets Pyro's private adapter step back and reruns its search under the inverse
    mass matrix set after ``setup``: on ``N(0, diag(0.01^2, 0.02^2))`` with that covariance as the metric the target
    is ``N(0, I)`` in the metric, so the step found is of order one where the identity's was below 0.05 (leapfrog
    is unstable above twice the smallest sd), and dual averaging is restarted around 10 times the new step."""
    import math

    scales = torch.tensor([0.01, 0.02])

    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2), scales).to_event(1))

    pyro.set_rng_seed(0)
    k = NUTS(model, step_size=1.0, full_mass=True)
    k.setup(warmup_steps=10)
    identity_step = k.step_size
    k.mass_matrix_adapter.inverse_mass_matrix = {("a",): torch.diag(scales**2)}
    up.restart_step_size_search(k, 1.0, k.initial_params)
    assert identity_step < 0.05 and k.step_size > 0.25, f"pyro {pyro.__version__}: {identity_step}, {k.step_size}"
    assert math.isclose(k._adapter._step_size_adapt_scheme.prox_center, math.log(10 * k.step_size))
