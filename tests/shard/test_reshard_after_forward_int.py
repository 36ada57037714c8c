"""FSDP2's ``reshard_after_forward=<int>`` under ``overlap.fully_shard``: after forward each rank keeps
its ``1/k`` of the unsharded parameters and backward gathers them from its ``k``-rank post-forward
group ([Note: resharding to a smaller group after forward] in ``overlap/post_forward_shard.py``).

On 4 gloo ranks with ``k`` = 2, three blocks and a root, three AdamW steps, each followed by a
``no_grad`` forward (which leaves post-forward shards), and once more with a ``no_grad`` forward
before each optimizer step (whose post-forward shards the next forward must not use): the losses and the optimizer's parameters are bitwise
FSDP2's with the same ``k``, in fp32 and in bf16 mixed precision, and bitwise the runtime's own
``reshard_after_forward=True``, also with the matrices sharded on dim 1 (where FSDP2 fails) and with
the ``no_grad`` forward before the step (where FSDP2 trains on a stale root at any setting). The
counting link shows backward's all-gathers on the 2-rank groups.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import overlap
from models import COUNTING_LINK, all_gathers, assert_refused, refusal

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

WIDTH, STEPS, K = 8, 3, 2


def _run(runtime: str, reshard: Any, rank: int, bf16: bool = False, dim1: bool = False,
         eval_before_step: bool = False) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from overlap.testing import current_link

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH),
                                          nn.LayerNorm(WIDTH)) for _ in range(3)])
    mesh = init_device_mesh("cpu", (4,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    placement = (lambda p: Shard(1) if p.dim() == 2 else None) if dim1 else None
    for block in model:
        shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, shard_placement_fn=placement)
    shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    link = current_link()
    before = link.stats_by_group()
    losses = []
    for step in range(STEPS):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).float().square().mean()
        loss.backward()
        if eval_before_step:  # its post-forward shards are stale once the optimizer has stepped
            with torch.no_grad():
                model(x)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        with torch.no_grad():
            model(x)
    after = link.stats_by_group()
    gathers = {name: all_gathers(stats) - (all_gathers(before[name]) if name in before else 0)
               for name, stats in after.items()}
    post_forward = model[0]._overlap_state.group.post_forward if runtime == "overlap" else None
    # the optimizer's parameters (FSDP2 leaves the post-forward ones registered after a no_grad forward)
    params = [p.full_tensor() for group in opt.param_groups for p in group["params"]]
    return {"losses": torch.stack(losses), "params": params,
            "post_forward_gathers": gathers.get(post_forward.info.pg.group_name, 0) if post_forward else 0}


def _runs(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "fsdp2": _run("fsdp2", K, rank), "overlap": _run("overlap", K, rank),
        "fsdp2 bf16": _run("fsdp2", K, rank, bf16=True), "overlap bf16": _run("overlap", K, rank, bf16=True),
        "overlap True": _run("overlap", True, rank),
        "overlap dim1": _run("overlap", K, rank, dim1=True), "overlap dim1 True": _run("overlap", True, rank, dim1=True),
        "overlap eval before step": _run("overlap", K, rank, eval_before_step=True),
        "overlap eval before step True": _run("overlap", True, rank, eval_before_step=True),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["losses"], b["losses"]) and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_reshard_after_forward_to_a_smaller_group_matches_fsdp2(distributed) -> None:
    """Fails if a post-forward shard is gathered into the wrong bytes, used after the optimizer
    changed the shards, or not used at all (backward gathering from every rank)."""
    for rank, res in enumerate(distributed(_runs, 4, link=COUNTING_LINK, timeout=300)):
        assert _same(res["fsdp2"], res["overlap"]), (rank, res["fsdp2"]["losses"], res["overlap"]["losses"])
        assert _same(res["fsdp2 bf16"], res["overlap bf16"]), rank
        assert _same(res["overlap True"], res["overlap"]), rank
        assert _same(res["overlap dim1 True"], res["overlap dim1"]), rank
        assert _same(res["overlap eval before step True"], res["overlap eval before step"]), rank
        # block 0's backward gathers come from its post-forward group, once per step at least
        assert res["overlap"]["post_forward_gathers"] >= STEPS, res["overlap"]["post_forward_gathers"]
        assert res["overlap True"]["post_forward_gathers"] == 0


def _refusals(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, kwargs in {"with compress": {"compress": overlap.Compression()},
                         "not a divisor": {}}.items():
        module = nn.Linear(4, 4)
        reshard = 3 if name == "not a divisor" else 2
        out[name] = refusal(lambda: overlap.fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs),
                            module)
    return out


def test_reshard_after_forward_int_refusals(distributed) -> None:
    for rank, res in enumerate(distributed(_refusals, 4)):
        assert_refused(res["with compress"], "NotImplementedError", "reshard_after_forward=2 (reshard to groups of 2 "
                       "ranks) is not supported by overlap with compress=", rank)
        assert_refused(res["not a divisor"], "ValueError", "must divide the shard size 4, got 3", rank)
