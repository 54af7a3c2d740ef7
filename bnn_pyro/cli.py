"""The ``bnn-pyro`` command line.

``bnn-pyro demo`` fits a 1-50-1 tanh BNN to the bundled gap data by SVI and prints how the
predictive uncertainty grows inside the gap. ``bnn-pyro zoo`` lists the model zoo and
``bnn-pyro zoo NAME`` prints an entry's card. ``bnn-pyro fit ENTRY --method nuts --chains 2 --out DIR``
fits a zoo entry by any registered method (``--option KEY=VALUE`` sets the method's other options),
prints its function-space summary and metrics, and writes the posterior, its InferenceData and plots
into ``DIR`` (which must be new or empty, unless ``--overwrite``). ``bnn-pyro compare ENTRY_OR_CSV --methods
svi,nuts --out DIR`` runs :func:`bnn_pyro.compare` on a zoo entry or a CSV file and writes its table and
figures. Bad arguments exit with status 2
and a message, never a traceback, before any fitting.

Example
-------
.. code-block:: bash

    bnn-pyro zoo mlp_regression
    bnn-pyro fit mlp_regression --method nuts --chains 2 --samples 200 --out runs/mlp
    bnn-pyro fit mlp_regression --method swag --steps 500 --option swag_rank=10 --out runs/swag
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import torch

__all__ = ["main"]

_TRACE_SCALARS = 4
_WIDTH = 100  # card text is wrapped to this many columns


def _demo(args) -> int:
    import bnn_pyro as bp
    from bnn_pyro.data import datasets

    x, y = datasets.toy_gap()
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    print(f"bnn-pyro demo: {len(x)} points with a gap in (-0.5, 0.5); 1-50-1 tanh BNN, Normal(0, 1) prior")
    start = time.perf_counter()
    post = bp.fit(
        model,
        x,
        y,
        method="svi",
        guide=args.guide,
        num_steps=args.steps,
        lr=0.03,
        lr_schedule="cosine",
        num_samples=500,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(
        f"fitted by SVI ({args.guide} guide, {args.steps} steps) in {time.perf_counter() - start:.1f} s; "
        f"final negative ELBO {post.history['loss'][0, -50:].mean():.1f}"
    )
    grid = torch.tensor([[-1.5], [-0.75], [0.0], [0.75], [1.5], [3.0]])
    pred = post.predict(grid, seed=args.seed)
    print(f"\n{'x':>6} {'region':>9} {'mean':>7} {'epistemic':>10} {'aleatoric':>10} {'95% interval':>18}")
    for i, v in enumerate(grid[:, 0].tolist()):
        region = "gap" if abs(v) < 0.5 else ("outside" if abs(v) > 2 else "data")
        print(
            f"{v:6.2f} {region:>9} {pred.mean[i]:7.3f} {pred.epistemic_std[i]:10.3f} {pred.aleatoric_std[i]:10.3f} "
            f"   [{pred.lower[i]:6.2f}, {pred.upper[i]:6.2f}]"
        )
    train = post.predict(x, seed=args.seed)
    rmse = (train.mean - y).pow(2).mean().sqrt()
    print(f"\ntraining RMSE {rmse:.3f} (noise sd 0.1)")
    print(
        "Gaussian variational families are known to understate the uncertainty between clusters "
        "(Foong et al. 2019); refit with method='nuts' to compare."
    )
    return 0


# ---------------------------------------------------------------------- zoo
def _zoo(args) -> int:
    from bnn_pyro.data import zoo

    names = zoo.list()
    if args.entry is not None:
        _print_card(_entry_name(args.entry, names))
        return 0
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name + ':':<{width + 1}} {zoo.card(name)['title']}")
    return 0


def _entry_name(name: str, names: list[str]) -> str:
    if name not in names:
        raise _Usage(f"unknown zoo entry {name!r}; choose one of: {', '.join(names)} (see `bnn-pyro zoo`).")
    return name


def _print_card(name: str) -> None:
    """An entry's card, one labelled paragraph per field, then its reference posterior (if any)."""
    from bnn_pyro.data import zoo

    card = zoo.card(name)
    print(f"{name}: {card.pop('title')}\n")
    method, settings = card.pop("default_method"), card.pop("default_settings")
    references = card.pop("references")
    for key, text in card.items():  # summary, prior, likelihood, data (and any field added later)
        _field(key, str(text))
    _field(
        "default",
        f"method {method!r}; the entry's settings per method (`bnn-pyro fit {name} --method M` "
        "starts from those of M; flags and --option override them):",
    )
    for m, config in settings.items():
        _field(f"  {m}", _pairs(config))
    print("references:")
    for ref in references:
        print(textwrap.fill(ref, _WIDTH, initial_indent="  - ", subsequent_indent="    ", break_on_hyphens=False))
    try:
        _print_reference(zoo.reference(name))
    except FileNotFoundError:
        print("\nreference posterior: none")
    print(f"\ntry: bnn-pyro fit {name} --method {method} --out runs/{name}")


