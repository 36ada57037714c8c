"""An emulated interconnect: collectives complete no sooner than a modelled link allows.

``with emulated_link(gbps, latency_us) as link:`` replaces the collective functions on
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (both names are used, by users and
by torch itself, e.g. FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``) with
wrappers that delay completion, and, with ``functional=True``, registers CPU kernels for torch's
functional collectives that do the same (see "Functional collectives" below); leaving the context
restores the originals. Contexts nest (the innermost active link models every call; everything is
restored when the outermost exits) and may be entered from several threads. The patch is
process-wide while any link is active.

Timing model. Each process group has one FIFO link (its speed: ``gbps`` and ``latency_us``, or
another tier's, see [Note: two-tier links]). A collective issued (host time) at ``t`` starts
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
never earlier than the real collective's. Every such wait, functional ``wait_tensor`` included, is
bounded by its timeout, emulated delay included (see [Note: timeouts behind the link]).

CUDA tensors. Instead of a host sleep, ``torch.cuda._sleep`` is enqueued on the current stream for
the collective's link time (``latency + wire_bytes / bandwidth``) just before the real collective,
so that stream (the caller's communication stream) is busy without blocking the host; the real
``Work`` is returned as is. Cycles per second are calibrated once per device with CUDA events.
The FIFO order is the stream's own order; ``busy_until`` is not used on CUDA.

Functional collectives (``torch.ops._c10d_functional.*``: what ``torch.distributed.
_functional_collectives``, DTensor, ``make_fx`` graphs and Inductor's generated code call at run
time), on CPU tensors, while a link made with ``functional=True`` is active (an inner link without
it does not remove them). Inductor's code looks the ops up by attribute at run time
(``torch.ops._c10d_functional.all_gather_into_tensor.default(...)``), but replacing those Python
attributes would break every identity check (``target is ...wait_tensor.default``) in the tracers,
Inductor and the overlap graph pass. So the link registers its own kernel for the ops' ``CPU``
dispatch key with ``torch.library`` instead: torch implements them as ``CompositeExplicitAutograd``
kernels, which a ``CPU`` kernel takes precedence over; ours adds the timing and runs torch's kernel
by redispatching with the GIL released (see [Note: calling torch's kernel without the GIL]). Op
objects, graphs and fake-tensor tracing are untouched, and compiling while a link is active is
fine. An issuing op (table below) books the group's FIFO link like any other collective and records
the completion time against the storage of each of its outputs; ``wait_tensor`` on that storage
(the output or a view of it) sleeps until then, then runs the real wait. A second wait finds
nothing recorded and does not sleep. An output with no bytes (an empty tensor) is booked but not
delayed at its wait. Statistics name these ops ``_c10d_functional.<op>``. The registration is
removed when the outermost link exits, and a result waited after that is not delayed.

==================================================================  ============================
functional op (``_c10d_functional.``)                               wire_bytes
==================================================================  ============================
all_gather_into_tensor, all_gather_into_tensor_out, ..._coalesced   (w-1)/w * output bytes
reduce_scatter_tensor, reduce_scatter_tensor_coalesced              (w-1)/w * input bytes
all_reduce, all_reduce_, all_reduce_coalesced, ..._coalesced_      2(w-1)/w * bytes (ring)
all_to_all_single                                                   (w-1)/w * input bytes
broadcast, broadcast_                                               bytes
==================================================================  ============================

A ``_coalesced`` op is one collective (one booking) for all of its tensors.

Not covered: functional collectives unless a link with ``functional=True`` is active, functional
collectives on CUDA tensors (their kernel runs on the ``CUDA`` key, and sleeping on the caller's
stream would stall its compute, not a link), functional collectives on a torch where these ops have
kernels of their own on the ``CPU`` or ``PrivateUse1`` key (a warning, then full speed), calls
inside ``dist._coalescing_manager``, and modules that bound a collective with ``from
torch.distributed import all_reduce`` before the link was entered. These run at full speed and are
not counted.

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
import numbers
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from overlap.errors import wait_timeout

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

_FUNCTIONAL_NAMESPACE = "_c10d_functional"
# functional op -> (whose bytes count: its first argument "input" or its result "output",
#                   wire-bytes factor of group size); each takes a ``group_name`` argument
_FUNCTIONAL: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_gather_into_tensor": ("output", _gather_factor),
    "all_gather_into_tensor_out": ("output", _gather_factor),
    "all_gather_into_tensor_coalesced": ("output", _gather_factor),
    "reduce_scatter_tensor": ("input", _gather_factor),
    "reduce_scatter_tensor_coalesced": ("input", _gather_factor),
    "all_reduce": ("input", _ring_all_reduce_factor),
    "all_reduce_": ("input", _ring_all_reduce_factor),
    "all_reduce_coalesced": ("input", _ring_all_reduce_factor),
    "all_reduce_coalesced_": ("input", _ring_all_reduce_factor),
    "all_to_all_single": ("input", _gather_factor),
    "broadcast": ("input", _whole),
    "broadcast_": ("input", _whole),
}


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


# torch's waits take whole milliseconds (a timedelta under 1 ms reaches them as "no timeout").
_MIN_WAIT = datetime.timedelta(milliseconds=1)


def _link_timeout_error(what: str, remaining: float, timeout: datetime.timedelta) -> RuntimeError:
    """What a wait that the link cannot finish within ``timeout`` raises: a RuntimeError whose text
    says "timed out", as torch's ``Work.wait`` does (``overlap`` turns it into CollectiveTimeoutError)."""
    return RuntimeError(
        f"Operation timed out! The emulated link delivers {what} {remaining:.3g} s after the wait began, "
        f"past its timeout of {timeout.total_seconds():g} s"
    )


