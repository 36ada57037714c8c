"""Desync detection: a sequence number and a fingerprint for every collective, checked across ranks.

Contract
--------
* Every collective the runtime issues goes through ``overlap.collectives._issue``, which numbers it
  per process group (:func:`next_seq`: 0, 1, 2, ... in issue order on this rank, counted by group
  name for the life of the process). The number travels with the in-flight work and appears in
  every error about it (failed or timed-out waits, see ``overlap.inflight_work``).
* **Debug mode** (off by default) checks, before each collective is issued, that every rank of the
  group is about to issue the same one: same sequence number, kind, reduce op (or broadcast
  source), dtypes and shapes (:func:`fingerprint`). If not, *every* rank raises
  :class:`DesyncError` naming the sequence number, the group and what each rank issued, and the
  collective is not issued, so nothing hangs on a mismatched collective and no buffer is filled
  with the wrong data. Cross-rank agreements (``overlap.agreement``) are collectives of the group
  too, checked the same way: a rank at an agreement point and a rank at a collective see each
  other's fingerprints and both raise. A rank that does not reach the check within the check's
  timeout (``overlap.errors.timeout_for(group, check=True)``: the bounded default with a 30 s floor,
  see [Note: wait timeouts]) makes the ranks waiting for it raise ``overlap.CollectiveTimeoutError``
  naming their own fingerprint and the ranks that have not reached it (a rank that died makes
  them raise ``overlap.CollectiveError`` as soon as its connection closes).
* **Threads**: a group's collectives must come from one thread at a time, in the same order on every
  rank (threads taking turns take them in the same order everywhere). In debug mode a second
  thread issuing on a group while another thread's collective on it is being checked raises
  :class:`DesyncError` saying so (see [Note: one thread at a time per group]).
* **Debug off**, a rank out of step issues a mismatched collective: gloo may then abort a peer inside
  the collective (C++ ``gloo::EnforceNotMet``, "Received data size doesn't match expected size",
  SIGABRT) or pair the wrong data silently. ``OVERLAP_DEBUG=1`` turns that into a DesyncError on
  every rank, raised before the collective is issued.
* Turning it on: ``OVERLAP_DEBUG=1`` in the environment, or ``overlap.set_debug(True)``, or
  ``with overlap.debug(): ...``. The environment variable is read at the first collective a
  process issues (not at import, so ranks started by a fork server see the environment they are
  given), and again after ``set_debug(None)``. Off, ``_issue`` pays one boolean check. The values
  are those of every boolean flag (``scheduler.env_flags``): 1/true/yes/on, 0/false/no/off/empty;
  anything else raises ``scheduler.env_flags.EnvFlagError`` (a ``ValueError``) naming the variable.

[Note: the side channel of the debug check]
The fingerprints are all-gathered (``256 * w`` bytes, one blocking gather) over a gloo group on the
same ranks, built once per checked group from the default store (prefix ``overlap/desync/<group
name>``), not over the checked group itself: a blocking collective on the checked group would wait
behind every collective already in flight on it (debug mode must keep the overlap it checks), and
on NCCL it would need a device tensor and a host sync. The side channel costs one host round trip per
collective, and it synchronizes the ranks' hosts at each collective (a slow rank is waited for at
the check instead of at the collective's first use): about one more small gloo collective, 0.3-0.8
ms per collective with 2 gloo ranks on a quiet 2-core CPU box, 0.8-1.6 ms on a loaded one
(``benchmarks/bench_desync.py``, ``benchmarks/RESULTS.md``).
Groups of one rank are numbered but not checked.

Fingerprint text (what the errors show), for ``w`` ranks; shapes are those of the collective's
buffers (``all_to_all``'s dim 0 legitimately differs between ranks, so it shows as ``*``):

=============================  ============================================
collective                     fingerprint
=============================  ============================================
all_gather of ``(4, 3)``       ``#7 all_gather float32[4w, 3]``
reduce_scatter of ``(8,)``     ``#8 reduce_scatter(sum) float32[w, 8/w] float32[8/w]``
all_reduce(avg) of ``(5,)``    ``#9 all_reduce(avg) float32[5]``
broadcast(src=0) of ``(2,)``   ``#10 broadcast(src=0) float32[2]``
all_to_all of ``(r, 4)``       ``#11 all_to_all float32[*, 4] float32[*, 4]``
=============================  ============================================
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import threading
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from overlap import arrivals
from overlap.errors import collective_failure, timeout_for
from overlap.regions import region
from scheduler.env_flags import Switch

__all__ = ["DesyncError", "check", "debug", "debug_enabled", "fingerprint", "next_seq", "set_debug",
           "FINGERPRINT_BYTES", "DEBUG_ENV"]

DEBUG_ENV = "OVERLAP_DEBUG"
FINGERPRINT_BYTES = 256  # the fixed size of one rank's encoded fingerprint in the check
_HASH_HEX = 16

SWITCH = Switch(DEBUG_ENV, "set_debug")
"""Debug mode. ``_issue`` reads ``SWITCH.on`` (one attribute): True until the first collective
resolves ``OVERLAP_DEBUG`` (:func:`check` does that and returns at once when the variable says
off); after that, the mode."""
_seqs: dict[str, int] = {}
_publishing = False  # overlap.arrivals publishes _seqs (started at the first collective)


class DesyncError(RuntimeError):
    """Ranks were about to issue different collectives on one group (debug mode).

    ``seq`` is the group's sequence number, ``group`` the group name, ``fingerprints`` maps each
    rank (global rank) to the fingerprint of the collective it was about to issue.
    """

    def __init__(self, message: str, seq: int = -1, group: str = "",
                 fingerprints: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.seq = seq
        self.group = group
        self.fingerprints: dict[int, str] = dict(fingerprints or {})


def set_debug(on: Optional[bool]) -> Optional[bool]:
    """Turn debug mode on or off for this process (``None``: follow ``OVERLAP_DEBUG`` again).

    Returns the previous explicit setting, or ``None`` if it followed the environment. Every rank
    must use the same mode (the check is itself a collective).
    """
    return SWITCH.set(on)


def debug(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Debug mode on (or off) inside the block; the previous mode is restored on exit."""
    return SWITCH.scoped(on)


