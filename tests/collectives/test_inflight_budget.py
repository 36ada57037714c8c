"""The process-wide in-flight budget (``overlap.inflight_work.set_max_inflight_bytes``): raw collectives
whose results are dropped no longer pile up in flight, and nothing is reordered or skipped.

Behind a slow emulated link each collective stays in flight for a while, so without a budget every
dropped result's collective is still in flight when the next is issued; with one, an issue first
waits (on the host, oldest first) until it fits. See [Note: the process-wide in-flight budget].
"""
from __future__ import annotations

import datetime

import pytest
import torch

import overlap
from overlap import inflight_work
from overlap.inflight_work import InflightWork
from overlap.testing import run_distributed

ROWS = 4096  # one rank's all-gather input: 4096 float32 = 16 KiB; the gathered result on 2 ranks: 32 KiB
RESULT_BYTES = 2 * ROWS * 4
BUDGET = 3 * RESULT_BYTES + RESULT_BYTES // 2  # room for three results in flight, not four
ISSUES = 12
BIG_ROWS = BUDGET // 4  # an all-gather whose result (2 * BUDGET bytes) exceeds the budget on its own
LINK = (0.5, 20_000.0)  # 20 ms latency per collective, ~0.5 ms of bytes: each stays in flight ~20 ms


def _most_in_flight(rank: int, count: int) -> tuple[int, list[torch.Tensor]]:
    """Issue ``count`` all-gathers, dropping all but every fourth result; the largest ``inflight_bytes()``
    seen right after an issue, and the kept results (in issue order)."""
    most, kept = 0, []
    for i in range(count):
        result = overlap.all_gather(torch.full((ROWS,), float(10 * i + rank)))
        most = max(most, overlap.inflight_bytes())
        if i % 4 == 0:
            kept.append(result)
    return most, kept


def _dropped_results(rank: int, world_size: int) -> dict:
    out: dict = {}
    out["uncapped"], _ = _most_in_flight(rank, ISSUES)
    overlap.wait_all()
    previous = inflight_work.set_max_inflight_bytes(BUDGET)
    try:
        out["capped"], kept = _most_in_flight(rank, ISSUES)
        # A collective larger than the budget goes once nothing else is in flight.
        big = overlap.all_gather(torch.ones(BIG_ROWS))
        out["big_alone"] = overlap.inflight_bytes() == 2 * BIG_ROWS * 4
        overlap.wait(big)
    finally:
        out["restored"] = inflight_work.set_max_inflight_bytes(previous) == BUDGET
    # Nothing reordered or skipped: each kept result holds both ranks' values of its own issue.
    out["values"] = [(float(r[0]), float(r[ROWS])) for r in kept]
    overlap.wait_all()
    return out


def test_the_budget_bounds_dropped_results_in_flight() -> None:
    for rank, r in enumerate(run_distributed(_dropped_results, 2, timeout=120, link=LINK)):
        assert r["uncapped"] > BUDGET, f"rank {rank}: the link is too fast to keep collectives in flight: {r}"
        assert r["capped"] <= BUDGET, f"rank {rank}: {r['capped']} bytes in flight, budget {BUDGET}"
        assert r["big_alone"], r
        assert r["values"] == [(10.0 * i, 10.0 * i + 1) for i in range(0, ISSUES, 4)], r["values"]
        assert r["restored"]


def test_set_max_inflight_bytes_checks_and_returns_the_previous_cap() -> None:
    assert inflight_work.max_inflight_bytes() is None, "off by default"
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError), ("1 MiB", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="set_max_inflight_bytes: limit must be None \\(no cap\\) or an int number of "
                                      "bytes >= 1, got"):
            inflight_work.set_max_inflight_bytes(bad)  # type: ignore[arg-type]
        assert inflight_work.max_inflight_bytes() is None, "a failed call changes nothing"
    assert inflight_work.set_max_inflight_bytes(1 << 20) is None
    try:
        assert inflight_work.max_inflight_bytes() == 1 << 20
    finally:
        assert inflight_work.set_max_inflight_bytes(None) == 1 << 20


class _QueuedWork:
    """A ``dist.Work`` stand-in that finishes only when waited (or when the test says so), logging the wait."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: datetime.timedelta) -> bool:
        self.log.append(self.name)
        self.done = True
        return True


@pytest.fixture
def no_works_in_flight():
    """An empty in-flight registry and no budget, before and after the test."""
    inflight_work._inflight.clear()
    yield
    inflight_work._inflight.clear()
    inflight_work.set_max_inflight_bytes(None)


def test_make_room_waits_for_the_oldest_only_until_the_new_collective_fits(no_works_in_flight) -> None:
    """``make_room(n)`` waits on the host for the collectives in flight oldest first, and only while
    ``inflight_bytes() + n`` is over the budget: one that fits exactly goes at once, a finished one
    is swept, not waited ([Note: the process-wide in-flight budget])."""
    waited: list[str] = []
    works = {name: _QueuedWork(waited, name) for name in "abc"}
    for i, (name, work) in enumerate(works.items()):
        inflight_work.track(InflightWork("all_gather", 10, [torch.zeros(1)], work=work, seq=i))
    inflight_work.set_max_inflight_bytes(35)
    inflight_work.make_room(5)  # 30 + 5: fits exactly
    assert waited == [] and overlap.inflight_bytes() == 30
    inflight_work.make_room(6)  # 36: the oldest goes, then 26 fits
    assert waited == ["a"] and overlap.inflight_bytes() == 20
    works["b"].done = True  # finished, nobody waited: the sweep forgets it
    inflight_work.make_room(25)  # c and 25 fit once b is swept
    assert waited == ["a"] and overlap.inflight_bytes() == 10
    inflight_work.make_room(26)  # over even alone once c is waited: c goes, then it goes alone
    assert waited == ["a", "c"] and overlap.inflight() == []
