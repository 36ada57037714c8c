"""The profiler's figures: summaries per rank, collective kind, region label and step, and the table.

Contract: :class:`ProfileResult` holds the ``RankProfile`` records of one or more ranks
(``overlap.profiler.records``) and derives everything from them, on demand: :meth:`~ProfileResult.
summary` returns a :class:`Report` of frozen dataclasses (milliseconds), :meth:`~ProfileResult.report`
also prints its table; ``export_chrome_trace`` / ``plot`` hand the records to
``overlap.profiler.export``. Nothing here records or changes records.

Per collective kind and label, figures are sums over the collectives. Per step, communication time
and exposed time are measured on the union of the step's collectives' intervals (collectives on
different groups may run at the same time), so a step's figure can be below the sum of its
collectives'. Exposed, hidden and efficiency are defined in ``overlap.profiler.records``, and so is
the idle link per step (``link_idle``, [Note: link idle while compute ran]).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional, Sequence, TextIO

from overlap.profiler import export
from overlap.profiler.records import (IDLE_CAUSES, CollectiveRecord, RankProfile, StepRecord, covered,
                                      IdlePiece, hidden_fraction, link_idle_pieces, union)

__all__ = ["CommSummary", "IdleSummary", "ProfileResult", "Report", "StepSummary"]

LARGEST_IDLE_PIECES = 3
"""How many of a step's idle-link pieces ``StepSummary.link_idle_largest`` keeps, the longest first."""


class _CommEfficiency:
    """``hidden_ms`` and ``efficiency`` of a summary with ``comm_ms`` and ``exposed_ms``."""

    comm_ms: float
    exposed_ms: float

    @property
    def hidden_ms(self) -> float:
        return max(0.0, self.comm_ms - self.exposed_ms)

    @property
    def efficiency(self) -> float:
        """Hidden / communication time, 0..1 (1.0 when there was no communication time)."""
        return hidden_fraction(self.comm_ms, self.exposed_ms)


@dataclasses.dataclass(frozen=True)
class CommSummary(_CommEfficiency):
    """Collectives of one rank, kind and label path, summed. Times in milliseconds."""

    rank: int
    kind: str
    label: str
    count: int
    nbytes: int
    comm_ms: float
    exposed_ms: float

    @property
    def gbps(self) -> float:
        """Bytes over communication time, GB/s."""
        return self.nbytes / (self.comm_ms * 1e-3) / 1e9 if self.comm_ms > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class StepSummary(_CommEfficiency):
    """One step of one rank. ``comm_ms`` / ``exposed_ms``: union of the step's collectives' intervals,
    and the part of it this rank was stalled for; ``stalled_ms``: all stalls inside the step window;
    ``compute_ms``: the step's wall time minus its stalls; ``link_idle_ms``: the part of the step
    window with nothing of this rank on the link while it computed, and ``link_idle_causes`` its
    split by cause (``(cause, ms)`` in ``IDLE_CAUSES`` order, causes with time only; see [Note:
    link idle while compute ran] in ``overlap.profiler.records``); ``link_idle_largest``: its
    ``LARGEST_IDLE_PIECES`` longest pieces, with what ended each."""

    rank: int
    step: int
    wall_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float
    stalled_ms: float
    count: int
    nbytes: int
    link_idle_ms: float = 0.0
    link_idle_causes: tuple[tuple[str, float], ...] = ()
    link_idle_largest: tuple["IdleSummary", ...] = ()

    @property
    def link_idle_share(self) -> float:
        """``link_idle_ms`` over the step's wall time, 0..1."""
        return self.link_idle_ms / self.wall_ms if self.wall_ms > 0 else 0.0

    def describe_largest_idle(self) -> str:
        """``link_idle_largest`` as one line of text (``"-"`` for none)."""
        return "; ".join(map(str, self.link_idle_largest)) or "-"


@dataclasses.dataclass(frozen=True)
class IdleSummary:
    """One piece of a step's idle link (``overlap.profiler.records.IdlePiece``), in milliseconds
    from the step's start: where it was, why, and which collective ended it (``before``: its
    ``CollectiveRecord.what`` with ``" (step N)"`` when it belongs to another step; ``""``: none)."""

    at_ms: float
    ms: float
    cause: str
    before: str

    def __str__(self) -> str:
        before = f" before {self.before}" if self.before else ""
        return f"{self.ms:.1f} ms from {self.at_ms:.1f} ms{before} ({self.cause})"