def debug_enabled() -> bool:
    """Is debug mode on (explicitly, or through ``OVERLAP_DEBUG``)?"""
    return SWITCH.resolve()


def next_seq(group: str) -> int:
    """The sequence number of the next collective on ``group`` (a process group name) on this rank."""
    global _publishing
    if not _publishing:
        _publishing = arrivals.start(_seqs)
    seq = _seqs.get(group, 0)
    _seqs[group] = seq + 1
    return seq


def _shape_text(t: torch.Tensor, any_dim0: bool) -> str:
    dims = [str(d) for d in t.shape]
    if any_dim0 and dims:
        dims[0] = "*"
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(dims)}]"


def fingerprint(seq: int, kind: str, buffers: Sequence[torch.Tensor], op: str = "", where: str = "") -> str:
    """What must agree across ranks for collective ``seq``: kind, op, each buffer's dtype and shape,
    and the sharded module it is for.

    Reads metadata only (no device sync). ``op`` is the reduce op, ``src=<rank>`` of a broadcast, or
    an agreement's point (``overlap.agreement``); ``where`` the module's fqn (``[blocks.2]``), if any.
    """
    any_dim0 = kind.startswith("all_to_all")
    head = f"#{seq} {kind}({op})" if op else f"#{seq} {kind}"
    text = " ".join([head, *(_shape_text(b, any_dim0) for b in buffers)])
    return f"{text} [{where}]" if where else text


