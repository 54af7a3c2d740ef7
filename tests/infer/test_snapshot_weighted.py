"""Snapshot ensembles on a plain Pyro function weight each cycle's observations by its own draw (the weighted
likelihood bootstrap, :mod:`bnn_pyro.infer.anchor`, "The data half"; :mod:`bnn_pyro.infer.snapshot`, "Pyro
functions").

Before, each whitened cycle of a Pyro function ended at the minimum of the potential tilted toward its own prior draw,
``A^{-1}(b + Lambda_0 w_0)``, so the snapshots' covariance was ``A^{-1} Lambda_0 A^{-1}``, not the posterior's
``A^{-1}``: on the reference suite's kidiq and logistic their sds were 0.007-0.086 of the exact ones
(``benchmarks/results/reference_suite/function_today.md``). Now cycle ``c`` of a run with seed ``s`` also weights the
observations of the rows it fits by ``n * Dirichlet(1, ..., 1)`` drawn under ``s + c * ANCHOR_CYCLE_OFFSET``."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ensemble_function_spread import _linear  # noqa: E402
from test_snapshot_function import NOISE, PRIOR_SD, _regression  # noqa: E402

import bnn_pyro as bp  # noqa: E402
import bnn_pyro.infer.anchor as anchor_module  # noqa: E402
import bnn_pyro.infer.snapshot as snapshot  # noqa: E402
from bnn_pyro.infer import checkpoint as ckpt_module  # noqa: E402
from bnn_pyro.infer import sgmcmc  # noqa: E402
from bnn_pyro.infer.anchor import ANCHOR_SEED_OFFSET, bootstrap_sites, bootstrap_weights  # noqa: E402
from bnn_pyro.infer.checkpoint import CheckpointError  # noqa: E402
from bnn_pyro.infer.sgmcmc_step import largest_curvature  # noqa: E402
from bnn_pyro.infer.snapshot import ANCHOR_CYCLE_OFFSET  # noqa: E402
from bnn_pyro.posterior.diagnostics import DiagnosticWarning  # noqa: E402

LINEAR_PRIOR_SD, LINEAR_NOISE = 1.0, 0.5  # test_ensemble_function_spread._linear's


def test_each_cycles_snapshot_is_its_weighted_anchored_ridge_solution_in_closed_form():
    """Cycle ``c`` of chain ``k`` (seed ``s + k``) minimizes ``sum_i v_i (y_i - x_i b)^2 / (2 sigma^2) + |b - b_0|^2 /
    (2 s^2)`` with its weights ``v`` (:func:`bootstrap_weights` under ``s + k + c * ANCHOR_CYCLE_OFFSET``) and its
    anchor ``b_0`` (the prior draw under that seed plus ``ANCHOR_SEED_OFFSET``): ``b = (X^T V X / sigma^2 + I / s^2)^-1
    (X^T V y / sigma^2 + b_0 / s^2)``. The whitened cycle with momentum 0.9 contracts by about ``sqrt(0.9)`` per step
    while its step is large, so a 600-step cycle (float64) ends within 1e-9 posterior sd of it (300 steps: 1e-6). Before, ``v = 1``: every snapshot missed this by about a posterior sd."""
    model, x, y, design = _linear(n=60)
    seed, cycles = 5, 2
    post = bp.fit(model, x, y, method="snapshot", num_cycles=cycles, cycle_length=600, num_chains=2, seed=seed,
                  progress=False)  # fmt: skip
    assert post.config["observation_weights"]["sites"] == {"obs": "[60]"}  # clean_config writes lists as text
    assert post.config["observation_weights"]["anchored_prior"] is True
    sd = torch.linalg.inv(design.T @ design / LINEAR_NOISE**2 + torch.eye(3, dtype=x.dtype)).diagonal().sqrt()
    sites = bootstrap_sites(model, x, y)
    for k in range(2):
        for c in range(cycles):
            cycle_seed = seed + k + c * ANCHOR_CYCLE_OFFSET
            v = bootstrap_weights(sites, seed=cycle_seed, like=y)["obs"]
            with torch.random.fork_rng(devices=[]):
                pyro.set_rng_seed(cycle_seed + ANCHOR_SEED_OFFSET)
                b0 = pyro.poutine.trace(model).get_trace(x, y).nodes["beta"]["value"]
            a = design.T @ (v[:, None] * design) / LINEAR_NOISE**2 + torch.eye(3, dtype=x.dtype) / LINEAR_PRIOR_SD**2
            b = torch.linalg.solve(a, design.T @ (v * y) / LINEAR_NOISE**2 + b0 / LINEAR_PRIOR_SD**2)
            off = ((post.samples["beta"][k, c] - b) / sd).abs().max()
            assert float(off) < 1e-9, (k, c, post.samples["beta"][k, c], b)


def test_without_bootstrap_the_cycles_are_the_anchored_ones_and_the_config_says_why():
    """``bootstrap=False``: every cycle weighs every observation 1 (the anchored cycles of before), recorded."""
    model, x, y, _ = _linear(n=60)
    fit = dict(method="snapshot", num_cycles=2, cycle_length=200, seed=0, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the anchored-only snapshots are too narrow, and warned so
        plain = bp.fit(model, x, y, bootstrap=False, **fit)
    weighted = bp.fit(model, x, y, **fit)
    assert plain.config["observation_weights"] == {"skipped": "bootstrap=False"}
    assert plain.config["bootstrap"] is False and weighted.config["bootstrap"] is True
    assert not torch.equal(plain.samples["beta"], weighted.samples["beta"])


def test_where_no_observation_can_be_weighted_the_config_says_why_and_the_narrow_warning_names_that_cause():
    """Minibatches (a weight per row of the data set, not of a batch) and an observed site whose observations lie in
    one event leave the cycles unweighted, recorded; the one-event model's snapshots (anchored only, and its one
    parameter set by the data) are then too narrow, and the warning names the unweighted cause."""
    model, x, y, _ = _linear(n=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batched = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=30, batch_size=20, seed=0,
                         progress=False)  # fmt: skip
    assert batched.config["preconditioner"] == "hessian_at_mode"  # whitened, but unweighted
    assert "minibatches" in batched.config["observation_weights"]["skipped"]
    # a batch size between the training rows (36) and all rows (60) minibatches the refit only: one plan serves
    # both runs, so neither is weighted (the refit once drew 60 weights for 40-row batches and crashed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        between = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=30, batch_size=40,
                         validation=0.4, seed=0, progress=False)  # fmt: skip
    assert "minibatches" in between.config["observation_weights"]["skipped"]
    assert torch.isfinite(between.samples["beta"]).all()

    def one_event(x, y=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        return pyro.sample("obs", dist.Normal(mu, 1.0).expand([len(x)]).to_event(1), obs=y)

    x1, y1 = torch.zeros(30, 1), torch.randn(30, generator=torch.Generator().manual_seed(0)) + 2.0
    with pytest.warns(DiagnosticWarning, match=r"too narrow.*observations are not weighted"):
        post = bp.fit(one_event, x1, y1, method="snapshot", num_cycles=3, cycle_length=50, seed=0, progress=False)
    assert "one event" in post.config["observation_weights"]["skipped"]


@pytest.mark.parametrize("case", ["bnn snapshot", "function csgmcmc"])
def test_a_bnn_snapshot_and_csgmcmc_are_unchanged_bit_for_bit(case, tiny_bnn_fit, monkeypatch):
    """A ``bp.BNN``'s snapshot fit and csgmcmc on a Pyro function (a sampler: its noise gives its spread) take no
    observation weights: they draw none, record none, and their draws, statistics and traces equal those of the step
    code before the weights (the potential plus the tilt, the curvature of the potential itself), to the bit."""
    spied = []
    monkeypatch.setattr(snapshot, "bootstrap_sites", lambda *a, **k: spied.append(1) or bootstrap_sites(*a, **k))
    if case == "bnn snapshot":
        fit = lambda: tiny_bnn_fit("snapshot", num_cycles=2, cycle_length=40)  # noqa: E731
    else:
        model, x, y, *_ = _regression()
        options = dict(num_cycles=2, num_samples=4, thin=2, exploration=0.5)
        fit = lambda: bp.fit(model, x, y, method="csgmcmc", seed=0, progress=False, **options)  # noqa: E731
    today = fit()
    assert not spied and "observation_weights" not in today.config

    def energy(self, batch, t):
        u = self.pot(self.pot.unflatten(self.z), batch)
        return u if self.tilts is None else u + self.z @ self.tilts(t)

    def curvature(self, z, start, iters):
        return largest_curvature(self.pot, z, self.batch, start, iters, self.metric)

    monkeypatch.setattr(sgmcmc._Chain, "_energy", energy)
    monkeypatch.setattr(sgmcmc._Chain, "curvature", curvature)
    before = fit()
    for group in ("samples", "sample_stats", "history"):
        for name, value in getattr(before, group).items():
            assert torch.equal(getattr(today, group)[name], value), (group, name)


def test_held_out_rows_weight_the_rows_each_run_fits_and_lp_is_the_log_joint(monkeypatch):
    """With rows held out, the fit that chooses each cycle's stop weights its training rows (36 of 60 here), and the
    refit on all rows weights all 60 by the same cycles' seeds; ``config["observation_weights"]`` is the refit's. The
    snapshots' ``lp`` is the log joint itself (neither weighted nor tilted: the cycles' objectives differ)."""
    model, x, y, _ = _linear(n=60)
    shapes = []
    draw = anchor_module.bootstrap_weights

    def spy(sites, **kwargs):
        shapes.append(tuple(sites.shapes["obs"]))
        return draw(sites, **kwargs)

    monkeypatch.setattr(snapshot, "bootstrap_weights", spy)
    post = bp.fit(model, x, y, method="snapshot", num_cycles=2, cycle_length=100, validation=0.4, seed=0,
                  progress=False)  # fmt: skip
    assert post.config["validation"]["final_fit_rows"] == 60 and post.config["validation"]["rows"] == 24
    assert shapes == [(36,), (36,), (60,), (60,)]  # two cycles of the fit that chose, two of the refit
    assert post.config["observation_weights"]["sites"] == {"obs": "[60]"}
    from bnn_pyro.infer._potential import Potential
    from bnn_pyro.infer.training_data import Data

    pot = Potential(model, Data(x, y), init="median")
    lp = torch.stack([-pot({"beta": b}, (x, y)) for b in post.samples["beta"][0]])
    assert torch.allclose(post.sample_stats["lp"][0].double(), lp.double(), rtol=1e-10)


def test_a_weighted_run_with_a_refit_resumes_bit_identically(crash_and_resume):
    """Crashed in the second cycle of the fit that chooses the stops and resumed: the weights are redrawn from the
    cycles' seeds, so the draws, statistics and traces equal an uninterrupted run's to the bit."""
    model, x, y, *_ = _regression()
    config = dict(method="snapshot", num_cycles=2, cycle_length=15, validation=0.4, seed=3, progress=False)
    whole = bp.fit(model, x, y, **config)
    assert "scheme" in whole.config["observation_weights"] and whole.config["validation"]["rows"] > 0
    crash_and_resume(lambda **extra: bp.fit(model, x, y, **extra, **config), whole, crash_at=20, every=5)


def test_a_checkpoint_written_before_the_cycles_were_weighted_is_refused(tmp_path):
    """A checkpoint of a whitened snapshot run whose run record names no ``observation_weights`` (written before the
    cycles weighted the observations: they minimized the unweighted potential) is refused on resume, naming the file
    and what to do; before, resuming it would have continued its cycles under another objective."""
    model, x, y, *_ = _regression()
    options = dict(method="snapshot", num_cycles=2, cycle_length=10, seed=0, progress=False, checkpoint=tmp_path)
    bp.fit(model, x, y, checkpoint_every=5, **options)
    path = tmp_path / "chain0.ckpt"
    tensors, meta = ckpt_module.read(path)
    meta["run"] = {k: v for k, v in meta["run"].items() if k not in ("observation_weights", "bootstrap")}
    ckpt_module.write(path, tensors, meta)
    with pytest.raises(CheckpointError, match="chain0.ckpt") as err:
        bp.fit(model, x, y, checkpoint_every=5, resume=True, **options)
    assert "did not record its cycles' observation weights" in str(err.value)
    assert "another (empty) checkpoint folder" in str(err.value)


@pytest.mark.slow
def test_the_snapshots_whitened_covariance_at_the_defaults_is_the_exact_posteriors():
    """The defaults (5 cycles of 1,000 steps, ``lr="auto"``, anchored, weighted) on the badly conditioned conjugate
    regression, 8 runs (``num_chains``): 40 snapshots, independent (each cycle contracts to its own minimum from the
    last). Whitened by the exact posterior precision ``A = L L^T``, ``u = L^T (b - m)``, the exact posterior is
    ``N(0, I)``. The scheme's own first-order covariance is ``T = L^T S (X^T diag(r^2) X / sigma^4 + I / s^2) S L``
    (``S = A^-1``, residuals ``r`` at the posterior mean): its diagonal differs from 1 by the rows' residual variance
    against ``sigma^2`` (computed from these rows, not tuned), which widens the bounds on its side, as the ensemble's
    test does. A variance from ``M`` independent draws is bounded by the chi-square quantiles of ``M - 1`` degrees of
    freedom at a two-sided 4-sigma tail (6e-5 per coordinate); the mean by 4 of its sds, ``sqrt(T_ii / M)``; each
    correlation by 4 of its sds under independence, ``1 / sqrt(M - 1)``, about ``T``'s. Before (anchors only) the
    whitened variances were the diagonal of ``L^T S S L / s^2``: 2e-4 to 0.011 here."""
    model, x, y, mean, cov = _regression()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        post = bp.fit(model, x, y, method="snapshot", num_chains=8, seed=0, progress=False)
    draws = post.samples["beta"].reshape(-1, 3).double()
    m = draws.shape[0]
    precision = torch.linalg.inv(cov)
    chol = torch.linalg.cholesky(precision)
    u = (draws - mean) @ chol
    design = torch.cat([torch.ones(x.shape[0], 1), x], 1).double()
    r = y.double() - design @ mean
    eye = torch.eye(3, dtype=torch.float64)
    target = chol.T @ cov @ (design.T @ (r[:, None] ** 2 * design) / NOISE**4 + eye / PRIOR_SD**2) @ cov @ chol
    expected = target.diagonal()
    sample = torch.cov(u.T)
    tail = stats.norm.sf(4.0)
    lo = stats.chi2.ppf(tail, m - 1) / (m - 1) * torch.clamp(expected, max=1.0)
    hi = stats.chi2.isf(tail, m - 1) / (m - 1) * torch.clamp(expected, min=1.0)
    assert bool(((lo <= sample.diagonal()) & (sample.diagonal() <= hi)).all()), (sample.diagonal(), lo, hi)
    assert bool((u.mean(0).abs() <= 4 * (expected / m).sqrt()).all()), (u.mean(0), expected)
    corr = sample / torch.outer(sample.diagonal(), sample.diagonal()).sqrt()
    corr_target = target / torch.outer(expected, expected).sqrt()
    assert bool(((corr - corr_target).abs() <= 4 / math.sqrt(m - 1) + 1e-12).all()), (corr, corr_target)
    assert not [w for w in caught if issubclass(w.category, DiagnosticWarning) and "too narrow" in str(w.message)]
