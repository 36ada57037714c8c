"""Verifying a schedule choice by a timed trial: which plan each trial step runs, and the verdict.

Contract: pure functions and records of numbers (no torch, no process groups), so every rank computes
the same steps and the same verdict from the same (agreed) step times. The runtime
(``overlap/schedule_verification.py``, for ``overlap.shard``'s ``prefetch="auto"``) runs the steps,
times them, agrees each timed step's slowest-rank seconds and applies the verdict.

Plans: the *chosen* one (the depth and gather-ahead plan the model picked from the recorded costs)
and the *simple* one: prefetch depth 1, nothing gathered ahead or across the step boundary (FSDP2's
default schedule).

[Note: verifying the choice by a trial]
The choosers pick from a model of the step fed with measured costs ([Note: robust step costs] in
``scheduler/cost_samples.py``); the model can be wrong (host contention of deeper prefetch, an
effect it does not carry), and the rule is that a schedule choice never loses to the simple
schedule. So after choosing, the runtime runs both plans on the real steps and keeps the choice only
if it wins: :func:`trial_steps` alternates them, ``rounds`` times, each plan's timed step after
``settle`` untimed steps of the same plan, because a plan with gathers issued across the step
boundary hands its gathers to the next step (a timed simple step right after a chosen one would get
them free; a timed chosen step right after a simple one would start cold). The rounds end on the
chosen plan, so a kept choice runs on with no cold step. A step is timed from one forward's start to
the next's (the optimizer step and the user's loop between are the step's too) and its time is the
slowest rank's (agreed, the maximum). :func:`decide` compares each plan's least timed step (noise on
a shared host only adds time: the least of a few is the least disturbed, as for the costs) and keeps
the choice only if it is faster than the simple plan by more than ``margin``; a tie or a loss falls
back to the simple plan. The trial costs ``rounds * 2 * (1 + settle)`` steps, half of them on the
simple plan, once per run.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

__all__ = ["CHOSEN", "SIMPLE", "TRIAL_ROUNDS", "WIN_MARGIN", "Plan", "ScheduleDecision", "TrialStep", "Verdict", "decide",
           "describe", "trial_steps"]

SIMPLE = "simple"
CHOSEN = "chosen"
TRIAL_ROUNDS = 3
"""Timed steps per plan in the trial (0: no trial, the model's choice is kept unverified)."""
WIN_MARGIN = 0.02
"""The chosen plan is kept only if its step is at least this share faster than the simple plan's."""


@dataclasses.dataclass(frozen=True)
class TrialStep:
    """One step of the trial: the plan it runs (:data:`SIMPLE` or :data:`CHOSEN`) and whether it is timed."""

    plan: str
    timed: bool


def trial_steps(rounds: int, settle: int) -> list[TrialStep]:
    """The trial's steps in order: ``rounds`` rounds of the simple plan then the chosen one, each
    ``settle`` untimed steps then one timed (see [Note: verifying the choice by a trial])."""
    for name, value in (("rounds", rounds), ("settle", settle)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    steps: list[TrialStep] = []
    for _ in range(rounds):
        for plan in (SIMPLE, CHOSEN):
            steps += [TrialStep(plan, False)] * settle + [TrialStep(plan, True)]
    return steps


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The trial's outcome: ``keep`` the chosen plan or not, and each plan's least timed step
    (seconds, slowest rank) over ``samples`` timed steps each."""

    keep: bool
    chosen_s: float
    simple_s: float
    samples: int


def decide(chosen: Sequence[float], simple: Sequence[float], margin: Optional[float] = None) -> Verdict:
    """Keep the chosen plan only if its least step beats the simple plan's by more than ``margin``
    (a share, >= 0; None: :data:`WIN_MARGIN`). Raises ``ValueError`` for an empty side, a time that is not finite seconds >= 0,
    or a bad margin."""
    if not chosen or not simple:
        raise ValueError(f"each plan needs at least one timed step, got {len(chosen)} chosen and {len(simple)} simple")
    if any(not (0 <= t < float("inf")) for t in (*chosen, *simple)):
        raise ValueError("step times must be finite seconds >= 0")
    margin = WIN_MARGIN if margin is None else margin
    if not (0 <= margin < 1):
        raise ValueError(f"margin must be a share in [0, 1), got {margin!r}")
    best_chosen, best_simple = min(chosen), min(simple)
    return Verdict(best_chosen < best_simple * (1 - margin), best_chosen, best_simple, min(len(chosen), len(simple)))


Plan = tuple[int, Optional[tuple[int, int]]]
"""``(prefetch depth, gather-ahead (count, lag) or None)``."""


@dataclasses.dataclass(frozen=True)
class ScheduleDecision:
    """What ``prefetch="auto"`` runs after choosing, and why: ``plan`` (what runs from now on),
    ``modelled`` (the model's choice) and its modelled seconds per step against the simple plan's,
    and the trial's ``verdict`` (None where no trial ran: ``reason`` says why)."""

    plan: Plan
    modelled: Plan
    modelled_s: float
    modelled_simple_s: float
    verdict: Optional[Verdict]
    reason: str

    def __str__(self) -> str:
        return f"{describe(self.plan)}: {self.reason}"


def describe(plan: Plan) -> str:
    """``plan`` in words: ``depth 3, gather-ahead (1, 2)``."""
    depth, ahead = plan
    return f"depth {depth}, " + (f"gather-ahead {ahead}" if ahead is not None else "nothing ahead")
