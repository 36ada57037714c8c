"""The profiler's recording side: :class:`Profiler` (``overlap.profile()``), which sees every collective.

Contract. While a :class:`Profiler` is inside its ``with`` block it is the recorder of
``overlap.inflight_work`` (``set_recorder``) and turns on region tracking
(``overlap.regions.track_labels``); it records, per collective issued through
``overlap.collectives._issue`` (the public collectives and the sharded runtime's gathers and
reduce-scatters alike): kind, bytes, process group name, the sharded module it is for (if any), the
step and the ``overlap::...`` region path it was issued in, the issue time, the communication's start and end, and its first wait
(start, end, region). Times are seconds since the profile started, on the host clock
(``time.perf_counter``). :meth:`Profiler.rank_profile` turns them into the plain records of
``overlap.profiler.records``; :meth:`Profiler.gather` and :func:`merge` combine ranks into a
``ProfileResult`` (``overlap.profiler.report``).

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
  release it); the cap by the wait's end bounds that for exposed time. A work that says when a
  link carried it (``link_start`` and ``deadline`` on ``time.monotonic()``: the emulated link's
  :class:`~overlap.testing.EmulatedWork`) is placed there instead, as a NIC's timestamps would
  place it: the watcher's GIL delay does not then blur the idle-link report (see
  [Note: link idle while compute ran] in ``overlap.profiler.records``).
* **CUDA** (written, not yet exercised by tests). Timing events: one on the issuing stream at issue,
  one on the communication stream after the collective (its end; the stream is
  ``overlap.streams.collective_stream``, the one the collective ran on), and one on the waiting
  stream when the first wait is reached. A collective starts at ``max(issue, end of the previous one
  on its group)``; its wait stalls the waiting stream from the wait until the collective's end.
  Event times are put on the host clock through a reference event, recorded (after a device
  synchronize) at the profile's first collective on each device.

Cost. When no profiler is active, issuing and waiting cost one ``is None`` check each, and runtime
regions one boolean check (``overlap.inflight_work.set_recorder``, ``overlap.regions.track_labels``).
While recording, each collective costs a record, a queue entry for its group's watcher thread and
a region-path lookup.

[Note: warm-up steps of a profile]
A profile sees only what is issued inside its ``with`` block. A training loop that leaves collectives
in flight from one step to the next (the next step's gathers issued at the end of backward:
``overlap.prefetch_next_step``, the demo's gather-ahead) starts its first profiled step with gathers
on the link that the profile never saw issued, so the idle-link report counts that time as idle and
the step's waits on them as nobody's; a barrier before the profile (the demo lines its ranks up) lets
those gathers land early, which makes the first step's forward wait less than a steady step's. On the
demo (2026-12-04, 2 ranks, 2 profiled steps) the first step read 30-34% of the link idle and the
second 7-9%. ``overlap.profile(warmup=k)`` records the first ``k`` steps, so their collectives are on
the link and their waits are stalls in the steps after, but leaves them out of ``RankProfile.steps``
and of every figure of the report (per step, per label, per kind, total); the Chrome trace and the
PNG timeline still show their collectives. One warm-up step suffices for gathers issued one step ahead.

Concurrency contract. One profiler records at a time per process (entering a second raises).
Records are made on the threads that issue and wait collectives; CPU completion times are written
by the group's watcher thread (one float store each). A collective issued while recording and waited
after the ``with`` block still gets its wait recorded.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
from typing import ContextManager, Optional, TextIO, Union

import torch
import torch.distributed as dist

from overlap import agreement, inflight_work, regions
from overlap.groups import resolve_group
from overlap.profiler.export import PathArg
from overlap.profiler.records import CollectiveRecord, RankProfile, StepRecord, covered, union
from overlap.profiler.report import ProfileResult, Report
from overlap.streams import collective_stream

__all__ = ["Profiler", "merge", "profile"]

_clock = time.perf_counter
_active_lock = threading.Lock()
_active: Optional["Profiler"] = None


class _Record:
    """The mutable record of one collective while it is in flight (``inflight_work.WaitRecord``)."""

    __slots__ = ("kind", "nbytes", "group", "step", "label", "module", "issued", "done", "link_start", "link_end",
                 "wait_start", "wait_end", "wait_label", "_waiting", "cuda")

    def __init__(self, kind: str, nbytes: int, group: str, step: int, label: str, issued: float,
                 module: str = "") -> None:
        self.kind, self.nbytes, self.group, self.step, self.label = kind, nbytes, group, step, label
        self.module = module
        self.issued = issued
        self.done: Optional[float] = None
        self.link_start: Optional[float] = None  # when a modelled link carried it (see _link_span)
        self.link_end: Optional[float] = None
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


def _link_span(work: dist.Work) -> Optional[tuple[float, float]]:
    """``(start, end)`` on this profiler's clock of a work that says when a link carried it
    (``link_start`` / ``deadline`` attributes on ``time.monotonic()``), else None."""
    start, end = getattr(work, "link_start", None), getattr(work, "deadline", None)
    if not isinstance(start, float) or not isinstance(end, float):
        return None
    offset = _monotonic_offset()
    return start + offset, end + offset


@functools.cache
def _monotonic_offset() -> float:
    """``perf_counter() - monotonic()``, read once per process: 0.0 where the two are one clock
    (Linux and macOS), else the tightest of a few bracketed reads. Read per record, as before, a
    thread switch or preemption between the two reads (seen: 24 µs, another thread holding the GIL)
    shifted that record's span by as much, and its link start came out before its issue."""
    if time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation:
        return 0.0
    brackets = []
    for _ in range(5):
        before, mono, after = _clock(), time.monotonic(), _clock()
        brackets.append((after - before, (before + after) / 2 - mono))
    return min(brackets)[1]


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

    Use through :func:`profile`. ``step()`` marks step boundaries (the first ``warmup`` steps are
    recorded but not reported: [Note: warm-up steps of a profile]); ``report()``,
    ``export_chrome_trace(path)``, ``plot(path)`` work during or after recording; ``gather()`` merges
    ranks. A profiler records once: enter a new one for a new session.
    """

    def __init__(self, enabled: bool = True, warmup: int = 0) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"overlap.profile: enabled must be a bool, got {type(enabled).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"overlap.profile: warmup must be an int >= 0 (steps recorded but not reported), "
                             f"got {warmup!r}")
        self.enabled = enabled
        self.warmup = warmup
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
                 event: Optional["torch.cuda.Event"], device: Optional[torch.device],
                 where: str = "") -> Optional[_Record]:
        """Called by ``InflightWork`` for every collective issued while recording (``where``: the
        sharded module it is for, ``""`` for none)."""
        if self._state != "recording":
            return None
        now = _clock()
        label, launched = _label_path(f"overlap::{kind}")  # the launch began as its region was entered
        record = _Record(kind, nbytes, group, len(self._steps), label, launched if launched is not None else now, where)
        if event is not None and device is not None:
            record.cuda = self._cuda_timing(kind, device)
            self._device = str(device)
        elif work is None:
            record.done = now  # completed at issue
        else:
            span = _link_span(work)
            if span is not None:
                record.link_start, record.link_end = span
            _watcher(group).watch(work, record)
        self._records.append(record)
        return record

    def _cuda_timing(self, kind: str, device: torch.device) -> _CudaTiming:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._cuda_refs:  # the reference that puts this device's events on the host clock
            torch.cuda.synchronize(index)
            ref = _timing_event(torch.cuda.current_stream(index))
            ref.synchronize()
            self._cuda_refs[index] = (ref, _clock())
        return _CudaTiming(device, _timing_event(torch.cuda.current_stream(device)),
                           _timing_event(collective_stream(device, kind)))

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
        stalls = union((w0, w1) for (_, _, _, w0, w1) in timed if w0 is not None and w1 is not None)
        # Collectives on one group run one after another: each starts when the one before it ended.
        busy_until: dict[str, float] = {}
        collectives = []
        for r, (issued, end, measured, w0, w1) in zip(raw, timed):
            start = max(issued, busy_until.get(r.group, issued)) if r.link_start is None else r.link_start
            end = max(end, start)
            if measured:
                busy_until[r.group] = end
            collectives.append(CollectiveRecord(
                rank=self.rank, step=r.step, kind=r.kind, nbytes=r.nbytes, group=r.group, label=r.label,
                module=r.module, issued=issued - t0, start=start - t0, end=end - t0, end_measured=measured,
                wait_start=None if w0 is None else w0 - t0, wait_end=None if w1 is None else w1 - t0,
                wait_label=r.wait_label, exposed=covered(stalls, start, end)))
        return RankProfile(
            rank=self.rank, world_size=self.world_size, epoch=self._epoch, device=self._device,
            steps=tuple(StepRecord(self.rank, i, a - t0, b - t0) for i, (a, b) in enumerate(steps) if i >= self.warmup),
            collectives=tuple(collectives), warmup_steps=self.warmup)

    def _times(self, r: _Record) -> tuple[float, float, bool, Optional[float], Optional[float]]:
        """(issued, end, end measured?, stall start, stall end) of one record on the host clock."""
        if r.cuda is not None:
            return self._cuda_times(r)
        w0, w1 = r.wait_start, r.wait_end
        if r.link_end is not None and (w1 is not None or r.done is not None or r.link_end <= _clock()):
            return r.issued, r.link_end, True, w0, w1  # the link's own delivery time (see _link_span)
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
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < dist.get_world_size():
            raise ValueError(f"overlap.profile: gather dst must be a rank in 0..{dist.get_world_size() - 1}, got {dst!r}")
        mine = self.rank_profile()
        # One bounded, debug-checked exchange (overlap.agreement): every rank receives every rank's
        # records (``w`` times the largest profile's bytes per rank), only ``dst`` keeps them.
        received = agreement.exchange(resolve_group(group), "profile records", mine)
        if dist.get_rank() != dst:
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


def profile(enabled: bool = True, warmup: int = 0) -> Profiler:
    """A :class:`Profiler` to use as ``with overlap.profile() as prof:``; ``enabled=False`` records
    nothing; the first ``warmup`` steps are recorded but not reported ([Note: warm-up steps of a profile])."""
    return Profiler(enabled, warmup)


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
