"""How many groups ahead to all-gather: the prefetch depth from measured costs and a byte budget.

Contract: pure functions of numbers (no torch, no process groups), so every rank computes the same
answer from the same inputs; the runtime (``overlap.shard``'s ``prefetch="auto"``) measures the
inputs and agrees the answer across ranks before using it.

Inputs, per group in the order compute needs them (the agreed forward order):

==============  ================================================================================
``compute``     seconds the compute stream spends on the group's forward: its compute and the host's
                packing (copy-in, copy-out) of its gather
``gather``      seconds its all-gather occupies the link: latency and transfer, not the packing
``backward``    seconds of the group's backward on the compute stream, measured in the first step's
                backward (optional: twice ``compute`` where no backward was measured)
``nbytes``      bytes its all-gather brings in (its unsharded size): what a prefetch holds;
                position 0 is the root's group, held the whole step
``budget``      bytes of unsharded parameters the schedule may hold at once (``held_bytes``: the
                root and forward's ``1 + depth`` window; [Note: the bytes a plan holds])
``loss``        host seconds between forward's end and backward's start (optional: 0)
``tail``        host seconds at the end of backward after its reduce-scatters landed (optional: 0)
``reduce``      seconds its reduce-scatter occupies the link (optional: ``gather``'s)
==============  ================================================================================

[Note: choosing the prefetch depth]
The link is a FIFO: a gather issued earlier than the link can start it waits in the queue, so depth
beyond what keeps the queue non-empty buys nothing and costs one group's unsharded size each. The
model replays one step from a cold start (``scheduler.replayed_step``, [Note: replaying a step on
a FIFO link], the model gather-ahead's choice replays too): forward issues at the start of group
``j`` the gathers of groups ``j+1 .. j+d``; the last group and the ``d`` before it stay unsharded
into backward (the runtime's [Note: kept for backward]: backward needs them first, and holding
them costs what re-gathering them ``d`` ahead would); backward re-gathers the rest the same way in
reverse, and each group's reduce-scatter (its ``reduce`` seconds) is queued when its
backward ends. The depth is the smallest ``d`` whose modelled step is within ``tolerance`` of the
best over every ``d`` the budget allows (the root's group with any group and the ``d`` after it,
together, within ``budget``: ``scheduler.held_bytes``), so ties go to the shallower, cheaper depth. Where the link is the bottleneck every
unit of depth saves one re-gather, so the budget alone caps the depth there. Depth 0 is never
chosen: one group ahead is always allowed (the runtime holds that much with ``prefetch=1`` too),
even past the budget.

[Note: what the step's costs are made of]
The first versions of this model took backward as twice forward and measured a group's gather as
the time from issue to unpacked (the host's packing, latency and transfer). On the demo (2 ranks,
emulated link) that made the step look link-bound when it was not: backward with the in-backward
optimizer step costs more than twice forward, and the host's packing runs on the compute side (the
host issues it between blocks), not on the link. So the runtime now measures, in its first step,
the packing (``compute`` gets it), the link's time (``gather``: the gather's whole interval less
its packing, [Note: a wait split by a stall] in ``scheduler/cost_samples.py``) and each group's
backward (``backward``: from its pre-backward to the next one's, less the time it waited for its
re-gather).
One sample per rank is noisy on a loaded host (seen: a 55 ms gather measured at 595 ms, a
backward at twice the other rank's), and noise only adds time: each rank takes each entry's least
over several recorded steps ([Note: robust step costs] in ``scheduler/cost_samples.py``), then the
ranks agree each entry's low median over ranks (the smaller of two) before choosing, so every rank
chooses from the same numbers.

[Note: the host work between the groups]
The per-group costs leave out host work that runs on no group's account, yet on the step's critical
path: the caller's loss between forward and backward (``loss``), and the end of backward after the
last reduce-scatters landed (``tail``): the last groups' epilogues and optimizer steps, which run
there before the next forward's first gathers can be issued. The model took both as 0. On the demo
at b8a9964 (2 ranks, quiet 2-core box, profiled) the end of backward ran 5-7 ms on the host between
the reduce-scatters' landing and the next forward's first gathers, on the step's critical path, and
the model was 19 ms (8%) below the measured step (226.7 vs 246.0 ms). The recording steps now
measure both (the loss from the end of forward to the first backward hook; the tail as the end of
backward's seconds less its wait for the reduce-scatters still in flight, which it waits for first),
they are combined over the recorded steps and ranks as the per-group costs are, and the replayed
step runs them in place (``scheduler.replayed_step``). What the model still leaves out, measured
beside it: the ranks' skew (a collective completes when the slowest rank issued it) and, on a host
whose cores the compute fills, the CPU a collective's transfer burns beside the compute (gloo on
CPU; ``benchmarks/bench_transfer_contention.py``).
"""
from __future__ import annotations

