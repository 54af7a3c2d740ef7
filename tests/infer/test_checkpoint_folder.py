"""A checkpoint folder's model and data identity and its one-writer lock (bnn_pyro/infer/checkpoint_folder.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import checkpoint as ckpt_mod
from bnn_pyro.infer.checkpoint_folder import IDENTITY, CheckpointInUseError
from bnn_pyro.posterior import tensor_files

SVI = dict(method="svi", guide="mean_field", num_steps=6, num_samples=4, num_chains=1, seed=3, progress=False)


def _mlp(width: int = 8, prior=None, scale: float = 0.1) -> bp.BNN:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    return bp.BNN(net, prior=prior or bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=scale))


@pytest.fixture(scope="module")
def toy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(37, 1, generator=g) * 4 - 2
    return x, torch.sin(x) + 0.1 * torch.randn(x.shape, generator=g)


@pytest.fixture
def fitted(toy, tmp_path):
    """A folder holding the checkpoint of a finished SVI fit (every 3 steps) and its file's bytes."""
    x, y = toy
    bp.fit(_mlp(), x, y, checkpoint=tmp_path, checkpoint_every=3, **SVI)
    return tmp_path, (tmp_path / "chain0.ckpt").read_bytes()


def _resume(folder, model, x, y):
    return bp.fit(model, x, y, checkpoint=folder, checkpoint_every=3, resume=True, **SVI)


@pytest.mark.parametrize(
    "change, differs",
    [
        (
            lambda x, y: (_mlp(width=9), x, y),  # a wider net: was a raw torch size error from copy_
            r"model\.net: saved Sequential.*out_features=8.*given Sequential.*out_features=9.*model\.param_shapes\.0\.bias: "
            r"saved \[8\], given \[9\]",
        ),
        (
            lambda x, y: (_mlp(), x, y + 1.0),  # other targets: the resumed fit went on silently
            r"data\.y: saved float32 \(37,\) sha256:[0-9a-f]{16}, given float32 \(37,\) sha256:[0-9a-f]{16}\)",
        ),
        (
            lambda x, y: (_mlp(), x[:30], y[:30]),
            r"data\.x: saved float32 \(37, 1\) sha256:\w+, given float32 \(30, 1\) sha256:\w+; data\.y: saved float32 \(37,\)",
        ),
        (
            lambda x, y: (_mlp(prior=bp.priors.Normal(0.0, 0.5)), x, y),
            r"model\.prior\.0\.bias: saved Independent\(Normal\(loc=0, scale=1; batch \(8,\)\); 1\), given "
            r"Independent\(Normal\(loc=0, scale=0\.5; batch \(8,\)\); 1\)",
        ),
        (
            lambda x, y: (_mlp(scale=0.2), x, y),
            r"model\.likelihood: saved Gaussian\(scale=0\.1, precision=None\), given Gaussian\(scale=0\.2",
        ),
    ],
)
def test_resume_with_another_model_or_data_is_refused_naming_what_differs(fitted, toy, change, differs):
    folder, before = fitted
    with pytest.raises(
        ckpt_mod.CheckpointError,
        match=rf"resume: the checkpoints in '.*' belong to another model or "
        rf"data \(.*{differs}.*Resume with the model and data",
    ):
        _resume(folder, *change(*toy))
    assert (folder / "chain0.ckpt").read_bytes() == before  # the run's state is untouched


def test_a_missing_folder_is_refused_naming_it_by_the_guard_and_by_a_checkpoint(toy, tmp_path):
    missing = tmp_path / "not_there"
    message = rf"checkpoint: the folder '{re.escape(str(missing))}' does not exist; create it first"
    with pytest.raises(FileNotFoundError, match=message):
        bp.fit(_mlp(), *toy, checkpoint=missing, **SVI)
    with pytest.raises(FileNotFoundError, match=message):
        ckpt_mod.Checkpoint(missing, every=None, resume=False, chain=0, run={})
    assert not missing.exists()  # a fit never creates it


