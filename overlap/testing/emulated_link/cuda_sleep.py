"""The emulated link on CUDA: keep the caller's stream busy for a collective's link time, host free.

Contract. :func:`cuda_sleep` enqueues ``torch.cuda._sleep`` on the current stream of ``device`` for
about ``seconds`` (at least one cycle) and returns at once: the stream (the caller's communication
stream) is busy, the host is not blocked, and everything queued behind it on that stream waits.
Cycles per second are calibrated once per device with CUDA events (two launches, the first warms
up), on a side stream. The link's FIFO order on CUDA is the stream's own order.
"""
from __future__ import annotations

import torch

__all__ = ["cuda_sleep"]

_cycles_per_second: dict[int, float] = {}


def cuda_sleep(seconds: float, device: torch.device) -> None:
    """Keep the current CUDA stream busy for ``seconds`` without blocking the host."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _cycles_per_second.get(index)
    if rate is None:
        rate = _cycles_per_second[index] = _calibrate(index)
    torch.cuda._sleep(max(1, int(seconds * rate)))


def _calibrate(index: int, cycles: int = 20_000_000) -> float:
    with torch.cuda.device(index), torch.cuda.stream(torch.cuda.Stream()):
        rate = 0.0
        for _ in range(2):  # the first launch warms up
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rate = cycles / (start.elapsed_time(end) * 1e-3)
    return rate
