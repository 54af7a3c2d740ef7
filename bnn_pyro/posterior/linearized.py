"""A Laplace posterior's linearized (GLM) network, evaluated from what the posterior stores.

For a draw ``w_s`` of the covered weights the output is that of the network linearized at the expansion point
``w*`` (Immer, Korzepa & Bauer 2021):

    f_lin(x, w_s) = f(x, w*) + J(x) (w_s - w*),      J(x) = d f(x, w) / d w at w*,

by Jacobian-vector products (:func:`torch.autograd.functional.jvp`) for a chunk of draws at once. The expansion
point of chain ``c`` is stored by the Laplace engine as ``post.history[CENTER + site]`` shaped ``(chains, *shape)``.
:meth:`~bnn_pyro.Posterior.predictive_draws` calls :func:`linearized_outputs` when
``post.config["predictive"] == "glm"``. It lives in the posterior layer (not in :mod:`bnn_pyro.infer.laplace.glm`,
which re-exports it) so that the Posterior never imports ``bnn_pyro.infer``: a saved Laplace posterior predicts
without the engines.
"""

from __future__ import annotations

import torch

__all__ = ["CENTER", "linearized_outputs"]

CENTER = "linearized_at/"  # history keys of the expansion point, one per covered weight site


def linearized_outputs(
    post, x: torch.Tensor, idx: torch.Tensor, params: dict[str, torch.Tensor], draws_per_chunk: int, rows: int
) -> torch.Tensor | None:
    """Outputs ``(len(idx), N, out)`` of the linearized net for pooled draws ``idx``; ``params`` holds every
    parameter of those draws (``(len(idx), *shape)``), as for :meth:`BNN.forward_draws`. ``None`` when no
    expansion point is stored (a net linear in its covered weights: the plain forward pass is exact)."""
    model = post.model
    names = [k[len(CENTER) :] for k in post.history if k.startswith(CENTER)]
    if not names:
        return None
    chain = torch.div(idx, post.num_draws, rounding_mode="floor")
    f = None
    for i in range(0, len(idx), draws_per_chunk):
        draws = {n: p[i : i + draws_per_chunk] for n, p in params.items()}
        center = tuple(post.history[CENTER + n][chain[i : i + draws_per_chunk]].to(draws[n]) for n in names)
        tangent = tuple(draws[n] - c for n, c in zip(names, center))
        fixed = {n: v for n, v in draws.items() if n not in names}
        for r in range(0, x.shape[0], rows):
            xr = x[r : r + rows]

            def net(*weights, xr=xr, fixed=fixed):
                return model.forward_draws({**fixed, **dict(zip(names, weights))}, xr)

            with torch.enable_grad():
                f0, jv = torch.autograd.functional.jvp(net, center, tangent)
            chunk = (f0 + jv).detach()
            if f is None:
                f = chunk.new_empty((len(idx), x.shape[0]) + chunk.shape[2:])
            f[i : i + chunk.shape[0], r : r + rows] = chunk
    return f
