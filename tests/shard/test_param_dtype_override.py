"""torch 2.15's ``MixedPrecisionPolicy.param_dtype_override_fn`` under ``overlap.fully_shard``: some
parameters of a group kept in their own dtype while the rest compute in ``param_dtype``.

The kept ones travel beside the group's fused all-gather, exactly, through the all-gather extension
path (``OwnDtypeRows``, [Note: all-gather extensions] in ``overlap/gather_extension.py``); the fused
one moves the rest in bfloat16. On 1 and 2 gloo ranks, side by side with FSDP2: blocks of
LayerNorm + Linear + Linear with the norms' parameters kept in float32 and the linears' in
bfloat16, ``reduce_dtype`` None (2.15: the parameters' own dtype) and bfloat16, 3
AdamW steps resharded after forward: the dtypes forward sees, the losses and the parameters bitwise
FSDP2's, and the fused all-gather carrying the linears alone. An override
returning another dtype, or not a dtype, raises ValueError naming the parameter before anything
changes, as FSDP2's does.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, NormedMLP, assert_same_run, run_of
from scheduler.torch_versions import TORCH_VERSION

pytestmark = [pytest.mark.torch_kernels,  # training loops: packing by the torch fallback (conftest)
              pytest.mark.skipif(TORCH_VERSION < (2, 15), reason="param_dtype_override_fn is torch 2.15's")]

STEPS, WIDTH = 3, 8


class Block(NormedMLP):
    """The norm computes in float32 whatever the linears' dtype."""

    def __init__(self) -> None:
        super().__init__(WIDTH)
        for p in self.norm.parameters():
            p.keep_own_dtype = True  # read by _keep_norms

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(self.norm(h.float()).to(self.up.weight.dtype))))


def _keep_norms(p: nn.Parameter) -> Any:
    return p.dtype if getattr(p, "keep_own_dtype", False) else None


def _policy(reduce_dtype: Any, override: Any = _keep_norms) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, param_dtype_override_fn=override)


def _train(runtime: str, world: int, rank: int, reduce_dtype: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = nn.Sequential(Block(), Block())
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    for block in model:
        shard(block, mesh=mesh, mp_policy=_policy(reduce_dtype))
    shard(model, mesh=mesh, mp_policy=_policy(reduce_dtype))
    seen: dict[str, torch.dtype] = {}
    model[0].register_forward_pre_hook(
        lambda m, _: seen.update({n: p.dtype for n, p in m.named_parameters()}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out = run_of(losses, model)
    out["seen"] = seen
    if runtime == "overlap":
        group = model[0]._overlap_state.group
        out["fused"] = ([group.fqns[i] for i in group.packed_indices], group.gather_layout.shapes)
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {str(reduce_dtype): {runtime: _train(runtime, world, rank, reduce_dtype) for runtime in ("overlap", "fsdp2")}
            for reduce_dtype in (None, torch.bfloat16)}


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_kept_in_their_dtype_train_bitwise_as_under_fsdp2(distributed, world: int) -> None:
    """Fails if a kept parameter is computed in bfloat16 (forward's dtypes differ, and the runs), if
    it is gathered rounded, or if the fused gather still carries it."""
    for rank, res in enumerate(distributed(_rank, world)):
        for what, runs in res.items():
            ours, fsdp2 = runs["overlap"], runs["fsdp2"]
            assert ours["seen"] == fsdp2["seen"], (what, ours["seen"], fsdp2["seen"])
            assert ours["seen"]["norm.weight"] == ours["seen"]["norm.bias"] == torch.float32, ours["seen"]
            assert ours["seen"]["up.weight"] == ours["seen"]["up.bias"] == torch.bfloat16, ours["seen"]
            assert_same_run(fsdp2, ours, (rank, what))
            names, shapes = ours["fused"]
            assert names == ["up.weight", "up.bias", "down.weight", "down.bias"] and len(shapes) == 4, ours["fused"]


@pytest.mark.parametrize("returned", [torch.float16, "float32"])
def test_an_override_of_another_dtype_is_refused_before_anything_changes(single_rank_group, returned: Any) -> None:
    block = Block()
    with pytest.raises(ValueError, match="param_dtype_override_fn must return None, param_dtype .* for 'norm.weight'"):
        overlap.fully_shard(block, mesh=init_device_mesh("cpu", (1,)), mp_policy=_policy(None, lambda p: returned))
    assert type(block) is Block and not isinstance(block.norm.weight, torch.distributed.tensor.DTensor)
