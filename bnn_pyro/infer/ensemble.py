r"""Deep ensembles: ``bp.fit(model, x, y, method="ensemble", ...)``.

Lakshminarayanan, B., Pritzel, A. & Blundell, C. (2017). Simple and scalable predictive uncertainty
estimation using deep ensembles. NeurIPS.

Each of ``num_members`` members ``k`` is a MAP fit of the model from its own random start (seed
``seed + k``: initial weights and minibatch order). Adam minimizes, on minibatches ``B`` of ``N``,

.. math::

    U_c(w) = -\log p(w) - \frac{N}{B} \sum_{i \in B} \log p(y_i \mid x_i, w)
           = U(z) + \log\left|\det \frac{\partial w}{\partial z}\right|,

the negative log joint over the latent sites ``w`` *in their own (constrained) coordinates*: the
shared :class:`~bnn_pyro.infer._potential.Potential` ``U(z)`` of the unconstrained ``z`` with the
log-Jacobian that ``U`` subtracts added back, so that a learned noise scale ``sigma`` goes to the
mode of ``p(sigma | ...)`` (as SVI's ``guide="map"``), not of ``p(log sigma | ...)``; for weights
(real-valued) the two agree. With a ``Normal`` prior the ``-log p(w)`` term is weight decay; the
likelihood term is the paper's proper scoring rule: Gaussian negative log-likelihood (a learned
``sigma`` site, or a ``HeteroscedasticGaussian`` net that outputs mean and scale: both are fitted
per member) or the cross-entropy for classification. Deterministic parameters (those that
``bayesian=...`` leaves out) are fitted per member too.

Initial values (``init=``, shared with every engine: :mod:`bnn_pyro.infer._init`): ``"reset"`` (a
``BNN``'s default) gives every parameter a fresh draw from its layer's own initializer
(``reset_parameters()`` under the member's seed), as in the paper; ``"prior"`` (a Pyro function's
default) draws the latent sites from their priors. Hyper and noise sites start at their prior
medians under ``"reset"``. The other choices (``"net"``, ``"median"``, a dict, a ``Posterior``) start
every member at the same point, so that only the minibatch order tells members apart.

The posterior is the equal-weight mixture of the members, ``p(w | D) ~ (1/K) sum_k delta(w - w_k)``,
stored as ``K`` chains of one draw each (so per-member deterministic values pair with their draw).
Its predictive (``post.predict``) is the paper's mixture: mean ``(1/K) sum_k mu_k(x)``, variance
``(1/K) sum_k (sigma_k^2(x) + mu_k^2(x)) - mean^2`` (aleatoric ``E_k sigma_k^2`` plus epistemic
``Var_k mu_k``); classification averages the members' probabilities. ``predict(x)`` uses each member
once; for interval bounds ask for more predictive draws, e.g. ``predict(x, num_samples=2000, seed=0)``
(members are picked with replacement, each draw with its own observation noise). With one draw per
chain, R-hat and ESS are undefined (NaN in ``summary``, and ArviZ warns "More chains than draws"):
members are modes, not a Markov chain.

Adversarial training (section 2.3 of the paper; ``adversarial_eps > 0``): each step also evaluates
the fast-gradient-sign input ``x' = x + eps * sign(grad_x U)`` (Goodfellow et al. 2015) and
minimizes ``(U(x) + U(x')) / 2`` (the prior counted once). The paper uses ``eps`` = 1% of each
input's range; ``eps`` here is in input units (e.g. ``0.04`` for standardized inputs).

Example
-------
>>> post = bp.fit(model, x, y, method="ensemble", num_members=5, num_steps=2000, lr=1e-2, seed=0)
>>> post.samples["0.weight"].shape        # (5, 1, 50, 1): member, draw, *shape
>>> pred = post.predict(x_test)            # mixture mean, std = sqrt(aleatoric + epistemic)
>>> post.history["loss"]                   # (members, steps): U_c on each step's minibatch
"""

from __future__ import annotations

import copy
import math

import pyro
import torch
from pyro import poutine

from bnn_pyro._checks import positive, positive_int
from bnn_pyro.infer._common import Data, clean_config, point_values, progress_bar
from bnn_pyro.infer._init import Init, chain_start, resolve_init
from bnn_pyro.infer._init import reset_values as _reset_values  # noqa: F401 - its former home (tests import it)
from bnn_pyro.infer._potential import Potential
from bnn_pyro.infer.holdout import DEFAULT, BestOnHoldout, Holdout, describe, heldout_score, select_noise, split
from bnn_pyro.infer.svi import make_optimizer, make_schedule
from bnn_pyro.posterior import Posterior

