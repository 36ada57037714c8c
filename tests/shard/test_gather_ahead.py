"""Gather-ahead (``prefetch="auto"`` + ``overlap.optimizer_in_backward``): the next step's all-gathers
issued in this backward, after each group's step, on 2 and 3 gloo CPU ranks; and the pure chooser
(``scheduler.gather_ahead``).

Reference: the plain loop (one AdamW over all parameters after backward, same sharding, same
``prefetch="auto"``) and optimizer in backward with nothing gathered ahead, bitwise: a gather issued
ahead may only move when a gather happens, never what it gathers. The plan is forced in the ranks
(``(count, lag)``: every group, the first two, none) so that each issue point is exercised whatever
the model would choose on this box; one run keeps the model's own choice. Covered: ``no_sync``
micro-batches, a shard edited in place between steps (picked up: gathered again), a step that skips
the group gathered ahead for it, a rank exiting with gathers in flight, ranks whose choosers pick
different plans (rank 0's runs on every rank).
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import overlap
from models import LR, SEED, TinyLM, assert_same_run, local_batch, make_batch, make_optimizer, make_optimizer_in_backward
from overlap.sharding import sharded_states
from scheduler import cost_samples, gather_ahead, prefetch_depth, schedule_trial
from scheduler.gather_ahead import choose_gather_ahead, choose_schedule, held_bytes, modelled_steady_step

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)

STEPS = 5
LAYERS = 3
FORCED_DEPTH = 1


def _sharded(max_inflight_bytes: Optional[int] = None) -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    for block in model.blocks:
        overlap.shard(block, prefetch="auto", max_inflight_bytes=max_inflight_bytes)
    overlap.shard(model, prefetch="auto", max_inflight_bytes=max_inflight_bytes)
    return model


def _pending_gathers(model: nn.Module) -> list[int]:
    """The groups with an all-gather in flight; each must have packed the shards after their step
    (not stale), or it would only be dropped and done again."""
    pending = [s for s in sharded_states(model) if s.group is not None and s.group.pending_gather is not None]
    assert not any(s.group.stale_gather() for s in pending), "a gather issued ahead packed shards before their step"
    return [s.index for s in pending]


def _train(rank: int, world_size: int, in_backward: bool, plan: Optional[tuple[int, int]],
           skip_last_on_odd_steps: bool = False, enabled: bool = True) -> dict[str, Any]:
    """``STEPS`` AdamW steps: step 1 in two ``no_sync`` micro-batches, a weight of the last block
    halved in place after step 2 (after its next-step gather was issued in backward), and with
    ``skip_last_on_odd_steps`` odd steps run without the last block. ``plan``: the gather-ahead plan
    forced on every rank (None: the model's choice); ``enabled``: ``set_gather_ahead``."""
    torch.set_num_threads(1)
    cost_samples.COST_SAMPLES = 1  # this rank's process only: the plan from step 0's costs, as the asserts count
    if plan is not None:  # this rank's process only; depth 1, so the end of backward gathers 2 groups
        schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on (the model's choice goes through the trial)
        gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, plan)
        prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: FORCED_DEPTH
    model = _sharded()
    model.set_gather_ahead(enabled)
    last = model.blocks[-1]
    opt: Any = make_optimizer_in_backward(model) if in_backward else make_optimizer(model.parameters())
    losses, ahead = [], []
    for step in range(STEPS):
        if skip_last_on_odd_steps:
            model.blocks[-1] = last if step % 2 == 0 else nn.Identity()
        batch = local_batch(make_batch(step), rank, world_size)
        parts = batch.chunk(2) if step == 1 else (batch,)
        for i, part in enumerate(parts):
            with overlap.no_sync(model) if i < len(parts) - 1 else _nothing():
                loss = model.loss(part)
                loss.backward()
        ahead.append(_pending_gathers(model))  # issued in (or at the end of) this backward
        opt.step()
        if step == 2:
            with torch.no_grad():
                last.mlp.fc1.weight.mul_(0.5)  # in place, after its next-step gather was packed
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    model.blocks[-1] = last
    return {"losses": torch.stack(losses), "ahead": ahead, "plan": model.gather_ahead,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _runs(rank: int, world_size: int, skip: bool) -> dict[str, dict[str, Any]]:
    groups = LAYERS + 1
    out = {
        "plain": _train(rank, world_size, False, None, skip),
        "none ahead": _train(rank, world_size, True, (0, 1), skip),
        "all ahead, lag 1": _train(rank, world_size, True, (groups, 1), skip),
        "two ahead, lag 2": _train(rank, world_size, True, (2, 2), skip),
        "model's choice": _train(rank, world_size, True, None, skip),
        "all planned, turned off": _train(rank, world_size, True, (groups, 1), skip, enabled=False),
    }
    # Each rank's chooser picks another plan (budgets read per rank can differ): rank 0's must run.
    # In debug mode, so that ranks on different plans raise DesyncError instead of hanging.
    with overlap.debug():
        out["rank-dependent choice"] = _train(rank, world_size, True, [(groups, 1), (2, 2), (0, 1)][rank], skip)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_ahead_is_bitwise_the_plain_loop(distributed, world_size: int) -> None:
    for runs in distributed(_runs, world_size, False):
        for what, run in runs.items():
            assert_same_run(run, runs["plain"], what)
        # The plain loop steps after backward: nothing may be gathered ahead for it.
        assert all(not a for a in runs["plain"]["ahead"]) and runs["plain"]["plan"] is None
        groups = LAYERS + 1
        assert runs["all ahead, lag 1"]["plan"] == (groups, 1)
        # Every backward that reduced (not step 1's no_sync micro-batch) gathered every group ahead,
        # and those issued in backward stayed in flight past its end.
        assert [len(a) for a in runs["all ahead, lag 1"]["ahead"]] == [groups] * STEPS
        assert all(not a for a in runs["all planned, turned off"]["ahead"])
        # One plan on every rank, rank 0's, whatever each rank's chooser picked (the gathers it issues
        # in backward are collectives: a rank on another plan would issue them in another order).
        assert runs["rank-dependent choice"]["plan"] == (groups, 1)
        assert runs["rank-dependent choice"]["ahead"] == runs["all ahead, lag 1"]["ahead"]
        # Nothing ahead in backward: the next forward's first 1 + depth groups, at its end; two
        # ahead: those and the two groups reduced first (the last two blocks).
        first = 1 + FORCED_DEPTH
        assert [len(a) for a in runs["none ahead"]["ahead"]] == [first] * STEPS
        assert [len(a) for a in runs["two ahead, lag 2"]["ahead"]] == [first + 2] * STEPS


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_ahead_for_a_group_the_next_forward_skips(distributed, world_size: int) -> None:
    for runs in distributed(_runs, world_size, True):
        for what, run in runs.items():
            assert_same_run(run, runs["plain"], what)


def _exit_with_gathers_in_flight(rank: int, world_size: int) -> list[int]:
    gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, (LAYERS + 1, 1))
    cost_samples.COST_SAMPLES = 1  # chosen in step 0: step 1 gathers ahead
    schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on, untried
    model = _sharded()
    overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    for step in range(2):
        model.loss(local_batch(make_batch(step), rank, world_size)).backward()
    return _pending_gathers(model)  # the harness then destroys the process group with them unwaited


def test_exit_with_gathers_ahead_in_flight_does_not_hang(distributed) -> None:
    results = distributed(_exit_with_gathers_in_flight, 2, link=(0.01, 0.0), timeout=90)
    assert all(len(r) == LAYERS + 1 for r in results), results


SYNTHETIC_COSTS = ([0.005, 0.02, 0.005, 0.005], [0.01] * 4)
"""Per-position seconds (root, then the blocks) on which the model gathers one group ahead at depth 1."""


def _held_within_budget(rank: int, world_size: int, slack: int) -> dict[str, Any]:
    """The chooser on :data:`SYNTHETIC_COSTS` with the real bytes and the real budget
    (``max_inflight_bytes``): the budget exactly what one group ahead needs, plus ``slack``."""
    real = gather_ahead.choose_gather_ahead
    gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kw: (
        depth, real(*SYNTHETIC_COSTS, nbytes, depth, budget))
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: FORCED_DEPTH
    cost_samples.COST_SAMPLES = 1  # chosen in step 0: every step holds gathers ahead
    schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on, untried
    torch.manual_seed(SEED)
    probe = TinyLM(layers=LAYERS)
    for block in probe.blocks:
        overlap.shard(block)
    overlap.shard(probe)
    states = sharded_states(probe)  # the root first, then the blocks: the forward order
    nbytes = [states[0].group.all_gather_bytes()] + [s.group.all_gather_bytes() for s in states[1:]]
    budget = held_bytes(nbytes, FORCED_DEPTH, 1) + slack
    model = _sharded(max_inflight_bytes=budget)
    overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    held = []
    for step in range(3):
        model.loss(local_batch(make_batch(step), rank, world_size)).backward()
        held.append(sum(s.group.all_gather_bytes() for s in sharded_states(model)
                        if s.group is not None and s.group.pending_gather is not None))
    return {"plan": model.gather_ahead, "held": held, "budget": budget}


@pytest.mark.parametrize("slack, plan", [(0, (1, 1)), (-1, (0, 1))])
def test_gather_ahead_holds_no_more_than_the_budget(distributed, slack: int, plan: tuple[int, int]) -> None:
    for result in distributed(_held_within_budget, 2, slack):
        assert result["plan"] == plan  # one byte short of one group ahead: none ahead
        assert all(0 < h <= result["budget"] for h in result["held"]), result


# ---------------------------------------------------------------- the chooser (pure)
LINK_BOUND_FORWARD = ([0.02] * 6, [0.03] * 6)  # backward (2x compute) leaves the link idle; forward does not


def test_chooser_gathers_ahead_where_the_model_gains_and_never_where_it_loses() -> None:
    compute, gather = LINK_BOUND_FORWARD
    depth = 5
    count, lag = choose_gather_ahead(compute, gather, [100] * 6, depth, 10**9)
    assert count >= 1
    base = modelled_steady_step(compute, gather, depth, 0)
    assert modelled_steady_step(compute, gather, depth, count, lag) < base
    # Link-bound in both passes: moving a gather only adds host waits, so nothing is issued ahead.
    assert choose_gather_ahead([0.01] * 6, [0.03] * 6, [100] * 6, 1, 10**9) == (0, 1)
    # No link time: nothing to gain.
    assert choose_gather_ahead([0.01] * 6, [0.0] * 6, [100] * 6, 1, 10**9) == (0, 1)
    assert choose_gather_ahead([], [], [], 1, 0) == (0, 1)


def test_chooser_keeps_the_held_bytes_within_the_budget() -> None:
    compute, gather = LINK_BOUND_FORWARD
    nbytes = [100, 200, 300, 400, 500, 600]
    for budget in range(0, 4000, 50):
        count, lag = choose_gather_ahead(compute, gather, nbytes, 5, budget)
        assert count == 0 or held_bytes(nbytes, 5, count) <= budget, (budget, count)
    assert held_bytes(nbytes, 1, 0) == 100 + 1100  # the root, and the largest 1 + depth window after it
    # Two gathered ahead (positions 4, 5): forward at 2 holds the root, 2, 3 and both (held once).
    assert held_bytes(nbytes, 1, 2) == 100 + 300 + 400 + 500 + 600


DEMO_COSTS = dict(
    compute=[1.44e-3, 0.74e-3, 9.30e-3, 9.10e-3, 9.18e-3, 8.92e-3, 2.58e-3],
    gather=[0.58e-3, 4.12e-3, 12.48e-3, 12.26e-3, 12.02e-3, 12.35e-3, 3.96e-3],
    nbytes=[133120, 1048576, 3159040, 3159040, 3159040, 3159040, 1048576],
    backward=[0.0, 0.97e-3, 21.42e-3, 21.71e-3, 21.87e-3, 19.76e-3, 5.78e-3],
    loss=1.57e-3, tail=4.77e-3)
"""What ``prefetch="auto"`` recorded on the demo (2 ranks, model small, the calibrated link, the 2-core
box, 2026-12-04; rounded): the root, tok, four blocks, head. The cold model ties every depth from 2."""


def _steady(depth: int, plan: tuple[int, int], **costs: Any) -> float:
    c = {k: v for k, v in costs.items() if k != "nbytes"}
    return modelled_steady_step(c.pop("compute"), c.pop("gather"), depth, *plan, **c)


def test_schedule_goes_deeper_where_a_plan_gains_there() -> None:
    """At depth 2 nothing ahead pays; at depth 3 (one re-gather fewer in backward) gathering the
    first 2 reduced groups ahead does, by more than the 1% tolerance."""
    c = DEMO_COSTS
    at_2 = choose_gather_ahead(c["compute"], c["gather"], c["nbytes"], 2, 10**12, backward=c["backward"],
                               loss=c["loss"], tail=c["tail"])
    assert at_2 == (0, 1)
    depth, plan = choose_schedule(c["compute"], c["gather"], c["nbytes"], 2, 10**12, backward=c["backward"],
                                  loss=c["loss"], tail=c["tail"])
    assert (depth, plan) == (3, (2, 1))
    assert _steady(depth, plan, **c) < 0.99 * _steady(2, at_2, **c)


def test_schedule_stays_within_the_budget_and_never_models_slower() -> None:
    c = DEMO_COSTS
    kw = dict(backward=c["backward"], loss=c["loss"], tail=c["tail"])
    # A budget one byte short of depth 3's held bytes: depth 2 and its own plan.
    short = held_bytes(c["nbytes"], 3, 0) - 1
    assert choose_schedule(c["compute"], c["gather"], c["nbytes"], 2, short, **kw) == (
        2, choose_gather_ahead(c["compute"], c["gather"], c["nbytes"], 2, short, **kw))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(2, 8, (1,), generator=gen))
        compute, gather, backward = (torch.rand(n, generator=gen, dtype=torch.float64).mul(0.02).tolist()
                                     for _ in range(3))
        nbytes = torch.randint(1, 1000, (n,), generator=gen).tolist()
        budget = int(torch.randint(0, 6000, (1,), generator=gen))
        depth = int(torch.randint(1, max(2, n), (1,), generator=gen))
        kw = dict(backward=backward, loss=0.001, tail=0.002)
        d, plan = choose_schedule(compute, gather, nbytes, depth, budget, **kw)
        at_depth = choose_gather_ahead(compute, gather, nbytes, depth, budget, **kw)
        assert d >= depth
        if d == depth:
            assert plan == at_depth
        else:  # deeper only within the budget and where the model gains by more than the tolerance
            assert held_bytes(nbytes, d, 0) <= budget and (plan[0] == 0 or held_bytes(nbytes, d, plan[0]) <= budget)
            steady = dict(backward=backward, loss=0.001, tail=0.002)
            assert (modelled_steady_step(compute, gather, d, *plan, **steady)
                    < 0.99 * modelled_steady_step(compute, gather, depth, *at_depth, **steady))


