"""The most unsharded bytes a prefetch schedule holds at once, from its depth and its gathers ahead.

Contract: a pure function of numbers (no torch, no process groups); both schedule choosers bound it
by their byte budget (``scheduler.prefetch_depth`` with nothing gathered ahead,
``scheduler.gather_ahead`` with its plans), and ``overlap/demo/unsharded_peak.py`` evaluates it on a
sharded model beside the peak it counts.

[Note: the bytes a plan holds]
``held_bytes`` is the most unsharded bytes the schedule holds at once, as
``overlap/demo/unsharded_peak.py`` counts them (from a gather's issue to its reshard). Forward
position 0 is the root's group: it is unsharded from its pre-forward to the end of backward, so it
is held at every point of the step, once. Forward at position ``j`` holds the root, the window
``j .. j + depth`` (the last ``1 + depth`` positions stay unsharded into backward: the window at
``n - 1 - depth`` is that set), and the groups gathered ahead for positions after ``j`` (not yet
used); a group that is both in a window and gathered ahead is one gather, held once. Backward at
``j`` holds no more than forward at ``j - depth`` (its window ``j - depth .. j`` and only the
groups gathered ahead above ``j``), and the end of backward holds the first ``1 + depth`` positions
and every group gathered ahead, which forward at position 1 also holds: so the peak is the most
over forward positions. ``budget`` bounds this peak, so it also bounds the bytes in flight at once
(``max_inflight_bytes``' meaning in the runtime), which are a part of it.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["held_bytes"]


def held_bytes(nbytes: Sequence[int], depth: int, count: int = 0) -> int:
    """Bytes of unsharded parameters held at most with prefetch ``depth`` and the first ``count``
    reduced groups (the last ``count`` forward positions) gathered ahead: see [Note: the bytes a
    plan holds]. ``nbytes[0]`` is the root's group, the first forward position."""
    n = len(nbytes)
    if n == 0:
        return 0
    ahead = range(max(1, n - count), n)  # the root (position 0) is counted once, below

    def held_at(j: int) -> int:  # forward at position j: its window, and what was gathered ahead for later
        window = range(max(1, j), min(n, j + 1 + depth))
        return sum(nbytes[k] for k in set(window).union(k for k in ahead if k >= j))

    return nbytes[0] + max(held_at(j) for j in range(n))
