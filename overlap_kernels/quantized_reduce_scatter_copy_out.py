"""quantized_reduce_scatter_copy_out: sum the quantized slots this rank received, into its sharded gradients (one launch).

Contract: ``quantized_reduce_scatter_copy_out(received, outs, qlayout, rank, scale, accumulate)``
reads ``received``, the ``world_size`` quantized versions of this rank's slot that the all-to-all
delivered (rank ``s``'s at quantized slot ``s``), dequantizes each block in float32 and sums them in
rank order (``((0 + d_0) + d_1) + ...``: the same order on every rank and in both paths), multiplies
by ``scale`` (rounded to float32; ``None``: no scale), then writes the result cast to each out's dtype
into ``outs`` (``rank``'s shards), or with ``accumulate`` adds it to them (``float32(out) + sum``, then
the cast). The sum over ranks is float32 whatever the gradients' dtype: quantization error does not
compound over a ring (qgZ). A block that held a NaN or inf on some rank comes out NaN.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``received``            ``(qlayout.buffer_bytes,)``            uint8
``outs[i]`` (in/out)    ``layout.shard_shape(i, rank)``, contiguous  float32, bfloat16, float16, mixed
======================  =====================================  =================================

The Triton kernel and the torch fallback are bitwise equal.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from overlap_kernels import _checks, _launch
from overlap_kernels._device_function import device_function
from overlap_kernels._dtypes import as_float32
from overlap_kernels._jit import load_as, store_as
from overlap_kernels.block_quantization import dequantize_block
from overlap_kernels.quantized_all_gather_copy_out import _check_buffer, dequantized
from overlap_kernels.quantized_copy_in import QUANTIZED_DTYPES
from overlap_kernels.quantized_layout import (QuantizedLayout, aligned_full_block, codes_at, launch, pointer_table, program_blocks,
                                      tile_offsets, tile_rows)

OP = "quantized_reduce_scatter_copy_out"


@triton.jit
def _quantized_reduce_scatter_copy_out_kernel(
    blocks_ptr, pointers_ptr, codes_ptr, scales_ptr, slot_bytes, slot_numel, scale,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, WORLD_SIZE: tl.constexpr,
    FP8: tl.constexpr, VECTOR: tl.constexpr, VEC: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    flat_start, length, addr, group, tensor_start, n_valid, first_block = program_blocks(blocks_ptr, pointers_ptr, g)
    # every slot's codes are aligned when the first's are and a slot is a multiple of 16 bytes long
    if VECTOR and aligned_full_block(addr, tensor_start, flat_start | (slot_bytes % 16), n_valid, n_valid,
                                     BLOCKS_PER_PROGRAM * BLOCK):
        _sum_tile(addr, group, tensor_start, codes_ptr, scales_ptr, flat_start, length, n_valid, first_block,
                  slot_bytes, slot_numel, scale, DT0, DT1, DT2, DT3, NUM_GROUPS, BLOCK, HAS_SCALE, ACCUMULATE,
                  WORLD_SIZE, FP8, VEC, BLOCKS_PER_PROGRAM, True)
    else:
        _sum_tile(addr, group, tensor_start, codes_ptr, scales_ptr, flat_start, length, n_valid, first_block,
                  slot_bytes, slot_numel, scale, DT0, DT1, DT2, DT3, NUM_GROUPS, BLOCK, HAS_SCALE, ACCUMULATE,
                  WORLD_SIZE, FP8, VEC, BLOCKS_PER_PROGRAM, False)


@device_function
def _sum_tile(addr, group, tensor_start, codes_ptr, scales_ptr, flat_start, length, n_valid, first_block, slot_bytes,
              slot_numel, scale, DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr,
              NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
              WORLD_SIZE: tl.constexpr, FP8: tl.constexpr, VEC: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
              ALIGNED: tl.constexpr):
    """A program's tile ([Note: several blocks per program]) dequantized from every slot, summed in
    rank order, scaled, written or added into its shard's elements. ``ALIGNED``: [Note: the aligned
    full-block path], no masks."""
    offs = tile_offsets(BLOCKS_PER_PROGRAM, BLOCK, VEC, ALIGNED)
    rows, present = tile_rows(length, BLOCKS_PER_PROGRAM, BLOCK)
    if ALIGNED:
        valid, other = None, None
    else:
        valid, other = offs < n_valid, 0.0
    acc = tl.zeros([BLOCKS_PER_PROGRAM, BLOCK], dtype=tl.float32)
    for s in range(WORLD_SIZE):  # a constexpr: Triton 3.6's interpreter cannot loop to a runtime int
        q = tl.load(codes_at(codes_ptr, s * slot_bytes + flat_start, offs, ALIGNED), mask=valid)
        block_scale = tl.load(scales_ptr + (s * slot_bytes + slot_numel) // 4 + first_block + rows, mask=present,
                              other=0.0)
        acc += dequantize_block(q, block_scale[:, None], FP8)
    if HAS_SCALE:
        acc = acc * scale
    if ACCUMULATE:
        acc = load_as(addr, group, tensor_start, offs, valid, other, DT0, DT1, DT2, DT3, NUM_GROUPS, tl.float32,
                      ALIGNED) + acc
    store_as(addr, group, tensor_start, offs, acc, valid, DT0, DT1, DT2, DT3, NUM_GROUPS, ALIGNED)


def quantized_reduce_scatter_copy_out(
    received: torch.Tensor, outs: Sequence[torch.Tensor], qlayout: QuantizedLayout, rank: int,
    scale: float | None = None, accumulate: bool = False,
) -> None:
    """Sum the received quantized slots into ``outs`` (``rank``'s shards), scaled, written or added."""
    if not isinstance(qlayout, QuantizedLayout):
        raise TypeError(f"{OP}: qlayout must be a overlap_kernels.quantized_layout.QuantizedLayout, got {type(qlayout).__name__}")
    device = _check_buffer(received, qlayout, "received")
    _checks.check_rank(OP, rank, qlayout.layout)
    _checks.check_tensors(OP, "outs", outs, qlayout.layout.shard_shape_tuple(rank), device, writable=True)
    bad = sorted(str(o.dtype) for o in outs if o.dtype not in QUANTIZED_DTYPES)
    if bad:
        raise TypeError(f"{OP}: outs must be float32, bfloat16 or float16 tensors, got {bad}")
    _checks.check_scale(OP, "scale", scale)
    if not isinstance(accumulate, bool):
        raise TypeError(f"{OP}: accumulate must be a bool, got {type(accumulate).__name__}")
    _quantized_reduce_scatter_copy_out(received, list(outs), qlayout, rank, scale, accumulate)


def _quantized_reduce_scatter_copy_out(received: torch.Tensor, outs: Sequence[torch.Tensor],
                                       qlayout: QuantizedLayout, rank: int, scale: float | None,
                                       accumulate: bool) -> None:
    """The op on checked arguments (``outs`` contiguous): the kernel, or the torch fallback."""
    device = received.device
    if not _launch.triton_enabled(device):
        with torch.no_grad():
            _quantized_reduce_scatter_copy_out_torch(received, outs, qlayout, rank, scale, accumulate)
        return
    table = qlayout.segment_table(rank, device)
    pointers = pointer_table(qlayout, ("reduce-scatter copy-out", rank), outs, device)
    launch(_quantized_reduce_scatter_copy_out_kernel, table, pointers, received.view(torch.int8),
           received.view(torch.float32), qlayout.slot_bytes, qlayout.layout.slot_numel,
           1.0 if scale is None else as_float32(scale), BLOCK=qlayout.block, HAS_SCALE=scale is not None,
           ACCUMULATE=accumulate, WORLD_SIZE=qlayout.world_size,
           FP8=qlayout.format == "fp8")


def _quantized_reduce_scatter_copy_out_torch(received: torch.Tensor, outs: Sequence[torch.Tensor],
                                             qlayout: QuantizedLayout, rank: int, scale: float | None,
                                             accumulate: bool) -> None:
    """The op without Triton, bitwise equal to the kernel: dequantize, sum in rank order, scale, then
    one ``_foreach_copy_`` (or float32 add and copy) into the shards."""
    layout = qlayout.layout
    acc = summed_slots(received, qlayout, scale)
    pairs = [(o, v) for o, v in zip(outs, layout.shard_views(acc[: layout.slot_numel], rank)) if v.numel()]
    if not pairs:
        return
    dsts, srcs = [o for o, _ in pairs], [v for _, v in pairs]
    if accumulate:
        srcs = torch._foreach_add([d.float() for d in dsts], srcs)
    torch._foreach_copy_(dsts, srcs)


def summed_slots(received: torch.Tensor, qlayout: QuantizedLayout, scale: float | None) -> torch.Tensor:
    """float32 ``(padded slot,)``: the received quantized slots dequantized, summed in rank order and
    scaled, as the kernel computes them (the slot's padding is zero)."""
    deq = dequantized(received, qlayout)
    acc = torch.zeros_like(deq[0])
    for s in range(qlayout.layout.world_size):
        acc += deq[s]
    if scale is not None:
        acc *= as_float32(scale)
    return acc
