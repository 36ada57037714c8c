"""Running the trial that verifies ``prefetch="auto"``'s choice on a sharded root's real steps.

Contract: :class:`ScheduleTrial` is driven by the root at the start of every forward
(:meth:`ScheduleTrial.at_forward_start`) and says which plan the starting step runs, until the trial
is over; then ``verdict`` holds the outcome. Plans and verdict are ``scheduler.schedule_trial``'s
([Note: verifying the choice by a trial]). Every rank of the root's groups must run the same steps:
the trial advances only on steps that ran a backward (a forward under ``no_grad`` between training
steps is not a trial step, and is not timed), and after each timed step the ranks agree the step's
trial position and seconds (``overlap.agreement.exchange``): a rank at another position is a
``DesyncError`` on every rank, and the step's time is the slowest rank's. The agreement is the
next collective of the group, issued at the start of the following forward; the clock of the next
step starts after it.
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
    started after the step whose backward count is ``backward_count``."""

    def __init__(self, infos: Sequence[Optional[GroupInfo]], rounds: int, settle: int, backward_count: int) -> None:
        self.steps = trial_steps(rounds, settle)
        self.infos = [info for info in infos if info is not None and info.size > 1]
        self.position = 0
        self.times: dict[str, list[float]] = {SIMPLE: [], CHOSEN: []}
        self.verdict: Optional[Verdict] = None
        self._backward_mark = backward_count
        self._start: Optional[float] = None

    def at_forward_start(self, backward_count: int) -> Optional[str]:
        """A forward starts (``backward_count``: the root's backward passes so far): close the step
        before it if it was a trial step, and return the plan this step runs (:data:`SIMPLE` or
        :data:`CHOSEN`); None once the trial is over (``verdict`` set)."""
        now = time.perf_counter()
        if self._start is not None and backward_count != self._backward_mark and self.position < len(self.steps):
            step = self.steps[self.position]
            if step.timed:
                self.times[step.plan].append(self._slowest(now - self._start))
                now = time.perf_counter()  # the agreement is not the next step's
            self.position += 1
        self._backward_mark, self._start = backward_count, now
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
