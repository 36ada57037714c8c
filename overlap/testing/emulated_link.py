"""An emulated interconnect: collectives complete no sooner than a modelled link allows.

``with emulated_link(gbps, latency_us) as link:`` replaces the collective functions on
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (both names are used, by users and
by torch itself, e.g. FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``) with
wrappers that delay completion; leaving the context restores the originals. Contexts nest (the
innermost active link models every call; the functions are restored when the outermost exits) and
may be entered from several threads. The patch is process-wide while any link is active.

Timing model. Each process group has one FIFO link. A collective issued (host time) at ``t`` starts
at ``max(t, busy_until)`` and completes at ``start + latency + wire_bytes / bandwidth``; that
completion time becomes the group's ``busy_until``. ``bandwidth = gbps * 1e9 / 8`` bytes/s
(**gigabits** per second). ``wire_bytes`` is what each rank receives, ``w`` the group size:

=============================================================  ==============================
collective                                                     wire_bytes
=============================================================  ==============================
all_gather_single, all_gather_into_tensor, _all_gather_base    (w-1)/w * output bytes
all_gather                                                     (w-1)/w * bytes of output list
reduce_scatter_single, reduce_scatter_tensor, _reduce_scatter_base  (w-1)/w * input bytes
reduce_scatter                                                 (w-1)/w * bytes of input list
all_reduce                                                     2(w-1)/w * bytes (ring)
broadcast                                                      bytes (every rank, src included)
all_to_all_single, all_to_all                                  (w-1)/w * input bytes
any collective with w == 1                                     no delay (0 s, not even latency)
=============================================================  ==============================

CPU tensors. The wrapper issues the real collective with ``async_op=True`` and returns an
:class:`EmulatedWork` whose ``wait()`` sleeps (``time.sleep``: no CPU burnt) until the modelled
completion time, then waits the real work; ``is_completed()`` and ``get_future()`` honour the
completion time too. With ``async_op=False`` the wrapper itself waits before returning. Completion is
never earlier than the real collective's.

CUDA tensors. Instead of a host sleep, ``torch.cuda._sleep`` is enqueued on the current stream for
the collective's link time (``latency + wire_bytes / bandwidth``) just before the real collective,
so that stream (the caller's communication stream) is busy without blocking the host; the real
``Work`` is returned as is. Cycles per second are calibrated once per device with CUDA events.
The FIFO order is the stream's own order; ``busy_until`` is not used on CUDA.

Not covered: functional collectives (``torch.ops._c10d_functional.*``, hence traced/compiled code
and DTensor redistribution), calls inside ``dist._coalescing_manager``, calls under
``torch.compile`` tracing, and modules that bound a collective with ``from torch.distributed import
all_reduce`` before the link was entered. These run at full speed and are not counted.

Statistics. ``link.stats()`` totals (count, wire bytes, emulated link seconds, calls per op) over
all groups since the link was created or :meth:`EmulatedLink.reset_stats`;
``link.stats_by_group()`` gives the same per process group name. :func:`current_link` returns the
innermost active link of this process (e.g. inside ``run_distributed(fn, 2, link=(gbps, lat))``).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import inspect
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["EmulatedLink", "EmulatedWork", "LinkStats", "current_link", "emulated_link"]


def _gather_factor(w: int) -> float:
    return (w - 1) / w


def _ring_all_reduce_factor(w: int) -> float:
    return 2 * (w - 1) / w


def _whole(w: int) -> float:
    return 1.0


# collective name -> (argument holding the tensors whose bytes count, wire-bytes factor of group size)
_COLLECTIVES: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_gather_single": ("output_tensor", _gather_factor),
    "all_gather_into_tensor": ("output_tensor", _gather_factor),
    "_all_gather_base": ("output_tensor", _gather_factor),
    "all_gather": ("tensor_list", _gather_factor),
    "reduce_scatter_single": ("input", _gather_factor),
    "reduce_scatter_tensor": ("input", _gather_factor),
    "_reduce_scatter_base": ("input", _gather_factor),
    "reduce_scatter": ("input_list", _gather_factor),
    "all_reduce": ("tensor", _ring_all_reduce_factor),
    "broadcast": ("tensor", _whole),
    "all_to_all_single": ("input", _gather_factor),
    "all_to_all": ("input_tensor_list", _gather_factor),
}
_MODULES: tuple[ModuleType, ...] = (dist, c10d)


@dataclass(frozen=True)
class LinkStats:
    """What a link carried: collectives, bytes received per rank, and modelled link seconds."""

    count: int = 0
    wire_bytes: int = 0
    emulated_seconds: float = 0.0
    by_op: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: LinkStats) -> LinkStats:
        by_op = collections.Counter(self.by_op)
        by_op.update(other.by_op)
        return LinkStats(
            self.count + other.count,
            self.wire_bytes + other.wire_bytes,
            self.emulated_seconds + other.emulated_seconds,
            dict(by_op),
        )


@dataclass
class _GroupLink:
    busy_until: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)


class EmulatedWork(dist.Work):
    """A CPU collective's work that completes no sooner than ``deadline`` (``time.monotonic()``)."""

    def __init__(self, work: dist.Work, deadline: float) -> None:
        super().__init__()
        self._work = work
        self.deadline = deadline

    def _sleep_to_deadline(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Sleep until the link delivers, then wait the real work (``timeout`` applies to that)."""
        self._sleep_to_deadline()
        return self._work.wait(timeout) if timeout else self._work.wait()

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


class EmulatedLink:
    """A modelled interconnect (see the module docstring); a context manager that activates it."""

    def __init__(self, gbps: float, latency_us: float = 10.0) -> None:
        if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"gbps (link bandwidth in gigabits/s) must be a finite number > 0, got {gbps!r}")
        if not (isinstance(latency_us, (int, float)) and math.isfinite(latency_us) and latency_us >= 0):
            raise ValueError(f"latency_us (per-collective latency in µs) must be a finite number >= 0, got {latency_us!r}")
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        self._lock = threading.Lock()
        self._groups: dict[Any, _GroupLink] = {}
        self._names: dict[Any, str] = {}

    def __repr__(self) -> str:
        return f"EmulatedLink(gbps={self.gbps}, latency_us={self.latency_us})"

    @property
    def bytes_per_second(self) -> float:
        return self.gbps * 1e9 / 8

    def transfer_seconds(self, wire_bytes: float) -> float:
        """Link time of one collective that delivers ``wire_bytes`` to each rank."""
        return self.latency_us * 1e-6 + wire_bytes / self.bytes_per_second

    def _schedule(self, group: Any, op: str, wire_bytes: int, seconds: float, issued: float) -> float:
        """Book ``seconds`` of the group's FIFO link from ``issued``; return the completion time."""
        with self._lock:
            state = self._groups.get(group)
            if state is None:
                state = self._groups[group] = _GroupLink()
                self._names[group] = getattr(group, "group_name", "") or str(len(self._names))
            done = max(issued, state.busy_until) + seconds
            state.busy_until = done
            state.stats = state.stats + LinkStats(1, wire_bytes, seconds, {op: 1})
            return done

    def stats(self) -> LinkStats:
        """Totals over every process group this link has carried."""
        with self._lock:
            return sum((s.stats for s in self._groups.values()), LinkStats())

    def stats_by_group(self) -> dict[str, LinkStats]:
        """Totals per process group, keyed by group name."""
        with self._lock:
            return {self._names[g]: s.stats for g, s in self._groups.items()}

    def reset_stats(self) -> None:
        with self._lock:
            for state in self._groups.values():
                state.stats = LinkStats()

    def __enter__(self) -> EmulatedLink:
        _activate(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _deactivate(self)


def emulated_link(gbps: float, latency_us: float = 10.0) -> EmulatedLink:
    """A link of ``gbps`` gigabits/s and ``latency_us`` µs per collective; use it with ``with``."""
    return EmulatedLink(gbps, latency_us)


# --- patching -----------------------------------------------------------------------------------

_state_lock = threading.RLock()
_active: list[EmulatedLink] = []
_patched: dict[tuple[ModuleType, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
_local = threading.local()  # .inside: a wrapper is running in this thread (inner calls pass through)


def current_link() -> EmulatedLink | None:
    """The innermost active link of this process, or None."""
    with _state_lock:
        return _active[-1] if _active else None


def _activate(link: EmulatedLink) -> None:
    with _state_lock:
        if not _active:
            for module in _MODULES:
                for name, (arg, factor) in _COLLECTIVES.items():
                    original = getattr(module, name, None)
                    if original is not None:
                        wrapper = _wrap(name, original, arg, factor)
                        _patched[(module, name)] = (original, wrapper)
                        setattr(module, name, wrapper)
        _active.append(link)


def _deactivate(link: EmulatedLink) -> None:
    with _state_lock:
        # Remove the innermost entry of this link (exits from threads need not be LIFO).
        index = len(_active) - 1 - _active[::-1].index(link)
        del _active[index]
        if _active:
            return
        for (module, name), (original, wrapper) in _patched.items():
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
            else:
                warnings.warn(
                    f"{module.__name__}.{name} was replaced while an emulated link was active; "
                    "leaving the replacement in place",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _patched.clear()


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    outer = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = outer


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)] if value is not None else []


def _wrap(
    name: str, original: Callable[..., Any], arg: str, factor: Callable[[int], float]
) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        link = current_link()
        if link is None or getattr(_local, "inside", False) or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if not dist.is_initialized() or c10d._rank_not_in_group(group):
            return original(*args, **kwargs)  # let torch report or skip it
        group = group if group is not None else c10d._get_default_group()
        if group in c10d._world.pg_coalesce_state:
            return original(*args, **kwargs)
        tensors = _tensors(bound.arguments.get(arg))
        world = group.size()
        if world > 1:
            wire_bytes = int(sum(t.numel() * t.element_size() for t in tensors) * factor(world))
            seconds = link.transfer_seconds(wire_bytes)
        else:
            wire_bytes, seconds = 0, 0.0
        if tensors and tensors[0].is_cuda:
            link._schedule(group, name, wire_bytes, seconds, time.monotonic())
            if seconds > 0:
                _cuda_sleep(seconds, tensors[0].device)
            with _inside():
                return original(*args, **kwargs)
        async_op = bool(bound.arguments.get("async_op", False))
        bound.arguments["async_op"] = True
        issued = time.monotonic()
        with _inside():
            work = original(*bound.args, **bound.kwargs)
        deadline = link._schedule(group, name, wire_bytes, seconds, issued)
        emulated = EmulatedWork(work, deadline)
        if async_op:
            return emulated
        emulated.wait()
        return None

    return wrapper


_cycles_per_second: dict[int, float] = {}


def _cuda_sleep(seconds: float, device: torch.device) -> None:
    """Keep the current CUDA stream busy for ``seconds`` without blocking the host."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _cycles_per_second.get(index)
    if rate is None:
        rate = _cycles_per_second[index] = _calibrate_cuda_sleep(index)
    torch.cuda._sleep(max(1, int(seconds * rate)))


def _calibrate_cuda_sleep(index: int, cycles: int = 20_000_000) -> float:
    with torch.cuda.device(index), torch.cuda.stream(torch.cuda.Stream()):
        rate = 0.0
        for _ in range(2):  # the first launch warms up
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rate = cycles / (start.elapsed_time(end) * 1e-3)
    return rate
