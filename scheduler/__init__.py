"""When to wait and when to issue: first-use waits (AsyncTensor), recorded schedules, graph passes.

This package must not import ``overlap``; ``overlap`` builds on it.
"""
from typing import Any

from scheduler.async_tensor import AsyncTensor, Completion, is_pending, wait_tensor
from scheduler.graph_pass import overlap_graph, overlap_pass
from scheduler.replay import ScheduleMismatchError, Scheduler
from scheduler.schedule import Schedule

# The Inductor hook imports torch._inductor (~1 s), so it is loaded on first use.
_INDUCTOR_HOOK_NAMES = ("OverlapGraphPass", "compile_options", "inductor_overlap", "install", "uninstall")


def __getattr__(name: str) -> Any:
    if name in _INDUCTOR_HOOK_NAMES:
        from scheduler import inductor_hook

        return getattr(inductor_hook, name)
    raise AttributeError(f"module 'scheduler' has no attribute {name!r}")


__all__ = [
    "AsyncTensor",
    "Completion",
    "OverlapGraphPass",
    "Schedule",
    "ScheduleMismatchError",
    "Scheduler",
    "compile_options",
    "inductor_overlap",
    "install",
    "is_pending",
    "overlap_graph",
    "overlap_pass",
    "uninstall",
    "wait_tensor",
]
