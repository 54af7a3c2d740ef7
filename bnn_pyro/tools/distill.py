r"""Distillation of a posterior's predictive into one deterministic network: ``bp.distill(post, student, x)``.

A Bayesian model average ``p(y | x, D) = E_{w ~ post} p(y | x, w)`` costs one network evaluation per
posterior draw; a *student* network trained to reproduce it costs one. The student is trained on the
inputs ``x`` (plus, optionally, ``num_jitter`` noisy copies ``x + jitter * eps`` that teach it the
predictive near the data) to minimize the KL divergence from the teacher's predictive:

- **Classification** (Hinton, Vinyals & Dean 2015, "Distilling the knowledge in a neural network";
  Balan, Rathod, Murphy & Welling 2015, "Bayesian dark knowledge"): the student outputs ``K``
  logits (or one logit, the class-1 log-odds, for two classes), and minimizes
  ``KL(p_BMA || softmax(student(x))) = sum_k p_k (log p_k - log q_k)``, averaged over inputs.
- **Regression** (the Gaussian student of Bayesian dark knowledge; Malinin, Mlodozeniec & Gales
  2020, "Ensemble distribution distillation", for richer students): the student outputs ``2 D``
  columns, the means ``mu`` then the log-variances ``s`` of ``D`` targets, and minimizes the
  expected Gaussian negative log-likelihood of the teacher's predictive, which up to a constant is
  ``KL(p_BMA || N(mu, e^s)) = 1/2 (s - log v + (v + (m - mu)^2) / e^s - 1)`` per target, with
  ``m``, ``v`` the BMA's predictive mean and variance (epistemic plus aleatoric). The BMA is a
  mixture; the Gaussian closest to it in this KL is the one with its moments, so the moments are
  all the student needs (no sampling noise is added by drawing ``y``).

At its optimum the student equals the teacher wherever it can represent it; the history of the loss
(the mean KL, 0 at a perfect match) shows how close it got.

Example
-------
>>> student = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 2))
>>> student = bp.distill(post, student, x_train, num_steps=3000, num_jitter=4, jitter=0.1)
>>> mean, log_var = student(x_test).chunk(2, dim=-1)         # regression: D means, D log-variances
>>> probs = torch.softmax(student(x_test), -1)               # classification
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from bnn_pyro.posterior import Posterior
from bnn_pyro.predictions import ClassificationPrediction
from bnn_pyro.utils.checks import check_data, match_columns, positive, positive_int

__all__ = ["distill"]


def distill(
    posterior: Posterior,
    student_net: nn.Module,
    x,
    *,
    num_steps: int = 2000,
    lr: float = 1e-2,
    optimizer="adam",
    lr_schedule="cosine",
    batch_size: int | None = None,
    jitter: float = 0.0,
    num_jitter: int = 0,
    num_samples: int | None = None,
    num_threads: int | None = 1,
    seed: int = 0,
    progress: bool = True,
) -> nn.Module:
    """Train a copy of ``student_net`` to reproduce ``posterior``'s predictive at ``x`` (see the module docstring).

    Parameters
    ----------
    posterior:
        The teacher: any engine's :class:`~bnn_pyro.Posterior` (its ``predict`` gives the BMA).
    student_net:
        A ``torch.nn.Module`` mapping ``x`` to ``(N, width)``: ``width = 2 D`` for ``D`` regression
        targets (means, then log-variances); ``K`` logits for ``K`` classes, or 1 logit for 2 classes.
        It is copied; the argument is left untouched.
    x:
        Inputs where the student learns the teacher's predictive (usually the training inputs).
    num_steps, lr, optimizer, lr_schedule, batch_size:
        The student's optimizer, as in :func:`bnn_pyro.infer.svi.fit` (default: Adam with a cosine
        decay to 1% of ``lr``); minibatches of ``batch_size`` rows (all rows by default).
    jitter, num_jitter:
        Add ``num_jitter`` copies of ``x`` with Gaussian noise of standard deviation ``jitter`` (in
        input units) to the training inputs.
    num_samples:
        Posterior draws used for the teacher's predictive (all by default).
    num_threads:
        Torch intra-op threads while training (one, the default, is fastest for small students;
        ``None`` keeps torch's setting); see :func:`bnn_pyro.infer.ensemble.fit_ensemble`.
    seed, progress:
        Seed of the jitter, the draws and the minibatches; a progress bar (``progress=False`` hides it).

    Returns
    -------
    torch.nn.Module
        The trained student, in eval mode.
    """
    if not isinstance(posterior, Posterior):
        raise TypeError(
            f"posterior: expected a bnn_pyro.Posterior (the result of bp.fit), got {type(posterior).__name__}."
        )
    if not isinstance(student_net, nn.Module):
        raise TypeError(f"student_net: expected a torch.nn.Module, got {type(student_net).__name__}.")
    num_steps = positive_int("num_steps", num_steps)
    lr = positive("lr", lr)
    num_jitter = positive_int("num_jitter", num_jitter, allow_zero=True)
    jitter = float(jitter)
    if not (math.isfinite(jitter) and jitter >= 0.0) or (num_jitter > 0) != (jitter > 0.0):
        raise ValueError(
            f"jitter={jitter!r}, num_jitter={num_jitter!r}: give both (a positive noise standard "
            "deviation and a number of noisy copies of x, e.g. jitter=0.1, num_jitter=4) or neither."
        )
    x, _ = check_data(match_columns(x, posterior.feature_names), None)  # a DataFrame's columns by name
    generator = torch.Generator().manual_seed(seed)
    if num_jitter:
        noisy = x.unsqueeze(0) + jitter * torch.randn((num_jitter,) + x.shape, generator=generator, dtype=x.dtype)
        x = torch.cat([x, noisy.reshape((-1,) + x.shape[1:])])
    batch_size = x.shape[0] if batch_size is None else positive_int("batch_size", batch_size)
    num_threads = None if num_threads is None else positive_int("num_threads", num_threads)

    from bnn_pyro.infer.shared import torch_threads

    target, loss_fn = _task(posterior.predict(x, num_samples=num_samples, seed=seed), _width(student_net, x))
    with torch_threads(num_threads):
        return _train(
            copy.deepcopy(student_net),
            x,
            target,
            loss_fn,
            num_steps,
            lr,
            optimizer,
            lr_schedule,
            batch_size,
            seed,
            progress,
        )


def _train(student, x, target, loss_fn, num_steps, lr, optimizer, lr_schedule, batch_size, seed, progress):
    """Minimize ``loss_fn(student(x_b), *targets_b)`` over reshuffled minibatches (the driver's
    :func:`~bnn_pyro.infer.driver.descend`); the student in eval mode."""
    from bnn_pyro.infer.driver import descend
    from bnn_pyro.infer.shared import Data

    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("student_net has no trainable parameters; give it layers with requires_grad=True.")

    def objective(batch, step):  # a batch of row indices
        rows = batch[0]
        loss = loss_fn(student(x[rows]), *(t[rows] for t in target))
        return loss, loss.item()

    rows = Data(x=torch.arange(x.shape[0], device=x.device), y=None, batch_size=batch_size)
    descend(
        objective,
        params,
        rows,
        num_steps=num_steps,
        lr=lr,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        seed=seed,
        method="distill",
        desc="distill",
        progress=progress,
        hint=" or standardized inputs",
    )
    return student.eval()


def _width(student: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        was = student.training
        student.eval()
        try:
            out = student(x[:2])
        except RuntimeError as err:
            raise ValueError(
                f"student_net cannot take x of shape {tuple(x.shape)} (the error it raised is chained "
                "below); check that its first layer takes x's features."
            ) from err
        finally:
            student.train(was)
    if out.dim() != 2:
        raise ValueError(f"student_net must map x to (N, width) outputs; it returned shape {tuple(out.shape)}.")
    return out.shape[1]


def _task(teacher, width: int):
    """The teacher's targets (tuple of ``(N, ...)`` tensors) and the loss ``(student_out, *targets) -> KL``."""
    if isinstance(teacher, ClassificationPrediction):
        k = teacher.probs.shape[-1]
        if width not in (k, 1) or (width == 1 and k != 2):
            ones = " (or 1 logit for the class-1 log-odds)" if k == 2 else ""
            raise ValueError(
                f"student_net outputs {width} column(s), but the teacher predicts {k} classes: the "
                f"student needs {k} logits{ones}. Change its last layer."
            )
        return (teacher.probs,), _classification_kl
    mean = teacher.mean.reshape(teacher.mean.shape[0], -1)
    var = teacher.std.reshape(mean.shape) ** 2
    d = mean.shape[1]
    if width != 2 * d:
        raise ValueError(
            f"student_net outputs {width} column(s), but a regression student needs 2 * D = {2 * d} "
            f"for the teacher's D = {d} target(s): D means, then D log-variances. Make its last layer "
            f"output {2 * d}."
        )
    return (mean, var), _gaussian_kl


def _classification_kl(out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``KL(probs || softmax(out))`` averaged over rows; one output column is the class-1 logit."""
    if out.shape[-1] == 1:
        out = torch.cat([torch.zeros_like(out), out], -1)
    log_q = torch.log_softmax(out, -1)
    log_p = probs.clamp_min(torch.finfo(probs.dtype).tiny).log()
    return (probs * (log_p - log_q)).sum(-1).mean()


def _gaussian_kl(out: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``KL(N(mean, var) || N(mu, e^s))`` averaged over rows and targets, ``out = [mu, s]``."""
    mu, s = out.chunk(2, dim=-1)
    return 0.5 * (s - var.log() + (var + (mean - mu) ** 2) * torch.exp(-s) - 1.0).mean()
