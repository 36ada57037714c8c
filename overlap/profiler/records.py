"""The profiler's data: what each rank recorded, as plain records, and the arithmetic of exposed time.

Contract: frozen dataclasses of plain values, picklable (``Profiler.gather`` sends them between
ranks, ``merge`` combines them), built by ``overlap.profiler.recorder`` and read by
``overlap.profiler.report`` / ``export``. Times are seconds since the recording rank's profile
started, on that rank's host clock; ``RankProfile.epoch`` puts ranks on one timeline. Nothing here
records, prints or writes.

Definitions. A *stall* is the interval of a first wait (CPU: the host blocked in ``wait`` /
``synchronize``; CUDA: the waiting stream idle until the collective's end). A collective's
*exposed* time is the part of its ``[start, end]`` during which this rank was stalled on any wait;
the rest is *hidden*. *Efficiency* (:func:`hidden_fraction`) = hidden / communication time, 1.0
where there was no communication time. It is not ``overlap.testing.PairedTimes.hidden_share``, which
compares a step timed with and without the emulated link's delay and divides by the part of the
communication that compute could have hidden. *Bandwidth* is the algorithm bandwidth ``bytes / (end
- start)`` (``bytes``: the gathered output, or the reduce-scattered input), as nccl-tests report
``algbw``.

Intervals: :func:`union` merges ``(start, end)`` pairs into sorted, disjoint ones; :func:`covered`
and :func:`covered_pieces` measure and list the part of ``[a, b]`` such a union covers.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Iterable, Optional, Sequence

__all__ = ["CollectiveRecord", "IDLE_CAUSES", "IdlePiece", "RankProfile", "StepRecord", "covered", "covered_pieces",
           "hidden_fraction", "link_idle", "link_idle_pieces", "union"]


def hidden_fraction(comm: float, exposed: float) -> float:
    """Efficiency: the hidden share of ``comm`` communication time of which ``exposed`` was exposed,
    0..1 (1.0 when ``comm`` is 0)."""
    return max(0.0, comm - exposed) / comm if comm > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank saw it. Times: seconds since that rank's profile started."""

    rank: int
    step: int
    kind: str
    nbytes: int
    group: str
    label: str
    """``/``-joined ``overlap::...`` (or user) region path it was issued in; ``""`` outside any."""
    issued: float
    start: float
    end: float
    end_measured: bool
    """True when ``end`` comes from a completion signal, False when estimated (see ``overlap.profiler.recorder``)."""
    wait_start: Optional[float]
    wait_end: Optional[float]
    wait_label: str
    exposed: float
    """Seconds of ``[start, end]`` during which this rank was stalled on a wait."""
    module: str = ""
    """The sharded module whose parameters or gradients it carries (its fqn; ``"root"``), ``""`` for
    a collective of no sharded module (the public ``overlap.*`` collectives). Not the module named
    in ``label``: a prefetch is issued in the region of the module running then."""

    @property
    def what(self) -> str:
        """``kind``, followed by ``module`` when there is one (``"all_gather blocks.1"``)."""
        return f"{self.kind} {self.module}" if self.module else self.kind

    @property
    def duration(self) -> float:
        """Communication time, seconds."""
        return self.end - self.start

    @property
    def hidden(self) -> float:
        return max(0.0, self.duration - self.exposed)

    @property
    def efficiency(self) -> float:
        """Hidden share of the communication time, 0..1 (1.0 for a zero-length collective)."""
        return hidden_fraction(self.duration, self.exposed)

    @property
    def waited(self) -> Optional[float]:
        """How long the first wait took (None: never waited)."""
        if self.wait_start is None or self.wait_end is None:
            return None
        return self.wait_end - self.wait_start

    @property
    def compute(self) -> Optional[float]:
        """Host time between issue and the first wait: the compute the collective could hide behind."""
        return None if self.wait_start is None else self.wait_start - self.issued

    @property
    def gbps(self) -> float:
        """Algorithm bandwidth, GB/s (``1e9`` bytes); 0.0 for a zero-length collective."""
        return self.nbytes / self.duration / 1e9 if self.duration > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step (between ``prof.step()`` calls) of one rank; seconds since the profile started."""

    rank: int
    step: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class RankProfile:
    """Everything one rank recorded: plain, picklable data (``gather`` / ``merge`` move it)."""

    rank: int
    world_size: int
    epoch: float
    """``time.time()`` when the profile started: aligns ranks on one timeline."""
    device: str
    steps: tuple[StepRecord, ...]
    """The reported steps: every step but the first ``warmup_steps``."""
    collectives: tuple[CollectiveRecord, ...]
    """Every collective recorded, the warm-up steps' included: one issued in a warm-up step may be on
    the link in the first reported one (a gather issued at the end of a step), which the idle-link
    report must see ([Note: warm-up steps of a profile])."""
    warmup_steps: int = 0
    """Steps recorded before the reported ones (``overlap.profile(warmup=...)``), left out of
    ``steps`` and of every figure a report gives."""

    @property
    def reported_collectives(self) -> tuple[CollectiveRecord, ...]:
        """The collectives issued in the reported steps (not in a warm-up step)."""
        if not self.warmup_steps:
            return self.collectives
        return tuple(c for c in self.collectives if c.step >= self.warmup_steps)

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """This rank's stall intervals (first waits), merged and sorted."""
        return union((c.wait_start, c.wait_end) for c in self.collectives
                     if c.wait_start is not None and c.wait_end is not None)