@dataclasses.dataclass(frozen=True)
class Report:
    """``rows``: per rank, kind and label; ``kinds``: per rank and kind; ``steps``: per rank and step;
    ``total``: everything (rank -1 when several ranks)."""

    rows: tuple[CommSummary, ...]
    kinds: tuple[CommSummary, ...]
    steps: tuple[StepSummary, ...]
    total: CommSummary

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every summary as a dict with its derived figures."""
        def row(s: Any) -> dict[str, Any]:
            d = dataclasses.asdict(s)
            d.update(hidden_ms=s.hidden_ms, efficiency=s.efficiency)
            if isinstance(s, CommSummary):
                d["gbps"] = s.gbps
            else:
                d["link_idle_causes"] = dict(s.link_idle_causes)
                d["link_idle_largest"] = [dataclasses.asdict(p) for p in s.link_idle_largest]
            return d

        return {"rows": [row(r) for r in self.rows], "kinds": [row(r) for r in self.kinds],
                "steps": [row(s) for s in self.steps], "total": row(self.total)}

    def table(self) -> str:
        """The report as fixed-width text."""
        head = (f"{'rank':>4}  {'kind':<24} {'label':<36} {'count':>6} {'MB':>9} {'comm ms':>9} "
                f"{'exposed ms':>10} {'hidden':>7} {'GB/s':>8}")

        def line(s: CommSummary, kind: str, label: str) -> str:
            rank = "all" if s.rank < 0 else str(s.rank)
            return (f"{rank:>4}  {kind:<24} {_clip(label, 36):<36} {s.count:>6} {s.nbytes / 1e6:>9.3f} "
                    f"{s.comm_ms:>9.2f} {s.exposed_ms:>10.2f} {100 * s.efficiency:>6.0f}% {s.gbps:>8.3f}")

        out = ["overlap.profile: collectives (exposed: comm time the rank stalled in a wait; hidden: the rest)", head]
        out += [line(r, r.kind, r.label or "-") for r in self.rows]
        out += [line(k, k.kind, "(all)") for k in self.kinds]
        out.append(line(self.total, "total", ""))
        out += ["", "per step:",
                f"{'rank':>4}  {'step':>4} {'wall ms':>9} {'compute ms':>10} {'comm ms':>9} {'exposed ms':>10} "
                f"{'hidden':>7} {'count':>6} {'link idle ms':>12}  link idle while compute ran, by cause"]
        out += [f"{s.rank:>4}  {s.step:>4} {s.wall_ms:>9.2f} {s.compute_ms:>10.2f} {s.comm_ms:>9.2f} "
                f"{s.exposed_ms:>10.2f} {100 * s.efficiency:>6.0f}% {s.count:>6} {s.link_idle_ms:>12.2f}  "
                + (", ".join(f"{cause} {ms:.2f}" for cause, ms in s.link_idle_causes) or "-") for s in self.steps]
        if any(s.link_idle_largest for s in self.steps):
            out += ["", "longest idle-link pieces per step (from the step's start; before: the collective that "
                        "ended the piece):"]
            out += [f"{s.rank:>4}  {s.step:>4}  {s.describe_largest_idle()}" for s in self.steps if s.link_idle_largest]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _summaries(rank: int, keyed: dict[tuple[str, str], list[CollectiveRecord]]) -> list[CommSummary]:
    return [CommSummary(rank, kind, label, len(cs), sum(c.nbytes for c in cs), 1e3 * sum(c.duration for c in cs),
                        1e3 * sum(c.exposed for c in cs)) for (kind, label), cs in keyed.items()]


class ProfileResult:
    """Records of one or more ranks, with ``report`` / ``export_chrome_trace`` / ``plot``."""

    def __init__(self, ranks: Sequence[RankProfile]) -> None:
        self.ranks: tuple[RankProfile, ...] = tuple(sorted(ranks, key=lambda r: r.rank))

    def __repr__(self) -> str:
        return f"ProfileResult(ranks={[r.rank for r in self.ranks]}, collectives={len(self.collectives)})"

    @property
    def collectives(self) -> list[CollectiveRecord]:
        return [c for r in self.ranks for c in r.collectives]

    @property
    def steps(self) -> list[StepRecord]:
        return [s for r in self.ranks for s in r.steps]

    def summary(self) -> Report:
        """The figures of :meth:`report`, without printing."""
        rows: list[CommSummary] = []
        kinds: list[CommSummary] = []
        steps: list[StepSummary] = []
        for rp in self.ranks:
            by_label: dict[tuple[str, str], list[CollectiveRecord]] = {}
            by_kind: dict[tuple[str, str], list[CollectiveRecord]] = {}
            for c in rp.reported_collectives:  # not a warm-up step's: [Note: warm-up steps of a profile]
                by_label.setdefault((c.kind, c.label), []).append(c)
                by_kind.setdefault((c.kind, ""), []).append(c)
            rows += _summaries(rp.rank, by_label)
            kinds += _summaries(rp.rank, by_kind)
            stalls = rp.stalls
            for s in rp.steps:
                mine = [c for c in rp.collectives if c.step == s.step]
                busy = union((c.start, c.end) for c in mine)
                stalled = covered(stalls, s.start, s.end)
                idle = link_idle_pieces(rp, s.start, s.end)
                by_cause = {cause: 1e3 * sum(p.seconds for p in idle if p.cause == cause) for cause in IDLE_CAUSES}
                longest = sorted(idle, key=lambda p: -p.seconds)[:LARGEST_IDLE_PIECES]
                steps.append(StepSummary(
                    rank=rp.rank, step=s.step, wall_ms=1e3 * (s.end - s.start),
                    compute_ms=1e3 * (s.end - s.start - stalled),
                    comm_ms=1e3 * sum(b - a for a, b in busy),
                    exposed_ms=1e3 * sum(covered(stalls, a, b) for a, b in busy),
                    stalled_ms=1e3 * stalled, count=len(mine), nbytes=sum(c.nbytes for c in mine),
                    link_idle_ms=1e3 * sum(p.seconds for p in idle),
                    link_idle_causes=tuple((c, ms) for c, ms in by_cause.items() if ms > 0),
                    link_idle_largest=tuple(_idle_summary(p, s) for p in longest)))
        everything = [c for r in self.ranks for c in r.reported_collectives]
        total = CommSummary(self.ranks[0].rank if len(self.ranks) == 1 else -1, "total", "", len(everything),
                            sum(c.nbytes for c in everything), 1e3 * sum(c.duration for c in everything),
                            1e3 * sum(c.exposed for c in everything))
        return Report(tuple(rows), tuple(kinds), tuple(steps), total)

    def report(self, *, file: Optional[TextIO] = None, show: bool = True) -> Report:
        """Summarise per collective kind and label, per step; print the table to ``file`` (default
        stdout) if ``show``. Returns the figures as a :class:`Report`."""
        if not isinstance(show, bool):
            raise TypeError(f"overlap.profile: report show must be a bool, got {type(show).__name__}")
        if file is not None and not hasattr(file, "write"):
            raise TypeError(f"overlap.profile: report file must be a writable text stream, got {type(file).__name__}")
        result = self.summary()
        if show:
            print(result.table(), file=file if file is not None else sys.stdout)
        return result

    def trace_events(self) -> list[dict[str, Any]]:
        """The Chrome trace events (pid = rank; tid 0 = compute, tid 1.. = comm per process group)."""
        return export.trace_events(self.ranks)

    def export_chrome_trace(self, path: export.PathArg) -> str:
        """Write the Chrome trace JSON (Perfetto / chrome://tracing open it) to ``path``; returns it."""
        return export.export_chrome_trace(self.ranks, path)

    def plot(self, path: export.PathArg) -> str:
        """Write a PNG timeline: per rank, compute (host busy, stalls marked) under comm bars (exposed
        parts marked; the link idle while compute ran, coloured by cause). Needs matplotlib (``pip install
        'triton-overlap[plot]'``); returns the path."""
        return export.plot(self.ranks, path)


def _idle_summary(piece: IdlePiece, step: StepRecord) -> IdleSummary:
    """``piece`` of ``step``'s window as an :class:`IdleSummary`."""
    ended_by = piece.ended_by
    before = "" if ended_by is None else ended_by.what + ("" if ended_by.step == step.step else f" (step {ended_by.step})")
    return IdleSummary(1e3 * (piece.start - step.start), 1e3 * piece.seconds, piece.cause, before)
