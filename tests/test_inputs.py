"""Sequence and embedding models (bnn_pyro/inputs.py and the paths it opens in model.py, likelihoods.py,
posterior.py): integer token ids kept integer end to end, tuple and dict inputs through fit, minibatches and
predict, (N, T, C) outputs with the exact log-likelihood, and the loop over draws for nets vmap cannot batch."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from conftest import TINY_SUBSPACE
from pyro import poutine
from torch import nn

import bnn_pyro as bp
from bnn_pyro import metrics
from bnn_pyro.infer._common import Data
from bnn_pyro.infer._logjoint import build as build_logjoint
from bnn_pyro.inputs import Inputs

SEEN_DTYPES: list[torch.dtype] = []


class Tagger(nn.Module):
    """Token ids (N, T) -> (N, T, C); records the dtype it is called with; ``rnn`` picks the recurrent layer."""

    def __init__(self, vocab=5, classes=3, hidden=6, rnn=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.rnn = {None: None, "gru": nn.GRU, "lstm": nn.LSTM}[rnn]
        self.rnn = None if rnn is None else self.rnn(4, hidden, batch_first=True)
        self.out = nn.Linear(hidden if rnn else 4, classes)

    def forward(self, tokens):
        SEEN_DTYPES.append(tokens.dtype)
        h = self.embed(tokens)
        h = torch.tanh(h) if self.rnn is None else self.rnn(h)[0]
        return self.out(h)


class TwoInputs(nn.Module):
    """forward(u, v): two feature tensors, one output."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(2, 5), nn.Linear(3, 5), nn.Linear(5, 1)

    def forward(self, u, v):
        return self.o(torch.tanh(self.a(u) + self.b(v)))


def _tokens(n=30, t=6, vocab=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab, (n, t), generator=g)
    return x, x % 3


def _tagger_model(rnn=None, likelihood=None, classes=3):
    torch.manual_seed(0)
    return bp.BNN(
        Tagger(rnn=rnn, classes=classes),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=likelihood or bp.likelihoods.Categorical(),
    )


def _draws(model, num, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: 0.5 * torch.randn((num,) + model.param_shapes[n], generator=g) for n in model.sample_names}


def _posterior(model, x, y, params):
    return bp.Posterior(samples={n: p.unsqueeze(0) for n, p in params.items()}, model=model, method="hand", x=x, y=y)


# ------------------------------------------------------------------------------------------ integer inputs
def test_token_ids_stay_integer_through_fit_and_predict():
    x, y = _tokens()
    model = _tagger_model()
    assert model.integer_inputs
    SEEN_DTYPES.clear()
    post = bp.fit(model, x.numpy(), y, method="svi", num_steps=3, num_samples=4, progress=False, seed=0)
    assert post.x.dtype == torch.int64 and torch.equal(post.x, x)
    pred = post.predict(x[:4].int())  # int32 ids too
    assert pred.probs.shape == (4, 6, 3) and pred.predicted.shape == (4, 6)
    assert SEEN_DTYPES and set(SEEN_DTYPES) <= {torch.int64, torch.int32}  # never a float (meta runs included)


