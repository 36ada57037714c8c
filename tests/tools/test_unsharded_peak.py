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

Nested groups (a block sharded after its attention, so the attention is a group of its own inside
the block's forward): the block's own group stays unsharded around the attention's, in forward and
in backward. With blocks ``nested`` so split, the peak is hand-computed at the position where the
split block's attention runs (the root, that block whole, and the ``depth`` blocks ahead of it), the
byte model given the nesting holds it exactly, and the model without it is short of it.

Counted over the steps after the first (which records the order and prefetches nothing).
"""
from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import nn

import overlap
from models import LR, SEED, TinyLM, local_batch, make_batch
from overlap.demo.unsharded_peak import UnshardedPeak, _unsharded_bytes, modelled_peak
from scheduler import cost_samples, gather_ahead, prefetch_depth, schedule_trial
from scheduler.held_bytes import enclosing_positions, held_bytes

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

BLOCKS = 4


def _tiny_lm() -> tuple[TinyLM, int, int]:
    """A fresh :class:`~models.TinyLM` of ``BLOCKS`` blocks, its root's parameter bytes (embeddings,
    final norm, tied head) and one block's (float32)."""
    torch.manual_seed(SEED)
    model = TinyLM(layers=BLOCKS)
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root_bytes = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks) * 4
    return model, root_bytes, block_bytes


def _counted(model: nn.Module, step: Callable[[int], None]) -> UnshardedPeak:
    """``step(0)`` (it records the order and prefetches nothing), then steps 1 and 2 counted."""
    step(0)
    with UnshardedPeak(model) as counter:
        step(1)
        step(2)
    return counter


def _peak(rank: int, world_size: int, runtime: str, prefetch: int,
          plan: Optional[tuple[int, int]] = None) -> tuple[int, int, int]:
    """``(peak, root bytes, block bytes)`` over steps 2 and 3 of AdamW training; with ``plan``,
    ``overlap.shard(prefetch="auto")`` with the optimizer in backward, the depth forced to
    ``prefetch`` and the gather-ahead plan to ``plan`` (in this rank's process only)."""
    torch.set_num_threads(1)
    if plan is not None:
        gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, plan)
        prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: prefetch
        cost_samples.COST_SAMPLES = 1  # chosen in step 0: steps 1 and 2 run the plan
        schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on, untried
    model, root_bytes, block_bytes = _tiny_lm()
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

    counter = _counted(model, step)
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


