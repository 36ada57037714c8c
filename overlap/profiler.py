"""``overlap.profile()``: where each collective's time went, hidden behind compute or exposed.

.. code-block:: python

    with overlap.profile() as prof:
        for batch in loader:
            train_step(batch)
            prof.step()                      # step boundary, like torch.profiler
    prof.report()                            # prints a table, returns a Report (dataclasses)
    prof.export_chrome_trace("trace.json")   # Perfetto / chrome://tracing
    prof.plot("timeline.png")                # needs matplotlib: pip install 'triton-overlap[plot]'

Across ranks: ``merged = prof.gather()`` (every rank calls it) returns on rank 0 a
:class:`ProfileResult` of every rank's records, which has the same ``report`` /
``export_chrome_trace`` / ``plot``; :func:`merge` combines :class:`RankProfile` objects that reached
one process another way (e.g. returned by ``overlap.testing.run_distributed``).

What is recorded, per collective issued through ``overlap.collectives._issue`` (the public
collectives and the sharded runtime's gathers and reduce-scatters alike): kind, bytes, process group
name, the step and the ``overlap::...`` region path it was issued in, the issue time, the
communication's start and end, and its first wait (start, end, region). Times are seconds since the
profile started, on the host clock (``time.perf_counter``).

Timing model.

* **CPU** (gloo; the emulated link). The end is when the work completes, noted by a watcher: one
  daemon thread per process group waits (``work.wait()``, GIL released) for the group's works in
  issue order and timestamps each as it returns; the emulated link's work returns at its modelled
  delivery time. (Not ``work.get_future()`` callbacks: gloo's reduce-scatter has no future, and a
  Python callback runs on, and can hold up, gloo's own worker thread.) The end is capped by the end
  of the first wait (a returned wait proves completion); a work that is ``None`` completed at issue.
  Collectives on one process group run one after another, so a collective starts at
  ``max(issue, end of the previous collective on its group)``. A collective still in flight when the
  records are read ends "now" (``end_measured`` False). A watcher needs the GIL to timestamp, so
  its times can be late while the main thread runs Python code without releasing it (torch ops
  release it); the cap by the wait's end bounds that for exposed time.
* **CUDA** (written, not yet exercised by tests). Timing events: one on the issuing stream at issue,
  one on the communication stream after the collective (its end), and one on the waiting stream
  when the first wait is reached. A collective starts at ``max(issue, end of the previous one on its
  group)``; its wait stalls the waiting stream from the wait until the collective's end. Event
  times are put on the host clock through a reference event, recorded (after a device synchronize)
  at the profile's first collective on each device.

Definitions. A *stall* is the interval of a first wait (CPU: the host blocked in ``wait`` /
``synchronize``; CUDA: the waiting stream idle until the collective's end). A collective's
*exposed* time is the part of its ``[start, end]`` during which this rank was stalled on any wait;
the rest is *hidden*. *Efficiency* = hidden / communication time. *Bandwidth* is the algorithm
bandwidth ``bytes / (end - start)`` (``bytes``: the gathered output, or the reduce-scattered
input), as nccl-tests report ``algbw``. Per step, communication time and exposed time are measured
on the union of the step's collectives' intervals (collectives on different groups may run at the
same time), so a step's figure can be below the sum of its collectives'.

Cost. When no profiler is active, issuing and waiting cost one ``is None`` check each, and runtime
regions one boolean check (``overlap.inflight_work.set_recorder``, ``overlap.regions.track_labels``).
While recording, each collective costs a record, a queue entry for its group's watcher thread and
a region-path lookup.

Concurrency contract. One profiler records at a time per process (entering a second raises).
Records are made on the threads that issue and wait collectives; CPU completion times are written
by the group's watcher thread (one float store each). A collective issued while recording and waited
after the ``with`` block still gets its wait recorded.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import os
import queue
import sys
import threading
import time
from typing import Any, ContextManager, Iterable, Optional, Sequence, TextIO, Union

import torch
import torch.distributed as dist

from overlap import inflight_work, regions

__all__ = [
    "CollectiveRecord", "CommSummary", "ProfileResult", "Profiler", "RankProfile", "Report", "StepRecord",
    "StepSummary", "merge", "profile",
]

_clock = time.perf_counter
_active_lock = threading.Lock()
_active: Optional["Profiler"] = None

PathArg = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------------------- records
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
    """True when ``end`` comes from a completion signal, False when estimated (see the module docs)."""
    wait_start: Optional[float]
    wait_end: Optional[float]
    wait_label: str
    exposed: float
    """Seconds of ``[start, end]`` during which this rank was stalled on a wait."""

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
        return self.hidden / self.duration if self.duration > 0 else 1.0

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
    """Everything one rank recorded: plain, picklable data (``gather`` / :func:`merge` move it)."""

    rank: int
    world_size: int
    epoch: float
    """``time.time()`` when the profile started: aligns ranks on one timeline."""
    device: str
    steps: tuple[StepRecord, ...]
    collectives: tuple[CollectiveRecord, ...]

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """This rank's stall intervals (first waits), merged and sorted."""
        return _union((c.wait_start, c.wait_end) for c in self.collectives
                      if c.wait_start is not None and c.wait_end is not None)


