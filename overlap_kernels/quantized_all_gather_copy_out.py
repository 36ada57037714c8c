"""quantized_all_gather_copy_out: dequantize a gathered quantized buffer into the full parameters (one launch).

Contract: ``outs = quantized_all_gather_copy_out(q_output, qlayout, outs, dtype)`` writes, for every
rank ``r`` and parameter ``i``, quantized slot ``r``'s rows of parameter ``i`` (codes times their
block's scale, in float32, then cast to the out's dtype as torch casts) into rows
``layout.shard_rows(i, r)`` of ``outs[i]``. ``outs=None`` allocates them (dtype ``dtype``, default
float32); given ``outs`` are written in place. ``q_output`` is only read. A block that held a NaN or
inf (its scale is NaN: ``overlap_kernels.quantized_copy_in``) comes out NaN in every element; the public
function raises ``ValueError`` naming the ranks instead, before writing anything.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``q_output``            ``(qlayout.buffer_bytes,)``            uint8
``outs[i]`` (out)       ``layout.shapes[i]``, contiguous       float32, bfloat16, float16, mixed
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
from overlap_kernels._jit import store_as
from overlap_kernels.block_quantization import dequantize_block, dequantize_elements_torch
from overlap_kernels.quantized_copy_in import QUANTIZED_DTYPES
from overlap_kernels.quantized_layout import (QuantizedLayout, aligned_full_block, codes_at, launch, pointer_table, program_blocks,
                                      tile_offsets, tile_rows)

OP = "quantized_all_gather_copy_out"


@triton.jit
def _quantized_all_gather_copy_out_kernel(
    blocks_ptr, pointers_ptr, codes_ptr, scales_ptr, programs_per_slot, slot_bytes, slot_numel,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    BLOCK: tl.constexpr, FP8: tl.constexpr, VECTOR: tl.constexpr, VEC: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    slot = g // programs_per_slot
    flat_start, length, addr, group, tensor_start, n_valid, first_block = program_blocks(blocks_ptr, pointers_ptr, g)
    codes_start = slot * slot_bytes + flat_start
    rows, present = tile_rows(length, BLOCKS_PER_PROGRAM, BLOCK)
    scale = tl.load(scales_ptr + (slot * slot_bytes + slot_numel) // 4 + first_block + rows, mask=present, other=0.0)
    if VECTOR and aligned_full_block(addr, tensor_start, codes_start, n_valid, n_valid, BLOCKS_PER_PROGRAM * BLOCK):
        _dequantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, scale, DT0, DT1, DT2, DT3,
                         NUM_GROUPS, BLOCK, FP8, VEC, BLOCKS_PER_PROGRAM, True)
    else:
        _dequantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, scale, DT0, DT1, DT2, DT3,
                         NUM_GROUPS, BLOCK, FP8, VEC, BLOCKS_PER_PROGRAM, False)


@device_function
def _dequantize_tile(addr, group, tensor_start, codes_ptr, codes_start, n_valid, scale, DT0: tl.constexpr,
                     DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
                     BLOCK: tl.constexpr, FP8: tl.constexpr, VEC: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """Dequantize a program's tile (scales ``[BLOCKS_PER_PROGRAM]``) into its tensor's elements
    ([Note: several blocks per program]). ``ALIGNED``: [Note: the aligned full-block path], no masks."""
    offs = tile_offsets(BLOCKS_PER_PROGRAM, BLOCK, VEC, ALIGNED)
    valid = None if ALIGNED else offs < n_valid
    x = dequantize_block(tl.load(codes_at(codes_ptr, codes_start, offs, ALIGNED), mask=valid), scale[:, None], FP8)
    store_as(addr, group, tensor_start, offs, x, valid, DT0, DT1, DT2, DT3, NUM_GROUPS, ALIGNED)


def quantized_all_gather_copy_out(
    q_output: torch.Tensor, qlayout: QuantizedLayout, outs: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Dequantize every slot of ``q_output`` into ``outs`` (allocated when None); returns them."""
    if not isinstance(qlayout, QuantizedLayout):
        raise TypeError(f"{OP}: qlayout must be a overlap_kernels.quantized_layout.QuantizedLayout, got {type(qlayout).__name__}")
    device = _check_buffer(q_output, qlayout)
    layout = qlayout.layout
    if outs is None:
        dtype = torch.float32 if dtype is None else dtype
        if dtype not in QUANTIZED_DTYPES:
            raise TypeError(f"{OP}: dtype must be float32, bfloat16 or float16, got {dtype}")
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape in layout.shapes]
    else:
        _checks.check_tensors(OP, "outs", outs, layout.shapes, device, writable=True)
        bad = sorted(str(o.dtype) for o in outs if o.dtype not in QUANTIZED_DTYPES or (dtype and o.dtype != dtype))
        if bad:
            raise TypeError(f"{OP}: outs must be float32, bfloat16 or float16 tensors"
                            f"{f' of dtype {dtype}' if dtype else ''}, got {bad}")
    scales = qlayout.scales(q_output)
    if not bool(torch.isfinite(scales).all()):
        ranks = torch.nonzero(~torch.isfinite(scales).all(dim=1)).flatten().tolist()
        raise ValueError(f"{OP}: the slots of ranks {ranks} hold non-finite blocks (NaN scales: a NaN or inf "
                         f"was quantized); refusing to write NaN into outs")
    _quantized_all_gather_copy_out(q_output, qlayout, list(outs))
    return list(outs)


