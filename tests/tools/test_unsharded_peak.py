"""``overlap.demo.unsharded_peak.UnshardedPeak``: the most bytes of unsharded parameters held at once,
for ``overlap.shard`` at prefetch depths 0, 1, 2 and for torch FSDP2, on 2 gloo CPU ranks.

Reference: hand-computed from the unsharded model's parameter sizes (float32) and the runtimes'
documented schedules, on :class:`~models.TinyLM` with 4 equal blocks (the root holds the embeddings,
the final norm and the tied head, and stays unsharded from its pre-forward to the end of backward):

* ``overlap.shard`` at depth ``d``: the running block and the ``d`` gathered ahead of it in forward,
  the last ``1 + d`` kept for backward, and backward's ``d`` ahead: ``root + (1 + d) * block``;
* FSDP2 (default settings): one block in forward (no forward prefetch), the running block and the
  one prefetched before it in backward: ``root + 2 * block``;
* ``overlap.shard`` with the optimizer in backward and a gather-ahead plan ``(count, lag)`` forced
  at depth ``d``: at the end of backward the ``count`` last blocks of forward are gathered ahead and
  the next forward's first ``1 + d`` groups (the root and ``d`` blocks) are gathered, so forward
  starts holding ``root + (1 + d + count)`` blocks, all 4 at most (a block gathered ahead that is
  also in the first window is held once).

Each ``overlap.shard`` peak is also checked against ``scheduler.held_bytes.held_bytes``, the
model the gather-ahead chooser keeps within its budget.

Counted over the steps after the first (which records the order and prefetches nothing).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

import overlap
from models import LR, SEED, TinyLM, local_batch, make_batch
from overlap.demo.unsharded_peak import UnshardedPeak, modelled_peak
from scheduler import cost_samples, gather_ahead, prefetch_depth, schedule_trial
from scheduler.held_bytes import held_bytes

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

BLOCKS = 4


def _peak(rank: int, world_size: int, runtime: str, prefetch: int,
          plan: Optional[tuple[int, int]] = None) -> tuple[int, int, int]:
    """``(peak, root bytes, block bytes)`` over steps 2 and 3 of AdamW training; with ``plan``,
    ``overlap.shard(prefetch="auto")`` with the optimizer in backward, the depth forced to
    ``prefetch`` and the gather-ahead plan to ``plan`` (in this rank's process only)."""
    torch.set_num_threads(1)
    if plan is not None:
        gather_ahead.choose_gather_ahead = lambda *args, **kwargs: plan
        prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: prefetch
        cost_samples.COST_SAMPLES = 1  # chosen in step 0: steps 1 and 2 run the plan
        schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on, untried
    torch.manual_seed(SEED)
    model = TinyLM(layers=BLOCKS)
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root_bytes = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks) * 4
    if runtime == "overlap":
        for block in model.blocks:
            overlap.shard(block, prefetch="auto" if plan else prefetch)
        overlap.shard(model, prefetch="auto" if plan else prefetch)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))  # without one, FSDP2 moves to a GPU where there is one
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if plan is not None:
        overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        model.loss(local_batch(make_batch(i), rank, world_size)).backward()
        if plan is None:
            optimizer.step()
            optimizer.zero_grad()

    step(0)
    with UnshardedPeak(model) as counter:
        step(1)
        step(2)
    assert counter.largest_group == max(root_bytes, block_bytes)
    if plan is not None:
        assert model.gather_ahead == plan and model.prefetch_depth == prefetch
    if runtime == "overlap":  # the gather-ahead chooser's memory model holds what was measured
        modelled = held_bytes([root_bytes] + [block_bytes] * BLOCKS, prefetch, plan[0] if plan else 0)
        assert modelled == modelled_peak(model) == counter.peak, (modelled, modelled_peak(model), counter.peak)
    else:
        assert modelled_peak(model) is None
    return counter.peak, root_bytes, block_bytes


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_overlap_holds_the_running_group_and_the_depth_ahead(distributed, prefetch: int) -> None:
    for peak, root, block in distributed(_peak, 2, "overlap", prefetch):
        assert peak == root + (1 + prefetch) * block, (peak, root, block)


@pytest.mark.parametrize("depth, plan", [(1, (1, 1)), (2, (1, 1)), (1, (3, 2))])
def test_gather_ahead_adds_the_groups_gathered_ahead(distributed, depth: int, plan: tuple[int, int]) -> None:
    for peak, root, block in distributed(_peak, 2, "overlap", depth, plan):
        assert peak == root + min(BLOCKS, 1 + depth + plan[0]) * block, (peak, root, block)


def test_fsdp2_counted_the_same_way(distributed) -> None:
    for peak, root, block in distributed(_peak, 2, "fsdp2", 0):
        assert peak == root + 2 * block, (peak, root, block)


def test_bad_model(single_rank_group) -> None:
    with pytest.raises(ValueError, match="model has no group sharded"):
        UnshardedPeak(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        UnshardedPeak("model")  # type: ignore[arg-type]
