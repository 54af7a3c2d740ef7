"""Devices and dtypes, correct by construction: every engine's tensors follow the model's parameters.

* every registered method fits a float64 model (``net.double()``, float64 data) and returns float64 draws and
  float64 predictions, while :class:`FakeDevice` (tests/infer/_fake_device.py) checks that no tensor the package
  creates without ``device=`` meets the model's tensors (what fails on CUDA) and that no float32 tensor made
  with torch's default dtype meets the float64 ones;
* priors and noise priors written with Python numbers (CPU, float32) are placed on the parameters' device and
  dtype (checked on the ``meta`` device, which needs no GPU);
* chains never fork once CUDA is initialised;
* on a machine with CUDA, every method fits on ``cuda`` (skipped here: CI has no GPU).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import Method, driver, svi_gap_cg, svi_refine
from bnn_pyro.utils.placement import placed_like

sys.path.insert(0, os.path.dirname(__file__))
from _fake_device import FakeDevice  # noqa: E402
from test_engine_matrix import TINY  # noqa: E402  (the smallest runs of each method's loop)

METHODS = [m.value for m in Method]
PACKAGE = os.path.dirname(bp.__file__)
# the default Laplace searches its MAP for thousands of steps: a short search exercises the same code
SETTINGS = {**TINY, "laplace": dict(num_steps=50)}


def _data(dtype=torch.float32, device="cpu", n=240):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 4 - 2
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def _model(dtype=torch.float32, device="cpu", likelihood=None, prior=None, out=1) -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, out)).to(device, dtype)
    return bp.BNN(
        net,
        prior=prior or bp.priors.Normal(0.0, 1.0),
        likelihood=likelihood or bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)),
    )


def _checked_fit(model, x, y, method, **options):
    """The fit and a prediction under :class:`FakeDevice`; fails naming the call sites of any mix."""
    fake = FakeDevice([PACKAGE])
    with fake:
        post = bp.fit(model, x, y, method=method, seed=3, progress=False, **options)
        pred = post.predict(x[:5])
    assert not fake.mixed_devices, f"{method}: tensors made without device= met the model's: {dict(fake.mixed_devices)}"
    assert not fake.mixed_dtypes, f"{method}: float32 tensors met float64 ones: {dict(fake.mixed_dtypes)}"
    return post, pred


# ---------------------------------------------------------------- the checker itself can fail
def test_fake_device_flags_a_buffer_made_without_device_and_passes_one_made_on_the_device():
    def accumulate(w, on_device):
        total = torch.zeros(w.shape, dtype=torch.float64, **({"device": w.device} if on_device else {}))
        return total + w.double()

    w = torch.randn(3)
    for on_device in (False, True):
        fake = FakeDevice([os.path.dirname(__file__)])
        with fake:
            accumulate(w, on_device)
            torch.zeros(3).to(w.device) + w  # moved explicitly: fine
            w + torch.ones(()) + w.new_zeros(3)  # a 0-dim host tensor (CUDA takes CPU scalars), a derived one: fine
            torch.zeros(3) + torch.ones(3)  # host tensors among themselves: fine
        assert bool(fake.mixed_devices) is not on_device, dict(fake.mixed_devices)
        assert not fake.mixed_dtypes
    fake = FakeDevice([os.path.dirname(__file__)])
    with fake:
        torch.randn(3, dtype=torch.float64) * torch.ones(3)
    assert [k.split(":")[0] for k in fake.mixed_dtypes] == ["mul test_devices.py"]


# ---------------------------------------------------------------- every engine, float64, devices followed
def test_every_method_is_in_the_device_matrix():
    assert set(SETTINGS) >= set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_fits_a_float64_model_with_buffers_on_the_models_device(method):
    x, y = _data(torch.float64)
    post, pred = _checked_fit(_model(torch.float64), x, y, method, **SETTINGS[method])
    assert {v.dtype for v in post.samples.values()} == {torch.float64}
    assert pred.mean.dtype == pred.std.dtype == pred.draws.dtype == torch.float64
    assert bool(torch.isfinite(pred.mean).all() and torch.isfinite(pred.std).all())


@pytest.mark.parametrize("likelihood", ["Bernoulli", "Categorical"])
@pytest.mark.parametrize("method", ["nuts", "hmc"])
def test_nuts_and_hmc_on_a_float64_classifier_keep_one_dtype_and_the_models_device(method, likelihood):
    """The flat kernels on the generic potential (a classifier's), which the Gaussian matrix above does not reach:
    the labels, kept in torch's default dtype, are scored in the model's."""
    x, y = _data(torch.float64)
    labels = (y > 0).float() if likelihood == "Bernoulli" else (y > 0).long() + (y > 0.5).long()
    model = _model(
        torch.float64, likelihood=getattr(bp.likelihoods, likelihood)(), out=1 if likelihood == "Bernoulli" else 3
    )
    post, pred = _checked_fit(model, x, labels, method, **SETTINGS[method])
    assert {v.dtype for v in post.samples.values()} == {torch.float64}
    assert bool(torch.isfinite(post.sample_stats["lp"]).all())


def test_noise_collapse_reference_regressions_make_their_buffers_on_the_inputs_device():
    """``check_noise_collapse``'s ridge / nearest-neighbour R^2 runs only on a fit that predicts the mean, which the
    engine matrix's fits need not do: checked directly (its identity matrix was once made on the CPU, which failed on
    CUDA, found on a GPU)."""
    from bnn_pyro.infer._health import reference_r2

    x, y = _data(torch.float64)
    fake = FakeDevice([PACKAGE])
    with fake:
        r2, which = reference_r2(x, y)
    assert not fake.mixed_devices, dict(fake.mixed_devices)
    assert not fake.mixed_dtypes, dict(fake.mixed_dtypes)
    assert r2 > 0.5 and which.endswith("regression"), (r2, which)  # sin(x) + noise: explained out of sample


def _linear_function(x, y=None):
    """A plain Pyro function (no ``BNN``): the engines' own paths for such models (the prior-median start, the
    converged members and modes, the whitened SG-MCMC cycles) run on it."""
    b = pyro.sample("b", dist.Normal(x.new_zeros(2), 10.0).to_event(1))
    s = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(b[0] + b[1] * x[:, 0], s), obs=y)


@pytest.mark.parametrize(
    "method", ["svi", "ensemble", "swag", "snapshot", "csgmcmc", "laplace", "metropolis", "nuts", "hmc"]
)
def test_plain_pyro_function_paths_keep_buffers_on_the_models_device(method, monkeypatch):
    """The Newton steps that converge a function's members / modes (``map_fit.damped_newton``,
    ``sg_metric.mode_metric``) once made their damping identity on the CPU (CUDA would fail there), and the
    parameters' R-hat stacked host and model tensors: found by this test, fixed. (SVI's refinement and gap: the bound
    on the fit's cost lifted, the fit is short.)"""
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)
    x, y = _data(torch.float64)
    x = x + 40.0  # a covariate far from 0: the conditioning the function paths are for
    options = {**SETTINGS[method], **({"num_chains": 2} if method == "ensemble" else {})}
    post, _ = _checked_fit(_linear_function, x, y, method, **options)
    assert {v.dtype for v in post.samples.values()} == {torch.float64}
    assert method != "svi" or post.config["guide"] == "full_rank"  # the Laplace-started full-rank default
    # the refinement ran on the device (a device error in it is caught and recorded as "skipped: ...")
    assert method != "svi" or not post.config["guide_refinement"][0]["stopped"].startswith("skipped"), post.config


