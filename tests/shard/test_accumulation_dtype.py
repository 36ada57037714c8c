"""Gradient accumulation under ``no_sync`` with mixed precision: the unsharded gradients of the
micro-batches add up in ``reduce_dtype`` where it is wider than ``param_dtype``, as FSDP2's do
([Note: accumulating in the reduce dtype] in ``overlap/param_group.py``), and a torch
``MixedPrecisionPolicy`` without ``reduce_dtype`` reduces in what FSDP2 of the installed torch
reduces in (the compute dtype before 2.15, the parameters' own dtype from 2.15).

On 1 and 2 gloo ranks, TinyLM (its head tied to the token embedding: two contributions to one
gradient per backward) under ``overlap.fully_shard`` and torch's ``fully_shard`` side by side,
bfloat16 parameters, ``reduce_dtype`` float32 and None; per step a micro-batch under ``no_sync`` and a
synced one, AdamW: losses and parameters bitwise FSDP2's, and the step without accumulation too.
Before the fix the accumulating runs ended 1e-2 off FSDP2's parameters after 3 steps (sums rounded to
bfloat16 per micro-batch).
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, TinyLM, assert_same_run, local_batch, make_batch, make_optimizer, run_of

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3


def _train(runtime: str, rank: int, world: int, reduce_dtype: Optional[torch.dtype], accumulate: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(SEED)
    model = TinyLM()
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    mesh = init_device_mesh("cpu", (world,))
    for module in (*model.blocks, model):
        shard(module, mesh=mesh, mp_policy=mp)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        if accumulate:
            model.set_requires_gradient_sync(False)
            for micro in range(2):
                model.loss(local_batch(make_batch(10 * micro + step + 20), rank, world)).backward()
            model.set_requires_gradient_sync(True)
        loss = model.loss(local_batch(make_batch(step), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return run_of(losses, model)


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {(runtime, str(reduce_dtype), accumulate): _train(runtime, rank, world, reduce_dtype, accumulate)
            for runtime in ("overlap", "fsdp2") for reduce_dtype in (torch.float32, None)
            for accumulate in (True, False)}


@pytest.mark.parametrize("world", [1, 2])
def test_accumulation_under_mixed_precision_is_bitwise_fsdp2(distributed, world: int) -> None:
    """Fails if the micro-batches add up in bfloat16 (or cast each contribution of the tied embedding
    where the installed torch's FSDP2 sums them first, or the other way round), or if a policy
    without reduce_dtype reduces in another dtype than FSDP2 of this torch."""
    for rank, res in enumerate(distributed(_rank, world)):
        for reduce_dtype in ("torch.float32", "None"):
            for accumulate in (True, False):
                ours, theirs = res[("overlap", reduce_dtype, accumulate)], res[("fsdp2", reduce_dtype, accumulate)]
                what = (rank, reduce_dtype, accumulate)
                assert_same_run(theirs, ours, what)
