"""``overlap.load_full_state_dict`` cuts the runtime's own parameters' rows itself (the layout's
rule) instead of calling ``distribute_tensor`` per parameter: each rank's local tensors after the
load are bit for bit what ``distribute_tensor`` + ``load_state_dict`` give, on full sharding with
ranks that hold no rows, on HSDP's 2-D mesh, and for a 0-dim (replicated) parameter.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import overlap


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 2)  # 2 rows: ranks 2 and 3 of 4 hold none
        self.b = nn.Linear(2, 7)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _load_rank(rank: int, world: int, hsdp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model, reference = _Model(), _Model()
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2))
    for m in (model, reference):
        overlap.shard(m.a, mesh=mesh)
        overlap.shard(m, mesh=mesh)
    torch.manual_seed(1)
    full = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    overlap.load_full_state_dict(model, full)
    with torch.no_grad():  # the path before: distribute_tensor per parameter, then load_state_dict
        local = {k: distribute_tensor(full[k], t.device_mesh, t.placements, src_data_rank=None)
                 if isinstance(t, DTensor) else full[k] for k, t in reference.state_dict(keep_vars=True).items()}
    reference.load_state_dict(local)
    return {k: (_bits(v.to_local()), _bits(reference.state_dict()[k].to_local()), tuple(v.to_local().shape))
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("world", "hsdp"), [(4, False), (4, True)])
def test_local_tensors_after_a_full_load_are_distribute_tensors(distributed, world: int, hsdp: bool) -> None:
    shapes = set()
    for seen in distributed(_load_rank, world, hsdp):
        for key, (got, want, shape) in seen.items():
            assert torch.equal(got, want), (key, hsdp)
            shapes.add((key, shape))
    if not hsdp:
        assert ("a.weight", (0, 5)) in shapes, "no rank without rows was loaded"