def _sleep_within(deadline: float, timeout: datetime.timedelta, what: str) -> None:
    """Sleep until ``deadline`` (``time.monotonic()``); if that is more than ``timeout`` away, sleep
    ``timeout`` and raise :func:`_link_timeout_error` instead. See [Note: timeouts behind the link]."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return
    budget = timeout.total_seconds()
    if remaining > budget:
        time.sleep(budget)
        raise _link_timeout_error(what, remaining, timeout)
    time.sleep(remaining)


# [Note: timeouts behind the link]
# The emulated delay is part of the wait, so the wait's timeout bounds it: a wait never blocks longer
# than its timeout, whatever the link's bandwidth (a 12.8 s transfer waited with a 2 s timeout raises
# after 2 s). An explicit timeout (``work.wait(timeout)``, which ``overlap``'s waits always pass:
# ``overlap.wait_timeout``) covers the sleep and then the real work's wait together. A wait without
# one (``work.wait()``, a blocking collective, a compiled ``wait_tensor``) is bounded by the group's
# ``overlap.wait_timeout`` as it was when the collective was issued (the group's own timeout unless
# ``overlap.set_wait_timeout`` overrides it). Running out raises a RuntimeError saying "Operation
# timed out!", like torch's ``Work.wait``; the real collective is left as it is.


class EmulatedWork(dist.Work):
    """A CPU collective's work that completes no sooner than ``deadline`` (``time.monotonic()``).

    ``default_timeout`` bounds a wait given no timeout (see [Note: timeouts behind the link]); None:
    ``overlap.wait_timeout()`` of the default group at the time of the wait.
    """

    def __init__(self, work: dist.Work, deadline: float,
                 default_timeout: datetime.timedelta | None = None) -> None:
        super().__init__()
        if default_timeout is not None and not (
                isinstance(default_timeout, datetime.timedelta) and default_timeout > datetime.timedelta(0)):
            raise ValueError(f"default_timeout must be None or a datetime.timedelta > 0, got {default_timeout!r}")
        self._work = work
        self.deadline = deadline
        self.default_timeout = default_timeout

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Sleep until the link delivers, then wait the real work, all within ``timeout``
        (``timedelta(0)``: ``default_timeout``); raises RuntimeError ("Operation timed out!") when
        the link or the real work needs longer. See [Note: timeouts behind the link]."""
        if not timeout > datetime.timedelta(0):
            timeout = self.default_timeout if self.default_timeout is not None else wait_timeout()
        start = time.monotonic()
        _sleep_within(self.deadline, timeout, "this collective")
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


