"""QuantizedLayout: where a ShardLayout's slots live once block-quantized to int8, and the tables
the quantized packing kernels read.

[Note: quantized slots]
A quantized buffer is ``world_size`` *quantized slots* of ``slot_bytes`` bytes each, rank-major,
held in one ``uint8`` tensor (what the collectives move). Quantized slot ``r`` encodes slot ``r`` of
the ``ShardLayout`` ([Note: flat buffers] in ``kernels/layout.py``: every parameter's shard at its
slot offset, zeros in the padding) cut into ``num_blocks = ceil(slot_numel / block)`` blocks of
``block`` consecutive elements (the last one zero-filled past ``slot_numel``):

=====================  ===========================================  =======================
bytes of a slot        what                                         dtype
=====================  ===========================================  =======================
``[0, B*Q)``           element ``k`` of the slot as its int8 code   int8
``[B*Q, B*Q + 4*B)``   the scale of each block                      float32
=====================  ===========================================  =======================

(``B = num_blocks``, ``Q = block``.) Blocks run over the flat slot, across parameter boundaries,
as DeepSpeed's qwZ quantizes its flat buffer: no per-parameter padding, so the bytes on the link
are ``(1 + 4 / Q) / itemsize`` of the uncompressed buffer's (0.508x bf16's, 0.254x fp32's at
``Q = 256``). A block may thus mix small parameters; its scale follows the largest of them.

[Note: segment tables]
Each kernel program handles one block of one slot, so it needs the pieces of parameters that fall
in it. The *segment table* lists them: for global block ``g = r * num_blocks + b``, rows
``first[g] .. first[g + 1]`` of ``segments`` are ``(param, tensor_start, lo, hi)``: elements
``lo .. hi`` of the block are elements ``tensor_start ..`` of parameter ``param``'s tensor. With
``rank=r`` the tensors are rank ``r``'s shards and the table covers slot ``r`` (``num_blocks``
blocks); with ``rank=None`` they are the full tensors and the table covers every slot. Built once
per (layout, block, rank, device) with numpy and cached on the layout, like the block tables of
``kernels._launch``; device copies through ``kernels.table_memory``.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import _launch, table_memory
from kernels.layout import ShardLayout

__all__ = ["BLOCKS", "QuantizedLayout", "SegmentTable"]

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes the quantized ops take (powers of two: one kernel program per block)."""


@dataclasses.dataclass(frozen=True)
class SegmentTable:
    """[Note: segment tables] on one device: ``first`` int64 ``(num_programs + 1,)``, ``segments`` int64
    ``(num_segments, 4)``."""

    first: torch.Tensor
    segments: torch.Tensor
    memory: table_memory.DeviceTable
    num_programs: int


