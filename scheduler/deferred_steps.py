"""Deferred optimizer steps: which groups' in-backward optimizer math to move into the end-of-step chain.

Contract: pure functions of numbers (no torch, no process groups), so every rank computes the same
answer from the same inputs; the runtime (``overlap.shard`` with ``prefetch="auto"``, an optimizer
stepped in backward and gather-ahead on) measures the inputs in the steps that record costs, agrees them across
ranks, and applies the answer ([Note: deferred optimizer steps] in ``overlap/sharding.py``).

Inputs, per forward position (the agreed forward order; one group per position):

==============  ================================================================================
``compute``     seconds of the position's forward on the compute side (with its gather's packing)
``gather``      seconds its all-gather occupies the link
``reduce``      seconds its reduce-scatter occupies the link (None: ``gather``'s)
``backward``    seconds of the position's backward (None: twice ``compute``)
``step``        seconds of its optimizer math (the group's in-backward step, measured on the host)
``first``       the chain's positions: ``0 .. first - 1``, the next forward's first groups, which
                the end of backward gathers (``prefetch_next_step``: ``1 + depth`` groups)
``candidates``  positions whose step may be deferred, in the order to defer them (the latest the
                next forward needs first); never a chain position or a group gathered ahead
==============  ================================================================================

[Note: filling the end-of-step chain]
The first groups of forward are reduced last, so a step ends with a chain on the link: their
reduce-scatters, then (after their steps) the next forward's gathers of the same groups:
``sum(reduce[:first]) + sum(gather[:first])``. Beside it the host has only the backward of the chain's groups
after the first of them is reduced (``backward[:first - 1]``; the first one's backward comes
before its reduce-scatter), their steps, and the next forward of the chain's groups before the
last (``compute[:first - 1]``). The rest is the chain's slack: link time the host cannot fill. Every
other group's optimizer step ran in backward right after its reduce-scatter, where the host is the
compute side; moved into the chain it runs where the host would otherwise wait. The candidates are
taken in order while their summed step seconds fit in the slack; more would only move host work
from where the link has room to where it has none. No slack, no candidate: nothing is deferred, the
schedule without deferral. The model leaves out what is still on the link when the chain starts
(earlier reduce-scatters), which only makes the slack larger, so it errs towards deferring less.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["chain_slack", "choose_deferred_steps"]


def chain_slack(compute: Sequence[float], gather: Sequence[float], step: Sequence[float], first: int,
                backward: Optional[Sequence[float]] = None, reduce: Optional[Sequence[float]] = None) -> float:
    """Seconds of the end-of-step chain's link time the host work beside it leaves unfilled (>= 0;
    see [Note: filling the end-of-step chain])."""
    _check(compute, gather, step, backward, reduce)
    n = len(compute)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= n:
        raise ValueError(f"first must be an int in 0..{n} (forward positions), got {first!r}")
    if first == 0:
        return 0.0
    back = backward if backward is not None else [2 * c for c in compute]
    link = sum(gather[:first]) + sum((gather if reduce is None else reduce)[:first])
    host = sum(back[: first - 1]) + sum(step[:first]) + sum(compute[: first - 1])
    return max(0.0, link - host)


def choose_deferred_steps(compute: Sequence[float], gather: Sequence[float], step: Sequence[float], first: int,
                          candidates: Sequence[int], backward: Optional[Sequence[float]] = None,
                          reduce: Optional[Sequence[float]] = None) -> list[int]:
    """The longest prefix of ``candidates`` whose steps' summed seconds fit in the chain's slack
    (``chain_slack``); ``[]`` where nothing fits."""
    slack = chain_slack(compute, gather, step, first, backward, reduce)
    n = len(compute)
    if any(isinstance(p, bool) or not isinstance(p, int) or not first <= p < n for p in candidates) \
            or len(set(candidates)) != len(candidates):
        raise ValueError(f"candidates must be distinct positions in {first}..{n - 1} (after the chain), "
                         f"got {list(candidates)!r}")
    chosen: list[int] = []
    used = 0.0
    for position in candidates:
        if used + step[position] > slack:
            break
        used += step[position]
        chosen.append(position)
    return chosen


def _check(compute: Sequence[float], gather: Sequence[float], step: Sequence[float],
           backward: Optional[Sequence[float]], reduce: Optional[Sequence[float]] = None) -> None:
    n = len(compute)
    if len(gather) != n or len(step) != n or any(v is not None and len(v) != n for v in (backward, reduce)):
        raise ValueError(f"compute, gather, step (and backward, reduce) must have one entry per forward position, "
                         f"got lengths {n}, {len(gather)}, {len(step)}"
                         + "".join(f", {name} {len(v)}" for name, v in (("backward", backward), ("reduce", reduce))
                                   if v is not None))
    if any(not math.isfinite(x) or x < 0 for x in [*compute, *gather, *step, *(backward or ()), *(reduce or ())]):
        raise ValueError("compute, gather, step, backward and reduce must be finite seconds >= 0")
