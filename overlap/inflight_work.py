"""Collectives in flight: their completion signal, the buffers they use, and the waits on them.

[Note: buffer lifetime without record_stream]
A collective reads its input buffer and writes its output buffer on the communication stream (or a
gloo thread) while the caller goes on. Both buffers are allocated on the caller's stream, and an
``InflightWork`` holds a reference to them. The reference is dropped only when reuse is safe:
* when a consumer has waited: on CUDA its stream now waits on the collective's event, so every later
  allocation on that stream (the only stream that can reuse these blocks) is ordered after the
  collective; on CPU the work has finished;
* or when a sweep (run at each issue) finds the collective finished (``event.query()`` /
  ``work.is_completed()``), which covers results that are dropped without ever being used.
``record_stream`` is not used: it delays the reuse of every block until the allocator happens to
notice the stream's progress, which over-holds memory in the caching allocator.
"""
from __future__ import annotations

import datetime
import time
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from overlap.regions import region

__all__ = ["InflightWork", "Recorder", "ResultCompletion", "WaitRecord", "track", "sweep", "wait_all", "inflight",
           "inflight_bytes", "set_recorder", "CollectiveError", "CollectiveTimeoutError", "collective_failure", "describe",
           "set_wait_timeout", "wait_timeout"]


class InflightWork:
    """One issued collective: its completion signal and the buffers it must keep alive."""

    __slots__ = ("kind", "nbytes", "group", "seq", "_work", "_event", "_device", "_buffers", "_shapes", "_host_waited", "_record")

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
    ) -> None:
        self.kind = kind
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
        self._record = _recorder.on_issue(kind, nbytes, group, work, event, device) if _recorder is not None else None

    def is_done(self) -> bool:
        """Non-blocking: has the collective finished?"""
        if self._event is not None:
            return self._event.query()
        return self._host_waited or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        """Make the caller's stream (CUDA) or thread (CPU) wait for the collective."""
        timed = self._record is not None and self._record.begin_wait()
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        elif not self._host_waited:
            if self._work is not None:
                _host_wait(self, self._work)  # raises CollectiveError naming this collective
            self._host_waited = True
        self.release()
        if timed:
            self._record.end_wait()

    def synchronize(self) -> None:
        """Block the host until the collective has finished (bounds bytes in flight, also on CUDA)."""
        timed = self._record is not None and self._record.begin_wait()
        if self._event is not None:
            _event_synchronize(self, self._event)
        self.wait()
        if timed:
            self._record.end_wait()

    @property
    def pending(self) -> bool:
        """Not yet waited (or found finished by a sweep)."""
        return self._buffers is not None

    def release(self) -> None:
        """Drop the buffer references and forget this work (safe once waited or done)."""
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
            self._work.wait()
            if self._finish is not None:
                self._finish()
        self._finish = None


_inflight: list[InflightWork] = []


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
                 event: Optional["torch.cuda.Event"], device: Optional[torch.device]) -> Optional[WaitRecord]: ...


_recorder: Optional[Recorder] = None


def set_recorder(recorder: Optional[Recorder]) -> Optional[Recorder]:
    """Install ``recorder`` (``None``: none) for the works issued from now on; returns the previous one.

    With none installed, issuing and waiting cost one ``is None`` check each.
    """
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def track(work: InflightWork) -> InflightWork:
    """Register ``work`` so its buffers outlive it even if every result is dropped unwaited."""
    sweep()
    _inflight.append(work)
    return work


def sweep() -> None:
    """Forget finished works (cheap: a non-blocking query each)."""
    for work in [w for w in _inflight if w.is_done()]:
        work.release()


def wait_all() -> None:
    """Wait (consumer side) for every collective still in flight in this process.

    Results keep their first-use step (e.g. the divide of an avg), which runs when they are used.
    """
    for work in list(_inflight):
        work.wait()


def inflight() -> list[InflightWork]:
    """The collectives issued and not yet waited or found finished."""
    return list(_inflight)


def inflight_bytes() -> int:
    """Bytes moved by the collectives in flight (the quantity ``max_inflight_bytes`` bounds)."""
    return sum(w.nbytes for w in _inflight)


