"""``overlap.shard(..., prefetch="auto")``: the prefetch depth chosen from the first steps' measured
costs (each the least of ``COST_SAMPLES`` samples) and a byte budget, agreed across ranks ([Note:
prefetch="auto"] in ``overlap/sharding.py``, [Note: robust step costs] in ``scheduler/cost_samples.py``).

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
from scheduler.cost_samples import COST_SAMPLES

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)


STEPS = COST_SAMPLES + 2
"""The recorded steps, then two on the chosen depth."""
CHOSEN = [None] * (COST_SAMPLES - 1)
"""``prefetch_depth`` after each recorded step but the last (chosen at the end of the last)."""


def _sharded_tinylm(prefetch: Any, budget: Optional[int] = None) -> TinyLM:
    """TinyLM from :data:`SEED`, each block then the root sharded with ``prefetch`` (and
    ``max_inflight_bytes=budget``)."""
    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        overlap.shard(block, prefetch=prefetch, max_inflight_bytes=budget)
    overlap.shard(model, prefetch=prefetch, max_inflight_bytes=budget)
    return model


def _train(rank: int, world_size: int, prefetch: Any, budget: Optional[int] = None,
           skip_first_on_odd_steps: bool = False) -> dict[str, Any]:
    """``STEPS`` AdamW steps of TinyLM sharded per block with ``prefetch`` (and ``max_inflight_bytes=budget``);
    with ``skip_first_on_odd_steps``, odd steps run without blocks[0]."""
    torch.set_num_threads(1)
    model = _sharded_tinylm(prefetch, budget)
    blocks = list(model.blocks)
    skipped = nn.ModuleList([nn.Identity(), *blocks[1:]])
    opt = make_optimizer(model.parameters())
    losses, depths = [], []
    for step in range(STEPS):
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
        assert plain["depths"] == [0] * STEPS
        depth = auto["depths"][-1]
        assert depth is not None and depth >= 1 and auto["depths"] == CHOSEN + [depth] * (STEPS - len(CHOSEN)), \
            auto["depths"]
        # within the budget: any group and the groups prefetched after it fit, unless depth 1 alone does not
        assert sorted(tight["gather_bytes"]) == [9728, 27648, 27648], "the budget above assumes these groups"
        assert tight["depths"][len(CHOSEN):] == [1] * (STEPS - len(CHOSEN)), "two blocks' gathers do not fit: depth 1"
        assert tight["max_inflight"] <= budget
    assert len({runs[1]["depths"][-1] for runs in per_rank}) == 1, "every rank prefetches alike"
    assert len({runs[2]["depths"][-1] for runs in per_rank}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_auto_depth_falls_back_when_a_block_is_skipped(distributed, world: int) -> None:
    option_sets = [{"prefetch": 0}, {"prefetch": "auto"}]
    for plain, auto in distributed(_runs, world, option_sets, skip_first_on_odd_steps=True, timeout=300):
        _assert_same(auto, plain)
        assert auto["depths"][-1] is not None and auto["depths"][-1] >= 1


def _rank_dependent_choice(rank: int, world_size: int) -> list[dict[str, Any]]:
    """Each rank's model picks ``rank + 1``: the ranks must agree on the largest."""
    import scheduler.prefetch_depth

    scheduler.prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: rank + 1
    return [_train(rank, world_size, prefetch=0), _train(rank, world_size, prefetch="auto")]


def test_ranks_agree_on_the_deepest_choice(distributed) -> None:
    per_rank = distributed(_rank_dependent_choice, 3, timeout=300)
    for plain, auto in per_rank:
        assert auto["depths"] == CHOSEN + [3] * (STEPS - len(CHOSEN)), auto["depths"]  # the deepest of 1, 2, 3 (all the groups ahead)
        _assert_same(auto, plain)


