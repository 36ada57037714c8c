"""overlap.profile()'s idle-link report ([Note: link idle while compute ran] in
``overlap/profiler/records.py``): per step, the time nothing of a rank was on the link while it
computed, split by cause.

Checked against the emulated link's own record of when it carried something
(``EmulatedLink.busy_intervals``): per step the reported idle time equals the step window minus the
link's busy time and the rank's stalls, within 1 ms (the issue's bound). The step windows are the
profiler's own; the link's record is on ``time.monotonic()``, so the test reads that clock just before
and just after each ``prof.step()`` and places the profile on it by the tightest of those brackets
(its width, a few µs on a quiet box, is the only slack; a rank preempted inside one bracket widens
that bracket only). The causes are checked
on hand-made records, where they are known exactly, and in the runs where one must appear: without
prefetch the last reduce-scatters wait on gradients with no gather left to run; under a one-gather byte budget each
next gather is held back (``overlap::held_for_budget``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from torch import nn

import overlap
from overlap.profiler import RankProfile, merge
from overlap.profiler.records import (AHEAD_LABEL, BUDGET_LABEL, IDLE_CAUSES, CollectiveRecord, StepRecord, covered,
                                      link_idle, link_idle_pieces, union)

STEPS = 3
# 4 blocks of 64 -> 128 -> 64 (33 KiB of fp32 per block): at 0.05 Gbit/s a block's gather takes
# ~2.7 ms on the wire, about a block's compute on this box, so the link is both busy and idle.
LINK = (0.05, 20.0)
BLOCK_GATHER = 4 * (64 * 128 + 128 + 128 * 64 + 64)  # bytes of one block's all-gather (fp32, even on 2 ranks)


def _mlp(blocks: int = 4, dim: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                           for _ in range(blocks)])


def _idle_rank(rank: int, world: int, prefetch: int, budget: int | None = None, ahead: bool = False) -> dict[str, Any]:
    """``STEPS`` profiled steps of a sharded MLP behind the link; ``ahead``: each step ends by issuing the
    next forward's first gathers (``overlap.prefetch_next_step``), and the profile records one warm-up
    step before them ([Note: warm-up steps of a profile] in ``overlap/profiler/recorder.py``)."""
    from overlap.testing import current_link

    link = current_link()
    assert link is not None
    model = _mlp()
    for block in model:
        overlap.shard(block, prefetch=prefetch, max_inflight_bytes=budget)
    overlap.shard(model, prefetch=prefetch, max_inflight_bytes=budget)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if ahead:
            overlap.prefetch_next_step(model)

    step()  # warm-up: the forward order is agreed here
    warmup = int(ahead)
    brackets: list[tuple[float, float]] = []  # time.monotonic() just before and after each prof.step()
    with overlap.profile(warmup=warmup) as prof:
        link.reset_stats()  # the link's busy record starts with the profile
        for _ in range(warmup + STEPS):
            step()
            before = time.monotonic()
            prof.step()
            brackets.append((before, time.monotonic()))
    profile = prof.rank_profile()
    report = prof.report(show=False)
    return {"brackets": brackets[warmup:], "busy": link.busy_intervals(), "profile": profile,
            "steps": [(s.step, s.link_idle_ms, dict(s.link_idle_causes), s.wall_ms) for s in report.steps]}


@pytest.mark.torch_kernels  # a training loop: the packing kernels are checked in packing/
@pytest.mark.parametrize("prefetch, budget, ahead", [(0, None, False), (1, None, False), (2, BLOCK_GATHER, False),
                                                     (1, None, True)], ids=["0", "1", "budget", "1-ahead"])
def test_idle_link_matches_the_emulated_links_busy_record(distributed, prefetch: int, budget: int | None,
                                                          ahead: bool) -> None:
    for rank, res in enumerate(distributed(_idle_rank, 2, prefetch, budget, ahead, link=LINK, timeout=120)):
        profile: RankProfile = res["profile"]
        busy = union(i for intervals in res["busy"].values() for i in intervals)
        # profile time -> time.monotonic(): step k's end lies inside bracket k; take the tightest one
        k = min(range(STEPS), key=lambda i: res["brackets"][i][1] - res["brackets"][i][0])
        offset = sum(res["brackets"][k]) / 2 - profile.steps[k].end
        stalls = [(a + offset, b + offset) for a, b in profile.stalls]
        not_idle = union(busy + stalls)
        assert [s for s, *_ in res["steps"]] == list(range(int(ahead), int(ahead) + STEPS))
        assert len(profile.steps) == STEPS, profile.steps
        # every collective names the sharded module it carries (the root holds no parameters): the
        # one whose region issued a reduce-scatter, and the one whose pre-forward / pre-backward
        # waited for a gather (a prefetch is issued in another module's region, and under a budget
        # it can first be waited where the next one is admitted: the regions do not say what a
        # gather carries, so those are not compared)
        assert {c.module for c in profile.collectives} == {"0", "1", "2", "3"}, profile.collectives
        for c in profile.collectives:
            if c.kind == "all_gather" and budget is not None:
                continue
            named = c.wait_label if c.kind == "all_gather" else c.label
            if named.endswith(")") and " (" in named:
                assert named.endswith(f" ({c.module})"), (rank, c.kind, c.module, c.label, c.wait_label)
        for (step, idle_ms, causes, wall_ms), window in zip(res["steps"], profile.steps):
            a, b = window.start + offset, window.end + offset
            expected = (b - a) - covered(not_idle, a, b)
            where = f"rank {rank}, step {step}, prefetch {prefetch}"
            assert abs(1e-3 * idle_ms - expected) <= 1e-3, (where, idle_ms, 1e3 * expected)
            assert 0 < idle_ms < wall_ms, where  # this workload leaves the link idle part of the time
            if ahead:  # the next step's gathers are issued at the step's end, after the last reduce-scatter
                assert set(causes) <= {IDLE_CAUSES[0], IDLE_CAUSES[2], IDLE_CAUSES[3]}, (where, causes)
            elif budget is None:
                assert set(causes) <= set(IDLE_CAUSES[::2]), (where, causes)
            else:  # one block's gather at a time: each next one is held until the last landed, then packed
                assert causes.get("waiting on the byte budget", 0) > 0, (where, causes)
            assert sum(causes.values()) == pytest.approx(idle_ms), where
            if prefetch == 0:  # the first block's backward: no gather left, its reduce-scatter waits on gradients
                assert causes.get("waiting on gradients", 0) > 0, (where, causes)


def _record(kind: str, start: float, end: float, label: str = "", wait: tuple[float, float] | None = None,
            step: int = 0, module: str = "") -> CollectiveRecord:
    return CollectiveRecord(rank=0, step=step, kind=kind, nbytes=8, group="g", label=label, issued=start,
                            start=start, end=end, end_measured=True, wait_start=None if wait is None else wait[0],
                            wait_end=None if wait is None else wait[1], wait_label="", exposed=0.0, module=module)


def test_idle_pieces_name_the_collective_that_ended_them_by_hand() -> None:
    # window [0, 10]: idle [0, 1.5) before blocks.0's gather [1.5, 3]; idle [3, 7) before blocks.1's
    # reduce-scatter [7, 8]; idle [8, 10] with nothing after it in the window but the next step's
    # public all-gather [12, 13] (no module: named by its kind)
    records = (
        _record("all_gather", 1.5, 3.0, module="blocks.0"),
        _record("reduce_scatter", 7.0, 8.0, module="blocks.1"),
        _record("all_gather", 12.0, 13.0, step=1),
    )
    rank = RankProfile(rank=0, world_size=2, epoch=0.0, device="cpu",
                       steps=(StepRecord(0, 0, 0.0, 10.0), StepRecord(0, 1, 10.0, 14.0)), collectives=records)
    pieces = link_idle_pieces(rank, 0.0, 10.0)
    assert [(p.start, p.end, p.ended_by) for p in pieces] == [(0.0, 1.5, records[0]), (3.0, 7.0, records[1]),
                                                              (8.0, 10.0, records[2])]
    assert [(a, b, cause) for a, b, cause in link_idle(rank, 0.0, 10.0)] == [(p.start, p.end, p.cause) for p in pieces]
    assert link_idle_pieces(rank, 10.0, 14.0)[-1].ended_by is None  # idle after the last collective: none ended it
    steps = merge(rank).summary().steps
    # the longest first, in ms (the records are in seconds) from the step's start; another step's collective says which step
    assert [str(s) for s in steps[0].link_idle_largest] == [
        "4000.0 ms from 3000.0 ms before reduce_scatter blocks.1 (waiting on gradients)",
        "2000.0 ms from 8000.0 ms before all_gather (step 1) (nothing issued yet)",
        "1500.0 ms from 0.0 ms before all_gather blocks.0 (nothing issued yet)"]
    assert [str(s) for s in steps[1].link_idle_largest] == ["2000.0 ms from 0.0 ms before all_gather (nothing issued yet)",
                                                            "1000.0 ms from 3000.0 ms (nothing issued yet)"]
    table = merge(rank).summary().table()
    assert "longest idle-link pieces per step" in table and "before reduce_scatter blocks.1" in table
    names = {e["name"] for e in merge(rank).trace_events() if e.get("cat") in ("comm", "issue")}
    assert {"all_gather blocks.0", "issue reduce_scatter blocks.1", "all_gather"} <= names, names


def test_idle_pieces_and_causes_by_hand() -> None:
    # window [0, 10]: idle [0, 1) before the first gather; gather [1, 3]; idle [3, 4) before a
    # reduce-scatter [4, 5] while a gather is still to come (a deeper prefetch would fill it: not
    # issued yet); idle [5, 6) before that gather, held for the budget [6, 7]; a stall [7, 7.5] on
    # something off this link (not idle); idle [7.5, 8) before a reduce-scatter [8, 9] with no gather
    # left in the window (waiting on gradients); idle [9, 10] to the window's end.
    records = (
        _record("all_gather", 1.0, 3.0),
        _record("reduce_scatter", 4.0, 5.0),
        _record("all_gather", 6.0, 7.0, label=f"overlap::pre_backward/{BUDGET_LABEL}"),
        _record("reduce_scatter", 8.0, 9.0),
        _record("all_gather", 20.0, 21.0, wait=(7.0, 7.5), step=1),  # issued in the next step
    )
    rank = RankProfile(rank=0, world_size=2, epoch=0.0, device="cpu",
                       steps=(StepRecord(0, 0, 0.0, 10.0), StepRecord(0, 1, 10.0, 22.0)), collectives=records)
    pieces = link_idle(rank, 0.0, 10.0)
    assert pieces == [(0.0, 1.0, "nothing issued yet"), (3.0, 4.0, "nothing issued yet"),
                      (5.0, 6.0, "waiting on the byte budget"), (7.5, 8.0, "waiting on gradients"),
                      (9.0, 10.0, "nothing issued yet")]
    # the next step's window: idle until its gather starts, busy to 21, idle to the end
    assert link_idle(rank, 10.0, 22.0) == [(10.0, 20.0, "nothing issued yet"), (21.0, 22.0, "nothing issued yet")]
    steps = merge(rank).summary().steps
    assert [s.link_idle_ms for s in steps] == pytest.approx([1e3 * 4.5, 1e3 * 11.0])
    assert dict(steps[0].link_idle_causes) == pytest.approx(
        {"nothing issued yet": 3e3, "waiting on gradients": 0.5e3, "waiting on the byte budget": 1e3})
    assert steps[0].link_idle_share == pytest.approx(0.45)
    assert "link idle" in merge(rank).summary().table()


def test_idle_before_the_next_steps_gathers_by_hand() -> None:
    # Window [0, 10]: idle [0, 1) before a gather of this step [1, 2]; idle [2, 3) before a
    # reduce-scatter [3, 4] while this step's re-gather [5, 6] is still to come, and [4, 5) before
    # that re-gather (not issued yet: a deeper prefetch fills those); idle [6, 6.5) before a
    # reduce-scatter [6.5, 7] with only the next step's gathers left (issued at the end of backward,
    # in the gather-ahead region) after a reduce-scatter landed: only gathering them earlier would
    # fill it; idle [7, 8) before the first of those; gathers [8, 9.5]; idle [9.5, 10] with nothing
    # after it. A stall [6.2, 6.3] (a wait for the first gather, long done) splits the gap [6, 6.5]:
    # both pieces keep its cause.
    end_of_backward = f"overlap::end_backward/{AHEAD_LABEL}"
    records = (
        _record("all_gather", 1.0, 2.0, label="overlap::pre_forward", wait=(6.2, 6.3)),
        _record("reduce_scatter", 3.0, 4.0),
        _record("all_gather", 5.0, 6.0, label="overlap::pre_backward"),
        _record("reduce_scatter", 6.5, 7.0),
        _record("all_gather", 8.0, 9.0, label=end_of_backward),
        _record("all_gather", 9.0, 9.5, label=AHEAD_LABEL),
    )
    rank = RankProfile(rank=0, world_size=2, epoch=0.0, device="cpu", steps=(StepRecord(0, 0, 0.0, 10.0),),
                       collectives=records)
    ahead = IDLE_CAUSES[3]
    assert link_idle(rank, 0.0, 10.0) == [(0.0, 1.0, "nothing issued yet"), (2.0, 3.0, "nothing issued yet"),
                                          (4.0, 5.0, "nothing issued yet"), (6.0, 6.2, ahead), (6.3, 6.5, ahead),
                                          (7.0, 8.0, ahead), (9.5, 10.0, "nothing issued yet")]
    (step,) = merge(rank).summary().steps
    assert dict(step.link_idle_causes) == pytest.approx({"nothing issued yet": 3.5e3, ahead: 1.4e3})

    # Forward done, every gather of the step landed [0, 1]: idle [1, 2) before the first
    # reduce-scatter [2, 3] with only the next step's gathers left, before any reduce-scatter
    # landed, waits on gradients (no group could have been stepped yet); idle [3, 4) before the
    # next reduce-scatter [4, 5] comes after one landed: the next step's gathers.
    records = (
        _record("all_gather", 0.0, 1.0, label="overlap::pre_forward"),
        _record("reduce_scatter", 2.0, 3.0),
        _record("reduce_scatter", 4.0, 5.0),
        _record("all_gather", 5.0, 6.0, label=AHEAD_LABEL),
    )
    rank = dataclasses.replace(rank, steps=(StepRecord(0, 0, 0.0, 6.0),), collectives=records)
    assert link_idle(rank, 0.0, 6.0) == [(1.0, 2.0, "waiting on gradients"), (3.0, 4.0, ahead)]
