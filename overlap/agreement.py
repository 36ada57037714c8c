"""Cross-rank agreements: every rank of a group contributes a value at a named point, bounded and checked.

Contract
--------
* :func:`exchange` is the one path by which the runtime agrees on something learned at run time
  (the forward order of ``overlap.shard``'s modules, the recorded schedules of ``scheduler.replay``
  (installed there by this module), the profiler's records): each rank of the group
  passes a picklable value at an agreement *point* (a short name, e.g. ``forward order``) and gets
  every rank's value back, by group rank.
* An agreement is itself a collective on the group, issued through ``overlap.collectives._issue``:
  numbered in the group's sequence (``overlap.desync``), waited within ``overlap.wait_timeout``,
  named in errors as ``agree(<point>) #<seq>``. So it meets the other ranks wherever they are (see
  [Note: agreements are collectives of the group]):

  ==========================  ===============================================================
  the other ranks are         what every rank gets
  ==========================  ===============================================================
  at the same point           the values (one 24-byte gather when all values are equal)
  at another collective,      debug mode: ``DesyncError`` at once, naming per rank its point or
  or another point            its collective (with the module's fqn); debug off: whatever the
                              mismatched collective does on the backend (gloo aborts a peer on
                              mismatched sizes: ``CollectiveError``), bounded by the wait timeout
  nowhere (stuck, or gone)    ``CollectiveTimeoutError`` after the wait timeout, naming the
                              ranks that have not reached it; ``CollectiveError`` at once when
                              a peer's process died
  ==========================  ===============================================================

* Values are compared by their pickled bytes: the first gather carries a 16-byte digest and the
  length of each rank's bytes; only when they differ does a second gather carry the bytes (padded
  to the longest), so the caller can name what each rank had.
* Groups of one rank return ``[value]`` and issue nothing. On NCCL the gathers use the current CUDA
  device and the result is copied to the host (a sync; agreements are rare: once per changed order).

[Note: agreements are collectives of the group]
An agreement exchanged out of band (``all_gather_object`` on the group, a store, a side channel)
cannot see what the other ranks are doing: a rank that ran one sharded block more than its peers is
at that block's all-gather while its peers are at the end of their forward, agreeing on the order.
With the debug check on a gloo side channel and the agreement on the group itself, each waited on a
channel the other never came to: a hang bounded only by the process group's timeout (30 minutes),
where debug off crashed in 0.3 s. Issued as the group's next collective, the agreement takes the
same road as the collective its peer issues instead: in debug mode both reach the side channel's
check with the same sequence number and see each other's fingerprints (``#3 agree(forward order)
uint8[48]`` against ``#3 all_gather float32[64] [blocks.2]``), so every rank raises ``DesyncError``
within one round trip; with debug off they pair on the backend like any two mismatched collectives.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch

from overlap import collectives
from overlap.groups import GroupInfo, resolve_group
from overlap.regions import region
from scheduler import replay

__all__ = ["exchange", "exchange_on_group", "HEADER_BYTES"]

_DIGEST_BYTES = 16
HEADER_BYTES = _DIGEST_BYTES + 8  # digest of the pickled value, then its length (little-endian int64)


def _device(info: GroupInfo) -> torch.device:
    if info.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(info: GroupInfo, point: str, row: torch.Tensor, where: str) -> torch.Tensor:
    """All-gather one uint8 row per rank as the group's next collective; returns ``(w, n)`` on the host."""
    w, n = info.size, row.numel()
    device = _device(info)
    out = torch.zeros(w * n, dtype=torch.uint8, device=device)
    slot = out[info.rank * n : (info.rank + 1) * n]
    slot.copy_(row)
    pg = info.pg
    work = collectives._issue("agree", device, lambda a: collectives._dist_all_gather(out, slot, pg, a), (out,),
                              out.numel(), pg.group_name, point, where=where)
    work.wait()
    return out.view(w, n).cpu()


def exchange(info: GroupInfo, point: str, value: Any, where: str = "") -> list[Any]:
    """Every rank's ``value`` at agreement point ``point`` over ``info``'s group, by group rank.

    All ranks of the group must call it at the same place in their sequence of collectives on it.
    ``where`` (e.g. the module's fqn) is shown with the point in debug-mode errors. Raises
    ``DesyncError`` (debug mode), ``CollectiveError`` or ``CollectiveTimeoutError`` as the table in
    the module docstring says; ``TypeError`` if ``value`` cannot be pickled, before anything is issued.
    """
    if info.size == 1:
        return [value]
    try:
        data = pickle.dumps(value)
    except Exception as e:  # pickling raises many types
        raise TypeError(f"overlap agreement {point!r}: value must be picklable, got {type(value).__name__} ({e})") from e
    header = hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest() + len(data).to_bytes(8, "little")
    with region("overlap::agree"):
        heads = _gather(info, point, torch.frombuffer(bytearray(header), dtype=torch.uint8), where)
        if bool((heads == heads[0]).all()):
            return [value] * info.size
        lengths = [int.from_bytes(h[_DIGEST_BYTES:].numpy().tobytes(), "little") for h in heads]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = _gather(info, f"{point}: values", padded, where)
    return [pickle.loads(rows[r, : lengths[r]].numpy().tobytes()) for r in range(info.size)]


def exchange_on_group(group: "torch.distributed.ProcessGroup", point: str, value: Any) -> list[Any]:
    """:func:`exchange` over a process group: what ``scheduler.replay`` agrees through (installed below)."""
    return exchange(resolve_group(group), point, value)


replay.set_exchange(exchange_on_group)
