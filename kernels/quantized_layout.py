"""QuantizedLayout: where a ShardLayout's slots live once block-quantized to int8 or fp8, and the
tables the quantized packing kernels read.

[Note: quantized slots]
A quantized buffer is ``world_size`` *quantized slots* of ``slot_bytes`` bytes each, rank-major,
held in one ``uint8`` tensor (what the collectives move). Quantized slot ``r`` encodes slot ``r`` of
the ``ShardLayout`` ([Note: flat buffers] in ``kernels/layout.py``: every parameter's shard at its
slot offset, zeros in its padding) element for element, one int8 code per element, followed by one
float32 scale per *block*. The code is an int8 (``format="int8"``) or a float8_e4m3fn byte
(``format="fp8"``; ``kernels/block_quantization.py``): the same bytes either way, so the format
changes what a byte means and nothing of where it lies:

=====================================  ==========================================  =======
bytes of a quantized slot              what                                        dtype
=====================================  ==========================================  =======
``[0, slot_numel)``                    element ``k`` of the slot as its code       int8 / e4m3
``[slot_numel, slot_numel + 4 * B)``   the scale of each block                     float32
=====================================  ==========================================  =======

A parameter's region of the slot (``padded_numels[i]`` elements from ``slot_offsets[i]``) is cut
into blocks of ``block`` elements from its start, the last one shorter: ``B = sum_i
ceil(padded_numels[i] / block)``, the same on every rank. A block never spans two parameters, so a
LayerNorm weight near 1 does not share a scale with (and crush) the small weights of its neighbour,
which blocks over the flat slot did: on the test suite's TinyLM they cost 2% of the loss after 100
steps at ``block=256``, against 0.2% per parameter. Bytes on the link: ``(1 + 4 B / slot_numel) /
itemsize`` of the uncompressed buffer's (0.508x of bf16's, 0.254x of fp32's for large parameters
at ``block=256``; more for many parameters smaller than a block). ``slot_numel`` is a multiple of
16, so the scales are float32-aligned.

[Note: the aligned full-block path]
One program quantizes one block of ``block`` elements (256 by default): with 4 warps that is two
elements per thread, loaded with masks and without vector instructions, as a block may start
anywhere in a tensor of any dtype. Most blocks of a large parameter are full and 16-byte aligned on
both sides, so each kernel checks that per program (``aligned_full_block``) and then loads and
stores ``VEC`` elements per thread (16 bytes of the widest tensor-side dtype) without masks, the
way the exact packing kernels' aligned runs do ([Note: alignment per run] in ``kernels/_jit.py``).
The arithmetic is the same on both paths, so the result is bit for bit the same
(tests/packing/test_quantized_kernels.py runs both); ``VECTOR_PATH`` turns it off.

[Note: segment tables]
Each kernel program handles one block of one slot. ``blocks[g] = (flat_start, length, param,
tensor_start, n_valid)`` of program ``g``: the block covers slot elements ``flat_start ..
flat_start + length``, the first ``n_valid`` of which are elements ``tensor_start ..`` of parameter
``param``'s tensor (the rest are padding, zeros); its scale is number ``g % B`` of its slot. With
``rank=r`` the tensors are rank ``r``'s shards and the table covers slot ``r`` (``B`` programs);
with ``rank=None`` they are the full tensors and the table covers every slot (``w * B`` programs,
slot ``g // B``). Built once per (layout, block, rank, device) with numpy and cached on the layout,
like the block tables of ``kernels._launch``; device copies through ``kernels.table_memory``.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import _launch, table_memory
from kernels.block_quantization import FORMATS
from kernels.layout import ShardLayout

__all__ = ["BLOCKS", "QuantizedLayout", "SegmentTable", "quantized_layout"]

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes the quantized ops take (powers of two: one kernel program per block)."""
NUM_WARPS: int | None = None
"""Warps per program of the quantized kernels on CUDA (one program per quantization block; the
result does not depend on it: a block's absolute maximum is exact in any order). ``None``: as many
as give each thread one 16-byte vector of the block (``warps_per_block``); ``benchmarks/
bench_kernels.py --quantized-num-warps 0 1 2 4`` times the choices (0: this default)."""
VECTOR_PATH = True
"""Whether the quantized kernels take [Note: the aligned full-block path] where a block allows it
(the result is the same bit for bit; ``bench_kernels.py --quantized-vector-path on off`` times both)."""


