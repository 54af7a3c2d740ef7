"""Tests for bnn_pyro/tools/distill.py: a deterministic student trained on a posterior's predictive.

Regression, known answer. The teacher is Bayesian linear regression (tests/blr.py) given by
``S = 4000`` exact posterior draws ``w_s ~ N(m, C)``. Its Bayesian model average at ``x`` (with
``x1 = [x, 1]``) has mean ``x1^T w_bar`` and variance ``s^2 + x1^T C_hat x1`` (``C_hat`` the draws'
covariance), which the student ``_Quadratic`` (a linear mean and the log of a quadratic form
``|A x + c|^2``) represents exactly, so the KL optimum is 0 and the student must match the teacher
to optimizer tolerance: ``|mu - mean| < 1e-3 sd`` and ``|log var_student - log var| < 1e-3``
(measured ~2e-7 in float32). Against the closed form (``mean = x1^T m``,
``var = s^2 + x1^T C x1``) the teacher adds Monte Carlo error: the mean's is ``N(0, x1^T C x1 / S)``,
the epistemic variance's sd is ``sqrt(2 / S) x1^T C x1`` (sampling variance of a Gaussian's
variance estimate); we allow 4 of these (two-sided 6e-5 per point, ~3e-3 over the 2 x 20 checks)
plus the optimizer tolerance.

Classification. The student (an MLP with 32 tanh units) can fit 60 probability vectors; at its
optimum KL is 0, so ``max |p_student - p_BMA| < 0.02`` is an optimizer tolerance (measured 0.006).
"""

import math

import pytest
import torch
from blr import make_blr

import bnn_pyro as bp
from bnn_pyro.tools.distill import _gaussian_kl

S, NOISE = 4000, 0.5


class _Quadratic(torch.nn.Module):
    """``[a^T x + b, log |A x + c|^2]``: a linear mean and a log-variance that is the log of any
    positive semi-definite quadratic form in ``[x, 1]``."""

    def __init__(self, d: int):
        super().__init__()
        self.mean, self.root = torch.nn.Linear(d, 1), torch.nn.Linear(d, d + 1)

    def forward(self, x):
        return torch.cat([self.mean(x), self.root(x).pow(2).sum(-1, keepdim=True).log()], -1)


def _exact_teacher(blr, draws: int = S, seed: int = 0) -> bp.Posterior:
    """A Posterior of ``draws`` exact posterior draws of Bayesian linear regression."""
    g = torch.Generator().manual_seed(seed)
    w = blr.mean + torch.randn(draws, len(blr.mean), generator=g, dtype=torch.double) @ torch.linalg.cholesky(blr.cov).T
    w = w.float()
    d = blr.x.shape[1]
    return bp.Posterior(
        samples={"weight": w[:, :d].reshape(1, draws, 1, d), "bias": w[:, d].reshape(1, draws, 1)},
        model=blr.model(),
        method="exact",
    )


def _mlp(inputs: int, out: int, hidden: int = 32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out))


# ------------------------------------------------------------------ regression
def test_gaussian_student_matches_the_bma_of_bayesian_linear_regression():
    blr = make_blr(n=20, d=1, noise=NOISE, seed=0)
    teacher = _exact_teacher(blr)
    torch.manual_seed(0)
    given = _Quadratic(1)
    before = {k: v.clone() for k, v in given.state_dict().items()}
    student = bp.distill(teacher, given, blr.x, num_steps=500, lr=0.05, progress=False)
    assert student is not given and all(torch.equal(v, given.state_dict()[k]) for k, v in before.items())
    assert not student.training
    with torch.no_grad():
        mu, log_var = student(blr.x).double().unbind(-1)

    bma = teacher.predict(blr.x)  # the teacher's own moments: optimizer tolerance only
    assert ((mu - bma.mean) / bma.std).abs().max() < 1e-3
    assert (log_var - bma.std.double().pow(2).log()).abs().max() < 1e-3

    x1 = blr.design
    mean, epistemic = x1 @ blr.mean, ((x1 @ blr.cov) * x1).sum(1)  # closed form: Monte Carlo error too
    var = NOISE**2 + epistemic
    mean_tol = 4 * (epistemic / S).sqrt() + 1e-3 * var.sqrt()
    var_tol = 4 * math.sqrt(2 / S) * epistemic + 1.001e-3 * var
    assert ((mu - mean).abs() < mean_tol).all(), ((mu - mean) / mean_tol).abs().max()
    assert ((log_var.exp() - var).abs() < var_tol).all(), ((log_var.exp() - var) / var_tol).abs().max()


