"""bnn_pyro.io: exact, safe and atomic save / load of a Posterior."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pyro.distributions as dist
import pytest
import torch
from safetensors.torch import save_file

import bnn_pyro as bp
from bnn_pyro import io
from bnn_pyro.io import ModelMismatchError, ModelNotBoundError, PosteriorFileError
from bnn_pyro.posterior import tensor_files


def _assert_same(a: bp.Posterior, b: bp.Posterior) -> None:
    for group in ("samples", "point", "sample_stats", "history"):
        da, db = getattr(a, group), getattr(b, group)
        assert list(da) == list(db), group
        for name in da:
            assert da[name].dtype == db[name].dtype and torch.equal(da[name], db[name]), (group, name)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert (a.method, a.config) == (b.method, b.config)


@pytest.fixture(scope="module")
def saved(svi_post, tmp_path_factory) -> Path:
    return svi_post.save(tmp_path_factory.mktemp("io") / "svi.bnn")


def test_round_trip_is_exact(svi_post, mcmc_post, saved, tmp_path):
    _assert_same(svi_post, bp.load(saved))
    assert svi_post.history["loss"].shape == (2, 200) and svi_post.point  # the fixture exercises every group
    _assert_same(mcmc_post, bp.load(mcmc_post.save(tmp_path / "mcmc.bnn")))


def test_rebinding_predicts_identically(svi_post, blr_model, saved, linear_data):
    x, _ = linear_data
    loaded = bp.load(saved, model=blr_model)
    before, after = svi_post.predict(x, seed=7), loaded.predict(x, seed=7)
    for field in ("mean", "std", "lower", "upper", "draws"):
        assert torch.equal(getattr(before, field), getattr(after, field)), field
    assert loaded.model is not blr_model  # the user's model is never modified


def test_unbound_posterior_summarizes_but_asks_for_model_to_predict(saved, linear_data):
    loaded = bp.load(saved)
    table = loaded.summary(warn=False)
    assert list(table.index) == ["weight[0, 0]"]
    assert set(loaded.to_inference_data().groups()) == {"posterior", "observed_data", "constant_data"}
    with pytest.raises(ModelNotBoundError, match=r"without its model.*bp.load\(.*svi.bnn', model=model\)"):
        loaded.predict(linear_data[0])
    with pytest.raises(ModelNotBoundError, match="cannot evaluate the network in function space"):
        loaded.summary(space="function")


def test_rebinding_to_a_different_model_is_refused(saved):
    other = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.5),
        bayesian="weights",
    )
    with pytest.raises(ValueError, match=r"model: does not match.*likelihood: saved 'Gaussian\(scale=0.1"):
        bp.load(saved, model=other)
    wider = bp.BNN(
        torch.nn.Linear(1, 2),
        prior=bp.priors.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
        bayesian="weights",
    )
    with pytest.raises(ModelMismatchError, match=r"param_shapes of 'weight': saved \[1, 1\], given \[2, 1\]"):
        bp.load(saved, model=wider)


@pytest.mark.parametrize(
    "prior, differs",
    [
        (
            bp.priors.Normal(0.0, 0.5),
            r"prior of 'weight': saved Independent\(Normal\(loc=0, scale=1; batch \(1, 1\)\); 2\), "
            r"given Independent\(Normal\(loc=0, scale=0.5; batch \(1, 1\)\); 2\)",
        ),
        (bp.priors.StudentT(), r"prior of 'weight': saved Independent\(Normal.*given Independent\(StudentT\(df=3"),
        (lambda name, module, param: dist.Laplace(0.0, 1.0), r"prior of 'weight': .*given Independent\(Laplace\(loc=0"),
    ],
)
def test_loading_with_a_model_whose_prior_differs_is_refused_naming_the_site(saved, prior, differs):
    """A model with another prior loaded without a word (the fingerprint held no prior); now it is refused,
    naming the site and both priors. The same prior given another way (a lambda) is accepted."""
    other = bp.BNN(
        torch.nn.Linear(1, 1), prior=prior, likelihood=bp.likelihoods.Gaussian(scale=0.1), bayesian="weights"
    )
    with pytest.raises(
        ModelMismatchError,
        match=rf"model: does not match the model the posterior in '.*svi\.bnn' was "
        rf"fitted with \({differs}",
    ):
        bp.load(saved, model=other)
    same = bp.BNN(
        torch.nn.Linear(1, 1),
        prior=lambda name, module, param: dist.Normal(0.0, 1.0),
        likelihood=bp.likelihoods.Gaussian(scale=0.1),
        bayesian="weights",
    )
    assert bp.load(saved, model=same).method == "svi"


def test_function_model_round_trip_and_rebind(function_post, tmp_path, linear_data):
    from conftest import linreg

    path = function_post.save(tmp_path / "fn.bnn")
    loaded = bp.load(path, model=linreg)
    _assert_same(function_post, loaded)
    assert torch.equal(
        function_post.predict(linear_data[0][:5], seed=1).mean, loaded.predict(linear_data[0][:5], seed=1).mean
    )


def test_truncated_file_is_a_clear_error(saved, tmp_path):
    raw = saved.read_bytes()
    for cut in (4, 100, len(raw) - 10):
        bad = tmp_path / f"cut{cut}.bnn"
        bad.write_bytes(raw[:cut])
        with pytest.raises(PosteriorFileError, match=rf"{bad.name}.*(truncated|corrupted)"):
            bp.load(bad)


def test_flipped_byte_is_caught_by_the_checksum(saved, tmp_path):
    raw = bytearray(saved.read_bytes())
    raw[-3] ^= 0xFF
    bad = tmp_path / "flipped.bnn"
    bad.write_bytes(bytes(raw))
    with pytest.raises(PosteriorFileError, match="checksum mismatch"):
        bp.load(bad)


def _rewrite_metadata(src: Path, dst: Path, change) -> None:
    raw = src.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    meta = json.loads(header["__metadata__"]["bnn_pyro"])
    change(meta)
    from safetensors.torch import load

    save_file(load(raw), dst, metadata={"bnn_pyro": json.dumps(meta)})


def test_newer_format_version_is_refused(saved, tmp_path):
    newer = tmp_path / "newer.bnn"
    _rewrite_metadata(saved, newer, lambda meta: meta.update(format_version=io.FORMAT_VERSION + 1))
    with pytest.raises(
        PosteriorFileError, match=rf"newer.bnn.*format version {io.FORMAT_VERSION + 1} by a newer bnn_pyro.*Upgrade"
    ):
        bp.load(newer)


def test_foreign_files_are_refused(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(3)}, plain)
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a posterior at all")
    for path in (plain, text):
        with pytest.raises(PosteriorFileError, match=rf"{path.name}.*not a bnn_pyro posterior"):
            bp.load(path)


class _Payload:
    """Unpickling this object creates a marker (a directory: no file handle left open, so no
    ResourceWarning): what a malicious pickle would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_malicious_pickle_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.bnn"
    torch.save({"samples": _Payload(marker)}, evil)
    with pytest.raises(PosteriorFileError, match="evil.bnn"):
        bp.load(evil)
    assert not marker.exists()
    # the payload is real: an unsafe loader would have run it
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_failed_write_leaves_previous_file_intact(svi_post, mcmc_post, tmp_path, monkeypatch):
    """A full disk mid-write (the writer fails with ENOSPC after a partial write): an OSError naming the path,
    the previous file unchanged, no temporary file left. Safetensors' own error type used to escape."""
    path = svi_post.save(tmp_path / "post.bnn")
    before = path.read_bytes()

    def disk_full(fd, payload):
        os.write(fd, bytes(payload[:64]))  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tensor_files, "_write_all", disk_full)  # the writer io shares with checkpoints
    with pytest.raises(
        OSError,
        match=r"could not write '.*post\.bnn' \(No space left on device\); the "
        r"previous file there, if any, is unchanged\. Free disk space",
    ) as info:
        mcmc_post.save(path)
    assert type(info.value) is OSError and info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["post.bnn"]  # no temporary file left behind
    _assert_same(svi_post, bp.load(path))


