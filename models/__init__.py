"""The bnn_pyro model zoo, installed as ``bnn_pyro.models`` (one module per entry)."""
