"""QuantizedLayout: where a ShardLayout's slots live once block-quantized to int8 or fp8, and the
tables the quantized packing kernels read.

[Note: quantized slots]
A quantized buffer is ``world_size`` *quantized slots* of ``slot_bytes`` bytes each, rank-major,
held in one ``uint8`` tensor (what the collectives move). Quantized slot ``r`` encodes slot ``r`` of
the ``ShardLayout`` ([Note: flat buffers] in ``overlap_kernels/layout.py``: every parameter's shard at its
slot offset, zeros in its padding) element for element, one int8 code per element, followed by one
float32 scale per *block*. The code is an int8 (``format="int8"``) or a float8_e4m3fn byte
(``format="fp8"``; ``overlap_kernels/block_quantization.py``): the same bytes either way, so the format
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

[Note: several blocks per program]
A kernel program handles ``BLOCKS_PER_PROGRAM`` consecutive blocks of one parameter as a 2-D tile
``[BLOCKS_PER_PROGRAM, block]``: row ``j`` is the program's block ``j``, so each block's absolute
maximum and scale are a row reduction and its scale a row of a broadcast. One program per block
(256 elements by default) left the GPU bound by per-program work (table loads, one scale, a short
tile: 0.54-0.61x of a plain copy's bandwidth for the gather copy-out, 0.55-0.59x for the reduce
copy-in on an H100, Triton 3.6); several per program amortise it, as the exact packing kernels'
4096-element blocks do. A program never spans two parameters (one address, one dtype group, as
``load_as`` / ``store_as`` need): a parameter of ``c`` blocks gets ``ceil(c / BLOCKS_PER_PROGRAM)``
programs, the last one with fewer rows; rows past the parameter's blocks are masked off (their
codes and scales are not stored). ``blocks_per_program`` picks it from the block size and the
largest parameter's block count (a power of two, at most ``ELEMENTS_PER_PROGRAM`` elements per
program, never more rows than any parameter fills); ``BLOCKS_PER_PROGRAM`` overrides it (1 is the
one-block-per-program kernel, for side-by-side timing: ``benchmarks/bench_kernels.py
--quantized-blocks-per-program 1 0``). The result does not depend on it: the rows are the blocks
they were, with the same arithmetic (tests/packing/test_quantized_kernels.py compares every
choice bit for bit with the torch fallback).

[Note: the aligned full-block path]
A program's blocks may start anywhere in a tensor of any dtype, so the general path loads and
stores with masks and without vector instructions. Most programs of a large parameter are full
(``BLOCKS_PER_PROGRAM`` full blocks) and 16-byte aligned on both sides, so each kernel checks that
per program (``aligned_full_block``) and then loads and stores ``VEC`` elements per thread (16 bytes
of the widest tensor-side dtype) without masks, the way the exact packing kernels' aligned runs do
([Note: alignment per run] in ``overlap_kernels/_jit.py``). Every row of an aligned program is aligned too
(a block is a multiple of 16 elements). The arithmetic is the same on both paths, so the result is
bit for bit the same (tests/packing/test_quantized_kernels.py runs both); ``VECTOR_PATH`` turns it
off. A parameter's last program (fewer blocks, or a short last block) takes the masked path.

[Note: segment tables]
``blocks[g] = (flat_start, length, param, tensor_start, n_valid, first_block)`` of program ``g``:
the program covers slot elements ``flat_start .. flat_start + length`` (its blocks, consecutive,
each ``block`` long but the parameter's last), the first ``n_valid`` of which are elements
``tensor_start ..`` of parameter ``param``'s tensor (the rest are padding, zeros); its first block's
scale is number ``first_block`` of its slot. Row ``j`` of the tile is element offsets ``j * block
..`` of the program, so ``offset < n_valid`` and ``offset < length`` are its masks (the valid
elements are a prefix of a parameter's region). With ``rank=r`` the tensors are rank ``r``'s shards
and the table covers slot ``r`` (``programs_per_slot`` programs); with ``rank=None`` they are the
full tensors and the table covers every slot (``w * programs_per_slot`` programs, slot ``g //
programs_per_slot``). Built once per (layout, block, blocks per program, rank, device) with numpy
and cached on the layout, like the block tables of ``overlap_kernels._launch``; device copies through
``overlap_kernels.table_memory``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from overlap_kernels import _launch, native_passes, table_memory
from overlap_kernels._device_function import device_function
from overlap_kernels._jit import vector_lanes
from overlap_kernels.block_quantization import FORMATS
from overlap_kernels.layout import ShardLayout, next_power_of_two

__all__ = ["BLOCKS", "QuantizedLayout", "SegmentTable", "blocks_per_program", "quantized_layout"]

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes the quantized ops take (powers of two: a block is one row of a program's tile)."""
ELEMENTS_PER_PROGRAM = 4096
"""The most elements ``blocks_per_program`` gives one program (the exact packing kernels' block on
large runs): [Note: several blocks per program]."""
BLOCKS_PER_PROGRAM: int | None = None
"""Blocks per program of the quantized kernels (a power of two), or ``None``: ``blocks_per_program``'s
choice. The result does not depend on it; ``benchmarks/bench_kernels.py
--quantized-blocks-per-program 1 0`` times one block per program against the choice (0)."""
NUM_WARPS: int | None = None
"""Warps per program of the quantized kernels on CUDA (the result does not depend on it: a block's
absolute maximum is exact in any order). ``None``: as many as give each thread one 16-byte vector of
the program's tile (``warps_per_block``, at most 8); ``benchmarks/bench_kernels.py
--quantized-num-warps 0 1 2 4`` times the choices (0: this default)."""
VECTOR_PATH = True
"""Whether the quantized kernels take [Note: the aligned full-block path] where a block allows it
(the result is the same bit for bit; ``bench_kernels.py --quantized-vector-path on off`` times both)."""


