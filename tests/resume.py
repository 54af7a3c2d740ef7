"""A spy on checkpoint resumes, for the tests that a resumed run is bit-identical to an uninterrupted one.

A seeded run that ignored its checkpoint and started again from step 0 gives the same bits as a true resume, so
those tests also need to know that the resumed run read the saved state and ran only the steps after it. Every
engine asks :meth:`Checkpoint.due` once per step (after ``step`` steps, 1-based) and reads its file through
:meth:`Checkpoint.load`; :class:`ResumeSpy` records both, per chain file.
"""

from __future__ import annotations

from bnn_pyro.infer import checkpoint as ckpt_mod


class ResumeSpy:
    """``ResumeSpy(monkeypatch)`` records, per chain file name (``"chain0.ckpt"``), the step that
    :meth:`Checkpoint.load` returned (``None``: it started afresh) and the steps asked about by
    :meth:`Checkpoint.due`; :meth:`check` asserts a true resume. Install it just before the resumed fit."""

    def __init__(self, monkeypatch):
        self.loaded: dict[str, int | None] = {}
        self.steps: dict[str, list[tuple[int, int]]] = {}
        load, due = ckpt_mod.Checkpoint.load, ckpt_mod.Checkpoint.due

        def spy_load(ckpt):
            saved = load(ckpt)
            self.loaded[ckpt.path.name] = None if saved is None else saved[1]["step"]
            return saved

        def spy_due(ckpt, step, num_steps):
            self.steps.setdefault(ckpt.path.name, []).append((step, num_steps))
            return due(ckpt, step, num_steps)

        monkeypatch.setattr(ckpt_mod.Checkpoint, "load", spy_load)
        monkeypatch.setattr(ckpt_mod.Checkpoint, "due", spy_due)

    def check(self, resumed_from: int, *, chain: str = "chain0.ckpt") -> None:
        """The chain's file was read and gave the state after ``resumed_from`` steps, and the run then took
        exactly the steps ``resumed_from + 1 .. total`` (``total - resumed_from`` of them), none before."""
        assert self.loaded.get(chain) == resumed_from, (chain, self.loaded)
        steps = self.steps.get(chain, [])
        assert steps, f"{chain}: the resumed run took no step"
        total = steps[-1][1]
        assert [s for s, _ in steps] == list(range(resumed_from + 1, total + 1)), (chain, steps[:3], len(steps))
