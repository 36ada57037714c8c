"""The multi-rank harness: results per rank, failures named by rank, no hangs."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from overlap.testing import DistributedTestError, DistributedTimeoutError, run_distributed


def _sum_of_ranks(rank: int, world_size: int, offset: int, *, scale: int = 1) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "sum": int(t.item()) * scale + offset,
        "interpret": os.environ.get("TRITON_INTERPRET"),
        "tensor": torch.full((2,), rank),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_by_rank(distributed, world_size: int) -> None:
    results = distributed(_sum_of_ranks, world_size, 100, scale=2)
    want_sum = sum(range(world_size)) * 2 + 100
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size and r["sum"] == want_sum for r in results)
    assert all(r["interpret"] == os.environ.get("TRITON_INTERPRET") for r in results)
    assert all(torch.equal(r["tensor"], torch.full((2,), i)) for i, r in enumerate(results))


def _rank_one_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_raise_names_rank_and_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_raises, 2, timeout=30)
    err = info.value
    assert err.rank == 1 and list(err.failures) == [1]
    assert "rank 1 of 2" in str(err)
    assert "rank one is unhappy" in str(err) and "_rank_one_raises" in str(err)
    assert isinstance(err.__cause__, ValueError)


def _rank_zero_exits(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()  # would wait for rank 0 forever


def test_exit_without_report_gives_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_zero_exits, 2, timeout=30)
    assert info.value.rank == 0 and info.value.exitcode == 3
    assert "exited with code 3" in str(info.value)
    assert time.monotonic() - start < 10, "the surviving rank must be killed, not waited for"


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        while True:
            time.sleep(1)


def test_timeout_names_unfinished_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_rank_one_hangs, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, DistributedTimeoutError) and info.value.ranks == [1]
    assert "ranks [1] had not finished" in str(info.value)
    assert "_rank_one_hangs" in str(info.value), "the stuck rank's stack is reported"
    assert elapsed < 3 + 3


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_sum_of_ranks, 1, timeout=0)
    with pytest.raises(ValueError, match="gbps"):
        run_distributed(_sum_of_ranks, 1, link=(0.0, 10.0))
    with pytest.raises(ValueError, match="module-level"):
        run_distributed(lambda rank, world_size: None, 1)
