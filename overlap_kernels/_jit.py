"""Device-side helpers of the four packing kernels (``@triton.jit``, inlined into each kernel).

Contract: ``block_run`` reads a program's block from the tables ``overlap_kernels._launch`` builds ([Note:
one launch over N tensors]); ``vector_lanes`` / ``scalar_lanes`` give a block's element offsets on
the aligned unmasked path and on the others; ``load_as`` / ``store_as`` read and write the
parameter-side tensor of any of up to ``MAX_DTYPE_GROUPS`` dtypes through its raw address;
``convert`` casts as torch does. ``INTERPRET`` says whether ``triton.jit`` made interpreter kernels.

[Note: alignment per run]
Blocks that lie wholly inside their run take an unmasked path; the last block of a run is masked.
An unmasked block whose parameter side starts 16-byte aligned (address a multiple of 16 bytes, start
a multiple of 16 elements: ``block_run``'s ``aligned``, decided per run inside the kernel) takes
vector loads and stores; the others, scalar ones. The flat side is always aligned (slot offsets are
multiples of ``ShardLayout.ALIGN``). One odd parameter thus slows only its own runs.

[Note: per-thread width]
Every thread moves ``VEC`` consecutive elements on both sides of a copy, ``VEC`` = 16 bytes of the
widest *destination* dtype (``overlap_kernels._launch.vector_width``), passed as ``tl.max_contiguous`` of
the offsets. Left to itself Triton loads 16 bytes per thread and caps stores at 16 bytes, so a
widening cast (bfloat16 -> float32: 8 elements loaded, 4 stored per thread) goes through a
shared-memory layout conversion. With ``VEC``: stores are 128-bit and gapless across a warp; loads
are 128-bit when the source is as wide as the destination, 64-bit (still coalesced) when it is half
as wide, and two 128-bit loads per thread when it is twice as wide. No layout conversion, no shared
memory (tests/packing/test_aot_compile.py checks the PTX). This is also the rule of torch's vectorized CUDA
casts (one vector width for all operands, the narrowest one's). Unaligned and masked blocks are
scalar on both sides (``scalar_lanes``), in steps of ``CHUNK`` elements (4 per thread on a GPU,
``overlap_kernels._launch._pick_block``): done in one step, their per-element 64-bit addresses would set the
register count of the whole kernel (tests/packing/test_aot_compile.py checks the count).
"""
from __future__ import annotations

import os

import triton.language as tl

from overlap_kernels._device_function import device_function

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
"""Whether ``triton.jit`` made interpreter kernels (read once, as Triton does at decoration time)."""

_INTERPRETED = tl.constexpr(INTERPRET)


@device_function
def _to_bf16_rtne(x):
    """float32 -> bfloat16, round to nearest even; every NaN becomes 0x7FC0 (c10's scalar rule)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    u = tl.where(x != x, 0x7FC0, u)
    return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@device_function
def _bf16_to_f32(x):
    """bfloat16 -> float32, exact for every value (subnormals and NaN payloads included): a bfloat16
    is the upper half of a float32."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@device_function
def _from_float32(x, TO: tl.constexpr):
    if _INTERPRETED and TO == tl.bfloat16:
        y = _to_bf16_rtne(x)
    else:
        y = x.to(TO)
    return y


@device_function
def _to_float32(x):
    if _INTERPRETED and x.dtype == tl.bfloat16:
        y = _bf16_to_f32(x)
    else:
        y = x.to(tl.float32)
    return y


@device_function
def convert(x, TO: tl.constexpr):
    """``x.to(TO)``, rounding as torch does.

    [Note: conversions as torch does them]
    * Conversions to or from a 16-bit float go through float32, because torch's ``c10::Half`` and
      ``c10::BFloat16`` convert from and to ``float``: float64 -> float16 rounds twice in torch
      (``1 + 2**-11 + 2**-40`` becomes 1.0, not the nearest half ``1 + 2**-10``), and so do we.
    * Triton's interpreter truncates float32 -> bfloat16 and flushes bfloat16 subnormals to zero
      on bfloat16 -> float32, so under the interpreter both are done with integer ops (round to
      nearest even; the exact widening). Compiled kernels use the hardware conversions.
    * The bit pattern of a NaN produced by a narrowing cast is not part of the contract: torch itself
      gives 0xFFFF (vectorized CPU copy), 0x7FC0 (scalar CPU path) or 0x7FFF (CUDA) for float32
      NaN -> bfloat16. A NaN stays a NaN; copies without a cast keep every bit.
    """
    if x.dtype == TO:
        y = x
    elif x.dtype == tl.float32:
        y = _from_float32(x, TO)
    elif TO == tl.float32:
        y = _to_float32(x)
    elif x.dtype == tl.float16 or x.dtype == tl.bfloat16 or TO == tl.float16 or TO == tl.bfloat16:
        y = _from_float32(_to_float32(x), TO)
    else:
        y = x.to(TO)
    return y


