"""The multi-rank harness: results per rank, failures named by rank, no hangs."""
from __future__ import annotations

import os
import signal
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


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"fn": _sum_of_ranks, "world_size": True}, TypeError, "world_size must be an int >= 1, got bool True"),
        ({"fn": _sum_of_ranks, "world_size": 2.0}, TypeError, "world_size must be an int >= 1, got float"),
        ({"fn": None, "world_size": 1}, TypeError, "fn must be a module-level function"),
        ({"fn": _sum_of_ranks, "world_size": 1, "timeout": None}, TypeError,
         "timeout must be a finite number of seconds > 0 (an int or float, not a bool), got NoneType None"),
        ({"fn": _sum_of_ranks, "world_size": 1, "timeout": "5"}, TypeError,
         "timeout must be a finite number of seconds > 0 (an int or float, not a bool), got str '5'"),
        ({"fn": _sum_of_ranks, "world_size": 1, "timeout": float("inf")}, ValueError, "timeout must be a finite"),
        ({"fn": _sum_of_ranks, "world_size": 1, "pg_timeout": "5"}, TypeError, "pg_timeout must be None (= timeout)"),
        ({"fn": _sum_of_ranks, "world_size": 1, "failure_grace": -1}, ValueError, "failure_grace must be a finite"),
        ({"fn": _sum_of_ranks, "world_size": 1, "backend": "mpi"}, ValueError,
         "backend must be one of ('gloo', 'nccl')"),
        ({"fn": _sum_of_ranks, "world_size": 1, "link": (True, 10.0)}, TypeError,
         "link=(gbps, latency_us): gbps (link bandwidth in gigabits/s) must be a finite number > 0 (an int or float, "
         "not a bool), got bool True"),
        ({"fn": _sum_of_ranks, "world_size": 1, "link": [1.0, 10.0]}, ValueError, "link must be None or a (gbps, "),
    ],
)
def test_bad_arguments_raise_in_the_caller_naming_them(kwargs: dict, exc: type, message: str) -> None:
    fn, world_size = kwargs.pop("fn"), kwargs.pop("world_size")
    with pytest.raises(exc) as info:
        run_distributed(fn, world_size, 0, **kwargs)
    assert str(info.value).startswith("run_distributed: ") and message in str(info.value), str(info.value)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the error on a machine with fewer than 2 GPUs")
def test_nccl_without_enough_gpus_is_named_up_front() -> None:
    with pytest.raises(ValueError, match=r"backend='nccl' .* needs world_size <= the GPUs visible \(\d+\), got "
                                         r"world_size=2; use backend='gloo' on CPU"):
        run_distributed(_sum_of_ranks, 2, 0, backend="nccl")


def test_unpicklable_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="the extra args and kwargs for fn must be picklable"):
        run_distributed(_sum_of_ranks, 1, 0, scale=lambda: 1)


# ----------------------------------------------------------------------------- failures that used to hide


def _raises_with_own_collective_in_flight(rank: int, world_size: int) -> str:
    """Rank 0 raises with a collective of its own in flight; rank 1 waits for a message that never
    comes. Destroying the group first would wait for rank 0's collective forever."""
    if rank == 0:
        dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never joins it
        raise KeyError("rank 0's own error")
    dist.recv(torch.empty(1), src=0)
    return "unreachable"


def test_a_failed_rank_reports_before_destroying_its_group() -> None:
    """[Note: report before destroying the process group]: the error comes back, not a timeout."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raises_with_own_collective_in_flight, 2, timeout=60, pg_timeout=600)
    err = info.value
    assert err.rank == 0 and "KeyError: \"rank 0's own error\"" in str(err), str(err)
    assert isinstance(err.__cause__, KeyError)


def _rank_one_aborts(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()


def test_a_rank_killed_by_a_signal_gets_the_debug_hint() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_aborts, 2, timeout=30)
    failure = info.value.failures[1]
    assert failure.exitcode == -signal.SIGABRT
    text = failure.describe()
    assert "rank 1 was killed by SIGABRT (exit code -6)" in text and "OVERLAP_DEBUG=1" in text, text


def _mismatched_sizes(rank: int, world_size: int) -> None:
    """Debug off, rank 1 is out of step: its all-reduce is twice as long as rank 0's."""
    dist.all_reduce(torch.ones(4 * (rank + 1)))


def test_a_collective_mismatch_with_debug_off_suggests_debug_mode() -> None:
    """gloo aborts the rank that receives more than it expects (EnforceNotMet, SIGABRT): the report
    says what that usually means and how to find out."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched_sizes, 2, timeout=60, pg_timeout=10)
    assert "OVERLAP_DEBUG=1" in str(info.value), str(info.value)
    # The headline is the aborted rank, not its peer's "Connection reset by peer" that followed.
    assert info.value.exitcode == -signal.SIGABRT, str(info.value)


def _rank_cuda_state(rank: int, world_size: int) -> dict:
    state = {"nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), "bad_fork": torch.cuda._is_in_bad_fork()}
    if torch.cuda.is_available():  # the first CUDA call of a rank: it failed when the server held CUDA
        state["cuda_sum"] = float((torch.ones(4, device="cuda") * 2).sum().item())
    return state


def test_ranks_forked_from_the_server_can_use_cuda() -> None:
    """The fork server imports Inductor (tests/conftest.py's preload), whose import of cpp_extension
    asks torch.cuda.is_available() where a CUDA toolkit is installed: answered by the CUDA runtime,
    that initialized CUDA in the server and failed every rank's first CUDA call on a GPU host (Dynamo's
    RNG state, the optimizers' capture check). The server answers by NVML instead; on a GPU machine
    each rank really uses the device here. Without a GPU, a CUDA build of torch still poisons the
    fork (no NVML there, so the runtime answers), harmlessly: no rank can use CUDA, and the harness
    keeps the fork server (``_cuda_device_visible``)."""
    # a CPU build never poisons a fork; a CUDA build only matters (and must not) where a device is seen
    fork_must_be_clean = torch.version.cuda is None or torch.cuda.is_available()
    for state in run_distributed(_rank_cuda_state, 2, timeout=120):
        if fork_must_be_clean:
            assert not state["bad_fork"], state
        if os.environ.get("OVERLAP_TEST_START_METHOD", "forkserver") == "forkserver":
            assert state["nvml_check"] == os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"), state
        if torch.cuda.is_available():
            assert state["cuda_sum"] == 8.0, state