def test_a_low_rank_guide_is_refined_and_checked_on_the_models_device(monkeypatch):
    """The low-rank refinement's projection (svi_refine.project_low_rank) and its gap's expected Hessian (svi_gap) make
    tensors of their own: on the model's device, with neither skipped nor without a verdict (the bound on the fit's
    cost lifted: the fit is short)."""
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)
    x, y = _data(torch.float64)
    post, _ = _checked_fit(_linear_function, x + 40.0, y, "svi", **{**SETTINGS["svi"], "guide": "low_rank"})
    assert not post.config["guide_refinement"][0]["stopped"].startswith("skipped"), post.config
    assert "guide_gap" in post.history, post.history.keys()
    assert all(r["method"] == "dense" and r["reason"] is None for r in post.config["guide_gap"]), post.config


def test_a_full_rank_guide_past_the_dense_bounds_is_stepped_and_checked_on_the_models_device(monkeypatch):
    """Past the dense bounds (lowered here) a full-rank guide's mean takes the conjugate-gradient step and its gap is
    the dense statistic on the step's antithetic draws (svi_gap: svi_gap_cg.antithetic_half's tensors): on the model's
    device, the step not skipped and the gap with a verdict from its pairs (the bound on the fit's cost lifted)."""
    monkeypatch.setattr(svi_refine, "MAX_WORK", 1)
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)
    x, y = _data(torch.float64)
    post, _ = _checked_fit(_linear_function, x + 40.0, y, "svi", **SETTINGS["svi"])
    assert post.config["guide"] == "full_rank", post.config
    assert not any(r["stopped"].startswith("skipped") for r in post.config["guide_refinement"]), post.config
    records = post.config["guide_gap"]
    assert records and all(r["method"] == "dense" and r.get("pairs") and r["reason"] is None for r in records), records
    assert bool(post.history["guide_gap"].isfinite().all()), post.history["guide_gap"]