@dataclasses.dataclass(frozen=True)
class SegmentTable:
    """[Note: segment tables] on one device: ``blocks`` int64 ``(num_programs, 5)``."""

    blocks: torch.Tensor
    memory: table_memory.DeviceTable
    num_programs: int


class QuantizedLayout:
    """``layout``'s slots quantized in blocks of at most ``block`` elements to ``format``'s codes
    (``"int8"`` or ``"fp8"``; see [Note: quantized slots])."""

    def __init__(self, layout: ShardLayout, block: int = 256, format: str = "int8") -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"QuantizedLayout: layout must be a kernels.ShardLayout, got {type(layout).__name__}")
        if isinstance(block, bool) or block not in BLOCKS:
            raise ValueError(f"QuantizedLayout: block must be one of {BLOCKS}, got {block!r}")
        if format not in FORMATS:
            raise ValueError(f"QuantizedLayout: format must be one of {FORMATS}, got {format!r}")
        self.layout = layout
        self.block = block
        self.format = format
        """What a code byte means: ``"int8"`` or ``"fp8"`` (float8_e4m3fn)."""
        self.world_size = layout.world_size
        counts = [-(-n // block) for n in layout.padded_numels]
        self.num_blocks = sum(counts)
        """Blocks (scales) per slot."""
        starts = np.concatenate([off + np.arange(c, dtype=np.int64) * block
                                 for off, c in zip(layout.slot_offsets, counts)])
        ends = np.concatenate([starts[1:], [layout.slot_numel]]).astype(np.int64)
        self.block_starts: np.ndarray = starts
        """Slot offset of each block (host int64)."""
        self.block_lengths: np.ndarray = ends - starts
        """Elements of each block, ``<= block`` (host int64)."""
        self.slot_bytes = layout.slot_numel + 4 * self.num_blocks
        self.buffer_bytes = self.world_size * self.slot_bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizedLayout) and ((self.layout, self.block, self.format)
                                                       == (other.layout, other.block, other.format))

    def __hash__(self) -> int:
        return hash((self.layout, self.block, self.format))

    def __repr__(self) -> str:
        return (f"QuantizedLayout({self.layout!r}, block={self.block}, format={self.format!r}, "
                f"slot_bytes={self.slot_bytes})")

    def codes(self, buffer: torch.Tensor) -> torch.Tensor:
        """int8 ``(world_size, slot_numel)`` view of the codes in a quantized buffer (fp8: each
        e4m3 byte as an int8; ``.view(torch.float8_e4m3fn)`` reads them as fp8)."""
        slots = buffer.view(self.world_size, self.slot_bytes)
        return slots[:, : self.layout.slot_numel].view(torch.int8)

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        """float32 ``(world_size, num_blocks)`` view of the scales in a quantized buffer."""
        floats = buffer.view(torch.float32).view(self.world_size, self.slot_bytes // 4)
        return floats[:, self.layout.slot_numel // 4 :]

    def block_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lengths (num_blocks,), element_block (slot_numel,))``: each block's length and the block
        of each slot element, on ``device`` (cached): how the torch fallbacks find the kernels'
        blocks in a flat slot."""
        key = ("quantized_blocks", self.block, device)
        cache = self.layout._device_cache
        index = cache.get(key)
        if index is None:
            element_block = np.repeat(np.arange(self.num_blocks, dtype=np.int64), self.block_lengths)
            index = cache[key] = tuple(torch.from_numpy(a).to(device) for a in (self.block_lengths, element_block))
        return index

    def segment_table(self, rank: int | None, device: torch.device) -> SegmentTable:
        """The table of ``rank`` (``None``: every slot, full tensors) on ``device``, cached."""
        key = ("quantized_segments", self.block, rank, device)
        cache = self.layout._device_cache
        table = cache.get(key)
        if table is None:
            blocks = _blocks(self, rank)
            memory = table_memory.upload([blocks], device, cached=True)
            table = SegmentTable(memory.tensors[0], memory, len(blocks))
            if not memory.in_graph:
                cache[key] = table
        return table


def _blocks(qlayout: QuantizedLayout, rank: int | None) -> np.ndarray:
    """Host array ``blocks`` of [Note: segment tables]."""
    layout, block = qlayout.layout, qlayout.block
    counts = [-(-n // block) for n in layout.padded_numels]
    param = np.repeat(np.arange(layout.num_params, dtype=np.int64), counts)
    within = qlayout.block_starts - np.repeat(np.asarray(layout.slot_offsets, dtype=np.int64), counts)
    tables = []
    for r in (range(layout.world_size) if rank is None else (rank,)):
        shard_numels = np.asarray([layout.shard_numel(i, r) for i in range(layout.num_params)], dtype=np.int64)
        base = np.asarray(layout.chunk_numels, dtype=np.int64) * r if rank is None else np.zeros(layout.num_params, np.int64)
        n_valid = np.clip(shard_numels[param] - within, 0, qlayout.block_lengths)
        tables.append(np.stack([qlayout.block_starts, qlayout.block_lengths, param, base[param] + within, n_valid], 1))
    return np.ascontiguousarray(np.concatenate(tables)).reshape(-1, 5)


@functools.lru_cache(maxsize=256)
def quantized_layout(layout: ShardLayout, block: int, format: str = "int8") -> QuantizedLayout:
    """The ``QuantizedLayout`` of ``layout``, ``block`` and ``format`` (cached: one object, one set
    of tables)."""
    return QuantizedLayout(layout, block, format)


# ----------------------------------------------------------------------------- device side, launch
@triton.jit
def program_block(blocks_ptr, pointers_ptr, g):
    """Program ``g``'s block: ``(flat_start, length, addr, group, tensor_start, n_valid)`` ([Note:
    segment tables]); ``addr`` / ``group``: its parameter's tensor and dtype group."""
    row = blocks_ptr + g * 5
    param = tl.load(row + 2)
    return (tl.load(row), tl.load(row + 1), tl.load(pointers_ptr + param * 2), tl.load(pointers_ptr + param * 2 + 1),
            tl.load(row + 3), tl.load(row + 4))