class _Record:
    """The mutable record of one collective while it is in flight (``inflight_work.WaitRecord``)."""

    __slots__ = ("kind", "nbytes", "group", "step", "label", "issued", "done", "wait_start", "wait_end",
                 "wait_label", "_waiting", "cuda")

    def __init__(self, kind: str, nbytes: int, group: str, step: int, label: str, issued: float) -> None:
        self.kind, self.nbytes, self.group, self.step, self.label = kind, nbytes, group, step, label
        self.issued = issued
        self.done: Optional[float] = None
        self.wait_start: Optional[float] = None
        self.wait_end: Optional[float] = None
        self.wait_label = ""
        self._waiting = False
        self.cuda: Optional[_CudaTiming] = None

    def begin_wait(self) -> bool:
        if self._waiting or self.wait_end is not None:
            return False  # nested (synchronize -> wait) or a later wait: only the first is timed
        self._waiting = True
        self.wait_start = _clock()
        self.wait_label = _label_path("overlap::wait")[0]
        if self.cuda is not None:
            self.cuda.reached = _timing_event(torch.cuda.current_stream(self.cuda.device))
        return True

    def end_wait(self) -> None:
        self.wait_end = _clock()
        self._waiting = False


class _Watcher:
    """A daemon thread that waits for one process group's CPU works in issue order and notes when
    each returns (its completion time). Idle, it blocks on its queue; it lives as long as the process."""

    def __init__(self, group: str) -> None:
        self._queue: "queue.SimpleQueue[tuple[dist.Work, _Record]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"overlap-profile-watcher-{group}", daemon=True)
        self._thread.start()

    def watch(self, work: dist.Work, record: _Record) -> None:
        self._queue.put((work, record))

    def _run(self) -> None:
        while True:
            work, record = self._queue.get()
            try:
                work.wait()
            except Exception:  # noqa: BLE001 (the issuing thread sees the failure; the time still counts)
                pass
            record.done = _clock()
            del work, record


_watchers: dict[str, _Watcher] = {}
_watchers_lock = threading.Lock()
os.register_at_fork(after_in_child=_watchers.clear)  # a forked child has none of the threads


def _watcher(group: str) -> _Watcher:
    with _watchers_lock:
        watcher = _watchers.get(group)
        if watcher is None:
            watcher = _watchers[group] = _Watcher(group)
        return watcher


@dataclasses.dataclass
class _CudaTiming:
    device: torch.device
    issued: "torch.cuda.Event"
    end: "torch.cuda.Event"
    reached: Optional["torch.cuda.Event"] = None