def test_resume_with_the_same_model_and_data_goes_on(fitted, toy):
    folder, _ = fitted
    x, y = toy
    post = _resume(folder, _mlp(), x.clone(), y.clone())  # equal values, other tensors: the same data
    assert post.history["loss"].shape == (1, 6)


def test_a_folder_without_identity_resumes_and_gets_one(fitted, toy):
    """Folders written before identities existed resume (unchecked), and are checked from then on."""
    folder, _ = fitted
    (folder / IDENTITY).unlink()
    _resume(folder, _mlp(), *toy)
    assert (folder / IDENTITY).exists()
    with pytest.raises(ckpt_mod.CheckpointError, match=r"data\.y"):
        _resume(folder, _mlp(), toy[0], -toy[1])


def test_a_wider_net_without_identity_is_a_checkpoint_error_not_a_size_error(fitted, toy):
    """Without the folder's identity (an old folder), the chain's own restore names the tensor that differs."""
    folder, _ = fitted
    (folder / IDENTITY).unlink()
    with pytest.raises(
        ckpt_mod.CheckpointError,
        match=r"resume: .*chain0\.ckpt.* holds .* shaped \(8, 1\); this "
        r"run's is shaped \(9, 1\)",
    ):
        _resume(folder, _mlp(width=9), *toy)


_HOLDER = """
import sys, torch
import bnn_pyro as bp
from bnn_pyro.infer.checkpoint_folder import guard
from bnn_pyro.infer.training_data import Data

model = bp.BNN(torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
with guard(sys.argv[1], model=model, data=Data(x=torch.zeros(3, 1), y=torch.zeros(3, 1)), resume=False):
    print("holding", flush=True)
    sys.stdin.read()
"""


def test_a_second_writer_is_refused_and_a_killed_writers_lock_is_free(toy, tmp_path):
    """Two processes fitting into one folder: the later silently replaced the other's state. Now a live holder
    of the folder's lock (another process) makes the fit fail before it writes anything, naming the holder; once
    the holder is killed (SIGKILL: no clean-up ran), the folder is free again."""
    x, y = toy
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(
            CheckpointInUseError,
            match=rf"checkpoint: '.*' is in use by another fit \(pid {holder.pid} "
            r"on .*\); two fits writing one folder would overwrite",
        ):
            bp.fit(_mlp(), x, y, checkpoint=tmp_path, **SVI)
        assert not (tmp_path / "chain0.ckpt").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    bp.fit(_mlp(), x, y, checkpoint=tmp_path, resume=True, **SVI)
    assert ckpt_mod.read(tmp_path / "chain0.ckpt")[1]["step"] == 6


def test_one_process_holds_the_lock_once_per_fit(toy, tmp_path):
    """The lock is released when the fit ends (also when it fails), so the next fit in the same process runs."""
    x, y = toy
    with pytest.raises(TypeError, match=r"num_steps must be an int, got str '6'"):  # after the lock is taken
        bp.fit(_mlp(), x, y, checkpoint=tmp_path, **{**SVI, "num_steps": "6"})
    bp.fit(_mlp(), x, y, checkpoint=tmp_path, **SVI)
    bp.fit(_mlp(), x, y, checkpoint=tmp_path, resume=True, **SVI)


# ---------------------------------------------------------------------- the checkpoint file's header
def _rewrite(path, change) -> None:
    import json
    import struct

    from safetensors.torch import load, save_file

    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(json.loads(raw[8 : 8 + size])["__metadata__"]["bnn_pyro"])
    change(header)
    tensors = load(raw)
    save_file(tensors, path, metadata={"bnn_pyro": json.dumps(header)})


