"""Progress display (bnn_pyro/infer/progress.py): tqdm's bar on a terminal; off a terminal, a plain line every
LINE_INTERVAL seconds and a final one, never carriage returns; nothing at all with progress=False."""

from __future__ import annotations

import io

import pytest
import torch
from tqdm.auto import tqdm

import bnn_pyro as bp
from bnn_pyro.infer import progress
from bnn_pyro.infer.progress import LINE_INTERVAL, LineProgress, progress_bar


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class _Clock:
    """``time.monotonic`` that moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(monkeypatch, tty: bool, enabled: bool, steps: int = 100, seconds_per_step: float = 1.0) -> str:
    stream, clock = _Stream(tty), _Clock()
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(progress.time, "monotonic", clock)
    with progress_bar(steps, "svi chain 0", enabled) as bar:
        for _ in range(steps):
            clock.now += seconds_per_step
            bar.set_postfix(loss="1.5", refresh=False)
            bar.update()
    return stream.getvalue()


def test_off_a_terminal_one_plain_line_every_interval_and_a_final_one(monkeypatch):
    text = _run(monkeypatch, tty=False, enabled=True, steps=100, seconds_per_step=1.0)
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 100 // int(LINE_INTERVAL) + 1  # one per interval, then the final line
    assert lines[0].startswith(f"svi chain 0: {int(LINE_INTERVAL)}/100 (10%)") and "loss=1.5" in lines[0]
    assert lines[-1].startswith("svi chain 0: 100/100 (100%)") and lines[-1].endswith("done")


def test_a_short_run_off_a_terminal_prints_only_its_final_line(monkeypatch):
    lines = _run(monkeypatch, tty=False, enabled=True, steps=20, seconds_per_step=0.01).splitlines()
    assert len(lines) == 1 and lines[0].startswith("svi chain 0: 20/20")


def test_on_a_terminal_the_bar_is_tqdms(monkeypatch):
    monkeypatch.setattr("sys.stderr", _Stream(tty=True))
    with progress_bar(10, "x", True) as bar:
        assert isinstance(bar, tqdm) and not bar.disable
    monkeypatch.setattr("sys.stderr", _Stream(tty=False))
    with progress_bar(10, "x", True) as bar:
        assert isinstance(bar, LineProgress)


@pytest.mark.parametrize("tty", [True, False])
def test_progress_false_prints_nothing_in_either_mode(monkeypatch, tty):
    assert _run(monkeypatch, tty=tty, enabled=False) == ""


def test_a_default_fit_with_stderr_captured_prints_plain_lines_not_a_carriage_return_flood(capsys):
    """pytest's captured stderr is not a terminal, as a CI log or a headless notebook's is."""
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 30).unsqueeze(-1)
    net = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    bp.fit(model, x, torch.sin(x).squeeze(-1), method="svi", num_steps=50, num_samples=10, seed=0)  # progress default
    err = capsys.readouterr().err
    assert "\r" not in err
    final = [line for line in err.splitlines() if "50/50" in line]
    assert len(final) == 1 and final[0].endswith("done")
