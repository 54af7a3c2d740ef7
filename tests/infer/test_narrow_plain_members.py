"""``anchored=False`` ensemble members of a Pyro function without observation weights (``bootstrap=False``) start at
its prior median and minimize one objective, so they reach the same mode (spread ~0); ``check_narrow`` says that they are one point, with that cause and its advice
(the default ``anchored=True``, or NUTS), not the anchored members' cause it is given (issue 26)."""

from __future__ import annotations

import copy
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

import bnn_pyro as bp
from bnn_pyro.infer import health_spread
from bnn_pyro.posterior.diagnostics import DiagnosticWarning

ONE_POINT = "the draws are one point, not posterior draws"


def _line(x, y=None):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b = pyro.sample("b", dist.Normal(0.0, 10.0))
    s = pyro.sample("s", dist.HalfNormal(1.0))
    with pyro.plate("rows", x.shape[0]):
        pyro.sample("obs", dist.Normal(a + b * x, s), obs=y)


def _said(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiagnosticWarning)
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, DiagnosticWarning)]


FIT = dict(num_chains=3, num_steps=100, seed=0, progress=False)


def _rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g)
    return x, 0.3 + 1.2 * x + 0.5 * torch.randn(50, generator=g)


@pytest.fixture(scope="module")
def plain():
    x, y = _rows()
    out = {}
    said = _said(
        lambda: out.setdefault(
            "post",
            bp.fit(_line, x, y, method="ensemble", anchored=False, bootstrap=False, **FIT),
        )
    )
    return out["post"], said


def test_plain_members_of_a_function_are_told_they_are_one_point(plain):
    post, said = plain
    assert post.config["anchored"] is False and post.config["init"] == "median"  # the defaults' start, not anchored
    members = torch.stack([post.samples[k].reshape(3, -1) for k in ("a", "b")], -1)
    assert float(members.std(0).max()) < 1e-3  # one point: the posterior sds here are ~0.07
    narrow = [m for m in said if "too narrow" in m or ONE_POINT in m]
    assert len(narrow) == 1 and ONE_POINT in narrow[0], said
    text = narrow[0]
    assert "With anchored=False the members are plain MAP fits of one objective" in text
    assert "default anchored=True" in text and "method='nuts'" in text
    assert "tilted toward each member's prior draw" not in text  # the anchored members' cause does not apply


def test_anchored_members_keep_the_cause_they_are_given(plain):
    """The same draws recorded as anchored members: check_narrow names the engine's cause, not the one-point one."""
    post = copy.copy(plain[0])
    post.config = {**post.config, "anchored": True}
    said = _said(lambda: health_spread.check_narrow(post, cause="THE ENGINE'S CAUSE. ", functions=True))
    assert len(said) == 1 and "THE ENGINE'S CAUSE." in said[0] and ONE_POINT not in said[0], said


def test_plain_members_with_observation_weights_are_not_one_point():
    """At the default ``bootstrap=True`` each ``anchored=False`` member weights the observations by its own draw (the
    weighted likelihood bootstrap): the members differ (posterior sds here ~0.07), and the one-point message is not
    given."""
    x, y = _rows()
    post = None

    def fit():
        nonlocal post
        post = bp.fit(_line, x, y, method="ensemble", anchored=False, **FIT)

    said = _said(fit)
    assert "scheme" in post.config["observation_weights"]
    members = torch.stack([post.samples[k].reshape(3, -1) for k in ("a", "b")], -1)
    assert float(members.std(0).min()) > 1e-2
    assert not any(ONE_POINT in m for m in said), said
