"""Named runtime regions (``overlap::...``) for torch.profiler traces, free when no profiler runs.

``torch.profiler.record_function`` costs microseconds per region even with no profiler active, and
the runtime enters several regions per block per step, so :func:`region` checks first (one cheap C
call) and only records while a profiler is collecting.

While ``overlap.profiler`` records (:func:`track_labels`), regions also keep a per-thread stack of
their names and entry times, so each collective can be attributed to the region that issued it, and
its issue time taken where its issuing region began (:func:`current_regions`).

A sharded module's regions carry its fully-qualified name relative to the root sharded last, as
FSDP2's ``_with_fqn`` does: ``overlap::pre_forward (blocks.3)``; the root's own regions carry none
(``overlap::pre_forward``), nor do those of a module whose ancestors were never sharded. The names
are built once per module, when ``overlap.shard`` runs (:class:`ModuleRegions`), not per call.
Regions of the collectives themselves (``overlap::all_gather``, ``overlap::wait`` ...) are not
per module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import ContextManager, Optional

import torch

__all__ = ["ModuleRegions", "region", "current_regions", "track_labels", "with_fqn"]

_NULL = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled
_tracking = False
_local = threading.local()  # .stack: (name, entry time) of the regions this thread is inside (while tracking)


def _stack() -> list[tuple[str, float]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class _Labelled:
    """A region whose name is pushed on this thread's label stack (and recorded by torch.profiler)."""

    __slots__ = ("name", "_recorded")

    def __init__(self, name: str) -> None:
        self.name = name
        self._recorded: Optional[ContextManager[object]] = None

    def __enter__(self) -> None:
        _stack().append((self.name, time.perf_counter()))
        if _profiler_enabled():
            self._recorded = torch.profiler.record_function(self.name)
            self._recorded.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._recorded is not None:
            self._recorded.__exit__(*exc)
        stack = _stack()
        if stack and stack[-1][0] == self.name:
            stack.pop()


def region(name: str) -> ContextManager[object]:
    """``record_function(name)`` while a profiler is active, else a no-op context."""
    if _tracking:
        return _Labelled(name)
    if _profiler_enabled():
        return torch.profiler.record_function(name)
    return _NULL


def track_labels(on: bool) -> bool:
    """Keep (``on``) or stop keeping the per-thread stack of region names; returns the previous setting."""
    global _tracking
    previous, _tracking = _tracking, bool(on)
    if not on:
        _local.stack = []
    return previous


def current_regions() -> tuple[tuple[str, float], ...]:
    """``(name, time.perf_counter() at entry)`` of the regions this thread is inside, outermost first
    (empty unless tracking)."""
    return tuple(getattr(_local, "stack", ()))


def with_fqn(name: str, fqn: str) -> str:
    """``name (fqn)``, or ``name`` alone for an empty ``fqn`` (the root), as FSDP2 labels its regions."""
    return f"{name} ({fqn})" if fqn else name


@dataclasses.dataclass(frozen=True)
class ModuleRegions:
    """The names of one sharded module's runtime regions: field ``x`` holds ``overlap::x (fqn)``."""

    pre_forward: str
    pre_forward_recompute: str
    post_forward: str
    pre_backward: str
    reduce_scatter: str
    reduce_scatter_epilogue: str
    end_backward: str
    all_gather_copy_in: str
    all_gather_copy_out: str
    reduce_scatter_copy_in: str
    reduce_scatter_copy_out: str

    @classmethod
    def named(cls, fqn: str) -> "ModuleRegions":
        """The region names of the module at ``fqn`` relative to the root (``""``: the root)."""
        return cls(**{f.name: with_fqn(f"overlap::{f.name}", fqn) for f in dataclasses.fields(cls)})
