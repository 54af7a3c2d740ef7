"""Internal helpers shared across the package, under public names: argument checks (:mod:`.checks`), file locks
(:mod:`.locks`), device placement (:mod:`.placement`), the Linear-stack fast forward (:mod:`.linear_stack`),
the one adapter for upstream private APIs (:mod:`.upstream_private`), checks of targets and predictions
(:mod:`.targets`) and the old import paths (:mod:`.moved`). Not part of the user API.

Import rule: the bottom layer (docs/layout.md). Modules here import, of ``bnn_pyro``, only ``utils/`` and the leaf
types beside it in layer 0: :mod:`bnn_pyro.inputs` and :mod:`bnn_pyro.predictions`.
"""
