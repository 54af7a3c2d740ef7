"""SG-MCMC on a plain Pyro function searches its whitening metric once per fit (:func:`bnn_pyro.infer.sgmcmc.fit_metric`).

Before, every chain ran :func:`~bnn_pyro.infer.sg_metric.mode_metric` itself (and the refit on all rows ran it again
per chain), its prior-median start drawn from the chain's own stream: each chain paid the mode search and got a
slightly different metric. And a checkpoint written before the run record named the metric resumed under the whitened
update without saying so (:func:`~bnn_pyro.infer.sgmcmc.refuse_unwhitened`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_snapshot_function import _regression  # noqa: E402

import bnn_pyro as bp  # noqa: E402
import bnn_pyro.infer.sgmcmc as sgmcmc  # noqa: E402
from bnn_pyro.infer.checkpoint import CheckpointError  # noqa: E402

QUICK = {
    "sgld": dict(num_warmup=10, num_samples=5, thin=1),
    "sghmc": dict(num_warmup=10, num_samples=5, thin=1),
    "csgmcmc": dict(num_cycles=2, num_samples=4, thin=1, exploration=0.5, validation=0.4),
    "snapshot": dict(num_cycles=2, cycle_length=10, validation=0.4),
}
"""Short runs of every method that whitens a Pyro function; csgmcmc and snapshot with held-out rows, so that each fit
also refits on all rows (:func:`bnn_pyro.infer.holdout.refit`)."""


def _spy(monkeypatch):
    """Counts ``mode_metric`` calls and collects the metric every chain's optimizer got (``SGMCMC(metric=)``)."""
    calls, metrics = [], []
    search, build = sgmcmc.mode_metric, sgmcmc.SGMCMC.__init__

    def counted(*args, **kwargs):
        calls.append(1)
        return search(*args, **kwargs)

    def spy(self, *args, **kwargs):
        metrics.append(kwargs.get("metric"))
        build(self, *args, **kwargs)

    monkeypatch.setattr(sgmcmc, "mode_metric", counted)
    monkeypatch.setattr(sgmcmc.SGMCMC, "__init__", spy)
    return calls, metrics


@pytest.mark.parametrize("method", sorted(QUICK))
def test_the_metric_is_searched_once_per_fit_and_shared_by_every_chain_and_the_refit(method, monkeypatch):
    """Three chains (and, for csgmcmc and snapshot, three more in the refit on all rows): one mode search, and every
    chain's optimizer whitened by the same ``L`` to the bit. Before: one search per chain and refit chain (3 or 6),
    and each chain's ``L`` from its own median start."""
    model, x, y, *_ = _regression()
    calls, metrics = _spy(monkeypatch)
    post = bp.fit(model, x, y, method=method, num_chains=3, seed=0, progress=False, **QUICK[method])
    refits = 2 if method in ("csgmcmc", "snapshot") else 1
    assert post.config["preconditioner"] == "hessian_at_mode"
    assert post.config["preconditioner_damping"] == 0.0  # a Gaussian posterior: H positive definite, undamped
    assert len(calls) == 1
    assert len(metrics) == 3 * refits and all(m is not None for m in metrics)
    assert all(torch.equal(m, metrics[0]) for m in metrics)


def test_the_metric_is_deterministic_in_the_seed_and_apart_from_the_chains_streams(monkeypatch):
    """The metric is a function of ``seed`` alone (a resumed run recomputes it to the bit): the same whatever the
    global generator held before the fit, and the same for one chain as for three (it is searched under
    ``seed + METRIC_SEED_OFFSET``, before and apart from the chains). A contract test: it holds on the per-chain code
    too for chain 0, whose stream is ``seed``; the per-fit search is tested above."""
    model, x, y, *_ = _regression()
    _, metrics = _spy(monkeypatch)
    torch.manual_seed(123)
    bp.fit(model, x, y, method="sgld", num_chains=2, seed=5, progress=False, **QUICK["sgld"])
    torch.manual_seed(456)
    bp.fit(model, x, y, method="sgld", num_chains=2, seed=5, progress=False, **QUICK["sgld"])
    assert all(torch.equal(m, metrics[0]) for m in metrics)
    # the search's seed, not a chain's: one metric per fit whatever the chain seeds (num_chains 1 vs 3)
    metrics.clear()
    bp.fit(model, x, y, method="sghmc", num_chains=1, seed=5, progress=False, **QUICK["sghmc"])
    bp.fit(model, x, y, method="sghmc", num_chains=3, seed=5, progress=False, **QUICK["sghmc"])
    assert len(metrics) == 4 and all(torch.equal(m, metrics[0]) for m in metrics)


@pytest.mark.parametrize("method", ["sgld", "csgmcmc"])
def test_a_bnn_fit_takes_no_metric_and_records_none(method, tiny_bnn_fit, monkeypatch):
    """A ``bp.BNN`` takes none of this: no mode search, every chain's optimizer without a metric (the path its fits
    took before, so its draws are unchanged), and a config, hence a checkpoint run record, without the preconditioner's
    keys (its checkpoints written before still resume)."""
    calls, metrics = _spy(monkeypatch)
    extra = {"num_warmup": 10} if method == "sgld" else {}
    post = tiny_bnn_fit(method, num_chains=2, num_samples=4, thin=1, **extra)
    assert calls == [] and metrics == [None, None]
    assert not {"preconditioner", "preconditioner_damping", "start"} & set(post.config)


@pytest.mark.parametrize("method", ["sgld", "snapshot"])
def test_a_checkpoint_written_before_the_metric_was_recorded_is_refused(method, tmp_path, monkeypatch):
    """A checkpoint written the old way: the run unwhitened (``mode_metric`` returning ``None``, as before the
    whitening), so its run record names no preconditioner. Resuming it under today's whitened update is refused with
    an error that names the file and says what to do; before, it resumed whitened with nothing said. A checkpoint of
    today's whitened run resumes (``crash_and_resume`` checks it to the bit)."""
    model, x, y, *_ = _regression()
    options = dict(method=method, seed=0, progress=False, checkpoint=tmp_path, checkpoint_every=5)
    options.update(QUICK[method] if method == "sgld" else dict(num_cycles=2, cycle_length=10))
    with monkeypatch.context() as m:  # no metric: the chains run unwhitened, as before the whitening
        m.setattr(sgmcmc, "mode_metric", lambda *args, **kwargs: None)
        old = bp.fit(model, x, y, **options)
    assert "preconditioner" not in old.config
    with pytest.raises(CheckpointError, match="chain0.ckpt") as err:
        bp.fit(model, x, y, resume=True, **options)
    assert "did not record a preconditioner" in str(err.value)
    assert "another (empty) checkpoint folder" in str(err.value)


def test_a_whitened_csgmcmc_run_with_a_refit_resumes_bit_identically(crash_and_resume):
    """csgmcmc on a Pyro function with held-out rows (a fit, then the refit on all rows, both whitened by the one
    metric): crashed at a save and resumed, the metric recomputed from the seed, its draws, statistics and traces equal
    an uninterrupted run's."""
    model, x, y, *_ = _regression()
    config = dict(method="csgmcmc", num_chains=2, seed=3, progress=False, **QUICK["csgmcmc"])
    whole = bp.fit(model, x, y, **config)
    assert whole.config["preconditioner"] == "hessian_at_mode" and whole.config["validation"]["rows"] > 0
    crash_and_resume(lambda **extra: bp.fit(model, x, y, **extra, **config), whole, crash_at=6, every=3)