@pytest.mark.parametrize("guide", ["mean_field", "low_rank"])
def test_the_conjugate_gradient_gap_runs_on_the_models_device(guide, monkeypatch):
    """Past the dense bounds (lowered here) the gap of a mean-field or low-rank guide is taken by conjugate gradients
    (svi_gap_cg), after the mean's Newton steps (svi_refine_cg), whose draws, batches and preconditioner are tensors
    of their own: on the model's device, with a verdict, and the steps not skipped (the bound on the fit's cost lifted:
    the fit is short)."""
    monkeypatch.setattr(svi_refine, "MAX_WORK", 1)
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)
    x, y = _data(torch.float64)
    post, _ = _checked_fit(_linear_function, x + 40.0, y, "svi", **{**SETTINGS["svi"], "guide": guide})
    records = post.config["guide_gap"]
    assert records and all(r["method"] == "cg" and r["reason"] is None for r in records), records
    assert post.history["guide_gap"].shape[-1] == 3 and bool(post.history["guide_gap"].isfinite().all())
    steps = post.config["guide_refinement"]  # the mean's Newton steps (svi_refine_cg) ran too
    assert steps and not any(r["stopped"].startswith("skipped") for r in steps), steps
    scales = [r["scale"]["stopped"] for r in steps if "scale" in r]  # and a mean-field guide's scale step before them
    assert len(scales) == (len(steps) if guide == "mean_field" else 0), steps
    assert not any(stopped.startswith("skipped") for stopped in scales), steps


@pytest.mark.slow  # five Laplace fits under the checker: ~6 s each on 2 busy cores
@pytest.mark.parametrize(
    "options",
    [
        dict(structure="full", prior_precision="marglik"),
        dict(structure="diag", hessian="fisher"),
        dict(structure="kron", predictive="glm"),
        dict(structure="last_layer", predictive="nn"),
    ],
    ids=lambda o: "-".join(map(str, o.values())),
)
def test_laplace_structures_keep_float64_curvature_on_the_models_device(options):
    x, y = _data(torch.float32)
    post, pred = _checked_fit(_model(torch.float32), x, y, "laplace", num_steps=50, **options)
    assert pred.mean.dtype == torch.float32 and bool(torch.isfinite(pred.std).all())


@pytest.mark.slow
def test_laplace_classification_probit_on_the_models_device():
    x, y = _data(torch.float64)
    labels = (y > 0).long()
    model = _model(torch.float64, likelihood=bp.likelihoods.Categorical(), out=2)
    post, pred = _checked_fit(model, x, labels, "laplace", num_steps=50)
    assert pred.probs.dtype == torch.float64 and torch.allclose(pred.probs.sum(-1), torch.ones((), dtype=torch.float64))


# ---------------------------------------------------------------- priors follow the parameters
@pytest.mark.parametrize(
    "prior",
    [
        dist.Normal(0.0, 1.0),
        dist.LogNormal(0.0, 1.0),  # a TransformedDistribution
        bp.priors.ScaleMixtureNormal()("w", None, torch.zeros(1)),  # a MixtureSameFamily built with torch.tensor
        dist.Normal(torch.zeros(3), 1.0).to_event(1),
    ],
    ids=["normal", "lognormal", "mixture", "independent"],
)
def test_placed_like_moves_every_tensor_of_a_distribution_to_the_device_and_dtype(prior):
    like = torch.empty(3, dtype=torch.float64, device="meta")
    placed = placed_like(prior, like)
    draw = placed.sample()
    assert draw.device.type == "meta" and draw.dtype == torch.float64
    assert prior.sample().device.type == "cpu"  # the caller's distribution is unchanged
    assert placed_like(prior, prior.sample()) is prior  # nothing to move: no copy
    assert placed_like(prior, like) is placed  # remembered: a likelihood places its noise prior at every run