def _costs_seen(rank: int, world_size: int) -> list[dict[str, Any]]:
    """The costs ``choose_prefetch_depth`` is handed, for recorded steps with a backward and for
    recorded forwards without (under ``torch.no_grad``), and the depth after each forward and each
    step."""
    import scheduler.prefetch_depth

    seen: list[dict[str, Any]] = []

    def spy(compute, gather, nbytes, budget, tolerance=0.01, backward=None, **between):  # type: ignore[no-untyped-def]
        seen.append({"compute": list(compute), "gather": list(gather), "nbytes": list(nbytes),
                     "backward": None if backward is None else list(backward)})
        return 1

    scheduler.prefetch_depth.choose_prefetch_depth = spy
    torch.set_num_threads(1)
    depths = []
    for with_grad in (True, False):
        model = _sharded_tinylm("auto")
        batch = local_batch(make_batch(0), rank, world_size)
        for _ in range(COST_SAMPLES):
            with torch.set_grad_enabled(with_grad):
                loss = model.loss(batch)
            depths.append(model.prefetch_depth)  # after the forward
            if with_grad:
                loss.backward()
            depths.append(model.prefetch_depth)  # after the step
    return [*seen, {"depths": depths}]


def test_the_depth_is_chosen_from_measured_backward_and_link_times(distributed) -> None:
    # [Note: what the step's costs are made of]: recorded steps with a backward hand the chooser one
    # measured backward time per forward position (root, 2 blocks), and link times apart from the
    # packing; recorded forwards without grad choose at the end of the last, backward taken as twice forward
    per_rank = distributed(_costs_seen, 2, timeout=300)
    # the ranks' measurements are agreed (the smaller of two per entry): every rank chooses from the same numbers
    assert per_rank[0][:2] == per_rank[1][:2]
    recorded = [None] * (2 * COST_SAMPLES - 2)
    for with_grad, without_grad, depths in per_rank:
        # with grad: chosen at the end of the last recorded backward; without: at the end of the last forward
        assert depths["depths"] == [*recorded, None, 1, *recorded, 1, 1], depths
        assert len(with_grad["compute"]) == len(with_grad["gather"]) == 3
        assert with_grad["backward"] is not None and len(with_grad["backward"]) == 3
        assert all(b > 0 for b in with_grad["backward"]), with_grad["backward"]
        assert all(g > 0 for g in with_grad["gather"]) and all(c > 0 for c in with_grad["compute"])
        assert without_grad["backward"] is None
        assert len(without_grad["gather"]) == 3


LOSS_S = 0.15
"""Seconds the loop sleeps between forward and backward in the recorded steps (the caller's loss)."""
TAIL_S = 0.15
"""Seconds the root group's epilogue sleeps: it runs at the end of backward (the root is reduced last)."""
LATENCY_S = 0.2
"""The emulated link's latency per collective: the root's reduce-scatter is in flight at the end of backward."""


def _between_seen(rank: int, world_size: int) -> list[dict[str, float]]:
    """The ``loss`` and ``tail`` seconds handed to ``choose_prefetch_depth`` behind a link whose every
    collective takes :data:`LATENCY_S`: first with the loss and the root's epilogue slowed by
    :data:`LOSS_S` / :data:`TAIL_S`, then unslowed ([Note: the host work between the groups])."""
    import time

    from overlap.param_group import ParamGroup
    from overlap.testing import emulated_link
    from scheduler import prefetch_depth

    seen: list[dict[str, float]] = []
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: seen.append(
        {"loss": kwargs["loss"], "tail": kwargs["tail"]}) or 1
    finish_reduce, slow = ParamGroup.finish_reduce, [True]

    def slow_root(self: ParamGroup, pending: Any) -> None:
        if slow[0] and self.module_fqn == "":
            time.sleep(TAIL_S)
        finish_reduce(self, pending)

    ParamGroup.finish_reduce = slow_root  # type: ignore[method-assign]
    torch.set_num_threads(1)
    for slowed in (True, False):
        slow[0] = slowed
        model = _sharded_tinylm("auto")
        with emulated_link(1e6, LATENCY_S * 1e6):
            for step in range(COST_SAMPLES):
                loss = model.loss(local_batch(make_batch(step), rank, world_size))
                if slowed:
                    time.sleep(LOSS_S)
                loss.backward()
    return seen


