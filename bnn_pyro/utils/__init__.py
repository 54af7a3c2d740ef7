"""Internal helpers shared across the package, under public names: argument checks (:mod:`.checks`), file locks
(:mod:`.locks`), device placement (:mod:`.placement`), the Linear-stack fast forward (:mod:`.linear_stack`),
the one adapter for upstream private APIs (:mod:`.upstream_private`) and the old import paths (:mod:`.moved`).

Import rule: the bottom layer. Modules here import nothing of ``bnn_pyro`` outside ``utils/`` except
``bnn_pyro.inputs`` (which imports nothing of ``bnn_pyro``); not part of the user API.
"""
