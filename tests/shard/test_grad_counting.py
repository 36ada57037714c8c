"""A group's gradients are counted without reading the shards' flags before the last one arrives
([Note: counting a group's gradients] in ``overlap/param_group.py``), and the reductions still
happen in backward with the unsharded model's gradients, bitwise (world size 1, fp32: the gradient
moves to the shard unchanged).

Checked: per group and backward, ``requires_grad_indices`` (a pass over the shards' flags) is read
once, by the reduction, not once per gradient; each group is reduced during backward (its sharded
``.grad`` is set when the next group's first gradient arrives), and the gradients equal the plain
model's; with a parameter frozen between steps, the next step counts one gradient fewer and still
reduces every group, the frozen one getting none.
"""
from __future__ import annotations

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


def _models() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Block() for _ in range(3)])
    sharded = nn.Sequential(*[_Block() for _ in range(3)])
    sharded.load_state_dict(plain.state_dict())
    for block in sharded:
        overlap.shard(block)
    overlap.shard(sharded)
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


def test_flags_read_once_per_group_and_gradients_bitwise(single_rank_group, flag_reads) -> None:
    plain, sharded = _models()
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
