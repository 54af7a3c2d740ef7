"""Tools built on fitted posteriors and engines: weight pruning and quantization (:mod:`.compression`), mode
connectivity curves (:mod:`.curves`), distillation of a posterior predictive into one network (:mod:`.distill`)
and simulation-based calibration of the engines (:mod:`.sbc`). Each is reached as ``bp.<name>``."""
