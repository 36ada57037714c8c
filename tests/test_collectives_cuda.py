"""Collectives on CUDA (NCCL, world size 1): a side stream, and compute that is not blocked.

Skipped without a GPU; on a GPU machine plain ``pytest`` runs it.
"""
from __future__ import annotations

import pytest
import torch

import overlap
from overlap.streams import comm_stream
from overlap.testing import run_distributed
from scheduler import AsyncTensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL collectives)"),
]

_SLEEP_CYCLES = 50_000_000  # tens of milliseconds of compute-stream work


def _side_stream_and_overlap(rank: int, world: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=dev)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    y = overlap.all_gather(x)
    side = comm_stream(dev, "all_gather")
    comm_done = torch.cuda.Event(enable_timing=True)
    comm_done.record(side)  # after the all-gather on its stream
    torch.cuda._sleep(_SLEEP_CYCLES)  # compute issued before the first use
    compute_done = torch.cuda.Event(enable_timing=True)
    compute_done.record()
    pending_before_use = type(y) is AsyncTensor
    z = y * 2  # first use: the current stream waits on the collective's event
    torch.cuda.synchronize()
    return {
        "side_stream_differs": side != torch.cuda.current_stream(),
        "pending_before_use": pending_before_use,
        "comm_ms": start.elapsed_time(comm_done),
        "compute_ms": start.elapsed_time(compute_done),
        "equal": bool(torch.equal(z, x * 2)),
    }


def test_collective_runs_beside_compute() -> None:
    (r,) = run_distributed(_side_stream_and_overlap, 1, backend="nccl")
    assert r["equal"] and r["pending_before_use"] and r["side_stream_differs"], r
    # The all-gather finished while the compute stream was still busy: it was not queued behind it.
    assert r["comm_ms"] < r["compute_ms"], r


def _matches_blocking(rank: int, world: int) -> None:
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 5, device=dev).to(dtype)
        ref = torch.empty_like(x)
        dist.all_gather_into_tensor(ref, x)
        got = overlap.all_gather(x)
        x.add_(1)  # mutating the input after issue does not change the result
        assert torch.equal(got, ref)
        r = overlap.reduce_scatter(x, op="avg")
        assert torch.equal(r, x)  # one rank: the average is the input
        a = overlap.all_reduce(x, op="max")
        assert torch.equal(a, x)


def test_nccl_results_match_blocking_collectives() -> None:
    run_distributed(_matches_blocking, 1, backend="nccl")