def test_an_edited_checkpoint_header_fails_the_checksum(tmp_path):
    """The checksum covered the tensors only: an edited step or configuration was read as if written."""
    path = ckpt_mod.write(tmp_path / "c.ckpt", {"w": torch.ones(3)}, {"step": 4, "run": {"lr": 0.1}})
    _rewrite(path, lambda h: h["meta"].update(step=2))
    with pytest.raises(ckpt_mod.CheckpointError, match=r"c\.ckpt' fails its checksum \(the tensors or the metadata"):
        ckpt_mod.read(path)


def test_a_checkpoint_of_format_version_1_still_reads(tmp_path):
    """Version 1 (checksum over the tensors only), as bnn_pyro wrote it before: still read."""
    tensors = {"w": torch.ones(3)}
    path = ckpt_mod.write(tmp_path / "c.ckpt", tensors, {"step": 4})

    def as_version_1(header):
        header.update(format_version=1, sha256=tensor_files.digest(tensors))

    _rewrite(path, as_version_1)
    got, meta = ckpt_mod.read(path)
    assert meta == {"step": 4} and torch.equal(got["w"], tensors["w"])


class _Items(torch.utils.data.Dataset):
    """A map-style dataset that is not a TensorDataset: items read one by one."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i].numpy(), "row": i}


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def test_a_loaders_dataset_is_hashed_where_it_is_indexable_and_finite(toy):
    from bnn_pyro.infer.checkpoint_folder import dataset_hash

    x, y = toy
    loader = torch.utils.data.DataLoader

    def tensors(x, y, **kwargs):
        return dataset_hash(loader(torch.utils.data.TensorDataset(x, y), batch_size=8, **kwargs))

    base = tensors(x, y)
    assert base.startswith("sha256:") and base == tensors(x.clone(), y.clone(), shuffle=True)  # values, not order
    assert tensors(x, y + 1.0) != base and tensors(x[:30], y[:30]) != base and tensors(x.double(), y) != base
    items = dataset_hash(loader(_Items(x, y), batch_size=8))
    assert items.startswith("sha256:") and items == dataset_hash(loader(_Items(x.clone(), y.clone())))
    changed = y.clone()
    changed[17] += 1e-3  # one value of one item
    assert dataset_hash(loader(_Items(x, changed), batch_size=8)) != items
    for unindexed in (loader(_Stream(x, y), batch_size=8), iter([(x, y)])):
        assert dataset_hash(unindexed).startswith("not hashed: an iterable loader or dataset")


def test_resume_with_a_loader_over_other_data_is_refused(toy, tmp_path):
    x, y = toy

    def loader(y):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    bp.fit(_mlp(), loader(y), checkpoint=tmp_path, checkpoint_every=3, **SVI)
    before = (tmp_path / "chain0.ckpt").read_bytes()
    with pytest.raises(ckpt_mod.CheckpointError, match=r"data\.dataset: saved sha256:[0-9a-f]{16}, given sha256:"):
        bp.fit(_mlp(), loader(-y), checkpoint=tmp_path, checkpoint_every=3, resume=True, **SVI)  # same shapes
    assert (tmp_path / "chain0.ckpt").read_bytes() == before
    post = bp.fit(_mlp(), loader(y.clone()), checkpoint=tmp_path, checkpoint_every=3, resume=True, **SVI)
    assert post.history["loss"].shape == (1, 6)
    # a folder recorded before loaders' datasets were hashed resumes (its other fields still checked)
    saved = ckpt_mod.read(tmp_path / IDENTITY)[1]["identity"]
    del saved["data"]["dataset"]
    ckpt_mod.write(tmp_path / IDENTITY, {}, {"identity": saved})
    bp.fit(_mlp(), loader(y), checkpoint=tmp_path, checkpoint_every=3, resume=True, **SVI)
    with pytest.raises(ckpt_mod.CheckpointError, match=r"model\.net"):
        bp.fit(_mlp(width=9), loader(y), checkpoint=tmp_path, checkpoint_every=3, resume=True, **SVI)
