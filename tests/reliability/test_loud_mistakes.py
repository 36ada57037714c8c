"""Silent user mistakes made loud (issue 31): an optimizer built before ``overlap.shard``
([Note: an optimizer built before shard] in ``overlap/optimizer_check.py``), and sharded parameters
moved to the meta device. Each raises a clear error before anything changes, naming the parameters
and the fix; the right order of calls trains as before.

One 1-rank gloo process runs every scenario (``_rank``) and returns what happened; the tests check it.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import overlap
from overlap.testing import run_distributed


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _shard(model: nn.Sequential) -> nn.Sequential:
    overlap.shard(model[0])
    overlap.shard(model[2])
    return overlap.shard(model)


def _error(fn: Any) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()]


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))

    # an optimizer built before shard: refused at its first step, nothing changed
    model = _blocks()
    early = torch.optim.SGD(model.parameters(), lr=0.5)
    _shard(model)
    model(x).sum().backward()
    before = _full(model)
    out["early"] = _error(early.step)
    out["early_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _full(model)))

    # built after: steps and changes the model; then a replaced parameter added to it is refused
    late = torch.optim.SGD(model.parameters(), lr=0.5)
    late.step()
    out["late_steps"] = not all(torch.equal(a, b) for a, b in zip(before, _full(model)))
    other = _blocks()
    replaced_param = other[0].weight
    overlap.shard(other[0])
    late.add_param_group({"params": [replaced_param]})
    out["added"] = _error(late.step)
    out["plain_optimizer"] = _error(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1).step)

    # moved to meta: refused at forward, naming the parameters; materialized and initialized: runs
    model = _shard(_blocks())
    model.to("meta")
    out["meta"] = _error(lambda: model(x))
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model[0].reset_parameters()
    model[2].reset_parameters()
    reference = _blocks()
    torch.manual_seed(3)
    reference[0].reset_parameters()
    reference[2].reset_parameters()
    out["rematerialized_equal"] = torch.equal(model(x), reference(x))
    return out


@pytest.fixture(scope="module")
def outcome() -> dict[str, Any]:
    return run_distributed(_rank, 1, timeout=120.0)[0]


def test_optimizer_built_before_shard_is_refused_at_its_first_step(outcome: dict[str, Any]) -> None:
    message = outcome["early"]
    assert message is not None, "the step ran"
    assert "SGD holds 4 parameter(s) that overlap.shard replaced" in message
    assert "'weight', 'bias'" in message and "Build the optimizer after overlap.shard" in message
    assert outcome["early_unchanged"], "a refused step changed the model"


def test_optimizer_built_after_shard_steps_and_later_additions_are_checked(outcome: dict[str, Any]) -> None:
    assert outcome["late_steps"], "the optimizer built after shard did not change the model"
    assert outcome["added"] is not None and "SGD holds 1 parameter(s)" in outcome["added"]
    assert outcome["plain_optimizer"] is None


def test_meta_parameters_are_refused_at_forward_then_rematerialize(outcome: dict[str, Any]) -> None:
    message = outcome["meta"]
    assert message is not None, "forward ran on meta parameters"
    assert "on the meta device" in message and "'weight', 'bias'" in message and "to_empty" in message
    assert outcome["rematerialized_equal"], "to_empty + reset_parameters does not give the unsharded model's output"
