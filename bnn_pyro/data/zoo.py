"""The model zoo: ready-made models with their data, default fits, metadata and metrics.

Every entry is a short module in the installed package :mod:`bnn_pyro.models` (the top-level
``models/`` folder of the repository) exposing ``CARD`` (what it shows, the prior and why, the
likelihood, the default method and settings, where the data comes from, references) and
``build(**hyper) -> Entry``. Small entries also carry a reference posterior (posteriordb style, see
``models/reference/README.md``).

Example
-------
>>> bp.zoo.list()                                   # ['bayesian_linear_regression', ...]
>>> entry = bp.zoo.load("mlp_regression")
>>> post = entry.fit()                              # the card's default method and settings
>>> entry.evaluate(post)                            # {'rmse': ..., 'test_log_likelihood': ...}
>>> entry = bp.zoo.load("mlp_classifier", dataset="digits")
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from bnn_pyro.infer import fit as _fit
from bnn_pyro.model import BNN
from bnn_pyro.posterior import Posterior

__all__ = ["Entry", "list", "load", "card", "reference", "fit_defaults", "CARD_KEYS"]

_list = list  # this module defines list(); keep the builtin at hand
CARD_KEYS = ("title", "summary", "prior", "likelihood", "default_method", "default_settings", "data", "references")
_PACKAGE = "bnn_pyro.models"


@dataclass
class Entry:
    """One zoo entry: a model, its data and how to fit and score it.

    Attributes
    ----------
    name, model:
        The entry's name and its model (a :class:`~bnn_pyro.BNN` or a Pyro function).
    x, y, x_test, y_test:
        Training data and held-out data (``None`` when an entry has no test split).
    task:
        ``"regression"`` or ``"classification"``.
    fit_defaults:
        ``bp.fit`` settings per method, e.g. ``{"svi": {...}, "nuts": {...}}``.
    card:
        The entry's metadata (see :data:`CARD_KEYS`).
    extras:
        Entry-specific callables, reachable as attributes (``entry.exact_posterior()``).
    """

    name: str
    model: BNN | Callable
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor | None
    y_test: torch.Tensor | None
    task: str
    fit_defaults: dict[str, dict[str, Any]]
    card: dict[str, Any]
    extras: dict[str, Callable] = field(default_factory=dict)

    def __getattr__(self, name: str):
        extras = self.__dict__.get("extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"zoo entry {self.__dict__.get('name')!r} has no attribute {name!r}")

    @property
    def default_method(self) -> str:
        return self.card["default_method"]

    def fit(self, method: str | None = None, **overrides) -> Posterior:
        """Fit the entry's model to its training data: ``method`` (default: the card's) with
        ``fit_defaults[method]`` updated by ``overrides``."""
        method = method or self.default_method
        config = {**self.fit_defaults.get(method, {}), **overrides}
        return _fit(self.model, self.x, self.y, method=method, **config)

    def evaluate(self, posterior: Posterior, *, num_samples: int | None = 500, seed: int = 0) -> dict[str, float]:
        """Metrics on the test split (the training data if there is none): ``rmse`` and
        ``test_log_likelihood`` (mean over points of ``log E_w p(y | x, w)``) for regression;
        ``accuracy``, ``nll`` (negative test log-likelihood per point) and ``ece`` (15 bins) for
        classification."""
        from bnn_pyro import metrics

        x, y = (self.x_test, self.y_test) if self.x_test is not None else (self.x, self.y)
        pred = posterior.predict(x, num_samples=num_samples, seed=seed)
        tll = float(metrics.test_log_likelihood(posterior, x, y))
        if self.task == "regression":
            return {"rmse": float(metrics.rmse(pred.mean, y)), "test_log_likelihood": tll}
        return {"accuracy": float(metrics.accuracy(pred, y)), "nll": -tll, "ece": float(metrics.ece(pred.probs, y))}


def fit_defaults(card: dict[str, Any], *, seed: int) -> dict[str, dict[str, Any]]:
    """An entry's :attr:`Entry.fit_defaults` from its card: ``card["default_settings"]`` per method, each with
    ``seed`` (an entry's fits are reproducible under its ``build(seed=...)``) and ``progress=False`` (a zoo fit
    runs inside scripts, benchmarks and tests; ``entry.fit(progress=True)`` shows the bar). Each method's
    settings are a new dict, so an entry may adjust them (``defaults["svi"].update(...)``)."""
    return {
        method: {**settings, "seed": seed, "progress": False} for method, settings in card["default_settings"].items()
    }


def list() -> _list[str]:  # noqa: A001 - bp.zoo.list() is the public name
    """Sorted names of the zoo's entries: the public modules of :mod:`bnn_pyro.models` that define
    ``CARD`` and ``build`` (helper scripts such as ``make_results`` are skipped)."""
    package = importlib.import_module(_PACKAGE)
    names = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"{_PACKAGE}.{info.name}")
        if hasattr(module, "CARD") and callable(getattr(module, "build", None)):
            names.append(info.name)
    return sorted(names)


def _module(name: str):
    valid = list()
    if not isinstance(name, str) or name not in valid:
        raise ValueError(f"zoo: unknown entry {name!r}; valid names are {', '.join(valid)}. See bp.zoo.list().")
    return importlib.import_module(f"{_PACKAGE}.{name}")


def load(name: str, **hyper) -> Entry:
    """Build the entry ``name`` (hyper-parameters as keywords, see its card); unknown names raise
    ``ValueError`` listing the valid ones."""
    return _module(name).build(**hyper)


def card(name: str) -> dict[str, Any]:
    """The metadata card of entry ``name`` (a copy)."""
    return json.loads(json.dumps(_module(name).CARD))


def reference(name: str) -> dict[str, Any]:
    """The stored reference posterior of entry ``name`` (function-space summary and provenance),
    read from ``bnn_pyro/models/reference/<name>.json``; ``FileNotFoundError`` when it has none."""
    path = resources.files(_PACKAGE).joinpath("reference", f"{name}.json")
    if not path.is_file():
        have = sorted(
            p.name[:-5] for p in resources.files(_PACKAGE).joinpath("reference").iterdir() if p.name.endswith(".json")
        )
        raise FileNotFoundError(f"zoo: entry {name!r} has no reference posterior; entries with one: {', '.join(have)}.")
    return json.loads(path.read_text())
