"""The command line: the demo runs, every subcommand documents its options, the zoo prints cards,
every registered method fits through ``fit``, bad arguments exit non-zero with a message, and
``--out`` never overwrites a user's files unasked."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import signal
import subprocess
import sys
import time

import pytest

from bnn_pyro import cli
from bnn_pyro.infer import Method, engine


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
    return pytest.importorskip("bnn_pyro.data.zoo", reason="the model zoo (bnn_pyro/data/zoo.py) is not installed")


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


def test_fit_without_method_uses_the_cards_default_method(zoo, tmp_path, capsys):
    import bnn_pyro as bp

    card = zoo.card("mlp_classifier")
    assert card["default_method"] == "svi"  # not nuts, so the test tells the card's default from a fixed one
    assert (
        cli.main(
            [
                "fit",
                "mlp_classifier",
                "--chains",
                "1",
                "--steps",
                "20",
                "--samples",
                "20",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    assert " by svi (" in capsys.readouterr().out
    post = bp.load(tmp_path / "posterior.bnn", model=zoo.load("mlp_classifier").model)
    assert post.method == card["default_method"]


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "mlp_regression", "--method", "sgd"],  # unknown method
        ["fit", "mlp_regression", "--samples", "0"],  # non-positive counts
        ["fit", "mlp_regression", "--chains", "-1"],
        ["fit", "mlp_regression", "--steps", "ten"],
        ["fit", "mlp_regression", "--method", "svi"],  # --out is required
    ],
)
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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "nuts", "--steps", "10"], "--steps"),
        (["--method", "svi", "--warmup", "10"], "--warmup"),
    ],
)
def test_fit_options_of_the_wrong_engine_are_refused(zoo, argv, message, tmp_path, capsys):
    assert cli.main(["fit", "mlp_regression", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------- help
def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_help_documents_every_option_with_its_default(command, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for action in _subcommands()[command]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, (command, action.dest)
        for name in action.option_strings or [action.metavar or action.dest]:
            assert name in printed, (command, name)
        if action.option_strings:  # an option says what happens when it is left out
            assert "(default: " in action.help or "(required)" in action.help, (command, action.dest)
        words = " ".join((action.help % vars(action)).split())
        assert words[:40] in printed, (command, action.dest)


# ---------------------------------------------------------------------- zoo cards
def test_zoo_name_prints_the_card_and_reference(zoo, capsys):
    assert cli.main(["zoo", "mlp_regression"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    card, ref = zoo.card("mlp_regression"), zoo.reference("mlp_regression")
    assert printed.startswith(f"mlp_regression: {card['title']}")
    for key in ("summary", "prior", "likelihood", "data"):
        assert f"{key}: {card[key][:50]}" in printed, key
    for reference in card["references"]:
        assert reference in printed
    assert f"method {card['default_method']!r}" in printed
    for method, settings in card["default_settings"].items():
        assert f"{method}: " + ", ".join(f"{k}={v!r}" for k, v in settings.items()) in printed
    assert "reference posterior" in printed and ref["provenance"]["engine"] in printed
    assert f"f(x) at {len(ref['x'])} inputs" in printed and f"{ref['f']['mean'][0]:.4g}" in printed


def test_zoo_card_of_an_entry_without_reference_says_so(zoo, capsys):
    (name, *_) = [n for n in zoo.list() if n not in ("mlp_regression", "bayesian_linear_regression")]
    with pytest.raises(FileNotFoundError):
        zoo.reference(name)
    assert cli.main(["zoo", name]) == 0
    assert "reference posterior: none" in capsys.readouterr().out


def test_zoo_unknown_name_lists_the_valid_ones(zoo, capsys):
    assert cli.main(["zoo", "mlp_regresion"]) == 2
    err = capsys.readouterr().err
    assert "unknown zoo entry 'mlp_regresion'" in err and all(n in err for n in zoo.list()) and "Traceback" not in err


# ---------------------------------------------------------------------- --out
def test_fit_refuses_a_non_empty_out_folder_before_fitting(zoo, tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    assert cli.main(["fit", "mlp_regression", "--method", "svi", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and "--overwrite" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and mine.read_text() == "my notes"


def test_fit_overwrite_replaces_only_its_own_files(zoo, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "trace.png").write_bytes(b"an old plot")
    assert _fit("mlp_regression", "svi", tmp_path, "--steps", "5", "--samples", "5", "--overwrite") == 0
    assert (tmp_path / "notes.txt").read_text() == "my notes"
    assert (tmp_path / "trace.png").read_bytes().startswith(b"\x89PNG")  # replaced by this run's plot
    assert (tmp_path / "posterior.bnn").stat().st_size > 0
    assert set(p.name for p in tmp_path.iterdir()) <= {"notes.txt", *cli._OUTPUTS}


# ---------------------------------------------------------------------- every method, --option
# Tiny settings per method: each runs through `bnn-pyro fit` in about a second.
TINY = {
    "svi": ["--steps", "5", "--samples", "5"],
    "nuts": ["--samples", "5", "--warmup", "5", "--option", "max_tree_depth=3", "--option", "jit=false"],
    "hmc": ["--samples", "5", "--warmup", "5", "--option", "num_leapfrog=3", "--option", "jit=false"],
    "metropolis": ["--samples", "5", "--warmup", "5"],
    "mala": ["--samples", "5", "--warmup", "5"],
    "sgld": ["--samples", "3", "--warmup", "3", "--option", "thin=1"],
    "sghmc": ["--samples", "3", "--warmup", "3", "--option", "thin=1"],
    "csgmcmc": ["--samples", "2", "--option", "num_cycles=2", "--option", "thin=1"],
    "swa": ["--steps", "4", "--option", "pretrain_steps=3", "--option", "collect_every=1"],
    "swag": [
        "--steps",
        "4",
        "--samples",
        "5",
        "--option",
        "pretrain_steps=3",
        "--option",
        "swag_rank=2",
        "--option",
        "collect_every=1",
        "--option",
        "burn_in=0",
    ],
    "mc_dropout": ["--steps", "5", "--samples", "5"],
    "variational_dropout": ["--steps", "5", "--samples", "5"],
    "sparse_vd": ["--steps", "5", "--samples", "5"],
    "ensemble": ["--chains", "2", "--steps", "5"],
    "laplace": ["--steps", "5", "--samples", "5", "--option", "polish_steps=1"],
    "snapshot": ["--option", "num_cycles=2", "--option", "cycle_length=3"],
    "subspace": [
        "--samples",
        "3",
        "--option",
        "subspace_dim=2",
        "--option",
        'inner_options={"num_warmup": 3, "jit": false}',
        "--option",
        'swa={"pretrain_steps": 3, "num_steps": 4, "collect_every": 1, "rank": 2}',
    ],
}


def test_tiny_settings_cover_every_registered_method():
    assert set(TINY) == {m.value for m in Method}


def _config(argv: list[str]) -> tuple[str, dict]:
    args = cli._parser().parse_args(["fit", "mlp_regression", "--out", "unused", *argv])
    return args.method, cli._fit_config(args.method, args)


def test_subspace_json_options_become_the_typed_configs():
    """--option swa={...} / inner_options={...} (JSON: the CLI cannot spell a config) reach bp.fit as the typed
    configs, so that a CLI user sees no deprecation they cannot act on; an unknown field is a usage error."""
    from bnn_pyro.infer.mcmc import NUTSConfig
    from bnn_pyro.infer.svi import SVIConfig
    from bnn_pyro.infer.swag import SWAGConfig

    _, config = _config(["--method", "subspace", *TINY["subspace"]])
    assert "inner_options" not in config
    assert config["inner"] == NUTSConfig(num_warmup=3, jit=False, dense_mass=True)
    assert config["swa"] == SWAGConfig(pretrain_steps=3, num_steps=4, collect_every=1, swag_rank=2)
    _, config = _config(["--method", "subspace", "--option", "inner=svi", "--option", 'inner_options={"num_steps": 5}'])
    assert config["inner"] == SVIConfig(num_steps=5)
    with pytest.raises(cli._Usage, match=r"--option swa / inner_options: .*num_step"):
        _config(["--method", "subspace", "--option", 'inner_options={"num_step": 5}'])


@pytest.mark.parametrize("method", [m.value for m in Method])
def test_flags_and_options_map_to_the_method_s_own_option_names(method):
    name, config = _config(["--method", method, *TINY[method], "--seed", "3", "--no-progress"])
    options = cli._method_options(method)
    assert name == method and set(config) <= set(options)
    assert config["seed"] == 3 and config["progress"] is False
    # --chains is num_chains; not given, the method's own default applies (the CLI sets none of its own)
    assert config.get("num_chains") == (2 if "--chains" in TINY[method] else None)
    for flag, option in (("--samples", "num_samples"), ("--warmup", "num_warmup"), ("--steps", "num_steps")):
        if flag in TINY[method]:
            assert config[option] == int(TINY[method][TINY[method].index(flag) + 1])
    inspect.signature(engine(method)).bind(
        None, None, **{k: v for k, v in config.items() if k not in cli._FIT_OPTIONS}
    )  # Python accepts them


@pytest.mark.parametrize("method", [m.value for m in Method])
def test_every_registered_method_fits_through_the_cli(method, zoo, tmp_path, capsys, monkeypatch):
    # the plots take most of a run's time and are the same for every method (tested above): skip them
    monkeypatch.setattr(cli, "_write_outputs", lambda post, entry, out: [post.save(out / "posterior.bnn")])
    assert _fit("mlp_regression", method, tmp_path / "run", *TINY[method]) == 0
    printed = capsys.readouterr().out
    assert f"by {method}" in printed and "metrics" in printed
    import bnn_pyro as bp

    post = bp.load(tmp_path / "run" / "posterior.bnn")
    assert post.method == method and post.num_chains == 2


@pytest.mark.parametrize(
    "text, value",
    [
        ("lr=0.01", 0.01),
        ("rank=10", 10),
        ("jit=False", False),
        ("dense_mass=true", True),
        ("init=None", None),
        ("checkpoint=null", None),
        ("guide=low_rank", "low_rank"),
        ("lr=1e-3", 1e-3),
        ("lr_schedule= cosine ", "cosine"),
        ('swa={"pretrain_steps": 3, "lr": 0.01}', {"pretrain_steps": 3, "lr": 0.01}),
    ],
)
def test_option_values_are_parsed_as_documented(text, value):
    key, parsed = cli._key_value(text)
    assert key == text.split("=")[0] and parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "swag", "--option", "swag_rnak=4"], "did you mean 'swag_rank'"),
        (["--method", "svi", "--option", "num_samples=4"], "set it with --samples"),
        (["--method", "svi", "--option", "lr=0.1", "--option", "lr=0.2"], "given twice"),
        (["--method", "csgmcmc", "--warmup", "10"], "--warmup does not apply to method 'csgmcmc'"),
        (["--method", "ensemble", "--samples", "10"], "--samples does not apply to method 'ensemble'"),
        (["--method", "swa", "--option", "rank=3"], "not an option of method 'swa'"),
    ],
)
def test_options_the_method_does_not_have_are_refused(zoo, argv, message, tmp_path, capsys):
    assert cli.main(["fit", "mlp_regression", "--out", str(tmp_path / "run"), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["lr", "=3", "not a key=1"])
def test_malformed_option_exits_with_usage(text, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["fit", "mlp_regression", "--out", str(tmp_path), "--option", text])
    assert stop.value.code == 2 and "expected KEY=VALUE" in capsys.readouterr().err


# ---------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_during_a_fit_stops_with_one_line_and_status_130(tmp_path):
    """SIGINT to `bnn-pyro fit` was a Python traceback and death by signal; now: one line that says nothing was
    written and how to resume from the checkpoint, exit status 130, no output file."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    ckpt.mkdir()
    command = [
        sys.executable,
        "-m",
        "bnn_pyro.cli",
        "fit",
        "mlp_regression",
        "--method",
        "svi",
        "--chains",
        "1",
        "--steps",
        "1000000",
        "--no-progress",
        "--out",
        str(out),
        "--option",
        f"checkpoint={ckpt}",
        "--option",
        "checkpoint_every=20",
    ]
    # cwd: the installed package, not the checkout's bnn_pyro/ (which has no models/: setup.cfg maps it in)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "chain0.ckpt").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (ckpt / "chain0.ckpt").exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(
        rf"bnn-pyro: interrupted; nothing was written to --out '{re.escape(str(out))}'; the fit's "
        rf"checkpoints are in '{re.escape(str(ckpt))}': run the same command with --option "
        r"resume=true to continue it\.",
        lines[0],
    ), lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_ctrl_c_while_writing_outputs_leaves_no_partial_file(zoo, tmp_path, capsys, monkeypatch):
    """Interrupted between two output files: none of this run's files appear in --out, and with --overwrite the
    previous run's files stay as they were."""
    (tmp_path / "trace.png").write_bytes(b"an old plot")

    def interrupted(fig, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_savefig", interrupted)  # after posterior.bnn and inference_data.nc are written
    assert _fit("mlp_regression", "svi", tmp_path, "--steps", "5", "--samples", "5", "--overwrite") == 130
    assert capsys.readouterr().err == f"bnn-pyro: interrupted; nothing was written to --out {str(tmp_path)!r}.\n"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.png"] and (
        tmp_path / "trace.png"
    ).read_bytes() == b"an old plot"
