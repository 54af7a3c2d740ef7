"""The reference posteriors of ``tests/infer/test_reference_posteriors.py`` and ``test_reference_engines.py`` with
their data and exact summaries (``reference.json``, written by ``generate.py``, which says how each was computed):
:data:`ALL` as plain Pyro models (for the engines that fit a Pyro function), :data:`BNN_REFERENCES` as ``bp.BNN``
models (for every engine, the point-fit ones included)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from scipy import stats

import bnn_pyro as bp

HERE = Path(__file__).resolve().parent
REFERENCE = json.loads((HERE / "reference.json").read_text())


@dataclass
class ReferencePosterior:
    """A model (``model(x, y=None)`` or a ``bp.BNN``), its data, and the exact posterior mean and sd of each flattened
    parameter. ``columns``: for a BNN, the ``(site, flat index)`` of each reference parameter in ``post.samples``
    (``None``: every latent site flattened in site order)."""

    name: str
    model: object
    x: torch.Tensor
    y: torch.Tensor
    names: list
    mean: np.ndarray
    sd: np.ndarray
    columns: list | None = None


def _table(name: str) -> torch.Tensor:
    return torch.tensor(np.loadtxt(HERE / f"{name}.csv", delimiter=",", skiprows=1), dtype=torch.float32)


def eight_schools() -> ReferencePosterior:
    """Non-centered eight schools (Rubin 1981; posteriordb's eight_schools_noncentered)."""
    ref = REFERENCE["eight_schools"]
    sigma = torch.tensor(ref["data"]["sigma"])

    def model(x, y=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0).expand([8]).to_event(1))
        with pyro.plate("data", size=8):
            return pyro.sample("obs", dist.Normal(mu + tau * theta_tilde, sigma), obs=y)

    return _make("eight_schools", model, torch.zeros(8, 1), torch.tensor(ref["data"]["y"]))


def kidiq() -> ReferencePosterior:
    """Linear regression on badly scaled covariates (an indicator and an IQ-like score near 100)."""
    t = _table("kidiq")

    def model(x, y=None):
        beta = pyro.sample("beta", dist.Normal(0.0, 100.0).expand([3]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfCauchy(25.0))
        with pyro.plate("data", size=len(x)):
            f = pyro.deterministic("f", beta[0] + beta[1] * x[:, 0] + beta[2] * x[:, 1])
            return pyro.sample("obs", dist.Normal(f, sigma), obs=y)

    return _make("kidiq", model, t[:, :2], t[:, 2])


def logistic() -> ReferencePosterior:
    """Logistic regression with an intercept, a standardized covariate and an age-like one near 40."""
    t = _table("logistic")

    def model(x, y=None):
        beta = pyro.sample("beta", dist.Normal(0.0, torch.tensor([10.0, 2.5, 2.5])).to_event(1))
        with pyro.plate("data", size=len(x)):
            f = pyro.deterministic("f", beta[0] + x @ beta[1:])
            return pyro.sample("obs", dist.Bernoulli(logits=f), obs=y)

    return _make("logistic", model, t[:, :2], t[:, 2])


def linear_bnn() -> ReferencePosterior:
    """Bayesian linear regression as a BNN: ``nn.Linear(2, 1)``, Normal(0, 1) on every parameter, Gaussian noise
    fixed at 0.5 (conjugate: the exact posterior in closed form)."""
    t = _table("linear")
    data = REFERENCE["linear"]["data"]
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Linear(2, 1),
        prior=bp.priors.Normal(0.0, data["prior_scale"]),
        likelihood=bp.likelihoods.Gaussian(scale=data["noise"]),
    )
    return _make("linear", model, t[:, :2], t[:, 2], columns=[("weight", 0), ("weight", 1), ("bias", 0)])


def logistic_bnn() -> ReferencePosterior:
    """:func:`logistic` as a BNN: ``nn.Linear(2, 1)`` with the same priors (bias N(0, 10), weights N(0, 2.5)) and a
    Bernoulli likelihood on its logit: the same posterior, so the same reference (intercept, then the slopes)."""
    t = _table("logistic")
    torch.manual_seed(0)
    model = bp.BNN(
        torch.nn.Linear(2, 1),
        prior={"bias": dist.Normal(0.0, 10.0), "weight": dist.Normal(0.0, 2.5)},
        likelihood=bp.likelihoods.Bernoulli(),
    )
    return _make("logistic", model, t[:, :2], t[:, 2], columns=[("bias", 0), ("weight", 0), ("weight", 1)])


def _make(name, model, x, y, columns=None) -> ReferencePosterior:
    ref = REFERENCE[name]
    mean, sd = np.array(ref["mean"]), np.array(ref["sd"])
    return ReferencePosterior(name, model, x, y, ref["names"], mean, sd, columns)


