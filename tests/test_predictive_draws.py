"""bnn_pyro/predictive_draws.py and the block-by-block prediction: every statistic equals the unchunked
computation on the same draws, memory per block is bounded by the chunk size, and what is not read is not
computed."""

from __future__ import annotations

import pyro.distributions as dist
import pytest
import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro import predictive_draws
from bnn_pyro.predictions import entropy, mutual_information
from bnn_pyro.predictive_draws import NOISE_ROWS, NetworkDraws


def _posterior(inputs: int, outputs: int, likelihood, draws: int = 40, seed: int = 0) -> bp.Posterior:
    """A posterior with random draws (no fit needed: the prediction is a function of the draws)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, outputs))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=likelihood)
    g = torch.Generator().manual_seed(seed)
    samples = {n: torch.randn((2, draws // 2) + s, generator=g) for n, s in model.param_shapes.items()}
    samples.update({n: 0.05 + torch.rand(2, draws // 2, generator=g) for n in likelihood.sites()})
    return bp.Posterior(samples=samples, model=model, method="svi")


REGRESSION = {
    "fixed noise": (2, 1, lambda: bp.likelihoods.Gaussian(scale=0.1)),
    "learned noise": (2, 1, lambda: bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))),
    "heteroscedastic": (2, 2, lambda: bp.likelihoods.HeteroscedasticGaussian()),
    "multi-output": (3, 3, lambda: bp.likelihoods.Gaussian(scale=0.2)),
}


@pytest.mark.parametrize("case", list(REGRESSION))
def test_regression_blocks_equal_the_unchunked_computation(case):
    inputs, outputs, likelihood = REGRESSION[case]
    post = _posterior(inputs, outputs, likelihood())
    x = torch.randn(601, inputs, generator=torch.Generator().manual_seed(1))
    d = post.observation_distribution(x)  # every draw at every point, in one piece
    m, v = d.mean.double(), d.variance.double()
    for chunk in (None, 7, 300):  # the default (one block here), 86 blocks of 7 rows, 3 uneven blocks
        pred = post.predict(x, points_per_chunk=chunk, seed=3)
        torch.testing.assert_close(pred.mean.double(), m.mean(0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pred.epistemic_std.double(), m.var(0, correction=0).sqrt(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pred.aleatoric_std.double(), v.mean(0).sqrt(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pred.std.double(), (m.var(0, correction=0) + v.mean(0)).sqrt(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pred.mean_draws, d.mean, rtol=1e-6, atol=1e-6)  # BLAS rounds by block size
        # the interval: quantiles of the predictive samples, which do not depend on the chunking
        q = torch.quantile(pred.draws, torch.tensor([0.025, 0.975]), dim=0)
        assert torch.equal(pred.lower, q[0]) and torch.equal(pred.upper, q[1])
        if chunk is None:
            first = pred
        else:
            assert torch.equal(pred.draws, first.draws) and torch.equal(pred.lower, first.lower)
    assert pred.mean.shape == ((601,) if outputs == 1 or case == "heteroscedastic" else (601, outputs))


@pytest.mark.parametrize("case", list(REGRESSION))
def test_moments_streamed_over_chunks_of_draws_equal_the_unchunked_computation(case):
    # 4,100 rows x 16 hidden units: the net runs one draw at a time; the moments are combined over chunks of
    # draws (the default 64: 64 + 64 + 64 + 8; 7; 1), each chunk with its own draws' noise
    inputs, outputs, likelihood = REGRESSION[case]
    post = _posterior(inputs, outputs, likelihood(), draws=200)
    x = torch.randn(4100, inputs, generator=torch.Generator().manual_seed(1))
    d = post.observation_distribution(x)
    m, v = d.mean.double(), d.variance.double()
    for per_chunk in (None, 7, 1):
        pred = post.predict(x, draws_per_chunk=per_chunk, interval=None)
        torch.testing.assert_close(pred.mean.double(), m.mean(0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pred.epistemic_std.double(), m.var(0, correction=0).sqrt(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pred.aleatoric_std.double(), v.mean(0).sqrt(), rtol=1e-6, atol=1e-6)


def test_draw_moments_combine_chunks_without_cancellation():
    # float32 draws 1,000 + 0.1 z: a sum of squares minus a squared sum would lose the variance (0.01) to
    # rounding of the squares (~1e6 each, float32 spacing 0.06); the pairwise combine keeps it to the
    # rounding of the values themselves (spacing 6e-5, against a spread of 0.1)
    g = torch.Generator().manual_seed(0)
    means = 1000.0 + 0.1 * torch.randn(300, 50, generator=g)
    variances = torch.rand(300, 50, generator=g)
    moments = predictive_draws.DrawMoments()
    for m, v in zip(means.split(64), variances.split(64)):
        moments.add(m, v)
    mean, epistemic, aleatoric = moments.result()
    torch.testing.assert_close(mean.double(), means.double().mean(0), rtol=1e-7, atol=1e-4)
    torch.testing.assert_close(epistemic.double(), means.double().var(0, correction=0), rtol=1e-3, atol=0)
    torch.testing.assert_close(aleatoric.double(), variances.double().mean(0), rtol=1e-6, atol=0)


def test_predictive_samples_are_noise_about_each_draw_independent_across_blocks():
    post = _posterior(2, 1, bp.likelihoods.Gaussian(scale=0.1), draws=200)
    x = torch.randn(3 * NOISE_ROWS, 2, generator=torch.Generator().manual_seed(2))
    pred = post.predict(x, seed=0)
    z = ((pred.draws - pred.mean_draws) / 0.1).double()  # standard normal, independent, if sampled right
    n = z.numel()
    assert abs(float(z.mean())) < 4 / n**0.5 and abs(float(z.var()) - 1) < 4 * (2 / n) ** 0.5
    blocks = z.reshape(200, 3, NOISE_ROWS).transpose(0, 1).reshape(3, -1)  # each block's noise, all draws
    for a, b in ((0, 1), (0, 2), (1, 2)):  # one seed per block: blocks' noise uncorrelated, not repeated
        assert abs(float(torch.corrcoef(blocks[[a, b]])[0, 1])) < 4 / blocks.shape[1] ** 0.5
    assert not torch.equal(post.predict(x, seed=1).draws, pred.draws)
    state = torch.get_rng_state()
    post.predict(x, seed=5).lower
    assert torch.equal(torch.get_rng_state(), state)  # a seeded prediction leaves the global generator alone


@pytest.mark.parametrize("likelihood, outputs", [(bp.likelihoods.Categorical, 4), (bp.likelihoods.Bernoulli, 1)])
def test_classification_blocks_equal_the_unchunked_computation(likelihood, outputs):
    post = _posterior(2, outputs, likelihood())
    x = torch.randn(301, 2, generator=torch.Generator().manual_seed(1))
    probs = post.model.likelihood.probs(post.observation_distribution(x))  # (S, N, K), in one piece
    for chunk in (None, 7):
        pred = post.predict(x, points_per_chunk=chunk)
        close = dict(rtol=1e-6, atol=1e-6)  # the net's rounding depends on the block's rows (BLAS blocking)
        torch.testing.assert_close(pred.probs, probs.mean(0), **close)
        torch.testing.assert_close(pred.entropy, entropy(probs.mean(0)), **close)
        torch.testing.assert_close(pred.aleatoric_entropy, entropy(probs).mean(0), **close)
        torch.testing.assert_close(pred.mutual_information, mutual_information(probs), **close)
        torch.testing.assert_close(pred.draws, probs, **close)
        assert torch.equal(pred.predicted, pred.probs.argmax(-1))


class _Spy:
    """Counts the blocks NetworkDraws evaluates (a block's outputs of every draw, or its moments streamed over
    chunks of draws) and the bytes of the largest network output it formed (a block's, or a chunk's)."""

    def __init__(self, monkeypatch):
        self.outputs, self.samples, self.largest = 0, 0, 0
        outputs, samples = NetworkDraws.outputs, NetworkDraws.samples
        moment_summary, chunk_outputs = NetworkDraws.moment_summary, NetworkDraws._chunk_outputs

        def spy_outputs(source, rows):
            f = outputs(source, rows)
            self.outputs += 1
            self.largest = max(self.largest, f.numel() * f.element_size())
            return f

        def spy_moment_summary(source, rows):
            self.outputs += 1
            return moment_summary(source, rows)

        def spy_chunk_outputs(source, *args, **kwargs):
            f = chunk_outputs(source, *args, **kwargs)
            self.largest = max(self.largest, f.numel() * f.element_size())
            return f

        def spy_samples(source, rows):
            self.samples += 1
            return samples(source, rows)

        monkeypatch.setattr(NetworkDraws, "outputs", spy_outputs)
        monkeypatch.setattr(NetworkDraws, "moment_summary", spy_moment_summary)
        monkeypatch.setattr(NetworkDraws, "_chunk_outputs", spy_chunk_outputs)
        monkeypatch.setattr(NetworkDraws, "samples", spy_samples)


def test_what_is_not_read_is_not_computed(monkeypatch):
    post = _posterior(2, 1, bp.likelihoods.Gaussian(scale=0.1))
    x = torch.randn(1000, 2, generator=torch.Generator().manual_seed(1))
    spy = _Spy(monkeypatch)
    pred = post.predict(x, points_per_chunk=256)  # the default interval=0.95
    assert (spy.outputs, spy.samples) == (4, 0)  # the moments: one pass, no predictive samples, no quantiles
    assert pred.mean.shape == (1000,) and "bounds" not in pred._cache and "draws" not in pred._cache
    lower = pred.lower
    assert (spy.outputs, spy.samples) == (8, 4)  # the interval on first read: one more pass
    assert pred.upper is not None and torch.equal(pred.lower, lower) and (spy.outputs, spy.samples) == (8, 4)
    assert post.predict(x, interval=None).lower is None


def test_memory_per_block_is_set_by_the_chunk_size_not_by_draws_times_points(monkeypatch):
    # 200 draws x 20,000 points: 16 MB per (S, N) array; blocks of a 1 MB budget hold 1,310 rows each
    monkeypatch.setattr(predictive_draws, "CHUNK_BYTES", 2**20)
    post = _posterior(1, 1, bp.likelihoods.Gaussian(scale=0.1), draws=200)
    x = torch.randn(20_000, 1, generator=torch.Generator().manual_seed(1))
    spy = _Spy(monkeypatch)
    pred = post.predict(x)
    assert spy.largest <= 2**20 and spy.outputs == -(-20_000 // (2**20 // 800))  # the moments, block by block
    pred.lower
    assert spy.largest <= 2**20 and spy.samples == -(-20_000 // 1280)  # samples: whole blocks of 256 rows
    spy.largest = 0
    post.predict(x, points_per_chunk=1000).mean  # streamed over chunks of 64 draws (BNN.draws_per_chunk)
    assert spy.largest == 64 * 1000 * 4
    spy.largest = 0
    post.predict(x, points_per_chunk=1000).mean_draws  # the per-draw means: every draw of a block at once
    assert spy.largest == 200 * 1000 * 4


def test_default_chunk_and_bad_chunk_sizes():
    post = _posterior(1, 1, bp.likelihoods.Gaussian(scale=0.1), draws=1000)
    source = post.predictive_draws(torch.zeros(10**6, 1), post.draw_index())
    assert source.chunk_rows() == 8388 and source.chunk_rows(aligned=True) == 8192  # 1,000 draws x 1 float32 output
    assert post.predictive_draws(torch.zeros(100, 1), post.draw_index()).chunk_rows() == 100
    with pytest.raises(ValueError, match="points_per_chunk must be a positive int, got 0"):
        post.predict(torch.zeros(2, 1), points_per_chunk=0)
    with pytest.raises(ValueError, match="scale: expected positive values"):
        post.predict(torch.zeros(2, 1)).affine(0.0, -1.0)


def test_affine_maps_every_statistic_and_draw_lazily():
    post = _posterior(2, 1, bp.likelihoods.Gaussian(scale=0.1))
    x = torch.randn(50, 2, generator=torch.Generator().manual_seed(1))
    pred = post.predict(x, seed=0)
    moved = pred.affine(1.5, 2.0)
    assert "draws" not in moved._cache and "bounds" not in moved._cache
    torch.testing.assert_close(moved.lower, 1.5 + 2.0 * pred.lower)
    torch.testing.assert_close(moved.draws, 1.5 + 2.0 * pred.draws)
    torch.testing.assert_close(moved.mean_draws, 1.5 + 2.0 * pred.mean_draws)
    torch.testing.assert_close(moved.std, 2.0 * pred.std)
    torch.testing.assert_close(pred.affine(1.5, 2.0).upper, 1.5 + 2.0 * pred.upper)  # read before the draws


def test_what_reads_every_draw_reads_it_block_by_block(monkeypatch):
    """PIT, the mixture NLL of a prediction and the predictive band read the per-draw arrays block by block
    (here blocks of 256 rows, 3 of them): the same numbers as from the whole arrays, which are never formed."""
    from bnn_pyro import calibration, metrics, plots
    from bnn_pyro.predictions import RegressionPrediction

    monkeypatch.setattr(predictive_draws, "CHUNK_BYTES", 4096)  # 40 draws x 4 bytes: 25 rows, 256 with samples
    post = _posterior(1, 1, bp.likelihoods.Gaussian(scale=0.3))
    x = torch.randn(700, 1, generator=torch.Generator().manual_seed(1))
    y = torch.randn(700, generator=torch.Generator().manual_seed(2))
    pred, whole = post.predict(x, seed=4), post.predict(x, seed=4)
    u = calibration.pit(pred, y)
    assert torch.equal(u, (whole.draws < y).double().mean(0) + 0.5 * (whole.draws == y).double().mean(0))
    log_p = torch.distributions.Normal(whole.mean_draws.double(), whole.aleatoric_std.double()).log_prob(y.double())
    expected = -float((torch.logsumexp(log_p, 0) - torch.log(torch.tensor(40.0))).mean())
    assert metrics.nll(pred, y) == pytest.approx(expected, rel=1e-6)
    assert "draws" not in pred._cache and "mean_draws" not in pred._cache

    def whole_array(self):
        raise AssertionError("read every draw at every point at once")

    monkeypatch.setattr(RegressionPrediction, "mean_draws", property(whole_array))
    monkeypatch.setattr(RegressionPrediction, "draws", property(whole_array))
    post.x, post.y = x, y
    plots.plot_predictive(post, x[:300])
    plots.plt.close("all")


def test_acquisition_reads_the_pools_draws_block_by_block(monkeypatch):
    from bnn_pyro import acquisition

    monkeypatch.setattr(predictive_draws, "CHUNK_BYTES", 4096)  # 40 draws x 3 classes x 4 bytes: 8 rows a block
    post = _posterior(2, 3, bp.likelihoods.Categorical())
    pool = torch.randn(90, 2, generator=torch.Generator().manual_seed(1))
    pred, whole = post.predict(pool), post.predict(pool)
    whole.draws  # read: one block of every row
    assert pred.source.chunk_rows() == 8
    for strategy in ("bald", "entropy", "variation_ratios"):
        torch.testing.assert_close(
            acquisition.scores(pred, strategy), acquisition.scores(whole, strategy), rtol=1e-5, atol=1e-7
        )  # float32 nets: BLAS rounds by block size
    assert torch.equal(acquisition.select(pred, 3, "batchbald"), acquisition.select(whole, 3, "batchbald"))
    assert acquisition.joint_mutual_information(pred, [3, 50, 89]) == pytest.approx(
        acquisition.joint_mutual_information(whole, [3, 50, 89]), rel=1e-5
    )
    assert "draws" not in pred._cache


@pytest.mark.parametrize(
    "likelihood, outputs",
    [(lambda: bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0)), 1), (bp.likelihoods.Categorical, 3)],
)
def test_a_prediction_pickles_and_its_lazy_parts_are_the_same_after_loading(likelihood, outputs):
    # the source holds the posterior, x and the likelihood with each draw's noise (a class, not a closure, which
    # pickle refused: "Can't pickle local object"); what was not read is produced after loading, from the same seed
    import pickle

    post = _posterior(2, outputs, likelihood())
    x = torch.randn(300, 2, generator=torch.Generator().manual_seed(1))
    pred = post.predict(x, seed=2)
    loaded = pickle.loads(pickle.dumps(pred))
    assert isinstance(loaded.source, NetworkDraws) and torch.equal(loaded.draws, pred.draws)
    if outputs == 1:
        assert torch.equal(loaded.lower, pred.lower) and torch.equal(loaded.mean, pred.mean)


def test_evaluating_restores_the_mode_on_error_and_leaves_a_plain_function_alone():
    net = nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5))
    with pytest.raises(RuntimeError, match="inside"), predictive_draws.evaluating(net):
        assert not net.training and not net[1].training
        raise RuntimeError("inside")
    assert net.training and net[1].training
    net.eval()
    with predictive_draws.evaluating(net):
        pass
    assert not net.training  # restored to what it was, not switched to training

    def model(x, y=None):  # a Pyro function model has no mode (Laplace's curvature takes one)
        return x

    with predictive_draws.evaluating(model):
        assert not hasattr(model, "training")