def check_number(value: object, rule: str, positive: bool) -> None:
    """Raise ``TypeError`` (not a real number, or a bool) / ``ValueError`` (not finite, or not > 0 when
    ``positive``, else not >= 0), the message being ``rule`` and the value. For this package's checks."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{rule} (an int or float, not a bool), got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{rule}, got {value!r}")


def _check_tier(value: object, name: str) -> tuple[float, float]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(f"{name} must be a (gbps, latency_us) tuple, got {value!r}")
    check_number(value[0], f"{name}[0] (bandwidth in gigabits/s) must be a finite number > 0", positive=True)
    check_number(value[1], f"{name}[1] (latency in µs) must be a finite number >= 0", positive=False)
    return float(value[0]), float(value[1])


class EmulatedLink:
    """A modelled interconnect (see the module docstring); a context manager that activates it.

    [Note: two-tier links]
    Every process group has its own FIFO link; by default all of them run at ``gbps`` /
    ``latency_us``. Two ways give groups other speeds, so one run can model fast intra-node and slow
    inter-node networks: ``gpus_per_node=G, inter_node=(gbps, latency_us)`` puts the global ranks
    ``[k*G, (k+1)*G)`` on node ``k``, and a group whose ranks lie on more than one node runs at the
    inter-node speed (a collective spanning both tiers is as slow as its slowest hop: its ring
    crosses the inter-node link, so the whole collective is charged at that link's bandwidth and
    latency); ``groups={group: (gbps, latency_us)}`` (a ProcessGroup or its name) sets a group's
    link directly and wins over the topology.
    """

    def __init__(self, gbps: float, latency_us: float = 10.0, functional: bool = False, *,
                 gpus_per_node: int | None = None, inter_node: tuple[float, float] | None = None,
                 groups: Mapping[Any, tuple[float, float]] | None = None) -> None:
        if not isinstance(functional, bool):
            raise TypeError(f"functional must be a bool (also model torch.ops._c10d_functional collectives), got {functional!r}")
        check_number(gbps, "gbps (link bandwidth in gigabits/s) must be a finite number > 0", positive=True)
        check_number(latency_us, "latency_us (per-collective latency in µs) must be a finite number >= 0",
                     positive=False)
        if (gpus_per_node is None) != (inter_node is None):
            raise ValueError("gpus_per_node and inter_node go together (ranks per node, and the (gbps, latency_us) "
                             f"of links between nodes); got gpus_per_node={gpus_per_node!r}, inter_node={inter_node!r}")
        if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                          or gpus_per_node < 1):
            raise ValueError(f"gpus_per_node must be an int >= 1 (global ranks per node), got {gpus_per_node!r}")
        self.inter_node = None if inter_node is None else _check_tier(inter_node, "inter_node")
        if groups is not None and not isinstance(groups, Mapping):
            raise TypeError(f"groups must be a mapping of ProcessGroup (or group name) to (gbps, latency_us), "
                            f"got {type(groups).__name__}")
        self._group_tiers = {self._group_key(g): _check_tier(t, f"groups[{g!r}]") for g, t in (groups or {}).items()}
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        self.functional = functional
        self.gpus_per_node = gpus_per_node
        self._tier_cache: dict[Any, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._groups: dict[Any, _GroupLink] = {}
        self._names: dict[Any, str] = {}

    def __repr__(self) -> str:
        tiers = ""
        if self.gpus_per_node is not None:
            tiers += f", gpus_per_node={self.gpus_per_node}, inter_node={self.inter_node}"
        if self._group_tiers:
            tiers += f", groups={self._group_tiers}"
        return f"EmulatedLink(gbps={self.gbps}, latency_us={self.latency_us}, functional={self.functional}{tiers})"

    @staticmethod
    def _group_key(group: Any) -> str:
        if isinstance(group, str):
            return group
        name = getattr(group, "group_name", None)
        if not isinstance(name, str):
            raise TypeError(f"groups: keys must be ProcessGroups or group names, got {type(group).__name__}")
        return name

    def tier(self, group: Any = None) -> tuple[float, float]:
        """``(gbps, latency_us)`` of ``group``'s link (None: the default link); see [Note: two-tier links]."""
        if group is None or (not self._group_tiers and self.gpus_per_node is None):
            return self.gbps, self.latency_us
        key = getattr(group, "group_name", None) or group
        tier = self._tier_cache.get(key)
        if tier is None:
            tier = self._group_tiers.get(key) if isinstance(key, str) else None
            if tier is None and self.gpus_per_node is not None and self.inter_node is not None:
                nodes = {r // self.gpus_per_node for r in dist.get_process_group_ranks(group)}
                tier = self.inter_node if len(nodes) > 1 else None
            tier = tier or (self.gbps, self.latency_us)
            self._tier_cache[key] = tier
        return tier

    @property
    def bytes_per_second(self) -> float:
        """The default link's bandwidth in bytes/s."""
        return self.gbps * 1e9 / 8

    def transfer_seconds(self, wire_bytes: float, group: Any = None) -> float:
        """Link time of one collective over ``group`` (None: the default link) that delivers
        ``wire_bytes`` to each rank."""
        gbps, latency_us = self.tier(group)
        return latency_us * 1e-6 + wire_bytes / (gbps * 1e9 / 8)

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


def emulated_link(gbps: float, latency_us: float = 10.0, functional: bool = False, *,
                  gpus_per_node: int | None = None, inter_node: tuple[float, float] | None = None,
                  groups: Mapping[Any, tuple[float, float]] | None = None) -> EmulatedLink:
    """A link of ``gbps`` gigabits/s and ``latency_us`` µs per collective; use it with ``with``.
    ``gpus_per_node`` with ``inter_node``, and ``groups``, give groups other speeds (see [Note:
    two-tier links]).

    ``functional=True`` also models ``torch.ops._c10d_functional`` collectives (compiled code,
    DTensor). It is opt-in: a first version hung DTensor's ``full_tensor`` inside torch FSDP2
    state-dict code on gloo (torch 2.13), a GIL deadlock now understood and avoided (see
    [Note: calling torch's kernel without the GIL]), and timings taken without it stay comparable."""
    return EmulatedLink(gbps, latency_us, functional, gpus_per_node=gpus_per_node, inter_node=inter_node,
                        groups=groups)


# --- patching -----------------------------------------------------------------------------------

_state_lock = threading.RLock()
_active: list[EmulatedLink] = []
_patched: dict[tuple[ModuleType, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
_local = threading.local()  # .inside: a wrapper is running in this thread (inner calls pass through)
_library: torch.library.Library | None = None  # the functional collectives' CPU kernels, while active
# storage address -> (completion time of the functional collective writing it, its wait's timeout)
_deadlines: dict[int, tuple[float, datetime.timedelta]] = {}
_deadlines_lock = threading.Lock()
_warned_unusual_registration = False


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
        if link.functional and _library is None:
            _register_functional()
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
        _unregister_functional()


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
            seconds = link.transfer_seconds(wire_bytes, group)
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
        emulated = EmulatedWork(work, deadline, wait_timeout(group.group_name))
        if async_op:
            return emulated
        emulated.wait()
        return None

    return wrapper


# --- functional collectives (torch.ops._c10d_functional) ------------------------------------------

# [Note: calling torch's kernel without the GIL]
# The dispatcher runs a kernel registered from Python with the GIL held, and
# ``SafeKernelFunction.call_boxed`` (``torch.library.get_kernel``) keeps holding it while torch's
# kernel runs. That deadlocks on gloo (seen on torch 2.13): a gloo worker thread destroys a finished
# work while holding the process group's queue lock, which drops the last reference to a tensor
# that has a Python object and so needs the GIL; the main thread, holding the GIL inside our kernel,
# blocks on that lock when it issues the next collective (or in ``wait_tensor`` on a work behind
# it). ``OpOverload.redispatch`` releases the GIL around the call, so our kernels reach torch's
# kernel that way: torch registers these ops once, as ``CompositeExplicitAutograd``, which fills
# the dispatch table entry of every backend key, ``PrivateUse1`` included; redispatching to that
# key runs the same kernel our ``CPU`` entry replaced (the kernel dispatches its own collectives
# by the tensors' device, so nothing of PrivateUse1 reaches the process group). Registration checks
# that neither key has a kernel of its own and otherwise leaves functional collectives alone.
_TORCH_KERNEL_KEY = "PrivateUse1"


def _uses_torch_composite_kernel(op: torch._ops.OpOverload) -> bool:
    """True when ``op``'s CPU and PrivateUse1 entries both hold its CompositeExplicitAutograd kernel."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = op._schema.name + (f".{op._schema.overload_name}" if op._schema.overload_name else "")
    return (has(name, "CompositeExplicitAutograd") and not has(name, "CPU")
            and not has(name, _TORCH_KERNEL_KEY))


def _register_functional() -> None:
    """Give the functional collectives and ``wait_tensor`` CPU kernels that model the link."""
    global _library, _warned_unusual_registration
    ops = {name: _functional_overload(name) for name in (*_FUNCTIONAL, "wait_tensor")}
    ops = {name: op for name, op in ops.items() if op is not None}
    if "wait_tensor" not in ops or not all(_uses_torch_composite_kernel(op) for op in ops.values()):
        if not _warned_unusual_registration:
            _warned_unusual_registration = True
            warnings.warn(
                "torch.ops._c10d_functional has kernels of its own on the CPU or PrivateUse1 key here: "
                "functional collectives (and compiled code) are not slowed by the emulated link",
                RuntimeWarning,
                stacklevel=4,
            )
        return
    torch_kernel = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _TORCH_KERNEL_KEY))
    library = torch.library.Library(_FUNCTIONAL_NAMESPACE, "IMPL")
    try:
        for name, op in ops.items():
            if name == "wait_tensor":
                kernel = _wait_kernel(op, torch_kernel)
            else:
                which, factor = _FUNCTIONAL[name]
                kernel = _issue_kernel(op, name, torch_kernel, which, factor)
            library.impl(name, kernel, "CPU")
    except BaseException:
        library._destroy()
        raise
    _library = library


def _unregister_functional() -> None:
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
    with _deadlines_lock:
        _deadlines.clear()


def _functional_overload(name: str) -> torch._ops.OpOverload | None:
    """``torch.ops._c10d_functional.<name>.default``, or None where this torch lacks the op."""
    try:
        return getattr(getattr(torch.ops, _FUNCTIONAL_NAMESPACE), name).default
    except (AttributeError, RuntimeError):
        return None


def _process_group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _issue_kernel(
    op: torch._ops.OpOverload, name: str, torch_kernel: Any, which: str, factor: Callable[[int], float]
) -> Callable[..., Any]:
    """A CPU kernel for ``op`` that runs torch's kernel and books the link for it."""
    group_index = [a.name for a in op._schema.arguments].index("group_name")
    label = f"{_FUNCTIONAL_NAMESPACE}.{name}"

    def kernel(*args: Any, **kwargs: Any) -> Any:
        link = current_link()
        if link is None or getattr(_local, "inside", False):
            return op.redispatch(torch_kernel, *args, **kwargs)
        group_name = args[group_index] if group_index < len(args) else kwargs["group_name"]
        group = _process_group(group_name)
        issued = time.monotonic()
        with _inside():
            result = op.redispatch(torch_kernel, *args, **kwargs)  # see [Note: calling torch's kernel without the GIL]
        outputs = _tensors(result)
        counted = outputs if which == "output" else _tensors(args[0])
        world = group.size()
        if world > 1:
            wire_bytes = int(sum(t.numel() * t.element_size() for t in counted) * factor(world))
            seconds = link.transfer_seconds(wire_bytes, group)
        else:
            wire_bytes, seconds = 0, 0.0
        deadline = link._schedule(group, label, wire_bytes, seconds, issued)
        if seconds > 0:
            timeout = wait_timeout(group.group_name)
            with _deadlines_lock:
                for t in outputs:
                    if t.untyped_storage().nbytes() > 0:
                        _deadlines[_storage_key(t)] = (deadline, timeout)
        return result

    return kernel


def _wait_kernel(op: torch._ops.OpOverload, torch_kernel: Any) -> Callable[..., Any]:
    """A CPU kernel for ``wait_tensor``: sleep until the link delivers ``tensor``, then really wait."""

    def kernel(tensor: torch.Tensor) -> Any:
        with _deadlines_lock:
            booked = _deadlines.pop(_storage_key(tensor), None)
        if booked is not None:
            _sleep_within(*booked, "this functional collective")  # see [Note: timeouts behind the link]
        return op.redispatch(torch_kernel, tensor)  # see [Note: calling torch's kernel without the GIL]

    return kernel


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
