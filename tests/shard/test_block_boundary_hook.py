"""A block's input that is the output the previous sharded block hooked is watched inside that
output's node pre-hook ([Note: one hook per block boundary] in ``overlap/sharding.py``): no tensor
hook of its own, and the group is still reduced at the same point of backward as with one — before
the previous block's pre-backward. Checked with a block whose parameter gets no gradient (so only
the input watch can say its backward is done), in a chain, and with an op between the blocks (the
input is then a new tensor: a tensor hook, the same order)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap
from overlap.param_group import ParamGroup
from overlap.sharding import ShardState, sharded_states


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient: counting cannot finish

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Chain(nn.Module):
    def __init__(self, between: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x * 1.0 if self.between else x)
        return x


def _events_rank(rank: int, world: int, between: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Chain(between)
    for block in model.blocks:
        overlap.shard(block)
    overlap.shard(model)
    names = {id(s.group): s.fqn for s in sharded_states(model) if s.group is not None}
    events: list[str] = []
    issue, pre_backward, register = ParamGroup.issue_reduce, ShardState.pre_backward, torch.Tensor.register_hook
    hooks = [0]

    def recording_issue(group: ParamGroup, *args: Any) -> Any:
        events.append(f"reduce {names[id(group)]}")
        return issue(group, *args)

    def recording_pre_backward(state: ShardState) -> None:
        if state.root is not None and not (state._backward_seen == state.root.backward_count and state.root.in_backward):
            events.append(f"pre_backward {state.fqn or 'root'}")
        pre_backward(state)

    def counting_register(tensor: torch.Tensor, hook: Any) -> Any:
        hooks[0] += 1
        return register(tensor, hook)

    ParamGroup.issue_reduce = recording_issue  # type: ignore[method-assign]
    ShardState.pre_backward = recording_pre_backward  # type: ignore[method-assign]
    torch.Tensor.register_hook = counting_register  # type: ignore[method-assign]
    try:
        x = torch.randn(2, 4, requires_grad=True) * 1.0  # not a leaf: the first block is watched too
        model(x).sum().backward()
    finally:
        ParamGroup.issue_reduce, ShardState.pre_backward, torch.Tensor.register_hook = issue, pre_backward, register
    return {"events": events, "tensor_hooks": hooks[0],
            "grads": [p.grad is not None for n, p in model.named_parameters() if n.endswith("lin.weight")]}


def test_chained_inputs_are_watched_by_the_output_hook(distributed) -> None:
    for between, tensor_hooks in ((False, 1), (True, 3)):
        (r,) = distributed(_events_rank, 1, between)
        # Backward: each block is reduced once backward has passed its input, before the block
        # before it re-gathers (its pre-backward), in reverse order (the root, without parameters
        # of its own, shares the last block's output: that block's hook runs first). The order of
        # main before the change, where every input had a tensor hook.
        assert r["events"] == ["pre_backward blocks.2", "pre_backward root", "reduce blocks.2",
                               "pre_backward blocks.1", "reduce blocks.1", "pre_backward blocks.0",
                               "reduce blocks.0"], (between, r["events"])
        # Only inputs that are not the last hooked output need a tensor hook: the first block's
        # input (no sharded output before it), and every block's with an op in between.
        assert r["tensor_hooks"] == tensor_hooks, (between, r)
        assert all(r["grads"])
