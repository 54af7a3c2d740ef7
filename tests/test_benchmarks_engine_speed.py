"""benchmarks/engine_speed.py's HMC row on its quick setting (the script is loaded from its file: benchmarks/ is no
package): it runs, and its Pyro side is Pyro's HMC on the log joint's traced potential."""

from __future__ import annotations

import torch

from bnn_pyro.infer import _kernels, _logjoint
from bnn_pyro.infer.mcmc import HMCConfig, KernelSettings


def test_quick_hmc_run_times_the_flat_kernel_against_pyros_hmc(tmp_path, load_benchmark):
    module = load_benchmark("engine_speed")
    table = module.main(["--only", "hmc", "--quick", "--repeats", "1", "--out", str(tmp_path), "--name", "quick"])
    assert list(table.path) == ["flat (FlatHMC), analytic potential", "pyro HMC, traced potential"]
    assert bool((table.ms > 0).all()) and float(table.ratio.iloc[1]) == 1.0
    assert (tmp_path / "quick.md").exists() and (tmp_path / "quick.csv").exists()


def test_the_pyro_side_is_pyros_hmc_on_the_traced_potential_of_the_log_joint(load_benchmark):
    """(The fits of the quick run use the default chains, in processes of their own: checked here directly.)"""
    module, common = load_benchmark("engine_speed"), load_benchmark("_common")
    x, y = common.regression(20, 1)
    model = common.bnn(1, width=3)
    from pyro.infer.autoguide.initialization import init_to_sample

    from bnn_pyro.infer._common import quiet_model

    config = HMCConfig(num_leapfrog=4).checked()
    settings = KernelSettings(config=config, joint=_logjoint.build(model, 20), init_strategy=init_to_sample)
    kernel = module.pyro_hmc_kernel(x, y)(config, quiet_model(model, 20), settings)
    assert type(kernel) is _kernels.PyroHMC and kernel.potential_fn is not None
    kernel.setup(2, x, y)
    z = kernel.initial_params
    assert torch.isfinite(kernel.potential_fn(z)) and set(z) == set(kernel.transforms)