_KILLED_WRITER = """
import os, sys
from pathlib import Path
from bnn_pyro.posterior import tensor_files
fd, tmp = tensor_files._new_temporary(Path(sys.argv[1]))
os.write(fd, b"partial")
print(tmp, flush=True)
sys.stdin.read()  # killed here, mid-write
"""


def _writer_holding_a_temporary(path: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, Path(proc.stdout.readline().strip())


def test_next_save_removes_stale_temporaries_of_killed_writers_only(svi_post, tmp_path):
    """SIGKILL mid-save left ``.post.bnn.*.tmp`` files behind; the next save into the folder removes those of
    dead writers, and leaves a live writer's temporary file and files that are not ours alone."""
    path = tmp_path / "post.bnn"
    dead = []
    for _ in range(3):
        proc, tmp = _writer_holding_a_temporary(path)
        proc.kill()
        proc.wait(timeout=30)
        dead.append(tmp)
    live_proc, live = _writer_holding_a_temporary(tmp_path / "other.bnn")
    foreign = [tmp_path / ".notes.tmp", tmp_path / ".post.bnn.zzzzzzzzzzzz.tmp", tmp_path / "post.bnn.tmp"]
    for f in foreign:
        f.write_text("not ours")
    try:
        assert all(t.exists() for t in dead) and live.exists()
        svi_post.save(path)
        assert not any(t.exists() for t in dead)
        assert live.exists() and all(f.read_text() == "not ours" for f in foreign)
    finally:
        live_proc.kill()
        live_proc.wait(timeout=30)
    _assert_same(svi_post, bp.load(path))
    bp.load(path).save(path)  # the live writer is dead now: its file goes too
    assert not live.exists() and all(f.exists() for f in foreign)


def test_save_rejects_bad_destination_and_config(svi_post, tmp_path):
    with pytest.raises(FileNotFoundError, match="path: the folder .* does not exist"):
        svi_post.save(tmp_path / "missing" / "post.bnn")
    odd = bp.Posterior(samples=svi_post.samples, model=svi_post.model, method="svi", config={"f": object()})
    with pytest.raises(TypeError, match="post.config must be JSON-friendly"):
        odd.save(tmp_path / "odd.bnn")


def test_unbound_model_attributes_explain_themselves(saved, linear_data):
    loaded = bp.load(saved)
    with pytest.raises(ModelNotBoundError, match=r"cannot use model\.(sample_names|likelihood).*pass it: bp\.load"):
        loaded.observation_distribution(linear_data[0])  # the first attribute it reaches (the likelihood's noise)
    with pytest.raises(ModelNotBoundError, match="cannot use model.likelihood"):
        loaded.plot_predictive()


@pytest.fixture
def umask():
    """``os.umask`` for one test; the caller's umask is restored afterwards."""
    before = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(before)


@pytest.mark.parametrize("writer", ["posterior", "checkpoint"])
@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_permissions_of_the_umask(svi_post, tmp_path, umask, writer, mask, mode):
    from bnn_pyro.infer import checkpoint

    umask(mask)
    path = tmp_path / "out.bnn"
    for _ in range(2):  # a new file, then one replaced atomically
        if writer == "posterior":
            svi_post.save(path)
        else:
            checkpoint.write(path, {"w": torch.ones(3)}, {"step": 1})
        assert path.stat().st_mode & 0o777 == mode, oct(path.stat().st_mode)
    assert os.listdir(tmp_path) == ["out.bnn"]  # no temporary file left behind


# ---------------------------------------------------------------------- edited headers (issue 27, item 4)
def _header(path: Path) -> tuple[dict, dict]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    from safetensors.torch import load

    return json.loads(json.loads(raw[8 : 8 + size])["__metadata__"]["bnn_pyro"]), load(raw)


def _edited(src: Path, dst: Path, change, *, reseal: bool) -> Path:
    """``src`` with its metadata (and tensors) changed by ``change(meta, tensors)``; ``reseal``: with the checksum
    recomputed as the writer computes it (an edit made consistently, e.g. by someone who read this code)."""
    meta, tensors = _header(src)
    change(meta, tensors)
    if reseal:
        meta["sha256"] = tensor_files.digest(tensors, {k: v for k, v in meta.items() if k != "sha256"})
    save_file(tensors, dst, metadata={"bnn_pyro": json.dumps(meta)})
    return dst


def test_an_edited_method_in_the_header_fails_the_checksum(saved, tmp_path):
    """The header's method edited from "svi" to "hmc" loaded and reported "hmc": the checksum covered only the
    tensors."""
    edited = _edited(saved, tmp_path / "edited.bnn", lambda meta, t: meta.update(method="hmc"), reseal=False)
    with pytest.raises(
        PosteriorFileError,
        match=r"edited\.bnn': checksum mismatch \(field 'sha256': the tensors or "
        r"the metadata changed after saving\).*was edited",
    ):
        bp.load(edited)


def _drop_sample_name(meta, tensors):
    meta["groups"]["samples"].append("ghost")


def _wider_weight(meta, tensors):
    tensors["samples/weight"] = torch.zeros(2, 100, 3, 1)
    meta["model"]["param_shapes"]["weight"] = [1, 1]


def _float_draws_as_int(meta, tensors):
    tensors["samples/weight"] = tensors["samples/weight"].to(torch.int64)


def _fewer_targets(meta, tensors):
    tensors["y"] = tensors["y"][:3]


def _point_reshaped(meta, tensors):
    tensors["point/bias"] = torch.zeros(2, 5)


@pytest.mark.parametrize(
    "change, field, what",
    [
        (lambda m, t: m.update(method=7), "method", r"is int, expected a str"),
        (lambda m, t: m.pop("config"), "config", r"is missing, expected a dict"),
        (lambda m, t: m.update(x_form="list"), "x_form", r"is 'list', expected 'tuple', 'dict' or 'tensor'"),
        (lambda m, t: m["model"].update(kind="Net"), "model", r"has kind 'Net'"),
        (lambda m, t: m["groups"].pop("point"), "groups.point", r"is missing or unknown"),
        (lambda m, t: m["groups"].update(extras=[]), "groups.extras", r"is missing or unknown"),
        (_drop_sample_name, "groups.samples", r"names tensors the file does not hold \(\['ghost'\]\)"),
        (lambda m, t: m["data"].append("z"), "data", r"names tensors the file does not hold \(\['z'\]\)"),
        (
            _wider_weight,
            "groups.samples",
            r"holds 'weight' shaped \(2, 100, 3, 1\), but the model's parameter is "
            r"shaped \(1, 1\)",
        ),
        (_float_draws_as_int, "groups.samples", r"holds 'weight' as torch.int64 \(2, 100, 1, 1\); expected floating"),
        (_point_reshaped, "groups.point", r"holds 'bias' shaped \(2, 5\), but the model's parameter is shaped \(1,\)"),
        (_fewer_targets, "data", r"holds inputs and targets of different numbers of rows \(\{'x': 40, 'y': 3\}\)"),
    ],
)
def test_a_consistently_edited_header_is_refused_naming_the_field(saved, tmp_path, change, field, what):
    """Headers edited consistently (checksum recomputed) crashed later with raw torch errors inside predict, or
    AttributeError/KeyError inside io.py; now every such file is a PosteriorFileError naming the file and field."""
    edited = _edited(saved, tmp_path / "edited.bnn", change, reseal=True)
    with pytest.raises(
        PosteriorFileError,
        match=rf"edited\.bnn': field '{re.escape(field)}' {what}.*Save the "
        r"posterior again",
    ) as info:
        bp.load(edited)
    assert type(info.value) is PosteriorFileError


# ---------------------------------------------------------------------- files of format version 1
FORMAT1 = Path(__file__).parent / "data" / "posterior_format1.bnn"  # written by bnn_pyro at ce53e88 (see README there)


def test_a_file_of_format_version_1_still_loads_and_predicts():
    """Format version 1 (the checksum covered only the tensors; the fingerprint held no prior) still loads: a
    1-1 linear BNN fitted by SVI (4 draws, seed 0) with the code of commit ce53e88, whose predictive mean at
    x = 0.5 (seed 0) was 0.4027 there."""
    meta, _ = _header(FORMAT1)
    assert meta["format_version"] == 1 and "prior" not in meta["model"]
    model = bp.BNN(
        torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1)
    )
    post = bp.load(FORMAT1, model=model)
    assert post.method == "svi" and post.samples["weight"].shape == (1, 4, 1, 1)
    assert post.predict(torch.tensor([[0.5]]), seed=0).mean.item() == pytest.approx(0.4027, abs=5e-5)
    with pytest.raises(
        ModelMismatchError,
        match=r"likelihood: saved 'Gaussian\(scale=0.1, precision=None\)', given 'Gaussian\(scale=0.2",
    ):
        bp.load(
            FORMAT1,
            model=bp.BNN(
                torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.2)
            ),
        )


