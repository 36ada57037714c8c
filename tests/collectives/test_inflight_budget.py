"""The process-wide in-flight budget (``overlap.inflight_work.set_max_inflight_bytes``): raw collectives
whose results are dropped no longer pile up in flight, and nothing is reordered or skipped.

Behind a slow emulated link each collective stays in flight for a while, so without a budget every
dropped result's collective is still in flight when the next is issued; with one, an issue first
waits (on the host, oldest first) until it fits. See [Note: the process-wide in-flight budget].
"""
from __future__ import annotations

import pytest
import torch

import overlap
from overlap import inflight_work
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
