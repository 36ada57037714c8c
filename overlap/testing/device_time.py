"""A callable's time on the GPU alone, the host's time hidden: what a kernel's bandwidth is read from.

Contract. :func:`device_ms` calls ``fn`` ``calls`` times on the current CUDA stream behind a sleep
long enough for the host to queue every call before the GPU reaches the first, and returns the
median, 20th and 80th percentile of the per-call times between CUDA events (ms), each call on a
cold L2 cache (a 256 MB buffer zeroed before it, outside its events, as ``triton.testing.do_bench``
does); fewer calls (at least 2) where the host needs more than ``MAX_HOLD_SECONDS`` to queue them.
It returns ``None`` when the queue could not be held: the GPU reached the first call before the host
had queued the last, three times with a longer sleep each time. That is the answer for a
``fn`` that synchronizes with the GPU (a ``.item()``, an event waited on by the host): its time is
not a device time. ``fn`` must queue its work on the current stream (or wait for it there).

[Note: device time vs wall time]
``do_bench`` times each call between two events recorded around it on the host. When the host
takes longer to issue a call than its cache clear and kernels take to run, the GPU reaches the
first event before the kernel is queued and waits: the time read is then the host's. The packing
ops' host cost is tens of µs per call (``benchmarks/bench_kernels.py``'s host table) and their
kernels on the "/4" workloads run for about as long, so a bandwidth read that way mixes issue 28's
host cost into issue 30's kernel bandwidth, and the spread between p20 and p80 can be 7x (the sixth
GPU run's 32 MB copy-in: 0.007-0.059 ms). Here the host queues every call while the GPU sleeps, so
each pair of events brackets kernels that were all queued before the GPU got to them. Whether the
queue held is checked, not assumed: an event recorded right after the sleep must still be pending
when the host has queued the last call.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Optional

import torch

from overlap.testing.emulated_link.cuda_sleep import cuda_sleep

__all__ = ["device_ms"]

CACHE_BYTES = 256 * 2**20
"""Zeroed before each call: larger than an H100's or H200's L2 (50 / 60 MB), as ``do_bench``'s."""

ATTEMPTS = 3

MAX_HOLD_SECONDS = 0.1
"""The first sleep's bound: fewer calls are timed where the host needs longer to queue ``calls``
of them (a call that issues hundreds of launches could also fill the GPU's launch queue while it
sleeps, which blocks the host: that reads as not held)."""


# The CUDA calls, by name (tests on CPU put a scripted GPU in their place).
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_device_context = torch.cuda.device
_sleep = cuda_sleep


def _cold_cache(device: torch.device) -> torch.Tensor:
    return torch.empty(CACHE_BYTES, dtype=torch.int8, device=device)


def device_ms(fn: Callable[[], object], device: torch.device, calls: int = 40,
              ) -> Optional[tuple[float, float, float]]:
    """``(median, p20, p80)`` ms of ``fn``'s work on the GPU per call, or ``None`` when the host could
    not be kept ahead (see the module's contract)."""
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise ValueError(f"device_ms: device must be a CUDA torch.device, got {device!r}")
    if not isinstance(calls, int) or calls < 2:
        raise ValueError(f"device_ms: calls must be an int >= 2, got {calls!r}")
    with _device_context(device):
        cache = _cold_cache(device)
        fn()  # warm: first-call builds (tables, compiled kernels) are not device time
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(3):
            cache.zero_()
            fn()
        host_s = (time.perf_counter() - start) / 3
        _synchronize(device)
        calls = max(2, min(calls, int(MAX_HOLD_SECONDS / (2 * host_s))))
        for attempt in range(ATTEMPTS):
            hold_s = 2 * calls * host_s * 4**attempt + 1e-3
            starts = [_Event(enable_timing=True) for _ in range(calls)]
            ends = [_Event(enable_timing=True) for _ in range(calls)]
            _sleep(hold_s, device)
            gate = _Event()
            gate.record()
            for begin, end in zip(starts, ends):
                cache.zero_()
                begin.record()
                fn()
                end.record()
            held = not gate.query()
            _synchronize(device)
            if held:
                times = [b.elapsed_time(e) for b, e in zip(starts, ends)]
                cuts = statistics.quantiles(times, n=10, method="inclusive")
                return statistics.median(times), cuts[1], cuts[7]
    return None
