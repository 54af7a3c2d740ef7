"""Tests for bnn_pyro/infer/_old_kernel.py: an MCMC engine written to the previous release's kernel interface
(``kernel(model, chain, model_args) -> (kernel, initial_params, transforms)``, documented in docs/adding_an_engine.md
until 7e4976c) still runs, with a DeprecationWarning that says what to write instead (review 20 finding 5: it failed
with a bare TypeError, inside a chain's process when the chains ran in parallel)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import forks_chains

import bnn_pyro as bp
from bnn_pyro.infer import _old_kernel, mcmc
from bnn_pyro.infer._kernels import Metropolis

RUN = dict(method="metropolis", num_samples=10, num_warmup=20, num_chains=2, seed=0, progress=False)


def _fit(**options):
    x = torch.linspace(-1, 1, 12).unsqueeze(-1)
    y = 0.5 * x[:, 0]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    return bp.fit(model, x, y, **RUN, **options)


def _old_interface(monkeypatch):
    """MetropolisConfig.kernel as an out-of-tree engine wrote it for the previous release."""
    new = mcmc.MetropolisConfig.kernel

    def kernel(self, model, chain, model_args):
        return new(self, model, chain), None, None

    monkeypatch.setattr(mcmc.MetropolisConfig, "kernel", kernel)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # a handful of draws
@pytest.mark.parametrize("chain_method", ["sequential", pytest.param("parallel", marks=forks_chains)])
def test_an_engine_written_to_the_old_kernel_interface_runs_with_a_deprecation_warning(monkeypatch, chain_method):
    """The same draws as the current interface's, and one DeprecationWarning, raised in the caller's process and
    pointing at its bp.fit line, that names the config and the signature to write."""
    expected = _fit(chain_method=chain_method)
    _old_interface(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = _fit(chain_method=chain_method)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and deprecations[0].filename == __file__, [str(w.message) for w in caught]
    message = str(deprecations[0].message)
    assert "MetropolisConfig.kernel(self, model, chain) returning the kernel alone" in message
    assert "will be removed in the next" in message
    for name, value in expected.samples.items():
        assert torch.equal(post.samples[name], value), name


def test_the_current_interface_is_not_taken_for_the_old_one():
    """Every registered MCMC engine's config, and one whose kernel takes more keywords with defaults."""
    for config in (mcmc.NUTSConfig(), mcmc.HMCConfig(), mcmc.MetropolisConfig()):
        assert not _old_kernel.is_old(config)

    class Wider(mcmc.MetropolisConfig):
        def kernel(self, model, chain, extra=None):
            return super().kernel(model, chain)

    assert not _old_kernel.is_old(Wider())


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # a handful of draws
def test_an_old_kernel_with_a_default_for_model_args_is_the_old_interface():
    """``kernel(self, model, chain, model_args=None)`` binds ``(model, chain)``, so the signature test alone took it
    for the current interface and its tuple failed inside the chain (review 22: AttributeError 'tuple' object has no
    attribute 'setup'); the parameter's name tells, and a keyword-only one is passed by keyword. Both fit, with the
    current interface's draws."""

    new = mcmc.MetropolisConfig.kernel
    expected = _fit()

    def defaulted(self, model, chain, model_args=None):
        return new(self, model, chain), None, None

    def keyword_only(self, model, chain, *, model_args=None):
        return new(self, model, chain), None, None

    for kernel in (defaulted, keyword_only):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(mcmc.MetropolisConfig, "kernel", kernel)
            assert _old_kernel.is_old(mcmc.MetropolisConfig())
            with pytest.warns(DeprecationWarning, match="kernel interface of the previous release"):
                post = _fit()
        assert all(torch.equal(post.samples[k], v) for k, v in expected.samples.items()), kernel.__name__


class _KeepsItsStart(Metropolis):
    """A kernel that keeps an ``initial_params`` set before ``setup``, as Pyro's potential-function kernels do (the
    old interface returned a start for exactly those); otherwise the library's Metropolis."""

    def setup(self, warmup_steps, *args, **kwargs):
        given = getattr(self, "_initial_params", None)
        super().setup(warmup_steps, *args, **kwargs)
        if given is not None:
            self._initial_params, self._energy_last = given, self.potential_fn(given)


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # a handful of draws
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the old interface's, tested above
def test_an_old_kernels_start_is_set_before_setup_and_its_transforms_map_the_draws(monkeypatch):
    """The old interface's two promises (review 22 finding 6: a shim returning ``(kernel, None, None)`` never ran
    them): the ``initial_params`` it returns are set before ``setup`` (a potential-function kernel then starts
    there: the chain's first step is taken from them), and the ``transforms`` it returns, not the kernel's, map the
    kept draws back (here ``w = 1 + 2 z`` on one site, so the draws are ``(z - 1) / 2``). Each fails if
    ``_old_kernel.build`` drops the value."""
    new = mcmc.MetropolisConfig.kernel
    start = {
        "0.bias": torch.full((3,), 0.25),
        "0.weight": torch.full((3, 1), -0.5),
        "2.bias": torch.full((1,), 0.75),
        "2.weight": torch.full((1, 3), 1.5),
    }
    affine = torch.distributions.AffineTransform(1.0, 2.0)
    firsts = []

    def kernel(self, model, chain, model_args):
        built = new(self, model, chain)
        built.__class__ = _KeepsItsStart
        sample = built.sample

        def spied(params):
            if not firsts or firsts[-1][0] is not built:
                firsts.append((built, {k: v.clone() for k, v in params.items()}))
            return sample(params)

        built.sample = spied
        return built, {k: v.clone() for k, v in start.items()}, {"2.bias": affine}

    monkeypatch.setattr(mcmc.MetropolisConfig, "kernel", kernel)
    post = _fit(chain_method="sequential")
    assert len(firsts) == RUN["num_chains"]
    for _, first in firsts:
        assert first.keys() == start.keys() and all(torch.equal(first[k], start[k]) for k in start)

    # the same run with the kernel's own transforms (identities on these real sites): only 2.bias differs, by the map
    monkeypatch.setattr(
        mcmc.MetropolisConfig,
        "kernel",
        lambda self, model, chain, model_args: (kernel(self, model, chain, model_args)[0], start, None),
    )
    own = _fit(chain_method="sequential")
    assert torch.allclose(post.samples["2.bias"], (own.samples["2.bias"] - 1.0) / 2.0)
    assert not torch.allclose(post.samples["2.bias"], own.samples["2.bias"])
    for name in ("0.bias", "0.weight", "2.weight"):
        assert torch.equal(post.samples[name], own.samples[name]), name