def test_the_loss_and_the_end_of_backward_are_measured_apart_from_the_link(distributed) -> None:
    # [Note: the host work between the groups]: the recorded steps measure the host's seconds between
    # forward and backward and at the end of backward, agreed across ranks, less the wait for the link
    per_rank = distributed(_between_seen, 2, timeout=300)
    assert per_rank[0] == per_rank[1]
    slowed, plain = per_rank[0]
    # the root's reduce-scatter holds the end of backward for LATENCY_S on the link: not the host's
    assert LOSS_S <= slowed["loss"] and TAIL_S <= slowed["tail"] < TAIL_S + LATENCY_S / 2, slowed
    assert plain["loss"] < LOSS_S and plain["tail"] < LATENCY_S / 2, plain


def _link_costs_seen(rank: int, world_size: int) -> list[tuple[list[float], list[float], list[float]]]:
    """The ``(gather, reduce)`` link seconds handed to ``choose_prefetch_depth`` for TinyLM sharded
    per block behind a slow emulated link, with each group's reduce bytes over its gather bytes:
    fp32 throughout, then bfloat16 parameters with float32 gradient reductions ([Note: a
    reduce-scatter's seconds])."""
    from overlap.testing import emulated_link
    from scheduler import prefetch_depth

    seen: list[Any] = []
    prefetch_depth.choose_prefetch_depth = lambda compute, gather, *args, **kwargs: seen.append(
        (list(gather), list(kwargs["reduce"]))) or 1
    torch.set_num_threads(1)
    for mp in (None, overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        torch.manual_seed(SEED)
        model = TinyLM()
        for block in model.blocks:
            overlap.shard(block, mp=mp)
        overlap.shard(model, mp=mp)
        with emulated_link(0.5, 100.0):
            for step in range(COST_SAMPLES):
                model.loss(local_batch(make_batch(step), rank, world_size)).backward()
        order = {id(block): i for i, block in enumerate(model.blocks)}  # the chooser's: forward order, root first
        groups = sorted((s for s in overlap.sharding.sharded_states(model) if s.group is not None),
                        key=lambda s: order.get(id(s.module), -1))
        seen[-1] += ([s.group.reduce_bytes() / s.group.all_gather_bytes() for s in groups],)
    return seen


def test_the_choosers_get_each_reduce_scatters_own_link_seconds(distributed) -> None:
    # [Note: a reduce-scatter's seconds]: a float32 reduction of bfloat16 parameters moves twice the
    # gather's bytes, so the model replays it on the link for twice the gather's measured seconds;
    # where both move the same bytes, for the same seconds (what the model took before)
    per_rank = distributed(_link_costs_seen, 2, timeout=300)
    assert per_rank[0] == per_rank[1]  # agreed costs, the same bytes: the same numbers on every rank
    (fp32_gather, fp32_reduce, fp32_ratio), (mp_gather, mp_reduce, mp_ratio) = per_rank[0]
    assert len(fp32_gather) == len(mp_gather) == 3 and all(g > 0 for g in fp32_gather + mp_gather)
    # the reduction moves the gathered bytes (twice them in float32 from bfloat16) and the presence
    # entry ([Note: a gradient no rank produced]): a few percent more
    assert all(1 < r < 1.1 for r in fp32_ratio) and all(2 < r < 2.2 for r in mp_ratio), (fp32_ratio, mp_ratio)
    assert fp32_reduce == [g * r for g, r in zip(fp32_gather, fp32_ratio)]
    assert mp_reduce == [g * r for g, r in zip(mp_gather, mp_ratio)]


STALL_S = 0.4
"""Seconds the host stalls right after booking blocks.0's gather on the link, in the first recorded step."""
LINK_S = 0.1
"""The emulated link's latency: every gather holds the link this long."""


def _link_seen_after_a_stall(rank: int, world_size: int) -> list[float]:
    """The per-position link seconds handed to ``choose_prefetch_depth`` behind a link of
    :data:`LINK_S` per collective, when the first recorded step's host stalled :data:`STALL_S` right
    after issuing blocks.0's gather, on every rank ([Note: a wait split by a stall])."""
    import time

    from overlap.param_group import ParamGroup
    from overlap.testing import emulated_link
    from scheduler import prefetch_depth

    seen: list[list[float]] = []
    prefetch_depth.choose_prefetch_depth = lambda compute, gather, *args, **kwargs: seen.append(list(gather)) or 1
    issue_gather, stalled = ParamGroup.issue_gather, [False]

    def stall_once(self: ParamGroup) -> Any:
        out = issue_gather(self)
        if self.module_fqn == "blocks.0" and not stalled[0]:
            stalled[0] = True
            time.sleep(STALL_S)  # the link carries the gather meanwhile
        return out

    ParamGroup.issue_gather = stall_once  # type: ignore[method-assign]
    torch.set_num_threads(1)
    model = _sharded_tinylm("auto")
    with emulated_link(1e6, LINK_S * 1e6):
        for step in range(COST_SAMPLES):
            model.loss(local_batch(make_batch(step), rank, world_size)).backward()
    assert stalled[0] and len(seen) == 1, (stalled, seen)
    return seen[0]


def test_a_stall_after_a_gather_was_issued_does_not_hide_its_link_time(distributed) -> None:
    # [Note: a wait split by a stall]: the stalled step's wait for blocks.0 is ~0 (the link ran during
    # the stall); its whole interval and its packing are each the least over the samples, so the link
    # time (their difference) is the unstalled steps'
    per_rank = distributed(_link_seen_after_a_stall, 2, timeout=300)
    assert per_rank[0] == per_rank[1]
    link = per_rank[0]  # root, blocks.0, blocks.1
    assert all(0.9 * LINK_S <= g < LINK_S + STALL_S / 2 for g in link), link


SPIKE_S = 0.3
"""Seconds one recorded step's packing of blocks.0 is held up, on every rank (a load spike)."""


def _compute_seen_after_a_spike(rank: int, world_size: int, samples: int) -> list[float]:
    """The per-position compute (packing included) handed to ``choose_prefetch_depth`` when the
    first recorded step's packing of blocks.0 took :data:`SPIKE_S` longer on every rank, with
    ``samples`` recorded steps."""
    import time

    from overlap.param_group import ParamGroup
    from scheduler import cost_samples, prefetch_depth

    cost_samples.COST_SAMPLES = samples
    seen: list[list[float]] = []
    prefetch_depth.choose_prefetch_depth = lambda compute, *args, **kwargs: seen.append(list(compute)) or 1
    issue_gather, spiked = ParamGroup.issue_gather, [False]

    def slow_once(self: ParamGroup) -> Any:
        if self.module_fqn == "blocks.0" and not spiked[0]:
            spiked[0] = True
            time.sleep(SPIKE_S)
        return issue_gather(self)

    ParamGroup.issue_gather = slow_once  # type: ignore[method-assign]
    _train(rank, world_size, "auto")
    assert spiked[0] and len(seen) == 1, (spiked, seen)
    return seen[0]


@pytest.mark.parametrize("samples, spike_seen", [(1, True), (COST_SAMPLES, False)])
def test_a_spike_in_one_recorded_step_does_not_reach_the_chooser(distributed, samples: int,
                                                                 spike_seen: bool) -> None:
    # [Note: robust step costs]: each entry is the least of its samples, so a spike on every rank in
    # one step (which the ranks' low median keeps) is dropped; with one sample it reaches the chooser
    for compute in distributed(_compute_seen_after_a_spike, 2, samples, timeout=300):
        assert (compute[1] >= SPIKE_S) == spike_seen, compute


def test_agreed_costs_are_each_entrys_low_median_over_the_ranks() -> None:
    """The ranks choose from one set of costs: per entry, the low median of the ranks' values
    ([Note: what the step's costs are made of]). A value some rank measured, and with an even count
    the smaller middle one: noise only ever adds time, so one rank slowed by its host (a load spike
    on one of 2 ranks) does not reach the chooser."""
    from overlap.sharding import _low_median_per_entry

    assert _low_median_per_entry([[1.0, 0.5], [0.2, 9.0]]) == [0.2, 0.5]  # 2 ranks: the smaller
    assert _low_median_per_entry([[3.0, 1.0], [1.0, 2.0], [2.0, 30.0]]) == [2.0, 2.0]  # 3: the middle one
    assert _low_median_per_entry([[4.0], [1.0], [3.0], [2.0]]) == [2.0]  # 4: the lower middle
    assert _low_median_per_entry([[0.1, 0.2]]) == [0.1, 0.2]
