"""quantized_copy_in: pack tensors into quantized slots (int8 or fp8 codes + a float32 scale per block), one launch.

Two uses, one kernel ([Note: quantized slots] in ``overlap_kernels/quantized_layout.py``):

* ``quantized_all_gather_copy_in(shards, qlayout, rank)`` -> ``(q_input, q_output)``: this rank's
  shards into its quantized slot of a new all-gather buffer (``q_input = q_output``'s slot ``rank``,
  a view: the all-gather may run in place; the other slots are left for it to fill). The qwZ
  copy-in: shards stay exact, only what travels is quantized.
* ``quantized_reduce_scatter_copy_in(grads, qlayout)`` -> ``q_input``: full gradients into every
  rank's quantized slot (slot ``r`` holds rank ``r``'s rows), the input of the all-to-all that sends
  each slot to its owner (qgZ).

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``shards[i]``           ``layout.shard_shape(i, rank)``        float32, bfloat16, float16, mixed
``grads[i]``            ``layout.shapes[i]``                   float32, bfloat16, float16, mixed
``q_output``, ``q_input``  ``(buffer_bytes,)``, ``(slot_bytes,)``  uint8
======================  =====================================  =================================

Values are read as float32 (exact for these dtypes) and quantized as ``overlap_kernels.block_quantization``
says. The public functions raise ``ValueError`` naming the tensors when a value is NaN or inf
(after filling a new buffer: nothing of the caller's changes); the unchecked ``_quantized_copy_in``
(for the runtime) leaves such a block with a NaN scale, which dequantizes to NaN, never to a finite
value. The Triton kernel and the torch fallback are bitwise equal.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from overlap_kernels import _checks, _launch, native_passes
from overlap_kernels._device_function import device_function
from overlap_kernels._jit import load_as
from overlap_kernels.block_quantization import quantize_blocks_torch, quantize_rows
from overlap_kernels.layout import ShardLayout
from overlap_kernels.quantized_layout import (QuantizedLayout, aligned_full_block, codes_at, launch, pointer_table, program_blocks,
                                      tile_offsets, tile_rows)

QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The parameter-side dtypes the quantized ops take."""


