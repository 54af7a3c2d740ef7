"""The held-out refit reruns the schedule of the run that chose (bnn_pyro/infer/holdout.py ``Chosen.schedule``,
bnn_pyro/infer/optim.py ``Horizon``): the fit on every row stops at the chosen step of a schedule laid over the
whole budget, not on a schedule annealed over the chosen steps alone."""

import math

import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import driver, swag_state
from bnn_pyro.infer import holdout as ho
from bnn_pyro.infer.optim import FINAL_LR_FRACTION, Horizon, make_schedule


def _learned_noise(n=240):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g) * 6 - 3
    y = torch.sin(x[:, 0]) + 0.5 * torch.randn(n, generator=g)
    net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return (
        bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Gaussian(scale=dist.HalfNormal(1.0))),
        x,
        y,
    )


def _cosine(lr: float, k: int, horizon: int) -> float:
    """The default cosine's rate after ``k`` steps of a ``horizon``-step run (CosineAnnealingLR's closed form)."""
    low = lr * FINAL_LR_FRACTION
    return low + (lr - low) * (1 + math.cos(math.pi * k / horizon)) / 2


def _rates(schedule, num_steps: int, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_schedule(schedule, opt, num_steps)
    out = []
    for _ in range(num_steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return out


# ---------------------------------------------------------------------------------------------- Horizon
@pytest.mark.parametrize("schedule", ["cosine", "exponential", "constant"])
def test_a_horizon_gives_the_first_rates_of_the_longer_run(schedule):
    assert _rates(Horizon(schedule, 100), 30) == _rates(schedule, 100)[:30]
    assert _rates(Horizon(schedule, 100), 100) == _rates(schedule, 100)


def test_a_horizon_passes_a_callable_through_and_ends_where_the_cosine_says():
    made = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)  # noqa: E731
    assert _rates(Horizon(made, 100), 20) == _rates(made, 20)  # a callable sets its own horizon
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    sched = make_schedule(Horizon("cosine", 1000), opt, 200)
    for _ in range(200):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(_cosine(1e-2, 200, 1000), rel=1e-12)  # 9.05e-3, not 1e-4


def test_a_horizon_shorter_than_the_run_or_not_positive_is_refused():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    with pytest.raises(ValueError, match="shorter than the run's num_steps=50"):
        make_schedule(Horizon("cosine", 20), opt, 50)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        Horizon("cosine", 0)
    with pytest.raises(ValueError, match="lr_schedule"):
        make_schedule(Horizon("linear", 20), opt, 10)
    assert repr(Horizon("cosine", 1000)) == "cosine over 1000 steps"


# ---------------------------------------------------------------------------------------------- Chosen
def test_chosen_schedule_lays_the_schedule_over_the_horizon_only_when_the_run_stopped_before_it():
    early = ho.Chosen(num_steps=80, sigma=None, horizon=1000)
    assert early.schedule("cosine") == Horizon("cosine", 1000)
    assert early.record() == {"num_steps": 80, "horizon": 1000}
    assert ho.Chosen(num_steps=1000, sigma=None, horizon=1000).schedule("cosine") == "cosine"
    assert ho.Chosen(num_steps=None, sigma=None, stops=[[3]]).schedule("constant") == "constant"


def test_the_horizon_is_the_budget_scaled_to_all_rows_like_the_stop():
    """Minibatches of 32: 216 training rows are 7 steps per epoch, 240 rows 8; the stop and the budget both keep
    their epochs."""
    assert ho.scaled_steps(140, rows_train=216, rows_all=240, batch_size=32) == 160
    assert ho.scaled_steps(70, rows_train=216, rows_all=240, batch_size=32) == 80


# ---------------------------------------------------------------------------------------------- engines
def _spy(monkeypatch, module):
    """Record every scheduler ``module.make_schedule`` builds, with the run's ``num_steps``."""
    made, real = [], module.make_schedule

    def spy(schedule, opt, num_steps):
        sched = real(schedule, opt, num_steps)
        made.append((sched, num_steps))
        return sched

    monkeypatch.setattr(module, "make_schedule", spy)
    return made


@pytest.mark.parametrize(
    "method, options, budget",
    [
        ("ensemble", dict(num_chains=2, num_steps=300), "num_steps"),
        ("laplace", dict(num_steps=300), "num_steps"),
        ("mc_dropout", dict(num_steps=300, num_samples=20), "num_steps"),
        ("swag", dict(pretrain_steps=300, num_steps=40, swag_rank=2, num_chains=1, num_samples=10), "pretrain_steps"),
    ],
)
def test_every_held_out_engine_refits_on_the_schedule_of_the_run_that_chose(monkeypatch, method, options, budget):
    """At every engine's default schedule (a cosine from lr to 1% of it), the refit on all 240 rows ends at the rate
    the whole budget's cosine has at the chosen step k, not at 1% of lr (a cosine over k steps): each engine routes
    its refit through ``Chosen.schedule``. ``config["validation"]["chosen"]`` records the stop and the horizon."""
    made = _spy(monkeypatch, swag_state if method == "swag" else driver)
    model, x, y = _learned_noise()
    post = bp.fit(model, x, y, method=method, seed=0, progress=False, **options)
    chosen = post.config["validation"]["chosen"]
    k, horizon = chosen["num_steps"], chosen["horizon"]
    assert horizon == options[budget] and 1 <= k < horizon  # full batch: the budget; the fit stopped before its end
    assert post.config[budget] == k
    refit = [sched for sched, n in made if n == k]  # the refit's first phase (the scored run's: 300)
    assert refit and all(n in (k, options[budget]) for _, n in made)
    lr = options.get("pretrain_lr", 3e-2) if method == "swag" else 1e-2
    for sched in refit:
        assert sched.last_epoch == k  # stepped once per step of the k-step refit
        rate = sched.get_last_lr()[0]  # the rate after k steps (swag's optimizer has moved on to its SWA phase)
        assert rate == pytest.approx(_cosine(lr, k, horizon), rel=1e-9), (rate, k, horizon)
        assert rate > 2 * lr * FINAL_LR_FRACTION


def test_swag_pretrains_the_refit_on_the_pretraining_cosine_of_the_run_that_chose():
    """SWAG's history records every step's rate: the refit's pre-training rates are the first k of the scored
    pre-training's cosine over its 300 steps; the SWA phase then runs as before. The pre-training is full-batch, so
    k and the horizon are not rescaled by the SWA phase's minibatches of 128 rows (``config["batch_size"]``: 252
    training rows are 2 of them, all 280 rows 3, which would have made 450 steps of 300)."""
    model, x, y = _learned_noise(280)
    options = dict(pretrain_steps=300, pretrain_lr=0.1, num_steps=60, swag_rank=2, num_chains=1, num_samples=10)
    post = bp.fit(model, x, y, method="swag", seed=0, progress=False, **options)
    chosen = post.config["validation"]["chosen"]
    k = chosen["num_steps"]
    assert chosen["horizon"] == 300 and k < 300 and post.config["pretrain_steps"] == k
    rates = post.history["lr"][0, :k].tolist()
    assert rates == pytest.approx([_cosine(0.1, t, 300) for t in range(k)], rel=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "exponential"])