@dataclasses.dataclass(frozen=True)
class SegmentTable:
    """[Note: segment tables] on one device: ``blocks`` int64 ``(num_programs, 6)``."""

    blocks: torch.Tensor
    memory: table_memory.DeviceTable
    num_programs: int
    programs_per_slot: int
    blocks_per_program: int


class QuantizedLayout:
    """``layout``'s slots quantized in blocks of at most ``block`` elements to ``format``'s codes
    (``"int8"`` or ``"fp8"``; see [Note: quantized slots])."""

    def __init__(self, layout: ShardLayout, block: int = 256, format: str = "int8") -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"QuantizedLayout: layout must be a overlap_kernels.ShardLayout, got {type(layout).__name__}")
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
        self.param_blocks: tuple[int, ...] = tuple(counts)
        """Blocks of each parameter's region (the same in every slot)."""
        self._largest_param_blocks = max(counts, default=0)  # read at every launch
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

    def blocks_per_program(self) -> int:
        """Blocks per kernel program now: ``BLOCKS_PER_PROGRAM``, or ``blocks_per_program``'s choice
        for this layout ([Note: several blocks per program])."""
        if BLOCKS_PER_PROGRAM is None:
            return blocks_per_program(self.block, self._largest_param_blocks)
        if isinstance(BLOCKS_PER_PROGRAM, bool) or not isinstance(BLOCKS_PER_PROGRAM, int) or BLOCKS_PER_PROGRAM < 1 \
                or BLOCKS_PER_PROGRAM & (BLOCKS_PER_PROGRAM - 1):
            raise ValueError(f"overlap_kernels.quantized_layout.BLOCKS_PER_PROGRAM must be None or a power of two >= 1, "
                             f"got {BLOCKS_PER_PROGRAM!r}")
        return BLOCKS_PER_PROGRAM

    def segment_table(self, rank: int | None, device: torch.device) -> SegmentTable:
        """The table of ``rank`` (``None``: every slot, full tensors) on ``device``, cached, for
        ``self.blocks_per_program()`` blocks per program."""
        per_program = self.blocks_per_program()
        key = ("quantized_segments", self.block, per_program, rank, device)
        cache = self.layout._device_cache
        table = cache.get(key)
        if table is None:
            blocks = _programs(self, rank, per_program)
            memory = table_memory.upload([blocks], device, cached=True)
            slots = self.world_size if rank is None else 1
            table = SegmentTable(memory.tensors[0], memory, len(blocks), len(blocks) // slots, per_program)
            if not memory.in_graph:
                cache[key] = table
        return table


def blocks_per_program(block: int, largest_param_blocks: int) -> int:
    """Blocks per kernel program ([Note: several blocks per program]): ``ELEMENTS_PER_PROGRAM //
    block``, but no more than the largest parameter's ``largest_param_blocks`` rounded up to a power
    of two (a layout of small parameters keeps small tiles); at least 1."""
    return max(1, min(ELEMENTS_PER_PROGRAM // block, next_power_of_two(largest_param_blocks)))


def _programs(qlayout: QuantizedLayout, rank: int | None, per_program: int) -> np.ndarray:
    """Host array ``blocks`` of [Note: segment tables], ``per_program`` blocks per program."""
    layout = qlayout.layout
    counts = np.asarray(qlayout.param_blocks, dtype=np.int64)
    param = np.repeat(np.arange(layout.num_params, dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    index = np.arange(qlayout.num_blocks, dtype=np.int64)
    heads = np.flatnonzero((index - first) % per_program == 0)  # each program's first block
    within = qlayout.block_starts - np.repeat(np.asarray(layout.slot_offsets, dtype=np.int64), counts)
    tables = []
    for r in (range(layout.world_size) if rank is None else (rank,)):
        shard_numels = np.asarray([layout.shard_numel(i, r) for i in range(layout.num_params)], dtype=np.int64)
        base = np.asarray(layout.chunk_numels, dtype=np.int64) * r if rank is None else np.zeros(layout.num_params, np.int64)
        n_valid = np.clip(shard_numels[param] - within, 0, qlayout.block_lengths)
        sums = [np.add.reduceat(a, heads) if len(heads) else a[:0] for a in (qlayout.block_lengths, n_valid)]
        tables.append(np.stack([qlayout.block_starts[heads], sums[0], param[heads], (base[param] + within)[heads],
                                sums[1], heads], 1))
    return np.ascontiguousarray(np.concatenate(tables)).reshape(-1, 6)


@functools.lru_cache(maxsize=256)
def quantized_layout(layout: ShardLayout, block: int, format: str = "int8") -> QuantizedLayout:
    """The ``QuantizedLayout`` of ``layout``, ``block`` and ``format`` (cached: one object, one set
    of tables)."""
    return QuantizedLayout(layout, block, format)


# ----------------------------------------------------------------------------- device side, launch
@device_function
def program_blocks(blocks_ptr, pointers_ptr, g):
    """Program ``g``'s blocks: ``(flat_start, length, addr, group, tensor_start, n_valid,
    first_block)`` ([Note: segment tables]); ``addr`` / ``group``: its parameter's tensor and dtype
    group."""
    row = blocks_ptr + g * 6
    param = tl.load(row + 2)
    return (tl.load(row), tl.load(row + 1), tl.load(pointers_ptr + param * 2), tl.load(pointers_ptr + param * 2 + 1),
            tl.load(row + 3), tl.load(row + 4), tl.load(row + 5))


@device_function
def aligned_full_block(addr, tensor_start, codes_start, n_valid, length, TILE: tl.constexpr):
    """Whether a program takes [Note: the aligned full-block path]: all ``TILE`` elements of its
    blocks valid and in the slot (``n_valid``, ``length``), the tensor side 16-byte aligned (address,
    and a start that is a multiple of 16 elements) and the codes' first byte (``codes_start``) a
    multiple of 16."""
    return ((n_valid == TILE) & (length == TILE) & ((addr % 16) == 0) & ((tensor_start % 16) == 0)
            & ((codes_start % 16) == 0))


@device_function
def aligned(offset):
    """``offset`` (a multiple of 16 on the aligned path) rebuilt as a product by 16, from which
    Triton infers the divisibility that lets it vectorize (as ``overlap_kernels._jit._at`` does)."""
    return (offset // 16) * 16


@device_function
def tile_offsets(BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr):
    """``[BLOCKS_PER_PROGRAM, BLOCK]`` element offsets of a program's tile from its first element
    (row ``j``: block ``j``); ``ALIGNED``: ``VEC`` consecutive elements per thread ([Note: the
    aligned full-block path])."""
    if ALIGNED:
        cols = vector_lanes(BLOCK, VEC)
    else:
        cols = tl.arange(0, BLOCK)
    return tl.arange(0, BLOCKS_PER_PROGRAM)[:, None] * BLOCK + cols[None, :]


@device_function
def codes_at(codes_ptr, start, offs, ALIGNED: tl.constexpr):
    """Pointers to the codes of a tile whose first code is byte ``start`` of the buffer (``ALIGNED``:
    ``start`` is a multiple of 16, rebuilt so that Triton sees it: ``aligned``)."""
    if ALIGNED:
        start = aligned(start)
    return codes_ptr + start + offs


@device_function
def tile_rows(length, BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    """``(rows [BLOCKS_PER_PROGRAM], present)``: each row's block number within the program, and
    whether the program has that block (``length`` slot elements)."""
    rows = tl.arange(0, BLOCKS_PER_PROGRAM)
    return rows, rows * BLOCK < length


def warps_per_block(block: int, vec: int) -> int:
    """Warps that give each thread ``vec`` elements of a ``block``-element tile (1 to 8): a 16-byte
    load or store per thread on [Note: the aligned full-block path]."""
    return max(1, min(8, block // (32 * vec)))


def launch_arguments(table: SegmentTable, pointers: _launch.PointerTable,
                     constexprs: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """``(kwargs, gpu_options)`` of a quantized kernel's launch: its constexprs (dtype groups, paths,
    ``VEC``, ``BLOCKS_PER_PROGRAM`` and the op's own ``constexprs``), and the compile options a
    CUDA launch uses (warps; no FMA contraction, [Note: why the arithmetic is bitwise portable] in
    ``overlap_kernels/block_quantization.py``)."""
    g = pointers.dtypes
    vec = _launch.vector_width(pointers.torch_dtypes)
    kwargs = dict(DT0=g[0], DT1=g[1], DT2=g[2], DT3=g[3], NUM_GROUPS=pointers.num_groups, VECTOR=VECTOR_PATH,
                  VEC=vec, BLOCKS_PER_PROGRAM=table.blocks_per_program, **constexprs)
    warps = NUM_WARPS or warps_per_block(constexprs["BLOCK"] * table.blocks_per_program, vec)
    return kwargs, dict(num_warps=warps, enable_fp_fusion=False)


def pointer_table(qlayout: QuantizedLayout, role: tuple, tensors: Sequence[torch.Tensor], device: torch.device,
                  dtypes: tuple[torch.dtype, ...] | None = None) -> _launch.PointerTable:
    """The pointer table of ``tensors`` (contiguous) for one list of one quantized op (``role``: which),
    from the tables of that role, keyed on the addresses alone (the ``POINTER_CACHE_SIZE`` newest,
    each with its list's per-tensor dtypes, compared at a hit: nothing hashed per tensor). A new
    address set with the dtypes of the newest table reuses its dtype groups (``PointerTable.moved``,
    [Note: a miss of a prepared launch] in ``overlap_kernels.prepared_launch``); other dtypes get a
    table built (``_launch.built_pointer_table``), kept here only. The runtime's gradients come at
    new addresses at every step on CPU, where a new table per address set from
    ``_launch.pointer_table`` (dtype groups, a key hashed over every dtype, an insert into the
    layout's cache) cost a reduction copy-in ~25 µs at 300 parameters. A table is a pure function of the addresses and dtypes, so none can go stale;
    one made during CUDA graph capture is not kept."""
    addresses = native_passes.addresses(tensors)
    if dtypes is None:
        dtypes = native_passes.dtypes(tensors)
    key = ("quantized pointers", role, device)
    tables = qlayout.layout._device_cache.get(key)
    if tables is None:
        tables = qlayout.layout._device_cache[key] = {}
    entry = tables.get(addresses)
    if entry is not None and entry[0] == dtypes:
        return entry[1]
    newest = tables[next(reversed(tables))] if tables else None
    if newest is not None and newest[0] == dtypes:
        table = newest[1].moved(addresses, device)
    else:
        table = _launch.built_pointer_table(addresses, dtypes, device)
    if not table.memory.in_graph:
        tables.pop(addresses, None)  # re-inserted as the newest
        if len(tables) >= _launch.POINTER_CACHE_SIZE:
            del tables[next(iter(tables))]
        tables[addresses] = (dtypes, table)
    return table


def launch(kernel: triton.JITFunction, table: SegmentTable, pointers: _launch.PointerTable, *args: object,
           **constexprs: object) -> None:
    """``kernel[(table.num_programs,)](blocks, pointers, *args, **launch_arguments(...))`` on the
    tensors' device (CUDA: tables through ``table_memory.prepare``)."""
    if table.num_programs == 0:
        return
    kwargs, options = launch_arguments(table, pointers, constexprs)
    if _launch.count_stubbed_launch():
        return
    device = table.blocks.device
    if device.type == "cuda":
        _launch.cuda_launch(kernel, table.num_programs, (table.memory, pointers.memory), args, kwargs, options, device)
    else:
        kernel[(table.num_programs,)](table.blocks, pointers.pointers, *args, **kwargs)