# ----------------------------------------------------------------------------- timeouts and failures
# [Note: wait timeouts]
# A blocking wait never outlasts the wait timeout: the group's own timeout (init_process_group's or
# new_group's ``timeout``) unless ``set_wait_timeout`` overrides it for every group.
# * CPU (gloo): ``work.wait(timeout)``; a wait that times out or fails (a peer died: its connection
#   closed) raises CollectiveTimeoutError / CollectiveError naming the collective.
# * CUDA (NCCL): ``wait`` is a stream wait on the collective's event and never blocks the host; a
#   collective that does not finish is aborted by NCCL's watchdog after the group's timeout (with
#   torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING the process is torn down, so no rank computes on
#   garbage). ``synchronize`` (the host waits: ``max_inflight_bytes``, ``no_overlap``) blocks on the
#   event, which the watchdog's abort also ends; with an override set, it polls the event instead and
#   raises CollectiveTimeoutError at the deadline.


class CollectiveError(RuntimeError):
    """A collective failed while being waited (e.g. a rank of its group died); names kind, seq, group."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not finish within the wait timeout; names kind, bytes, shapes, group, seq."""


_timeout_override: Optional[datetime.timedelta] = None
_group_timeouts: dict[str, tuple[object, datetime.timedelta]] = {}  # name -> (process group, its timeout)


def set_wait_timeout(timeout: "float | datetime.timedelta | None") -> Optional[datetime.timedelta]:
    """Bound every blocking wait by ``timeout`` (seconds or a timedelta, > 0); ``None``: each process
    group's own timeout (the default). Returns the previous override. See [Note: wait timeouts]."""
    global _timeout_override
    if timeout is not None:
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = datetime.timedelta(seconds=timeout)
        if not isinstance(timeout, datetime.timedelta) or not timeout > datetime.timedelta(0):
            raise ValueError(f"set_wait_timeout: timeout must be None, a number of seconds > 0 or a timedelta > 0, "
                             f"got {timeout!r}")
    previous, _timeout_override = _timeout_override, timeout
    return previous


def wait_timeout(group: str = "", device_type: str = "cpu") -> datetime.timedelta:
    """How long a wait on a collective of ``group`` (a process group name; default WORLD) may block."""
    if not isinstance(group, str):
        raise TypeError(f"wait_timeout: group must be a process group name (str; '' for WORLD), got {type(group).__name__}")
    if _timeout_override is not None:
        return _timeout_override
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group) if group else c10d._get_default_group()
    except (RuntimeError, ValueError):  # destroyed, or never initialized
        return c10d.default_pg_timeout
    cached = _group_timeouts.get(group)
    if cached is not None and cached[0] is pg:
        return cached[1]
    try:
        timeout = pg._get_backend(torch.device(device_type)).options._timeout
    except (RuntimeError, AttributeError):  # no backend for this device, or no options on it
        timeout = c10d.default_pg_timeout
    _group_timeouts[group] = (pg, timeout)
    return timeout


def describe(work: InflightWork) -> str:
    """``all_gather #12 on group '0' (4096 bytes: float32[8, 128])``: what errors name a collective by."""
    shapes = " ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape in work._shapes)
    return f"{work.kind} #{work.seq} on group {work.group!r} ({work.nbytes} bytes: {shapes})"


def collective_failure(what: str, timeout: datetime.timedelta, cause: Optional[BaseException]) -> CollectiveError:
    """The error for ``what`` (``wait for <collective>``, or a check before one) that timed out after
    ``timeout`` (``cause`` None or a timeout) or failed with ``cause`` (e.g. a peer's connection closed)."""
    detail = f" ({cause})" if cause is not None else ""
    text = str(cause).lower()
    if cause is None or "timed out" in text or "timeout" in text:
        return CollectiveTimeoutError(
            f"overlap: {what} timed out after {timeout.total_seconds():g} s: a rank of the group did not get "
            f"there (it issued fewer collectives on this group, is stuck, or died){detail}"
        )
    return CollectiveError(f"overlap: {what} failed: a rank of the group failed or died{detail}")


def _host_wait(work: InflightWork, handle: dist.Work) -> None:
    timeout = wait_timeout(work.group)
    try:
        finished = handle.wait(timeout)
    except RuntimeError as e:
        raise collective_failure(f"wait for {describe(work)}", timeout, e) from e
    if finished is False:
        raise collective_failure(f"wait for {describe(work)}", timeout, None)


def _event_synchronize(work: InflightWork, event: "torch.cuda.Event") -> None:
    if _timeout_override is None:  # NCCL's watchdog bounds it by the group's timeout
        event.synchronize()
        return
    deadline = time.monotonic() + _timeout_override.total_seconds()
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise collective_failure(f"wait for {describe(work)}", _timeout_override, None)
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
