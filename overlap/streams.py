"""Communication streams, one per (device, purpose).

[Note: one stream per purpose]
All-gathers run on their own stream so that a backward reduce-scatter queued behind compute never
delays the next all-gather (the prefetch that forward and backward depend on); reduce-scatters get a
second stream, and every other collective a third. Streams are created with high priority so that
communication kernels are scheduled ahead of compute kernels when both are ready, as FSDP2 does.
Every collective's stream first waits for the issuing (current) stream, so the data it reads is ready.
"""
from __future__ import annotations

import torch

__all__ = ["comm_stream", "STREAM_PURPOSES"]

STREAM_PURPOSES = ("all_gather", "reduce_scatter", "other")
_streams: dict[tuple[int, str], "torch.cuda.Stream"] = {}


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
