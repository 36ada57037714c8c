"""Parameters sharded on a dim other than 0 (FSDP2's ``shard_placement_fn`` returning ``Shard(d)``).

[Note: sharding on another dim]
FSDP2 lets ``shard_placement_fn`` put a parameter's shards on any dim ``d``: rank ``r`` holds
``torch.chunk(param, world, dim=d)[r]`` as a contiguous tensor (torchtitan does it for MoE expert
weights, whose dim 0 is already split by expert parallelism). The runtime's packing works in dim-0
rows, so such a parameter enters the group's layout in its *rows form*: ``(param.shape[d],
numel / param.shape[d])``, where rank ``r``'s rows are the bytes of its chunk, flattened. The
chunk's ``view`` as those rows is free (it is contiguous), and the layout gives each rank the rows
``torch.chunk`` gives it along ``d`` (one rule: ``ceil(n / world)`` each, the last ones short).
So the fused copy-in packs the chunks as they are, and a reduce-scatter's output for rank ``r``
is the flattened chunk of the summed gradient, which is the sharded gradient itself: what FSDP2
does with its chunk-and-cat before the reduce-scatter.

Two places see the parameter's own shape and need one copy each, as in FSDP2:

- the gathered parameter: the fused copy-out leaves rank-major chunks, and ``rows_to_full``
  concatenates the ranks' chunks along ``d`` into the unsharded parameter (``torch.cat(out=)``);
- the unsharded gradient before the reduce-scatter: ``full_to_rows`` concatenates its chunks along
  ``d``, each flattened, into the rows form the copy-in reads.

At one rank the chunk is the whole parameter and its rows form is its own memory: nothing moves.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["rows_shape", "chunk_sizes", "own_chunk", "rows_to_full", "full_to_rows"]


def rows_shape(shape: Sequence[int], dim: int) -> tuple[int, int]:
    """The rows form of a parameter of ``shape`` sharded on ``dim``: ``(shape[dim], the rest's numel)``."""
    n = shape[dim]
    rest = 1
    for i, size in enumerate(shape):
        if i != dim:
            rest *= size
    return (n, rest)


def chunk_sizes(n: int, world: int) -> list[int]:
    """How many of ``n`` indices each of ``world`` ranks holds (``torch.chunk``'s rule; 0 past the end)."""
    each = -(-n // world) if n else 0
    return [max(0, min(each, n - r * each)) for r in range(world)]


def own_chunk(full: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    """``rank``'s chunk of ``full`` along ``dim`` (a view, possibly empty)."""
    sizes = chunk_sizes(full.shape[dim], world)
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


def rows_to_full(per_rank: Sequence[torch.Tensor], shape: Sequence[int], dim: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The parameter of ``shape`` from each rank's chunk (``per_rank[r]``: that chunk's elements in
    order, any shape of that numel), concatenated along ``dim`` (into ``out`` when given)."""
    sizes = chunk_sizes(shape[dim], len(per_rank))
    chunks = []
    for rows, size in zip(per_rank, sizes):
        chunk_shape = list(shape)
        chunk_shape[dim] = size
        chunks.append(rows.reshape(-1)[: torch.Size(chunk_shape).numel()].view(chunk_shape))
    return torch.cat(chunks, dim=dim) if out is None else torch.cat(chunks, dim=dim, out=out)


def full_to_rows(full: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """``full`` in its rows form: each rank's chunk along ``dim``, flattened, one after another
    (a new tensor of ``rows_shape``; one copy of each chunk into it)."""
    rows = torch.empty(rows_shape(full.shape, dim), dtype=full.dtype, device=full.device)
    flat, start = rows.view(-1), 0
    for r in range(world):
        chunk = own_chunk(full, dim, world, r)
        flat.narrow(0, start, chunk.numel()).view(chunk.shape).copy_(chunk)
        start += chunk.numel()
    return rows
