"""The floor of an exact sharded step: the least seconds per step any schedule of these groups reaches.

Contract: a pure function of numbers (no torch, no process groups). Inputs, per forward position
(the agreed forward order; one group per position), as the schedule choosers take them
(``scheduler.replayed_step``): ``compute`` (a position's forward on the compute side), ``gather`` (its
all-gather's seconds on the link), ``reduce`` (its reduce-scatter's; None: ``gather``), ``backward`` (None:
twice ``compute``), ``loss`` and ``tail`` (the host's seconds between forward and backward, and at the
end of backward), and ``step``: seconds of each group's optimizer math where it runs on the compute
side inside the step (an optimizer stepped in backward), already part of ``backward`` and ``tail``
(None: none).

[Note: the end-of-step chain's floor]
Every schedule that keeps the step's math (the plain loop's, bitwise) on one link that carries one
collective at a time is bound by two things. The link must carry every group's gather and
reduce-scatter once: ``link = sum(gather) + sum(reduce)``. And the first groups of forward are reduced last:
for a position ``p``, from the moment its backward ends (``t0``) to the moment its next forward
starts (``t1``), the link must carry the reduce-scatters of positions ``0 .. p`` (none can start
before ``t0``: theirs end after ``p``'s), then their next-step gathers (each after its group's
step, so after its reduce-scatter; each before ``p``'s forward). The compute side can fill that
window only with the backward of positions ``0 .. p - 1``, the ``tail``, the next forward of
positions ``0 .. p - 1``, and the optimizer steps of positions after ``p`` moved there (the
deferred steps; those of ``0 .. p`` already run there, inside the backward and tail counted).
Whatever the window's link work exceeds that by, the compute side waits: ``exposed`` is the most
over ``p``. Over ``K`` consecutive steps the windows of steps ``1 .. K - 2`` lie whole between the
first and the last step's end, so ``K - 1`` steps take at least ``(K - 1) * compute + (K - 2) *
exposed`` (property-tested against ``scheduler.replayed_step``), and a steady step at least
``compute + exposed``. The floor is the larger of that and ``link``.

It is a floor for the runtime's schedules and any other that keeps autograd's backward order and
the math: depth, gathers ahead, deferred steps, bucketing of those groups all stay above it. What
goes below it changes one of the premises: fewer bytes in the chain (compressed collectives, a
first group of fewer parameters), collectives that overlap each other on the wire, or a backward
reordered so the chain's weight gradients come earlier (zero-bubble's split of the input and
weight gradients). On the demo's small model at comm ~ compute the chain is the root, the
embedding and the first block: about 36 ms of link beside 10-15 ms of host work (docs/DESIGN.md,
"the end-of-step chain").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

__all__ = ["StepFloor", "step_floor"]


@dataclasses.dataclass(frozen=True)
class StepFloor:
    """What bounds an exact step from below (see [Note: the end-of-step chain's floor]); seconds."""

    seconds: float
    """The floor: ``max(link, compute + exposed)``."""
    compute: float
    """The compute side's seconds per step: forward, loss, backward and tail."""
    link: float
    """The link's seconds per step: every gather and reduce-scatter once (no re-gathers)."""
    exposed: float
    """The binding chain's link time that the compute side cannot fill (>= 0)."""
    chain: int
    """How many first positions make the binding chain (0 where none leaves anything exposed)."""
    chain_link: float
    """The binding chain's link seconds: its reduce-scatters and next-step gathers."""
    chain_host: float
    """The compute side's seconds that can run beside the binding chain."""

    def ratio(self) -> float:
        """The floor over ``max(compute, link)``: the least step / ideal any exact schedule reaches
        (1.0 for an empty step)."""
        ideal = max(self.compute, self.link)
        return self.seconds / ideal if ideal > 0 else 1.0


def step_floor(compute: Sequence[float], gather: Sequence[float], backward: Optional[Sequence[float]] = None,
               loss: float = 0.0, tail: float = 0.0, step: Optional[Sequence[float]] = None,
               reduce: Optional[Sequence[float]] = None) -> StepFloor:
    """The floor of an exact step from per-position costs (see [Note: the end-of-step chain's floor]).
    Raises ``ValueError`` for lists of different lengths or times that are not finite seconds >= 0."""
    n = len(compute)
    for name, values in (("gather", gather), ("reduce", reduce), ("backward", backward), ("step", step)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} must have one entry per forward position ({n}), got {len(values)}")
    back = list(backward) if backward is not None else [2 * c for c in compute]
    steps = list(step) if step is not None else [0.0] * n
    reduces = list(reduce) if reduce is not None else list(gather)
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
           for x in [*compute, *gather, *reduces, *back, *steps, loss, tail]):
        raise ValueError("compute, gather, reduce, backward, step, loss and tail must be finite seconds >= 0")
    compute_s = sum(compute) + sum(back) + loss + tail
    link_s = sum(gather) + sum(reduces)
    exposed, chain, chain_link, chain_host = 0.0, 0, 0.0, 0.0
    for p in range(n):
        window_link = sum(gather[: p + 1]) + sum(reduces[: p + 1])
        window_host = sum(back[:p]) + sum(compute[:p]) + tail + sum(steps[p + 1:])
        if window_link - window_host > exposed:
            exposed, chain, chain_link, chain_host = window_link - window_host, p + 1, window_link, window_host
    return StepFloor(max(link_s, compute_s + exposed), compute_s, link_s, exposed, chain, chain_link, chain_host)