# -------------------------------------------------------------------------------------- idle link
IDLE_CAUSES = ("nothing issued yet", "waiting on the byte budget", "waiting on gradients",
               "next step's gathers not issued yet")
"""The causes :func:`link_idle` names, in the order reports list them."""

BUDGET_LABEL = "overlap::held_for_budget"
"""The region a collective is issued in after the runtime held it back for ``max_inflight_bytes``."""

AHEAD_LABEL = "overlap::gather_ahead"
"""The region the runtime issues the next step's all-gathers in, in backward or at its end (gather-ahead)."""

_GRADIENT_KINDS = ("reduce_scatter", "all_reduce")


@dataclasses.dataclass(frozen=True)
class IdlePiece:
    """One piece of a rank's idle link (see :func:`link_idle_pieces`)."""

    start: float
    end: float
    cause: str
    """One of :data:`IDLE_CAUSES`."""
    ended_by: Optional[CollectiveRecord]
    """The collective whose start ended the piece, the one it names the cause from: the next
    to go on the link (possibly in a later step); None when none started after it."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def link_idle(rank: RankProfile, start: float, end: float) -> list[tuple[float, float, str]]:
    """The pieces of ``[start, end]`` during which no collective of ``rank`` was on the link and the
    rank was not stalled in a wait, each with its cause (one of :data:`IDLE_CAUSES`):
    :func:`link_idle_pieces` as ``(start, end, cause)``.

    [Note: link idle while compute ran]
    At comm >= compute every millisecond the link sits idle while compute runs is a millisecond
    added to the step, so the report says where and why. The link is busy during the union of the
    collectives' ``[start, end]`` (every group's: one rank, one NIC); a stall means the rank waits
    for something in flight, so stalls are not counted either. An idle piece ends when the next
    collective starts (or the window ends), and that collective says why it was not on the link
    sooner (a piece that ends at a stall, e.g. a wait for a collective already done, takes the
    cause of the next collective to start after it: the stall changed nothing on the link): a
    collective issued in the ``overlap::held_for_budget`` region had been held back by
    ``max_inflight_bytes`` (*waiting on the byte budget*); a reduce-scatter (or HSDP's all-reduce)
    goes out when its gradients are complete, so if no all-gather was left to run in the window
    the link was *waiting on gradients*; anything else, or no collective before the window's end,
    had simply *not been issued yet*: a gap before a reduce-scatter while a later all-gather of
    the window was still to come is one a deeper prefetch would have filled, and so is one before
    an all-gather (a prefetch too shallow or too late, the step boundary's optimizer step).
    Gathers for the next step (issued in the ``overlap::gather_ahead`` region: in backward after
    their group's step, or at its end) are told apart: a gap they end, or one before a
    reduce-scatter with only such gathers left in the window once a reduce-scatter of the window
    has landed (so a group could have been stepped), is *next step's gathers not issued yet*: no
    deeper prefetch fills it, only issuing those gathers earlier in backward (more gathered ahead,
    or earlier) would. Before any reduce-scatter landed such a gap is *waiting on gradients*: the
    next step's gathers wait for steps, which wait for gradients. Without that split
    every backward gap of a step that ends with gathers ahead read as *not issued yet* (the
    demo's whole idle time did), which hid that backward's link waits on the next step.
    Collectives of every step count, so a gather issued by ``prefetch_next_step`` in one step
    fills the link in the next.
    """
    return [(p.start, p.end, p.cause) for p in link_idle_pieces(rank, start, end)]


def link_idle_pieces(rank: RankProfile, start: float, end: float) -> list[IdlePiece]:
    """:func:`link_idle`'s pieces, each with the collective that ended it (``IdlePiece.ended_by``):
    which gather or reduce-scatter the link was idle before, for a report to name."""
    busy = union([(c.start, c.end) for c in rank.collectives] + rank.stalls)
    ordered = sorted((c for c in rank.collectives if c.start >= start - 1e-9), key=lambda c: c.start)
    starts = [c.start for c in ordered]
    pieces: list[IdlePiece] = []
    cursor = start
    for lo, hi in busy + [(end, end)]:
        lo, hi = min(max(lo, start), end), min(hi, end)
        if lo > cursor:
            nxt = bisect.bisect_left(starts, lo - 1e-9)  # the next collective on the link (a piece may end at a stall)
            ended_by = ordered[nxt] if nxt < len(ordered) else None
            pieces.append(IdlePiece(cursor, lo, _idle_cause(starts, ordered, nxt, cursor, end), ended_by))
        cursor = max(cursor, hi)
        if cursor >= end:
            break
    return pieces


def _idle_cause(starts: Sequence[float], ordered: Sequence[CollectiveRecord], i: int, since: float,
                end: float) -> str:
    """Why the link was idle from ``since`` until ``ordered[i]`` started (in a window ending at
    ``end``; ``i == len(ordered)``: none started after): from that collective and the ones after it
    (``ordered`` by ``starts``; see [Note: link idle while compute ran])."""
    if i == len(starts):
        return IDLE_CAUSES[0]
    c = ordered[i]
    if BUDGET_LABEL in c.label:
        return IDLE_CAUSES[1]
    if c.kind not in _GRADIENT_KINDS:
        return IDLE_CAUSES[3] if AHEAD_LABEL in c.label else IDLE_CAUSES[0]
    stop = bisect.bisect_left(starts, end, lo=i + 1)  # ``ordered`` is by start: only those before ``end``
    gathers_left = [o for o in ordered[i + 1:stop] if o.kind not in _GRADIENT_KINDS]
    if any(AHEAD_LABEL not in o.label for o in gathers_left):
        return IDLE_CAUSES[0]
    stepped = any(o.kind in _GRADIENT_KINDS and o.end <= since + 1e-9 for o in ordered[:i])
    return IDLE_CAUSES[3] if gathers_left and stepped else IDLE_CAUSES[2]


# ---------------------------------------------------------------------------------------- intervals
def union(intervals: Iterable[tuple[Any, Any]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def covered(merged: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Length of ``[a, b]`` covered by the sorted, disjoint ``merged`` intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(merged, (a, a)) - 1)
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        total += max(0.0, hi - lo)
        i += 1
    return total


def covered_pieces(merged: Sequence[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of ``[a, b]`` covered by ``merged``."""
    return [(max(a, lo), min(b, hi)) for lo, hi in merged if lo < b and hi > a]
