"""A group's gradients are counted without reading the shards' flags before the last one arrives
([Note: counting a group's gradients] in ``overlap/param_group.py``), and the reductions still
happen in backward with the unsharded model's gradients, bitwise (world size 1, fp32: the gradient
moves to the shard unchanged).

Checked: per group and backward, ``requires_grad_indices`` (a pass over the shards' flags) is read
once, by the reduction, not once per gradient; each group is reduced during backward (its sharded
``.grad`` is set when the next group's first gradient arrives), and the gradients equal the plain
model's; with a parameter frozen between steps, the next step counts one gradient fewer and still
reduces every group, the frozen one getting none. With ``max_inflight_bytes`` (whose cap reads
the reduction's size first) the flags are still read once per reduction, and flags changed between
forward and backward are seen as without it; the indices of unchanged flags are one tuple, rebuilt
when a flag changes; each unsharded parameter keeps one post-accumulate-grad hook through any number
of flag changes.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

import overlap
from overlap.param_group import ParamGroup


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.gain = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain


def _models(max_inflight_bytes: Optional[int] = None) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Block() for _ in range(3)])
    sharded = nn.Sequential(*[_Block() for _ in range(3)])
    sharded.load_state_dict(plain.state_dict())
    for block in sharded:
        overlap.shard(block, max_inflight_bytes=max_inflight_bytes)
    overlap.shard(sharded, max_inflight_bytes=max_inflight_bytes)
    return plain, sharded


@pytest.fixture
def flag_reads(monkeypatch):
    reads: list[int] = []
    original = ParamGroup.requires_grad_indices

    def counted(self):
        reads.append(id(self))
        return original.fget(self)

    monkeypatch.setattr(ParamGroup, "requires_grad_indices", property(counted))
    return reads


@pytest.mark.parametrize("max_inflight_bytes", [None, 1 << 20])
def test_flags_read_once_per_group_and_gradients_bitwise(single_rank_group, flag_reads, max_inflight_bytes) -> None:
    plain, sharded = _models(max_inflight_bytes)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    plain(x).sum().backward()
    groups = [s.group for s in overlap.sharding.sharded_states(sharded) if s.group is not None]
    reduced_before: list[bool] = []  # at each of block 1's gradients: has block 2 been reduced?
    for step in range(2):
        sharded.zero_grad(set_to_none=True)
        flag_reads.clear()
        sharded(x).sum().backward()
        assert [flag_reads.count(id(g)) for g in groups] == [1] * len(groups)  # the reduction's read only
        for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters()):
            assert torch.equal(q.grad.full_tensor(), p.grad), name
        if step == 0:  # the unsharded parameters exist now (made at the first gather), for life
            for u in sharded[1]._overlap_state.group.unsharded:
                u.register_post_accumulate_grad_hook(
                    lambda _: reduced_before.append(sharded[2].lin.weight.grad is not None))
    assert len(reduced_before) == 3 and all(reduced_before)


def test_frozen_between_steps_counts_one_fewer(single_rank_group) -> None:
    plain, sharded = _models()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    sharded(x).sum().backward()
    sharded[1].gain.requires_grad_(False)
    plain[1].gain.requires_grad_(False)
    sharded.zero_grad(set_to_none=True)
    sharded(x).sum().backward()
    plain(x).sum().backward()
    assert sharded[1]._overlap_state.group._grads_needed == 2  # lin.weight, lin.bias
    assert sharded[1].gain.grad is None
    for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters()):
        if p.requires_grad:
            assert torch.equal(q.grad.full_tensor(), p.grad), name


# A shard frozen or unfrozen between its forward and its backward ([Note: a gradient needs both
# flags] in overlap/param_group.py): the plain model's parameter gets no gradient in that step, and
# nothing of that step's may reach a later one; each unsharded parameter keeps the one
# post-accumulate-grad hook its first gather registered, whatever the flags did since. The gradients
# are mostly accumulated over the steps, so a stale unsharded gradient reduced later would show; one
# step starts from no gradients, so a zero-filled gradient where the plain model has none would show.
# Every rank computes on the same input: the average of equal gradients over 1 or 2 ranks is exact,
# so the comparison is bitwise.
_FLAG_STEPS = (  # (gain's requires_grad in the forward, in the backward, zero_grad first), per step
    (True, True, False), (True, False, False), (False, True, True), (True, True, False),
    (True, False, False), (False, True, False), (True, True, False))


def _flag_changes_run(rank: int, world: int, max_inflight_bytes: Optional[int] = None) -> list[dict[str, object]]:
    plain, sharded = _models(max_inflight_bytes)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    seen = []
    for forward_flag, backward_flag, zero_grad in _FLAG_STEPS:
        for model in (plain, sharded):
            if zero_grad:  # the step's gradients alone: a zero-filled one where none is due would show
                model.zero_grad(set_to_none=True)
            model[1].gain.requires_grad_(forward_flag)
            loss = model(x).sum()
            model[1].gain.requires_grad_(backward_flag)
            loss.backward()
        group = sharded[1]._overlap_state.group
        seen.append({
            "grads": {name: (None if q.grad is None else q.grad.full_tensor().clone(),
                             None if p.grad is None else p.grad.clone())  # accumulated in place later
                      for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters())},
            "unsharded_grads_left": sum(u.grad is not None for u in group.unsharded),
            # post-accumulate-grad hooks per unsharded parameter: one, however often a flag changed
            "hooks": [len(u._post_accumulate_grad_hooks or {}) for u in group.unsharded],
        })
    return seen


def _check_flag_changes(steps: list[dict[str, object]]) -> None:
    for step, seen in enumerate(steps):
        assert seen["unsharded_grads_left"] == 0, f"step {step}: an unsharded gradient stayed behind"
        # a hook added again at each change would call the runtime once more per gradient, without bound
        assert seen["hooks"] == [1, 1, 1], f"step {step}: hooks per unsharded parameter {seen['hooks']}"
        for name, (got, want) in seen["grads"].items():
            assert (got is None) == (want is None), f"step {step}, {name}: {got} vs the plain model's {want}"
            if want is not None:
                assert torch.equal(got, want), f"step {step}, {name}"


def test_flags_changed_between_forward_and_backward_as_the_plain_model(single_rank_group) -> None:
    _check_flag_changes(_flag_changes_run(0, 1))


@pytest.mark.parametrize("max_inflight_bytes", [None, 1 << 20])
def test_flags_changed_between_forward_and_backward_on_two_ranks(distributed, max_inflight_bytes) -> None:
    for steps in distributed(_flag_changes_run, 2, max_inflight_bytes):
        _check_flag_changes(steps)


def test_indices_of_unchanged_flags_are_one_tuple(single_rank_group) -> None:
    _, sharded = _models()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    block = sharded[1]
    sharded(x).sum().backward()  # the unsharded parameters follow the flags (all True)
    group = block._overlap_state.group
    first = group.requires_grad_indices
    assert first == (0, 1, 2) and group.requires_grad_indices is first
    block.gain.requires_grad_(False)  # after the gather: both flags needed, so it drops out now
    gain = [i for i, p in enumerate(group.sharded) if p is block.gain][0]
    assert group.requires_grad_indices == tuple(i for i in range(3) if i != gain)
    block.gain.requires_grad_(True)
    assert group.requires_grad_indices == (0, 1, 2)
