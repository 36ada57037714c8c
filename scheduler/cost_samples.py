"""One rank's step costs from several measured steps: the least-disturbed sample of each entry.

Contract: a pure function of numbers (no torch, no process groups). The runtime (``overlap.shard``'s
``prefetch="auto"``) records the costs of :data:`COST_SAMPLES` steps, combines them here, then
agrees the result across ranks (the low median per entry) before the schedule choosers see it.

Input: one table per recorded step, all recorded on the same forward order; each table holds one
row per forward position, each row the same number of entries (seconds). An entry below 0 means
"not measured" in that step (a backward that did not run); it is left out of that entry's samples,
and an entry no step measured stays at the first table's value.

[Note: robust step costs]
The schedule choosers used to see the costs of ONE step: on a loaded box a gather of 55 ms was
measured once at 595 ms, and a backward at twice the other rank's, which moves the chosen depth and
gather-ahead plan for the rest of the run. Now the first :data:`COST_SAMPLES` steps all record
(each gathers and waits at once, nothing prefetched) and each entry (a position's compute, link
wait, packing, backward) is the smallest of its samples. The minimum, not the median, because the
noise of a shared host only ever adds time (a descheduled process, another job's burst, a first
use's one-time costs such as the allocator's growth and lazy initialisation, all in step 1): the
least-disturbed sample is the best estimate of what the schedule will pay, it drops up to ``k - 1``
spikes of one entry where the median of ``k`` drops fewer than ``k / 2``, and per entry (not the
whole fastest step) because spikes hit entries of different steps. Three samples: two would drop
one spike; the third covers step 1's one-time costs landing on the same entry as a spike, at one
more unprefetched step. The ranks then agree each entry's low median over ranks as before ([Note:
what the step's costs are made of] in ``scheduler/prefetch_depth.py``). A model built on the
least-disturbed costs can be optimistic about a plan that is sensitive to load; the timed trial
that follows the choice ([Note: verifying the choice by a trial] in ``scheduler/schedule_trial.py``)
is what guards against a plan that loses on the real steps.

[Note: a wait split by a stall]
"Noise only adds time" holds for an interval, not for the two parts of one: a gather's packing is
timed from its pre-forward to the issue's return, its link wait from there to its landing, and a
stall of the host right after the collective was booked on the link (the issue's return delayed by
a descheduled process) moves the link's time into the packing: the link keeps running during the
stall, so the wait after it is short or 0. The least of each part over the samples then combines a
short wait from a stalled step with the packing of an unstalled one, and the low median over ranks
compounds it. On the demo at load 8-15 (2 ranks, link 0.09-0.7 Gbit/s) the agreed link times of the
blocks' gathers came out at 5.6-13.7 ms where the link takes 18.0 (at 0.7 Gbit/s), 29.3-39.7 for 44.0
(at 0.287; the head 2.2 for 14.6), 114.0-135.3 for 141.3 (at 0.0894; the root 0 for 6.0), and once 0
for blocks.0's 65.8 (at 0.192). So the runtime records each gather's whole interval (packing and
wait, ``gather``) and its packing, takes the least of each as for any entry, and the link time is
their difference (>= 0): both are whole intervals, to which noise only adds. From the same samples
that gives 17.8-19.5, 43.9-44.4 (head 14.6), 141.2-141.6 (root 5.9) ms.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["COST_SAMPLES", "least_disturbed"]

COST_SAMPLES = 3
"""Steps whose costs are recorded before the schedule is chosen (see [Note: robust step costs])."""


def least_disturbed(samples: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Per entry, the smallest measured (>= 0) value over ``samples`` (tables of the same shape,
    ``[step][position][entry]``); an entry measured in no sample keeps the first table's value.
    Raises ``ValueError`` for no samples or tables of different shapes."""
    if not samples:
        raise ValueError("samples must hold at least one table of costs, got none")
    first = samples[0]
    shape = [len(row) for row in first]
    for i, table in enumerate(samples):
        if [len(row) for row in table] != shape:
            raise ValueError(f"samples must all have the shape of the first (rows of {shape} entries); "
                             f"sample {i} has rows of {[len(row) for row in table]}")
    out: list[list[float]] = []
    for p, row in enumerate(first):
        out.append([min((t[p][k] for t in samples if t[p][k] >= 0), default=row[k]) for k in range(len(row))])
    return out