__all__ = ["fit_ensemble", "EnsembleInit"]


EnsembleInit = Init  # the shared choices; the name is kept for backward compatibility


def fit_ensemble(
    model,
    data: Data,
    *,
    num_members: int = 5,
    num_steps: int = 1000,
    lr: float = 1e-2,
    optimizer="adam",
    lr_schedule="constant",
    init=None,
    adversarial_eps: float = 0.0,
    validation="default",
    seed: int = 0,
    progress: bool = True,
) -> Posterior:
    """Fit a deep ensemble: ``num_members`` MAP fits from different random starts (see the module docstring).

    Parameters
    ----------
    num_members:
        Number of members ``K`` (the paper uses 5); each becomes one chain of one draw.
    num_steps, lr, optimizer, lr_schedule:
        Optimizer steps per member and the optimizer, as in :func:`bnn_pyro.infer.svi.fit`
        (``"adam"``/``"adamw"``/``"sgd"`` or a callable; ``"constant"``/``"cosine"``/``"exponential"``
        or a callable). Minibatches come from ``bp.fit(..., batch_size=...)``.
    init:
        ``"reset"`` (re-run the layers' initializers; default for a ``BNN``) or ``"prior"`` (a prior
        draw; default for a Pyro function model), or one start for every member (``"net"``,
        ``"median"``, a dict of site values, a ``Posterior``). A ``BNN``'s deterministic parameters
        restart from their initializers except under ``"net"`` and a ``Posterior``.
    adversarial_eps:
        Size of the fast-gradient-sign input perturbation (0, the default, turns it off).
    validation:
        Held-out rows (:mod:`bnn_pyro.infer.holdout`): by default 10% of the training rows (when that is at
        least 20 rows and the data are tensors), the same rows for every member. Each member keeps its state
        with the best held-out likelihood (scored every ``num_steps // 50`` steps: early stopping), and a
        learned Gaussian noise is then set to the value that maximizes the held-out log predictive density
        of the ensemble's mixture. A fraction, an ``(x_val, y_val)`` pair, or ``None`` (all rows trained on,
        the members' own noise estimates kept: overconfident on small data).
    seed, progress:
        Member ``k`` uses seed ``seed + k``; ``progress=False`` turns the progress bar off.

    Returns
    -------
    Posterior
        ``samples`` shaped ``(num_members, 1, *shape)``, ``point`` ``(num_members, *shape)``,
        ``history["loss"]`` ``(num_members, num_steps)``, ``sample_stats["lp"]`` ``(num_members, 1)``:
        each member's log joint ``-U_c`` at its mode (on the full data; on the first batch, scaled to
        the data set, for a loader).
    """
    num_members = positive_int("num_members", num_members)
    num_steps = positive_int("num_steps", num_steps)
    lr = positive("lr", lr)
    init = resolve_init(model, init, data)
    try:
        eps = float(adversarial_eps)
    except (TypeError, ValueError):
        raise TypeError(f"adversarial_eps must be a number, got {adversarial_eps!r}.") from None
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"adversarial_eps must be a non-negative finite number, got {adversarial_eps!r}; "
                         "0 turns adversarial training off, the paper uses 1% of each input's range.")
    train, holdout, why = split(data, validation, seed=seed, method="ensemble", convert=data.convert)
    config = clean_config(dict(
        num_members=num_members, num_steps=num_steps, lr=lr, optimizer=getattr(optimizer, "value", optimizer),
        lr_schedule=getattr(lr_schedule, "value", lr_schedule),
        init=init if isinstance(init, str) else type(init).__name__, adversarial_eps=eps,
        batch_size=data.batch_size, dataset_size=data.size, seed=seed,
        validation=describe(holdout, validation if validation != "default" else DEFAULT, why),
    ))
    members = [_fit_member(model, train, init, num_steps, lr, optimizer, lr_schedule, eps, seed + k, progress,
                           f"ensemble member {k}", holdout) for k in range(num_members)]
    stack = lambda key: {n: torch.stack([m[key][n] for m in members]) for n in members[0][key]}  # noqa: E731
    samples = {n: v.unsqueeze(1) for n, v in stack("sample").items()}
    history = {"loss": torch.stack([m["loss"] for m in members])}
    if holdout is not None:
        history["best_step"] = torch.tensor([[m["best_step"]] for m in members])
    post = Posterior(samples=samples, model=members[-1]["model"], method="ensemble", config=config,
                     point=stack("point"), sample_stats={"lp": torch.stack([m["lp"] for m in members]).unsqueeze(1)},
                     history=history, x=data.x, y=data.y)
    return select_noise(post, holdout)


