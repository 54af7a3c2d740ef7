"""The bad-input matrix (issue 7, item 4): one table of bad data, configuration, models, runtime
failures, prediction inputs and files. Each case must end in our own clear error or warning, whose
message names what is wrong and suggests what to try; errors must be raised by bnn_pyro's own
validation (the innermost frame of the traceback lies in the package), never deep inside
torch or Pyro, and never as a silently wrong answer."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.io import PosteriorFileError

PACKAGE = Path(bp.__file__).parent
# Every message suggests something: one of these phrasings (case-insensitive) must appear.
ADVICE = (
    r"(?i)(try|use |pass |choose|drop|re-encode|reshape|give |return |move |add |build |check |save |"
    r"upgrade|increase|decrease|lower|raise|widen|make |impute|standardiz)"
)


def _model(out: int = 1, likelihood=None, prior=None, features: int = 1) -> bp.BNN:
    return bp.BNN(
        nn.Linear(features, out),
        prior=prior or bp.priors.Normal(0.0, 1.0),
        likelihood=likelihood or bp.likelihoods.Gaussian(scale=0.1),
    )


X, Y = torch.linspace(-1, 1, 8).reshape(8, 1), torch.linspace(-1, 1, 8)
LABELS = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
IMPROPER = dist.ImproperUniform(dist.constraints.real, (), ())


def _fit(*, model=None, x=X, y=Y, **config):
    config = {"method": "svi", "num_steps": 2, "num_samples": 2, "progress": False, **config}
    return bp.fit(model if model is not None else _model(), x, y, **config)


def _mcmc(method="nuts", **config):
    return bp.fit(_model(), X, Y, method=method, **{"num_samples": 2, "num_warmup": 2, "progress": False, **config})


def _tanh_model() -> bp.BNN:
    """Saturating hidden units: the first ELBO is finite even for huge inputs."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def _nan_elbo_model(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(w * x[:, 0] * 1e39, 1.0), obs=y)  # float32 overflow: an infinite ELBO


def _improper_model(x, y=None):
    w = pyro.sample("w", IMPROPER)
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(w * x[:, 0], 1.0), obs=y)


def _walled(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    pyro.factor("wall", torch.where(w.abs() < 0.5, 0.0, -float("inf")))  # a cliff: trajectories crossing it diverge
    with pyro.plate("data", x.shape[0]):
        pyro.sample("obs", dist.Normal(w * x[:, 0], 10.0), obs=y)


def _nuts_diverging():
    return bp.fit(
        _walled,
        X,
        Y,
        method="nuts",
        num_chains=1,
        num_samples=10,
        num_warmup=5,
        init={"w": torch.tensor(0.0)},
        jit=False,
        progress=False,
        seed=0,
    )  # 8 of 10 draws diverge (measured)


def _posterior():
    return _fit(num_samples=3)


def _mlp(*widths: int) -> bp.BNN:
    """A tanh MLP 1 -> widths... -> 1 (module paths "0", "2", "4", ...)."""
    sizes, layers = (1, *widths, 1), []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return bp.BNN(
        nn.Sequential(*layers[:-1]), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)
    )


def _init_from(source: bp.BNN, target: bp.BNN, method: str = "nuts"):
    """Start a fit of ``target`` from a posterior of ``source`` (another net)."""
    post = _fit(model=source, num_samples=2)
    return bp.fit(
        target,
        X,
        Y,
        method=method,
        init=post,
        num_samples=2,
        progress=False,
        **({"num_warmup": 2} if method == "nuts" else {"num_steps": 2}),
    )


