"""The command line: the demo runs, bad arguments exit non-zero with a message."""

from __future__ import annotations

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