def _fit_member(model, data: Data, init, num_steps, lr, optimizer, lr_schedule, eps, seed, progress, desc,
                holdout: Holdout | None) -> dict:
    """One MAP fit from a fresh random start; returns its site values, point values, loss trace and lp."""
    fitted = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    with pyro.get_param_store().scope():
        pyro.set_rng_seed(seed)
        pot = Potential(fitted, data, init=chain_start(fitted, init, seed))
        z = {k: v.clone().requires_grad_() for k, v in pot.init.items()}
        with poutine.trace(param_only=True) as capture:
            _energy(pot, z, data.first())
        params = list(z.values()) + [site["value"].unconstrained() for site in capture.trace.nodes.values()]
        opt = make_optimizer(optimizer, params, lr)
        sched = make_schedule(lr_schedule, opt, num_steps)
        batches = data.batches(torch.Generator().manual_seed(seed))
        losses = torch.empty(num_steps)
        best = BestOnHoldout(every=max(1, num_steps // 50), patience=None)
        with progress_bar(num_steps, desc, progress) as bar:
            for step in range(num_steps):
                batch = next(batches)
                opt.zero_grad(set_to_none=True)
                loss = _adversarial_loss(pot, z, batch, eps) if eps > 0 else _energy(pot, z, batch)
                value = loss.item()
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"ensemble: the loss became {value} at step {step} (of {num_steps}) of {desc}. Try a lower "
                        f"learning rate (lr={lr} now), standardized inputs and targets, or check the batch for "
                        "NaN/Inf values."
                    )
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                losses[step] = value
                if holdout is not None and (best.due(step) or step == num_steps - 1):
                    with torch.no_grad():
                        best.record(step, heldout_score(fitted, pot.constrain(z), holdout), [p.detach() for p in params])
                if step % 50 == 0 or step == num_steps - 1:
                    bar.set_postfix(loss=f"{value:.4g}", refresh=False)
                bar.update()
        if holdout is not None:
            with torch.no_grad():
                for p, kept in zip(params, best.state):
                    p.copy_(kept)
        with torch.no_grad():
            lp = -_energy(pot, z, data.first()).detach()
            sample = {k: v.detach().clone() for k, v in pot.constrain(z).items()}
            x0, y0 = data.first()
            point = point_values(fitted, x0, y0, data.size)
    return dict(model=fitted, sample=sample, point=point, loss=losses, lp=lp,
                best_step=best.best_step if holdout is not None else num_steps - 1)


def _energy(pot: Potential, z: dict[str, torch.Tensor], batch) -> torch.Tensor:
    """``U_c = U(z) + log|det dw/dz|``: ``-log p`` in ``w``'s own coordinates (its mode is the constrained MAP)."""
    u = pot(z, batch)
    for name, t in pot.transforms.items():
        w = t.inv(z[name])
        if w is not z[name]:  # identity maps (real-valued sites, e.g. weights) return their input and add nothing
            u = u + t.inv.log_abs_det_jacobian(z[name], w).sum()
    return u


def _adversarial_loss(pot: Potential, z, batch, eps: float) -> torch.Tensor:
    """``(U_c(x) + U_c(x')) / 2`` with the fast-gradient-sign input ``x' = x + eps * sign(grad_x U_c)``."""
    x, y = batch
    if not x.dtype.is_floating_point:
        raise TypeError(f"adversarial_eps > 0 perturbs the inputs, which must be floating point; got {x.dtype}. "
                        "Use adversarial_eps=0 for integer (e.g. token) inputs.")
    x = x.detach().requires_grad_()
    clean = _energy(pot, z, (x, y))
    (grad,) = torch.autograd.grad(clean, x, retain_graph=True)
    return 0.5 * (clean + _energy(pot, z, ((x + eps * grad.sign()).detach(), y)))