def _corrupted_file(tmp: Path) -> Path:
    path = tmp / "post.bnn"
    _posterior().save(path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # flip bits in the tensor payload
    path.write_bytes(bytes(raw))
    return path


def _foreign_file(tmp: Path) -> Path:
    path = tmp / "weights.pt"
    torch.save({"w": torch.ones(2)}, path)  # a pickle: must be refused, not executed
    return path


def _empty_file(tmp: Path) -> Path:
    path = tmp / "empty.bnn"
    path.write_bytes(b"")
    return path


class _TorchOnly(torch.distributions.Distribution):
    """A torch distribution that pyro.distributions has no class of the same name for."""

    arg_constraints: dict = {}
    support = torch.distributions.constraints.real

    def __init__(self):
        super().__init__(validate_args=False)


def _categorical(out: int = 3) -> bp.BNN:
    return _model(out=out, likelihood=bp.likelihoods.Categorical())


def _metropolis_all_rejected():
    return bp.fit(
        _model(),
        X,
        Y,
        method="metropolis",
        num_chains=1,
        num_samples=20,
        num_warmup=1,
        step_size=1e4,
        jit=False,
        progress=False,
        seed=0,
    )


@dataclass(frozen=True)
class Case:
    id: str
    trigger: Callable  # called with a tmp_path
    expected: type[BaseException] | type[Warning]
    match: str  # names the argument / what is wrong, then (anywhere) what to try


CASES = [
    # ------------------------------------------------------------------ data
    Case(
        "x-nan",
        lambda t: _fit(x=X.clone().index_fill_(0, torch.tensor([2]), float("nan"))),
        ValueError,
        r"x contains NaN values in 1 row.*impute",
    ),
    Case(
        "y-inf",
        lambda t: _fit(y=Y.clone().index_fill_(0, torch.tensor([0]), float("inf"))),
        ValueError,
        r"y contains Inf values.*drop or impute",
    ),
    Case(
        "x-empty", lambda t: _fit(x=torch.empty(0, 1), y=torch.empty(0)), ValueError, r"x is empty.*pass at least one"
    ),
    Case(
        "x-1d",
        lambda t: _fit(model=_model(features=3), x=torch.ones(8)),
        ValueError,
        r"x has shape \(8,\).*1-D.*reshape",
    ),
    Case(
        "x-wrong-features",
        lambda t: _fit(model=_model(features=3), x=torch.ones(8, 2)),
        ValueError,
        r"x has shape \(8, 2\).*net cannot take.*Check that the feature",
    ),
    Case(
        "xy-length-mismatch",
        lambda t: _fit(y=Y[:5]),
        ValueError,
        r"x and y have different numbers of rows.*x has 8, y has 5.*check",
    ),
    Case("x-strings", lambda t: _fit(x=np.array([["a"]] * 8)), TypeError, r"x: could not convert.*pass numbers"),
    Case("x-object-dtype", lambda t: _fit(x=[[1.0], [None]] * 4), TypeError, r"x: could not convert.*pass numbers"),
    Case("y-shape", lambda t: _fit(y=torch.ones(8, 3)), ValueError, r"Gaussian: y has shape \(8, 3\).*Reshape y"),
    Case(
        "labels-out-of-range",
        lambda t: _fit(model=_model(out=2, likelihood=bp.likelihoods.Categorical()), y=LABELS),
        ValueError,
        r"labels must lie in 0\.\.1.*found labels in 0\.\.2.*Re-encode",
    ),
    Case(
        "labels-negative",
        lambda t: _fit(model=_model(out=3, likelihood=bp.likelihoods.Categorical()), y=LABELS - 1),
        ValueError,
        r"labels must lie in 0\.\.2.*Re-encode",
    ),
    Case(
        "labels-non-integer",
        lambda t: _fit(model=_model(out=3, likelihood=bp.likelihoods.Categorical()), y=LABELS + 0.5),
        TypeError,
        r"y must hold integer class labels.*pass y\.long\(\)",
    ),
    Case(
        "bernoulli-labels",
        lambda t: _fit(model=_model(likelihood=bp.likelihoods.Bernoulli()), y=LABELS),
        ValueError,
        r"Bernoulli: y must be a vector of 0/1 labels.*Use Categorical",
    ),
    Case("x-other-device", lambda t: _fit(x=X.to("meta")), ValueError, r"x is on device meta.*model.*cpu.*move"),
    Case("y-other-device", lambda t: _fit(y=Y.to("meta")), ValueError, r"y is on device meta.*cpu.*move"),
    Case(
        "loader-with-y",
        lambda t: _fit(x=torch.utils.data.DataLoader(list(zip(X, Y)), batch_size=4)),
        ValueError,
        r"y: pass y=None when x is a DataLoader",
    ),
    Case(
        "y-missing-regression",
        lambda t: bp.fit(_model(), X),
        ValueError,
        r"y: svi fits the model to targets, but y is None; pass them.*bp\.fit\(model, x, y",
    ),
    Case(
        "y-missing-classification-nuts",
        lambda t: bp.fit(_categorical(), X, method="nuts", num_chains=1),
        ValueError,
        r"y: nuts fits the model to targets, but y is None.*DataLoader of \(x, y\) batches",
    ),
    Case(
        "loader-batches-without-y",
        lambda t: _fit(x=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4), y=None),
        ValueError,
        r"x: each batch must be an \(x, y\) pair, got a list of 1.*TensorDataset\(x, y\)",
    ),
    Case(
        "loader-yields-y-none",
        lambda t: _fit(x=((X[i : i + 4], None) for i in (0, 4)), y=None, dataset_size=8),
        ValueError,
        r"x: a batch of the loader holds no targets.*make every batch an \(x, y\) pair",
    ),
    Case("x-scalar", lambda t: _fit(x=3.0), ValueError, r"x is a single number \(shape \(\)\).*pass rows shaped"),
    Case(
        "x-sparse",
        lambda t: _fit(x=X.to_sparse()),
        TypeError,
        r"x is a sparse tensor \(torch.sparse_coo\).*x\.to_dense\(\)",
    ),
    Case("x-complex", lambda t: _fit(x=X.to(torch.complex64)), TypeError, r"x has complex dtype.*pass real numbers"),
    Case(
        "y-strings",
        lambda t: _fit(y=np.array(["a"] * 8)),
        TypeError,
        r"y: could not convert ndarray of dtype <U1 to a tensor; pass numbers",
    ),
    Case(
        "labels-one-hot",
        lambda t: _fit(model=_categorical(), y=torch.nn.functional.one_hot(LABELS, 3)),
        ValueError,
        r"Categorical: y must be a vector of labels shaped \(N,\), got shape \(8, 3\).*pass y\.argmax\(1\)",
    ),
    # ------------------------------------------------------------------ configuration
    Case("unknown-method", lambda t: _fit(method="sgd"), ValueError, r"method: unknown value 'sgd'; choose one of"),
    Case("unknown-guide", lambda t: _fit(guide="flow"), ValueError, r"guide: unknown value 'flow'; choose one of"),
    Case("unknown-elbo", lambda t: _fit(elbo="renyi"), ValueError, r"elbo: unknown value 'renyi'; choose one of"),
    Case(
        "unknown-optimizer", lambda t: _fit(optimizer="lbfgs2"), ValueError, r"optimizer: unknown value.*choose one of"
    ),
    Case(
        "unknown-kernel-option",
        lambda t: _mcmc(num_leapfrog=3),
        TypeError,
        r"num_leapfrog: not an option of method='nuts'; drop it.*use a method that takes it \(hmc\)",
    ),
    Case(
        "leapfrog-jitter-out-of-range",
        lambda t: _mcmc(method="hmc", leapfrog_jitter=1.5),
        ValueError,
        r"leapfrog_jitter must be a fraction in \[0, 1\), got 1.5; try 0.5 \(the default\), or 0 for a fixed",
    ),
    Case(
        "leapfrog-jitter-for-nuts",
        lambda t: _mcmc(leapfrog_jitter=0.5),
        TypeError,
        r"leapfrog_jitter: not an option of method='nuts'; drop it.*\(hmc\)",
    ),
    Case("num-steps-zero", lambda t: _fit(num_steps=0), ValueError, r"num_steps must be a positive int, got 0.*pass"),
    Case(
        "num-steps-float", lambda t: _fit(num_steps=2.5), TypeError, r"num_steps must be an int, got float 2\.5.*pass"
    ),
    Case("draws-zero", lambda t: _mcmc(num_samples=0), ValueError, r"num_samples must be a positive int.*pass"),
    Case(
        "chains-negative", lambda t: _mcmc("hmc", num_chains=-1), ValueError, r"num_chains must be a positive int.*pass"
    ),
    Case("batch-size-zero", lambda t: _fit(batch_size=0), ValueError, r"batch_size must be a positive int.*pass"),
    Case("lr-negative", lambda t: _fit(lr=-0.1), ValueError, r"lr must be a positive finite number, got -0\.1.*pass"),
    Case("lr-nan", lambda t: _fit(lr=float("nan")), ValueError, r"lr must be a positive finite number, got nan.*pass"),
    Case("lr-string", lambda t: _fit(lr="fast"), ValueError, r"lr: unknown value 'fast'; pass a positive number"),
    Case(
        "fast-path-string-svi",
        lambda t: _fit(fast_path="no"),
        TypeError,
        r"fast_path must be True or False, got str 'no'.*pass fast_path=True or fast_path=False",
    ),
    Case(
        "fast-path-int-mcmc",
        lambda t: _mcmc(fast_path=0),
        TypeError,
        r"fast_path must be True or False, got int 0.*pass fast_path=True or fast_path=False",
    ),
    Case(
        "jit-string-mcmc",
        lambda t: _mcmc(jit="no"),
        TypeError,
        r"jit must be True or False, got str 'no'.*pass jit=True or jit=False",
    ),
    Case(
        "dense-mass-int-mcmc",
        lambda t: _mcmc(dense_mass=1),
        TypeError,
        r"dense_mass must be True or False, got int 1.*pass dense_mass=True or dense_mass=False",
    ),
    Case(
        "target-accept",
        lambda t: _mcmc(target_accept=1.5),
        ValueError,
        r"target_accept must be a probability in \(0, 1\).*try 0\.8",
    ),
    Case(
        "prior-not-distribution",
        lambda t: _model(prior=lambda name, module, param: 1.0),
        TypeError,
        r"prior for '(weight|bias)' returned float.*return .*dist\.Normal",
    ),
    Case(
        "prior-wrong-shape",
        lambda t: _model(prior=lambda n, m, p: dist.Normal(torch.zeros(3), 1.0)),
        ValueError,
        r"prior for 'weight'.*batch_shape \(3,\).*does not fit.*Return a scalar distribution",
    ),
    Case(
        "improper-prior-bnn",
        lambda t: _model(prior=lambda n, m, p: IMPROPER),
        ValueError,
        r"prior for 'weight' is improper \(ImproperUniform\).*Use a proper, wide prior",
    ),
    Case(
        "improper-prior-function",
        lambda t: bp.fit(_improper_model, X, Y, method="nuts", num_chains=1, num_samples=2, progress=False),
        ValueError,
        r"model: a prior cannot be sampled.*improper priors are not supported.*Use a proper",
    ),
    Case(
        "option-of-another-engine",
        lambda t: _mcmc(num_steps=10),
        TypeError,
        r"num_steps: not an option of method='nuts'; drop it.*help\(bnn_pyro\.infer\.mcmc\.fit_nuts\)",
    ),
    Case(
        "unknown-option", lambda t: _fit(learning_rate=0.1), TypeError, r"learning_rate: not an option of method='svi'"
    ),
    Case(
        "likelihood-not-likelihood",
        lambda t: bp.BNN(nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood="gaussian"),
        TypeError,
        r"likelihood: expected a bnn_pyro\.likelihoods\.Likelihood.*Try",
    ),
    Case(
        "bayesian-unknown",
        lambda t: bp.BNN(
            nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1), bayesian="some"
        ),
        ValueError,
        r"bayesian: unknown value 'some'; choose one of",
    ),
    Case("seed-string", lambda t: _fit(seed="0"), TypeError, r"seed must be an int, got str '0'.*pass a whole number"),
    Case("seed-float", lambda t: _mcmc(seed=1.5), TypeError, r"seed must be an int, got float 1\.5.*pass"),
    Case(
        "seed-2**63",
        lambda t: _fit(seed=2**63),
        ValueError,
        r"seed must be at most 2\*\*31 - 1 = 2147483647, got 9223372036854775808.*32-bit seeds.*Pass a smaller seed",
    ),
    Case("seed-2**70-mcmc", lambda t: _mcmc(seed=2**70), ValueError, r"seed must be at most 2\*\*31 - 1"),
    Case("seed-dataset", lambda t: bp.datasets.spirals(seed=2**63), ValueError, r"seed must be at most 2\*\*31 - 1"),
    Case(
        "seed-split",
        lambda t: bp.splits.make_uci_splits(X, Y, 2, seed=2**64),
        ValueError,
        r"seed must be at most 2\*\*31 - 1",
    ),
    Case(
        "progress-string",
        lambda t: _fit(progress="no"),
        TypeError,
        r"progress must be True or False, got str 'no'.*pass progress=True",
    ),
    Case(  # was read as True by the engine's driver and as False by the checkpoint folder's guard
        "resume-string",
        lambda t: _fit(checkpoint=str(t), resume="yes"),
        ValueError,
        r"resume: expected True or False .*or a Posterior of nuts or hmc to extend, got str 'yes'; pass resume=True",
    ),
    Case(
        "prior-pattern-matches-nothing",
        lambda t: _model(prior={"layer0.*": dist.Normal(0.0, 1.0)}),
        ValueError,
        r"prior: the pattern 'layer0\.\*' matches no parameter of the net; its parameters are \['weight', 'bias'\]"
        r".*Check the pattern",
    ),
    Case(
        "prior-pattern-shadowed",
        lambda t: _model(prior={"*": dist.Normal(0.0, 1.0), "bias": dist.Laplace(0.0, 1.0)}),
        ValueError,
        r"the pattern 'bias' is never used.*matched first by \['\*'\].*Move the more specific pattern",
    ),
    Case(
        "prior-none-everywhere",
        lambda t: _model(prior=lambda name, module, param: None),
        ValueError,
        r"prior: gives no parameter a distribution.*\['weight', 'bias'\].*no random weights.*return a distribution",
    ),
    Case(
        "prior-dict-all-none",
        lambda t: _model(prior={"*": None}),
        ValueError,
        r"prior: gives no parameter a distribution.*return a distribution",
    ),
    Case(
        "bayesian-selects-nothing",
        lambda t: bp.BNN(
            nn.Linear(1, 1),
            prior=bp.priors.Normal(),
            likelihood=bp.likelihoods.Gaussian(scale=0.1),
            bayesian=lambda name, module, param: False,
        ),
        ValueError,
        r"bayesian: selects none of the net's parameters \['weight', 'bias'\].*choose some",
    ),
    Case(
        "bayesian-pattern-matches-nothing",
        lambda t: bp.BNN(
            nn.Linear(1, 1),
            prior=bp.priors.Normal(),
            likelihood=bp.likelihoods.Gaussian(scale=0.1),
            bayesian=["weight", "0.*"],
        ),
        ValueError,
        r"bayesian: the pattern '0\.\*' matches no parameter.*\['weight', 'bias'\].*Check the pattern",
    ),
    Case(
        "bayesian-pattern-as-string",
        lambda t: bp.BNN(
            nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1), bayesian="0.*"
        ),
        ValueError,
        r"bayesian: unknown value '0\.\*'.*pass a list, e\.g\. bayesian=\['0\.\*'\]",
    ),
    Case(
        "bayesian-bool",
        lambda t: bp.BNN(
            nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1), bayesian=True
        ),
        TypeError,
        r"bayesian: expected \"all\".*got bool True; pass e\.g\.",
    ),
    Case(
        "prior-class-not-instance",
        lambda t: _model(prior=bp.priors.Normal),
        TypeError,
        r"prior: got the class bnn_pyro\.priors\.Normal, not an instance of it; pass an instance",
    ),
    Case(
        "likelihood-class-not-instance",
        lambda t: bp.BNN(nn.Linear(1, 1), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Categorical),
        TypeError,
        r"likelihood: got the class bnn_pyro\.likelihoods\.Categorical.*pass an instance",
    ),
    Case(
        "prior-dict-value-string",
        lambda t: _model(prior={"*": "normal"}),
        TypeError,
        r"prior\['\*'\]: expected a Distribution, a prior or None, got str 'normal'; use e\.g\. dist\.Normal",
    ),
    Case(
        "prior-torch-without-pyro-class",
        lambda t: _model(prior=lambda n, m, p: _TorchOnly()),
        TypeError,
        r"prior for 'weight': .*_TorchOnly is a torch distribution without a Pyro counterpart; use one from "
        r"pyro\.distributions",
    ),
    Case(
        "prior-loc-string",
        lambda t: bp.priors.Normal("zero", 1.0),
        TypeError,
        r"loc must be a number, got str 'zero'; pass a float",
    ),
    Case(
        "noise-prior-negative-support",
        lambda t: bp.likelihoods.Gaussian(scale=dist.Normal(0.0, 1.0)),
        ValueError,
        r"scale: Normal has support Real\(\), but a scale or precision must be positive.*use a distribution",
    ),
    Case(
        "noise-precision-number",
        lambda t: bp.likelihoods.Gaussian(precision=100.0),
        TypeError,
        r"precision: expected a distribution over the precision.*got the number 100\.0.*pass scale=1 / sqrt"
        r"\(precision\), e\.g\. scale=0\.1",
    ),
    Case(
        "hyperprior-number",
        lambda t: bp.priors.HierarchicalNormal(1.0),
        TypeError,
        r"hyperprior: expected a pyro\.distributions distribution, got float 1\.0; pass e\.g\. dist\.HalfNormal",
    ),
    Case(
        "hyperprior-negative-support",
        lambda t: bp.priors.HierarchicalNormal(dist.Normal(0.0, 1.0)),
        ValueError,
        r"hyperprior: Normal has support Real\(\).*must be positive",
    ),
    Case("num-threads-zero", lambda t: _fit(num_threads=0), ValueError, r"num_threads must be a positive int.*pass"),
    # init= (issue 16): checked at fit start against the model's sites and shapes
    Case(
        "init-posterior-other-width",
        lambda t: _init_from(_mlp(20), _mlp(50)),
        ValueError,
        r"init: the Posterior's site '0\.weight' has shape \(20, 1\) \(per draw\), but this model's '0\.weight' "
        r"has shape \(50, 1\).*same net architecture.*init='net'",
    ),
    Case(
        "init-posterior-other-architecture",
        lambda t: _init_from(_mlp(4, 4), _mlp(4), method="svi"),
        ValueError,
        r"init: the Posterior's sites \['4\.weight', '4\.bias'\] are not sites or parameters of this model.*"
        r"same net architecture",
    ),
    Case(
        "init-dict-unknown-site",
        lambda t: _fit(init={"w": torch.zeros(1, 1)}),
        ValueError,
        r"init: the dict's sites \['w'\] are not sites or parameters of this model \(its sites: \['weight', 'bias'",
    ),
    Case(
        "init-dict-wrong-shape",
        lambda t: _mcmc(method="hmc", num_chains=1, init={"weight": torch.zeros(3)}),
        ValueError,
        r"init: the dict's site 'weight' has shape \(3,\).*this model's 'weight' has shape \(1, 1\)",
    ),
    Case(
        "init-wrong-type",
        lambda t: _fit(init=5),
        TypeError,
        r"init: expected 'reset', 'net', 'prior', 'median' \('laplace' too under svi\), a dict of site values or a bp\.Posterior, got int.*pass",
    ),
    Case(
        "init-reset-pyro-function",
        lambda t: bp.fit(_walled, X, Y, method="sgld", init="reset", progress=False),
        ValueError,
        r"init='reset' re-runs the layers' initializers of a bp\.BNN's net; this model is a Pyro "
        r"function\. Use init='prior'",
    ),
    # ------------------------------------------------------------------ model
    Case(
        "net-without-parameters",
        lambda t: bp.BNN(nn.Tanh(), prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1)),
        ValueError,
        r"net has no parameters.*give a net with",
    ),
    Case(
        "net-not-module",
        lambda t: bp.BNN(lambda x: x, prior=bp.priors.Normal(), likelihood=bp.likelihoods.Gaussian(scale=0.1)),
        TypeError,
        r"net: expected a torch\.nn\.Module, got function.*pass",
    ),
    Case(
        "model-not-callable", lambda t: bp.fit(42, X, Y), TypeError, r"model: expected a bnn_pyro\.BNN.*got int.*pass"
    ),
    Case(
        "model-plain-torch-module",
        lambda t: bp.fit(nn.Linear(1, 1), X, Y),
        TypeError,
        r"model: got the plain torch module Linear, which has no prior or likelihood; make it a Bayesian model first: "
        r"model = bp\.BNN\(net, prior=",
    ),
    Case(
        "output-3d",
        lambda t: _fit(
            model=bp.BNN(
                nn.Sequential(nn.Linear(1, 2), nn.Unflatten(1, (1, 2))),
                prior=bp.priors.Normal(),
                likelihood=bp.likelihoods.Gaussian(scale=0.1),
            )
        ),
        ValueError,
        r"net must map \(N, \.\.\.\) inputs to \(N, out\) outputs.*Add a final Flatten",
    ),
    Case(
        "output-odd-heteroscedastic",
        lambda t: _fit(model=_model(out=3, likelihood=bp.likelihoods.HeteroscedasticGaussian())),
        ValueError,
        r"HeteroscedasticGaussian needs a net with 2 \* D outputs.*Make the last layer",
    ),
    Case(
        "output-bernoulli-two",
        lambda t: _fit(model=_model(out=2, likelihood=bp.likelihoods.Bernoulli()), y=LABELS.clamp(max=1)),
        ValueError,
        r"Bernoulli needs a net with 1 output.*Use Categorical",
    ),
    # ------------------------------------------------------------------ runtime
    Case(
        "svi-diverges-mid-run",
        lambda t: _fit(model=_tanh_model(), x=X * 1e30, lr=1e10, num_steps=30),
        FloatingPointError,
        r"svi: the (optimization diverged|ELBO became (nan|inf|-inf)) at step [1-9].*lower learning rate",
    ),
    Case(
        "elbo-nan",
        lambda t: bp.fit(_nan_elbo_model, X, Y, method="svi", num_steps=3, num_samples=2, progress=False),
        FloatingPointError,
        r"svi: the ELBO became (nan|inf|-inf) at step 0.*Try a lower learning rate",
    ),
    Case(
        "metropolis-all-rejected",
        lambda t: _metropolis_all_rejected(),
        UserWarning,
        r"metropolis: chain 0 accepted 0\.0% of its 19 proposals.*Try more num_warmup",
    ),
    Case(
        "nuts-divergences",
        lambda t: _nuts_diverging(),
        UserWarning,
        r"nuts: [0-9.]+% of the draws diverged.*Try a higher target_accept.*reparameterized",
    ),
    # ------------------------------------------------------------------ predict
    Case(
        "predict-wrong-features",
        lambda t: _posterior().predict(torch.ones(4, 3)),
        ValueError,
        r"x has shape \(4, 3\), which the net cannot take.*Check that the feature",
    ),
    Case(
        "predict-1d",
        lambda t: _posterior().predict(torch.ones(4)),
        ValueError,
        r"x has shape \(4,\), which the net cannot take \(its first layer, Linear, takes inputs shaped \(N, 1\)\).*"
        r"1-D.*x\.reshape\(-1, 1\)",
    ),
    Case("predict-scalar", lambda t: _posterior().predict(0.5), ValueError, r"x is a single number.*pass rows"),
    Case(
        "predict-before-fit",
        lambda t: _model().predict(X),
        AttributeError,
        r"model\.predict: this BNN is not fitted.*post = bp\.fit\(model, x, y, method=.*then post\.predict\(x\)",
    ),
    Case(
        "summary-before-fit",
        lambda t: _model().summary(),
        AttributeError,
        r"model\.summary: this BNN is not fitted.*then post\.summary\(\)",
    ),
    Case(
        "inference-data-before-fit",
        lambda t: _model().to_inference_data(),
        AttributeError,
        r"model\.to_inference_data: this BNN is not fitted.*post = bp\.fit",
    ),
    Case(
        "predict-nan",
        lambda t: _posterior().predict(torch.full((4, 1), float("nan"))),
        ValueError,
        r"x contains NaN.*impute",
    ),
    Case(
        "predict-interval",
        lambda t: _posterior().predict(X, interval=95),
        ValueError,
        r"interval must lie in \(0, 1\), got 95.*try 0\.95",
    ),
    Case(
        "predict-num-samples",
        lambda t: _posterior().predict(X, num_samples=0),
        ValueError,
        r"num_samples must be a positive int.*pass",
    ),
    Case(
        "inference-data-y-without-x",
        lambda t: _posterior().to_inference_data(y=Y),
        ValueError,
        r"y: given without x.*pass both",
    ),
    # ------------------------------------------------------------------ save / load
    Case(
        "load-corrupted",
        lambda t: bp.load(_corrupted_file(t)),
        PosteriorFileError,
        r"(checksum mismatch|unreadable).*corrupted.*Save the posterior again",
    ),
    Case(
        "load-foreign-pickle",
        lambda t: bp.load(_foreign_file(t)),
        PosteriorFileError,
        r"(not a bnn_pyro posterior|truncated).*(pickles|Save)",
    ),
    Case(
        "load-empty",
        lambda t: bp.load(_empty_file(t)),
        PosteriorFileError,
        r"empty or truncated.*Save the posterior again",
    ),
    Case(
        "load-missing",
        lambda t: bp.load(t / "nope.bnn"),
        FileNotFoundError,
        r"nope\.bnn.*does not exist.*check the path",
    ),
]