def _print_reference(ref: dict) -> None:
    prov, accept = ref["provenance"], ref["acceptance"]
    print("\nreference posterior (bp.zoo.reference):")
    _field(
        "  engine",
        f"{prov['engine']}; settings {_pairs(prov.get('settings', {}))}"
        + (f"; hyper-parameters {_pairs(ref['hyper'])}" if ref.get("hyper") else ""),
    )
    run = [
        f"{prov['divergences']} divergent transitions" if "divergences" in prov else None,
        f"{prov['wall_time_s']:.0f} s" if "wall_time_s" in prov else None,
        prov.get("date"),
        prov.get("note"),
    ]
    if any(run):
        _field("  run", "; ".join(r for r in run if r))
    checks = accept.get("checks")
    checks = (
        ", ".join(f"{k}: {'pass' if ok else 'FAIL'}" for k, ok in checks.items())
        if checks
        else accept.get("criteria", "")
    )
    _field("  accepted", f"{'yes' if accept.get('accepted') else 'NO'} ({checks})")
    f = ref["f"]
    columns = [c for c in ("mean", "sd", "r_hat", "ess_bulk") if c in f]
    print(f"  f(x) at {len(ref['x'])} inputs:")
    print(f"    {'x':>16} " + " ".join(f"{c:>9}" for c in columns))
    for i, x in enumerate(ref["x"]):
        inputs = ", ".join(f"{round(v, 6) + 0.0:.3g}" for v in x)  # + 0.0: no "-0"
        print(f"    {inputs:>16} " + " ".join(f"{f[c][i]:9.4g}" for c in columns))


