"""Laplace approximation: ``bp.fit(model, x, y, method="laplace", ...)``.

A Gaussian at the posterior mode whose precision is the curvature there (MacKay 1992):

1. **MAP.** ``z* = argmin U(z)``, ``U(z) = -log p(z) - sum_i log p(y_i | x_i, z)``: Pyro's potential
   energy in the unconstrained coordinates ``z`` of every latent site, log-Jacobians included
   (:class:`~bnn_pyro.infer._potential.Potential`), by the shared MAP search
   (:func:`bnn_pyro.infer.map_fit.minimize`): Adam with a cosine decay of the learning rate (on
   minibatches when ``batch_size`` is set), then, when no rows are held out, an L-BFGS polish on the full
   data. Deterministic (non-Bayesian) parameters are optimized along, then kept fixed. With held-out rows
   (``validation=``, below) the search keeps its best state on them (early stopping) and is not polished.
   ``checkpoint=FOLDER`` saves the search every ``checkpoint_every`` steps; after a crash, in the search or in
   what follows it, ``resume=True`` gives the uninterrupted run's result bit for bit (:mod:`bnn_pyro.infer.checkpoint`).
2. **Curvature.** ``H = H_prior + H_lik`` at ``z*``; ``H_prior`` is the exact Hessian of ``-log p(z)``
   (in closed form for factorized Normal priors, :mod:`.factorized`; otherwise by autograd), ``H_lik`` by
   ``hessian=``:

   - ``"ggn"`` (generalized Gauss-Newton; Martens 2014; Immer et al. 2021), for a ``BNN``:
     ``sum_i J_i^T Lambda_i J_i``, ``J_i = d f(x_i) / d w`` the Jacobian of the network output and
     ``Lambda_i`` the Hessian of ``-log p(y_i | f)`` in ``f``: ``I / sigma^2`` (Gaussian),
     ``diag(p) - p p^T`` (Categorical), ``p (1 - p)`` (Bernoulli); any other likelihood's by autograd,
     clipped to be positive semi-definite. A likelihood's noise site (a learned ``sigma``) gets the exact
     Hessian of ``-log p(y | f*, sigma)`` in its coordinate and no cross terms with the weights (their
     expectation is zero for a Gaussian). Hyper sites of a hierarchical prior enter through ``H_prior``.
   - ``"fisher"``: the empirical Fisher ``sum_i g_i g_i^T``, ``g_i = grad_z log p(y_i | x_i, z)``, over
     every covered coordinate. It equals the Hessian only in expectation over the data (Kunstner et al. 2019).
   - ``"exact"`` (the default for a Pyro function model, which has no separate network output for a GGN): the
     Hessian of ``-log p(y | z)`` itself, by autograd (:mod:`.exact`; any structure but ``"kron"``), the Laplace
     approximation proper. The empirical Fisher, that default before, put the sd of eight schools' ``tau`` at 23
     times the exact posterior's (8 rows: the Fisher's sum is far from its expectation).

   **A Pyro function model** starts its MAP search at the prior median (``init="median"``, as Pyro's and NumPyro's
   autoguides do; a draw of a wide prior can start it too far away to come back) and ends it, after the L-BFGS polish,
   with up to 5 Newton steps on ``U`` (``hessian="exact"``, ``structure="full"``, nothing held out; at most 2,000
   coordinates): L-BFGS in float32 stops short of the mode of a badly conditioned posterior (kidiq: 2.4 sds), Newton's
   step does not depend on the coordinates' scales. The Gaussian sits at the joint mode of the unconstrained
   coordinates, which need not be where the posterior's mass is: for the non-centered eight schools that mode has
   ``tau`` ~29 where the posterior mean is 3.6. Every such fit checks its draws against the model by Pareto-smoothed
   importance sampling and warns when ``k_hat > 0.7`` (:func:`~bnn_pyro.infer.health_spread.check_gaussian`, naming the
   coordinate the weights move most): use ``method="nuts"`` there (``docs/reference_suite.md``). Where the exact
   Hessian at the end of the search is not positive definite (a network written as a Pyro function, the zoo's
   ``explicit_mlp``: no strict mode reached) the fit stops with an error naming ``hessian="fisher"`` (positive
   semi-definite by construction; that fit is then judged by the same check) and ``method="nuts"``.

3. **Posterior.** ``q(z) = N(m, H^-1)`` with ``m = z* - H^-1 grad U(z*)``, the mode of the quadratic
   model of ``U`` at ``z*`` (used when within one posterior sd of ``z*``: it removes the optimizer's
   float32 noise, since ``U`` resolves its minimum only to ~1e-3 sd). ``num_samples`` draws per chain,
   mapped to each site's support.

``structure=``: ``"last_layer"`` (the default for a ``BNN``; Kristiadi et al. 2020; Daxberger et al.
2021): the last ``nn.Linear`` layer with a dense ``H``, every other site fixed at the MAP (its draws
repeat it, so its summary rows have sd 0). ``"full"`` (the default for a Pyro function): every
coordinate, dense ``H``, at most ``MAX_FULL_DIM`` = 5,000. ``"diag"``: every coordinate, diagonal ``H``.
``"kron"`` (KFAC; Martens & Grosse 2015, Ritter et al. 2018; Conv2d by KFC, Grosse & Martens 2016): the weights
and biases of every ``nn.Linear`` and ``nn.Conv2d`` layer (other sites fixed at the MAP), ``H`` block-diagonal
over layers with each block ``G (x) A + delta I``: ``A`` from the layer's inputs (unfolded patches for a
convolution), ``G`` from the output gradients that one batched backward pass per network output delivers
(:mod:`.kfac`; no per-example Jacobians; ``hessian="fisher"`` gives the empirical-Fisher KFAC). It is the exact
GGN block for one datum, and for the output layer of a Gaussian regression (so a one-layer net gets its exact
posterior); elsewhere an approximation (tests/infer/test_laplace_kron.py states how close). Evidence, prior
precision (``delta`` per layer must be one number: ``Normal`` priors, ``"marglik"``/``"marglik_layerwise"``),
draws and the held-out noise use the eigendecompositions of the factors (:mod:`.kron`), so memory grows with the
layer widths squared, not the parameter count squared. Measured at defaults otherwise (docs/engines.md, "Laplace, KFAC"):
diabetes test LL -5.51 for both (3 splits of benchmarks/uci.py), gap data 0.81 against 0.83 for
``"last_layer"``, digits NLL 0.27 against 0.39 (benchmarks/laplace_structures.py): better on classification
only, so ``"last_layer"`` stays the default.
In-between uncertainty (the zoo's ``mlp_regression``: epistemic sd inside the gap over that on the data, GLM
predictive, defaults otherwise; NUTS 6.6x): last layer 3.28x, full 6.51x, diag 0.88x. A diagonal precision
keeps ``1 / H_ii`` per weight and drops the correlations that leave combinations of weights free in the gap
but pinned on the data (its sd on the data is 4x the full one's), the failure of factorized Gaussians
(Foong et al. 2019, "'In-between' uncertainty in Bayesian neural networks"); neither 3 restarts (0.86x) nor
``prior_precision="marglik"`` (1.00x, with the mean collapsed to a flat line) fixes it, so prefer
``"last_layer"`` or ``"full"`` when in-between uncertainty matters.
Layout of the package: :mod:`.structure` (which coordinates, dense or diagonal), the curvature
backends :mod:`.ggn`, :mod:`.fisher` and :mod:`.kfac` (with :mod:`.curvature` for the prior part and the
dispatch; per-example Jacobians of ``nn.Linear`` / ``nn.Conv2d`` layers from one batched backward pass per
output in :mod:`.layerwise`, ``vmap(jacrev)`` for any other net; benchmarks/laplace_speed.py times them against
laplace-torch), :mod:`.kron` (the Kronecker-factored precision), :mod:`.marglik` (evidence and prior precision),
:mod:`.noise` (noise on held-out rows), :mod:`.glm` (the linearized predictive), :mod:`.fit` (the factory).

**Predictive** (``predictive=``). ``"glm"``, the default for a ``BNN`` and every structure (Immer, Korzepa &
Bauer 2021; laplace-torch's ``pred_type="glm"``): draws ``w_s`` of the Gaussian enter the network linearized
at the mode, ``f(x, w*) + J(x)(w_s - w*)`` (:mod:`.glm`); for regression its predictive is
``N(f(x, w*), J Sigma J^T + sigma^2)``, for classification the MC GLM predictive. ``"nn"`` evaluates the
network itself at each draw. For a classifier, :func:`.glm.predictive_probs` gives the class probabilities of the
GLM predictive straight from the Gaussian in function space, ``N(f(x, w*), J H^-1 J^T)``, by MacKay's probit
approximation (``link="probit"``, no sampling) or by sampling those logits (``link="mc"``; the same law as the
posterior's linearized draws). ``predictive="nn"`` evaluates the
network itself at each draw: under ``"full"``/``"diag"`` that badly underfits small MLPs (Lawrence 2001;
Immer et al. 2021: the GGN posterior is wide along directions where the linearized net is flat but the net is
not; toy gap data: training RMSE 1.8 against 0.09 for ``"last_layer"``). The last layer is linear in its
weights, so there the two agree.

**Held-out rows** (``validation=``, default ``"default"``: 10% of tensor data, at least 20 rows, with at least 40 rows;
:mod:`bnn_pyro.infer.holdout`). The MAP of an over-parameterized net sets a learned noise to its training
residual, far below the test error (UCI Boston: train RMSE 0.67 against test 3.1; test LL -10.9 at the old
defaults). With held-out rows the MAP search stops early at its best held-out likelihood, and a learned
homoscedastic Gaussian noise is chosen to maximize the held-out log predictive density of the GLM predictive,
iterated with the weight covariance it implies (:mod:`.noise`); the noise site is then held at that value
(not covered by the Gaussian) and ``post.config["noise"]`` records it. ``validation=None`` restores the MAP
noise and the L-BFGS polish.

**Prior precision by marginal likelihood** (``prior_precision="marglik"`` or ``"marglik_layerwise"``;
MacKay 1992; Immer et al. 2021). The Normal priors of the covered weights become ``Normal(loc,
delta^-1/2)``, one ``delta`` (or one per layer: a ``BNN`` module, a function model's site), chosen to
maximize the Laplace evidence of the quadratic model of ``U_delta`` at ``z*`` (L-BFGS on ``log delta``)::

    log p(y | delta) ~ -U_delta(z*) + g^T H_delta^-1 g / 2 - log det H_delta / 2 + k log(2 pi) / 2

with ``g = grad U_delta(z*)`` and ``k`` covered coordinates; ``U_delta``, ``g`` and ``H_delta`` move
with ``delta`` in closed form. The MAP is then refit under the new prior and the curvature recomputed
(``marglik_rounds`` alternations; more than one iterates toward MacKay's fixed point). The posterior
belongs to the model with that prior, not to the prior the model was built with:
``post.config["prior_precision_fitted"]`` records ``delta``. ``prior_precision=<number>`` sets ``delta``
without a search. Only Normal priors qualify (not hierarchical ones). ``post.config["log_evidence"]``
is the estimate above at the end (the model's own prior for ``"model"``). A learned homoscedastic Gaussian
noise is searched along with ``delta`` (laplace-torch's ``sigma_noise``): it is held out of the covered
coordinates, the likelihood part moves with ``sigma`` in closed form (``rss / (2 sigma^2) + n log sigma``, GGN
``~ sigma^-2``; :class:`.marglik.NoiseTerms`), and the MAP refit keeps it fixed; with held-out rows the
held-out choice (:mod:`.noise`) then replaces it.

**Why these defaults** (measured; scikit-learn's diabetes, 3 random 90/10 splits, standardized, 10-50-1 ReLU
net, Normal(0, 1) prior, ``Gaussian(scale=HalfNormal(1))``, last layer; test log-likelihood per point in
original units): the former defaults (no held-out rows, the model's prior) -39.3; held-out rows (today's
default) -5.36; ``prior_precision="marglik"`` without held-out rows -40.3 (``delta`` alone, noise at the MAP:
-78.1); both -5.39. ``structure="full"``: held-out rows -5.35, ``"marglik"`` without held-out rows -5.79,
both -5.38. The evidence of the last layer cannot see that the features below it overfit (the noise it picks,
0.12-0.13 standardized units, is the training residual); that of the whole linearized net can (noise 1.22-1.26),
but it stays below held-out selection, so held-out rows are the default and the evidence an option (the one to
take on data too small to hold rows out: ``structure="full", prior_precision="marglik"``). With held-out rows,
and for a mis-scaled prior, ``"marglik"`` helps (a Normal(0, 0.05) prior on
Friedman #1 data: -1.36 to -0.91, tests/infer/test_laplace_glm.py).

**Classification** keeps the same defaults: over ``structure`` x ``prior_precision`` on iris, wine,
breast_cancer and digits (splits 0-1), no setting met issue 26's joint target (noise AUROC >= 0.8 with accuracy
and NLL within 0.03 of logistic regression) on more than 3 of the 8 splits (docs/ood.md, "Laplace's
classification settings"). At a MAP that fits every training row the GGN vanishes and the Gaussian is far wider than
the posterior on the data themselves (digits' last layer: test NLL 0.50 against 0.145 for NUTS on the same last
layer); a fit whose network is linear in the covered weights measures it (:mod:`.quadratic`:
``post.config["quadratic_excess"]``, the draws' training misfit against ``gamma / 2``) and warns.

On Bayesian linear regression (Gaussian likelihood with known noise, Normal prior) every step is
exact: ``U`` is quadratic and the GGN is its Hessian, so ``q`` is the posterior and the evidence
estimate is the evidence. The empirical Fisher is not: it is ``sum_i r_i^2 x_i x_i^T / sigma^4``
(residuals ``r_i`` at the MAP) where the Hessian is ``X^T X / sigma^2``; they agree in expectation over ``y``.

``num_chains`` independent restarts (seeds ``seed``, ``seed + 1``, ...) become chains; with the default
``init="reset"`` each starts from its own re-draw of the layers' initializers (:mod:`bnn_pyro.infer._init`);
with ``init="net"`` and full batches they start alike and find the same mode.

References
----------
MacKay, D. J. C. (1992). A practical Bayesian framework for backpropagation networks. Neural Computation.
Lawrence, N. D. (2001). Variational inference in probabilistic models. PhD thesis, University of Cambridge.
Martens, J. (2014). New insights and perspectives on the natural gradient method. arXiv:1412.1193.
Kunstner, F., Balles, L., Hennig, P. (2019). Limitations of the empirical Fisher approximation for natural gradient
descent. NeurIPS.
Yao, Y., Vehtari, A., Simpson, D., Gelman, A. (2018). Yes, but did it work?: Evaluating variational inference. ICML.
Ritter, H., Botev, A., Barber, D. (2018). A scalable Laplace approximation for neural networks. ICLR.
Kristiadi, A., Hein, M., Hennig, P. (2020). Being Bayesian, even just a bit, fixes overconfidence in ReLU
networks. ICML.
Immer, A., Korzepa, M., Bauer, M. (2021). Improving predictions of Bayesian neural nets via local linearization.
AISTATS.
Immer, A., Bauer, M., Fortuin, V., Raetsch, G., Khan, M. E. (2021). Scalable marginal likelihood estimation for
model selection in deep learning. ICML.
Martens, J., Grosse, R. (2015). Optimizing neural networks with Kronecker-factored approximate curvature. ICML.
Grosse, R., Martens, J. (2016). A Kronecker-factored approximate Fisher matrix for convolution layers. ICML.
Daxberger, E., Kristiadi, A., Immer, A., Eschenhagen, R., Bauer, M., Hennig, P. (2021). Laplace Redux: effortless
Bayesian deep learning. NeurIPS.

Example
-------
>>> post = bp.fit(model, x, y, method="laplace", seed=0)      # last layer, GGN, GLM predictive, held-out noise
>>> post = bp.fit(model, x, y, method="laplace", structure="diag", prior_precision="marglik")
>>> post = bp.fit(model, x, y, method="laplace", structure="kron", prior_precision="marglik_layerwise")
>>> post.config["prior_precision_fitted"], post.config["log_evidence"]
>>> approx = bp.infer.laplace.laplace_approximation(model, Data(x, y))   # the Gaussian itself
>>> probs = bp.infer.laplace.predictive_probs(approx, x_test, link="probit")   # a classifier's GLM predictive
"""

from bnn_pyro.infer.laplace.approximation import (
    MAX_FULL_DIM,
    Hessian,
    LaplaceApproximation,
    Link,
    Predictive,
    PriorPrecision,
    Structure,
)
from bnn_pyro.infer.laplace.fit import fit_laplace, laplace_approximation
from bnn_pyro.infer.laplace.glm import functional_moments, predictive_probs

__all__ = [
    "fit_laplace",
    "laplace_approximation",
    "LaplaceApproximation",
    "Structure",
    "Hessian",
    "PriorPrecision",
    "Predictive",
    "Link",
    "MAX_FULL_DIM",
    "functional_moments",
    "predictive_probs",
]
