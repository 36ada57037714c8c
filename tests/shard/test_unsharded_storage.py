"""The unsharded parameters of a group are views of one storage ([Note: unsharded parameters share
one storage] in ``overlap/param_group.py``): one ``resize_`` frees or re-allocates them all, each is
16-byte aligned and contiguous, and the copy-out keys its pointer table on that storage. Training
through it is checked against the unsharded model and FSDP2 in test_shard_numerics.py; here, the
storage itself, with mixed dtypes (fp32, bf16 and an int parameter) in one group.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap
from overlap.sharding import sharded_states


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.odd = nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16))
        self.steps = nn.Parameter(torch.arange(6, dtype=torch.int32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1, keepdim=True) * self.odd.float().sum() + self.steps.sum()


def _storage_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Mixed()
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    overlap.shard(model)
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    seen: dict[str, Any] = {}

    def look(module: nn.Module, args: Any) -> None:  # inside the forward: gathered
        storage, placement = group._unsharded_storage
        data = list(group._unsharded_data)
        seen["one_storage"] = all(d.untyped_storage().data_ptr() == storage.data_ptr() for d in data)
        seen["offsets"] = [d.data_ptr() - storage.data_ptr() for d in data]
        seen["placement_offsets"] = list(placement.byte_offsets)
        seen["nbytes"] = (storage.nbytes(), placement.nbytes)
        seen["contiguous"] = all(d.is_contiguous() for d in data)
        seen["dtypes"] = [d.dtype for d in data]
        seen["values_right"] = all(
            torch.equal(model.get_parameter(name).detach(), p)
            for name, p in expected.items())

    model.lin.register_forward_pre_hook(look)
    model(torch.randn(4, 5)).float().sum().backward()
    seen["freed_after_step"] = group._unsharded_storage[0].nbytes()
    return seen


def test_unsharded_parameters_share_one_aligned_storage(distributed) -> None:
    for seen in distributed(_storage_rank, 2):
        assert seen["one_storage"] and seen["contiguous"]
        assert seen["offsets"] == seen["placement_offsets"] and all(o % 16 == 0 for o in seen["offsets"])
        assert seen["nbytes"][0] == seen["nbytes"][1] > 0
        assert sorted(map(str, seen["dtypes"])) == ["torch.bfloat16", "torch.float32", "torch.float32", "torch.int32"]
        assert seen["values_right"], "the gathered parameters differ from the originals"
        assert seen["freed_after_step"] == 0