def _pairs(config: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _field(label: str, text: str) -> None:
    print(
        textwrap.fill(
            text, _WIDTH, initial_indent=f"{label + ':':<13}", subsequent_indent=" " * 13, break_on_hyphens=False
        )
    )


# ---------------------------------------------------------------------- fit
def _fit(args) -> int:
    import pandas as pd

    from bnn_pyro.data import zoo

    name = _entry_name(args.entry, zoo.list())
    method = args.method or zoo.card(name)["default_method"]
    overrides = _fit_config(method, args)
    out = _output_folder(args.out, overwrite=args.overwrite)

    entry = zoo.load(name)
    shown = ", ".join(f"{k}={v!r}" for k, v in overrides.items() if k != "progress")
    print(
        f"bnn-pyro fit: {entry.name} ({entry.card['title']}) by {method} ({shown}; other settings: the entry's, "
        "else the method's)"
    )
    start = time.perf_counter()
    post = entry.fit(method=method, **overrides)
    print(f"fitted in {time.perf_counter() - start:.1f} s: {post!r}\n")

    with pd.option_context("display.width", 120, "display.max_columns", 20, "display.max_rows", 40):
        _print_summaries(post)
    print("\nmetrics (held-out data):" if entry.x_test is not None else "\nmetrics:")
    for metric, value in entry.evaluate(post).items():
        print(f"  {metric:<22} {value:.4f}" if isinstance(value, float) else f"  {metric:<22} {value}")

    print(f"\nwriting to {out}/")
    for path in _write_outputs(post, entry, out):
        print(f"  {path.name}")
    return 0


# ---------------------------------------------------------------------- methods and their options
# Flags with a name of their own -> the options they set (the first one the method has).
# The flags carry the library's option names and, when not given, its defaults (docs/options.md).
_FLAGS = {
    "--chains": ("num_chains",),
    "--samples": ("num_samples",),
    "--warmup": ("num_warmup",),
    "--steps": ("num_steps",),
    "--seed": ("seed",),
    "--no-progress": ("progress",),
}


_FIT_OPTIONS = ("batch_size", "num_threads")  # bp.fit's own keywords that the CLI offers, for every method


def _method_options(method: str) -> dict[str, object]:
    """The keyword options ``bp.fit(..., method=method)`` takes, with their defaults (less ``dataset_size``,
    which only a loader needs): :func:`bnn_pyro.infer.options`."""
    from bnn_pyro import infer

    return {k: v for k, v in infer.options(method).items() if k != "dataset_size"}


def _fit_config(method: str, args) -> dict[str, object]:
    """``bp.fit`` keywords from the flags and ``--option KEY=VALUE`` pairs, checked against the method's
    options; a flag or key the method does not have is a usage error naming what it has."""
    from bnn_pyro import infer

    options = _method_options(method)
    given = {
        "--chains": args.chains,
        "--samples": args.samples,
        "--warmup": args.warmup,
        "--steps": args.steps,
        "--seed": args.seed,
        "--no-progress": False if args.no_progress else None,
    }
    config = {}
    for flag, value in given.items():
        names = [n for n in _FLAGS[flag] if n in options]
        if value is not None and not names:
            raise _Usage(
                f"{flag} does not apply to method {method!r} (it has no {' or '.join(_FLAGS[flag])} "
                f"option); drop {flag}, or set one of its options with --option KEY=VALUE: "
                f"{', '.join(options)}."
            )
        if value is not None:
            config[names[0]] = value
    for key, default in (("seed", 0), ("progress", True)):
        if key in options:
            config.setdefault(key, default)
    for key, value in args.option:
        flag = next((f for f, names in _FLAGS.items() if key in names), None)
        if flag is not None:
            raise _Usage(f"--option {key}: set it with {flag} instead (see `bnn-pyro fit --help`).")
        if key not in options and key not in infer.REGISTRY[infer.Method(method)].renamed():  # old names warn
            close = difflib.get_close_matches(key, options, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _Usage(
                f"--option {key}: not an option of method {method!r}; {hint}choose one of: {', '.join(options)}."
            )
        if key in config:
            raise _Usage(f"--option {key} is given twice; keep one.")
        config[key] = value
    return _typed_subspace_options(config) if method == "subspace" else config


def _typed_subspace_options(config: dict) -> dict:
    """Subspace's JSON options as the typed configs the library takes (its dict forms are deprecated):
    ``swa={...}`` as a ``SWAGConfig``, ``inner_options={...}`` as the inner engine's config (NUTS and HMC with the
    dense mass matrix that subspace gives them when named by a string)."""
    from bnn_pyro.infer import REGISTRY, Method
    from bnn_pyro.infer.swag import SWAGConfig

    config = dict(config)
    try:
        if isinstance(config.get("swa"), dict):
            swa = {("swag_rank" if k == "rank" else k): v for k, v in config["swa"].items()}
            config["swa"] = SWAGConfig(**swa)
        inner = config.get("inner", "nuts")
        if (
            isinstance(config.get("inner_options"), dict)
            and isinstance(inner, str)
            and inner in Method._value2member_map_
        ):
            options = dict(config.pop("inner_options"))
            if inner in ("nuts", "hmc"):
                options.setdefault("dense_mass", True)
            config["inner"] = REGISTRY[Method(inner)].fit_function().config_type(**options)
    except TypeError as err:  # an unknown field: the config's own message names it
        raise _Usage(
            f"--option swa / inner_options: {err} (the fields of bp.infer.swag.SWAGConfig, or bp.infer.options(inner)'s names)."
        ) from None
    return config


def _key_value(text: str) -> tuple[str, object]:
    """``--option KEY=VALUE``: VALUE is None (``none``, ``null``), a bool (``true``, ``false``; any
    case), an int, a float, a JSON object (``{...}``: a dict option such as subspace's ``swa``), else the
    text itself."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE with KEY an option name, got {text!r}; e.g. --option lr=0.01"
        )
    if raw.lower() in ("none", "null"):
        return key, None
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    if raw.startswith("{"):
        try:
            return key, json.loads(raw)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(
                f"--option {key}: {raw!r} is not a JSON object ({err}); write e.g. {key}='{{\"pretrain_steps\": 100}}'."
            ) from None
    return key, raw


def _print_summaries(post) -> None:
    """The function-space table (what to judge a BNN by), then a one-line digest of the weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = post.summary(space="function")
            print(
                "summary in function space (f(x) at up to 20 training inputs; weight-space R-hat misleads "
                "for BNNs, whose weights can be permuted and sign-flipped without changing f):"
            )
        except ValueError as err:  # a Pyro function model without the site "f"
            print(f"function-space summary unavailable ({err}); weight-space summary:")
            table = post.summary(space="weights")
        print(table.round(3).to_string())
        weights = post.summary(space="weights", warn=False)
        print(
            f"\nweight space ({len(weights)} scalars): max R-hat {weights['r_hat'].max():.3f}, "
            f"min bulk ESS {weights['ess_bulk'].min():.0f}, min tail ESS {weights['ess_tail'].min():.0f}"
        )
    for note in table.attrs.get("notes", []):
        print(f"note: {note}")
    for w in caught:
        if issubclass(w.category, UserWarning):
            print(f"warning: {w.message}")


def _write_outputs(post, entry, out: Path) -> list[Path]:
    """Write the outputs into a hidden folder in ``out``, then move them into ``out``: an interrupted or failed
    write leaves no partial file there (and, with ``--overwrite``, the previous run's files unchanged)."""
    final, out = out, Path(tempfile.mkdtemp(prefix=".bnn-pyro-", dir=out))  # moved into place once all are written
    try:
        moved = []
        for path in _write_all_outputs(post, entry, out):
            os.replace(path, final / path.name)
            moved.append(final / path.name)
        return moved
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _write_all_outputs(post, entry, out: Path) -> list[Path]:
    import arviz as az
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bnn_pyro.posterior import diagnostics, plots

    written = [post.save(out / "posterior.bnn")]
    path = out / "inference_data.nc"
    if importlib.util.find_spec("h5netcdf") is None:  # ArviZ's netCDF engine is optional
        print(f"  (skipped {path.name}: writing netCDF needs the h5netcdf package; pip install h5netcdf)")
    else:
        post.to_inference_data().to_netcdf(str(path), engine="h5netcdf")
        written.append(path)

    params = _trace_params(post)
    with plots.arviz_plotting():
        axes = az.plot_trace(diagnostics.from_dict(posterior=plots.scalars(post, params)), compact=False)
    axes.ravel()[0].figure.tight_layout()
    written.append(_savefig(axes.ravel()[0].figure, out / "trace.png"))
    x_plot = entry.x if entry.x_test is None else entry.x_test
    y_plot = entry.y if entry.y_test is None else entry.y_test
    if entry.task == "classification":
        written.append(_savefig(post.plot_reliability(x_plot, y_plot), out / "reliability.png"))
    elif post.x is not None and post.x.dim() == 2 and post.x.shape[1] == 1:
        written.append(_savefig(post.plot_predictive(), out / "predictive.png"))
    else:
        print(f"  (no predictive band: inputs have {tuple(entry.x.shape[1:])} features, the band needs 1)")
    plt.close("all")
    return written


def _trace_params(post) -> list[str]:
    """A few scalars for the trace plot: scalar sites (noise, global scales) first, then the first
    entry of each tensor site."""
    scalar = [n for n, v in post.samples.items() if v[0, 0].numel() == 1]
    first = [f"{n}[{', '.join(['0'] * (v.dim() - 2))}]" for n, v in post.samples.items() if v[0, 0].numel() > 1]
    return (scalar + first)[:_TRACE_SCALARS]


def _savefig(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


_OUTPUTS = ("posterior.bnn", "inference_data.nc", "trace.png", "predictive.png", "reliability.png")


def _output_folder(text: str, *, overwrite: bool) -> Path:
    """``--out``, created if missing; an existing folder must be empty unless ``overwrite`` (then only
    the files in :data:`_OUTPUTS` are replaced; nothing else there is touched)."""
    out = Path(text)
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
        raise _Usage(
            f"--out {text!r} already exists and is not empty ({len(present)} entries: {shown}); choose a "
            f"new or empty folder, or pass --overwrite to replace the files this command writes "
            f"({', '.join(_OUTPUTS)}) and keep every other file."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise _Usage(f"--out {text!r} is not a writable folder ({err.strerror or err}); choose another path.") from None
    return out


# ---------------------------------------------------------------------- compare
_COMPARE_OUTPUTS = ("table.csv", "table.md", "rows.csv", "test_ll.png", "predictive.png", "reliability.png")


def _compare(args) -> int:
    """``bnn-pyro compare``: :func:`bnn_pyro.compare` on a zoo entry or a CSV file; the table printed and saved."""
    import shutil

    import pandas as pd

    import bnn_pyro as bp
    from bnn_pyro.comparison import sources
    from bnn_pyro.data import zoo
    from bnn_pyro.infer import Method

    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    if Path(args.source).suffix.lower() == ".csv" or Path(args.source).is_file():
        source = sources.from_csv(args.source, target=args.target, task=args.task, seed=args.seed)
    else:
        if args.target is not None or args.task is not None:
            raise _Usage("--target and --task are for a CSV file; a zoo entry has its own target and task.")
        source = sources.from_zoo(_entry_name(args.source, zoo.list()), methods, zoo.load)
    options = source.options
    for method, (key, value) in args.option:
        known = _method_options(method) if method in [m.value for m in Method] else None
        if known is None or key not in known:
            raise _Usage(
                f"--option {method}:{key}: "
                + (
                    f"not a method; choose one of {', '.join(m.value for m in Method)}."
                    if known is None
                    else f"not an option of {method}; choose one of: {', '.join(known)}."
                )
            )
        options.setdefault(method, {})[key] = value
    out = Path(args.out)
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not (args.overwrite or args.resume):
        raise _Usage(
            f"--out {args.out!r} already exists and is not empty ({', '.join(present[:3])}"
            f"{', ...' if len(present) > 3 else ''}); choose a new folder, pass --resume to go on from its "
            f"cache/, or --overwrite to replace {', '.join(_COMPARE_OUTPUTS)} and cache/ (other files are kept)."
        )
    if args.overwrite and (out / "cache").is_dir():
        shutil.rmtree(out / "cache")
    splits = args.splits if args.splits is not None else (None if source.test is not None else 5)
    print(
        f"bnn-pyro compare: {source.title}; "
        + (f"{splits}-fold cross-validation" if splits else "the entry's test split")
    )
    result = bp.compare(
        source.model,
        source.x,
        source.y,
        methods=methods,
        test=None if splits else source.test,
        splits=splits,
        options=options,
        seed=args.seed,
        progress=not args.no_progress,
        cache=out / "cache",
        time_limit=args.time_limit,
    )
    result.table = sources.to_original_units(result.table, source.y_scale)
    result.rows = sources.to_original_units(result.rows, source.y_scale)
    shown = result.table[[c for c in result.table.columns if c != "warnings" and not c.endswith("_se")]]
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.max_colwidth", 40):
        print(shown.round(4).to_string())  # standard errors and warnings: in table.csv and table.md
    print(f"\n{len(result.table)} methods in {result.total_s:.1f} s; writing to {out}/")
    for path in result.save(out):
        print(f"  {path.name}")
    return 0


def _method_key_value(text: str) -> tuple[str, tuple[str, object]]:
    """``--option METHOD:KEY=VALUE`` (VALUE read as for ``bnn-pyro fit --option``)."""
    method, sep, pair = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected METHOD:KEY=VALUE, got {text!r}; e.g. --option nuts:num_samples=200")
    return method.strip(), _key_value(pair)


class _Usage(ValueError):
    """A bad command-line argument found after parsing: a message and exit status 2."""


# ---------------------------------------------------------------------- parsing
def _parser() -> argparse.ArgumentParser:
    from bnn_pyro.infer import Method

    parser = argparse.ArgumentParser(prog="bnn-pyro", description="Bayesian neural networks in Pyro.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="fit a BNN to the bundled 1-D gap data and show its uncertainty",
        description="Fit a 1-50-1 tanh BNN to the bundled gap data by SVI and print how its "
        "predictive uncertainty grows inside the gap.",
    )
    demo.add_argument(
        "--guide",
        default="low_rank",
        choices=["mean_field", "low_rank", "full_rank", "map"],
        help="the SVI guide (variational family) (default: %(default)s)",
    )
    demo.add_argument("--steps", type=_positive_int, default=3000, help="SVI optimizer steps (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar (default: shown)")
    demo.set_defaults(run=_demo)

    zoo = sub.add_parser(
        "zoo",
        help="list the model zoo's entries, or print one entry's card",
        description="Without NAME: one line per zoo entry. With NAME: the entry's card (what it "
        "shows, prior, likelihood, data and where it comes from, references, default "
        "method and settings) and its reference posterior, if it has one.",
    )
    zoo.add_argument(
        "entry", nargs="?", metavar="NAME", help="the entry whose card to print (default: none, list every entry)"
    )
    zoo.set_defaults(run=_zoo)

    methods = [m.value for m in Method]
    fit = sub.add_parser(
        "fit",
        help="fit a zoo entry; print its summary and metrics; write posterior, InferenceData and plots into --out",
        description="Fit a zoo entry with the entry's settings for --method (else the method's "
        "defaults), overridden by the flags below; print the function-space summary "
        "and metrics; write posterior.bnn, inference_data.nc and plots into --out.",
        epilog="example: bnn-pyro fit mlp_regression --method swag --steps 500 --option swag_rank=10 --out runs/swag",
    )
    fit.add_argument("entry", metavar="ENTRY", help="a zoo entry (see `bnn-pyro zoo`)")
    fit.add_argument(
        "--method",
        choices=methods,
        metavar="METHOD",
        help=f"inference method, one of {', '.join(methods)} (default: the entry's card's default "
        "method, see `bnn-pyro zoo ENTRY`)",
    )
    fit.add_argument(
        "--chains",
        type=_positive_int,
        help="num_chains: chains (MCMC), independent restarts (SVI and the other optimizers) or "
        "members (ensemble) (default: the entry's setting, else the method's own, e.g. 4 for "
        "nuts/hmc/metropolis, 5 for ensemble, 1 for svi)",
    )
    fit.add_argument(
        "--samples",
        type=_positive_int,
        help="draws per chain (default: the entry's setting for the method, else the method's)",
    )
    fit.add_argument(
        "--warmup",
        type=_positive_int,
        help="warm-up steps per chain, for nuts, hmc, metropolis, sgld and sghmc (default: the "
        "entry's setting, else the method's)",
    )
    fit.add_argument(
        "--steps",
        type=_positive_int,
        help="optimizer steps, for svi, swa, swag, the dropout methods, ensemble and laplace "
        "(default: the entry's setting, else the method's)",
    )
    fit.add_argument(
        "--option",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other option of the method (the README's Engines table lists the main ones; an "
        "unknown KEY is an error that lists them all), repeatable, e.g. --option lr=0.01 "
        "--option guide=low_rank; VALUE is read as None (none, null), a bool (true, false), an "
        "int, a float, else a string (default: none)",
    )
    fit.add_argument("--seed", type=int, help="random seed (default: 0)")
    fit.add_argument(
        "--out",
        required=True,
        metavar="FOLDER",
        help="folder for posterior.bnn, inference_data.nc and the plots, created if missing; "
        "an existing one must be empty unless --overwrite is given (required)",
    )
    fit.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace the files this command writes there and "
        "keep every other file (default: refuse)",
    )
    fit.add_argument("--no-progress", action="store_true", help="hide the progress bars (default: shown)")
    fit.set_defaults(run=_fit)
    _compare_parser(sub, methods)
    return parser


def _compare_parser(sub, methods: list[str]) -> None:
    compare = sub.add_parser(
        "compare",
        help="fit every method to a zoo entry or a CSV file and tabulate them",
        description="bp.compare from the command line: fit each method (default: every one "
        "that applies) on the entry's test split or on k folds, print the table "
        "(test log-likelihood, errors, calibration, diagnostics, fit time) and write "
        "table.csv, table.md, rows.csv and the figures into --out; each fit is "
        "cached in --out/cache as it ends.",
        epilog="example: bnn-pyro compare mlp_regression --methods svi,laplace,ensemble --out "
        "runs/cmp; bnn-pyro compare data.csv --target price --splits 5 --out runs/price",
    )
    compare.add_argument(
        "source",
        metavar="ENTRY_OR_CSV",
        help="a zoo entry (see `bnn-pyro zoo`) or a CSV file of numeric columns (its model: the UCI "
        "protocol's 50-unit ReLU MLP on standardized columns; regression scores in the "
        "target's units)",
    )
    compare.add_argument(
        "--methods",
        metavar="M1,M2,...",
        help=f"comma-separated methods from {', '.join(methods)} (default: every method that "
        "applies to the model, each at the entry's settings, else its defaults)",
    )
    compare.add_argument("--target", help="CSV only: the target column (default: the last column)")
    compare.add_argument(
        "--task",
        choices=["regression", "classification"],
        help="CSV only: the task (default: classification for an integer target, else regression)",
    )
    compare.add_argument(
        "--splits",
        type=_positive_int,
        metavar="K",
        help="k-fold cross-validation with K folds (default: the entry's test split; a CSV: 5)",
    )
    compare.add_argument(
        "--option",
        type=_method_key_value,
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE",
        help="a setting of one method, repeatable, e.g. --option nuts:num_samples=200 (default: none)",
    )
    compare.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    compare.add_argument(
        "--time-limit",
        type=_positive_int,
        metavar="SECONDS",
        help="stop a fit after this many seconds of wall time; it becomes an error row (default: none)",
    )
    compare.add_argument(
        "--out",
        required=True,
        metavar="FOLDER",
        help="folder for the table, the figures and cache/, created if missing; an existing one must "
        "be empty unless --resume or --overwrite is given (required)",
    )
    group = compare.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="go on from --out/cache: fits already done there are not repeated (default: refuse a non-empty --out)",
    )
    group.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace the files this command writes and its cache/, "
        "keep every other file (default: refuse)",
    )
    compare.add_argument("--no-progress", action="store_true", help="hide the progress bar (default: shown)")
    compare.set_defaults(run=_compare)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FloatingPointError, OSError) as err:
        print(f"bnn-pyro: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT (128 + 2), no traceback
        print(f"bnn-pyro: interrupted{_after_interrupt(args)}", file=sys.stderr)
        return 130


def _after_interrupt(args) -> str:
    """What an interrupted command left: ``fit`` writes its outputs only once all are complete (none otherwise),
    and a fit with ``--option checkpoint=FOLDER`` resumes from its checkpoints."""
    if args.command != "fit":
        return ""
    text = f"; nothing was written to --out {args.out!r}"
    folder = dict(args.option).get("checkpoint")
    if folder is not None and any(Path(folder).rglob("*.ckpt")):
        text += (
            f"; the fit's checkpoints are in {str(folder)!r}: run the same command with --option resume=true "
            "to continue it"
        )
    return text + "."


if __name__ == "__main__":
    sys.exit(main())
