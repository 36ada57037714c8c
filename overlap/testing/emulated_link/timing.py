"""The emulated link's timing model: one FIFO link per process group, and what a collective costs on it.

Contract. A :class:`LinkModel` owns all link state: its parameters, one FIFO link per process group
(when it is next free) and the statistics. :meth:`LinkModel.book` is the only way a collective uses
the link: from the process group, the op's name (statistics), its kind (which wire-bytes rule
applies, :data:`WIRE_KINDS`), its payload bytes and its issue time, it books the group's link and
returns a :class:`Booking`. Booking and statistics are thread-safe. Nothing here patches torch,
sleeps or waits: the callers (``eager``, ``functional``) decide how a call is delayed until its
booking's deadline (``work``, ``cuda_sleep``).

Timing model. Each process group has one FIFO link (its speed: ``gbps`` and ``latency_us``, or
another tier's, see [Note: two-tier links]). A collective issued (host time,
``time.monotonic()``) at ``t`` starts at ``max(t, busy_until)`` and completes at ``start + latency +
wire_bytes / bandwidth``; that completion time becomes the group's ``busy_until``. ``bandwidth = gbps
* 1e9 / 8`` bytes/s (**gigabits** per second). ``wire_bytes`` is what each rank receives, from the
payload (the bytes of the tensors the caller counts: see the op tables of ``eager`` and
``functional``) and ``w``, the group size:

==============  ==================================
kind            wire_bytes
==============  ==================================
all_gather      (w-1)/w * payload (the output)
reduce_scatter  (w-1)/w * payload (the input)
all_reduce      2(w-1)/w * payload (ring)
broadcast       payload (every rank, src included)
all_to_all      (w-1)/w * payload (the input)
any, w == 1     no delay (0 s, not even latency)
==============  ==================================
"""
from __future__ import annotations

import collections
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

__all__ = ["Booking", "LinkModel", "LinkStats", "WIRE_KINDS", "check_number", "payload_bytes", "tensors_in"]


def _gather_factor(w: int) -> float:
    return (w - 1) / w


def _ring_all_reduce_factor(w: int) -> float:
    return 2 * (w - 1) / w


def _whole(w: int) -> float:
    return 1.0


# collective kind -> wire bytes per payload byte, as a function of the group size
_WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all_gather": _gather_factor,
    "reduce_scatter": _gather_factor,
    "all_reduce": _ring_all_reduce_factor,
    "broadcast": _whole,
    "all_to_all": _gather_factor,
}
WIRE_KINDS = frozenset(_WIRE_FACTOR)
"""The collective kinds :meth:`LinkModel.book` knows (the wire-bytes table of the module docstring)."""


def check_number(value: object, rule: str, positive: bool) -> None:
    """Raise ``TypeError`` (not a real number, or a bool) / ``ValueError`` (not finite, or not > 0 when
    ``positive``, else not >= 0), the message being ``rule`` and the value. For this package's checks."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{rule} (an int or float, not a bool), got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{rule}, got {value!r}")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value``: a tensor, a list / tuple holding tensors, or None (none)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)] if value is not None else []


def payload_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``, the payload :meth:`LinkModel.book` takes."""
    return sum(t.numel() * t.element_size() for t in tensors)


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


@dataclass(frozen=True)
class Booking:
    """One collective's use of its group's link: bytes received per rank, link seconds (0 for a group
    of one), and the ``time.monotonic()`` at which the link delivers it."""

    wire_bytes: int
    seconds: float
    deadline: float


@dataclass
class _GroupLink:
    busy_until: float = 0.0
    stats: LinkStats = field(default_factory=LinkStats)
    busy: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per booking, in order


def _check_tier(value: object, name: str) -> tuple[float, float]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(f"{name} must be a (gbps, latency_us) tuple, got {value!r}")
    check_number(value[0], f"{name}[0] (bandwidth in gigabits/s) must be a finite number > 0", positive=True)
    check_number(value[1], f"{name}[1] (latency in µs) must be a finite number >= 0", positive=False)
    return float(value[0]), float(value[1])


def _group_key(group: Any) -> str:
    if isinstance(group, str):
        return group
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        raise TypeError(f"groups: keys must be ProcessGroups or group names, got {type(group).__name__}")
    return name