def test_student_of_a_pyro_function_model(function_post, linear_data):
    x, _ = linear_data
    torch.manual_seed(0)
    student = bp.distill(function_post, _Quadratic(1), x, progress=False)  # the defaults (2,000 steps)
    bma = function_post.predict(x)
    with torch.no_grad():
        mu, log_var = student(x).unbind(-1)
    assert ((mu - bma.mean) / bma.std).abs().max() < 1e-2  # exactly representable, as above (20 draws only)
    assert (log_var - bma.std.pow(2).log()).abs().max() < 1e-2


def test_gaussian_kl_is_zero_at_the_teacher_and_positive_elsewhere():
    mean, var = torch.tensor([[0.5, -1.0]]), torch.tensor([[0.2, 3.0]])
    at = torch.cat([mean, var.log()], -1)
    assert _gaussian_kl(at, mean, var).abs() < 1e-7
    # KL(N(0, 1) || N(1, e)) = 1/2 (1 - 0 + (1 + 1) / e - 1) = 1 / e, averaged with 0 for the second target
    off = torch.tensor([[1.0, -1.0, 1.0, math.log(3.0)]])
    torch.testing.assert_close(
        _gaussian_kl(off, torch.tensor([[0.0, -1.0]]), torch.tensor([[1.0, 3.0]])), torch.tensor(0.5 / math.e)
    )


# ------------------------------------------------------------------ classification
def test_classification_student_matches_the_bma_probabilities(classifier_post):
    x = classifier_post.x
    torch.manual_seed(0)
    student = bp.distill(classifier_post, _mlp(2, 3), x, num_steps=500, lr=0.02, progress=False)
    with torch.no_grad():
        probs = torch.softmax(student(x), -1)
    assert (probs - classifier_post.predict(x).probs).abs().max() < 0.02


def test_jittered_inputs_teach_the_student_near_the_data(classifier_post):
    """Inputs 0.3 away from the training points: a student trained on 3 jittered copies as well
    matches the teacher there better (mean KL measured 3.2e-5 vs 4.0e-5)."""
    x = classifier_post.x
    near = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    p = classifier_post.predict(near).probs
    kl = {}
    for copies in (0, 3):
        torch.manual_seed(0)
        extra = dict(jitter=0.3, num_jitter=copies) if copies else {}
        student = bp.distill(classifier_post, _mlp(2, 3), x, num_steps=500, lr=0.02, seed=1, progress=False, **extra)
        with torch.no_grad():
            q = torch.softmax(student(near), -1)
        kl[copies] = (p * (p.log() - q.log())).sum(-1).mean().item()
    assert kl[3] < kl[0], kl


def test_binary_student_with_one_logit():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 2, generator=g)
    model = bp.BNN(torch.nn.Linear(2, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Bernoulli())
    draws = 200
    w = torch.tensor([2.0, -1.0]) + torch.randn(draws, 2, generator=g)
    teacher = bp.Posterior(
        samples={"weight": w.reshape(1, draws, 1, 2), "bias": torch.randn(1, draws, 1, generator=g)},
        model=model,
        method="hand",
    )
    torch.manual_seed(0)
    student = bp.distill(teacher, _mlp(2, 1), x, num_steps=500, lr=0.02, progress=False)
    with torch.no_grad():
        p1 = torch.sigmoid(student(x))[:, 0]
    assert (p1 - teacher.predict(x).probs[:, 1]).abs().max() < 0.02


# ------------------------------------------------------------------ errors
def test_bad_arguments(classifier_post):
    blr = make_blr(n=10, d=1)
    teacher = _exact_teacher(blr, draws=10)
    with pytest.raises(ValueError, match=r"2 \* D = 2 for the teacher's D = 1 target"):
        bp.distill(teacher, torch.nn.Linear(1, 1), blr.x, progress=False)
    with pytest.raises(ValueError, match="teacher predicts 3 classes: the student needs 3 logits"):
        bp.distill(classifier_post, torch.nn.Linear(2, 2), classifier_post.x, progress=False)
    with pytest.raises(ValueError, match="student_net cannot take x of shape"):
        bp.distill(teacher, torch.nn.Linear(3, 2), blr.x, progress=False)
    with pytest.raises(TypeError, match="posterior: expected a bnn_pyro.Posterior"):
        bp.distill({"weight": torch.zeros(1)}, torch.nn.Linear(1, 2), blr.x, progress=False)
    with pytest.raises(TypeError, match="student_net: expected a torch.nn.Module"):
        bp.distill(teacher, lambda x: x, blr.x, progress=False)
    with pytest.raises(ValueError, match="give both"):
        bp.distill(teacher, torch.nn.Linear(1, 2), blr.x, jitter=0.1, progress=False)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        bp.distill(teacher, torch.nn.Linear(1, 2), blr.x, num_steps=0, progress=False)
