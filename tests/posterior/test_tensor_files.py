"""The atomic safetensors writer (bnn_pyro/posterior/tensor_files.py): what it writes safetensors reads back exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from bnn_pyro.posterior import tensor_files


def test_every_dtype_and_shape_round_trips_through_safetensors(tmp_path):
    """The writer lays the file out itself (header, then each tensor's bytes); safetensors' reader, which checks
    the layout, gives back every tensor exactly: each dtype, a 0-dim, an empty and a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"{dtype}".removeprefix("torch."): (torch.randn(3, 2, generator=g) * 50).to(dtype)
        for dtype in tensor_files._DTYPES
    }
    tensors.update(
        scalar=torch.tensor(2.5, dtype=torch.float64),
        empty=torch.zeros(0, 4),
        strided=torch.arange(12.0).reshape(3, 4).t(),
        negative=torch.ones(2).neg().conj(),
    )
    path = tensor_files.write_atomic(tmp_path / "t.bin", tensors, {"note": "x"})
    back = load(path.read_bytes())
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_an_unsupported_dtype_is_refused_naming_the_tensor(tmp_path):
    with pytest.raises(TypeError, match=r"cannot store 'z' of dtype torch.complex64 in a bnn_pyro file"):
        tensor_files.write_atomic(tmp_path / "t.bin", {"z": torch.zeros(2, dtype=torch.complex64)}, {})
    assert list(tmp_path.iterdir()) == []