@pytest.mark.parametrize("depth", [0, -1, True, 1.5])
def test_schedule_bad_depth(depth: object) -> None:
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        choose_schedule([0.1, 0.1], [0.1, 0.1], [1, 1], depth, 10)  # type: ignore[arg-type]


# Forward positions: the root (held the whole step), then four groups; hand-computed below.
ROOT_AND_FOUR = [1000, 10, 20, 30, 40]


@pytest.mark.parametrize("depth, count, held", [
    (0, 0, 1000 + 40),  # the root and the largest group (the old count left the root out: 1000)
    (1, 0, 1000 + 30 + 40),  # the root and forward's last window (old: 1010, the window with the root)
    (1, 2, 1000 + 10 + 20 + 30 + 40),  # at 1: its window 1, 2 and 3, 4 gathered ahead (old: 1080)
    (1, 4, 1000 + 10 + 20 + 30 + 40),  # every group ahead, the window's held once (old: 1110)
    (1, 5, 1000 + 10 + 20 + 30 + 40),  # the root gathered ahead too: still held once (old: 2110)
    (4, 0, 1000 + 10 + 20 + 30 + 40),  # the whole model, once
    (0, 1, 1000 + 30 + 40),  # at 3: group 3 and group 4 gathered ahead
])
def test_held_bytes_counts_the_root_and_each_group_once(depth: int, count: int, held: int) -> None:
    assert held_bytes(ROOT_AND_FOUR, depth, count) == held


