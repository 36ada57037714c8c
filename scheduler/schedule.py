"""A recorded schedule: for each collective of a step, where it was issued and where it must wait.

A step is cut into *points*: the module hooks that ran in it, in order (a module's forward starting
or ending, its backward starting), plus the step's end. A :class:`Schedule` lists those points and,
for every collective issued in the step (in issue order), its signature (kind, group, shape, dtype),
the point after which it was issued, the op that used its result first, and the point at which a
replay waits for it: the last point before that first use, so the wait comes as late as module
boundaries allow. A result used before the next point after its issue is left to its own first-use
wait (``wait_point`` is ``None``); a result never used waits at the step's end.

Shapes (``n`` collectives, ``p`` points):

=================  ===================================================================
field              meaning
=================  ===================================================================
``points``         ``p`` tuples ``(phase, module name)``; phases below; the last is
                   ``("step_end", "")``
``collectives``    ``n`` :class:`ScheduledCollective`, in issue order
=================  ===================================================================

Phases: ``forward_pre`` (before a module's forward), ``forward_post`` (after it), ``backward_pre``
(the gradient of the module's output has arrived: its backward starts), ``step_end``.

Ranks agree on a schedule through :meth:`Schedule.signature` (what every rank must issue in the same
order: kinds, groups, shapes, dtypes) and :func:`first_difference`, which names the first collective
on which ranks differ.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Optional, Sequence

__all__ = ["Point", "OpRef", "ScheduledCollective", "Schedule", "first_difference", "PHASES"]

PHASES = ("forward_pre", "forward_post", "backward_pre", "step_end")

Point = tuple[str, str]  # (phase, module name)


@dataclasses.dataclass(frozen=True)
class OpRef:
    """One op of the recorded step: its index among the step's dispatched ops, its name, and the
    point after which it ran."""

    index: int
    name: str
    after_point: int  # index into Schedule.points; -1: before the first point


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the recorded step and where replays wait for it."""

    seq: int
    kind: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    issued: OpRef
    first_use: Optional[OpRef]  # None: never used in the step
    wait_point: Optional[int]  # the point at which replays wait; None: left to the first-use wait

    def signature(self) -> tuple:
        """What every rank must issue identically: kind, group, shape, dtype."""
        return (self.kind, self.group, self.shape, self.dtype)

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"#{self.seq} {self.kind}(group={self.group or '?'}, {shape}, {self.dtype})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The points and collectives of one recorded step (see the module docstring)."""

    points: tuple[Point, ...]
    collectives: tuple[ScheduledCollective, ...]
    ops: int  # ops dispatched in the recorded step
    point_ops: tuple[int, ...]  # ops dispatched before each point

    def signature(self) -> list[tuple]:
        """The collectives' signatures in issue order (what ranks compare)."""
        return [c.signature() for c in self.collectives]

    def digest(self) -> str:
        """A short stable hash of :meth:`signature`."""
        return hashlib.sha256(repr(self.signature()).encode()).hexdigest()[:16]

    @functools.cached_property
    def waits_at(self) -> dict[int, list[int]]:
        """Point index -> collective seqs a replay waits for there."""
        table: dict[int, list[int]] = {}
        for c in self.collectives:
            if c.wait_point is not None:
                table.setdefault(c.wait_point, []).append(c.seq)
        return table

    def point_name(self, index: int) -> str:
        """A point as text, e.g. ``forward_pre(layers.0)``."""
        if index < 0:
            return "step start"
        phase, module = self.points[index]
        return f"{phase}({module or '<root>'})" if phase != "step_end" else "step end"

    def __str__(self) -> str:
        header = ("#", "collective", "bytes", "issued after", "first use", "replay waits at")
        rows = []
        for c in self.collectives:
            use = "never used" if c.first_use is None else (
                f"op {c.first_use.index} {c.first_use.name} after {self.point_name(c.first_use.after_point)}")
            wait = "its first use" if c.wait_point is None else self.point_name(c.wait_point)
            rows.append((str(c.seq), c.describe().split(" ", 1)[1], str(c.nbytes),
                         f"op {c.issued.index} after {self.point_name(c.issued.after_point)}", use, wait))
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines = [f"Schedule {self.digest()}: {len(self.collectives)} collectives, {len(self.points)} points, "
                 f"{self.ops} ops"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]
        lines.insert(2, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def first_difference(signatures: Sequence[Sequence[tuple]]) -> Optional[tuple[int, list[str]]]:
    """Ranks' schedule signatures -> ``None`` if all equal, else the first differing collective
    index and, per rank, what that rank issued there."""
    longest = max((len(s) for s in signatures), default=0)
    for i in range(longest):
        entries = [tuple(s[i]) if i < len(s) else None for s in signatures]
        if any(e != entries[0] for e in entries):
            return i, [_describe_signature(i, e) for e in entries]
    return None


def _describe_signature(seq: int, entry: Optional[tuple]) -> str:
    if entry is None:
        return f"#{seq} nothing (the step ended)"
    kind, group, shape, dtype = entry
    return f"#{seq} {kind}(group={group or '?'}, {'x'.join(map(str, shape)) or 'scalar'}, {dtype})"
