"""Collectives on CUDA (NCCL, world size 1, one GPU): side streams on the timeline, buffers consumed
on another stream, CUDA graph capture, the device check.

Skipped without a GPU (``requires_cuda``); on a GPU machine ``pytest -m gpu`` runs it.
``torch.cuda._sleep`` queued on a stream makes that stream slow on purpose: on the comm stream it
is a slow link (the collective waits behind it), on the compute stream it is long compute. Events
timed on both streams show what ran beside what.
The CPU half of these checks (the release bookkeeping with fake streams and events, the capture and
device errors) is tests/collectives/test_stream_lifetime.py.
"""
from __future__ import annotations

import pytest
import torch

import overlap
from conftest import requires_cuda
from overlap.streams import comm_stream
from overlap.testing import run_distributed
from scheduler import AsyncTensor

pytestmark = [pytest.mark.gpu, requires_cuda]

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


# ----------------------------------------------------------------------------- a slow collective

# ~0.25 s queued on the comm stream (1-2 GHz): the collective is still pending long after the host
# has issued everything that follows it in a test
_SLOW_COMM_CYCLES = 500_000_000


def _compute_beside_slow_collective(rank: int, world: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=dev)
    a = torch.randn(1024, 1024, device=dev)
    overlap.wait(overlap.all_gather(x))  # warm-up: NCCL and cuBLAS set-up stay off the timeline
    a @ a
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    side = comm_stream(dev, "all_gather")
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLOW_COMM_CYCLES)  # a slow link: the all-gather queues behind it
    y = overlap.all_gather(x)
    comm_done = torch.cuda.Event(enable_timing=True)
    comm_done.record(side)
    b = a @ a  # compute issued after the collective, before its first use
    compute_done = torch.cuda.Event(enable_timing=True)
    compute_done.record()
    comm_busy_at_issue_end = not side.query()
    z = y * 2
    torch.cuda.synchronize()
    return {
        "comm_busy": comm_busy_at_issue_end,
        "comm_ms": start.elapsed_time(comm_done),
        "compute_ms": start.elapsed_time(compute_done),
        "equal": bool(torch.equal(z, x * 2)) and bool(torch.allclose(b, a @ a)),
    }


def test_compute_is_not_blocked_by_a_slow_collective() -> None:
    (r,) = run_distributed(_compute_beside_slow_collective, 1, backend="nccl")
    assert r["equal"] and r["comm_busy"], r
    # The matmul issued after the collective finished long before it: the compute stream did not wait.
    assert r["compute_ms"] < r["comm_ms"], r


# ----------------------------------------------------------------------------- consumers on another stream

CONSUMER_CASES = ("all_gather dim 1", "reduce_scatter", "all_gather_coalesced", "reduce_scatter_into",
                  "wait_all then use")


def _consume_on_another_stream(rank: int, world: int, case: str, slow: str) -> dict:
    """Issue on the current (issue) stream, wait on another (consumer) stream, then allocate and
    scribble on the issue stream while the ``slow`` stream is still busy: the runtime's buffers must
    not be handed out, and the result must be right.

    ``slow="comm"``: the collective itself is still pending (NCCL reads and writes the buffers).
    ``slow="consumer"``: the collective has finished (the host synchronized its stream, so torch's
    own stream bookkeeping for NCCL's tensors is satisfied) but the consumer's copy-out is still
    queued: only the runtime's deferred release keeps the buffer from the scribbles.

    The round runs twice, the first time without the sleep: CUDA loads a kernel's module at its
    first launch (lazy loading, the default), and that load waits for the device, so a first
    launch of a kernel behind the sleep would block the host until the slow stream had drained
    and the race would not be exercised ([Note: first launches synchronize] in overlap/streams.py).
    """
    dev = torch.device("cuda", torch.cuda.current_device())
    consumer = torch.cuda.Stream(dev)
    _consume_round(dev, consumer, case, slow, sleep=False)  # warm-up: every kernel of the round loaded
    return _consume_round(dev, consumer, case, slow, sleep=True)


