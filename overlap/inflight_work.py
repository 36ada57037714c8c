"""Collectives in flight: their completion signal, the buffers they use, and the waits on them.

[Note: buffer lifetime without record_stream]
A collective reads its input buffer and writes its output buffer on the communication stream (or a
gloo thread) while the caller goes on. Both buffers are allocated on the caller's stream, and an
``InflightWork`` holds a reference to them. The reference is dropped only when reuse is safe:
* when a consumer has waited: on CPU the work has finished; on CUDA see
  [Note: cross-stream buffer lifetime];
* or when a sweep (run at each issue) finds the collective finished (``event.query()`` /
  ``work.is_completed()``), which covers results that are dropped without ever being used.
``record_stream`` is not used: it delays the reuse of every block until the allocator happens to
notice the stream's progress, which over-holds memory in the caching allocator.

[Note: cross-stream buffer lifetime]
Invariant: a buffer an ``InflightWork`` holds goes back to the caching allocator only once the stream
it was allocated on (the *issue stream*: the current stream when the collective was issued, which
is the only stream whose later allocations can get its blocks) can no longer run ahead of a device
read or write of it: the collective on the comm stream, and the reads that turn the buffer into the
result on the consumer's stream (``wait(then=...)``: a copy out of a packed buffer, a divide).
* The consumer waits on the issue stream: its later allocations are ordered after the stream wait
  on the collective's event and after ``then`` (stream order), so the references drop at once.
* The consumer waits on another stream (a result first used under ``torch.cuda.stream(s)``,
  ``wait_all()`` there, backward hooks on autograd's stream, final callbacks on the caller's): its
  stream waits on the collective's event, runs ``then``, and records an event; (event, buffers) go
  to a deferred-release list that ``sweep()`` (at each issue) empties of entries whose event has
  completed (``event.query()``), when no device work touches the buffers any more.
* A collective a sweep finds finished (``event.query()`` on its own event) and nobody waited has
  no reader left: released at once.
Rejected: making the issue stream wait on the consumer's event before releasing (it would queue
the caller's compute behind the consumer stream's unrelated work) and ``record_stream``.
Tensors the caller keeps (a result used on another stream, then dropped) follow torch's usual
rule for cross-stream use; the runtime only guards the buffers it owns.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from overlap import desync, errors
from overlap.errors import (  # noqa: F401 (re-exported: the names' historical home)
    CollectiveError,
    CollectiveTimeoutError,
    collective_failure,
    set_wait_timeout,
    wait_timeout,
)
from overlap.regions import region
from overlap.streams import capture_error, capturing

__all__ = ["InflightWork", "Recorder", "ResultCompletion", "WaitRecord", "track", "sweep", "wait_all", "inflight",
           "inflight_bytes", "set_recorder", "describe", "set_max_inflight_bytes", "max_inflight_bytes", "make_room"]


class InflightWork:
    """One issued collective: its completion signal and the buffers it must keep alive."""

    __slots__ = ("kind", "nbytes", "group", "seq", "_work", "_event", "_device", "_buffers", "_shapes", "_host_waited", "_record",
                 "_issue_stream", "_finish")

    def __init__(
        self,
        kind: str,
        nbytes: int,
        buffers: Sequence[torch.Tensor],
        work: Optional[dist.Work] = None,
        event: Optional["torch.cuda.Event"] = None,
        device: Optional[torch.device] = None,
        group: str = "",
        seq: int = -1,
        issue_stream: Optional["torch.cuda.Stream"] = None,
        finish: Optional[Callable[[], None]] = None,
        where: str = "",
    ) -> None:
        self.kind = kind
        self._finish = finish  # CPU: completes the collective's output after the host wait, before any reader
        # CUDA: the stream the buffers were allocated on (see [Note: cross-stream buffer lifetime])
        self._issue_stream = issue_stream
        self.seq = seq  # per-group sequence number (overlap.desync), named in errors
        self.group = group  # process group name (for the profiler and error messages)
        self._device = device
        self.nbytes = nbytes
        self._work = work
        self._event = event
        self._buffers: Optional[tuple] = tuple(buffers)
        self._shapes = tuple((b.dtype, b.shape) for b in self._buffers)  # for errors, after release
        self._host_waited = False
        # overlap.profiler: one global check when no profiler runs (see set_recorder)
        self._record = (_recorder.on_issue(kind, nbytes, group, work, event, device, where)
                        if _recorder is not None else None)

    def is_done(self) -> bool:
        """Non-blocking: has the collective finished?"""
        if self._event is not None:
            return self._event.query()
        return self._host_waited or self._work is None or self._work.is_completed()

    def wait(self, then: Optional[Callable[[], None]] = None) -> None:
        """Make the caller's stream (CUDA) or thread (CPU) wait for the collective, run ``then`` (the
        caller's reads of this work's buffers, e.g. a copy out), then drop the buffer references.

        On CUDA, from a stream other than the issue stream, the references (and ``then``, which may
        hold views of them) are kept until an event recorded after ``then`` completes; see
        [Note: cross-stream buffer lifetime]. Raises ``StreamCaptureError`` during CUDA graph capture.
        """
        timed = self._record is not None and self._record.begin_wait()
        consumer = None
        if self._event is not None:
            if capturing():
                raise capture_error(f"the wait for {describe(self)} (its result's first use)")
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(self._event)
        elif not self._host_waited:
            if self._work is not None:
                _host_wait(self, self._work)  # raises CollectiveError naming this collective
            self._host_waited = True
            if self._finish is not None:
                self._finish, finish = None, self._finish
                finish()
        if timed:
            self._record.end_wait()
        if then is not None:
            then()
        if consumer is None or self._issue_stream is None or consumer == self._issue_stream:
            self.release()
        else:
            self._release_after(consumer, then)

    def _release_after(self, consumer: "torch.cuda.Stream", then: Optional[Callable[[], None]]) -> None:
        """Hand the buffers (and ``then``) to the deferred-release list, behind an event on ``consumer``."""
        refs = tuple(r for r in (self._buffers, then) if r is not None)
        if refs:
            _deferred.append(_DeferredRelease(consumer.record_event(), refs))
        self.release()

    def synchronize(self) -> None:
        """Block the host until the collective has finished (bounds bytes in flight, also on CUDA).

        Raises ``StreamCaptureError`` during CUDA graph capture (a host wait cannot be captured)."""
        timed = self._record is not None and self._record.begin_wait()
        if self._event is not None:
            if capturing():
                raise capture_error(f"a host wait (synchronize) for {describe(self)}")
            _event_synchronize(self, self._event)
        self.wait()
        if timed:
            self._record.end_wait()

    @property
    def pending(self) -> bool:
        """Not yet waited (or found finished by a sweep)."""
        return self._buffers is not None

    def keep(self, *tensors: torch.Tensor) -> None:
        """Hold ``tensors`` with this work's buffers, released by the same rule: for tensors read by
        device work queued on the collective's stream just before it (nothing to hold once released)."""
        if self._buffers is not None:
            self._buffers = (*self._buffers, *tensors)

    def release(self) -> None:
        """Drop the buffer references now and forget this work: safe once the collective is done, or
        waited on its issue stream (``wait`` defers the release itself when it is not)."""
        if self._buffers is not None:
            self._buffers = None
            try:
                _inflight.remove(self)
            except ValueError:
                pass


