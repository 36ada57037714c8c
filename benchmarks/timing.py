"""Per-call timing shared by the benchmarks: median over repeated timed loops."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def seconds_per_call(fn: Callable[[], object], iters: int, repeats: int = 5, warmup: int = 3) -> float:
    """Call ``fn`` ``warmup`` times, then time ``repeats`` loops of ``iters`` calls; the median per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)