def _check_buffer(q: object, qlayout: QuantizedLayout, name: str = "q_output") -> torch.device:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{OP}: {name} must be a tensor, got {type(q).__name__}")
    if q.dtype != torch.uint8 or q.numel() != qlayout.buffer_bytes or not q.is_contiguous():
        raise ValueError(f"{OP}: {name} must be a contiguous uint8 tensor of {qlayout.buffer_bytes} bytes "
                         f"(qlayout.buffer_bytes), got {q.dtype} of {q.numel()} elements")
    return q.device


def _quantized_all_gather_copy_out(q_output: torch.Tensor, qlayout: QuantizedLayout,
                                   outs: Sequence[torch.Tensor]) -> None:
    """The op on checked arguments (``outs`` contiguous): the kernel, or the torch fallback."""
    device = q_output.device
    if not _launch.triton_enabled(device):
        with torch.no_grad():
            _quantized_all_gather_copy_out_torch(q_output, qlayout, outs)
        return
    table = qlayout.segment_table(None, device)
    pointers = pointer_table(qlayout, ("all-gather copy-out",), outs, device)
    launch(_quantized_all_gather_copy_out_kernel, table, pointers, q_output.view(torch.int8),
           q_output.view(torch.float32), table.programs_per_slot, qlayout.slot_bytes, qlayout.layout.slot_numel,
           BLOCK=qlayout.block, FP8=qlayout.format == "fp8")


def _quantized_all_gather_copy_out_torch(q_output: torch.Tensor, qlayout: QuantizedLayout,
                                         outs: Sequence[torch.Tensor]) -> None:
    """The op without Triton: dequantize every slot (float32), then one ``_foreach_copy_`` of each
    rank's shard views into the rows of ``outs`` (the cast as torch does it, as the kernel's)."""
    layout = qlayout.layout
    flat = dequantized(q_output, qlayout)
    dsts, srcs = [], []
    for r in range(layout.world_size):
        for out, view in zip(outs, layout.shard_views(flat[r, : layout.slot_numel], r)):
            if view.numel():
                dsts.append(layout.shard(out, r))
                srcs.append(view)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def dequantized(buffer: torch.Tensor, qlayout: QuantizedLayout) -> torch.Tensor:
    """float32 ``(world_size, slot_numel)``: every slot of a quantized buffer dequantized (the codes'
    values times their block's scale, as the kernels compute them)."""
    _, element_block = qlayout.block_index(buffer.device)
    return dequantize_elements_torch(qlayout.codes(buffer), qlayout.scales(buffer).index_select(1, element_block),
                                     qlayout.format)
