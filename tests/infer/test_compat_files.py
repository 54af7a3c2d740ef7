"""Files written before the MCMC engines had typed configs still work (issue 29 item 6): posteriors and
checkpoints that bnn_pyro at commit a7736d0 wrote (tests/data/main_mcmc/, made by
tests/data/make_main_mcmc_files.py from that commit) load, and a checkpointed run that it left half-way resumes
with today's code to exactly the draws its uninterrupted run gave."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from resume import ResumeSpy

import bnn_pyro as bp

DATA = Path(__file__).parent.parent / "data"
_spec = importlib.util.spec_from_file_location("make_main_mcmc_files", DATA / "make_main_mcmc_files.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)


@pytest.mark.parametrize("kernel", list(made.RUNS))
def test_a_checkpoint_written_before_resumes_to_the_draws_of_the_run_it_interrupted(kernel, tmp_path, monkeypatch):
    whole = bp.load(DATA / "main_mcmc" / f"{kernel}.bnn")  # main's uninterrupted run
    assert whole.method == kernel and whole.num_draws == made.COMMON["num_samples"]
    folder = tmp_path / kernel
    shutil.copytree(DATA / "main_mcmc" / kernel, folder)  # never written in place
    model, x, y = made.blr_problem()
    if kernel == "nuts":  # one NUTS transition now serves one chain and C chains: the recursive kernel's mid-tree
        # state cannot be continued, so its checkpoint is refused with the version that can (issue 29 item 6)
        from bnn_pyro.infer.checkpoint import CheckpointError

        with pytest.raises(
            CheckpointError, match=r"recursive NUTS kernel of an earlier bnn_pyro \(up to commit a7736d0\)"
        ):
            bp.fit(
                model, x, y, **made.RUNS[kernel], **made.COMMON, checkpoint=str(folder), checkpoint_every=5, resume=True
            )
        return
    with monkeypatch.context() as m:  # a seeded fresh start gives the same bits: check it read iteration 5 and went on
        spy = ResumeSpy(m)
        resumed = bp.fit(
            model, x, y, **made.RUNS[kernel], **made.COMMON, checkpoint=str(folder), checkpoint_every=5, resume=True
        )
    spy.check(5)
    added = {"step_size_origin"}  # recorded since that file was written: a checkpoint from before the aim resumes
    assert {k: v for k, v in resumed.config.items() if k not in added} == whole.config  # with the dual average's step
    assert kernel != "hmc" or resumed.config["step_size_origin"] == ["dual_average"], resumed.config
    for group in ("samples", "sample_stats", "history"):
        assert set(getattr(resumed, group)) == set(getattr(whole, group)), group
        for name, value in getattr(whole, group).items():
            assert torch.equal(getattr(resumed, group)[name], value), (group, name)


@pytest.mark.parametrize("kernel", list(made.RUNS))
def test_posteriors_written_before_load_with_their_model_and_predict(kernel):
    """(The format-1 file, tests/data/posterior_format1.bnn, is tested in tests/test_io.py.)"""
    model, x, y = made.blr_problem()
    post = bp.load(DATA / "main_mcmc" / f"{kernel}.bnn", model=model)
    assert post.config["kernel"] == kernel and post.samples["weight"].shape == (1, 8, 1, 2)
    pred = post.predict(x[:5], seed=0)
    assert pred.mean.shape == (5,) and torch.isfinite(pred.mean).all()
    # the predictive of the file's draws, computed here: f = x W^T + b per draw, its mean and (population) sd over
    # the 8 draws, and the likelihood's fixed noise 0.5; float32 sums of 8 terms of size ~2: 1e-5 absolute
    f = torch.einsum("ni,dji->dn", x[:5], post.samples["weight"].flatten(0, 1)) + post.samples["bias"].flatten(0, 1)
    assert torch.allclose(pred.mean, f.mean(0), rtol=0, atol=1e-5), (pred.mean, f.mean(0))
    assert torch.allclose(pred.epistemic_std, f.std(0, unbiased=False), rtol=0, atol=1e-5)
    assert torch.allclose(pred.aleatoric_std, torch.full((5,), 0.5))
