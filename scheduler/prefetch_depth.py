"""How many groups ahead to all-gather: the prefetch depth from measured costs and a byte budget.

Contract: pure functions of numbers (no torch, no process groups), so every rank computes the same
answer from the same inputs; the runtime (``overlap.shard``'s ``prefetch="auto"``) measures the
inputs and agrees the answer across ranks before using it.

Inputs, per group in the order compute needs them (the agreed forward order):

==============  ================================================================================
``compute``     seconds of forward compute of the group (backward is taken as twice that)
``gather``      seconds its all-gather occupies the link (a gather issued and waited at once, as
                in the step that records the order: packing, latency and transfer)
``nbytes``      bytes its all-gather brings in (its unsharded size): what a prefetch holds
``budget``      bytes the running group's gather and those of the groups gathered ahead of it may
                hold together
==============  ================================================================================

[Note: choosing the prefetch depth]
The link is a FIFO: a gather issued earlier than the link can start it waits in the queue, so depth
beyond what keeps the queue non-empty buys nothing and costs one group's unsharded size each. The
model replays one step: forward runs the groups in order, issuing at the start of group ``j`` the
gathers of groups ``j+1 .. j+d`` (each once); the last group and the ``d`` before it stay
unsharded into backward (the runtime's [Note: kept for backward]: backward needs them first, and
holding them costs what re-gathering them ``d`` ahead would); backward runs the rest in reverse,
re-gathering the same way, and each group's reduce-scatter (taken to cost what its gather costs) is queued when its
backward ends. A group starts when the one before it is done and its gather has landed. The depth
is the smallest ``d`` whose modelled step is within ``tolerance`` of the best over every ``d``
the budget allows (any group and the ``d`` after it, together, within ``budget``), so ties go to
the shallower, cheaper depth. Where the link is the bottleneck every unit of depth saves one
re-gather, so the budget alone caps the depth there. Depth 0 is never chosen: one group ahead is always allowed (the
runtime holds that much with ``prefetch=1`` too), even past the budget.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["choose_prefetch_depth", "modelled_step", "check_costs"]


def modelled_step(compute: Sequence[float], gather: Sequence[float], depth: int) -> float:
    """Seconds of one step (forward and backward) at prefetch ``depth`` under the model of [Note:
    choosing the prefetch depth]."""
    n = len(compute)
    if n == 0:
        return 0.0
    link_free = 0.0
    landed = [math.inf] * n

    def issue(i: int, at: float) -> None:
        nonlocal link_free
        if landed[i] == math.inf:
            link_free = max(link_free, at) + gather[i]
            landed[i] = link_free

    now = 0.0
    for j in range(n):  # forward
        issue(j, now)
        for k in range(j + 1, min(n, j + 1 + depth)):
            issue(k, now)
        now = max(now, landed[j]) + compute[j]
    landed = [math.inf] * n
    for k in range(max(0, n - 1 - depth), n):  # the last group and the depth before it stay unsharded
        landed[k] = 0.0
    for j in reversed(range(n)):  # backward
        issue(j, now)
        for k in range(j - 1, max(-1, j - 1 - depth), -1):
            issue(k, now)
        now = max(now, landed[j]) + 2 * compute[j]
        link_free = max(link_free, now) + gather[j]  # the reduce-scatter, queued when its backward ends
    return max(now, link_free)


def check_costs(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int], entry: str) -> None:
    """Refuse cost lists of different lengths (one entry per ``entry``) or times that are not finite
    seconds >= 0 (``ValueError``)."""
    if not (len(compute) == len(gather) == len(nbytes)):
        raise ValueError(f"compute, gather and nbytes must have one entry per {entry}, got lengths "
                         f"{len(compute)}, {len(gather)}, {len(nbytes)}")
    if any(not math.isfinite(x) or x < 0 for x in [*compute, *gather]):
        raise ValueError("compute and gather must be finite seconds >= 0")


def _fits(nbytes: Sequence[int], depth: int, budget: int) -> bool:
    """Do any group and the ``depth`` groups after it fit ``budget`` together?"""
    return all(sum(nbytes[j: j + 1 + depth]) <= budget for j in range(len(nbytes)))


def choose_prefetch_depth(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int],
                          budget: int, tolerance: float = 0.01) -> int:
    """The prefetch depth for groups with these costs (see [Note: choosing the prefetch depth]): at
    least 1, at most ``len(compute) - 1`` (or 1 for fewer than two groups)."""
    check_costs(compute, gather, nbytes, "group")
    if not (isinstance(budget, int) and budget >= 0):
        raise ValueError(f"budget must be an int >= 0 (bytes), got {budget!r}")
    allowed = [d for d in range(1, max(2, len(compute))) if d == 1 or _fits(nbytes, d, budget)]
    times = {d: modelled_step(compute, gather, d) for d in allowed}
    best = min(times.values())
    return min(d for d, t in times.items() if t <= best * (1 + tolerance))