def test_held_bytes_edges() -> None:
    assert held_bytes([], 1, 0) == 0
    assert held_bytes([7], 0, 0) == held_bytes([7], 3, 1) == 7  # the root alone, gathered ahead or not
    assert held_bytes([7, 0, 5], 0, 0) == 12  # a position without parameters holds nothing


@pytest.mark.parametrize("args, match", [
    (([0.1], [0.1, 0.2], [1], 1, 10), "one entry per position"),
    (([float("nan")], [0.1], [1], 1, 10), "finite seconds"),
    (([0.1], [-1.0], [1], 1, 10), "finite seconds"),
    (([0.1], [0.1], [1], -1, 10), "depth must be an int >= 0"),
    (([0.1], [0.1], [1], True, 10), "depth must be an int >= 0"),
    (([0.1], [0.1], [1], 1, -5), "budget must be an int >= 0"),
    (([0.1], [0.1], [1], 1, 1.5), "budget must be an int >= 0"),
])
def test_chooser_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_gather_ahead(*args)


def test_set_gather_ahead_bad_input(single_rank_group) -> None:
    model = _sharded()
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="set_gather_ahead: enabled must be a bool"):
            model.set_gather_ahead(bad)  # type: ignore[arg-type]
    assert model._overlap_state.gather_ahead_enabled is True


