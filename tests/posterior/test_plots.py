"""bnn_pyro.posterior.plots: every plot draws on a figure and returns it; bad requests get clear errors."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure

from bnn_pyro import plots


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _titles(fig: Figure) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_trace_plot_has_one_row_per_site(svi_post):
    fig = svi_post.plot_trace()
    assert isinstance(fig, Figure)
    assert _titles(fig) == ["weight", "weight"]  # density and draws


def test_rank_plot_of_chosen_and_default_scalars(mcmc_post):
    fig = mcmc_post.plot_rank(["weight[0, 0]"])
    assert _titles(fig) == ["weight[0, 0]"]
    assert len(plots.scalars(mcmc_post, None, limit=8)) == 1


def test_pair_plot_of_chosen_weights(classifier_post):
    fig = classifier_post.plot_pair(["weight[0, 0]", "bias[2]", "weight[1, 1]"])
    labels = {ax.get_xlabel() for ax in fig.axes} | {ax.get_ylabel() for ax in fig.axes}
    assert {"weight[0, 0]", "bias[2]", "weight[1, 1]"} <= labels


def test_energy_plot_needs_energy(mcmc_post, svi_post):
    assert isinstance(mcmc_post.plot_energy(), Figure)
    with pytest.raises(ValueError, match=r"sample_stats\['energy'\].*method='svi'.*plot_trace"):
        svi_post.plot_energy()


def test_predictive_band_draws_data_mean_and_two_bands(svi_post):
    fig = svi_post.plot_predictive()
    ax = fig.axes[0]
    assert len(ax.collections) == 3  # total band, epistemic band, data
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["total 95% (with noise)", "epistemic 95%", "predictive mean", "data"]
    epistemic, total = ax.collections[1].get_paths()[0], ax.collections[0].get_paths()[0]
    height = lambda path: path.vertices[:, 1].max() - path.vertices[:, 1].min()  # noqa: E731
    assert height(total) >= height(epistemic)


def test_reliability_diagram_reports_ece(classifier_post):
    fig = classifier_post.plot_reliability(num_bins=5)
    top, bottom = fig.axes
    assert top.get_title().startswith("Reliability (svi), ECE = ")
    ece = float(top.get_title().rsplit("= ", 1)[1])
    # the plotted predictive (training data, all draws, seed 0) binned here by the definition: five equal-width
    # confidence bins, left-closed (the last also takes 1); each filled bin's accuracy bar, and the title's
    # ECE = sum_b (n_b / N) |accuracy_b - confidence_b|, which the title rounds to 3 decimals (so within 5e-4)
    probs = classifier_post.predict(classifier_post.x, seed=0).probs.double()
    confidence, predicted = probs.max(-1)
    correct = (predicted == classifier_post.y).double()
    which = (confidence * 5).floor().clamp(max=4).long()
    filled = [b for b in range(5) if (which == b).any()]
    accuracy = [float(correct[which == b].mean()) for b in filled]
    bars = top.patches[: len(filled)]  # the accuracy bars, then the gaps to confidence
    assert [round(bar.get_x() + bar.get_width() / 2, 9) for bar in bars] == [round(0.1 + 0.2 * b, 9) for b in filled]
    assert [bar.get_height() for bar in bars] == pytest.approx(accuracy, abs=1e-12)
    exact = sum(
        (which == b).double().mean() * (correct[which == b].mean() - confidence[which == b].mean()).abs()
        for b in filled
    )
    assert ece == pytest.approx(float(exact), abs=5e-4 + 1e-12), (ece, float(exact))
    assert sum(bar.get_height() for bar in bottom.patches) == 60  # every point in the histogram


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: p.plot_pair(["weight[3, 0]", "bias"]), r"'weight\[3, 0\]' is not an entry of 'weight'"),
        (lambda p: p.plot_pair(["gamma", "bias"]), r"params: unknown site 'gamma'"),
        (lambda p: p.plot_pair(["weight[0, 0]"]), r"needs at least 2 scalars"),
        (lambda p: p.plot_trace(var_names=["gamma"]), r"var_names: unknown site\(s\) \['gamma'\]"),
        (lambda p: p.plot_predictive(torch.zeros(5, 2)), r"x: a predictive band needs 1-D inputs"),
        (lambda p: p.plot_reliability(), r"plot_reliability is for classification"),
    ],
)
def test_plots_reject_bad_requests(svi_post, call, message):
    with pytest.raises(ValueError, match=message):
        call(svi_post)


def test_predictive_band_is_for_regression(classifier_post):
    with pytest.raises(ValueError, match="plot_predictive is for regression"):
        classifier_post.plot_predictive(torch.zeros(4, 1))


def test_calibration_plot_shows_before_and_after(classifier_post):
    from bnn_pyro import calibration, metrics

    x, y = classifier_post.x, classifier_post.y
    pred = classifier_post.predict(x)
    after = calibration.TemperatureScaling.fit(pred, y)(pred)
    fig = plots.plot_calibration(pred, after, y, num_bins=5)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == [f"Before, ECE = {metrics.ece(pred, y, 5):.3f}", f"After, ECE = {metrics.ece(after, y, 5):.3f}"]
    plt.close(fig)


def test_rejection_plot_has_one_curve_per_score(classifier_post):
    from bnn_pyro import selective

    x, y = classifier_post.x, classifier_post.y
    pred = classifier_post.predict(x)
    fig = plots.plot_rejection(pred, y, scores=("entropy", "max_prob"))
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == [
        f"entropy (area {selective.rejection_auc(pred, y):.3f})",
        f"max_prob (area {selective.rejection_auc(pred, y, score='max_prob'):.3f})",
    ]
    assert len(ax.lines[0].get_xdata()) == len(y)
    plt.close(fig)


def _user_deprecated_matplotlib_call():
    """The deprecated Matplotlib call that ArviZ 0.23 makes in its plots, made here by "the user"."""
    from matplotlib import cbook

    cbook.normalize_kwargs({"lw": 1}, alias_mapping={"linewidth": ["lw"]})


def test_arviz_plots_emit_no_deprecation_warnings_while_the_users_own_matplotlib_code_still_does(
    mcmc_post, classifier_post
):
    import warnings

    from matplotlib import MatplotlibDeprecationWarning

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # as -W always / -W error::DeprecationWarning would show them
        mcmc_post.plot_trace()
        mcmc_post.plot_rank()
        classifier_post.plot_pair(["weight[0, 0]", "bias[2]"])
        mcmc_post.plot_energy()
        ours = [w for w in record if issubclass(w.category, DeprecationWarning)]
        _user_deprecated_matplotlib_call()
        users = [w for w in record if issubclass(w.category, MatplotlibDeprecationWarning)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    assert len(users) == 1 and users[0].filename == __file__  # the filter ended with our plot calls


def test_one_site_name_as_a_string_is_that_site_not_its_characters(svi_post, mcmc_post):
    """ArviZ takes var_names="weight"; ours iterated the string and refused its characters ('w', 'e', ...)."""
    assert _titles(svi_post.plot_trace("weight")) == _titles(svi_post.plot_trace(["weight"]))
    assert _titles(mcmc_post.plot_rank("weight[0, 0]")) == ["weight[0, 0]"]
    table = svi_post.summary(var_names="weight", warn=False)
    assert table.equals(svi_post.summary(var_names=["weight"], warn=False))
    with pytest.raises(ValueError, match=r"var_names: unknown site\(s\) \['wieght'\]; this posterior has \['weight'\]"):
        svi_post.summary(var_names="wieght")


def test_draws_spread_over_less_than_float32_resolves_still_plot():
    """Near-constant float32 draws (a collapsed approximation) made ArviZ's density estimate fail inside numpy:
    'Too many bins for data range. Cannot create 512 finite-sized bins.'"""
    import bnn_pyro as bp

    model = bp.BNN(torch.nn.Linear(1, 1), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(0.1))
    g = torch.Generator().manual_seed(0)
    samples = {n: 0.3 + 1e-7 * torch.randn((1, 4) + s, generator=g) for n, s in model.param_shapes.items()}
    post = bp.Posterior(samples=samples, model=model, method="svi")
    assert _titles(post.plot_trace()) == ["weight", "weight", "bias", "bias"]
    assert isinstance(post.plot_rank(), Figure)