class ResultCompletion:
    """The ``scheduler.Completion`` of one result tensor: wait for the work, then ``finish`` it.

    ``finish`` runs on the consumer's stream after the wait: it turns the raw collective buffer
    into the result (divide for avg, copy out of a packed buffer, ...).
    """

    __slots__ = ("_work", "_finish")

    def __init__(self, work: InflightWork, finish: Optional[Callable[[], None]] = None) -> None:
        self._work = work
        self._finish = finish

    def wait(self) -> None:
        with region("overlap::wait"):
            self._work.wait(self._finish)
        self._finish = None


_inflight: list[InflightWork] = []


class _DeferredRelease:
    """Buffers waited on a stream other than their issue stream, kept until ``event`` completes."""

    __slots__ = ("event", "refs")

    def __init__(self, event: "torch.cuda.Event", refs: tuple) -> None:
        self.event, self.refs = event, refs


# [Note: cross-stream buffer lifetime]; entries are removed by identity, so appends from another
# thread (autograd's) during a sweep are never lost.
_deferred: list[_DeferredRelease] = []


class WaitRecord(Protocol):
    """What a recorder keeps for one collective; the work calls it around its first blocking wait."""

    def begin_wait(self) -> bool:
        """Called as a wait starts; True if this call is timed (the first, outermost wait)."""
        ...

    def end_wait(self) -> None:
        """Called as a timed wait (``begin_wait`` returned True) returns."""
        ...


class Recorder(Protocol):
    """Sees every collective as it is issued (``overlap.profiler`` installs one while it records)."""

    def on_issue(self, kind: str, nbytes: int, group: str, work: Optional[dist.Work],
                 event: Optional["torch.cuda.Event"], device: Optional[torch.device],
                 where: str) -> Optional[WaitRecord]:
        """``where``: the sharded module the collective is for (its fqn, ``"root"``), ``""`` for
        a collective of no sharded module (the public ``overlap.*`` collectives)."""


_recorder: Optional[Recorder] = None


def set_recorder(recorder: Optional[Recorder]) -> Optional[Recorder]:
    """Install ``recorder`` (``None``: none) for the works issued from now on; returns the previous one.

    With none installed, issuing and waiting cost one ``is None`` check each.
    """
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def track(work: InflightWork) -> InflightWork:
    """Register ``work`` so its buffers outlive it even if every result is dropped unwaited (see
    [Note: buffer lifetime without record_stream])."""
    sweep()
    _inflight.append(work)
    return work


