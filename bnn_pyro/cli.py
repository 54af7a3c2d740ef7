"""The ``bnn-pyro`` command line.

``bnn-pyro demo`` fits a 1-50-1 tanh BNN to the bundled gap data by SVI and prints how the
predictive uncertainty grows inside the gap. ``bnn-pyro zoo`` lists the model zoo, and
``bnn-pyro fit ENTRY --method nuts --chains 2 --out DIR`` fits a zoo entry, prints its
function-space summary and metrics, and writes the posterior, its InferenceData and plots into
``DIR``. Bad arguments exit non-zero with a message, never a traceback.

Example
-------
.. code-block:: bash

    bnn-pyro zoo
    bnn-pyro fit mlp_regression --method nuts --chains 2 --samples 200 --out runs/mlp
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

__all__ = ["main"]

_METHODS = ("svi", "nuts", "hmc", "metropolis")
_TRACE_SCALARS = 4


def _demo(args) -> int:
    import bnn_pyro as bp
    from bnn_pyro import datasets

    x, y = datasets.toy_gap()
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    model = bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=0.1))
    print(f"bnn-pyro demo: {len(x)} points with a gap in (-0.5, 0.5); 1-50-1 tanh BNN, Normal(0, 1) prior")
    start = time.perf_counter()
    post = bp.fit(model, x, y, method="svi", guide=args.guide, num_steps=args.steps, lr=0.03, lr_schedule="cosine",
                  num_samples=500, seed=args.seed, progress=not args.no_progress)
    print(f"fitted by SVI ({args.guide} guide, {args.steps} steps) in {time.perf_counter() - start:.1f} s; "
          f"final negative ELBO {post.history['loss'][0, -50:].mean():.1f}")
    grid = torch.tensor([[-1.5], [-0.75], [0.0], [0.75], [1.5], [3.0]])
    pred = post.predict(grid, seed=args.seed)
    print(f"\n{'x':>6} {'region':>9} {'mean':>7} {'epistemic':>10} {'aleatoric':>10} {'95% interval':>18}")
    for i, v in enumerate(grid[:, 0].tolist()):
        region = "gap" if abs(v) < 0.5 else ("outside" if abs(v) > 2 else "data")
        print(f"{v:6.2f} {region:>9} {pred.mean[i]:7.3f} {pred.epistemic_std[i]:10.3f} {pred.aleatoric_std[i]:10.3f} "
              f"   [{pred.lower[i]:6.2f}, {pred.upper[i]:6.2f}]")
    train = post.predict(x, seed=args.seed)
    rmse = (train.mean - y).pow(2).mean().sqrt()
    print(f"\ntraining RMSE {rmse:.3f} (noise sd 0.1)")
    print("Gaussian variational families are known to understate the uncertainty between clusters "
          "(Foong et al. 2019); refit with method='nuts' to compare.")
    return 0


# ---------------------------------------------------------------------- zoo
def _zoo(args) -> int:
    from bnn_pyro import zoo

    names = zoo.list()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name + ':':<{width + 1}} {zoo.card(name)['title']}")
    return 0


# ---------------------------------------------------------------------- fit
def _fit(args) -> int:
    import pandas as pd

    from bnn_pyro import zoo

    names = zoo.list()
    if args.entry not in names:
        raise _Usage(f"unknown zoo entry {args.entry!r}; choose one of: {', '.join(names)} (see `bnn-pyro zoo`).")
    method = args.method
    mcmc = method != "svi"
    if args.steps is not None and mcmc:
        raise _Usage(f"--steps sets the number of SVI optimizer steps; method {method!r} takes --samples and --warmup.")
    if args.warmup is not None and not mcmc:
        raise _Usage("--warmup is for MCMC methods (nuts, hmc, metropolis); SVI takes --steps.")
    out = _output_folder(args.out)

    entry = zoo.load(args.entry)
    overrides = {"num_chains": args.chains, "seed": args.seed, "progress": not args.no_progress}
    for key, value in (("num_samples", args.samples), ("num_warmup", args.warmup), ("num_steps", args.steps)):
        if value is not None:
            overrides[key] = value
    print(f"bnn-pyro fit: {entry.name} ({entry.card['title']}) by {method}, {args.chains} chain(s)")
    start = time.perf_counter()
    post = entry.fit(method=method, **overrides)
    print(f"fitted in {time.perf_counter() - start:.1f} s: {post!r}\n")

    with pd.option_context("display.width", 120, "display.max_columns", 20, "display.max_rows", 40):
        _print_summaries(post)
    print("\nmetrics (held-out data):" if entry.x_test is not None else "\nmetrics:")
    for name, value in entry.evaluate(post).items():
        print(f"  {name:<22} {value:.4f}" if isinstance(value, float) else f"  {name:<22} {value}")

    print(f"\nwriting to {out}/")
    for path in _write_outputs(post, entry, out):
        print(f"  {path.name}")
    return 0


def _print_summaries(post) -> None:
    """The function-space table (what to judge a BNN by), then a one-line digest of the weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = post.summary(space="function")
            print("summary in function space (f(x) at up to 20 training inputs; weight-space R-hat misleads "
                  "for BNNs, whose weights can be permuted and sign-flipped without changing f):")
        except ValueError as err:  # a Pyro function model without the site "f"
            print(f"function-space summary unavailable ({err}); weight-space summary:")
            table = post.summary(space="weights")
        print(table.round(3).to_string())
        weights = post.summary(space="weights", warn=False)
        print(f"\nweight space ({len(weights)} scalars): max R-hat {weights['r_hat'].max():.3f}, "
              f"min bulk ESS {weights['ess_bulk'].min():.0f}, min tail ESS {weights['ess_tail'].min():.0f}")
    for note in table.attrs.get("notes", []):
        print(f"note: {note}")
    for w in caught:
        if issubclass(w.category, UserWarning):
            print(f"warning: {w.message}")