def test_integer_features_of_a_net_without_embedding_are_still_cast_to_float():
    model = bp.BNN(nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    assert not model.integer_inputs
    x = torch.tensor([[1, 2], [3, 4], [5, 6]])
    post = bp.fit(model, x, torch.zeros(3), method="svi", num_steps=2, num_samples=2, progress=False)
    assert post.x.dtype == torch.float32 and torch.equal(post.x, x.float())


@pytest.mark.parametrize(
    "ids, match",
    [
        (-1, r"x: token ids must lie in 0\.\.4.*found ids in -1\.\.4"),
        (5, r"x: token ids must lie in 0\.\.4 .*num_embeddings=5.*found ids in 0\.\.5"),
    ],
)
def test_token_ids_outside_the_embedding_are_refused_clearly(ids, match):
    x, y = _tokens()
    x[0, 0] = ids
    x[1, 0] = 4
    with pytest.raises(ValueError, match=match):
        bp.fit(_tagger_model(), x, y, method="svi", num_steps=1, progress=False)


# ------------------------------------------------------------------------------------------ tuple and dict inputs
def _two_inputs(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, v = torch.randn(n, 2, generator=g), torch.randn(n, 3, generator=g)
    return u, v, u[:, 0] - v[:, 1]


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_tuple_and_dict_inputs_fit_predict_and_equal_the_net_called_by_hand(form):
    u, v, y = _two_inputs()
    x = (u, v) if form == "tuple" else {"v": v, "u": u}  # a dict goes in as keywords: order does not matter
    torch.manual_seed(0)
    model = bp.BNN(TwoInputs(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    post = bp.fit(model, x, y, method="svi", num_steps=5, num_samples=6, batch_size=10, progress=False, seed=0)
    assert isinstance(post.x, Inputs) and torch.equal(post.x.tensors()[0], x[0] if form == "tuple" else v)
    x_new = (u[:7], v[:7]) if form == "tuple" else {"u": u[:7], "v": v[:7]}
    pred = post.predict(x_new, interval=None)
    flat = post.sample()
    for s in range(post.num_draws):
        values = {n: flat[n][s] for n in model.sample_names}
        by_hand = torch.func.functional_call(TwoInputs(), values, (u[:7], v[:7]))
        torch.testing.assert_close(pred.mean_draws[s], by_hand[:, 0], rtol=0, atol=1e-6)


def test_minibatches_of_structured_inputs_are_rows_of_every_tensor():
    u, v, _ = _two_inputs(n=23)
    y = torch.arange(23.0)
    data = Data(x=Inputs(args=(u, v)), y=y, batch_size=5)
    batches = data.batches(torch.Generator().manual_seed(0))
    seen = []
    for _ in range(5):  # one epoch: 4 batches of 5 and one of 3
        xb, yb = next(batches)
        rows = yb.long()
        assert torch.equal(xb.args[0], u[rows]) and torch.equal(xb.args[1], v[rows])
        seen += rows.tolist()
    assert sorted(seen) == list(range(23))


def test_structured_inputs_survive_save_and_load(tmp_path):
    u, v, y = _two_inputs()
    torch.manual_seed(0)
    model = bp.BNN(TwoInputs(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    post = bp.fit(model, {"u": u, "v": v}, y, method="svi", num_steps=2, num_samples=3, progress=False)
    back = bp.load(post.save(tmp_path / "p.safetensors"), model=model)
    assert isinstance(back.x, Inputs) and set(back.x.kwargs) == {"u", "v"} and torch.equal(back.x.kwargs["v"], v)
    torch.testing.assert_close(back.predict({"u": u, "v": v}).mean, post.predict({"u": u, "v": v}).mean)


def test_structured_input_errors_name_the_argument():
    u, v, y = _two_inputs()
    model = bp.BNN(TwoInputs(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    with pytest.raises(ValueError, match=r"same first \(row\) dimension; got shapes \(24, 2\), \(23, 3\)"):
        bp.fit(model, (u, v[:23]), y, method="svi", num_steps=1)
    with pytest.raises(ValueError, match=r"x\[1\] contains NaN"):
        bp.fit(model, (u, v.clone().fill_(float("nan"))), y, method="svi", num_steps=1)
    with pytest.raises(ValueError, match=r"a dict as keyword arguments, net\(\*\*x\)"):
        bp.fit(model, {"u": u, "w": v}, y, method="svi", num_steps=1)
    with pytest.raises(ValueError, match=r"method='laplace'.*x is a tuple or dict of tensors.*Use svi, nuts"):
        bp.fit(model, (u, v), y, method="laplace")


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # a handful of draws
def test_subspace_fits_structured_inputs_and_says_its_check_was_not_judged():
    """Subspace's check of the variance its subspace holds takes per-row Jacobians of one input tensor; on tuple or
    dict x it is not judged and says why, and the fit runs (review 26: torch's vmap error after the SWA stage; review
    28: refusing the fit up front removed subspace fits that ran)."""
    u, v, y = _two_inputs()
    torch.manual_seed(0)
    model = bp.BNN(TwoInputs(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    post = bp.fit(model, {"u": u, "v": v}, y, method="subspace", seed=0, progress=False, **TINY_SUBSPACE)
    held = post.config["subspace"]["held"]
    assert held["judged"] is False and "tuple or dict" in held["reason"], held
    assert torch.isfinite(post.predict({"u": u, "v": v}).mean).all()


@pytest.mark.filterwarnings("ignore::bnn_pyro.posterior.diagnostics.DiagnosticWarning")  # a handful of draws
@pytest.mark.parametrize("method", ["nuts", "hmc", "metropolis", "mala"])
def test_mcmc_takes_structured_inputs(method):
    """docs/guide/models.md lists the MCMC engines for tuple/dict x; they raised 'Inputs' object has no attribute
    'detach' at the kernel's setup (review 26 finding 9). They fit, and predict at such x."""
    u, v, y = _two_inputs()
    torch.manual_seed(0)
    model = bp.BNN(TwoInputs(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.3))
    run = dict(num_samples=5, num_warmup=5, num_chains=1, seed=0, progress=False)
    post = bp.fit(model, {"u": u, "v": v}, y, method=method, **run)
    assert isinstance(post.x, Inputs) and torch.isfinite(post.predict({"u": u, "v": v}).mean).all()


# ------------------------------------------------------------------------------------------ (N, T, C) outputs
def test_sequence_classification_log_likelihood_is_the_sum_over_positions():
    x, y = _tokens(n=8)
    model = _tagger_model()
    values = {n: p[0] for n, p in _draws(model, 1).items()}
    with pyro.get_param_store().scope(), torch.no_grad():
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y, dataset_size=20)
        trace.compute_log_prob()
    f = torch.func.functional_call(Tagger(), values, (x,))
    by_hand = torch.log_softmax(f, -1).gather(-1, y[..., None])[..., 0].sum(1)  # per sequence (N,)
    assert trace.nodes["f"]["value"].shape == (8, 6, 3)
    torch.testing.assert_close(trace.nodes["obs"]["unscaled_log_prob"], by_hand, rtol=1e-6, atol=1e-5)
    # the data plate scales sequences (rows), not positions: a minibatch of 8 of 20 sequences
    torch.testing.assert_close(trace.nodes["obs"]["log_prob"], 20 / 8 * by_hand, rtol=1e-6, atol=1e-5)
    # the fast log joint (SVI, NUTS) agrees: prior + (20 / 8) * sum of the rows' log-likelihoods
    joint = build_logjoint(model, 20)
    torch.testing.assert_close(joint.log_likelihood(values, x, y), 20 / 8 * by_hand.sum(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("classes", [1, 2])
def test_sequence_regression_with_learned_noise_equals_the_gaussian_density_by_hand(classes):
    x, _ = _tokens(n=7)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(7, 6, classes, generator=g)
    model = _tagger_model(likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)), classes=classes)
    values = {n: p[0] for n, p in _draws(model, 1).items()}
    values["sigma"] = torch.tensor(0.7)
    target = model.likelihood.check_output_target(y, model.output_shape(x))  # the model's layout, as bp.fit makes it
    assert target.shape == ((7, 6) if classes == 1 else (7, 6, classes))
    with pyro.get_param_store().scope(), torch.no_grad():
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(x, target)
        trace.compute_log_prob()
    f = torch.func.functional_call(Tagger(classes=classes), {k: v for k, v in values.items() if k != "sigma"}, (x,))
    z = (y - f) / 0.7
    by_hand = (-0.5 * z**2 - math.log(0.7) - 0.5 * math.log(2 * math.pi)).sum((1, 2))
    torch.testing.assert_close(trace.nodes["obs"]["log_prob"], by_hand, rtol=1e-6, atol=1e-5)
    post = _posterior(model, x, target, {k: v[None] for k, v in values.items()})
    pred = post.predict(x, interval=None)  # one draw: the mean is f, the aleatoric sd sigma at every position
    torch.testing.assert_close(pred.mean, f[..., 0] if classes == 1 else f, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pred.aleatoric_std, torch.full(target.shape, 0.7), rtol=1e-6, atol=1e-6)


def test_sequence_predictions_and_the_log_predictive_density_by_hand():
    x, y = _tokens(n=9)
    model = _tagger_model()
    params = _draws(model, 5)
    post = _posterior(model, x, y, params)
    f = torch.stack(
        [torch.func.functional_call(Tagger(), {n: p[s] for n, p in params.items()}, (x,)) for s in range(5)]
    )
    probs = torch.softmax(f, -1)  # (S, N, T, C)
    pred = post.predict(x)
    torch.testing.assert_close(pred.probs, probs.mean(0), rtol=1e-6, atol=1e-6)
    log_p = torch.log_softmax(f, -1).gather(-1, y.expand(5, -1, -1)[..., None])[..., 0].sum(-1)  # (S, N)
    lpd = torch.logsumexp(log_p, 0) - math.log(5)
    torch.testing.assert_close(metrics.log_predictive_density(post, x, y), lpd, rtol=1e-5, atol=1e-5)
    labels = probs.mean(0).argmax(-1)
    assert metrics.accuracy(pred, y) == pytest.approx(float((labels == y).double().mean()))
    with pytest.raises(ValueError, match=r"one label per position, shaped \(9, 6\)"):
        metrics.accuracy(pred, y[:, 0])


def test_sequence_targets_are_checked_per_position():
    x, y = _tokens()
    with pytest.raises(ValueError, match=r"outputs shaped \(N, 6, 3\).*y has shape \(30,\).*Reshape y"):
        bp.fit(_tagger_model(), x, y[:, 0], method="svi", num_steps=1)
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2.*checked per position"):
        bp.fit(_tagger_model(), x, y + 1, method="svi", num_steps=1)


def test_vectorized_particles_on_sequence_outputs_equal_one_particle_at_a_time():
    """Weights with a particle dim (Pyro's vectorized ELBO): each particle's log-likelihood is the one of its
    own draw alone (the GRU goes through the loop over draws, the plate dims line up with (N, T, C))."""
    x, y = _tokens(n=5)
    model = _tagger_model(rnn="gru")
    params = _draws(model, 3)
    with pyro.get_param_store().scope(), torch.no_grad():
        batched = {n: p.unsqueeze(1) for n, p in params.items()}  # (3, 1, *shape): particle dim -2
        with pyro.plate("particles", 3, dim=-2):
            trace = poutine.trace(poutine.condition(model, data=batched)).get_trace(x, y)
        trace.compute_log_prob()
        for s in range(3):
            one = poutine.trace(poutine.condition(model, data={n: p[s] for n, p in params.items()})).get_trace(x, y)
            one.compute_log_prob()
            torch.testing.assert_close(
                trace.nodes["obs"]["log_prob"][s], one.nodes["obs"]["log_prob"], rtol=0, atol=1e-5
            )


# ------------------------------------------------------------------------------------------ nets vmap cannot batch
class HandLSTM(nn.Module):
    """nn.LSTM's recurrence (one layer, batch_first) in plain tensor ops, which vmap can batch."""

    def __init__(self, vocab=5, classes=3, hidden=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.w_ih, self.w_hh = nn.Parameter(torch.zeros(4 * hidden, 4)), nn.Parameter(torch.zeros(4 * hidden, hidden))
        self.b_ih, self.b_hh = nn.Parameter(torch.zeros(4 * hidden)), nn.Parameter(torch.zeros(4 * hidden))
        self.out = nn.Linear(hidden, classes)

    def forward(self, tokens):
        e = self.embed(tokens)
        h = c = e.new_zeros(e.shape[0], self.w_hh.shape[1])
        outs = []
        for t in range(e.shape[1]):
            i, f, g, o = (e[:, t] @ self.w_ih.T + self.b_ih + h @ self.w_hh.T + self.b_hh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return self.out(torch.stack(outs, 1))


def test_lstm_predictions_loop_over_draws_and_equal_a_manual_loop_and_a_vmappable_lstm():
    x, y = _tokens(n=11)
    model = _tagger_model(rnn="lstm")
    assert not model.vmappable and _tagger_model().vmappable
    params = _draws(model, 7)
    f = model.forward_draws(params, x)
    manual = torch.stack(
        [torch.func.functional_call(Tagger(rnn="lstm"), {n: p[s] for n, p in params.items()}, (x,)) for s in range(7)]
    )
    assert torch.equal(f, manual)  # the loop is the manual loop, exactly
    torch.manual_seed(0)
    hand = bp.BNN(HandLSTM(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())
    assert hand.vmappable
    rename = {
        "rnn.weight_ih_l0": "w_ih",
        "rnn.weight_hh_l0": "w_hh",
        "rnn.bias_ih_l0": "b_ih",
        "rnn.bias_hh_l0": "b_hh",
    }
    torch.testing.assert_close(
        hand.forward_draws({rename.get(n, n): p for n, p in params.items()}, x), f, rtol=1e-5, atol=1e-5
    )  # vmap over the hand-written cell: the same function
    post = _posterior(model, x, y, params)
    whole, chunked = post.predict(x), post.predict(x, draws_per_chunk=3)  # chunks of 3, 3 and 1 draws
    assert torch.equal(whole.draws, chunked.draws) and torch.equal(whole.probs, chunked.probs)


def test_a_net_whose_vmap_fails_falls_back_to_the_loop_once_and_remembers():
    class Opaque(nn.Module):  # an op torch cannot batch: a custom autograd Function without a vmap rule
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            return _NoVmap.apply(self.lin(x))

    model = bp.BNN(Opaque(), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    assert model.vmappable
    params = _draws(model, 4)
    x = torch.randn(6, 2)
    f = model.forward_draws(params, x)
    assert not model.vmappable  # remembered
    torch.testing.assert_close(
        f, torch.stack([x @ params["lin.weight"][s].T + params["lin.bias"][s] for s in range(4)])
    )


class _NoVmap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


# ------------------------------------------------------------------------------------------ engines
@pytest.mark.parametrize(
    "method, options",
    [
        ("svi", dict(num_steps=3, num_samples=4, num_particles=2, fast_path=False)),  # Pyro's vectorized ELBO
        ("svi", dict(num_steps=3, num_samples=4)),  # the fast log joint
        ("nuts", dict(num_samples=3, num_warmup=3, max_tree_depth=2, jit=False)),  # jit=True: the slow test below
    ],
)
def test_engines_fit_a_gru_on_token_ids(method, options):
    x, y = _tokens(n=12)
    post = bp.fit(_tagger_model(rnn="gru"), x, y, method=method, progress=False, seed=0, **options)
    pred = post.predict(x[:3])
    assert pred.probs.shape == (3, 6, 3) and torch.allclose(pred.probs.sum(-1), torch.ones(3, 6))
    assert np.isfinite(metrics.test_log_likelihood(post, x, y))


def test_laplace_refuses_sequence_outputs_and_recurrent_nets_clearly():
    x, y = _tokens()
    with pytest.raises(ValueError, match=r"method='laplace'.*sequence outputs \(N, 6, 3\).*Use svi, nuts"):
        bp.fit(_tagger_model(rnn="gru"), x, y, method="laplace")


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, options",
    [
        ("nuts", dict(num_samples=3, num_warmup=3, max_tree_depth=2)),  # the default jit=True: ~10-25 s of compiling
        ("hmc", dict(num_samples=3, num_warmup=3, num_leapfrog=3, jit=False)),
        ("metropolis", dict(num_samples=5, num_warmup=5)),
        ("sgld", dict(num_samples=5, num_warmup=5)),
        ("sghmc", dict(num_samples=5, num_warmup=5)),
        ("csgmcmc", dict(num_cycles=2, num_samples=4, thin=2)),
        ("swa", dict(pretrain_steps=5, num_steps=5)),
        ("swag", dict(pretrain_steps=5, num_steps=12, swag_rank=3, num_samples=4, num_chains=1)),
        ("ensemble", dict(num_chains=2, num_steps=5)),
    ],
)
def test_the_other_engines_fit_a_gru_on_token_ids(method, options):
    """The README's list of engines that take recurrent, integer-input, sequence-output models."""
    x, y = _tokens(n=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a few draws: the convergence checks warn, as they should
        post = bp.fit(_tagger_model(rnn="gru"), x, y, method=method, progress=False, seed=0, **options)
    pred = post.predict(x[:3])
    assert pred.probs.shape == (3, 6, 3) and torch.allclose(pred.probs.sum(-1), torch.ones(3, 6))
    assert post.x.dtype == torch.int64
