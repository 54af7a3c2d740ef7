"""SVI's flat fast path (bnn_pyro/infer/_svi_flat.py): the default mean-field fit takes it; with the same optimizer
it is bit-identical to the autograd path it replaces (same draws, same losses); Adam is fused; the non-finite stop
names the first bad step also when it checks every k steps; checkpoints resume bit-identically and a checkpoint of
another layout is refused clearly. ``elbo="mean_field"`` (closed-form KL) takes it too, equal to Pyro's path within
float rounding, and a MAP guide with it takes the fast path (Trace_ELBO's estimator: no KL of a point mass). Its step's exactness (Pyro's Trace_ELBO value and gradient in float64) is in
tests/infer/test_analytic.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import _svi_flat
from bnn_pyro.infer.checkpoint import CheckpointError


def _mlp() -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 2, generator=g) * 4 - 2
    return x, torch.sin(x.sum(1)) + 0.1 * torch.randn(40, generator=g)


def _fit(x, y, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the convergence diagnostics of short runs
        return bp.fit(
            _mlp(),
            x,
            y,
            **{"method": "svi", "num_steps": 30, "num_samples": 6, "seed": 2, "progress": False, **options},
        )


def _steps(monkeypatch) -> list:
    calls, original = [], _svi_flat.FlatMeanField.step
    monkeypatch.setattr(_svi_flat.FlatMeanField, "step", lambda self, x, y: calls.append(1) or original(self, x, y))
    return calls


def _without_flat_path(monkeypatch):
    monkeypatch.setattr(_svi_flat.FlatMeanField, "of", classmethod(lambda cls, *args, **kwargs: None))


@pytest.mark.parametrize("options", [dict(), dict(num_particles=3, batch_size=16), dict(num_chains=2, batch_size=8)])
def test_the_flat_path_is_bit_identical_to_the_autograd_path_with_the_same_optimizer(toy, monkeypatch, options):
    x, y = toy
    foreach_adam = lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True)  # noqa: E731 (the autograd path's)
    calls = _steps(monkeypatch)
    flat = _fit(x, y, optimizer=foreach_adam, **options)
    assert len(calls) == 30 * flat.config["num_chains"] and flat.config["fast_path"] is True
    with monkeypatch.context() as m:
        _without_flat_path(m)
        calls.clear()
        before = _fit(x, y, optimizer=foreach_adam, **options)
    assert not calls
    assert torch.equal(flat.history["loss"], before.history["loss"])
    for name in before.samples:
        assert torch.equal(flat.samples[name], before.samples[name]), name


def test_the_default_fit_takes_the_flat_path_with_fused_adam(toy, monkeypatch):
    x, y = toy
    made = []
    original = _svi_flat._optimizer
    monkeypatch.setattr(_svi_flat, "_optimizer", lambda *a: made.append(original(*a)) or made[-1])
    calls = _steps(monkeypatch)
    post = _fit(x, y)
    assert len(calls) == 30 and post.config["fast_path"] is True
    (opt,) = made
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["fused"] is True
    assert [p.shape for p in opt.param_groups[0]["params"]] == [torch.Size([33])] * 2  # loc, unconstrained scale


@pytest.mark.parametrize("interval", [1, 4])
def test_the_non_finite_stop_names_the_first_bad_step(toy, monkeypatch, interval):
    x, y = toy
    y = y.clone()
    y[16:24] = 1e30  # the third batch of 8 (step 2): its squared residuals overflow float32
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    monkeypatch.setattr(_svi_flat, "_check_interval", lambda device: interval)
    calls = _steps(monkeypatch)
    with pytest.raises(FloatingPointError, match=r"the ELBO became inf at step 2 \(of 30\).*lower learning rate"):
        _fit(batches, None)
    assert len(calls) == (3 if interval == 1 else 4)  # checked at once, or at the end of the first 4 steps


@pytest.mark.parametrize("elbo", ["trace", "mean_field"])
def test_resume_is_bit_identical_and_refuses_another_layout(toy, tmp_path, monkeypatch, elbo):
    x, y = toy
    options = dict(num_particles=2, batch_size=16, checkpoint_every=10, elbo=elbo)
    (tmp_path / "whole").mkdir()
    whole = _fit(x, y, **options, checkpoint=tmp_path / "whole")
    cut = tmp_path / "cut"  # a run killed right after its checkpoint at step 20
    cut.mkdir()
    real_save = _svi_flat._Synced.save

    def stop_after_20(self, step, *args):
        real_save(self, step, *args)
        if step == 20:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_svi_flat._Synced, "save", stop_after_20)
        with pytest.raises(KeyboardInterrupt):
            _fit(x, y, **options, checkpoint=cut)
    resumed = _fit(x, y, **options, checkpoint=cut, resume=True)
    assert torch.equal(resumed.history["loss"], whole.history["loss"])
    for name in whole.samples:
        assert torch.equal(resumed.samples[name], whole.samples[name]), name
    old = tmp_path / "old"  # written by the autograd path (the optimizer over every site's tensors)
    old.mkdir()
    with monkeypatch.context() as m:
        _without_flat_path(m)
        _fit(x, y, **{**options, "num_steps": 10}, checkpoint=old)
    with pytest.raises(CheckpointError, match="another layout"):
        _fit(x, y, **{**options, "num_steps": 10}, checkpoint=old, resume=True)
    with pytest.raises(CheckpointError, match=r"another run \(differs in \['lr'\]\)") as refused:
        _fit(x, y, **{**options, "num_steps": 10, "lr": 0.02}, checkpoint=old, resume=True)
    assert "another layout" not in str(refused.value)


FOREACH_ADAM = dict(optimizer=lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True))  # Pyro's path's Adam


@pytest.mark.parametrize("options", [dict(), dict(num_particles=3, batch_size=16)])
def test_elbo_mean_field_takes_the_flat_path_and_equals_pyros_within_rounding(toy, monkeypatch, options):
    """The same draws, the closed-form KL on both paths; only float32 rounding differs (measured: losses 2e-7
    relative, draws 6e-8 absolute after 30 steps), so 1e-5 relative is ~100 float32 ulps."""
    x, y = toy
    calls = _steps(monkeypatch)
    flat = _fit(x, y, elbo="mean_field", **FOREACH_ADAM, **options)
    assert len(calls) == 30 and flat.config["fast_path"] is True and flat.config["elbo"] == "mean_field"
    calls.clear()
    pyro_path = _fit(x, y, elbo="mean_field", fast_path=False, **FOREACH_ADAM, **options)
    assert not calls and pyro_path.config["fast_path"] is False
    torch.testing.assert_close(flat.history["loss"], pyro_path.history["loss"], rtol=1e-5, atol=0)
    for name in flat.samples:
        torch.testing.assert_close(flat.samples[name], pyro_path.samples[name], rtol=1e-5, atol=1e-6)
    trace = _fit(x, y, **FOREACH_ADAM, **options)  # the same draws, another estimator: other losses
    assert (trace.history["loss"] - flat.history["loss"]).abs().max() > 1e-3 * flat.history["loss"].abs().max()


def test_elbo_mean_field_elsewhere_runs_pyros_path_and_says_so(toy, monkeypatch):
    x, y = toy
    calls = _steps(monkeypatch)
    torch.manual_seed(1)
    laplace = bp.BNN(
        torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
        prior=bp.priors.Laplace(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post = bp.fit(laplace, x, y, method="svi", elbo="mean_field", num_steps=5, num_samples=3, progress=False)
    assert not calls and post.config["fast_path"] is False and post.config["elbo"] == "mean_field"


def test_a_map_guide_with_elbo_mean_field_takes_the_fast_path(toy):
    x, y = toy
    fast = _fit(x, y, guide="map", elbo="mean_field", **FOREACH_ADAM)
    slow = _fit(x, y, guide="map", elbo="mean_field", fast_path=False, **FOREACH_ADAM)
    assert fast.config["fast_path"] is True and slow.config["fast_path"] is False
    torch.testing.assert_close(fast.history["loss"], slow.history["loss"], rtol=1e-5, atol=0)