def test_bnn_on_the_meta_device_draws_every_site_there():
    """A net on another device and dtype than torch's defaults: every weight, hyper and noise site is drawn there,
    though the priors were written with Python numbers."""
    prior = {"0.*": bp.priors.HierarchicalNormal(), "2.*": dist.Laplace(0.0, 1.0)}
    with pyro.validation_enabled(False):  # argument checks read values, which meta tensors have none of
        model = _model(torch.float64, "meta", prior=bp.priors.as_prior(prior))
        trace = pyro.poutine.trace(model).get_trace(torch.empty(4, 1, dtype=torch.float64, device="meta"))
    sites = {n: s["value"] for n, s in trace.nodes.items() if s["type"] == "sample" and n != "data"}  # not the plate
    assert {"0.weight", "2.bias", "sigma", "obs"} <= set(sites) and len(sites) > len(model.sample_names) + 1
    assert {(v.device.type, v.dtype) for v in sites.values()} == {("meta", torch.float64)}


def test_model_to_after_construction_moves_initial_values_and_priors():
    """``model.double()`` / ``model.to(device)`` on a built BNN: its initial values and priors are not registered
    tensors, and stayed float32 on the CPU before (the data were then silently cast back to float32)."""
    model = _model().double()
    assert model.dtype == torch.float64 and {v.dtype for v in model.init_values.values()} == {torch.float64}
    x, y = _data(torch.float64)
    post, _ = _checked_fit(model, x, y, "sgld", **SETTINGS["sgld"])
    assert {v.dtype for v in post.samples.values()} == {torch.float64}
    with pyro.validation_enabled(False):
        moved = _model().to("meta")
        trace = pyro.poutine.trace(moved).get_trace(torch.empty(4, 1, device="meta"))
    assert moved.device.type == "meta"
    assert {s["value"].device.type for n, s in trace.nodes.items() if s["type"] == "sample"} == {"meta"}


# ---------------------------------------------------------------- no fork once CUDA is initialised, nor where a child cannot run autograd
@pytest.mark.skipif(
    driver._accelerator_visible(), reason="this machine's torch sees an accelerator: the GPU test below"
)
def test_the_fork_probe_decides_by_a_backward_pass_in_a_forked_child(monkeypatch):
    """Without an accelerator autograd never starts device threads: nothing is forked to ask. Told one is visible, the
    probe forks a child that runs a backward pass; its exit code is the answer (a CPU-only torch: it succeeds). Only
    torch's own refusal blames autograd's device threads (naming the device and the way out); another failure (an
    exception, a signal) or a child that does not answer in time (killed) is a refusal that says what happened. A
    refusal is kept for the process (the threads never stop; a child that hung once would hang again)."""
    monkeypatch.setattr(driver, "_refused", None)

    def no_fork(*args):
        raise AssertionError("the probe forked without an accelerator")

    with monkeypatch.context() as m:
        m.setattr(driver.mp, "get_context", no_fork)
        m.setattr(os, "fork", no_fork)
        assert driver.fork_refusal() is None and driver.autograd_survives_fork()
    monkeypatch.setattr(driver, "_accelerator", lambda: "cuda")
    assert driver.fork_refusal() is None  # a real fork, a real backward pass in the child

    def raising(err):
        def backward(self, *args, **kwargs):
            raise err

        return backward

    def asked(accelerator="cuda", backward=None, probe=None, seconds=driver.PROBE_SECONDS):
        with monkeypatch.context() as m:
            m.setattr(driver, "_refused", None)
            m.setattr(driver, "_accelerator", lambda: accelerator)
            m.setattr(driver, "PROBE_SECONDS", seconds)
            if backward is not None:
                m.setattr(torch.Tensor, "backward", backward)
            if probe is not None:
                m.setattr(driver, "_backward_or_exit", probe)
            said = driver.fork_refusal()
            assert driver._refused == said  # kept
            m.setattr(driver, "_backward_or_exit", lambda: os._exit(0))
            assert driver.fork_refusal() == said  # not asked again
        return said

    refusal = RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing.")
    said = asked(backward=raising(refusal))
    assert "could not run autograd" in said and "accelerator (cuda)" in said and "VISIBLE_DEVICES=''" in said, said
    said = asked("mps", backward=raising(refusal))
    assert "accelerator (mps)" in said and "VISIBLE_DEVICES" not in said, said
    for other in (RuntimeError("another error"), MemoryError("not a refusal")):
        said = asked(backward=raising(other))
        assert said.startswith("a forked process running one backward pass ended with exit code 4"), (other, said)
    assert "ended with signal 9" in asked(probe=lambda: os.kill(os.getpid(), 9))
    assert "macOS" not in asked(probe=lambda: os.kill(os.getpid(), 9))  # the cause is named for MPS alone (below)
    said = asked("mps", probe=lambda: os.kill(os.getpid(), 9))  # as macOS's fork-safety abort (signal 6, whose
    # default action may write a core file here) ends the child: review 24 finding 13
    assert "ended with signal 9" in said and "Objective-C runtime's fork safety" in said, said
    assert "docs/devices.md" in said and "not asked again" in said, said
    assert "macOS" not in asked("mps", backward=raising(RuntimeError("another error")))  # an exit code: no signal
    said = asked(probe=lambda: time.sleep(30), seconds=0.5)
    assert "did not finish one backward pass within driver.PROBE_SECONDS (0.5 s" in said, said


