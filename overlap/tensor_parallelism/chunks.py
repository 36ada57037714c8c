"""How many chunks a decomposed collective matmul is cut into.

[Note: choosing the chunk count]
Cutting one collective of ``T`` seconds on the link into ``c`` chunks lets ``c - 1`` of them run
behind the matmuls of the chunks already there, but each chunk pays the link's per-collective
latency ``L`` and a host cost ``O`` of its own (issuing the collective, packing, a smaller GEMM,
and on gloo the loopback transfer's set-up). What stays exposed is about one chunk's transfer plus
those costs, ``T / c + c * (L + O)``, which is smallest at ``c = sqrt(T / (L + O))``. ``O`` is
``PER_CHUNK_COST_S``: 0.5 ms on CPU/gloo, measured on a 2-core box (a linear layer of 256 -> 1024
features on 2 x 256 rows per rank, chunks 1 to 8: the unlinked forward grows by about that much
per chunk; ``c = 4`` was the fastest behind a link with ``T`` ~ 10 ms, which this rule picks);
20 µs on CUDA, an estimate not yet measured on a GPU. So:

* behind a known link (``overlap.testing.current_link()``, the emulated one, whose group tier gives
  bandwidth and latency): ``c = round(sqrt(T / (L + O)))``, ``T`` the transfer time of this
  collective;
* otherwise (no link model: a real NCCL or gloo network whose figures this process does not know):
  ``DEFAULT_CHUNKS``;
* never more than ``MAX_CHUNKS`` (the per-chunk Python and GEMM launch cost grows with ``c``), and
  never more chunks than leave ``MIN_ROWS`` rows of the chunked dimension per chunk (a smaller
  GEMM wastes the compute it is meant to hide behind), nor than the rows there are;
* at least 1. ``chunks=`` of ``overlap.tensor_parallel`` overrides all of this (``chunks=1`` is
  torch's undecomposed collective-then-matmul, bitwise).

Every rank computes the same count from the same global sizes, so all ranks issue the same
collectives (contract 3).

The Inductor hook (``scheduler/collective_matmul.py``) shares ``MIN_ROWS`` but not the rest: it
takes the count it is given (``collective_matmul_chunks``, where None means no split) and lowers it
until the cut dim divides, since a compiled chunk has a static shape. It does not choose from the
link: a count chosen at compile time from the link active then would be baked into graphs that
Inductor caches by the pass's uuid, and reused behind another link.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from scheduler.collective_matmul import MIN_ROWS

__all__ = ["DEFAULT_CHUNKS", "MAX_CHUNKS", "MIN_ROWS", "PER_CHUNK_COST_S", "choose_chunks", "check_chunks"]

DEFAULT_CHUNKS = 2
MAX_CHUNKS = 8
PER_CHUNK_COST_S = {"cpu": 5e-4, "cuda": 2e-5}  # host cost per extra chunk, see the note


def check_chunks(chunks: object, arg: str = "chunks") -> Optional[int]:
    """``chunks`` if it is None (choose per call) or an int >= 1; else ``TypeError`` / ``ValueError``
    naming ``arg``."""
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"{arg} must be None (chosen from the sizes) or an int >= 1, got {type(chunks).__name__} {chunks!r}")
    if chunks < 1:
        raise ValueError(f"{arg} must be None (chosen from the sizes) or an int >= 1, got {chunks!r}")
    return chunks


def _link_chunks(wire_bytes: float, group: Any, device_type: str) -> Optional[int]:
    """``round(sqrt(T / (L + O)))`` behind the active emulated link, or None when no link is active."""
    from overlap.testing.emulated_link.active import current_link  # light: no torch patching on import

    link = current_link()
    if link is None:
        return None
    gbps, latency_us = link.tier(group)
    transfer = wire_bytes / (gbps * 1e9 / 8)
    per_chunk = latency_us * 1e-6 + PER_CHUNK_COST_S.get(device_type, PER_CHUNK_COST_S["cpu"])
    return max(1, round(math.sqrt(transfer / per_chunk)))


def choose_chunks(rows: int, wire_bytes: float, group: Any = None, override: Optional[int] = None,
                  device_type: str = "cpu") -> int:
    """The chunk count for a collective moving ``wire_bytes`` to each rank, chunked over ``rows``
    rows (the largest per-rank extent of the chunked dimension: every chunk then has a row on some
    rank); ``override`` (``chunks=``) wins but is still capped at ``rows``.
    See [Note: choosing the chunk count]."""
    if override is not None:
        return max(1, min(override, rows)) if rows > 0 else 1
    chosen = _link_chunks(wire_bytes, group, device_type)
    if chosen is None:
        chosen = DEFAULT_CHUNKS
    return max(1, min(chosen, MAX_CHUNKS, rows // MIN_ROWS))
