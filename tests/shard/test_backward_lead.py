"""The prefetch horizon past the forward's end ([Note: prefetching across the forward's end] in
``overlap/sharding.py``): backward's first re-gathers are issued in forward, in the order backward
needs them, without adding a collective, bitwise the plain loop, on 2 and 3 ranks; a forward with
no backward after it and a step off the agreed order fall back without a hang.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import overlap
from overlap.sharding import sharded_states

pytestmark = pytest.mark.torch_kernels  # about when and what is gathered, not how it is packed

BLOCKS = 5


class _Net(nn.Module):
    """A linear layer (the root's parameters), then 5 blocks; ``skip`` names a block left out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 7)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 7), nn.Tanh()) for _ in range(BLOCKS))
        self.skip = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return x


def _train(rank: int, world: int, prefetch: int, unused_forward_at: int = -1, skip_at: int = -1) -> dict[str, Any]:
    """4 SGD steps of a 5-block MLP sharded per block. Records each all-gather as (step, phase, block):
    phase "forward" before backward started, "backward" after. ``unused_forward_at``: before that
    step a forward with grad enabled and no backward; ``skip_at``: that step runs without block 2."""
    from overlap.param_group import ParamGroup

    torch.set_num_threads(1)
    model = _Net()
    for block in model.blocks:
        overlap.shard(block, prefetch=prefetch)
    overlap.shard(model, prefetch=prefetch)
    states = sharded_states(model)
    index_of = {id(s.group): i for i, s in enumerate(states) if s.group is not None}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gathers: list[tuple[int, str, int]] = []
    step_now = [0]
    issue = ParamGroup.issue_gather

    def recording_issue(group: ParamGroup) -> None:
        pending = group.pending_gather is not None or group.is_unsharded
        issue(group)
        if not pending and group.pending_gather is not None:
            phase = "backward" if states[0].root.in_backward else "forward"
            gathers.append((step_now[0], phase, index_of[id(group)]))

    ParamGroup.issue_gather = recording_issue  # type: ignore[method-assign]
    losses = []
    try:
        for step in range(4):
            step_now[0] = step
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == unused_forward_at:
                model(x).sum()  # grad enabled, no backward
            model.skip = 2 if step == skip_at else -1  # blocks.2: state index 3
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    finally:
        ParamGroup.issue_gather = issue  # type: ignore[method-assign]
    groups = [s.group for s in states if s.group is not None]
    return {"losses": torch.stack(losses), "gathers": gathers,
            "params": [p.to_local().clone() for p in model.parameters()],
            "left_unsharded": [s.index for s in states[1:] if s.group.is_unsharded],
            "left_pending": [g.pending_gather is not None for g in groups]}


def _runs(rank: int, world: int, **kwargs: Any) -> list[dict[str, Any]]:
    return [_train(rank, world, 0, **kwargs), _train(rank, world, 1, **kwargs), _train(rank, world, 2, **kwargs)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["losses"], b["losses"]), (a["losses"], b["losses"])
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("world", [2, 3])
def test_backward_regathers_are_issued_in_forward_in_backward_order(distributed, world: int) -> None:
    for plain, *deep in distributed(_runs, world, timeout=300):
        for run, depth in zip(deep, (1, 2)):
            _same(run, plain)
            # no collective added: the same gathers per step as with nothing prefetched
            for step in range(4):
                assert (sorted(g[2] for g in run["gathers"] if g[0] == step)
                        == sorted(g[2] for g in plain["gathers"] if g[0] == step)), run["gathers"]
            # after the first step (which records the order): the root is state 0, blocks.0..4 are 1..5;
            # the root and the last block stay unsharded into backward, which first needs 4, then 3
            in_forward = [g[2] for g in run["gathers"] if g[0] == 2 and g[1] == "forward"]
            assert in_forward == [0, 1, 2, 3, 4, 5] + [4, 3][:depth], in_forward
            assert [g[2] for g in plain["gathers"] if g[0] == 2 and g[1] == "forward"] == [0, 1, 2, 3, 4, 5]
            assert not run["left_unsharded"] and not any(run["left_pending"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("off_script", [{"unused_forward_at": 2}, {"skip_at": 2}], ids=["unused-forward", "skipped-block"])
def test_off_script_steps_fall_back(distributed, world: int, off_script: dict[str, int]) -> None:
    """A forward with grad and no backward drops the lead unwaited at the next forward; a step that
    skips blocks.2 leaves the agreed order there and issues no gather for backward in forward."""
    for plain, *deep in distributed(_runs, world, **off_script, timeout=300):
        for run in deep:
            _same(run, plain)
            assert not run["left_unsharded"] and not any(run["left_pending"])
            if "skip_at" in off_script:
                in_forward = [g[2] for g in run["gathers"] if g[0] == 2 and g[1] == "forward"]
                assert len(in_forward) == len(set(in_forward)), in_forward