def _cuda_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def _fork_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    refusal = "a forked process could not run autograd: (simulated; to fit ..., CUDA_VISIBLE_DEVICES='')"
    monkeypatch.setattr(driver, "fork_refusal", lambda: refusal)


@pytest.mark.parametrize(
    "cause, said",
    [
        pytest.param(
            _cuda_initialised,
            "CUDA is initialised",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(),
                reason="simulates CUDA on a machine without one (patching a real device's state breaks "
                "torch.manual_seed); on a GPU the tests below run the real thing",
            ),
            id="cuda-initialised",
        ),
        pytest.param(_fork_refused, "a forked process could not run autograd.*CUDA_VISIBLE", id="fork-refused"),
    ],
)
def test_chains_run_in_this_process_where_they_cannot_fork(cause, said, monkeypatch):
    """Once CUDA is initialised (a forked child cannot use its parent's context), or on a machine whose torch sees a
    GPU once a backward pass has run in this process (a start, a MAP of the deterministic parameters: every backward
    pass in a forked child then raises, and parallel chains of a CPU model failed at their first gradient, found on
    an H200, 2026-11-28): ``"parallel"`` is refused, naming the cause and the way out, and ``"auto"`` runs the
    chains here with a warning; no chain is forked."""
    monkeypatch.setattr(driver, "_cores", lambda: 4)
    cause(monkeypatch)
    with pytest.raises(ValueError, match=rf"chain_method='parallel' cannot run here: {said}"):
        driver.chain_execution(2, "parallel")

    def no_fork(*args, **kwargs):
        raise AssertionError("a chain was forked where it cannot run")

    monkeypatch.setattr(driver, "_start", no_fork)
    x, y = _data()
    with pytest.warns(UserWarning, match=rf"{said}.*run one after another"):
        post = bp.fit(
            _model(), x, y, method="metropolis", seed=0, progress=False, **{**TINY["metropolis"], "num_chains": 2}
        )
    assert post.config["chain_execution"] == "sequential" and post.num_chains == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_a_cpu_fit_on_a_gpu_machine_runs_its_chains_after_a_backward_pass():
    """The real thing, in a fresh process (this one may have initialised CUDA, which is the other rule): the probe's
    yes before any backward pass, NUTS's default chains on CPU tensors after the fit's own gradient work (how the
    H200 run failed: forked, whatever it chose, the chains must finish) and after a backward pass (in this process)."""
    script = """
import warnings, torch, bnn_pyro as bp
from bnn_pyro.infer import driver
x = torch.linspace(-2, 2, 40).unsqueeze(-1); y = torch.sin(x).squeeze(-1)
net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
assert driver.autograd_survives_fork()  # a fresh process: no backward pass yet, the chains may fork
for step in ("the fit's own", "after a backward pass"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="nuts", num_samples=10, num_warmup=10, progress=False)
    run = post.config["chain_execution"]
    assert all(bool(torch.isfinite(v).all()) for v in post.samples.values()), step
    assert run == "parallel" or any("could not run autograd" in str(w.message) for w in caught), step
    print(step, run, post.num_chains)
    torch.ones(1, requires_grad=True).sum().backward()
assert not torch.cuda.is_initialized() and not driver.autograd_survives_fork() and run == "sequential"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), done.stdout + done.stderr[-3000:]


# ---------------------------------------------------------------- the engine matrix on a real GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize(
    "method", ["svi", "ensemble", "swag", "snapshot", "csgmcmc", "laplace", "metropolis", "nuts", "hmc"]
)
def test_plain_pyro_function_paths_run_on_cuda(method, monkeypatch):
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)  # SVI's refinement and gap: the fit is short
    x, y = _data(device="cuda")
    options = {**SETTINGS[method], **({"num_chains": 2} if method == "ensemble" else {})}
    post = bp.fit(_linear_function, x + 40.0, y, method=method, seed=3, progress=False, **options)
    assert {v.device.type for v in post.samples.values()} == {"cuda"}
    assert all(bool(torch.isfinite(v).all()) for v in post.samples.values())
    # the refinement and the gap ran on the device (a device error in either is caught and recorded, not raised)
    assert method != "svi" or not post.config["guide_refinement"][0]["stopped"].startswith("skipped"), post.config
    # every chain's gap ran (a record with no reason; one with a reason says why it did not), its verdict finite
    assert method != "svi" or all(r["reason"] is None for r in post.config["guide_gap"]), post.config
    assert method != "svi" or bool(post.history["guide_gap"].isfinite().all()), post.history


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("guide", ["low_rank", "mean_field"])
def test_every_refined_guide_family_runs_on_cuda(guide, monkeypatch):
    """The low-rank projection (L-BFGS on the device) and the mean-field diagonal step make tensors of their own: on
    CUDA neither is skipped, and the gap has a verdict (the CUDA twin of the fake-device low-rank test above)."""
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)  # the fit is short
    x, y = _data(device="cuda")
    post = bp.fit(_linear_function, x + 40.0, y, method="svi", guide=guide, seed=3, progress=False, **SETTINGS["svi"])
    assert not post.config["guide_refinement"][0]["stopped"].startswith("skipped"), post.config
    assert guide == "mean_field" or all(r["reason"] is None for r in post.config["guide_gap"]), post.config
    assert guide == "mean_field" or bool(post.history["guide_gap"].isfinite().all()), post.history
    assert {v.device.type for v in post.samples.values()} == {"cuda"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("guide", ["low_rank", "mean_field"])
def test_the_conjugate_gradient_gap_runs_on_cuda(guide, monkeypatch):
    """The CUDA twin of the fake-device test of the conjugate-gradient gap above."""
    monkeypatch.setattr(svi_refine, "MAX_WORK", 1)
    monkeypatch.setattr(svi_gap_cg, "FIT_SHARE", math.inf)
    x, y = _data(device="cuda")
    post = bp.fit(_linear_function, x + 40.0, y, method="svi", guide=guide, seed=3, progress=False, **SETTINGS["svi"])
    records = post.config["guide_gap"]
    assert records and all(r["method"] == "cg" and r["reason"] is None for r in records), records
    assert not any(r["stopped"].startswith("skipped") for r in post.config["guide_refinement"]), post.config
    assert post.history["guide_gap"].device.type == "cpu" and bool(post.history["guide_gap"].isfinite().all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("method", METHODS)
def test_every_method_fits_and_predicts_on_cuda(method):
    x, y = _data(device="cuda")
    post = bp.fit(_model(device="cuda"), x, y, method=method, seed=3, progress=False, **SETTINGS[method])
    assert {v.device.type for v in post.samples.values()} == {"cuda"}
    pred = post.predict(x[:5])
    assert pred.mean.device.type == "cuda" and bool(torch.isfinite(pred.std).all())


class _Crash(Exception):
    pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("method", ["svi", "sgld", "nuts", "hmc"])
def test_resume_on_cuda_is_bit_identical(method, tmp_path, monkeypatch):
    """The CUDA generators' states go into the checkpoints (tests/infer/test_checkpoint.py checks the saving on
    CPU with a fake torch.cuda): a crashed CUDA run resumes to the same draws. NUTS and HMC on a classifier: the flat
    kernels on the generic potential, whose own generator's state must go back as a CPU tensor."""
    from bnn_pyro.infer import checkpoint as ckpt_mod

    x, y = _data(device="cuda")
    model = _model
    if method in ("nuts", "hmc"):
        y = (y > 0).long() + (y > 0.5).long()
        model = lambda device: _model(device=device, likelihood=bp.likelihoods.Categorical(), out=3)  # noqa: E731
    run = dict(method=method, seed=3, progress=False, **SETTINGS[method])
    whole = bp.fit(model(device="cuda"), x, y, **run)
    save, saves = ckpt_mod.Checkpoint.save, []

    def crashing(self, step, tensors, meta):
        saves.append(step)
        if len(saves) == 2:
            raise _Crash(step)
        return save(self, step, tensors, meta)

    with monkeypatch.context() as m:
        m.setattr(ckpt_mod.Checkpoint, "save", crashing)
        with pytest.raises(_Crash):
            bp.fit(model(device="cuda"), x, y, checkpoint=tmp_path, checkpoint_every=4, **run)
    resumed = bp.fit(model(device="cuda"), x, y, checkpoint=tmp_path, checkpoint_every=4, resume=True, **run)
    for name in whole.samples:
        assert torch.equal(resumed.samples[name], whole.samples[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("method", ["nuts", "hmc"])
def test_vectorized_chains_run_on_cuda(method):
    """chain_method='vectorized' (the batched leapfrog of _analytic_batched / _nuts_batched) on CUDA tensors: the
    draws stay on the device, are finite, and every chain moved."""
    x, y = _data(device="cuda")
    model = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(1, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).cuda(),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
    )
    post = bp.fit(
        model,
        x,
        y,
        method=method,
        num_chains=3,
        chain_method="vectorized",
        num_warmup=30,
        num_samples=20,
        seed=0,
        progress=False,
        **({"max_tree_depth": 5} if method == "nuts" else {}),
    )
    assert post.config["chain_execution"] == "vectorized"
    for name, v in post.samples.items():
        assert v.device.type == "cuda" and bool(torch.isfinite(v).all()), name
        assert bool((v[:, 0] != v[:, -1]).any()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_chunked_prediction_on_cuda_equals_the_unchunked_one():
    """predict's blocks of rows and its seeded predictive noise (per block of rows, on the CUDA generator) give the
    same statistics and draws whatever the chunk size, on the device."""
    x, y = _data(device="cuda")
    post = bp.fit(_model(device="cuda"), x, y, method="svi", seed=0, progress=False, **SETTINGS["svi"])
    whole = post.predict(x, num_samples=50, seed=1)
    small = post.predict(x, num_samples=50, seed=1, points_per_chunk=7)
    assert whole.mean.device.type == "cuda"
    for name in ("mean", "std", "epistemic_std", "lower", "upper"):
        assert torch.allclose(getattr(whole, name), getattr(small, name), atol=1e-5), name
    assert torch.equal(whole.draws, small.draws)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("kind", ["numpy", "pandas"])
def test_compare_on_cuda_takes_host_data(kind, task):
    """``bp.compare`` of a CUDA model on numpy or pandas data: its splits are converted as ``bp.fit`` converts a fit's
    data, onto the model's device (found by review: pandas splits were CPU tensors, refused before any fit; numpy
    test rows met CUDA predictions at scoring)."""
    import pandas as pd

    x, y = _data(torch.float64)
    x, y = x.numpy(), y.numpy()
    model = _model(device="cuda")
    if task == "classification":  # metrics on class probabilities (ECE's bins, Brier) too
        y = (y > 0).astype("int64")
        model = _model(device="cuda", likelihood=bp.likelihoods.Categorical(), out=2)
    if kind == "pandas":
        x, y = pd.DataFrame({"x": x[:, 0]}), pd.Series(y)
    result = bp.compare(model, x[:180], y[:180], test=(x[180:], y[180:]), methods=["laplace"], progress=False)
    assert (result.table["error"] == "").all(), result.table["error"]
    assert bool(torch.isfinite(torch.tensor(float(result.table.loc["laplace", "test_ll"]))))
