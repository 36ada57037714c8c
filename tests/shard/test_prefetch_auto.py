"""``overlap.shard(..., prefetch="auto")``: the prefetch depth chosen from the first step's measured
costs and a byte budget, agreed across ranks ([Note: prefetch="auto"] in ``overlap/sharding.py``).

Every run is compared bitwise with the same loop at ``prefetch=0`` (nothing gathered ahead): a
schedule may only move when a gather happens, never what it gathers or what the step computes.
Covered: the chosen depth is one number on every rank (the deepest rank's choice), within the
budget, and a forward that skips a block (the order changes after the depth was chosen) falls back
without a hang, on 2 and 3 ranks.
The depth model itself is ``tests/scheduling/test_prefetch_depth.py``'s.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import overlap
from models import SEED, TinyLM, local_batch, make_batch, make_optimizer

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)


def _train(rank: int, world_size: int, prefetch: Any, budget: Optional[int] = None,
           skip_first_on_odd_steps: bool = False) -> dict[str, Any]:
    """4 AdamW steps of TinyLM sharded per block with ``prefetch`` (and ``max_inflight_bytes=budget``);
    with ``skip_first_on_odd_steps``, odd steps run without blocks[0]."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        overlap.shard(block, prefetch=prefetch, max_inflight_bytes=budget)
    overlap.shard(model, prefetch=prefetch, max_inflight_bytes=budget)
    blocks = list(model.blocks)
    skipped = nn.ModuleList([nn.Identity(), *blocks[1:]])
    opt = make_optimizer(model.parameters())
    losses, depths = [], []
    for step in range(4):
        model.blocks = skipped if skip_first_on_odd_steps and step % 2 else nn.ModuleList(blocks)
        loss = model.loss(local_batch(make_batch(step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        depths.append(model.prefetch_depth)
    model.blocks = nn.ModuleList(blocks)
    groups = [s.group for s in overlap.sharding.sharded_states(model) if s.group is not None]
    return {"losses": torch.stack(losses), "depths": depths, "max_inflight": model.max_inflight_bytes_seen,
            "gather_bytes": [g.all_gather_bytes() for g in groups],
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["losses"], b["losses"]), (a["losses"], b["losses"])
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name


def _runs(rank: int, world_size: int, option_sets: list[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
    return [_train(rank, world_size, **options, **kwargs) for options in option_sets]


def test_auto_depth_is_agreed_within_budget_and_bitwise_the_plain_loop(distributed) -> None:
    budget = 27648 + 9728  # bytes: one block's gather and the root's (TinyLM's defaults, fp32, 2 ranks): depth 1
    option_sets = [{"prefetch": 0}, {"prefetch": "auto"}, {"prefetch": "auto", "budget": budget}]
    per_rank = distributed(_runs, 2, option_sets, timeout=300)
    for plain, auto, tight in per_rank:
        _assert_same(auto, plain)
        _assert_same(tight, plain)
        assert plain["depths"] == [0] * 4
        depth = auto["depths"][0]
        assert depth is not None and depth >= 1 and auto["depths"] == [depth] * 4, auto["depths"]
        # within the budget: any group and the groups prefetched after it fit, unless depth 1 alone does not
        assert sorted(tight["gather_bytes"]) == [9728, 27648, 27648], "the budget above assumes these groups"
        assert tight["depths"] == [1] * 4, "two blocks' gathers do not fit the budget: depth 1"
        assert tight["max_inflight"] <= budget
    assert len({runs[1]["depths"][0] for runs in per_rank}) == 1, "every rank prefetches alike"
    assert len({runs[2]["depths"][0] for runs in per_rank}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_auto_depth_falls_back_when_a_block_is_skipped(distributed, world: int) -> None:
    option_sets = [{"prefetch": 0}, {"prefetch": "auto"}]
    for plain, auto in distributed(_runs, world, option_sets, skip_first_on_odd_steps=True, timeout=300):
        _assert_same(auto, plain)
        assert auto["depths"][0] is not None and auto["depths"][0] >= 1


def _rank_dependent_choice(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Each rank's model picks ``rank + 1``: the ranks must agree on the largest."""
    import scheduler.prefetch_depth

    scheduler.prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: rank + 1
    return [_train(rank, world_size, prefetch=0), _train(rank, world_size, prefetch="auto")]


def test_ranks_agree_on_the_deepest_choice(distributed) -> None:
    per_rank = distributed(_rank_dependent_choice, 3, timeout=300)
    for plain, auto in per_rank:
        assert auto["depths"] == [3] * 4, auto["depths"]  # the deepest of 1, 2, 3 (all the groups ahead)
        _assert_same(auto, plain)


def _costs_seen(rank: int, world_size: int) -> list[dict[str, Any]]:
    """The costs ``choose_prefetch_depth`` is handed, for a first step with a backward and for one
    without (under ``torch.no_grad``), and the depth before and after the first backward."""
    import scheduler.prefetch_depth

    seen: list[dict[str, Any]] = []

    def spy(compute, gather, nbytes, budget, tolerance=0.01, backward=None):  # type: ignore[no-untyped-def]
        seen.append({"compute": list(compute), "gather": list(gather), "nbytes": list(nbytes),
                     "backward": None if backward is None else list(backward)})
        return 1

    scheduler.prefetch_depth.choose_prefetch_depth = spy
    torch.set_num_threads(1)
    depths = []
    for first_with_grad in (True, False):
        torch.manual_seed(SEED)
        model = TinyLM()
        for block in model.blocks:
            overlap.shard(block, prefetch="auto")
        overlap.shard(model, prefetch="auto")
        batch = local_batch(make_batch(0), rank, world_size)
        with torch.set_grad_enabled(first_with_grad):
            loss = model.loss(batch)
        depths.append(model.prefetch_depth)  # after the first forward
        if first_with_grad:
            loss.backward()
        depths.append(model.prefetch_depth)  # after its backward (none: after the next forward)
        if not first_with_grad:
            model.loss(batch).backward()
            depths.append(model.prefetch_depth)
    return [*seen, {"depths": depths}]


def test_the_depth_is_chosen_from_measured_backward_and_link_times(distributed) -> None:
    # [Note: what the step's costs are made of]: a first step with a backward hands the chooser one
    # measured backward time per forward position (root, 2 blocks), and link times apart from the
    # packing; a first forward without grad chooses at once, with backward taken as twice forward
    per_rank = distributed(_costs_seen, 2, timeout=300)
    # the ranks' measurements are agreed (the smaller of two per entry): every rank chooses from the same numbers
    assert per_rank[0][:2] == per_rank[1][:2]
    for with_grad, without_grad, depths in per_rank:
        # with grad: chosen at the end of the recording backward; without: at the end of its forward
        assert depths["depths"] == [None, 1, 1, 1, 1], depths
        assert len(with_grad["compute"]) == len(with_grad["gather"]) == 3
        assert with_grad["backward"] is not None and len(with_grad["backward"]) == 3
        assert all(b > 0 for b in with_grad["backward"]), with_grad["backward"]
        assert all(g > 0 for g in with_grad["gather"]) and all(c > 0 for c in with_grad["compute"])
        assert without_grad["backward"] is None
        assert len(without_grad["gather"]) == 3
