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

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from overlap.regions import region

__all__ = ["InflightWork", "ResultCompletion", "track", "sweep", "wait_all", "inflight", "inflight_bytes"]


class InflightWork:
    """One issued collective: its completion signal and the buffers it must keep alive."""

    __slots__ = ("kind", "nbytes", "_work", "_event", "_device", "_buffers", "_host_waited")

    def __init__(
        self,
        kind: str,
        nbytes: int,
        buffers: Sequence[torch.Tensor],
        work: Optional[dist.Work] = None,
        event: Optional["torch.cuda.Event"] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        self.kind = kind
        self._device = device
        self.nbytes = nbytes
        self._work = work
        self._event = event
        self._buffers: Optional[tuple] = tuple(buffers)
        self._host_waited = False

    def is_done(self) -> bool:
        """Non-blocking: has the collective finished?"""
        if self._event is not None:
            return self._event.query()
        return self._host_waited or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        """Make the caller's stream (CUDA) or thread (CPU) wait for the collective."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        elif not self._host_waited:
            if self._work is not None:
                self._work.wait()
            self._host_waited = True
        self.release()

    def synchronize(self) -> None:
        """Block the host until the collective has finished (bounds bytes in flight, also on CUDA)."""
        if self._event is not None:
            self._event.synchronize()
        self.wait()

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
