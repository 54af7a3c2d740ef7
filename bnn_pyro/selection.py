"""Which parameters of a net are random: ``BNN(bayesian=...)``'s choices, frozen parameters and their checks.

``bayesian=`` is ``"all"``, ``"weights"``, ``"no_batchnorm"`` (:class:`Bayesian`), a list of name patterns
(``fnmatch``: ``["0.*", "2.weight"]``) or a predicate ``(name, module, param) -> bool``; :func:`selector` turns
it into the predicate. Parameters with ``requires_grad=False`` are frozen: :func:`frozen_as_buffers` makes
them buffers of the model's own copy of the net, so no engine draws, trains or re-initializes them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from enum import Enum

import torch
from torch import nn

from bnn_pyro.utils.checks import choice

__all__ = ["Bayesian", "SelectorLike", "selector", "frozen_as_buffers", "nothing_random", "NORM_LAYERS"]

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


class Bayesian(str, Enum):
    """Named choices for ``BNN(bayesian=...)``: which parameters get a prior."""

    ALL = "all"
    WEIGHTS = "weights"  # parameters whose name ends in "weight"; biases stay deterministic
    NO_BATCHNORM = "no_batchnorm"  # everything except normalization layers' affine parameters


SelectorLike = str | Bayesian | Sequence[str] | Callable[[str, nn.Module, torch.Tensor], bool]


def nothing_random(names: list[str], selected: list[str]) -> str:
    if not selected:
        return (
            f"bayesian: selects none of the net's parameters {names}, so the BNN would have no random weights; "
            'choose some, e.g. bayesian="all" or name patterns that match these names.'
        )
    return (
        f"prior: gives no parameter a distribution (it returned None for every one of {selected}), so the BNN "
        "would have no random weights; return a distribution for at least one, e.g. prior=bp.priors.Normal(0., 1.)."
    )


def frozen_as_buffers(net: nn.Module, names: list[str]) -> nn.Module:
    """``net`` (a copy) with the parameters ``names`` turned into buffers of the same name and value."""
    for name in names:
        owner = net.get_submodule(name.rpartition(".")[0])
        attr = name.rpartition(".")[2]
        value = getattr(owner, attr).detach()
        delattr(owner, attr)
        owner.register_buffer(attr, value)
    return net


def selector(
    bayesian: SelectorLike, names: list[str], frozen: Sequence[str] = ()
) -> Callable[[str, nn.Module, torch.Tensor], bool]:
    if callable(bayesian) and not isinstance(bayesian, str):
        return bayesian
    if isinstance(bayesian, str):
        try:
            kind = choice("bayesian", bayesian, Bayesian)
        except ValueError as err:
            raise ValueError(f"{err} For name patterns pass a list, e.g. bayesian=[{bayesian!r}].") from None
        if kind is Bayesian.ALL:
            return lambda name, module, param: True
        if kind is Bayesian.WEIGHTS:
            return lambda name, module, param: name.rpartition(".")[2].endswith("weight")
        return lambda name, module, param: not isinstance(module, NORM_LAYERS)
    if not isinstance(bayesian, (list, tuple, set, frozenset)):
        raise TypeError(
            f'bayesian: expected "all", "weights", "no_batchnorm", a list of name patterns or a '
            f"predicate (name, module, param) -> bool, got {type(bayesian).__name__} {bayesian!r}; pass e.g. "
            'bayesian="all" or bayesian=["0.*"].'
        )
    patterns = list(bayesian)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError("bayesian: a list must hold name patterns (str), e.g. ['0.*', '2.weight'].")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names) and any(
            fnmatch.fnmatchcase(name, pattern) for name in frozen
        ):
            raise ValueError(
                f"bayesian: the pattern {pattern!r} matches only frozen parameters (requires_grad=False), "
                f"which stay fixed at the net's values; the trainable ones are {names}. Unfreeze them "
                "(.requires_grad_(True)) to make them Bayesian, or drop the pattern."
            )
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(
                f"bayesian: the pattern {pattern!r} matches no parameter of the net; its parameters are "
                f"{names}. Check the pattern against these names (e.g. '0.*' or '*.weight')."
            )
    return lambda name, module, param: any(fnmatch.fnmatchcase(name, p) for p in patterns)
