"""torchao's float8 training under ``overlap.fully_shard``, side by side with FSDP2: the client of
FSDP2's all-gather extension ([Note: all-gather extensions] in ``overlap/gather_extension.py``).

``torchao.float8.convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each linear's weight a ``WeightWithDynamicFloat8CastTensor``: its ``fsdp_pre_all_gather`` casts
the shard to float8 with a scale agreed over the shard group (an all-reduce of the amax, inside the
pre-all-gather), the all-gather moves float8 bytes, and ``fsdp_post_all_gather`` wraps them as the
``Float8TrainingTensor`` the float8 linear multiplies with; a re-gather refills the same bytes and
sets the new scale through ``out=``. torchtitan's float8 recipe is this, with
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step (one all-reduce for every
weight's scale instead of one per weight).

On 2 gloo ranks (torchao's float8 linear runs on the CPU too): a 2-block MLP, 3 AdamW steps, with and
without precomputed scales, resharded after forward: losses and parameters bitwise FSDP2's, and the
weights' local tensors stay torchao's subclass. Skipped without torchao (the test extra installs it).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, assert_same_run, run_of

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]' installs it)")

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3
WIDTH = 32  # float8 matmuls want multiples of 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _train(runtime: str, world: int, rank: int, precompute: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = float8.convert_to_float8_training(
        Net(), config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            float8.precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.detach())
    out = run_of(losses, model)
    out["kinds"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {precompute: {runtime: _train(runtime, world, rank, precompute) for runtime in ("overlap", "fsdp2")}
            for precompute in (False, True)}


def test_torchao_float8_all_gather_trains_bitwise_as_under_fsdp2(distributed) -> None:
    """Fails if the weights are gathered as values (another computation than float8's), if a
    re-gather leaves the old scale, or if the shards lose torchao's subclass."""
    for rank, res in enumerate(distributed(_rank, 2)):
        for precompute, runs in res.items():
            ours, fsdp2 = runs["overlap"], runs["fsdp2"]
            assert_same_run(fsdp2, ours, (rank, precompute))
            assert ours["kinds"] == fsdp2["kinds"], (ours["kinds"], fsdp2["kinds"])
            assert ours["kinds"]["blocks.0.up.weight"] == "WeightWithDynamicFloat8CastTensor", ours["kinds"]