def test_the_table_covers_at_least_30_cases_with_unique_ids():
    ids = [c.id for c in CASES]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gives_a_clear_error_or_warning(case: Case, tmp_path):
    if issubclass(case.expected, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case.trigger(tmp_path)
        messages = [str(w.message) for w in caught if issubclass(w.category, case.expected)]
        hits = [m for m in messages if _matches(case.match, m)]
        assert hits, f"no {case.expected.__name__} matching {case.match!r}; got {messages}"
        return
    with pytest.raises(case.expected) as info:
        case.trigger(tmp_path)
    message = str(info.value)
    assert _matches(case.match, message), f"message {message!r} does not match {case.match!r}"
    innermost = Path(str(info.traceback[-1].path)).resolve()
    assert PACKAGE.resolve() in innermost.parents, f"raised from {innermost}, not from bnn_pyro's validation"


def _matches(pattern: str, message: str) -> bool:
    import re

    return re.search(pattern, message, re.DOTALL) is not None and re.search(ADVICE, message) is not None


@pytest.mark.filterwarnings("ignore:nuts. 100.0% of the draws diverged")
def test_the_largest_seed_fits_with_several_chains():
    """The bound leaves room for the per-chain offsets: chain 1 of seed 2**31 - 1 seeds NumPy with 2**31."""
    post = _mcmc(seed=2**31 - 1, num_chains=2, chain_method="sequential")
    assert post.num_chains == 2


def test_float64_numpy_data_fits_and_predicts_in_the_models_dtype():
    """numpy's default float64 for a float32 net was a 'mat1 and mat2 must have the same dtype'
    RuntimeError from inside torch; now the inputs are cast to the model's dtype."""
    g = np.random.default_rng(0)
    x, y = g.normal(size=(6, 2)), g.normal(size=6)
    post = bp.fit(_model(features=2), x, y, method="svi", num_steps=2, num_samples=2, progress=False)
    pred = post.predict(g.normal(size=(3, 2)))
    assert pred.mean.dtype == torch.get_default_dtype() and pred.mean.shape == (3,)
    assert torch.isfinite(pred.mean).all()


@pytest.mark.parametrize("method", [m.value for m in bp.infer.Method])
@pytest.mark.parametrize(
    "likelihood",
    [bp.likelihoods.Gaussian(scale=0.1), bp.likelihoods.Categorical()],
    ids=["regression", "classification"],
)
def test_every_method_refuses_a_fit_without_targets(method, likelihood):
    """Without y every engine failed somewhere else (a TypeError deep in torch, Pyro's 'discrete sample site',
    an engine's own check); now bp.fit refuses before any engine runs, naming the method."""
    model = _model(out=3 if isinstance(likelihood, bp.likelihoods.Categorical) else 1, likelihood=likelihood)
    with pytest.raises(ValueError, match=rf"y: {method} fits the model to targets, but y is None; pass them") as info:
        bp.fit(model, X, method=method, progress=False)
    assert Path(str(info.traceback[-1].path)).resolve() == PACKAGE.resolve() / "infer" / "__init__.py"


@pytest.mark.parametrize("bad", [2**31, 2**63, 2**70, -1])
def test_seeds_after_the_fit_are_checked_too(bad):
    """predict, sample, PSIS resampling and SBC take seeds as bp.fit does: [0, 2**31 - 1], or a ValueError naming
    the argument (2**63 was a raw torch overflow error in predict)."""
    import bnn_pyro.posterior.psis as psis_module
    import bnn_pyro.tools.sbc as sbc_module

    x = torch.linspace(-1, 1, 8)[:, None]
    model = bp.BNN(torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(0.1))
    post = bp.Posterior(
        samples={n: torch.zeros((1, 3) + s) for n, s in model.param_shapes.items()}, model=model, method="svi"
    )
    calls = [
        lambda: post.predict(x, seed=bad),
        lambda: post.sample(2, seed=bad),
        lambda: psis_module.resample(torch.ones(3), 2, seed=bad),
        lambda: sbc_module.run(model, x, method="svi", num_replications=1, seed=bad),
    ]
    expected = (
        r"seed must be a non-negative int, got -1"
        if bad < 0
        else rf"seed must be at most 2\*\*31 - 1 = 2147483647, got {bad}"
    )
    for call in calls:
        with pytest.raises(ValueError, match=expected) as info:
            call()
        innermost = Path(str(info.traceback[-1].path)).resolve()
        assert PACKAGE.resolve() in innermost.parents, f"raised from {innermost}, not from bnn_pyro's checks"


def _line(x, y=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(w * x[:, 0], 0.1), obs=y)


FUNCTION_METHODS = [m.value for m in bp.infer.Method if bp.infer.unfit_reason(m, _line, X) is None]


@pytest.mark.parametrize("method", FUNCTION_METHODS)
def test_a_column_of_targets_for_a_pyro_function_is_refused_not_broadcast(method):
    """y shaped (N, 1) against a function's (N,) predictions: Normal(f).log_prob(y) is (N, N), every prediction
    against every target. Twelve engines fitted that wrong likelihood silently and svi raised Pyro's shape error;
    now bp.fit refuses before any engine runs, naming y and the reshape."""
    with pytest.raises(
        ValueError,
        match=r"y: the model's observed site 'obs' .* shaped \(8,\).*shape \(8, 1\).*"
        r"broadcast to \(8, 8\).*Pass y shaped like",
    ) as info:
        bp.fit(_line, X, Y[:, None], method=method, progress=False)
    assert Path(str(info.traceback[-1].path)).resolve() == PACKAGE.resolve() / "infer" / "_common.py"


def test_targets_shaped_like_the_observed_site_still_fit():
    """The check refuses only a value and a distribution that enlarge each other: targets shaped like the site,
    (N,) or (N, 2) under to_event(1), fit as before."""

    def two_outputs(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(x * w, 0.1).to_event(1), obs=y)

    for model, y in ((_line, Y), (two_outputs, torch.cat([Y[:, None], -Y[:, None]], 1))):
        post = bp.fit(model, X, y, method="svi", num_steps=2, num_samples=2, progress=False)
        assert post.num_draws == 2


@pytest.mark.parametrize("method", ["svi", "laplace"])
def test_training_data_that_require_grad_are_fitted_as_constants(method):
    """x or y requiring grad (e.g. another net's output) failed deep in the analytic ELBO with 'dot(): functions
    with out=... arguments don't support automatic differentiation'; bp.fit now takes them as the constants they are."""
    x, y = X.clone().requires_grad_(), Y.clone().requires_grad_()
    post = _fit(x=x, y=y, method=method, seed=0)
    reference = _fit(method=method, seed=0)
    assert all(torch.equal(post.samples[k], reference.samples[k]) for k in reference.samples)
    assert not post.x.requires_grad and not post.y.requires_grad and x.requires_grad  # the user's tensor untouched


def test_numpys_bool_resume_is_read_as_the_bool_it_is():
    """``resume=np.False_`` passed the resume check but then met engines that test ``resume is True`` / ``is not
    False`` (nuts: 'resume: expected True ...'; subspace: 'resume= needs checkpoint=FOLDER'); it is a plain bool."""
    import numpy as np

    post = _mcmc(resume=np.False_, num_chains=1)
    assert post.num_draws == 2  # a fresh fit of its 2 draws
