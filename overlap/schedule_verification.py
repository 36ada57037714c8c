"""Running the trial that verifies ``prefetch="auto"``'s choice on a sharded root's real steps.

Contract: :class:`ScheduleTrial` is driven by the root at the start of every forward
(:meth:`ScheduleTrial.at_forward_start`) and says which plan the starting step runs, until the trial
is over; then ``verdict`` holds the outcome. Plans and verdict are ``scheduler.schedule_trial``'s
([Note: verifying the choice by a trial]). Every rank of the root's groups must run the same steps,
and after each timed step the ranks agree the step's trial position and seconds
(``overlap.agreement.exchange``): a rank at another position is a ``DesyncError`` on every rank, and
the step's time is the slowest rank's. The agreement is the next collective of the group, issued at
the start of the following forward; the clock of the next step starts after it.

[Note: what a trial step is]
A trial step is a training step: it ends at the first forward after a backward that reduced
gradients (one not entirely under ``no_sync``), and it starts at the first forward after the step
before it ended. So the micro-batches of gradient accumulation (``no_sync`` backwards, then one that
reduces) are one trial step, timed whole, and both plans are timed over the same phase of the
cycle: timed per backward, a cycle of two micro-batches would time one plan always on the reducing
micro-batch and the other never, and the verdict would compare the two phases instead of the
plans. A trial chosen in the middle of a cycle (its costs recorded on a ``no_sync`` micro-batch)
starts with the next cycle; the rest of the cycle runs the simple plan, untimed. Forwards before a
step's first backward (an evaluation under ``no_grad`` between training steps) are not the step's:
its clock restarts at each of them. A loop that never reduces (only ``no_sync`` backwards) never
ends a trial step, and runs the simple plan.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from overlap import agreement, desync
from overlap.groups import GroupInfo
from scheduler.schedule_trial import CHOSEN, SIMPLE, Verdict, decide, trial_steps

__all__ = ["ScheduleTrial"]


class ScheduleTrial:
    """The trial's steps (``rounds`` per plan, ``settle`` untimed steps before each timed one) on the
    ranks of ``infos`` (the shard group, and the replicas' with HSDP; groups of one rank are skipped),
    started after the step whose backward passes so far are ``backward_count``, ``synced_count`` of
    them reducing gradients, the last of them one that reduced unless ``mid_cycle`` ([Note: what a
    trial step is])."""

    def __init__(self, infos: Sequence[Optional[GroupInfo]], rounds: int, settle: int, backward_count: int,
                 synced_count: int, mid_cycle: bool = False) -> None:
        self.steps = trial_steps(rounds, settle)
        self.infos = [info for info in infos if info is not None and info.size > 1]
        self.position = 0
        self.times: dict[str, list[float]] = {SIMPLE: [], CHOSEN: []}
        self.verdict: Optional[Verdict] = None
        self._backward_mark, self._synced_mark = backward_count, synced_count
        self._start: Optional[float] = None
        self._mid_cycle = mid_cycle

    def at_forward_start(self, backward_count: int, synced_count: int) -> Optional[str]:
        """A forward starts (``backward_count``: the root's backward passes so far, ``synced_count`` of
        them reducing gradients): close the trial step before it if that step's reducing backward ran
        ([Note: what a trial step is]), and return the plan this forward runs (:data:`SIMPLE` or
        :data:`CHOSEN`); None once the trial is over (``verdict`` set)."""
        now = time.perf_counter()
        if self._start is None:  # the first step starts here, or with the next cycle
            if not self._mid_cycle or synced_count != self._synced_mark:
                self._start, self._mid_cycle = now, False
        elif synced_count != self._synced_mark and self.position < len(self.steps):
            step = self.steps[self.position]
            if step.timed:
                self.times[step.plan].append(self._slowest(now - self._start))
                now = time.perf_counter()  # the agreement is not the next step's
            self.position += 1
            self._start = now
        elif backward_count == self._backward_mark:
            self._start = now  # no backward since the step's clock started: its training starts here
        self._backward_mark, self._synced_mark = backward_count, synced_count
        if self.position < len(self.steps):
            return self.steps[self.position].plan
        if self.verdict is None:
            self.verdict = decide(self.times[CHOSEN], self.times[SIMPLE])
        return None

    def _slowest(self, seconds: float) -> float:
        """This timed step's seconds on the slowest rank, agreed with the trial position."""
        for info in self.infos:
            seen = agreement.exchange(info, "schedule trial step", (self.position, seconds))
            if any(position != self.position for position, _ in seen):
                described = "; ".join(f"rank {info.global_rank(r)}: step {p}" for r, (p, _) in enumerate(seen))
                raise desync.DesyncError(
                    f"overlap.shard: ranks are at different steps of prefetch='auto''s schedule trial ({described}); "
                    f"every rank must run the same training steps", -1, info.pg.group_name)
            seconds = max(s for _, s in seen)
        return seconds
