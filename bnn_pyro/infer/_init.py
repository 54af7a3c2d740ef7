"""Where every engine starts: ``init=``, checked once per fit and resolved once per chain.

Every engine takes the same ``init=``:

- ``"reset"`` (the default for a :class:`~bnn_pyro.BNN`): every parameter re-drawn by its module's own
  ``reset_parameters()`` (``nn.Linear``: Kaiming-uniform weights) under the chain's seed
  (``seed + chain``), on the CPU, apart from torch's global generator. The fit then depends on
  ``seed=`` only, not on the random numbers drawn before the net was built, and chains (ensemble
  members) start apart. Parameters of modules without ``reset_parameters()`` keep the net's values
  (a warning names them).
- ``"net"``: the net's own current weights (a pretrained net), the same for every chain.
- ``"prior"``: a draw from the prior per chain (the default for a Pyro function model); ``"median"``:
  the prior median.
- a dict of values by site name (a ``BNN``'s deterministic parameters may be named too), or a
  :class:`~bnn_pyro.Posterior` of the same model: its mean, and its chain-0 deterministic values.

Sites without a value (hyper and noise sites) start at their prior median. A ``BNN``'s deterministic
parameters (those the prior leaves out) start at the net's values under ``"net"``, at the posterior's
under a ``Posterior`` (or the dict's, where it names them), and are re-drawn with ``reset_parameters()``
under the chain's seed otherwise. ``init=`` is checked before any fitting: a dict or a posterior
must name only this model's sites or parameters, each with its shape.

Example
-------
>>> init = resolve_init(model, init, data)                 # once per fit: checked, default filled in
>>> start = chain_start(fitted, init, seed + chain)        # once per chain: sets deterministic params
>>> pot = Potential(fitted, data, init=start)              # or init_strategy(fitted, start)
"""

from __future__ import annotations

import copy
from enum import Enum

import torch

from bnn_pyro.infer._common import Data, is_latent, traced
from bnn_pyro.model import BNN
from bnn_pyro.utils.checks import choice
from bnn_pyro.utils.user_warnings import warn

__all__ = ["Init", "resolve_init", "chain_start", "reset_values", "set_points"]


class Init(str, Enum):
    """Named starting points for ``init=`` (a dict of values or a ``Posterior`` are the others)."""

    RESET = "reset"  # each module's reset_parameters() under the chain's seed (BNN only; the BNN default)
    NET = "net"  # the net's current weights (a pretrained net)
    PRIOR = "prior"  # a prior draw per chain (the Pyro function default)
    MEDIAN = "median"  # the prior median


_ADVICE = (
    "init= must come from a fit of this same model (same net architecture, prior and likelihood). To start "
    "from a net's own weights, build the model from that net and pass init='net'; otherwise use "
    "init='reset' (the default) or init='prior'"
)


def resolve_init(model, init, data: Data):
    """``init`` checked against ``model`` and the default filled in: ``"reset"``, ``"net"``, ``"prior"``,
    ``"median"`` (plain ``str``), a dict of tensors, or the ``Posterior`` itself.

    ``None`` is ``"reset"`` for a ``BNN`` and ``"prior"`` for a Pyro function. Raises a ``TypeError`` for
    another type, and a ``ValueError`` for an unknown name, ``"reset"`` on a Pyro function, or a dict /
    posterior whose names or shapes do not fit the model (found by running it once on the first batch).
    """
    from bnn_pyro.posterior import Posterior

    is_bnn = isinstance(model, BNN)
    if init is None:
        return Init.RESET.value if is_bnn else Init.PRIOR.value
    if isinstance(init, str):
        kind = choice("init", init, Init)
        if kind is Init.RESET and not is_bnn:
            raise ValueError(
                "init='reset' re-runs the layers' initializers of a bp.BNN's net; this model is a Pyro "
                "function. Use init='prior' (a prior draw per chain) or 'median'."
            )
        return kind.value
    if isinstance(init, Posterior):
        values = {n: v.mean((0, 1)) for n, v in init.samples.items()}
        points = {n: v[0] for n, v in init.point.items()}
        _check_values(model, {**points, **values}, data, "the Posterior's")
        return init
    if isinstance(init, dict):
        values = {}
        for name, value in init.items():
            try:
                values[name] = torch.as_tensor(value, dtype=value.dtype if torch.is_tensor(value) else _dtype(model))
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"init: the value for {name!r} is a {type(value).__name__}; pass a tensor (or a number) "
                    "per site name, e.g. init={'0.weight': torch.zeros(50, 1)}."
                ) from None
        _check_values(model, values, data, "the dict's")
        return values
    raise TypeError(
        f"init: expected 'reset', 'net', 'prior', 'median' ('laplace' too under svi), a dict of site values or a bp.Posterior, got "
        f"{type(init).__name__}; pass e.g. init='net' (the net's own weights) or init=post (a fit of this "
        "model)."
    )