def _timing_event(stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _label_path(own: str) -> tuple[str, Optional[float]]:
    """This thread's region path without the innermost region if it is named ``own`` (the region of
    the issue or wait itself), and the time that region was entered (None if not inside it)."""
    stack = list(regions.current_regions())
    entered = None
    if stack and stack[-1][0] == own:
        entered = stack.pop()[1]
    return "/".join(name for name, _ in stack), entered


# ---------------------------------------------------------------------------------------- profiler
class Profiler:
    """Records every collective issued inside its ``with`` block (see the module docstring).

    Use through :func:`profile`. ``step()`` marks step boundaries; ``report()``,
    ``export_chrome_trace(path)``, ``plot(path)`` work during or after recording; ``gather()`` merges
    ranks. A profiler records once: enter a new one for a new session.
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"overlap.profile: enabled must be a bool, got {type(enabled).__name__}")
        self.enabled = enabled
        self._state = "new"  # new -> recording -> done
        self._records: list[_Record] = []
        self._steps: list[tuple[float, float]] = []  # closed steps (start, end), raw clock
        self._step_start = 0.0
        self._t0 = 0.0
        self._epoch = 0.0
        self.rank, self.world_size = 0, 1
        self._device = "cpu"
        self._cuda_refs: dict[int, tuple["torch.cuda.Event", float]] = {}
        self._previous_labels = False
        self._gathered: Optional[ProfileResult] = None

    def __repr__(self) -> str:
        return (f"Profiler(rank={self.rank}, state={self._state!r}, steps={len(self._steps) + (self._state == 'recording')}, "
                f"collectives={len(self._records)})")

    # ------------------------------------------------------------------ recording
    def __enter__(self) -> "Profiler":
        global _active
        if self._state != "new":
            raise RuntimeError("overlap.profile: this profiler has already recorded; use a new overlap.profile()")
        if not self.enabled:
            self._state = "done"
            return self
        with _active_lock:
            if _active is not None:
                raise RuntimeError("overlap.profile: another profiler is already recording in this process "
                                   "(profilers do not nest)")
            _active = self
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._epoch, self._t0 = time.time(), _clock()
        self._step_start = self._t0
        self._state = "recording"
        self._previous_labels = regions.track_labels(True)
        inflight_work.set_recorder(self)
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        if self._state != "recording":
            return
        inflight_work.set_recorder(None)
        regions.track_labels(self._previous_labels)
        now = _clock()
        # A trailing step with nothing in it is the exit right after a final prof.step(): drop it.
        if not self._steps or any(r.step == len(self._steps) for r in self._records):
            self._steps.append((self._step_start, now))
        self._state = "done"
        with _active_lock:
            _active = None

    @property
    def recording(self) -> bool:
        return self._state == "recording"

    def step(self) -> None:
        """End the current step and start the next (call it once per iteration, like torch.profiler)."""
        if self._state != "recording":
            if not self.enabled:
                return
            raise RuntimeError("overlap.profile: step() must be called inside `with overlap.profile() as prof:`")
        now = _clock()
        self._steps.append((self._step_start, now))
        self._step_start = now

    def label(self, name: str) -> ContextManager[object]:
        """A context manager naming a region (``prof.label("block3")``): collectives issued inside it
        carry the name in their label path; torch.profiler sees it as a ``record_function``."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"overlap.profile: label name must be a non-empty str, got {name!r}")
        return regions.region(name)

    # inflight_work.Recorder
    def on_issue(self, kind: str, nbytes: int, group: str, work: Optional[dist.Work],
                 event: Optional["torch.cuda.Event"], device: Optional[torch.device]) -> Optional[_Record]:
        """Called by ``InflightWork`` for every collective issued while recording."""
        if self._state != "recording":
            return None
        now = _clock()
        label, launched = _label_path(f"overlap::{kind}")  # the launch began as its region was entered
        record = _Record(kind, nbytes, group, len(self._steps), label, launched if launched is not None else now)
        if event is not None and device is not None:
            record.cuda = self._cuda_timing(kind, device)
            self._device = str(device)
        elif work is None:
            record.done = now  # completed at issue
        else:
            _watcher(group).watch(work, record)
        self._records.append(record)
        return record

    def _cuda_timing(self, kind: str, device: torch.device) -> _CudaTiming:
        from overlap.collectives import _STREAM_PURPOSE
        from overlap.streams import comm_stream

        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._cuda_refs:  # the reference that puts this device's events on the host clock
            torch.cuda.synchronize(index)
            ref = _timing_event(torch.cuda.current_stream(index))
            ref.synchronize()
            self._cuda_refs[index] = (ref, _clock())
        stream = comm_stream(device, _STREAM_PURPOSE.get(kind.removesuffix("_coalesced"), "other"))
        return _CudaTiming(device, _timing_event(torch.cuda.current_stream(device)), _timing_event(stream))

    # ------------------------------------------------------------------ results
    def rank_profile(self) -> RankProfile:
        """This rank's records so far (an open step ends now). On CUDA, waits for the recorded events."""
        now = _clock()
        steps = list(self._steps)
        if self._state == "recording":
            steps.append((self._step_start, now))
        t0 = self._t0
        raw = list(self._records)
        timed = [self._times(r) for r in raw]
        stalls = _union((w0, w1) for (_, _, _, w0, w1) in timed if w0 is not None and w1 is not None)
        # Collectives on one group run one after another: each starts when the one before it ended.
        busy_until: dict[str, float] = {}
        collectives = []
        for r, (issued, end, measured, w0, w1) in zip(raw, timed):
            start = max(issued, busy_until.get(r.group, issued))
            end = max(end, start)
            if measured:
                busy_until[r.group] = end
            collectives.append(CollectiveRecord(
                rank=self.rank, step=r.step, kind=r.kind, nbytes=r.nbytes, group=r.group, label=r.label,
                issued=issued - t0, start=start - t0, end=end - t0, end_measured=measured,
                wait_start=None if w0 is None else w0 - t0, wait_end=None if w1 is None else w1 - t0,
                wait_label=r.wait_label, exposed=_overlap(stalls, start, end)))
        return RankProfile(
            rank=self.rank, world_size=self.world_size, epoch=self._epoch, device=self._device,
            steps=tuple(StepRecord(self.rank, i, a - t0, b - t0) for i, (a, b) in enumerate(steps)),
            collectives=tuple(collectives))

    def _times(self, r: _Record) -> tuple[float, float, bool, Optional[float], Optional[float]]:
        """(issued, end, end measured?, stall start, stall end) of one record on the host clock."""
        if r.cuda is not None:
            return self._cuda_times(r)
        w0, w1 = r.wait_start, r.wait_end
        if r.done is not None:
            return r.issued, (min(r.done, w1) if w1 is not None else r.done), True, w0, w1
        if w1 is not None:  # the wait returned, so it had completed (the watcher has not said when yet)
            return r.issued, w1, True, w0, w1
        return r.issued, _clock(), False, w0, w1  # still in flight

    def _cuda_times(self, r: _Record) -> tuple[float, float, bool, Optional[float], Optional[float]]:
        timing = r.cuda
        assert timing is not None
        index = timing.device.index if timing.device.index is not None else torch.cuda.current_device()
        ref, host = self._cuda_refs[index]

        def host_time(event: "torch.cuda.Event") -> float:
            event.synchronize()
            return host + ref.elapsed_time(event) * 1e-3

        issued, end = host_time(timing.issued), host_time(timing.end)
        if timing.reached is None:
            return issued, end, True, None, None
        reached = host_time(timing.reached)
        return issued, end, True, reached, max(reached, end)

    @property
    def result(self) -> "ProfileResult":
        """What ``report`` / ``export_chrome_trace`` / ``plot`` show: every rank's records after a
        ``gather`` on its destination, else this rank's."""
        return self._gathered if self._gathered is not None else ProfileResult([self.rank_profile()])

    @property
    def collectives(self) -> list[CollectiveRecord]:
        """This rank's collectives so far."""
        return list(self.rank_profile().collectives)

    def gather(self, dst: int = 0, group: Optional[dist.ProcessGroup] = None) -> Optional["ProfileResult"]:
        """Collect every rank's records on ``dst`` (a global rank); every rank of ``group`` must call it.

        Returns the merged :class:`ProfileResult` on ``dst`` (from then on this profiler's
        ``report`` / ``export_chrome_trace`` / ``plot`` cover all ranks there), None elsewhere.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("overlap.profile: gather() needs an initialized torch.distributed process group")
        world = dist.get_world_size(group)
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < dist.get_world_size():
            raise ValueError(f"overlap.profile: gather dst must be a rank in 0..{dist.get_world_size() - 1}, got {dst!r}")
        mine = self.rank_profile()
        received: Optional[list[Any]] = [None] * world if dist.get_rank() == dst else None
        dist.gather_object(mine, received, dst=dst, group=group)
        if received is None:
            return None
        self._gathered = merge(*received)
        return self._gathered

    def report(self, *, file: Optional[TextIO] = None, show: bool = True) -> "Report":
        """Summarise (see :class:`Report`); print the table to ``file`` (default stdout) if ``show``."""
        return self.result.report(file=file, show=show)

    def export_chrome_trace(self, path: PathArg) -> str:
        """Write a Chrome trace (JSON; Perfetto opens it); returns the path written."""
        return self.result.export_chrome_trace(path)

    def plot(self, path: PathArg) -> str:
        """Write a PNG timeline (needs matplotlib); returns the path written."""
        return self.result.plot(path)


def profile(enabled: bool = True) -> Profiler:
    """A :class:`Profiler` to use as ``with overlap.profile() as prof:``; ``enabled=False`` records nothing."""
    return Profiler(enabled)


# ---------------------------------------------------------------------------------------- intervals
def _union(intervals: Iterable[tuple[Any, Any]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(merged: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Length of ``[a, b]`` covered by the sorted, disjoint ``merged`` intervals."""
    total = 0.0
    i = max(0, bisect.bisect_right(merged, (a, a)) - 1)
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        total += max(0.0, hi - lo)
        i += 1
    return total


def _pieces(merged: Sequence[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of ``[a, b]`` covered by ``merged``."""
    return [(max(a, lo), min(b, hi)) for lo, hi in merged if lo < b and hi > a]


# ---------------------------------------------------------------------------------------- reports
class _HiddenShare:
    """``hidden_ms`` and ``efficiency`` of a summary with ``comm_ms`` and ``exposed_ms``."""

    comm_ms: float
    exposed_ms: float

    @property
    def hidden_ms(self) -> float:
        return max(0.0, self.comm_ms - self.exposed_ms)

    @property
    def efficiency(self) -> float:
        """Hidden / communication time, 0..1 (1.0 when there was no communication time)."""
        return self.hidden_ms / self.comm_ms if self.comm_ms > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class CommSummary(_HiddenShare):
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
class StepSummary(_HiddenShare):
    """One step of one rank. ``comm_ms`` / ``exposed_ms``: union of the step's collectives' intervals,
    and the part of it this rank was stalled for; ``stalled_ms``: all stalls inside the step window;
    ``compute_ms``: the step's wall time minus its stalls."""

    rank: int
    step: int
    wall_ms: float
    compute_ms: float
    comm_ms: float
    exposed_ms: float
    stalled_ms: float
    count: int
    nbytes: int


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
                f"{'hidden':>7} {'count':>6}"]
        out += [f"{s.rank:>4}  {s.step:>4} {s.wall_ms:>9.2f} {s.compute_ms:>10.2f} {s.comm_ms:>9.2f} "
                f"{s.exposed_ms:>10.2f} {100 * s.efficiency:>6.0f}% {s.count:>6}" for s in self.steps]
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
            for c in rp.collectives:
                by_label.setdefault((c.kind, c.label), []).append(c)
                by_kind.setdefault((c.kind, ""), []).append(c)
            rows += _summaries(rp.rank, by_label)
            kinds += _summaries(rp.rank, by_kind)
            stalls = rp.stalls
            for s in rp.steps:
                mine = [c for c in rp.collectives if c.step == s.step]
                busy = _union((c.start, c.end) for c in mine)
                stalled = _overlap(stalls, s.start, s.end)
                steps.append(StepSummary(
                    rank=rp.rank, step=s.step, wall_ms=1e3 * (s.end - s.start),
                    compute_ms=1e3 * (s.end - s.start - stalled),
                    comm_ms=1e3 * sum(b - a for a, b in busy),
                    exposed_ms=1e3 * sum(_overlap(stalls, a, b) for a, b in busy),
                    stalled_ms=1e3 * stalled, count=len(mine), nbytes=sum(c.nbytes for c in mine)))
        everything = self.collectives
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

    # ------------------------------------------------------------------ chrome trace
    def _origin(self) -> float:
        return min(r.epoch for r in self.ranks) if self.ranks else 0.0

    def trace_events(self) -> list[dict[str, Any]]:
        """The Chrome trace events (pid = rank; tid 0 = compute, tid 1.. = comm per process group)."""
        origin = self._origin()
        events: list[dict[str, Any]] = []
        for rp in self.ranks:
            shift = rp.epoch - origin

            def us(t: float) -> float:
                return round((shift + t) * 1e6, 3)

            pid = rp.rank
            groups = sorted({c.group for c in rp.collectives}) or [""]
            tids = {g: 1 + i for i, g in enumerate(groups)}
            events += [
                {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}},
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}},
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": 0}},
            ]
            for g, tid in tids.items():
                name = "comm" if len(tids) == 1 else f"comm ({g or 'unnamed group'})"
                events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
                           {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]
            for s in rp.steps:
                events.append({"ph": "X", "name": f"step {s.step}", "cat": "step", "pid": pid, "tid": 0,
                               "ts": us(s.start), "dur": round((s.end - s.start) * 1e6, 3)})
            stalls = rp.stalls
            for c in rp.collectives:
                args = {"bytes": c.nbytes, "group": c.group, "label": c.label, "step": c.step,
                        "exposed_ms": round(1e3 * c.exposed, 4), "hidden_ms": round(1e3 * c.hidden, 4),
                        "GB/s": round(c.gbps, 4), "end_measured": c.end_measured}
                tid = tids[c.group]
                events.append({"ph": "X", "name": c.kind, "cat": "comm", "pid": pid, "tid": tid,
                               "ts": us(c.start), "dur": round(c.duration * 1e6, 3), "args": args})
                for a, b in _pieces(stalls, c.start, c.end):
                    events.append({"ph": "X", "name": "exposed", "cat": "exposed", "pid": pid, "tid": tid,
                                   "ts": us(a), "dur": round((b - a) * 1e6, 3)})
                events.append({"ph": "i", "name": f"issue {c.kind}", "cat": "issue", "s": "t", "pid": pid,
                               "tid": 0, "ts": us(c.issued), "args": {"label": c.label}})
                if c.wait_start is not None and c.wait_end is not None:
                    events.append({"ph": "X", "name": f"wait {c.kind}", "cat": "wait", "pid": pid, "tid": 0,
                                   "ts": us(c.wait_start), "dur": round((c.wait_end - c.wait_start) * 1e6, 3),
                                   "args": {"label": c.wait_label, "exposed_ms": round(1e3 * c.exposed, 4)}})
        return events

    def export_chrome_trace(self, path: PathArg) -> str:
        """Write the Chrome trace JSON (Perfetto / chrome://tracing open it) to ``path``; returns it."""
        target = _check_path(path, "export_chrome_trace")
        doc = {"traceEvents": self.trace_events(), "displayTimeUnit": "ms",
               "otherData": {"source": "overlap.profile", "ranks": [r.rank for r in self.ranks],
                             "epoch_origin": self._origin()}}
        _write(target, "export_chrome_trace", lambda f: json.dump(doc, f), "w")
        return target

    # ------------------------------------------------------------------ plot
    def plot(self, path: PathArg) -> str:
        """Write a PNG timeline: per rank, compute (host busy, stalls marked) under comm bars (exposed
        parts marked). Needs matplotlib (``pip install 'triton-overlap[plot]'``); returns the path."""
        target = _check_path(path, "plot")
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError("overlap.profile: plot() needs matplotlib; install it with "
                              "pip install 'triton-overlap[plot]'") from e
        origin = self._origin()
        fig = Figure(figsize=(12, 1.6 + 1.1 * max(1, len(self.ranks))), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ticks, names = [], []
        for row, rp in enumerate(self.ranks):
            shift = rp.epoch - origin
            base = 2 * (len(self.ranks) - 1 - row)
            ms = [(1e3 * (shift + s.start), 1e3 * (s.end - s.start)) for s in rp.steps]
            ax.broken_barh(ms, (base + 0.1, 0.8), facecolors="#9ecae1", edgecolor="white")
            stalls = rp.stalls
            ax.broken_barh([(1e3 * (shift + a), 1e3 * (b - a)) for a, b in stalls], (base + 0.1, 0.8),
                           facecolors="#d62728", alpha=0.8)
            comm = [(1e3 * (shift + c.start), 1e3 * c.duration) for c in rp.collectives]
            ax.broken_barh(comm, (base + 1.1, 0.8), facecolors="#74c476", edgecolor="#31a354")
            exposed = [(1e3 * (shift + a), 1e3 * (b - a)) for c in rp.collectives
                       for a, b in _pieces(stalls, c.start, c.end)]
            ax.broken_barh(exposed, (base + 1.1, 0.8), facecolors="#d62728", hatch="//", alpha=0.8)
            ticks += [base + 0.5, base + 1.5]
            names += [f"rank {rp.rank} compute", f"rank {rp.rank} comm"]
        ax.set_yticks(ticks)
        ax.set_yticklabels(names)
        ax.set_xlabel("ms")
        ax.set_title("overlap.profile timeline: comm over compute; red = exposed (host stalled in a wait)")
        ax.legend(handles=[Patch(color="#9ecae1", label="compute (step)"), Patch(color="#74c476", label="comm"),
                           Patch(color="#d62728", label="exposed / stalled")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
        fig.tight_layout()
        _write(target, "plot", lambda f: fig.savefig(f, format="png"), "wb")
        return target


def merge(*profiles: Union[RankProfile, ProfileResult, Profiler]) -> ProfileResult:
    """Combine the records of several ranks (each a RankProfile, ProfileResult or Profiler) into one
    :class:`ProfileResult`; a rank may appear only once."""
    ranks: list[RankProfile] = []
    for i, p in enumerate(profiles):
        if isinstance(p, RankProfile):
            ranks.append(p)
        elif isinstance(p, ProfileResult):
            ranks += p.ranks
        elif isinstance(p, Profiler):
            ranks.append(p.rank_profile())
        else:
            raise TypeError(f"overlap.profiler.merge: profiles[{i}] must be a RankProfile, ProfileResult or "
                            f"Profiler, got {type(p).__name__}")
    seen = [r.rank for r in ranks]
    duplicated = sorted({r for r in seen if seen.count(r) > 1})
    if duplicated:
        raise ValueError(f"overlap.profiler.merge: profiles hold rank(s) {duplicated} more than once")
    return ProfileResult(ranks)


# ---------------------------------------------------------------------------------------- files
def _check_path(path: object, caller: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"overlap.profile: {caller} path must be a str or os.PathLike, got {type(path).__name__}")
    target = os.fspath(path)
    if not isinstance(target, str) or not target:
        raise ValueError(f"overlap.profile: {caller} path must be a non-empty file path, got {path!r}")
    return target


def _write(target: str, caller: str, write: Any, mode: str) -> None:
    try:
        with open(target, mode) as f:
            write(f)
    except OSError as e:
        message = f"overlap.profile: {caller} cannot write path={target!r}: {e.strerror or e}"
        raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e

