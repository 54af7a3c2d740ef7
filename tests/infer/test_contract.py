"""The engine contract (bnn_pyro/infer/contract.py) and the registry of declarations (bnn_pyro/infer/__init__.py)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import NamedTuple

import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import REGISTRY, Method, engine
from bnn_pyro.infer._common import Data
from bnn_pyro.infer.contract import Capabilities, Declaration, Engine, Loop, drive
from bnn_pyro.infer.driver import ChainRun

ON_CONTRACT = [m.value for m in Method]  # every registered engine declares a typed config (contract.entry)


@pytest.mark.parametrize("method", list(Method))
def test_declared_capabilities_agree_with_the_declared_options(method):
    can, opts = REGISTRY[method].capabilities, bp.infer.options(method)
    assert can.checkpoint == ("checkpoint" in opts)
    assert can.data_parallel == ("distributed" in opts)
    assert can.chains == ("num_chains" in opts)
    assert not (can.one_shot and can.multi_pass)


@pytest.mark.parametrize("method", ON_CONTRACT)
def test_engines_on_the_contract_declare_a_frozen_config_that_is_their_signature(method):
    fn = engine(method)
    fields = dataclasses.fields(fn.config_type)
    params = inspect.signature(fn).parameters
    assert list(params)[:2] == ["model", "data"]
    assert {f.name: f.default for f in fields} == {k: p.default for k, p in list(params.items())[2:]}
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        fn.config_type().seed = 1
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_stepz'"):
        fn(None, None, num_stepz=3)


def test_capabilities_refuse_a_stream_they_cannot_serve():
    with pytest.raises(ValueError, match="one_shot needs minibatches and a single pass"):
        Capabilities(minibatches=True, one_shot=True, multi_pass=True)
    with pytest.raises(ValueError, match="one_shot needs minibatches"):
        Capabilities(one_shot=True)


def test_a_declaration_of_a_function_taking_config_is_an_error_naming_the_fix(monkeypatch):
    from bnn_pyro.infer import mcmc

    monkeypatch.setattr(mcmc, "fit_untyped", lambda model, data, **config: None, raising=False)
    with pytest.raises(LookupError, match=r"takes \*\*config: make it an engine with a config dataclass"):
        Declaration("mcmc", "fit_untyped", Capabilities()).options()
    assert not {f.name for f in dataclasses.fields(Declaration)} & {"passed_on", "set_by_engine"}


def test_unknown_option_names_the_methods_that_take_it():
    x, y = torch.zeros(4, 1), torch.zeros(4)
    with pytest.raises(TypeError, match=r"threshold: not an option of method='svi'.*\(sparse_vd\)"):
        bp.fit(lambda x, y=None: None, x, y, method="svi", threshold=3.0)
    with pytest.raises(TypeError, match=r"friction: not an option of method='nuts'.*\(sghmc, csgmcmc, snapshot\)"):
        bp.fit(lambda x, y=None: None, x, y, method="nuts", num_chains=1, friction=0.1)
    with pytest.raises(TypeError, match=r"num_members: not an option of method='nuts'"):  # ensemble's former name
        bp.fit(lambda x, y=None: None, x, y, method="nuts", num_chains=1, num_members=3)


class _Gap(NamedTuple):
    loss: float
    gap: float  # w - mean(batch y), before the update
    after: float  # w after the update


@dataclasses.dataclass
class _Mean:
    params: list


def _mean_engine() -> Engine:
    """Minimizes 0.5 (w - mean(y_batch))^2: one SGD step at lr=1 lands exactly on the batch mean."""

    def step(state, batch, index):
        w = state.params[0]
        loss = 0.5 * (w - batch[1].mean()) ** 2
        return loss, _Gap(loss.item(), (w - batch[1].mean()).item(), float("nan"))

    return Engine(
        init=lambda model, chain: _Mean([torch.full((), float(chain.seed), requires_grad=True)]),
        step=step,
        info=_Gap,
        after=lambda state, index, info: info._replace(after=state.params[0].item()),
        draws=lambda state, history: ChainRun(None, {"w": state.params[0].detach()[None]}, history=history),
    )


def test_drive_runs_a_hand_written_engine_to_its_exact_answer_and_records_its_typed_info():
    y = torch.tensor([1.0, 2.0, 4.0, 9.0])
    data = Data(x=torch.zeros(4, 1), y=y)
    loop = Loop(num_steps=3, lr=1.0, method="mean", desc="mean chain {index}", optimizer="sgd", progress=False)
    post = drive(lambda x, y=None: None, data, _mean_engine(), loop, num_chains=2, seed=5, config={})
    assert post.samples["w"].shape == (2, 1) and torch.equal(post.samples["w"], torch.full((2, 1), 4.0))
    assert set(post.history) == {"loss", "gap", "after"} and post.history["gap"].shape == (2, 3)
    # each chain starts at its seed (5, 6); the first step's gap is start - mean, then it is exactly 0
    assert post.history["gap"].tolist() == [[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]
    assert post.history["after"].tolist() == [[4.0] * 3] * 2
    assert post.history["loss"][:, 0].tolist() == [0.5, 2.0]


def test_an_engine_brings_its_own_optimizer_and_record_dtype():
    """``Engine.optimizer(state)`` replaces the loop's optimizer (here SGD at lr=1, which lands on the mean in one
    step, where the loop's lr=0.25 would not) and ``record_dtype`` is the history's dtype (float64 values kept)."""
    y = torch.tensor([1.0, 2.0, 4.0, 9.0], dtype=torch.float64)
    base = _mean_engine()

    def init(model, chain):
        return _Mean([torch.full((), float(chain.seed), dtype=torch.float64, requires_grad=True)])

    engine = base._replace(
        init=init, optimizer=lambda state: torch.optim.SGD(state.params, lr=1.0), record_dtype=torch.float64
    )
    loop = Loop(num_steps=2, lr=0.25, method="mean", desc="mean", optimizer="sgd", progress=False)
    post = drive(lambda x, y=None: None, Data(x=torch.zeros(4, 1), y=y), engine, loop, num_chains=1, seed=5, config={})
    assert post.samples["w"].item() == 4.0 and post.history["after"].tolist() == [[4.0, 4.0]]
    assert all(v.dtype == torch.float64 for v in post.history.values())
    assert post.history["loss"][0, 0].item() == 0.5  # 0.5 (5 - 4)^2
    default = drive(lambda x, y=None: None, Data(x=torch.zeros(4, 1), y=y), base, loop, num_chains=1, seed=5, config={})
    assert default.history["after"][0, 0].item() == 4.75 and default.history["loss"].dtype == torch.get_default_dtype()


def test_drive_on_minibatches_ends_on_the_last_batch_mean():
    y = torch.arange(10.0)
    data = Data(x=torch.zeros(10, 1), y=y, batch_size=5)
    loop = Loop(num_steps=4, lr=1.0, method="mean", desc="mean", optimizer="sgd", progress=False)
    post = drive(lambda x, y=None: None, data, _mean_engine(), loop, num_chains=1, seed=0, config={})
    batches = data.batches(torch.Generator().manual_seed(0))  # the order the driver drew (seeded by the chain)
    last = [next(batches) for _ in range(4)][-1]
    assert post.samples["w"].item() == last[1].mean().item() == post.history["after"][0, -1].item()


@pytest.mark.parametrize("method", ["nuts", "laplace"])
def test_a_stream_is_refused_before_the_model_runs(method):
    calls = []
    model = lambda x, y=None: calls.append(1)  # noqa: E731 - never run: the capability check comes first
    batches = ((torch.zeros(4, 1), torch.zeros(4)) for _ in range(3))
    with pytest.raises(ValueError, match=rf"x: method='{method}' .*a method that takes a stream: svi, "):
        bp.fit(model, batches, method=method, dataset_size=12)
    assert calls == []