def _nested_peak(rank: int, world_size: int, nested: tuple[int, ...], depth: int) -> dict[str, object]:
    """The counted peak over steps 2 and 3 of AdamW training with ``prefetch=depth``, the blocks in
    ``nested`` sharded after their attention; the group bytes, the order and the two models."""
    torch.set_num_threads(1)
    model, root_bytes, block_bytes = _tiny_lm()
    for i, block in enumerate(model.blocks):
        if i in nested:
            overlap.shard(block.attn, prefetch=depth)
        overlap.shard(block, prefetch=depth)
    overlap.shard(model, prefetch=depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        model.loss(local_batch(make_batch(i), rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()

    counter = _counted(model, step)
    root = model._overlap_state.root  # type: ignore[attr-defined]
    order = root.agreed_order
    nbytes = [_unsharded_bytes(root.states[i].group) for i in order]  # every group has parameters here
    enclosing = enclosing_positions(order, root.post_forward_seq, root.owner.index)
    return {"peak": counter.peak, "root": root_bytes, "block": block_bytes, "modelled": modelled_peak(model),
            "nested model": held_bytes(nbytes, depth, 0, enclosing), "flat model": held_bytes(nbytes, depth),
            "enclosing": [sorted(e) for e in enclosing]}


@pytest.mark.parametrize("nested, depth", [((1,), 2), ((0, 2), 1)], ids=["block1-depth2", "blocks0and2-depth1"])
def test_a_block_holds_its_group_around_its_nested_groups(distributed, nested: tuple[int, ...], depth: int) -> None:
    for r in distributed(_nested_peak, 2, nested, depth):
        # order: the root, then each block, a nested block's attention right after it (enclosed by it)
        expected: list[list[int]] = [[]]
        for i in range(BLOCKS):
            expected.append([])
            if i in nested:
                expected.append([len(expected) - 1])
        assert r["enclosing"] == expected, r["enclosing"]
        # at the last nested block's attention: the root, that block whole, and ``depth`` blocks ahead
        assert r["peak"] == r["root"] + (1 + depth) * r["block"], r
        assert r["modelled"] == r["nested model"] == r["peak"], r
        assert r["flat model"] < r["peak"], r  # what the choosers' budget check missed before


def test_enclosing_positions_and_the_bytes_they_add() -> None:
    # root 0 around everything (left out); group 1 around 2; 3 after them
    assert enclosing_positions([0, 1, 2, 3], [2, 1, 3, 0], root=0) == [frozenset(), frozenset(), {1}, frozenset()]
    assert enclosing_positions([5, 7, 6], [6, 7, 5], root=5) == [frozenset(), frozenset(), {1}]
    with pytest.raises(ValueError, match="each once"):
        enclosing_positions([0, 1, 1], [1, 1, 0])
    with pytest.raises(ValueError, match="each once"):
        enclosing_positions([0, 1, 2], [1, 0])
    nbytes = [10, 100, 1, 1000]  # root, block, its nested part, the next block
    around = [frozenset(), frozenset(), frozenset({1}), frozenset()]
    # depth 1: at position 2 the nested part, the next block ahead and its enclosing block
    assert held_bytes(nbytes, 1, 0, around) == 10 + 1 + 1000 + 100
    assert held_bytes(nbytes, 1) == 10 + 1 + 1000
    # depth 0, backward at position 2: the nested part and its block
    assert held_bytes([10, 100, 50, 1], 0, 0, around) == 10 + 150
    assert held_bytes([10, 100, 50, 1], 0) == 10 + 100
    with pytest.raises(ValueError, match="one entry per position"):
        held_bytes(nbytes, 1, 0, around[:2])


def test_the_depth_chooser_keeps_nested_groups_within_the_budget() -> None:
    """A budget that depth 2 fits only while the block around the nested group is left out: the
    chooser given the nesting takes depth 1."""
    compute, gather = [0.001, 0.01, 0.01, 0.01, 0.01, 0.01], [0.0, 0.02, 0.02, 0.02, 0.02, 0.02]
    nbytes = [10, 100, 100, 100, 100, 100]
    around = [frozenset(), frozenset(), frozenset({1}), frozenset(), frozenset(), frozenset()]
    budget = held_bytes(nbytes, 2)
    assert held_bytes(nbytes, 2, 0, around) > budget
    assert prefetch_depth.choose_prefetch_depth(compute, gather, nbytes, budget) >= 2
    assert prefetch_depth.choose_prefetch_depth(compute, gather, nbytes, budget, enclosing=around) == 1


def _enclosing_the_choosers_saw(rank: int, world_size: int) -> dict[str, object]:
    """``prefetch="auto"`` with the optimizer in backward on TinyLM with block 1 sharded after its
    attention: the ``enclosing`` each chooser was called with (the choice in step 0)."""
    torch.set_num_threads(1)
    seen: dict[str, object] = {}
    for module, name in ((prefetch_depth, "choose_prefetch_depth"), (gather_ahead, "choose_gather_ahead")):
        def recording(*args: object, _original: Callable = getattr(module, name), _name: str = name,
                      **kwargs: object) -> object:
            enclosing = kwargs.get("enclosing")
            seen[_name] = None if enclosing is None else [sorted(e) for e in enclosing]  # type: ignore[union-attr]
            return _original(*args, **kwargs)

        setattr(module, name, recording)
    cost_samples.COST_SAMPLES = 1
    model, _, _ = _tiny_lm()
    overlap.shard(model.blocks[1].attn, prefetch="auto")
    for block in model.blocks:
        overlap.shard(block, prefetch="auto")
    overlap.shard(model, prefetch="auto")
    overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    for i in range(2):
        model.loss(local_batch(make_batch(i), rank, world_size)).backward()
    return seen


def test_the_runtime_hands_the_nesting_to_both_choosers(distributed) -> None:
    # root, blocks.0, blocks.1, blocks.1.attn (inside blocks.1), blocks.2, blocks.3
    expected = [[], [], [], [2], [], []]
    for seen in distributed(_enclosing_the_choosers_saw, 2):
        assert seen == {"choose_prefetch_depth": expected, "choose_gather_ahead": expected}, seen