def _write_outputs(post, entry, out: Path) -> list[Path]:
    import arviz as az
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bnn_pyro import diagnostics, plots

    written = [post.save(out / "posterior.bnn")]
    path = out / "inference_data.nc"
    if importlib.util.find_spec("h5netcdf") is None:  # ArviZ's netCDF engine is optional
        print(f"  (skipped {path.name}: writing netCDF needs the h5netcdf package; pip install h5netcdf)")
    else:
        post.to_inference_data().to_netcdf(str(path), engine="h5netcdf")
        written.append(path)

    params = _trace_params(post)
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


def _output_folder(text: str) -> Path:
    out = Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise _Usage(f"--out {text!r} is not a writable folder ({err.strerror or err}); choose another path.") from None
    return out


class _Usage(ValueError):
    """A bad command-line argument found after parsing: a message and exit status 2."""


# ---------------------------------------------------------------------- parsing
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnn-pyro", description="Bayesian neural networks in Pyro.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit a BNN to the bundled 1-D gap data and show its uncertainty")
    demo.add_argument("--guide", default="low_rank", choices=["mean_field", "low_rank", "full_rank", "map"])
    demo.add_argument("--steps", type=_positive_int, default=3000)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(run=_demo)

    zoo = sub.add_parser("zoo", help="list the model zoo's entries")
    zoo.set_defaults(run=_zoo)

    fit = sub.add_parser("fit", help="fit a zoo entry; print its summary and metrics; write posterior, "
                                     "InferenceData and plots into --out")
    fit.add_argument("entry", help="a zoo entry (see `bnn-pyro zoo`)")
    fit.add_argument("--method", default="nuts", choices=_METHODS, help="inference engine (default: nuts)")
    fit.add_argument("--chains", type=_positive_int, default=2, help="chains (independent restarts for svi); default 2")
    fit.add_argument("--samples", type=_positive_int, help="draws per chain (default: the entry's)")
    fit.add_argument("--warmup", type=_positive_int, help="MCMC warm-up steps per chain (default: the entry's)")
    fit.add_argument("--steps", type=_positive_int, help="SVI optimizer steps (default: the entry's)")
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--out", required=True, help="folder for posterior.bnn, inference_data.nc and the plots")
    fit.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    fit.set_defaults(run=_fit)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