# ---------------------------------------------------------------- measuring steps that leave gathers in flight
def test_interleaved_steps_settle_runs_untimed_steps_of_the_same_kind_first() -> None:
    from overlap.testing import interleaved_steps

    calls: list[int] = []
    interleaved_steps(lambda: calls.append(1), 3, [None, None], warmup=1, settle=1)
    assert len(calls) == 1 + 3 * 2 * 2  # warm-up, then per round and entry one settle + one timed step
    calls.clear()
    interleaved_steps(lambda: calls.append(1), 3, [None, None], warmup=0)
    assert len(calls) == 3 * 2  # settle 0: as before
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="settle must be an int >= 0"):
            interleaved_steps(lambda: None, 1, [None], settle=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("settle", [0, 1, 2])
def test_interleaved_steps_time_a_step_right_after_its_settle_steps(single_rank_group, monkeypatch, settle) -> None:
    """The ranks line up (a barrier) before each entry's first step only: a barrier between a settle
    step and the timed one would let the gathers the settle step left in flight progress in an
    untimed wait."""
    import torch.distributed as dist

    from overlap.testing import interleaved_steps

    calls: list[str] = []
    barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (calls.append("barrier"), barrier(*a, **k))[1])
    interleaved_steps(lambda: calls.append("step"), 2, [None, None], warmup=0, settle=settle)
    assert calls == (["barrier"] + ["step"] * (settle + 1)) * 4, calls  # 2 rounds x 2 entries
