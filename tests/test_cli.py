"""The command line: the demo runs, bad arguments exit non-zero with a message."""

from __future__ import annotations

import importlib.util

import pytest

from bnn_pyro import cli


def test_demo_runs_and_reports_uncertainty(capsys):
    assert cli.main(["demo", "--steps", "30", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "gap" in out and "epistemic" in out and "training RMSE" in out


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["demo", "--guide", "flows"], ["fly"], []])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------- zoo and fit
@pytest.fixture
def zoo():
    return pytest.importorskip("bnn_pyro.zoo", reason="the model zoo (bnn_pyro/zoo.py) is not installed")


def test_zoo_lists_every_entry_with_its_title(zoo, capsys):
    assert cli.main(["zoo"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == list(zoo.list())
    assert all(zoo.card(line.split(":")[0].strip())["title"] in line for line in lines)


def _fit(entry, method, out, *extra):
    return cli.main(["fit", entry, "--method", method, "--chains", "2", "--out", str(out), "--no-progress", *extra])


def test_fit_regression_writes_posterior_inference_data_and_plots(zoo, tmp_path, capsys):
    import arviz as az

    import bnn_pyro as bp

    out = tmp_path / "run"  # created by the command
    assert _fit("bayesian_linear_regression", "nuts", out, "--samples", "20", "--warmup", "20") == 0
    printed = capsys.readouterr().out
    assert "function space" in printed and "r_hat" in printed and "metrics" in printed
    entry = zoo.load("bayesian_linear_regression")
    for name in ("posterior.bnn", "trace.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "predictive.png").exists() == (entry.x.shape[1:] == (1,))  # a band needs 1-D inputs
    post = bp.load(out / "posterior.bnn", model=entry.model)
    assert post.method == "nuts" and post.num_chains == 2 and post.num_draws == 20
    if importlib.util.find_spec("h5netcdf") is None:
        assert "pip install h5netcdf" in printed and not (out / "inference_data.nc").exists()
    else:
        idata = az.from_netcdf(out / "inference_data.nc")
        assert idata.posterior.sizes["chain"] == 2 and "log_likelihood" in idata.groups()


def test_fit_classification_by_svi_writes_a_reliability_diagram(zoo, tmp_path, capsys):
    assert _fit("mlp_classifier", "svi", tmp_path, "--steps", "20", "--samples", "20") == 0
    assert "metrics" in capsys.readouterr().out
    assert (tmp_path / "reliability.png").stat().st_size > 0
    assert not (tmp_path / "predictive.png").exists()


@pytest.mark.parametrize("argv", [
    ["fit", "mlp_regression", "--method", "sgld"],           # unknown method
    ["fit", "mlp_regression", "--samples", "0"],             # non-positive counts
    ["fit", "mlp_regression", "--chains", "-1"],
    ["fit", "mlp_regression", "--steps", "ten"],
    ["fit", "mlp_regression", "--method", "svi"],            # --out is required
])
def test_fit_bad_arguments_exit_with_a_message(argv, tmp_path, capsys):
    if "--out" not in argv and argv[-1] != "svi":
        argv = argv + ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    assert "error" in capsys.readouterr().err


def test_fit_unknown_entry_names_the_choices(zoo, tmp_path, capsys):
    assert cli.main(["fit", "no_such_net", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown zoo entry 'no_such_net'" in err and zoo.list()[0] in err and "Traceback" not in err


def test_fit_unwritable_out_dir_fails_before_fitting(zoo, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert cli.main(["fit", "mlp_regression", "--out", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert "not a writable folder" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--method", "nuts", "--steps", "10"], "--steps"),
    (["--method", "svi", "--warmup", "10"], "--warmup"),
])
def test_fit_options_of_the_wrong_engine_are_refused(zoo, argv, message, tmp_path, capsys):
    assert cli.main(["fit", "mlp_regression", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
