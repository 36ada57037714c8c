"""Groups kept unsharded from their forward into backward ([Note: kept for backward] in
``overlap/sharding.py``): the last group and the ``prefetch`` groups before it are not re-gathered
in backward, bitwise the plain loop, never more than ``1 + prefetch`` groups unsharded, on 2 and 3
ranks; a forward with no backward after it and a step off the agreed order fall back without a hang.
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


def _train(rank: int, world: int, prefetch: int, unused_forward_at: int = -1, skip_at: int = -1,
           deepen_at: int = -1) -> dict[str, Any]:
    """4 SGD steps of a 5-block MLP sharded per block. Records each all-gather as (step, phase, state
    index): phase "forward" before backward started, "backward" after, and the most blocks unsharded
    at once. ``unused_forward_at``: before that step a forward with grad enabled and no backward;
    ``skip_at``: that step runs without blocks.2; ``deepen_at``: from that step every group's
    prefetch is one deeper (as the schedule trial's ``_apply_plan`` changes it)."""
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
    peak = [0]
    issue, finish = ParamGroup.issue_gather, ParamGroup.finish_gather

    def recording_issue(group: ParamGroup) -> None:
        pending = group.pending_gather is not None or group.is_unsharded
        issue(group)
        if not pending and group.pending_gather is not None:
            phase = "backward" if states[0].root.in_backward else "forward"
            gathers.append((step_now[0], phase, index_of[id(group)]))

    def counting_finish(group: ParamGroup, *args: Any, **kwargs: Any) -> None:
        finish(group, *args, **kwargs)
        peak[0] = max(peak[0], sum(s.group.is_unsharded for s in states[1:]))

    ParamGroup.issue_gather = recording_issue  # type: ignore[method-assign]
    ParamGroup.finish_gather = counting_finish  # type: ignore[method-assign]
    losses = []
    try:
        for step in range(4):
            step_now[0] = step
            if step == deepen_at:
                for state in states:
                    state.prefetch += 1
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
        ParamGroup.issue_gather, ParamGroup.finish_gather = issue, finish  # type: ignore[method-assign]
    groups = [s.group for s in states if s.group is not None]
    return {"losses": torch.stack(losses), "gathers": gathers, "peak": peak[0],
            "params": [p.to_local().clone() for p in model.parameters()],
            "left_unsharded": [s.index for s in states[1:] if s.group.is_unsharded],
            "left_pending": [g.pending_gather is not None for g in groups]}


def _runs(rank: int, world: int, **kwargs: Any) -> list[dict[str, Any]]:
    return [_train(rank, world, 0, **kwargs), _train(rank, world, 1, **kwargs), _train(rank, world, 2, **kwargs)]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["losses"], b["losses"]), (a["losses"], b["losses"])
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("world", [2, 3])
def test_the_last_groups_are_not_gathered_again_in_backward(distributed, world: int) -> None:
    for plain, *deep in distributed(_runs, world, timeout=300):
        for run, depth in zip(deep, (1, 2)):
            _same(run, plain)
            assert 1 <= run["peak"] <= 1 + depth, run["peak"]
            # the root is state 0, blocks.0..4 are states 1..5. The first step records the order and
            # keeps nothing; then blocks.4 and the `depth` blocks before it are kept (prefetch=0: the last).
            for step in range(4):
                backward = [g[2] for g in run["gathers"] if g[0] == step and g[1] == "backward"]
                plain_backward = [g[2] for g in plain["gathers"] if g[0] == step and g[1] == "backward"]
                assert plain_backward == ([5, 4, 3, 2, 1] if step == 0 else [4, 3, 2, 1]), plain_backward
                assert backward == ([5, 4, 3, 2, 1] if step == 0 else [4, 3, 2, 1][depth:]), (step, backward)
                forward = [g[2] for g in run["gathers"] if g[0] == step and g[1] == "forward"]
                assert forward == [0, 1, 2, 3, 4, 5], forward
            assert not run["left_unsharded"] and not any(run["left_pending"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("off_script", [{"unused_forward_at": 2}, {"skip_at": 2}], ids=["unused-forward", "skipped-block"])
def test_off_script_steps_fall_back(distributed, world: int, off_script: dict[str, int]) -> None:
    """A forward with grad and no backward leaves the kept groups to the next forward, which
    reshards them first; a step that skips blocks.2 leaves the agreed order there and keeps the last
    ``1 + prefetch`` groups that ran ([Note: kept off script]): backward gathers only the others
    again, within the same bound of groups unsharded."""
    for plain, *deep in distributed(_runs, world, **off_script, timeout=300):
        for run, depth in zip(deep, (1, 2)):
            _same(run, plain)
            assert not run["left_unsharded"] and not any(run["left_pending"])
            if "skip_at" in off_script:  # blocks.2 (state 3) did not run: blocks.4 and .3 kept
                # (after a forward whose graph is dropped, its kept groups stay into the next one:
                # one group more than the bound, as before [Note: kept off script])
                assert 1 <= run["peak"] <= 1 + depth, run["peak"]
                backward = [g[2] for g in run["gathers"] if g[0] == 2 and g[1] == "backward"]
                assert backward == [2, 1], (depth, backward)  # blocks.1 ran on script: resharded


def _deepened(rank: int, world: int) -> list[dict[str, Any]]:
    return [_train(rank, world, 2), _train(rank, world, 1, deepen_at=2)]


def test_a_deeper_prefetch_keeps_more_groups_from_the_next_step(distributed) -> None:
    """A prefetch depth changed between steps (1, then 2 from step 2, the same agreed order) keeps
    the groups of the new depth from that step on: backward re-gathers what prefetch=2 re-gathers
    there, with the same values."""
    for deep, deepened in distributed(_deepened, 2, timeout=300):
        _same(deepened, deep)
        for step in range(4):
            backward = [g[2] for g in deepened["gathers"] if g[0] == step and g[1] == "backward"]
            want = {0: [5, 4, 3, 2, 1], 1: [3, 2, 1]}.get(step, [2, 1])  # depth 1 at step 1, 2 from step 2
            assert backward == want, (step, backward)
        assert deepened["peak"] <= 3 and not deepened["left_unsharded"]
