"""Communication streams, one per (device, purpose), and the checks that keep stream use correct.

[Note: one stream per purpose]
All-gathers run on their own stream so that a backward reduce-scatter queued behind compute never
delays the next all-gather (the prefetch that forward and backward depend on); reduce-scatters get a
second stream, all-reduces a third (HSDP's cross-replica all-reduce of a reduced shard waits for
its reduce-scatter without holding up the next one), and every other collective a fourth. The
sharded runtime packs its all-gather inputs on a fifth (``all_gather_copy_in``), so a prefetch is
not queued behind later compute, and runs each reduce-scatter's epilogue on the stream of its last
collective (reduce-scatter, or HSDP's all-reduce) right behind it. Streams are created with high
priority so that communication kernels are scheduled ahead of compute kernels when both are ready,
as FSDP2 does.
Every collective's stream first waits for the issuing (current) stream, so the data it reads is ready.

[Note: no collectives in CUDA graph capture]
An issued collective records an event on its comm stream, sweeps query earlier events, a first use
makes the consumer's stream wait on an event recorded before the capture began (a dependency that
crosses the capture boundary: CUDA rejects it), and ``synchronize`` blocks the host. None of this
can be captured into a CUDA graph or replayed by one, so every such step checks
``check_not_capturing`` first and raises ``StreamCaptureError`` naming what to do instead.

[Note: one device per rank]
NCCL runs a rank's collectives on one device, the one ``torch.cuda.set_device`` made current.
``check_device`` raises before issuing unless the tensor's device is the current device and, when the
rank's device is known (``init_process_group(device_id=...)``, or torchrun's ``LOCAL_RANK`` with
several devices visible), that device too. Without it, ranks that forgot ``set_device`` all use
``cuda:0`` and NCCL hangs or fails far from the cause.

[Note: first launches synchronize]
CUDA loads a kernel's module at its first launch (lazy loading, ``CUDA_MODULE_LOADING=LAZY``, the
default since CUDA 11.7), and the load waits for the device to go idle: a kernel launched for the
first time right after a collective blocks the host until the communication stream has drained
(seen on an H100 / H200 machine, torch 2.11: an ``x.fill_`` after ``overlap.all_gather`` blocked for the whole
250 ms a sleep had queued on the comm stream; the same sequence later in the process did not). So
the first step of a process overlaps less than the rest, with this runtime as with FSDP2 (Triton's
own first compile of each packing kernel is slower still). The runtime does not warm kernels up
ahead of time: the kernels of a step (the model's, torch's, the packing kernels' variants per
dtype and block size) are only known by running it, and the cost is one step's worth per process.
Timings skip the first steps; tests that need a race on the device run their sequence once before
timing it (tests/collectives/test_collectives_cuda.py); ``CUDA_MODULE_LOADING=EAGER`` loads every
module at start-up instead, at a cost in start-up time and memory.

Concurrency: call from the thread that issues and waits (the caller's, or autograd's for hooks);
the stream table is filled once per (device, purpose).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["comm_stream", "collective_stream", "stream_purpose", "STREAM_PURPOSES", "StreamCaptureError",
           "capturing", "capture_error", "check_not_capturing", "check_device"]

STREAM_PURPOSES = ("all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce", "other")
_streams: dict[tuple[int, str], "torch.cuda.Stream"] = {}
# Collective kinds (``InflightWork.kind`` without ``_coalesced``) with a stream of their own.
_KINDS_WITH_OWN_STREAM = ("all_gather", "reduce_scatter", "all_reduce")


def comm_stream(device: torch.device, purpose: str) -> "torch.cuda.Stream":
    """The communication stream for ``purpose`` on CUDA ``device`` (created on first use)."""
    if purpose not in STREAM_PURPOSES:
        raise ValueError(f"purpose must be one of {STREAM_PURPOSES}, got {purpose!r}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose)
    stream = _streams.get(key)
    if stream is None:
        stream = torch.cuda.Stream(device=index, priority=-1)
        _streams[key] = stream
    return stream


def stream_purpose(kind: str) -> str:
    """The purpose whose stream runs a collective of ``kind`` (``"all_gather"``, ``"reduce_scatter_coalesced"``
    ...): all-gathers, reduce-scatters and all-reduces (coalesced or not) their own, every other kind
    ``"other"``.
    See [Note: one stream per purpose]."""
    base = kind.removesuffix("_coalesced")
    return base if base in _KINDS_WITH_OWN_STREAM else "other"


def collective_stream(device: torch.device, kind: str) -> "torch.cuda.Stream":
    """The communication stream that a collective of ``kind`` runs on, on CUDA ``device``: the one
    place that decides it, for the collectives that issue there and the profiler that times them."""
    return comm_stream(device, stream_purpose(kind))


# ----------------------------------------------------------------------------- CUDA graph capture


class StreamCaptureError(RuntimeError):
    """An overlap collective was issued or waited while a CUDA graph is being captured."""


CAPTURE_INSTEAD = (
    "issue and wait overlap's collectives outside the captured region (e.g. overlap.wait_all() before "
    "torch.cuda.graph(...) starts), and inside it call torch.distributed's collectives directly (NCCL "
    "collectives are capturable)"
)


def capturing() -> bool:
    """Is a CUDA graph being captured on the current stream? False, without touching CUDA, when CUDA
    was never initialized in this process (e.g. on a CPU-only build)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def capture_error(what: str) -> StreamCaptureError:
    """The error for ``what`` (``overlap.all_gather issued``) done during CUDA graph capture."""
    return StreamCaptureError(
        f"overlap: {what} during CUDA graph capture: its side-stream events, event queries and host waits "
        f"cannot be captured or replayed. Instead, {CAPTURE_INSTEAD}."
    )


