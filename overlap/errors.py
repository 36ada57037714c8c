"""The errors a wait on a collective raises, and how long a wait may block.

``CollectiveError`` / ``CollectiveTimeoutError`` name the collective (``overlap.inflight_work.describe``);
``set_wait_timeout`` / ``wait_timeout`` set and read the bound on every blocking wait (see
[Note: wait timeouts]). Nothing here issues or waits for a collective.
"""
from __future__ import annotations

import datetime
import math
import numbers
from typing import Optional

import torch

__all__ = ["CollectiveError", "CollectiveTimeoutError", "collective_failure", "set_wait_timeout", "wait_timeout",
           "timeout_for", "timeout_override", "MIN_WAIT_TIMEOUT_S", "MAX_WAIT_TIMEOUT_S"]

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


# torch's waits take whole milliseconds (less reaches them as 0: "no timeout"); the upper end keeps the
# conversion to C++ durations in range.
MIN_WAIT_TIMEOUT_S = 1e-3
MAX_WAIT_TIMEOUT_S = 1e9
_TIMEOUT_ALLOWED = (f"None, a number of seconds or a datetime.timedelta, from {MIN_WAIT_TIMEOUT_S:g} s (1 ms) "
                    f"to {MAX_WAIT_TIMEOUT_S:g} s")


def _timeout_seconds(timeout: object) -> float:
    """``timeout`` (a real number of seconds or a timedelta) in seconds; raises naming what was passed."""
    if isinstance(timeout, bool) or not isinstance(timeout, (numbers.Real, datetime.timedelta)):
        raise TypeError(f"set_wait_timeout: timeout must be {_TIMEOUT_ALLOWED}; got {type(timeout).__name__} "
                        f"{timeout!r}")
    try:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    except OverflowError:
        seconds = math.inf
    if not (math.isfinite(seconds) and MIN_WAIT_TIMEOUT_S <= seconds <= MAX_WAIT_TIMEOUT_S):
        raise ValueError(f"set_wait_timeout: timeout must be {_TIMEOUT_ALLOWED}; got {timeout!r}")
    return seconds


def set_wait_timeout(timeout: "float | datetime.timedelta | None") -> Optional[datetime.timedelta]:
    """Bound every blocking wait by ``timeout`` (seconds or a timedelta, 1 ms to 1e9 s); ``None``: each
    process group's own timeout (the default). Returns the previous override. Raises ``TypeError`` /
    ``ValueError`` naming the value passed, before changing anything. See [Note: wait timeouts]."""
    global _timeout_override
    value: Optional[datetime.timedelta] = None
    if timeout is not None:
        seconds = _timeout_seconds(timeout)
        value = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=seconds)
    previous, _timeout_override = _timeout_override, value
    return previous


def wait_timeout(group: str = "", device_type: str = "cpu") -> datetime.timedelta:
    """How long a wait on a collective of ``group`` (a process group's name, ``ProcessGroup.group_name``;
    '' for WORLD) may block: the override of :func:`set_wait_timeout`, else the group's own timeout
    (torch's default one when no default group exists).

    Raises ``TypeError`` for a ``group`` or ``device_type`` that is not a str, ``ValueError`` for a
    name no live process group has, or a ``device_type`` that names no device type.
    """
    from torch.distributed import distributed_c10d as c10d

    if not isinstance(group, str):
        raise TypeError(f"wait_timeout: group must be a process group name (str; '' for WORLD), got {type(group).__name__}")
    if not isinstance(device_type, str):
        raise TypeError(f"wait_timeout: device_type must be a device type name such as 'cpu' or 'cuda', got "
                        f"{type(device_type).__name__}")
    try:
        torch.device(device_type)
    except RuntimeError:
        raise ValueError(f"wait_timeout: device_type must be a device type name such as 'cpu' or 'cuda', got "
                         f"{device_type!r}") from None
    if group:
        try:
            c10d._resolve_process_group(group)
        except (RuntimeError, ValueError):
            raise ValueError(f"wait_timeout: group {group!r} is not the name of a live process group; pass '' "
                             f"(WORLD) or a ProcessGroup's group_name") from None
    return timeout_for(group, device_type)


def timeout_for(group: str, device_type: str = "cpu") -> datetime.timedelta:
    """:func:`wait_timeout` without the argument checks; a destroyed group gets torch's default."""
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


def timeout_override() -> Optional[datetime.timedelta]:
    """The timeout ``set_wait_timeout`` set for every group, or None (each group's own)."""
    return _timeout_override


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