def test_a_users_named_schedule_is_the_one_the_refit_stops_in(schedule):
    """``"constant"``: k steps at lr, as before (the scored run's rates); ``"exponential"``: the decay to 1% over the
    whole budget, stopped at k (bit for bit the by-hand fit on all rows)."""
    model, x, y = _learned_noise()
    options = dict(method="ensemble", num_chains=1, num_steps=150, seed=0, progress=False)
    post = bp.fit(model, x, y, lr_schedule=schedule, **options)
    k = post.config["validation"]["chosen"]["num_steps"]
    assert k < 150 and post.config["lr_schedule"] == f"{schedule} over 150 steps"
    again = bp.fit(model, x, y, **{**options, "num_steps": k}, lr_schedule=Horizon(schedule, 150), validation=None)
    assert torch.equal(post.samples["0.weight"], again.samples["0.weight"])


def test_the_refit_reproduces_the_state_the_held_out_rows_scored():
    """When the held-out rows add nothing to the training gradient (inputs 0 under a net without biases: their
    logits are 0 whatever the weights), the loss on all rows has the gradient of the loss on the training rows, so
    the refit on all rows must end where the fit that chose was when it was scored: the state a fit on the training
    rows alone keeps with the same held-out rows given as a pair (``validation=(x_val, y_val)``: no refit). Those
    rows score every state alike, so the first check (step 6 of 300) is chosen; a refit annealed over 6 steps
    would end elsewhere."""
    n, seed = 240, 0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    _, held, _ = ho.split(ho.Data(x, y), "default", seed=seed, method="ensemble")
    x[held.rows] = 0.0
    kept = torch.tensor(sorted(set(range(n)) - set(held.rows.tolist())))

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(2, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 2, bias=False))
        return bp.BNN(net, prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical())

    options = dict(method="ensemble", num_chains=2, num_steps=300, seed=seed, progress=False)
    post = bp.fit(model(), x, y, **options)
    chosen = post.config["validation"]["chosen"]
    assert chosen == {"num_steps": 6, "horizon": 300} and post.config["validation"]["final_fit_rows"] == n
    scored = bp.fit(model(), x[kept], y[kept], validation=(x[held.rows], y[held.rows]), **options)
    assert "chosen" not in scored.config["validation"] and scored.history["best_step"].flatten().tolist() == [5, 5]
    for name in ("0.weight", "2.weight"):
        assert torch.allclose(post.samples[name], scored.samples[name], rtol=1e-5, atol=1e-6), name
    annealed = bp.fit(model(), x, y, **{**options, "num_steps": 6}, validation=None)  # the refit before
    assert not torch.allclose(annealed.samples["0.weight"], scored.samples["0.weight"], rtol=1e-3, atol=1e-4)
