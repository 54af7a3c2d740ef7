"""Small data files bundled with the package (read with :mod:`bnn_pyro.datasets`)."""