ALL = {"eight_schools": eight_schools, "kidiq": kidiq, "logistic": logistic}
BNN_REFERENCES = {"linear": linear_bnn, "logistic": logistic_bnn}


def flat_draws(post, ref: ReferencePosterior | None = None) -> np.ndarray:
    """The posterior's draws, ``(chains, draws, P)``: the reference's ``columns`` when it names them, else every
    latent site flattened in site order."""
    if ref is not None and ref.columns is not None:
        flat = {k: v.reshape(v.shape[0], v.shape[1], -1) for k, v in post.samples.items()}
        return torch.stack([flat[site][..., i] for site, i in ref.columns], -1).double().cpu().numpy()
    parts = [v.reshape(v.shape[0], v.shape[1], -1) for v in post.samples.values()]
    return torch.cat(parts, -1).double().cpu().numpy()


def judge(ref: ReferencePosterior, post) -> dict:
    """The draws' errors against the exact summaries: ``z`` (mean error in posterior sds), ``ratio`` (sd / exact sd)
    and, in Monte Carlo standard errors (ArviZ: the mean's from its ESS, the sd's MCSE), ``z_mcse_mean`` and
    ``z_mcse_sd`` (NaN with fewer than 4 draws per chain, where ArviZ cannot estimate them)."""
    import arviz as az

    d = flat_draws(post, ref)
    mean, sd = d.mean((0, 1)), d.reshape(-1, d.shape[-1]).std(0)
    z_mean = np.full(len(ref.names), np.nan)
    z_sd = np.full(len(ref.names), np.nan)
    if d.shape[1] >= 4:
        for i in range(d.shape[-1]):
            ess = az.ess(d[..., i], method="mean")
            z_mean[i] = (mean[i] - ref.mean[i]) / (ref.sd[i] / np.sqrt(ess))
            z_sd[i] = (sd[i] - ref.sd[i]) / az.mcse(d[..., i], method="sd")
    return dict(z=(mean - ref.mean) / ref.sd, ratio=sd / ref.sd, z_mcse_mean=z_mean, z_mcse_sd=z_sd, draws=d)


Z_MAX = 4.0
"""Monte Carlo standard errors allowed: a two-sided 6e-5 tail per comparison."""
APPROX_MEAN = 0.25
"""The bias an approximation or SG-MCMC may have in a mean, in posterior sds."""
APPROX_SD = 1.5
"""The factor an approximation's or SG-MCMC's sd may be off by, either way."""


def num_effective(d: np.ndarray) -> np.ndarray:
    """Per parameter, ArviZ's ESS of the mean (at least 4 draws per chain), else the number of draws (independent
    members or snapshots)."""
    import arviz as az

    if d.shape[1] >= 4:
        return np.array([az.ess(d[..., i], method="mean") for i in range(d.shape[-1])])
    return np.full(d.shape[-1], float(d.shape[0] * d.shape[1]))


def biased_off(ref: ReferencePosterior, post) -> list:
    """The rule for approximations and SG-MCMC: the parameters outside the bias bounds widened by the Monte Carlo
    error of the draws, ``(name, z, sd ratio)``. A mean must lie within ``APPROX_MEAN + Z_MAX / sqrt(ess)`` sd, an
    sd ratio within ``[1 / APPROX_SD, APPROX_SD]`` times the chi-square quantiles of ``ess - 1`` degrees of freedom
    at the ``Z_MAX`` tail, and above zero (one point never matches)."""
    j = judge(ref, post)
    n = np.maximum(num_effective(j["draws"]), 2.0)
    tail = stats.norm.sf(Z_MAX)
    lo = np.sqrt(stats.chi2.ppf(tail, n - 1) / (n - 1)) / APPROX_SD
    hi = np.sqrt(stats.chi2.isf(tail, n - 1) / (n - 1)) * APPROX_SD
    return [
        (name, round(float(z), 2), round(float(r), 2))
        for name, z, r, k, a, b in zip(ref.names, j["z"], j["ratio"], n, lo, hi)
        if not (abs(z) <= APPROX_MEAN + Z_MAX / np.sqrt(k) and r > 0 and a <= r <= b)
    ]


def exact_off(ref: ReferencePosterior, post) -> list:
    """The rule for MCMC (unbiased): the parameters whose mean or sd is ``Z_MAX`` or more Monte Carlo standard
    errors from the exact one, ``(name, z of the mean, z of the sd)`` in MCSEs."""
    j = judge(ref, post)
    return [
        (name, round(float(a), 1), round(float(b), 1))
        for name, a, b in zip(ref.names, j["z_mcse_mean"], j["z_mcse_sd"])
        if not (abs(a) < Z_MAX and abs(b) < Z_MAX)
    ]
