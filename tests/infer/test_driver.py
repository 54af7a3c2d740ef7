"""The driver's gradient loop (bnn_pyro/infer/driver.py ``descend``) and its hooks for a hand-written gradient.

``backward=False`` with an objective that sets ``.grad`` itself must take exactly the steps autograd takes; tensor
values are recorded where they lie and checked every ``check_every`` steps, the non-finite stop naming the first
bad step (as SVI's flat path, bnn_pyro/infer/_svi_flat.py, relies on).
"""

import pytest
import torch

from bnn_pyro.infer.driver import descend
from bnn_pyro.infer.training_data import Data

TARGET = torch.tensor([1.0, -2.0, 0.5])


def _data() -> Data:
    x = torch.linspace(-1.0, 1.0, 8).unsqueeze(-1)
    return Data(x=x, y=x.squeeze(-1), batch_size=4)


def _run(by_hand: bool, **options):
    w = torch.zeros(3, requires_grad=True)

    def autograd(batch, step):
        loss = 0.5 * ((w - TARGET) ** 2).sum() * batch[0].abs().mean()
        return loss, float(loss.detach())

    def hand_written(batch, step):  # the same loss, its gradient set without autograd
        with torch.no_grad():
            scale = batch[0].abs().mean()
            w.grad = (w - TARGET) * scale
            return None, 0.5 * ((w - TARGET) ** 2).sum() * scale

    losses = descend(
        hand_written if by_hand else autograd,
        [w],
        _data(),
        num_steps=12,
        lr=0.1,
        seed=0,
        method="test",
        desc="chain 0",
        progress=False,
        backward=not by_hand,
        **options,
    )
    return w.detach(), losses


@pytest.mark.parametrize("check_every", [1, 5])
def test_a_hand_written_gradient_takes_autograds_steps(check_every):
    w_auto, losses_auto = _run(False)
    w_hand, losses_hand = _run(True, check_every=check_every)
    assert torch.equal(w_auto, w_hand)
    torch.testing.assert_close(losses_hand, losses_auto, rtol=0, atol=0)
    assert losses_hand[-1] < losses_hand[0]  # it descended


@pytest.mark.parametrize("check_every", [1, 4])
def test_a_non_finite_tensor_value_stops_the_run_naming_its_step(check_every):
    w, updates = torch.zeros(2, requires_grad=True), []

    def objective(batch, step):
        w.grad = torch.ones_like(w)
        return None, torch.tensor(float("nan") if step == 5 else 1.0)

    with pytest.raises(FloatingPointError, match=r"the loss became nan at step 5 \(of 12\) of chain 0"):
        descend(
            objective,
            [w],
            _data(),
            num_steps=12,
            lr=0.1,
            seed=0,
            method="test",
            desc="chain 0",
            progress=False,
            backward=False,
            check_every=check_every,
            after_step=lambda: updates.append(1),
        )
    # checked every step: stopped before step 5's update; every 4 steps: at the check after step 7
    assert len(updates) == (5 if check_every == 1 else 7)


@pytest.mark.parametrize("by_hand", [False, True])
def test_the_gradient_is_cleared_only_where_autograd_accumulates_it(by_hand):
    """Autograd accumulates into ``.grad``, so each step clears it first; a hand-written gradient is assigned, so the
    optimizer's ``zero_grad`` is not called at all (SVI's flat path takes every step this way)."""
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    calls = []
    clear = opt.zero_grad
    opt.zero_grad = lambda set_to_none=True: (calls.append(1), clear(set_to_none))

    def objective(batch, step):
        if by_hand:
            w.grad = (w - TARGET).detach()
            return None, 0.0
        loss = 0.5 * ((w - TARGET) ** 2).sum()
        return loss, float(loss.detach())

    descend(
        objective,
        [w],
        _data(),
        num_steps=6,
        lr=0.1,
        opt=opt,
        seed=0,
        method="test",
        desc="chain 0",
        progress=False,
        backward=not by_hand,
    )
    assert len(calls) == (0 if by_hand else 6)
    # either way the steps are those of gradient descent on 0.5 |w - target|^2: w_k = (1 - 0.9^k) target
    torch.testing.assert_close(w.detach(), (1 - 0.9**6) * TARGET)


def test_assemble_lists_every_chains_record_entries_with_none_where_a_chain_has_none():
    """A third-party kernel may record for some chains only: the entry is listed for every chain (None where it has
    none) rather than raising after every chain has run, or being dropped because chain 0 lacks it (review 22)."""
    from bnn_pyro.infer.driver import ChainRun, assemble

    runs = [
        ChainRun(None, {"w": torch.zeros(3, 2)}, {}, {}, record={"step_size_origin": "crossing"}),
        ChainRun(None, {"w": torch.ones(3, 2)}, {}, {}, record={"other": 1}),
    ]
    x = torch.zeros(4, 1)
    post = assemble(runs, method="mcmc", config={}, data=Data(x=x, y=x.squeeze(-1), batch_size=4))
    assert post.config["step_size_origin"] == ["crossing", None] and post.config["other"] == [None, 1]
