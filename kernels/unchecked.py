"""The four packing ops without argument checks, for callers that built every argument from the layout.

The public ops (``kernels.all_gather_copy_in`` ...) check every tensor's shape, dtype and device on
each call (~4 µs per tensor), and route through ``torch.ops.overlap.*`` while tracing. A runtime
that creates the shards, buffers and gradients itself from one ``ShardLayout`` and calls the ops in
eager mode several times per block per step pays that cost for nothing; it calls these instead.
Arguments are as for the public ops, already valid; ``dtype`` is required where the public op would
infer it. Wrong arguments here are undefined behaviour (the kernels read raw addresses).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.all_gather_copy_in import _all_gather_copy_in
from kernels.all_gather_copy_out import _all_gather_copy_out
from kernels.layout import ShardLayout
from kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in
from kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out

__all__ = ["all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"]


def all_gather_copy_in(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return _all_gather_copy_in(shards, layout, rank, dtype, shards[0].device)


def all_gather_copy_out(ag_output: torch.Tensor, layout: ShardLayout, outs: list[torch.Tensor]) -> None:
    _all_gather_copy_out(ag_output, layout, outs)


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], layout: ShardLayout, pre_scale: float | None, dtype: torch.dtype
) -> torch.Tensor:
    return _reduce_scatter_copy_in(grads, layout, pre_scale, dtype, grads[0].device)


def reduce_scatter_copy_out(
    rs_output: torch.Tensor, shard_grads: Sequence[torch.Tensor], layout: ShardLayout, rank: int,
    post_scale: float | None, accumulate: bool,
) -> None:
    _reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate)
