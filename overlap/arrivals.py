"""Which ranks have reached a collective: each rank's count of issued collectives per group, in the store.

Contract
--------
* :func:`start` (``overlap.desync.next_seq`` calls it at a process's first collective) starts one
  daemon thread per process that publishes this rank's per-group counts (``{group name: collectives
  issued}``, the sequence numbers of ``overlap.desync``) under ``overlap/issued/<global rank>`` in
  the default store, once they have stopped changing (see [Note: publishing where a rank stopped]).
* :func:`missing` reads them back when a wait or a check times out: which ranks of the group have
  not issued collective ``#seq``, with what each issued last. The error message shows it
  (``overlap.errors.collective_failure``).
* Nothing here blocks the thread that issues collectives: issuing never touches the store.

[Note: publishing where a rank stopped]
A rank that times out waiting for collective #12 wants to know which peers never issued it. Those
peers are not answering (stuck in user code, asleep after catching an exception), so they must have
said where they are before they stopped. Writing the count to the store at every collective would
cost a store round trip (tens of µs over TCP) on the issuing thread, per collective. Instead a
daemon thread looks at the counts every ``INTERVAL_S`` and writes them only when they are the same
as one look before: while a rank trains, its counts change at every look and nothing is written
(no store traffic in a healthy step, the thread wakes twice a second); a rank that stops issuing,
or waits, is published within ``2 * INTERVAL_S``. The wait timeout's floor is far above that, so
by the time a wait times out every rank that stopped has published where. A rank that keeps issuing
on other groups while one of its groups is stuck is not published; :func:`missing` then says "no
report". Counts are per process group name, for the life of the process.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

__all__ = ["start", "missing", "describe_missing", "INTERVAL_S", "KEY_PREFIX"]

INTERVAL_S = 0.5
KEY_PREFIX = "overlap/issued/"
_thread: Optional[threading.Thread] = None


def _store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return dist.PrefixStore(KEY_PREFIX, c10d._get_default_store())


def start(counts: dict[str, int]) -> bool:
    """Publish ``counts`` (a live dict, read by the thread) from now on; idempotent. Returns True once
    publishing runs or is not needed (one rank), False if torch.distributed is not initialized yet."""
    global _thread
    import torch.distributed as dist

    if _thread is not None:
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size() == 1:
        return True
    _thread = threading.Thread(target=_publish, args=(counts, dist.get_rank()), name="overlap-arrivals", daemon=True)
    _thread.start()
    return True


def _publish(counts: dict[str, int], rank: int) -> None:
    looks = _Looks()
    while True:
        time.sleep(INTERVAL_S)
        now = looks.due(dict(counts))  # one C-level copy under the GIL: consistent while the issuer adds
        if now is not None:
            try:
                _store().set(str(rank), json.dumps(now))
                looks.published = now
            except Exception:  # no default store now (destroyed, being rebuilt): try at the next look
                pass


class _Looks:
    """What the publishing thread has seen and written (see [Note: publishing where a rank stopped])."""

    def __init__(self) -> None:
        self.seen: Optional[dict[str, int]] = None
        self.published: Optional[dict[str, int]] = None

    def due(self, now: dict[str, int]) -> Optional[dict[str, int]]:
        """``now`` if it should be written (the same as at the last look, and not written yet), else None."""
        stopped = now == self.seen
        self.seen = now
        return now if stopped and now != self.published else None


def missing(group: str, seq: int, mine: dict[str, int]) -> Optional[dict[int, Optional[int]]]:
    """The global ranks of ``group`` (a process group name) that have not issued its collective
    ``#seq``, each with the number of the last one it issued (None: none on it, or no report);
    ``mine`` is this rank's live counts. None if the store cannot be read."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = c10d._resolve_process_group(group) if group else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        me = dist.get_rank()
        store = _store()
        behind: dict[int, Optional[int]] = {}
        for r in ranks:
            if r == me:
                counts: Optional[dict[str, int]] = mine
            elif store.check([str(r)]):
                counts = json.loads(store.get(str(r)))
            else:
                counts = None
            issued = None if counts is None else counts.get(group)
            if issued is None or issued <= seq:
                behind[r] = None if not issued else issued - 1
        return behind
    except Exception:  # the store is gone (a peer that hosted it died): say nothing rather than fail again
        return None


def describe_missing(group: str, seq: int, behind: Optional[dict[int, Optional[int]]]) -> str:
    """`` ranks that have not issued #12 on group '0': 1 (last #11), 2 (none)`` for an error message."""
    if behind is None:
        return ""
    if not behind:
        return f"; every rank of group {group!r} has issued #{seq} (as last reported)"
    shown = ", ".join(f"{r} ({'last #' + str(last) if last is not None else 'no collective on it reported'})"
                      for r, last in behind.items())
    return f"; ranks that have not issued #{seq} on group {group!r}: {shown}"
