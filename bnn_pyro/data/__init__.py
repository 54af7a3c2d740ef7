"""Data: the bundled datasets and their loaders (:mod:`.datasets`, reading the small files in this folder),
train/test and k-fold splits with standardization (:mod:`.splits`) and the model zoo's registry (:mod:`.zoo`, the
entries themselves install as ``bnn_pyro.models``). Reached as ``bp.datasets`` and ``bp.zoo``."""
