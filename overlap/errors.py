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
           "timeout_for", "timeout_override", "default_timeout", "observe_step", "MIN_WAIT_TIMEOUT_S",
           "MAX_WAIT_TIMEOUT_S", "DEFAULT", "DEFAULT_FLOOR_S", "DEBUG_FLOOR_S", "STEP_FACTOR", "FLOOR_ENV"]

# [Note: wait timeouts]
# A blocking wait never outlasts the wait timeout. Unless ``set_wait_timeout`` overrides it for every
# group, it is chosen per group as
#     min(the group's own timeout, max(floor, STEP_FACTOR x the slowest step seen so far))
# with floor = DEFAULT_FLOOR_S (300 s; OVERLAP_WAIT_TIMEOUT_FLOOR in seconds changes it). A step is
# the time between two forward passes of a sharded root (``overlap.shard``: optimizer step, data
# loading and logging included), the slowest this process has seen. Why so: a healthy rank is late
# at a collective by at most what separates it from its peers' arrival, which is the compute between
# two collectives, at most a step (plus rank-dependent pauses between steps); five times the slowest
# step, never under five minutes, covers jitter, a first step that compiles, and the usual pauses,
# while a rank that stopped (it caught an exception, or is stuck in user code) is found in minutes
# instead of the process group's 30. Work done on some ranks only for longer than that (a checkpoint
# written by rank 0 alone, evaluation on rank 0) needs ``set_wait_timeout`` (or ``None``: the group's
# own timeout, the old default). The debug check (``overlap.desync``), where every rank meets every
# collective, has a floor of DEBUG_FLOOR_S (30 s, or the floor above if smaller).
# * CPU (gloo): ``work.wait(timeout)``; a wait that times out or fails (a peer died: its connection
#   closed) raises CollectiveTimeoutError / CollectiveError naming the collective, and for a timeout
#   which ranks have not issued it (``overlap.arrivals``: each rank's counts, published in the store
#   once they stop changing).
# * CUDA (NCCL): ``wait`` is a stream wait on the collective's event and never blocks the host; a
#   collective that does not finish is aborted by NCCL's watchdog after the group's timeout (with
#   torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING the process is torn down, so no rank computes on
#   garbage). ``synchronize`` (the host waits: ``max_inflight_bytes``, ``no_overlap``) blocks on the
#   event, which the watchdog's abort also ends; with an override set, it polls the event instead and
#   raises CollectiveTimeoutError at the deadline.


