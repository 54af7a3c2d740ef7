"""bnn_pyro's warnings name the user's line (bnn_pyro/utils/user_warnings.py): a health warning at the end of ``bp.fit``,
one from ``Posterior.summary``, an option warning raised while ``bp.fit`` resolves ``init=``, and a
DeprecationWarning, each attributed to this file and to the line of the call that raised it."""

from __future__ import annotations

import inspect
import warnings

import torch

import bnn_pyro as bp
from bnn_pyro.posterior.diagnostics import DiagnosticWarning
from bnn_pyro.utils import user_warnings


def _data():
    x = torch.linspace(-2, 2, 40).unsqueeze(-1)
    return x, torch.sin(2 * x).squeeze(-1)


def _model(*modules: torch.nn.Module) -> bp.BNN:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), *modules)
    return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))


def _next_line() -> int:
    """The line after the caller's current one: where the call under test sits."""
    return inspect.currentframe().f_back.f_lineno + 1


def _where(record, category) -> set[tuple[str, int]]:
    return {(w.filename, w.lineno) for w in record if issubclass(w.category, category)}


def test_a_health_warning_at_the_end_of_fit_and_one_from_summary_point_at_the_callers_lines():
    x, y = _data()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_line = _next_line()
        post = bp.fit(
            _model(), x, y, method="nuts", num_samples=10, num_warmup=10, num_chains=1, seed=0, progress=False
        )
        assert _where(record, DiagnosticWarning) == {(__file__, fit_line)}  # was ("sys", 1) before
        record.clear()
        summary_line = _next_line()
        post.summary(space="function")
    assert _where(record, DiagnosticWarning) == {(__file__, summary_line)}


class _Shift(torch.nn.Module):
    """A module with a parameter and no reset_parameters(): ``init="reset"`` cannot redraw it."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(1))

    def forward(self, h):
        return h + self.shift


def test_an_option_warning_raised_while_fit_resolves_init_points_at_the_fit_call():
    x, y = _data()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _next_line()
        bp.fit(_model(_Shift()), x, y, method="svi", num_chains=2, num_steps=5, init="reset", seed=0, progress=False)
    init_warnings = [w for w in record if "reset_parameters" in str(w.message)]
    assert init_warnings and {(w.filename, w.lineno) for w in init_warnings} == {(__file__, line)}


def test_a_deprecation_warning_points_at_the_user_so_that_python_shows_it_in_scripts():
    """Python shows a DeprecationWarning by default only when it is attributed to ``__main__``: the user's code."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _next_line()
        user_warnings.warn("an old option name", DeprecationWarning)
    assert [(w.filename, w.lineno, w.category) for w in record] == [(__file__, line, DeprecationWarning)]


def test_find_stack_level_skips_every_bnn_pyro_frame_up_to_the_outermost():
    """Called through bnn_pyro code that calls back into the user's code that calls bnn_pyro again (a custom
    prior inside ``bp.fit``), the warning goes to the outer user frame that entered bnn_pyro first."""
    namespace = {"__name__": "bnn_pyro.fake_inner", "user_warnings": user_warnings}
    inner = compile("def lib(callback):\n    return callback()\n", user_warnings.PACKAGE_DIR + "fake_inner.py", "exec")
    exec(inner, namespace)

    def user_callback():
        user_warnings.warn("from a callback", UserWarning)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _next_line()
        namespace["lib"](user_callback)
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


def test_every_warning_in_the_library_goes_through_user_warnings():
    """A ``warnings.warn`` with a hand-counted ``stacklevel`` goes stale when a call path changes; only
    user_warnings.py itself calls it, and utils/moved.py, whose warning fires inside the import system: there
    ``warnings.warn``'s own stacklevel counting skips importlib's frames, which a frame walk cannot tell apart."""
    import re
    from pathlib import Path

    package = Path(user_warnings.PACKAGE_DIR)
    direct = [
        f"{path.relative_to(package.parent)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name not in ("user_warnings.py", "moved.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bwarnings\.warn\(|stacklevel=", line)
    ]
    assert not direct, f"use bnn_pyro.utils.user_warnings.warn instead of warnings.warn / stacklevel at {direct}"


def test_speaking_for_renames_only_the_named_methods_warnings_and_only_inside_the_block():
    """An engine run inside another (subspace's inner NUTS) has its warnings renamed to what the user called; other
    messages, and every message after the block, are as issued, and all still point at the caller's line."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with user_warnings.speaking_for("nuts", "subspace (inner nuts)"):
            line = _next_line()
            user_warnings.warn("nuts: 3% of the draws diverged", DiagnosticWarning)
            user_warnings.warn("nutshell: not the method's name", DiagnosticWarning)
            user_warnings.warn("subspace: the fit's own", DiagnosticWarning)
        user_warnings.warn("nuts: after the block", DiagnosticWarning)
    assert [str(w.message) for w in record] == [
        "subspace (inner nuts): 3% of the draws diverged",
        "nutshell: not the method's name",
        "subspace: the fit's own",
        "nuts: after the block",
    ]
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_speaking_for_appends_its_note_and_keeps_its_documented_scope():
    """The note (where the inner engine's options go) ends every renamed message, and only those; a nested block
    that raises restores the outer label; a thread started inside the block begins with an empty context (unless
    Python's thread_inherit_context flag is set; the docstring's limit), unless run in a copy of the caller's."""
    import contextvars
    import sys
    import threading

    def in_thread(target):
        t = threading.Thread(target=target)
        t.start()
        t.join()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with user_warnings.speaking_for("nuts", "subspace (inner nuts)", "(options: inner=NUTSConfig(...).)"):
            user_warnings.warn("nuts: few draws.", DiagnosticWarning)
            user_warnings.warn("subspace: the fit's own.", DiagnosticWarning)
            try:
                with user_warnings.speaking_for("svi", "other (inner svi)"):
                    raise RuntimeError
            except RuntimeError:
                pass
            user_warnings.warn("nuts: after a raising nested block.", DiagnosticWarning)
            in_thread(lambda: user_warnings.warn("nuts: from a thread.", DiagnosticWarning))
            context = contextvars.copy_context()
            in_thread(lambda: context.run(user_warnings.warn, "nuts: from a copied context.", DiagnosticWarning))
    thread = "subspace (inner nuts): from a thread. (options: inner=NUTSConfig(...).)"
    assert [str(w.message) for w in record] == [
        "subspace (inner nuts): few draws. (options: inner=NUTSConfig(...).)",
        "subspace: the fit's own.",
        "subspace (inner nuts): after a raising nested block. (options: inner=NUTSConfig(...).)",
        thread if getattr(sys.flags, "thread_inherit_context", 0) else "nuts: from a thread.",
        "subspace (inner nuts): from a copied context. (options: inner=NUTSConfig(...).)",
    ]
