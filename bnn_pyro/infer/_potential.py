"""The potential energy of any model on minibatches, for engines that move the weights themselves.

SG-MCMC, SWA/SWAG, ensembles and Laplace need ``U(w) = -log p(w) - (N/B) sum_{i in B} log p(y_i | x_i, w)``
as a differentiable function of the latent sites. This is Pyro's own potential energy
(:func:`pyro.infer.mcmc.util.initialize_model`: the model conditioned on the values, traced, its
log-density summed, plus the log-Jacobians of the maps to unconstrained space), built once and
pointed at a new minibatch per call. It serves a :class:`~bnn_pyro.BNN` and a Pyro function alike.

Example
-------
>>> pot = Potential(model, data, init="net")
>>> z = {k: v.clone().requires_grad_() for k, v in pot.init.items()}   # unconstrained values
>>> u = pot(z, data.first())          # -log joint of that batch, likelihood scaled by N / B
>>> u.backward()
>>> draws = pot.constrain(z)           # values on each site's support (e.g. positive noise scales)
"""

from __future__ import annotations

import math

import torch
from pyro.infer.mcmc.util import initialize_model

from bnn_pyro.infer._common import Data, init_strategy, quiet_model

__all__ = ["Potential"]


class Potential:
    """``U(z; batch)``: the negative log joint density in unconstrained coordinates ``z``.

    Parameters
    ----------
    model:
        A ``BNN`` or a Pyro function model following the site conventions.
    data:
        The fit's :class:`~bnn_pyro.infer._common.Data`; ``dataset_size`` scales minibatch likelihoods.
    init:
        Initial values (see :func:`~bnn_pyro.infer._common.init_strategy`); ``"net"`` starts from a
        BNN's current weights.

    Attributes
    ----------
    init:
        Initial unconstrained values, one tensor per latent site.
    transforms:
        Site name -> the bijection from constrained to unconstrained space.
    shapes:
        Site name -> shape, in a fixed order (that of :meth:`flatten`).
    """

    def __init__(self, model, data: Data, *, init="net"):
        self._batch = data.first()
        run = quiet_model(model, data.size)

        def bound():
            return run(*self._batch)

        self.init, self._fn, self.transforms, _ = initialize_model(
            bound, model_args=(), init_strategy=init_strategy(model, init))
        self.init = {k: v.detach() for k, v in self.init.items()}
        self.shapes = {k: v.shape for k, v in self.init.items()}

    def __call__(self, z: dict[str, torch.Tensor], batch: tuple | None = None) -> torch.Tensor:
        """``U(z)`` on ``batch`` (``(x, y)``), or on the last batch given."""
        if batch is not None:
            self._batch = batch
        return self._fn(z)

    def constrain(self, z: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Map unconstrained values (with any leading batch dims) to each site's support."""
        return {k: self.transforms[k].inv(v) if k in self.transforms else v for k, v in z.items()}

    def unconstrain(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.transforms[k](v) if k in self.transforms else v for k, v in values.items()}

    # ------------------------------------------------------------------ flat vectors
    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def flatten(self, z: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate the sites (in :attr:`shapes` order) into ``(..., dim)``; leading dims kept."""
        parts = []
        for k, shape in self.shapes.items():
            v = z[k]
            parts.append(v.reshape(v.shape[: v.dim() - len(shape)] + (-1,)))
        return torch.cat(parts, dim=-1)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`flatten` for ``flat`` shaped ``(..., dim)``."""
        out, i = {}, 0
        lead = flat.shape[:-1]
        for k, shape in self.shapes.items():
            n = math.prod(shape)
            out[k] = flat[..., i : i + n].reshape(lead + shape)
            i += n
        return out

    def flat_fn(self, batch: tuple | None = None):
        """``U`` as a function of one flat vector (for Hessians and flat-space samplers)."""
        if batch is not None:
            self._batch = batch
        return lambda flat: self._fn(self.unflatten(flat))