class CollectiveError(RuntimeError):
    """A collective failed while being waited (e.g. a rank of its group died); names kind, seq, group.

    ``group`` and ``seq`` say which collective (``""`` / ``-1`` where not known)."""

    def __init__(self, message: str, group: str = "", seq: int = -1) -> None:
        super().__init__(message)
        self.group, self.seq = group, seq


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not finish within the wait timeout; names kind, bytes, shapes, group, seq, and
    the ranks that have not issued it. ``missing`` maps each such global rank to the number of the last
    collective it issued on the group (None: none reported); None when that could not be read."""

    def __init__(self, message: str, group: str = "", seq: int = -1,
                 missing: Optional[dict[int, Optional[int]]] = None) -> None:
        super().__init__(message, group, seq)
        self.missing = missing


DEFAULT = "default"
"""``set_wait_timeout(DEFAULT)``: the bounded default of [Note: wait timeouts] (the initial setting)."""
_timeout_override: "datetime.timedelta | str | None" = DEFAULT  # a fixed bound, DEFAULT, or None (off)
DEFAULT_FLOOR_S = 300.0
DEBUG_FLOOR_S = 30.0
STEP_FACTOR = 5.0
FLOOR_ENV = "OVERLAP_WAIT_TIMEOUT_FLOOR"
_floor_s: Optional[float] = None  # DEFAULT_FLOOR_S or OVERLAP_WAIT_TIMEOUT_FLOOR, read at the first wait
_slowest_step_s = 0.0
_group_timeouts: dict[tuple[str, str], tuple[object, datetime.timedelta]] = {}
"""(group name, device type) -> (the process group it named when read, its backend's timeout): a group
destroyed and made again under the same name (names restart from the same counter after
``destroy_process_group``) is a new object, so its timeout is read again."""


# torch's waits take whole milliseconds (less reaches them as 0: "no timeout"); the upper end keeps the
# conversion to C++ durations in range.
MIN_WAIT_TIMEOUT_S = 1e-3
MAX_WAIT_TIMEOUT_S = 1e9
_TIMEOUT_ALLOWED = (f"'default', None, a number of seconds or a datetime.timedelta, from {MIN_WAIT_TIMEOUT_S:g} s (1 ms) "
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


def set_wait_timeout(timeout: "float | datetime.timedelta | str | None") -> "datetime.timedelta | str | None":
    """Bound every blocking wait (and debug check) by ``timeout``: seconds or a timedelta (1 ms to 1e9 s)
    for every group; ``'default'`` (``overlap.errors.DEFAULT``, the initial setting): the bound chosen
    per group from the step time (see [Note: wait timeouts]); ``None``: off, each process group's own
    timeout (30 minutes unless the group was made with another).

    Returns the previous setting (pass it back to restore it). Raises ``TypeError`` / ``ValueError``
    naming the value passed, before changing anything."""
    global _timeout_override
    value: "datetime.timedelta | str | None" = timeout if timeout is None or (isinstance(timeout, str) and timeout == DEFAULT) else None
    if value is None and timeout is not None:
        seconds = _timeout_seconds(timeout)
        value = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=seconds)
    previous, _timeout_override = _timeout_override, value
    return previous


def wait_timeout(group: str = "", device_type: str = "cpu") -> datetime.timedelta:
    """How long a wait on a collective of ``group`` (a process group's name, ``ProcessGroup.group_name``;
    '' for WORLD) may block, as :func:`set_wait_timeout` set it: a fixed bound, the default of
    [Note: wait timeouts] (:func:`default_timeout` of the group's own timeout), or the group's own
    timeout (torch's default one when no default group exists).

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


def timeout_for(group: str, device_type: str = "cpu", check: bool = False) -> datetime.timedelta:
    """:func:`wait_timeout` without the argument checks; a destroyed group gets torch's default.
    ``check``: the timeout of a debug check (its floor is ``DEBUG_FLOOR_S``)."""
    setting = _timeout_override
    if isinstance(setting, datetime.timedelta):
        return setting
    if setting is None:
        return _group_timeout(group, device_type)
    floor = _floor_s if _floor_s is not None else _read_floor()
    if check:
        floor = min(floor, DEBUG_FLOOR_S)
    return default_timeout(_group_timeout(group, device_type), floor, _slowest_step_s)


def _group_timeout(group: str, device_type: str) -> datetime.timedelta:
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group) if group else c10d._get_default_group()
    except (RuntimeError, ValueError):  # destroyed, or never initialized
        return c10d.default_pg_timeout
    key = (group, device_type)
    cached = _group_timeouts.get(key)
    if cached is not None and cached[0] is pg:
        return cached[1]
    try:
        timeout = pg._get_backend(torch.device(device_type)).options._timeout
    except (RuntimeError, AttributeError):  # no backend for this device, or no options on it
        timeout = c10d.default_pg_timeout
    _group_timeouts[key] = (pg, timeout)
    return timeout


def default_timeout(group_timeout: datetime.timedelta, floor_s: float, slowest_step_s: float) -> datetime.timedelta:
    """The default wait timeout: ``min(group_timeout, max(floor_s, STEP_FACTOR * slowest_step_s))``
    (see [Note: wait timeouts]). Pure: for tests and for reading the rule."""
    return min(group_timeout, datetime.timedelta(seconds=max(floor_s, STEP_FACTOR * slowest_step_s)))


def _read_floor() -> float:
    global _floor_s
    import os

    text = os.environ.get(FLOOR_ENV, "").strip()
    if not text:
        _floor_s = DEFAULT_FLOOR_S
        return _floor_s
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and MIN_WAIT_TIMEOUT_S <= value <= MAX_WAIT_TIMEOUT_S):
        raise ValueError(f"{FLOOR_ENV} must be a number of seconds from {MIN_WAIT_TIMEOUT_S:g} to "
                         f"{MAX_WAIT_TIMEOUT_S:g} (the floor of the default wait timeout), got {text!r}")
    _floor_s = value
    return _floor_s


def observe_step(seconds: float) -> None:
    """Record a step of ``seconds`` (``overlap.shard``'s root calls it at each forward after the first);
    the default wait timeout follows the slowest one (see [Note: wait timeouts])."""
    global _slowest_step_s
    if seconds > _slowest_step_s:
        _slowest_step_s = seconds


def timeout_override() -> Optional[datetime.timedelta]:
    """The fixed timeout ``set_wait_timeout`` set for every group, or None (the default, or off)."""
    setting = _timeout_override
    return setting if isinstance(setting, datetime.timedelta) else None


def collective_failure(what: str, timeout: datetime.timedelta, cause: Optional[BaseException], group: str = "",
                       seq: int = -1, mine: Optional[dict[str, int]] = None) -> CollectiveError:
    """The error for ``what`` (``wait for <collective>``, or a check before one) that timed out after
    ``timeout`` (``cause`` None or a timeout) or failed with ``cause`` (e.g. a peer's connection closed).
    For a timeout with ``group`` and ``seq`` known, it names the ranks that have not issued ``#seq``
    (``mine``: this rank's counts per group, see ``overlap.arrivals``)."""
    detail = f" ({cause})" if cause is not None else ""
    text = str(cause).lower()
    if cause is None or "timed out" in text or "timeout" in text:
        from overlap import arrivals

        behind = arrivals.missing(group, seq, mine or {}) if seq >= 0 else None
        return CollectiveTimeoutError(
            f"overlap: {what} timed out after {timeout.total_seconds():g} s: a rank of the group did not get "
            f"there (it issued fewer collectives on this group, is stuck, or died){detail}"
            f"{arrivals.describe_missing(group, seq, behind)}. The timeout is overlap.wait_timeout() "
            f"(overlap.set_wait_timeout changes it)",
            group, seq, behind,
        )
    return CollectiveError(f"overlap: {what} failed: a rank of the group failed or died{detail}", group, seq)