def test_a_file_of_format_version_1_with_an_edited_tensor_is_refused(tmp_path):
    raw = bytearray(FORMAT1.read_bytes())
    raw[-3] ^= 0xFF
    bad = tmp_path / "old.bnn"
    bad.write_bytes(bytes(raw))
    with pytest.raises(PosteriorFileError, match=r"old\.bnn': checksum mismatch"):
        bp.load(bad)


def test_an_edited_buffer_shape_is_refused_naming_the_field(tmp_path):
    """A buffer (BatchNorm's running mean) reshaped in a resealed file was a raw size error from copy_."""

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(1, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
        return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))

    x = torch.linspace(-1, 1, 10).unsqueeze(-1)
    post = bp.fit(model(), x, x.squeeze(-1), method="svi", num_steps=2, num_samples=2, num_chains=1, progress=False)
    path = post.save(tmp_path / "bn.bnn")
    assert bp.load(path, model=model()).predict(x, seed=0).mean.shape == (10,)

    def reshaped(meta, tensors):
        tensors["buffers/1.running_mean"] = torch.zeros(5)

    edited = _edited(path, tmp_path / "edited.bnn", reshaped, reseal=True)
    with pytest.raises(
        PosteriorFileError,
        match=r"edited\.bnn': field 'groups\.buffers' holds buffers shaped unlike "
        r"the model's .*'1\.running_mean': \(\(5,\), \(3,\)\)",
    ):
        bp.load(edited, model=model())