def _encode(text: str) -> torch.Tensor:
    data = text.encode()
    if len(data) > FINGERPRINT_BYTES:  # keep a readable head and a digest of the whole
        digest = hashlib.blake2b(data, digest_size=_HASH_HEX // 2).hexdigest().encode()
        data = data[: FINGERPRINT_BYTES - len(digest) - 1] + b"~" + digest
    return torch.frombuffer(bytearray(data.ljust(FINGERPRINT_BYTES, b"\0")), dtype=torch.uint8)


def _decode(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")


@dataclasses.dataclass
class _Channel:
    """The gloo side channel of one checked group (see [Note: the side channel of the debug check])."""

    pg: dist.ProcessGroup  # the checked group; a new group under the same name gets a new channel
    backend: dist.ProcessGroupGloo
    rank: int
    size: int
    global_ranks: list[int]


_channels: dict[str, _Channel] = {}

# [Note: one thread at a time per group]
# Ranks pair a group's collectives by the order each rank issues them. Two threads issuing on one
# group at once interleave differently on each rank, so collectives pair with the wrong partners:
# silently (same sizes) or with gloo aborting a rank (EnforceNotMet, sizes differ). Debug mode marks
# a group while a thread runs its check (a blocking exchange with the peers, the longest part of
# issuing); a second thread reaching the check of that group meanwhile raises DesyncError saying so,
# before anything is issued or a side channel is built. The thread that was first goes on; peers
# left waiting for the second thread's check time out naming it. Threads taking turns (one issues,
# then another) are fine when every rank takes them in the same order; turns in different orders show
# up as an ordinary DesyncError (the sequence numbers' kinds or shapes differ), or not at all when the
# collectives look alike.
_checking_lock = threading.Lock()
_checking: dict[str, tuple[threading.Thread, str]] = {}  # group -> (thread in its check, its fingerprint)


def _channel(group: str, timeout: datetime.timedelta) -> Optional[_Channel]:
    """The side channel of ``group`` (None for a group of one rank); built at its first check."""
    pg = c10d._resolve_process_group(group)
    channel = _channels.get(group)
    if channel is not None and channel.pg is pg:
        return channel
    size = dist.get_world_size(pg)
    if size == 1:
        return None
    rank = dist.get_rank(pg)
    store = dist.PrefixStore(f"overlap/desync/{group}/", c10d._get_default_store())
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    channel = _Channel(pg, backend, rank, size, [dist.get_global_rank(pg, r) for r in range(size)])
    _channels[group] = channel
    return channel


def check(kind: str, seq: int, group: str, buffers: Sequence[torch.Tensor], op: str = "", where: str = "") -> None:
    """Debug mode: all-gather this rank's fingerprint over ``group``'s side channel and compare.

    Raises :class:`DesyncError` on every rank if any rank's fingerprint differs, and
    ``CollectiveError`` / ``CollectiveTimeoutError`` (naming ``seq`` and this rank's fingerprint)
    if the check cannot complete (a rank died, or did not reach it within the wait timeout).
    Returns at once when debug mode turns out to be off (the first call resolves ``OVERLAP_DEBUG``).
    """
    if not SWITCH.resolve():
        return
    mine = fingerprint(seq, kind, buffers, op, where)
    with _one_thread(group, seq, mine):
        _check_across_ranks(mine, seq, group)


@contextlib.contextmanager
def _one_thread(group: str, seq: int, mine: str) -> Iterator[None]:
    """Mark ``group`` as being checked by this thread; raise :class:`DesyncError` if another thread of
    this process is in a check on it (see [Note: one thread at a time per group])."""
    me = threading.current_thread()
    with _checking_lock:
        other = _checking.get(group)
        if other is not None and other[0] is not me:
            raise DesyncError(
                f"overlap: two threads issued collectives on group {group!r} at once on rank {dist.get_rank()} "
                f"(debug check, nothing was issued): thread {me.name!r} ({mine}) while thread "
                f"{other[0].name!r} ({other[1]}) was issuing. A group's collectives must come from one thread "
                f"at a time: each rank pairs them in the order it issues them, so two threads interleave "
                f"differently on each rank and pair the wrong collectives. Issue them from one thread, or "
                f"let threads take turns in the same order on every rank, or give each thread its own "
                f"process group (dist.new_group).",
                seq, group, {dist.get_rank(): mine},
            )
        _checking[group] = (me, mine)
    try:
        yield
    finally:
        with _checking_lock:
            if _checking.get(group, (None,))[0] is me:
                del _checking[group]


def _check_across_ranks(mine: str, seq: int, group: str) -> None:
    timeout = timeout_for(group, check=True)
    what = f"debug check before {mine} on group {group!r}"
    with region("overlap::desync_check"):
        try:
            channel = _channel(group, timeout)
            if channel is None:
                return
            out = torch.empty(channel.size * FINGERPRINT_BYTES, dtype=torch.uint8)
            finished = channel.backend._allgather_base(out, _encode(mine)).wait(timeout)
        except RuntimeError as e:
            raise collective_failure(what, timeout, e, group, seq, _seqs) from e
        if finished is False:
            raise collective_failure(what, timeout, None, group, seq, _seqs)
    rows = out.view(channel.size, FINGERPRINT_BYTES)
    texts = [_decode(rows[r]) for r in range(channel.size)]
    if all(t == texts[0] for t in texts):
        return
    by_rank = {channel.global_ranks[r]: t for r, t in enumerate(texts)}
    listed = "; ".join(f"rank {g}: {t}" for g, t in by_rank.items())
    hint = ""
    if any(" agree(" in t for t in texts) and not all(" agree(" in t for t in texts):
        hint = (" A rank at an agreement point (agree(...): e.g. overlap.shard's forward order, agreed when a "
                "forward pass ends) while another issues a collective means the ranks ran different sharded "
                "modules: one more or one fewer block, a branch taken on some ranks only, or an extra forward.")
    raise DesyncError(
        f"overlap: ranks are out of sync on group {group!r} at collective #{seq} (debug check, nothing "
        f"was issued): {listed}. Every rank must issue the same collectives, with the same op, dtypes "
        f"and shapes, for the same modules, in the same order.{hint}",
        seq, group, by_rank,
    )