@device_function
def block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK: tl.constexpr):
    """This program's block: ``(addr, group, tensor_start, flat_start, n_valid, n_total, aligned)``.

    ``addr``/``group``: address and dtype group of the parameter-side tensor; starts are the block's
    first element (int64); counts are what is left of the run from there (may exceed ``BLOCK``);
    ``aligned``: the parameter side starts 16-byte aligned ([Note: alignment per run]: the address
    a multiple of 16 bytes and the start a multiple of 16 elements; ``BLOCK`` is a multiple of 16, so
    this holds for every block of a run or for none).
    """
    pid = tl.program_id(0).to(tl.int64)
    row = runs_ptr + tl.load(blocks_ptr + pid).to(tl.int64) * 6
    param = tl.load(row)
    start = (pid - tl.load(row + 5)) * BLOCK
    tensor_start = tl.load(row + 1) + start
    flat_start = tl.multiple_of(tl.load(row + 2) + start, 16)  # slot offsets are 16-aligned
    addr = tl.load(pointers_ptr + param * 2)
    group = tl.load(pointers_ptr + param * 2 + 1)
    aligned = ((addr % 16) == 0) & ((tensor_start % 16) == 0)
    return addr, group, tensor_start, flat_start, tl.load(row + 3) - start, tl.load(row + 4) - start, aligned


@device_function
def vector_lanes(BLOCK: tl.constexpr, VEC: tl.constexpr):
    """A block's element offsets on an aligned unmasked path: ``arange(0, BLOCK)``, ``VEC``
    consecutive elements per thread ([Note: per-thread width])."""
    return tl.max_contiguous(tl.arange(0, BLOCK), VEC)


@device_function
def scalar_lanes(BLOCK: tl.constexpr):
    """A block's element offsets on an unaligned or masked path, shaped ``(1, BLOCK)``.

    Triton's coalescing widens every load to the widest access *of the same shape* anywhere in the
    kernel, and to what the load itself allows (the flat side is aligned even when the parameter
    side is not); a wide load feeding a scalar store is a layout conversion through shared memory.
    Another shape keeps these paths apart from the vector path, and a contiguity of 1 keeps their
    flat side scalar: scalar on both sides, no shared memory ([Note: per-thread width]).
    """
    return tl.max_contiguous(tl.arange(0, BLOCK), 1)[None, :]


@device_function
def _at(addr, start, DT: tl.constexpr, ALIGNED: tl.constexpr):
    """Element ``start`` of the tensor at ``addr`` (dtype ``DT``); ``ALIGNED``: both are 16-aligned
    (bytes, elements), which lets Triton vectorize. (``tl.multiple_of`` marks the op that defines a
    value, and ``start`` is defined outside this branch: so it is rebuilt here as a product by 16,
    the same number on an aligned run, from which Triton infers the divisibility itself.)"""
    ptr = addr.to(tl.pointer_type(DT))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
        start = (start // 16) * 16
    return ptr + start


@device_function
def _load(addr, start, offs, mask, other, DT: tl.constexpr, TO: tl.constexpr, ALIGNED: tl.constexpr):
    return convert(tl.load(_at(addr, start, DT, ALIGNED) + offs, mask=mask, other=other), TO)


@device_function
def load_as(addr, group, start, offs, mask, other, DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr,
            DT3: tl.constexpr, NUM_GROUPS: tl.constexpr, TO: tl.constexpr, ALIGNED: tl.constexpr):
    """Elements ``start + offs`` of the tensor at ``addr`` (dtype ``DT{group}``), converted to ``TO``."""
    if NUM_GROUPS == 1:
        x = _load(addr, start, offs, mask, other, DT0, TO, ALIGNED)
    elif group == 0:
        x = _load(addr, start, offs, mask, other, DT0, TO, ALIGNED)
    elif NUM_GROUPS == 2:
        x = _load(addr, start, offs, mask, other, DT1, TO, ALIGNED)
    elif group == 1:
        x = _load(addr, start, offs, mask, other, DT1, TO, ALIGNED)
    elif NUM_GROUPS == 3:
        x = _load(addr, start, offs, mask, other, DT2, TO, ALIGNED)
    elif group == 2:
        x = _load(addr, start, offs, mask, other, DT2, TO, ALIGNED)
    else:
        x = _load(addr, start, offs, mask, other, DT3, TO, ALIGNED)
    return x


@device_function
def _store(addr, start, offs, x, mask, DT: tl.constexpr, ALIGNED: tl.constexpr):
    tl.store(_at(addr, start, DT, ALIGNED) + offs, convert(x, DT), mask=mask)


@device_function
def store_as(addr, group, start, offs, x, mask, DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr,
             DT3: tl.constexpr, NUM_GROUPS: tl.constexpr, ALIGNED: tl.constexpr):
    """Store ``x`` converted to ``DT{group}`` at elements ``start + offs`` of the tensor at ``addr``."""
    if NUM_GROUPS == 1:
        _store(addr, start, offs, x, mask, DT0, ALIGNED)
    elif group == 0:
        _store(addr, start, offs, x, mask, DT0, ALIGNED)
    elif NUM_GROUPS == 2:
        _store(addr, start, offs, x, mask, DT1, ALIGNED)
    elif group == 1:
        _store(addr, start, offs, x, mask, DT1, ALIGNED)
    elif NUM_GROUPS == 3:
        _store(addr, start, offs, x, mask, DT2, ALIGNED)
    elif group == 2:
        _store(addr, start, offs, x, mask, DT2, ALIGNED)
    else:
        _store(addr, start, offs, x, mask, DT3, ALIGNED)
