"""The most unsharded bytes a prefetch schedule holds at once, from its depth and its gathers ahead.

Contract: pure functions of numbers (no torch, no process groups); both schedule choosers bound
``held_bytes`` by their byte budget (``scheduler.prefetch_depth`` with nothing gathered ahead,
``scheduler.gather_ahead`` with its plans), and ``overlap/demo/unsharded_peak.py`` evaluates it on
a sharded model beside the peak it counts. ``enclosing_positions`` reads the nesting of groups off
the order of their pre- and post-forwards.

[Note: the bytes a plan holds]
``held_bytes`` is the most unsharded bytes the schedule holds at once, as
``overlap/demo/unsharded_peak.py`` counts them (from a gather's issue to its reshard). Forward
position 0 is the root's group: it is unsharded from its pre-forward to the end of backward, so it
is held at every point of the step, once. Forward at position ``j`` holds the root, the window
``j .. j + depth`` (the last ``1 + depth`` positions stay unsharded into backward: the window at
``n - 1 - depth`` is that set), the groups gathered ahead for positions after ``j`` (not yet
used), and the groups whose forward runs around ``j``'s (``enclosing[j]``: a block sharded with its
MLP as a group of its own holds its own group until its forward ends, after the MLP's); a group in
two of those sets is one gather, held once. Backward at ``j`` holds its window ``j - depth .. j``,
the groups gathered ahead above ``j`` and ``enclosing[j]`` again (a block's backward starts before
its MLP's and ends after it); without nesting that is never more than forward at ``j - depth``.
The end of backward holds the first ``1 + depth`` positions and every group gathered ahead, which
forward at position 1 also holds. So the peak is the most over forward and backward positions.
``budget`` bounds this peak, so it also bounds the bytes in flight at once (``max_inflight_bytes``'
meaning in the runtime), which are a part of it. Checked against the counted peak on flat and
nested models (``tests/tools/test_unsharded_peak.py``); without ``enclosing`` a nested model's peak
is undercounted by the enclosing groups (78520 against 91320 bytes on one there).
"""
from __future__ import annotations

from typing import AbstractSet, Optional, Sequence

__all__ = ["held_bytes", "enclosing_positions"]


def enclosing_positions(forward_seq: Sequence[int], post_forward_seq: Sequence[int],
                        root: Optional[int] = None) -> list[frozenset[int]]:
    """Per forward position, the positions whose forward runs around its own: entered before it
    (``forward_seq``, the groups' pre-forward order) and left after it (``post_forward_seq``, their
    post-forward order). ``root`` (a group index, held the whole step anyway) is left out. Each
    group appears once in each sequence; ``ValueError`` otherwise."""
    if len(set(forward_seq)) != len(forward_seq) or sorted(forward_seq) != sorted(post_forward_seq):
        raise ValueError("forward_seq and post_forward_seq must hold the same groups, each once, got "
                         f"{list(forward_seq)} and {list(post_forward_seq)}")
    left = {index: k for k, index in enumerate(post_forward_seq)}
    return [frozenset(p for p in range(q) if forward_seq[p] != root and left[forward_seq[p]] > left[index])
            for q, index in enumerate(forward_seq)]


def held_bytes(nbytes: Sequence[int], depth: int, count: int = 0,
               enclosing: Optional[Sequence[AbstractSet[int]]] = None) -> int:
    """Bytes of unsharded parameters held at most with prefetch ``depth`` and the first ``count``
    reduced groups (the last ``count`` forward positions) gathered ahead: see [Note: the bytes a
    plan holds]. ``nbytes[0]`` is the root's group, the first forward position. ``enclosing``: per
    position, the positions whose forward runs around it (:func:`enclosing_positions`); None for
    groups that run one after the other."""
    n = len(nbytes)
    if n == 0:
        return 0
    if enclosing is not None and len(enclosing) != n:
        raise ValueError(f"enclosing must have one entry per position ({n}), got {len(enclosing)}")
    ahead = range(max(1, n - count), n)  # the root (position 0) is counted once, below
    around = [frozenset()] * n if enclosing is None else enclosing

    def held(window: range, after: int, j: int) -> int:
        return sum(nbytes[k] for k in set(window).union(k for k in ahead if k > after).union(around[j]) if k)

    forward = max(held(range(max(1, j), min(n, j + 1 + depth)), j - 1, j) for j in range(n))
    backward = max((held(range(max(1, j - depth), j + 1), j, j) for j in range(1, n)), default=0)
    return nbytes[0] + max(forward, backward)
