"""A run's held-out loss against exact's over several seeds: the mean difference, its spread, and the
verdicts on issue 30's goal and against the noise floor ([Note: the noise floor of the client runs]
in ``compressed_training.py``). Used by ``benchmarks/train_compressed_clients.py --seeds``."""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

__all__ = ["GOAL", "Spread", "floor_verdict", "goal_verdict", "spread"]

GOAL = 0.01
"""Issue 30: the compressed run's loss within 1% of exact's."""


@dataclasses.dataclass(frozen=True)
class Spread:
    """Relative differences from exact over ``n`` seeds: ``mean``, its standard error ``sem`` (the
    sample standard deviation over sqrt(n)), ``rms`` (root mean square: how far one seed lands, bias
    and noise together) and ``largest`` (the largest magnitude)."""

    n: int
    mean: float
    sem: float
    rms: float
    largest: float


def spread(diffs: Sequence[float]) -> Spread:
    """The :class:`Spread` of ``diffs`` (at least two finite values: one seed has no spread)."""
    diffs = [float(d) for d in diffs]
    if len(diffs) < 2 or not all(math.isfinite(d) for d in diffs):
        raise ValueError(f"diffs must hold at least two finite values, got {diffs!r}")
    n = len(diffs)
    return Spread(n, statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(n),
                  math.sqrt(sum(d * d for d in diffs) / n), max(abs(d) for d in diffs))


def goal_verdict(run: Spread, goal: float = GOAL) -> str:
    """Is the mean difference within ``goal``? ``"yes"`` when the mean plus two standard errors is,
    ``"no"`` when the mean less two standard errors is not, else ``"undecided"``: these seeds cannot
    tell (more seeds shrink the standard error by their square root)."""
    if abs(run.mean) + 2 * run.sem <= goal:
        return "yes"
    if abs(run.mean) - 2 * run.sem > goal:
        return "no"
    return "undecided"


def floor_verdict(run: Spread, floor: Spread) -> str:
    """``run``'s RMS difference against the floor's: ``"inside"`` when not larger, else how many times."""
    if run.rms <= floor.rms:
        return "inside"
    if floor.rms == 0:
        return "outside (the floor is 0)"
    return f"outside ({run.rms / floor.rms:.1f}x)"