def _consume_round(dev: torch.device, consumer: torch.cuda.Stream, case: str, slow: str, sleep: bool) -> dict:
    from overlap import inflight_work
    from overlap.collectives import reduce_scatter_into
    from overlap.groups import resolve_group

    x = torch.randn(64, 1024, device=dev)  # 256 KiB blocks: the caching allocator reuses them at once
    want = x.clone()  # world size 1: every case's result is the input
    purpose = "all_gather" if case.startswith("all_gather") else "reduce_scatter"
    torch.cuda.synchronize()
    slow_stream = comm_stream(dev, purpose) if slow == "comm" else consumer
    if sleep:
        with torch.cuda.stream(slow_stream):
            torch.cuda._sleep(_SLOW_COMM_CYCLES)
    if case == "all_gather dim 1":
        result = overlap.all_gather(x, dim=1)  # a temporary output, copied out at first use
    elif case == "all_gather_coalesced":
        result = overlap.all_gather_coalesced([x, x[:2]])[0]  # a packed output, copied out at first use
    elif case == "reduce_scatter_into":
        packed, result = x.clone(), torch.empty_like(x)
        work = reduce_scatter_into(result.view(-1), packed.view(-1), resolve_group(None))
        del packed  # the runtime drops its reduce-scatter input at once
    else:
        result = overlap.reduce_scatter(x)  # an input snapshot
    storages = [b.untyped_storage() for b in overlap.inflight()[-1]._buffers]
    held = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
    del storages
    x.fill_(float("nan"))
    with torch.cuda.stream(consumer):
        if case == "reduce_scatter_into":
            work.wait()
            got = result.clone()
        else:
            if case == "wait_all then use":
                overlap.wait_all()
            got = result.clone()  # first use on the consumer stream
    if slow == "consumer":
        comm_stream(dev, purpose).synchronize()
    busy = not slow_stream.query()
    scribbles = [torch.full(((hi - lo) // 4,), -1.0, device=dev) for lo, hi in held for _ in range(4)]
    clashes = sum(s.data_ptr() < hi and lo < s.data_ptr() + s.numel() * 4 for s in scribbles for lo, hi in held)
    torch.cuda.synchronize()
    inflight_work.sweep()  # the consumer's events have completed: the deferred buffers go now
    return {
        "busy": busy,
        "clashes": clashes,
        "equal": bool(torch.equal(got, want)),
        "scribbles_intact": all(bool((s == -1.0).all()) for s in scribbles),
        "deferred_left": len(inflight_work._deferred),
    }


@pytest.mark.parametrize("slow", ("comm", "consumer"))
@pytest.mark.parametrize("case", CONSUMER_CASES)
def test_buffers_outlive_a_consumer_on_another_stream(case: str, slow: str) -> None:
    (r,) = run_distributed(_consume_on_another_stream, 1, case, slow, backend="nccl")
    assert r["busy"], f"the {slow} stream finished before the scribbles: the race was not exercised ({r})"
    assert r["clashes"] == 0, f"a buffer still read by NCCL was handed to a new tensor on the issue stream ({r})"
    assert r["equal"] and r["scribbles_intact"], r
    assert r["deferred_left"] == 0, f"a sweep after the consumer's events completed must release everything ({r})"


# ----------------------------------------------------------------------------- CUDA graph capture


def _capture_is_refused(rank: int, world: int) -> dict:
    from overlap.streams import StreamCaptureError

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(8.0, device=dev)
    pending = overlap.all_gather(x)  # issued before the capture, first used inside it
    errors = []
    for step in (lambda: overlap.all_gather(x), lambda: pending + 1):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
        except StreamCaptureError as e:
            errors.append(str(e))
    later = overlap.wait(pending) + 1  # the capture ended cleanly: the same result waits normally
    torch.cuda.synchronize()
    return {"errors": errors, "equal": bool(torch.equal(later, x + 1))}


def test_collectives_in_cuda_graph_capture_raise_and_name_the_fix() -> None:
    (r,) = run_distributed(_capture_is_refused, 1, backend="nccl")
    assert len(r["errors"]) == 2, r
    assert "overlap.all_gather issued during CUDA graph capture" in r["errors"][0], r
    assert "the wait for all_gather" in r["errors"][1], r
    assert all("before torch.cuda.graph" in e for e in r["errors"]), r
    assert r["equal"], r


# ----------------------------------------------------------------------------- one device per rank


def _tensor_on_another_device(rank: int, world: int) -> str:
    x = torch.ones(4, device=torch.device("cuda", (torch.cuda.current_device() + 1) % torch.cuda.device_count()))
    try:
        overlap.all_gather(x)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (a tensor off the rank's device)")
def test_a_tensor_off_the_current_device_names_set_device() -> None:
    (message,) = run_distributed(_tensor_on_another_device, 1, backend="nccl")
    assert "but the current CUDA device is cuda:0" in message and "torch.cuda.set_device" in message, message