import math
from typing import AbstractSet, Optional, Sequence

from scheduler.held_bytes import held_bytes
from scheduler.replayed_step import step_ends

__all__ = ["choose_prefetch_depth", "modelled_step", "check_costs"]


def modelled_step(compute: Sequence[float], gather: Sequence[float], depth: int,
                  backward: Optional[Sequence[float]] = None, loss: float = 0.0, tail: float = 0.0,
                  reduce: Optional[Sequence[float]] = None,
                  backward_gathers: Optional[Sequence[bool]] = None) -> float:
    """Seconds of one step (forward and backward) at prefetch ``depth`` from a cold start, under the
    model of [Note: choosing the prefetch depth] (``scheduler.replayed_step``)."""
    ends = step_ends(compute, gather, depth, backward=backward, loss=loss, tail=tail, reduce=reduce,
                     backward_gathers=backward_gathers)
    return ends[0] if ends else 0.0


def check_costs(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int], entry: str,
                backward: Optional[Sequence[float]] = None, reduce: Optional[Sequence[float]] = None) -> None:
    """Refuse cost lists of different lengths (one entry per ``entry``) or times that are not finite
    seconds >= 0 (``ValueError``)."""
    if not (len(compute) == len(gather) == len(nbytes)):
        raise ValueError(f"compute, gather and nbytes must have one entry per {entry}, got lengths "
                         f"{len(compute)}, {len(gather)}, {len(nbytes)}")
    for name, values in (("backward", backward), ("reduce", reduce)):
        if values is not None and len(values) != len(compute):
            raise ValueError(f"{name} must have one entry per {entry} (or be None), got length {len(values)} "
                             f"for {len(compute)}")
    if any(not math.isfinite(x) or x < 0 for x in [*compute, *gather, *(backward or ()), *(reduce or ())]):
        raise ValueError("compute, gather, backward and reduce must be finite seconds >= 0")


def choose_prefetch_depth(compute: Sequence[float], gather: Sequence[float], nbytes: Sequence[int],
                          budget: int, tolerance: float = 0.01, backward: Optional[Sequence[float]] = None,
                          loss: float = 0.0, tail: float = 0.0,
                          enclosing: Optional[Sequence[AbstractSet[int]]] = None,
                          reduce: Optional[Sequence[float]] = None,
                          backward_gathers: Optional[Sequence[bool]] = None) -> int:
    """The prefetch depth for groups with these costs (see [Note: choosing the prefetch depth]): at
    least 1, at most ``len(compute) - 1`` (or 1 for fewer than two groups). ``enclosing``: nested
    groups, as ``scheduler.held_bytes.held_bytes`` takes them (None: one after the other);
    ``backward_gathers``: as ``scheduler.replayed_step.step_ends`` takes it."""
    check_costs(compute, gather, nbytes, "group", backward, reduce)
    if not (isinstance(budget, int) and budget >= 0):
        raise ValueError(f"budget must be an int >= 0 (bytes), got {budget!r}")
    allowed = [d for d in range(1, max(2, len(compute))) if d == 1 or held_bytes(nbytes, d, 0, enclosing) <= budget]
    times = {d: modelled_step(compute, gather, d, backward, loss, tail, reduce, backward_gathers) for d in allowed}
    best = min(times.values())
    return min(d for d, t in times.items() if t <= best * (1 + tolerance))
