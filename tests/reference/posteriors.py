"""The reference posteriors of ``tests/infer/test_reference_posteriors.py`` as plain Pyro models with their data and
exact summaries (``reference.json``, written by ``generate.py``, which says how each was computed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch

HERE = Path(__file__).resolve().parent
REFERENCE = json.loads((HERE / "reference.json").read_text())


@dataclass
class ReferencePosterior:
    """A model ``model(x, y=None)``, its data, and the exact posterior mean and sd of each flattened parameter."""

    name: str
    model: object
    x: torch.Tensor
    y: torch.Tensor
    names: list
    mean: np.ndarray
    sd: np.ndarray


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


def _make(name, model, x, y) -> ReferencePosterior:
    ref = REFERENCE[name]
    return ReferencePosterior(name, model, x, y, ref["names"], np.array(ref["mean"]), np.array(ref["sd"]))


ALL = {"eight_schools": eight_schools, "kidiq": kidiq, "logistic": logistic}


def flat_draws(post) -> np.ndarray:
    """The posterior's draws of every latent site, flattened in site order: ``(chains, draws, P)``."""
    parts = [v.reshape(v.shape[0], v.shape[1], -1) for v in post.samples.values()]
    return torch.cat(parts, -1).double().cpu().numpy()