class QuantizedLayout:
    """``layout``'s slots quantized in blocks of ``block`` elements (see [Note: quantized slots])."""

    def __init__(self, layout: ShardLayout, block: int = 256) -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"QuantizedLayout: layout must be a kernels.ShardLayout, got {type(layout).__name__}")
        if isinstance(block, bool) or block not in BLOCKS:
            raise ValueError(f"QuantizedLayout: block must be one of {BLOCKS}, got {block!r}")
        self.layout = layout
        self.block = block
        self.world_size = layout.world_size
        self.num_blocks = -(-layout.slot_numel // block)
        self.payload_bytes = self.num_blocks * block
        self.slot_bytes = self.payload_bytes + 4 * self.num_blocks
        """Bytes of one quantized slot: a multiple of 4 (``block`` is), so its scales are float32-aligned."""
        self.buffer_bytes = self.world_size * self.slot_bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizedLayout) and (self.layout, self.block) == (other.layout, other.block)

    def __hash__(self) -> int:
        return hash((self.layout, self.block))

    def __repr__(self) -> str:
        return f"QuantizedLayout({self.layout!r}, block={self.block}, slot_bytes={self.slot_bytes})"

    def payloads(self, buffer: torch.Tensor) -> torch.Tensor:
        """int8 ``(world_size, num_blocks, block)`` view of the codes in a quantized buffer."""
        slots = buffer.view(self.world_size, self.slot_bytes)
        return slots[:, : self.payload_bytes].view(torch.int8).view(self.world_size, self.num_blocks, self.block)

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        """float32 ``(world_size, num_blocks)`` view of the scales in a quantized buffer."""
        floats = buffer.view(torch.float32).view(self.world_size, self.slot_bytes // 4)
        return floats[:, self.payload_bytes // 4 :]

    def segment_table(self, rank: int | None, device: torch.device) -> SegmentTable:
        """The segment table of ``rank`` (``None``: every slot, full tensors) on ``device``, cached."""
        key = ("quantized_segments", self.block, rank, device)
        cache = self.layout._device_cache
        table = cache.get(key)
        if table is None:
            first, segments = _segments(self.layout, self.block, rank)
            memory = table_memory.upload([first, segments], device, cached=True)
            table = SegmentTable(memory.tensors[0], memory.tensors[1], memory, len(first) - 1)
            if not memory.in_graph:
                cache[key] = table
        return table


def _segments(layout: ShardLayout, block: int, rank: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays ``(first, segments)`` of [Note: segment tables]."""
    num_blocks = -(-layout.slot_numel // block)
    ranks = range(layout.world_size) if rank is None else (rank,)
    rows = []
    for slot_index, r in enumerate(ranks):
        for param, tensor_start, flat_start, n_valid, _ in layout.segments(r):
            if n_valid == 0:
                continue
            if rank is None:  # the full tensor's coordinates
                tensor_start = r * layout.chunk_numels[param]
            b0, b1 = flat_start // block, (flat_start + n_valid - 1) // block
            starts = np.arange(b0, b1 + 1, dtype=np.int64) * block
            lo = np.maximum(starts, flat_start)
            hi = np.minimum(starts + block, flat_start + n_valid)
            g = np.arange(b0, b1 + 1, dtype=np.int64) + slot_index * num_blocks
            rows.append(np.stack([g, np.full_like(g, param), tensor_start + lo - flat_start, lo - starts, hi - starts], 1))
    table = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)
    table = table[np.argsort(table[:, 0], kind="stable")]
    num_programs = num_blocks * len(ranks)
    counts = np.bincount(table[:, 0], minlength=num_programs)
    first = np.zeros(num_programs + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    return first, np.ascontiguousarray(table[:, 1:])


@functools.lru_cache(maxsize=256)
def quantized_layout(layout: ShardLayout, block: int) -> QuantizedLayout:
    """The ``QuantizedLayout`` of ``layout`` and ``block`` (cached: one object, one set of tables)."""
    return QuantizedLayout(layout, block)


# ----------------------------------------------------------------------------- device side, launch
@triton.jit
def segment_range(first_ptr, g):
    """Rows ``[start, end)`` of the segment table that belong to program ``g``."""
    return tl.load(first_ptr + g), tl.load(first_ptr + g + 1)


@triton.jit
def segment(segments_ptr, pointers_ptr, s, offs):
    """Segment ``s``: ``(addr, group, start, mask)``: block lanes ``offs`` under ``mask`` are elements
    ``start + offs`` of the tensor at ``addr`` (dtype group ``group``)."""
    row = segments_ptr + s * 4
    param = tl.load(row)
    lo = tl.load(row + 2)
    mask = (offs >= lo) & (offs < tl.load(row + 3))
    return tl.load(pointers_ptr + param * 2), tl.load(pointers_ptr + param * 2 + 1), tl.load(row + 1) - lo, mask


def launch(kernel: triton.JITFunction, table: SegmentTable, pointers: _launch.PointerTable, *args: object,
           **constexprs: object) -> None:
    """``kernel[(table.num_programs,)](first, segments, pointers, *args, DT0.., NUM_GROUPS, ...)`` on
    the tensors' device (CUDA: tables through ``table_memory.prepare``; compiled without FMA
    contraction, [Note: why the arithmetic is bitwise portable])."""
    if table.num_programs == 0:
        return
    g = pointers.dtypes
    kwargs = dict(DT0=g[0], DT1=g[1], DT2=g[2], DT3=g[3], NUM_GROUPS=pointers.num_groups, **constexprs)
    grid = (table.num_programs,)
    device = table.first.device
    if device.type == "cuda":
        with torch.cuda.device(device):
            ((first, segments), (pointer_tensor,)) = table_memory.prepare((table.memory, pointers.memory), device)
            kernel[grid](first, segments, pointer_tensor, *args, **kwargs, num_warps=4, enable_fp_fusion=False)
    else:
        kernel[grid](table.first, table.segments, pointers.pointers, *args, **kwargs)