class LinkModel:
    """A modelled interconnect of ``gbps`` gigabits/s and ``latency_us`` µs per collective, one FIFO
    link per process group (see the module docstring).

    [Note: two-tier links]
    By default every group's link runs at ``gbps`` / ``latency_us``. Two ways give groups other
    speeds, so one run can model fast intra-node and slow inter-node networks:
    ``gpus_per_node=G, inter_node=(gbps, latency_us)`` puts the global ranks ``[k*G, (k+1)*G)`` on
    node ``k``, and a group whose ranks lie on more than one node runs at the inter-node speed (a
    collective spanning both tiers is as slow as its slowest hop: its ring crosses the inter-node
    link, so the whole collective is charged at that link's bandwidth and latency);
    ``groups={group: (gbps, latency_us)}`` (a ProcessGroup or its name) sets a group's link directly
    and wins over the topology.
    """

    def __init__(self, gbps: float, latency_us: float = 10.0, *, gpus_per_node: int | None = None,
                 inter_node: tuple[float, float] | None = None,
                 groups: Mapping[Any, tuple[float, float]] | None = None) -> None:
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
        self.group_tiers = {_group_key(g): _check_tier(t, f"groups[{g!r}]") for g, t in (groups or {}).items()}
        self.gpus_per_node = gpus_per_node
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        self._tier_cache: dict[Any, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._groups: dict[Any, _GroupLink] = {}
        self._names: dict[Any, str] = {}

    @property
    def bytes_per_second(self) -> float:
        """The default link's bandwidth in bytes/s."""
        return self.gbps * 1e9 / 8

    def tier(self, group: Any = None) -> tuple[float, float]:
        """``(gbps, latency_us)`` of ``group``'s link (None: the default link); see [Note: two-tier links]."""
        if group is None or (not self.group_tiers and self.gpus_per_node is None):
            return self.gbps, self.latency_us
        key = getattr(group, "group_name", None) or group
        tier = self._tier_cache.get(key)
        if tier is None:
            tier = self.group_tiers.get(key) if isinstance(key, str) else None
            if tier is None and self.gpus_per_node is not None and self.inter_node is not None:
                import torch.distributed as dist

                nodes = {r // self.gpus_per_node for r in dist.get_process_group_ranks(group)}
                tier = self.inter_node if len(nodes) > 1 else None
            tier = tier or (self.gbps, self.latency_us)
            self._tier_cache[key] = tier
        return tier

    def transfer_seconds(self, wire_bytes: float, group: Any = None) -> float:
        """Link time of one collective over ``group`` (None: the default link) that delivers
        ``wire_bytes`` to each rank."""
        gbps, latency_us = self.tier(group)
        return latency_us * 1e-6 + wire_bytes / (gbps * 1e9 / 8)

    def book(self, group: Any, op: str, kind: str, payload: int, issued: float) -> Booking:
        """Book the FIFO link of process group ``group`` for one collective of ``kind`` (one of
        :data:`WIRE_KINDS`) moving ``payload`` bytes, issued at ``issued`` (``time.monotonic()``);
        counted under ``op`` in the statistics."""
        world = group.size()
        if world > 1:
            wire_bytes = int(payload * _WIRE_FACTOR[kind](world))
            seconds = self.transfer_seconds(wire_bytes, group)
        else:
            wire_bytes, seconds = 0, 0.0
        with self._lock:
            state = self._groups.get(group)
            if state is None:
                state = self._groups[group] = _GroupLink()
                self._names[group] = getattr(group, "group_name", "") or str(len(self._names))
            start = max(issued, state.busy_until)
            done = start + seconds
            state.busy_until = done
            state.stats = state.stats + LinkStats(1, wire_bytes, seconds, {op: 1})
            if seconds > 0:
                state.busy.append((start, done))
        return Booking(wire_bytes, seconds, done)

    def stats(self) -> LinkStats:
        """Totals over every process group this link has carried."""
        with self._lock:
            return sum((s.stats for s in self._groups.values()), LinkStats())

    def stats_by_group(self) -> dict[str, LinkStats]:
        """Totals per process group, keyed by group name."""
        with self._lock:
            return {self._names[g]: s.stats for g, s in self._groups.items()}

    def busy_intervals(self) -> dict[str, list[tuple[float, float]]]:
        """When each process group's link carried something: ``(start, end)`` (``time.monotonic()``)
        of every booking with link time since the link was created or :meth:`reset_stats`, in
        booking order, keyed by group name. The link's own record of its busy time (the profiler's
        idle-link report is checked against it)."""
        with self._lock:
            return {self._names[g]: list(s.busy) for g, s in self._groups.items()}

    def reset_stats(self) -> None:
        """Forget the statistics and the busy intervals (the FIFO state is kept)."""
        with self._lock:
            for state in self._groups.values():
                state.stats = LinkStats()
                state.busy = []
