"""Which emulated link models a call: the active links of the process, and a thread's pass-through.

Contract. Links are active per process, innermost last (:func:`current_link` models every call);
contexts nest and may be entered and left from several threads, not necessarily in LIFO order
(:func:`remove` drops the innermost entry of the link leaving). :data:`state_lock` (re-entrant)
guards the stack and whatever its first entry installs and its last exit removes
(``overlap.testing.emulated_link``'s activation). Per thread, :func:`passing_through` marks that a
modelled call is running (a wrapper or kernel of ``eager`` / ``functional``), so the collectives it
calls inside run unmodelled (:func:`inside`): one booking per user call.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from overlap.testing.emulated_link import EmulatedLink

__all__ = ["current_link", "inside", "passing_through", "push", "remove", "state_lock"]

state_lock = threading.RLock()
_active: list[EmulatedLink] = []
_local = threading.local()  # .inside: a wrapper is running in this thread (inner calls pass through)


def current_link() -> Optional[EmulatedLink]:
    """The innermost active link of this process, or None."""
    with state_lock:
        return _active[-1] if _active else None


def push(link: EmulatedLink) -> None:
    """Make ``link`` the innermost active link (hold :data:`state_lock` around the check that precedes it)."""
    with state_lock:
        _active.append(link)


def remove(link: EmulatedLink) -> bool:
    """Drop the innermost entry of ``link``; True when no link is left active."""
    with state_lock:
        index = len(_active) - 1 - _active[::-1].index(link)
        del _active[index]
        return not _active


def inside() -> bool:
    """Is a modelled call running in this thread (its inner collectives pass through)?"""
    return getattr(_local, "inside", False)


@contextlib.contextmanager
def passing_through() -> Iterator[None]:
    """Run the block as part of a modelled call: collectives it calls are not modelled again."""
    outer = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = outer
