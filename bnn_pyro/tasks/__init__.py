"""Uncertainty tasks on a fitted posterior: active learning (:mod:`.acquisition`), selective prediction
(:mod:`.selective`), adversarial inputs (:mod:`.adversarial`), calibration (:mod:`.calibration`) and conformal
prediction (:mod:`.conformal`). Each is reached as ``bp.<name>``; they use posteriors, nothing below imports them."""