# ------------------------------------------------------------------------------------------- kernel
@triton.jit
def _quantized_copy_in_kernel(
    blocks_ptr, pointers_ptr, codes_ptr, scales_ptr, first_slot, programs_per_slot, slot_bytes, slot_numel,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    BLOCK: tl.constexpr, FP8: tl.constexpr, VECTOR: tl.constexpr, VEC: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    slot = first_slot + g // programs_per_slot
    flat_start, length, addr, group, tensor_start, n_valid, first_block = program_blocks(blocks_ptr, pointers_ptr, g)
    codes_start = slot * slot_bytes + flat_start
    if VECTOR and aligned_full_block(addr, tensor_start, codes_start, n_valid, length, BLOCKS_PER_PROGRAM * BLOCK):
        scale = _quantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, length, DT0, DT1, DT2,
                               DT3, NUM_GROUPS, BLOCK, FP8, VEC, BLOCKS_PER_PROGRAM, True)
    else:
        scale = _quantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, length, DT0, DT1, DT2,
                               DT3, NUM_GROUPS, BLOCK, FP8, VEC, BLOCKS_PER_PROGRAM, False)
    rows, present = tile_rows(length, BLOCKS_PER_PROGRAM, BLOCK)
    tl.store(scales_ptr + (slot * slot_bytes + slot_numel) // 4 + first_block + rows, scale, mask=present)


@device_function
def _quantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, length, DT0: tl.constexpr,
                   DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
                   BLOCK: tl.constexpr, FP8: tl.constexpr, VEC: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """Quantize a program's tile ([Note: several blocks per program]) into its codes; returns the
    scales ``[BLOCKS_PER_PROGRAM]``. ``ALIGNED``: [Note: the aligned full-block path], no masks."""
    offs = tile_offsets(BLOCKS_PER_PROGRAM, BLOCK, VEC, ALIGNED)
    if ALIGNED:
        valid, other, stored = None, None, None
    else:
        valid, other, stored = offs < n_valid, 0.0, offs < length  # padding: zeros, its codes written
    x = load_as(addr, group, tensor_start, offs, valid, other, DT0, DT1, DT2, DT3, NUM_GROUPS, tl.float32, ALIGNED)
    q, scale = quantize_rows(x, FP8)
    tl.store(codes_at(codes_ptr, codes_start, offs, ALIGNED), q, mask=stored)
    return scale


# -------------------------------------------------------------------------------------- public API
def _check(op: str, name: str, tensors: Sequence[torch.Tensor], qlayout: QuantizedLayout, rank: int | None,
           ) -> tuple[torch.dtype, ...]:
    if not isinstance(qlayout, QuantizedLayout):
        raise TypeError(f"{op}: qlayout must be a overlap_kernels.quantized_layout.QuantizedLayout, got {type(qlayout).__name__}")
    layout = qlayout.layout
    if rank is not None:
        _checks.check_rank(op, rank, layout)
    shapes = layout.shard_shape_tuple(rank) if rank is not None else layout.shapes
    checked = _checks.check_tensors(op, name, tensors, shapes)
    bad = sorted(str(d) for d in checked.distinct if d not in QUANTIZED_DTYPES)
    if bad:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16 tensors, got {bad}")
    return checked.dtypes


def _raise_if_non_finite(op: str, name: str, tensors: Sequence[torch.Tensor], qlayout: QuantizedLayout,
                         q_output: torch.Tensor, rank: int | None) -> None:
    scales = qlayout.scales(q_output)
    if bool(torch.isfinite(scales if rank is None else scales[rank]).all()):
        return
    bad = [i for i, t in enumerate(tensors) if not bool(torch.isfinite(t).all())]
    raise ValueError(f"{op}: {name}{bad} hold NaN or inf; {qlayout.format} block quantization needs finite values "
                     f"(a non-finite block has no scale)")


def quantized_all_gather_copy_in(shards: Sequence[torch.Tensor], qlayout: QuantizedLayout, rank: int,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``shards`` (this rank's) into a new quantized all-gather buffer; ``(q_input, q_output)``."""
    op = "quantized_all_gather_copy_in"
    dtypes = _check(op, "shards", shards, qlayout, rank)
    q_input, q_output = _quantized_copy_in(shards, qlayout, rank, dtypes)
    _raise_if_non_finite(op, "shards", shards, qlayout, q_output, rank)
    return q_input, q_output


def quantized_reduce_scatter_copy_in(grads: Sequence[torch.Tensor], qlayout: QuantizedLayout) -> torch.Tensor:
    """Quantize full ``grads`` into every rank's quantized slot of a new buffer (returned)."""
    op = "quantized_reduce_scatter_copy_in"
    dtypes = _check(op, "grads", grads, qlayout, None)
    q_input, _ = _quantized_copy_in(grads, qlayout, None, dtypes)
    _raise_if_non_finite(op, "grads", grads, qlayout, q_input, None)
    return q_input


# ------------------------------------------------------------------------------------------- launch
def _quantized_copy_in(tensors: Sequence[torch.Tensor], qlayout: QuantizedLayout, rank: int | None,
                       dtypes: tuple[torch.dtype, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on checked arguments: ``rank``'s shards into slot ``rank`` (returns that slot and the
    whole buffer), or (``rank=None``) full tensors into every slot (returns the buffer twice)."""
    device = tensors[0].device
    q_output = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8, device=device)
    q_input = q_output.view(qlayout.world_size, qlayout.slot_bytes)[rank] if rank is not None else q_output
    if not _launch.triton_enabled(device):
        with torch.no_grad():
            _quantized_copy_in_torch(tensors, qlayout, rank, q_output)
        return q_input, q_output
    if not native_passes.contiguous(tensors):  # one pass; a contiguous copy only where one is strided
        tensors = [t.contiguous() for t in tensors]
    table = qlayout.segment_table(rank, device)
    pointers = pointer_table(qlayout, ("copy-in", rank), tensors, device, dtypes)
    launch(_quantized_copy_in_kernel, table, pointers, q_output.view(torch.int8), q_output.view(torch.float32),
           0 if rank is None else rank, table.programs_per_slot, qlayout.slot_bytes, qlayout.layout.slot_numel,
           BLOCK=qlayout.block, FP8=qlayout.format == "fp8")
    return q_input, q_output


def packed_float32(tensors: Sequence[torch.Tensor], layout: ShardLayout, rank: int | None) -> torch.Tensor:
    """float32 ``(slots, slot_numel)``: the flat slot of ``rank`` (``None``: every rank's, from full
    tensors), zeros in the padding: what the kernel quantizes (exact: float32, bfloat16 and float16
    widen to float32 exactly)."""
    ranks = range(layout.world_size) if rank is None else (rank,)
    flat = torch.zeros(len(ranks), layout.slot_numel, dtype=torch.float32, device=tensors[0].device)
    dsts, srcs = [], []
    for j, r in enumerate(ranks):
        for view, t in zip(layout.shard_views(flat[j], r), tensors):
            if view.numel():
                dsts.append(view)
                srcs.append(t if rank is not None else layout.shard(t, r))
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return flat


def _quantized_copy_in_torch(tensors: Sequence[torch.Tensor], qlayout: QuantizedLayout, rank: int | None,
                             q_output: torch.Tensor) -> None:
    """The op without Triton, bitwise equal to the kernel: pack in float32, quantize each block where
    it lies (``quantize_blocks_torch``)."""
    flat = packed_float32(tensors, qlayout.layout, rank)
    q, scale = quantize_blocks_torch(flat, *qlayout.block_index(flat.device), qlayout.format)
    slots = slice(None) if rank is None else slice(rank, rank + 1)
    qlayout.codes(q_output)[slots] = q
    qlayout.scales(q_output)[slots] = scale
