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
model replays one step from a cold start (``scheduler.replayed_step``, [Note: replaying a step on
a FIFO link], the model gather-ahead's choice replays too): forward issues at the start of group
``j`` the gathers of groups ``j+1 .. j+d``; the last group and the ``d`` before it stay unsharded
into backward (the runtime's [Note: kept for backward]: backward needs them first, and holding
them costs what re-gathering them ``d`` ahead would); backward re-gathers the rest the same way in
reverse, and each group's reduce-scatter (taken to cost what its gather costs) is queued when its
backward ends. The depth is the smallest ``d`` whose modelled step is within ``tolerance`` of the
best over every ``d`` the budget allows (any group and the ``d`` after it, together, within
``budget``), so ties go to the shallower, cheaper depth. Where the link is the bottleneck every
unit of depth saves one re-gather, so the budget alone caps the depth there. Depth 0 is never
chosen: one group ahead is always allowed (the runtime holds that much with ``prefetch=1`` too),
even past the budget.
"""
from __future__ import annotations

import math
from typing import Sequence

from scheduler.replayed_step import step_ends

__all__ = ["choose_prefetch_depth", "modelled_step", "check_costs"]


def modelled_step(compute: Sequence[float], gather: Sequence[float], depth: int) -> float:
    """Seconds of one step (forward and backward) at prefetch ``depth`` from a cold start, under the
    model of [Note: choosing the prefetch depth] (``scheduler.replayed_step``)."""
    ends = step_ends(compute, gather, depth)
    return ends[0] if ends else 0.0


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