def check_not_capturing(what: str) -> None:
    """Raise ``capture_error(what)`` if the current stream is capturing a CUDA graph.
    See [Note: no collectives in CUDA graph capture]."""
    if capturing():
        raise capture_error(what)


# ----------------------------------------------------------------------------- one device per rank


def _rank_device(bound: Optional[torch.device]) -> Optional[int]:
    """This rank's CUDA device index if known: the group's bound device, else torchrun's LOCAL_RANK
    when several devices are visible (with one visible, each rank has its own already)."""
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        return bound.index
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        count = torch.cuda.device_count()
        if count > 1 and int(local) < count:
            return int(local)
    return None


def check_device(device: torch.device, what: str, bound: Optional[torch.device] = None) -> None:
    """Raise ``RuntimeError`` unless CUDA ``device`` is the current device and this rank's device.

    ``what`` names the collective; ``bound`` is the process group's ``bound_device_id`` (None when
    ``init_process_group`` got no ``device_id``). See [Note: one device per rank].
    """
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    if index != current:
        raise RuntimeError(
            f"overlap: {what} got a tensor on cuda:{index} but the current CUDA device is cuda:{current}: "
            f"NCCL runs each rank's collectives on the current device. Call torch.cuda.set_device(local_rank) "
            f"at the start of each rank (before init_process_group) and keep its tensors on that device."
        )
    expected = _rank_device(bound)
    if expected is not None and expected != current:
        if bound is not None:
            source, other = f"the process group is bound to cuda:{expected} (init_process_group(device_id=...))", ""
        else:
            source = f"this rank's LOCAL_RANK is {expected}"
            other = (f" If this rank is meant to use cuda:{current}, say so: "
                     f"init_process_group(..., device_id=torch.device('cuda', {current})).")
        raise RuntimeError(
            f"overlap: {what} runs on cuda:{current} but {source}: call torch.cuda.set_device({expected}) "
            f"at the start of the rank, before init_process_group and its first collective.{other}"
        )
