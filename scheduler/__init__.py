"""When to wait and when to issue: first-use waits (AsyncTensor), recorded schedules, graph passes.

This package must not import ``overlap``; ``overlap`` builds on it.
"""
from scheduler.async_tensor import AsyncTensor, Completion, is_pending, wait_tensor

__all__ = ["AsyncTensor", "Completion", "is_pending", "wait_tensor"]