@triton.jit
def aligned_full_block(addr, tensor_start, codes_start, n_valid, length, BLOCK: tl.constexpr):
    """Whether a block takes [Note: the aligned full-block path]: all ``BLOCK`` elements valid and in
    the slot (``n_valid``, ``length``), the tensor side 16-byte aligned (address, and a start that
    is a multiple of 16 elements) and the codes' first byte (``codes_start``) a multiple of 16."""
    return ((n_valid == BLOCK) & (length == BLOCK) & ((addr % 16) == 0) & ((tensor_start % 16) == 0)
            & ((codes_start % 16) == 0))


@triton.jit
def aligned(offset):
    """``offset`` (a multiple of 16 on the aligned path) rebuilt as a product by 16, from which
    Triton infers the divisibility that lets it vectorize (as ``kernels._jit._at`` does)."""
    return (offset // 16) * 16


def warps_per_block(block: int, vec: int) -> int:
    """Warps that give each thread ``vec`` elements of a ``block``-element block (1 to 8): a 16-byte
    load or store per thread on [Note: the aligned full-block path]."""
    return max(1, min(8, block // (32 * vec)))


def launch(kernel: triton.JITFunction, table: SegmentTable, pointers: _launch.PointerTable, *args: object,
           **constexprs: object) -> None:
    """``kernel[(table.num_programs,)](blocks, pointers, *args, DT0.., NUM_GROUPS, ...)`` on the
    tensors' device (CUDA: tables through ``table_memory.prepare``; compiled without FMA
    contraction, [Note: why the arithmetic is bitwise portable] in ``kernels/block_quantization.py``)."""
    if table.num_programs == 0:
        return
    g = pointers.dtypes
    vec = _launch.vector_width(pointers.torch_dtypes)
    kwargs = dict(DT0=g[0], DT1=g[1], DT2=g[2], DT3=g[3], NUM_GROUPS=pointers.num_groups, VECTOR=VECTOR_PATH,
                  VEC=vec, **constexprs)
    device = table.blocks.device
    if device.type == "cuda":
        warps = NUM_WARPS or warps_per_block(constexprs["BLOCK"], vec)
        _launch.cuda_launch(kernel, table.num_programs, (table.memory, pointers.memory), args, kwargs,
                            dict(num_warps=warps, enable_fp_fusion=False), device)
    else:
        kernel[(table.num_programs,)](table.blocks, pointers.pointers, *args, **kwargs)