def _dtype(model) -> torch.dtype:
    return model.dtype if isinstance(model, BNN) else torch.get_default_dtype()


def _check_values(model, values: dict[str, torch.Tensor], data: Data, whose: str) -> None:
    """Every name a latent site or a parameter of ``model``, with that site's (per-draw) shape."""
    x0, y0 = data.first()
    shapes = {
        name: site["value"].shape
        for name, site in traced(model, x0, y0).nodes.items()
        if site["type"] == "param"
        or is_latent(site)
        or (site["type"] == "sample" and site["infer"].get("_deterministic"))
    }  # MCMC keeps pyro.deterministic
    if isinstance(model, BNN):
        shapes.update(model.param_shapes)
    unknown = [n for n in values if n not in shapes]
    if unknown:
        raise ValueError(
            f"init: {whose} sites {unknown} are not sites or parameters of this model (its sites: "
            f"{list(shapes)}); {_ADVICE}."
        )
    for name, value in values.items():
        if value.shape != shapes[name]:
            raise ValueError(
                f"init: {whose} site {name!r} has shape {tuple(value.shape)} (per draw), but this model's "
                f"{name!r} has shape {tuple(shapes[name])}; {_ADVICE}."
            )


def chain_start(model, init, seed: int, *, points: bool = True):
    """The start of one chain: ``init`` as :func:`~bnn_pyro.infer._common.init_strategy` takes it.

    ``init`` comes from :func:`resolve_init`; ``model`` is the fit's own copy. For a ``BNN``, ``"reset"``
    becomes a dict of fresh values (:func:`reset_values` under ``seed``), and with ``points=True`` its
    deterministic parameters are set (module docstring); engines whose chains share one copy (MCMC,
    SG-MCMC: the deterministic parameters stay fixed) pass ``points=False`` for every chain but the first.
    """
    from bnn_pyro.posterior import Posterior

    if not isinstance(model, BNN) or (isinstance(init, str) and init == Init.NET.value):
        return init
    if isinstance(init, Posterior):
        if points:
            set_points(model, {n: v[0] for n, v in init.point.items()})
        return init
    reset = init == Init.RESET.value if isinstance(init, str) else False
    if not (reset or (points and model.point_names)):
        return init
    fresh = reset_values(model, seed, names=None if reset else model.point_names)
    if points:
        given = init if isinstance(init, dict) else {}
        set_points(model, {n: given.get(n, fresh[n]) for n in model.point_names})
    return {n: fresh[n] for n in model.sample_names} if reset else init


def set_points(model: BNN, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the net's parameters of those names (a BNN's deterministic parameters)."""
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if name in values:
                p.copy_(values[name])


def reset_values(model: BNN, seed: int, *, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Fresh values of a BNN's parameters from its layers' ``reset_parameters()``, seeded by ``seed``.

    Drawn on the CPU with their own generator state (torch's global one is left as it was), then moved
    to the model's device and dtype: the same values on every machine and device. Parameters of modules without
    ``reset_parameters`` keep the net's values; a warning names those among ``names`` (default: all).
    """
    like = next(iter(model.init_values.values()))  # the model's device and dtype (also after model.to(...))
    net = copy.deepcopy(model._template).to_empty(device="cpu")
    covered = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, module in net.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if own and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                covered.update(f"{prefix}.{n}" if prefix else n for n in own)
    values = {n: p.detach().to(like) for n, p in net.named_parameters()}
    missing = [n for n in values if n not in covered]
    if any(n in (values if names is None else names) for n in missing):
        warn(
            f"init: parameters {missing} belong to modules without reset_parameters(), so every chain (or "
            "ensemble member) starts them at the net's current values, which seed= does not control. Give "
            "those modules a reset_parameters(), seed torch before building the net, or use init='prior' "
            "(sites) or init='net' (the net's values, without this warning).",
            UserWarning,
        )
    values.update({n: model.init_values[n].clone() for n in missing})
    return values