# ---------------------------------------------------------------------- a Laplace posterior from before the layout change
LAPLACE_A7736D0 = Path(__file__).parent / "data" / "posterior_laplace_glm_a7736d0.bnn"


def test_a_laplace_posterior_saved_before_the_layout_change_predicts_the_same():
    """Written by the code of commit a7736d0 (before bnn_pyro's modules moved into subpackages and the linearized
    predictive moved to bnn_pyro/posterior/linearized.py): a 1-4-1 tanh MLP, 12 rows of sin(x) + noise, Laplace
    with structure="diag" (every weight covered, so the GLM predictive linearizes at the stored mode), 6 draws,
    seed 0. There the predictive mean at x = -1, 0.5, 2 (seed 0) was the first list below, the plain forward
    pass of the same draws the second: the file stores no module path, and the GLM path still runs."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    post = bp.load(LAPLACE_A7736D0, model=model)
    assert post.method == "laplace" and post.config["predictive"] == "glm"
    assert any(k.startswith("linearized_at/") for k in post.history)  # the expansion point the GLM path reads
    x = torch.tensor([[-1.0], [0.5], [2.0]])
    glm = post.predict(x, seed=0).mean.flatten().tolist()
    plain = post.network_outputs(x, linearized=False).mean(0).flatten().tolist()
    assert glm == pytest.approx([-0.82213, 0.51204, 1.19934], abs=5e-5)
    assert plain == pytest.approx([-0.90784, 0.69774, 1.23098], abs=5e-5)