def sweep() -> None:
    """Forget finished works and release the deferred buffers whose consumer event has completed
    (cheap: a non-blocking query each). Does nothing while a CUDA graph is being captured."""
    if capturing():
        return  # event queries are not allowed during capture
    for entry in [d for d in _deferred if d.event.query()]:
        _deferred.remove(entry)
    for work in [w for w in _inflight if w.is_done()]:
        work.release()


def wait_all() -> None:
    """Wait (consumer side) for every collective still in flight in this process.

    Results keep their first-use step (e.g. the divide of an avg), which runs when they are used.
    From a stream other than the issue stream, buffers stay held until that stream's progress says
    they are free ([Note: cross-stream buffer lifetime]). Raises ``StreamCaptureError`` during CUDA
    graph capture.
    """
    for work in list(_inflight):
        work.wait()


def inflight() -> list[InflightWork]:
    """The collectives issued and not yet waited or found finished."""
    return list(_inflight)


def inflight_bytes() -> int:
    """Bytes moved by the collectives in flight (the quantity ``max_inflight_bytes`` bounds)."""
    return sum(w.nbytes for w in _inflight)


# [Note: the process-wide in-flight budget]
# ``set_max_inflight_bytes(limit)`` caps the bytes of every collective this process issues through
# ``overlap`` (raw calls such as ``overlap.all_gather`` and the sharded runtime's own), counted as
# ``inflight_bytes()`` counts them. Before a collective of ``n`` bytes is issued, ``make_room(n)``
# blocks the host on the oldest collectives in flight, one at a time and in issue order
# (``InflightWork.synchronize``), until ``inflight_bytes() + n <= limit`` or nothing is in flight
# (a collective larger than the budget then goes alone). Nothing is reordered or skipped: the waits
# are on collectives already issued, whose completion needs no later collective from any rank, so
# ranks may even use different budgets without a hang. Results keep their first-use step (a divide,
# a copy out), which still runs at their first use. The sharded runtime's ``max_inflight_bytes``
# applies on top, to its own collectives. Off (None) by default: one check per collective.
_max_inflight_bytes: Optional[int] = None


def set_max_inflight_bytes(limit: Optional[int]) -> Optional[int]:
    """Cap the bytes of collectives in flight in this process (an int >= 1; ``None``: no cap, the
    default); returns the previous cap. Applies to collectives issued from now on. Raises
    ``TypeError`` / ``ValueError`` naming ``limit`` before changing anything. See
    [Note: the process-wide in-flight budget]."""
    global _max_inflight_bytes
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise TypeError(f"set_max_inflight_bytes: limit must be None (no cap) or an int number of bytes >= 1, "
                        f"got {type(limit).__name__} {limit!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"set_max_inflight_bytes: limit must be None (no cap) or an int number of bytes >= 1, "
                         f"got {limit!r}")
    previous, _max_inflight_bytes = _max_inflight_bytes, limit
    return previous


def max_inflight_bytes() -> Optional[int]:
    """The process-wide cap set by :func:`set_max_inflight_bytes` (None: no cap)."""
    return _max_inflight_bytes


def make_room(nbytes: int) -> None:
    """Before issuing a collective of ``nbytes``: wait on the host for the oldest collectives in
    flight until it fits the process-wide budget (no-op without one). Raises what their waits raise
    (``CollectiveError``, ``CollectiveTimeoutError``), before anything is issued."""
    limit = _max_inflight_bytes
    if limit is None:
        return
    sweep()
    while _inflight and inflight_bytes() + nbytes > limit:
        _inflight[0].synchronize()  # releases it: it leaves _inflight


def describe(work: InflightWork) -> str:
    """``all_gather #12 on group '0' (4096 bytes: float32[8, 128])``: what errors name a collective by."""
    shapes = " ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape in work._shapes)
    return f"{work.kind} #{work.seq} on group {work.group!r} ({work.nbytes} bytes: {shapes})"


def _host_wait(work: InflightWork, handle: dist.Work) -> None:
    timeout = errors.timeout_for(work.group)
    try:
        finished = handle.wait(timeout)
    except RuntimeError as e:
        raise collective_failure(f"wait for {describe(work)}", timeout, e, work.group, work.seq, desync._seqs) from e
    if finished is False:
        raise collective_failure(f"wait for {describe(work)}", timeout, None, work.group, work.seq, desync._seqs)


def _event_synchronize(work: InflightWork, event: "torch.cuda.Event") -> None:
    override = errors.timeout_override()
    if override is None:  # NCCL's watchdog bounds it by the group's timeout
        event.synchronize()
        return
    deadline = time.monotonic() + override.total_seconds()
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise collective_failure(f"wait for {describe(work)}", override, None, work.group, work.seq, desync._seqs)
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
