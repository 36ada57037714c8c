"""Waiting for the emulated link on the host: a CPU collective's work, and the bounded sleep behind it.

Contract. A delivery is a ``time.monotonic()`` deadline (from ``timing.LinkModel.book``).
:func:`sleep_within` sleeps until it, never longer than the wait's timeout, and raises
:func:`link_timeout_error` when the link needs longer (see [Note: timeouts behind the link]).
:class:`EmulatedWork` wraps the real collective's ``dist.Work`` so that ``wait``, ``is_completed`` and
``get_future`` honour the deadline, and completion is never earlier than the real work's. Nothing
here books the link or patches torch.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from overlap.errors import wait_timeout

__all__ = ["EmulatedWork", "link_timeout_error", "sleep_within"]

# torch's waits take whole milliseconds (a timedelta under 1 ms reaches them as "no timeout").
_MIN_WAIT = datetime.timedelta(milliseconds=1)


def link_timeout_error(what: str, remaining: float, timeout: datetime.timedelta) -> RuntimeError:
    """What a wait that the link cannot finish within ``timeout`` raises: a RuntimeError whose text
    says "timed out", as torch's ``Work.wait`` does (``overlap`` turns it into CollectiveTimeoutError)."""
    return RuntimeError(
        f"Operation timed out! The emulated link delivers {what} {remaining:.3g} s after the wait began, "
        f"past its timeout of {timeout.total_seconds():g} s"
    )


def sleep_within(deadline: float, timeout: datetime.timedelta, what: str) -> None:
    """Sleep until ``deadline`` (``time.monotonic()``); if that is more than ``timeout`` away, sleep
    ``timeout`` and raise :func:`link_timeout_error` instead. See [Note: timeouts behind the link]."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return
    budget = timeout.total_seconds()
    if remaining > budget:
        time.sleep(budget)
        raise link_timeout_error(what, remaining, timeout)
    time.sleep(remaining)


# [Note: timeouts behind the link]
# The emulated delay is part of the wait, so the wait's timeout bounds it: a wait never blocks longer
# than its timeout, whatever the link's bandwidth (a 12.8 s transfer waited with a 2 s timeout raises
# after 2 s). An explicit timeout (``work.wait(timeout)``, which ``overlap``'s waits always pass:
# ``overlap.wait_timeout``) covers the sleep and then the real work's wait together. A wait without
# one (``work.wait()``, a blocking collective, a compiled ``wait_tensor``) is bounded by the group's
# ``overlap.wait_timeout`` as it was when the collective was issued (the bounded default of
# [Note: wait timeouts] unless ``overlap.set_wait_timeout`` changed it). Running out raises a RuntimeError saying "Operation
# timed out!", like torch's ``Work.wait``; the real collective is left as it is.


class EmulatedWork(dist.Work):
    """A CPU collective's work that completes no sooner than ``deadline`` (``time.monotonic()``).

    ``link_start``: when the link began carrying it (``deadline`` minus its link time; None if not
    given), so that a profiler can place it on the link as the link did (``overlap.profiler``).
    ``default_timeout`` bounds a wait given no timeout (see [Note: timeouts behind the link]); None:
    ``overlap.wait_timeout()`` of the default group at the time of the wait.
    """

    def __init__(self, work: dist.Work, deadline: float,
                 default_timeout: datetime.timedelta | None = None, link_start: float | None = None) -> None:
        super().__init__()
        if default_timeout is not None and not (
                isinstance(default_timeout, datetime.timedelta) and default_timeout > datetime.timedelta(0)):
            raise ValueError(f"default_timeout must be None or a datetime.timedelta > 0, got {default_timeout!r}")
        self._work = work
        self.deadline = deadline
        self.link_start = link_start
        self.default_timeout = default_timeout

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Sleep until the link delivers, then wait the real work, all within ``timeout``
        (``timedelta(0)``: ``default_timeout``); raises RuntimeError ("Operation timed out!") when
        the link or the real work needs longer. See [Note: timeouts behind the link]."""
        if not timeout > datetime.timedelta(0):
            timeout = self.default_timeout if self.default_timeout is not None else wait_timeout()
        start = time.monotonic()
        sleep_within(self.deadline, timeout, "this collective")
        left = timeout - datetime.timedelta(seconds=time.monotonic() - start)
        return self._work.wait(max(left, _MIN_WAIT))

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return time.monotonic() >= self.deadline and self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the real work's value once the link delivers (a timer thread)."""
        fut: torch.futures.Future = torch.futures.Future()

        def _deliver(real: torch.futures.Future) -> None:
            try:
                value = real.value()
            except Exception as e:  # noqa: BLE001 (handed to the waiter)
                fut.set_exception(e)
                return
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                fut.set_result(value)
            else:
                timer = threading.Timer(remaining, fut.set_result, (value,))
                timer.daemon = True
                timer.start()

        self._work.get_future().then(_deliver)
        return fut
