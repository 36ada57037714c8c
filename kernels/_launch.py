"""Launcher plumbing shared by the four packing ops: dispatch, input checks, tables, torch fallback
plans, device helpers.

[Note: one launch over N tensors]
Each op is one Triton launch whatever the number of parameters. The grid is the number of
``BLOCK``-element blocks over all *runs* (``ShardLayout.segments``: contiguous stretches between a
parameter tensor and the flat buffer). Two tables tell a program what to do:

* the **block table** (per layout, rank, padding mode and device; built once, cached on the layout):
  ``blocks[pid]`` is the run of block ``pid``; ``runs[k] = (param, tensor_start, flat_start,
  n_valid, n_total, first_block)`` (int64, so buffers beyond 2**31 elements work);
* the **pointer table** (per call): ``pointers[i] = (data address, dtype group)`` of the ``i``-th
  parameter-side tensor. The kernel turns the address into a typed pointer
  (``addr.to(tl.pointer_type(DTg))``) in a branch per dtype group, so a list mixing up to
  ``MAX_DTYPE_GROUPS`` dtypes is still one launch. Raw addresses work compiled on CUDA and under
  ``TRITON_INTERPRET=1`` on CPU tensors (the interpreter dereferences host addresses); the
  interpreter cannot follow CUDA addresses, so CUDA tensors under the interpreter take the torch path.
  Pointer tables are cached per layout keyed by (addresses, dtypes) — their content is a function of
  that key — up to ``POINTER_CACHE_SIZE`` entries; further address sets get a per-call table copied on
  the current stream.

Device copies of the tables, their use from several streams, their release and CUDA graph capture
are ``kernels.table_memory``'s ([Note: table memory]): copies are stream-ordered (no host sync), a
table is not reused while a queued kernel may read it, and a captured launch reads tables that stay
valid for as long as the graph may replay.

[Note: alignment per run]
Blocks that lie wholly inside their run take an unmasked path; the last block of a run is masked.
An unmasked block whose parameter side starts 16-byte aligned (address a multiple of 16 bytes, start
a multiple of 16 elements: ``block_run``'s ``aligned``, decided per run inside the kernel) takes
vector loads and stores; the others, scalar ones. The flat side is always aligned (slot offsets are
multiples of ``ShardLayout.ALIGN``). One odd parameter thus slows only its own runs.

[Note: per-thread width]
Every thread moves ``VEC`` consecutive elements on both sides of a copy, ``VEC`` = 16 bytes of the
widest *destination* dtype (``vector_width``), passed as ``tl.max_contiguous`` of the offsets. Left
to itself Triton loads 16 bytes per thread and caps stores at 16 bytes, so a widening cast
(bfloat16 -> float32: 8 elements loaded, 4 stored per thread) goes through a shared-memory layout
conversion. With ``VEC``: stores are 128-bit and gapless across a warp; loads are 128-bit when the
source is as wide as the destination, 64-bit (still coalesced) when it is half as wide, and two
128-bit loads per thread when it is twice as wide. No layout conversion, no shared memory
(tests/test_aot_compile.py checks the PTX). This is also the rule of torch's vectorized CUDA casts
(one vector width for all operands, the narrowest one's). Unaligned and masked blocks are
scalar on both sides (``scalar_lanes``), in steps of ``CHUNK`` elements (4 per thread): done in one
step, their per-element 64-bit addresses would set the register count of the whole kernel
(80 instead of 38 registers for reduce_scatter_copy_out with accumulation on sm_90).

Launches pass ``enable_fp_fusion=False`` so that scale-then-accumulate rounds like the torch reference.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import table_memory
from kernels.layout import ShardLayout

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
"""Whether ``triton.jit`` made interpreter kernels (read once, as Triton does at decoration time)."""

TRITON_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float64: tl.float64,
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.int64: tl.int64,
    torch.int32: tl.int32,
    torch.int16: tl.int16,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
}
SUPPORTED = ", ".join(str(d).removeprefix("torch.") for d in TRITON_DTYPES)
MAX_DTYPE_GROUPS = 4
POINTER_CACHE_SIZE = 64
GPU_MAX_BLOCK = 4096
INTERPRET_MAX_BLOCK = 1 << 16  # the interpreter pays per program, not per element


# ----------------------------------------------------------------------------------------- dispatch
def triton_enabled(device: torch.device) -> bool:
    """Triton kernel (compiled on CUDA, interpreted on CPU) or the torch fallback ([Note: torch fallback])."""
    if device.type == "cuda":
        return not INTERPRET
    return device.type == "cpu" and INTERPRET


def use_dispatcher(tensors: Sequence[torch.Tensor]) -> bool:
    """Route through ``torch.ops.overlap.*`` (traceable) instead of launching directly (fast eager).

    True while Dynamo traces, while a TorchDispatchMode (make_fx, FakeTensorMode) is active, or when a
    tensor is a subclass (fake, functional, ...): cases where data pointers do not exist or where the
    op must be recorded.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def increment_version(tensors: Sequence[torch.Tensor]) -> None:
    """Tell autograd that the kernel wrote ``tensors`` in place behind its back."""
    torch.autograd.graph.increment_version(list(tensors))


# ------------------------------------------------------------------------------------------- checks
def check_dtype(op: str, name: str, dtype: object) -> None:
    if dtype not in TRITON_DTYPES:
        raise TypeError(f"{op}: {name} must be one of {SUPPORTED}, got {dtype}")


def check_rank(op: str, rank: object, layout: ShardLayout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{op}: rank must be an int in [0, {layout.world_size}), got {type(rank).__name__}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"{op}: rank must be an int in [0, {layout.world_size}), got {rank!r}")


def check_layout(op: str, layout: object) -> None:
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"{op}: layout must be a kernels.ShardLayout, got {type(layout).__name__}")


def check_tensors(
    op: str,
    name: str,
    tensors: object,
    shapes: Sequence[torch.Size],
    device: torch.device | None = None,
    *,
    writable: bool = False,
) -> torch.device:
    """A list of ``len(shapes)`` tensors of those shapes, supported dtypes, one device; returns it.

    ``writable`` tensors (outputs) must also be contiguous: the kernel writes them in place.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{op}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != len(shapes):
        raise ValueError(f"{op}: {name} has {len(tensors)} tensors, the layout has {len(shapes)} parameters")
    for i, (t, shape) in enumerate(zip(tensors, shapes)):
        where = f"{op}: {name}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
        device = t.device if device is None else device
        if t.device != device:
            raise ValueError(f"{where} is on {t.device}, expected {device} (all tensors on one device)")
        check_dtype(op, f"{name}[{i}].dtype", t.dtype)
        if t.shape != shape:
            raise ValueError(f"{where} has shape {tuple(t.shape)}, the layout expects {tuple(shape)}")
        if writable and not t.is_contiguous():
            raise ValueError(f"{where} must be contiguous (it is written in place)")
    assert device is not None
    return device


def check_flat(op: str, name: str, tensor: object, numel: int, device: torch.device | None) -> torch.device:
    """A contiguous buffer of exactly ``numel`` elements (any shape) of a supported dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device} (all tensors on one device)")
    check_dtype(op, f"{name}.dtype", tensor.dtype)
    if tensor.numel() != numel:
        raise ValueError(f"{op}: {name} has {tensor.numel()} elements, the layout needs exactly {numel}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    return tensor.device


def common_dtype(op: str, name: str, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The one dtype of ``tensors``; mixed lists need an explicit ``dtype``."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"{op}: {name} mixes dtypes {sorted(map(str, dtypes))}; pass dtype= to choose the buffer's")
    return dtypes.pop()


def check_dtype_groups(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > MAX_DTYPE_GROUPS:
        raise ValueError(
            f"{op}: {name} mixes {len(dtypes)} dtypes, at most {MAX_DTYPE_GROUPS} per call are supported"
        )


def check_scale(op: str, name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{op}: {name} must be None or a float, got {type(value).__name__}")


def check_floating(op: str, what: str, dtypes: Sequence[torch.dtype]) -> None:
    """Scaling and accumulation need floating-point tensors; integer ones can only be copied."""
    bad = sorted({str(d) for d in dtypes if not d.is_floating_point})
    if bad:
        raise TypeError(f"{op}: {what} needs floating-point tensors, got integer dtypes {bad} (ints can only be copied)")


def compute_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Precision of scaling and accumulation: float64 if any tensor is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def as_float32(value: float) -> float:
    """A scale as the kernels apply it: rounded to float32 (a Triton float argument)."""
    return float(np.float32(value))


# ------------------------------------------------------------------------------------------- tables
@dataclasses.dataclass(frozen=True)
class BlockTable:
    blocks: torch.Tensor  # int32 (num_blocks,): run of each block
    runs: torch.Tensor  # int64 (num_runs, 6): param, tensor_start, flat_start, n_valid, n_total, first_block
    memory: table_memory.DeviceTable  # (blocks, runs) in one allocation
    device: torch.device  # the device it was built for (the kernel runs there)
    num_blocks: int
    block: int
    num_warps: int
    chunk: int  # elements per step of the scalar paths


@dataclasses.dataclass(frozen=True)
class PointerTable:
    pointers: torch.Tensor  # int64 (N, 2): data address, dtype group
    memory: table_memory.DeviceTable
    dtypes: tuple[tl.dtype, ...]  # MAX_DTYPE_GROUPS entries, unused ones repeat the first
    num_groups: int


def to_device(arrays: Sequence[np.ndarray], device: torch.device, *, cached: bool) -> table_memory.DeviceTable:
    """Host arrays -> one device table (``table_memory.upload``; ``cached``: read by later launches,
    from any stream). During CUDA graph capture the result is the graph's own (``in_graph``) and
    must not be cached."""
    return table_memory.upload(arrays, device, cached=cached)


def _pick_block(max_run: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, CHUNK)`` for runs of at most ``max_run`` elements; ``CHUNK``: elements per
    step of the scalar paths (4 per thread on a GPU, the whole block under the interpreter, which
    pays per step: [Note: per-thread width])."""
    cap = GPU_MAX_BLOCK if device.type == "cuda" else INTERPRET_MAX_BLOCK
    block = min(cap, max(128, triton.next_power_of_2(max(max_run, 1))))
    num_warps = 8 if block >= 4096 else 4
    return block, num_warps, min(block, 4 * 32 * num_warps) if device.type == "cuda" else block


def block_table(layout: ShardLayout, rank: int | None, pad: bool, device: torch.device) -> BlockTable:
    """Blocks over ``layout.segments(rank)``; ``pad``: blocks also cover the padding (``n_total``)."""
    key = ("blocks", rank, pad, device)
    table = layout._device_cache.get(key)
    if table is None:
        runs = layout.segments(rank)
        lengths = runs[:, 4] if pad else runs[:, 3]
        block, num_warps, chunk = _pick_block(int(lengths.max()), device)
        counts = -(-lengths // block)
        first = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=first[1:])
        blocks = np.repeat(np.arange(len(runs), dtype=np.int32), counts)
        memory = to_device([blocks, np.concatenate([runs, first[:, None]], axis=1)], device, cached=True)
        table = BlockTable(
            blocks=memory.tensors[0],
            runs=memory.tensors[1],
            memory=memory,
            device=device,
            num_blocks=int(counts.sum()),
            block=block,
            num_warps=num_warps,
            chunk=chunk,
        )
        if not memory.in_graph:
            layout._device_cache[key] = table
    return table


def pointer_table(layout: ShardLayout, tensors: Sequence[torch.Tensor], device: torch.device) -> PointerTable:
    """Addresses and dtype groups of ``tensors`` (contiguous, checked)."""
    addresses = tuple(t.data_ptr() for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    key = ("pointers", device, addresses, dtypes)
    table = layout._device_cache.get(key)
    if table is not None:
        return table
    groups: dict[torch.dtype, int] = {}
    codes = [groups.setdefault(d, len(groups)) for d in dtypes]
    group_dtypes = [TRITON_DTYPES[d] for d in groups]
    num_cached = layout._device_cache.setdefault("num_pointer_tables", [0])
    cached = num_cached[0] < POINTER_CACHE_SIZE
    memory = to_device([np.array([addresses, codes], dtype=np.int64).T.copy()], device, cached=cached)
    table = PointerTable(
        pointers=memory.tensors[0],
        memory=memory,
        dtypes=tuple(group_dtypes + group_dtypes[:1] * (MAX_DTYPE_GROUPS - len(group_dtypes))),
        num_groups=len(group_dtypes),
    )
    if cached and not memory.in_graph:
        layout._device_cache[key] = table
        num_cached[0] += 1
    return table


def vector_width(dtypes: Sequence[torch.dtype]) -> int:
    """Elements per thread on both sides of a copy: 16 bytes of the widest of ``dtypes`` (the
    destination side's dtypes; [Note: per-thread width])."""
    return 16 // max(d.itemsize for d in dtypes)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One launch as an op's launcher builds it: what ``launch`` runs, and what the ahead-of-time
    checks (tests/test_aot_compile.py) compile for GPU targets on a CPU-only machine."""

    kernel: triton.JITFunction
    blocks: BlockTable
    pointers: PointerTable
    tensors: tuple[torch.Tensor, ...]  # what ``pointers`` points to: held until the launch is queued
    args: tuple[object, ...]  # the op's own arguments, after the three tables
    constexprs: dict[str, object]  # the op's own constexprs

    def launch(self) -> None:
        launch(self.kernel, self.blocks, self.pointers, *self.args, **self.constexprs)

    def arguments(self) -> tuple[tuple[object, ...], dict[str, object]]:
        """``kernel[grid](*args, **kwargs)``'s arguments on a GPU (tables as built: ``launch`` swaps
        in what ``table_memory.prepare`` gives), compile options included."""
        args = (self.blocks.blocks, self.blocks.runs, self.pointers.pointers, *self.args)
        return args, {**launch_constexprs(self.blocks, self.pointers, self.constexprs), **gpu_options(self.blocks)}


def kernel_call(
    kernel: triton.JITFunction,
    layout: ShardLayout,
    rank: int | None,
    pad: bool,
    tensors: Sequence[torch.Tensor],
    args: Sequence[object],
    constexprs: dict[str, object],
) -> KernelCall:
    """``kernel`` over ``layout``'s runs for ``rank`` (``None``: all ranks; ``pad``: blocks cover the
    padding too) with the parameter-side ``tensors`` (contiguous), on the device of ``args[0]`` (the
    flat buffer)."""
    device = args[0].device
    return KernelCall(kernel, block_table(layout, rank, pad, device), pointer_table(layout, tensors, device),
                      tuple(tensors), tuple(args), constexprs)


def scaled_kernel_call(
    kernel: triton.JITFunction,
    layout: ShardLayout,
    rank: int | None,
    pad: bool,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    scale: float | None,
    destinations: Sequence[torch.dtype],
    **constexprs: object,
) -> KernelCall:
    """``kernel_call`` for a kernel taking ``(flat, scale)``: the scale (``None``: none) rounded to
    float32 and applied in the compute dtype of ``flat`` and ``tensors``; ``destinations``: the
    dtypes it writes (``vector_width``)."""
    compute = compute_dtype([flat.dtype, *(t.dtype for t in tensors)])
    return kernel_call(
        kernel, layout, rank, pad, tensors, (flat, 1.0 if scale is None else as_float32(scale)),
        dict(COMPUTE=TRITON_DTYPES[compute], HAS_SCALE=scale is not None, VEC=vector_width(destinations), **constexprs),
    )


def launch_constexprs(blocks: BlockTable, pointers: PointerTable, constexprs: dict[str, object]) -> dict[str, object]:
    """The constexprs of a launch: dtype groups, block size, and the op's own."""
    g = pointers.dtypes
    return dict(DT0=g[0], DT1=g[1], DT2=g[2], DT3=g[3], NUM_GROUPS=pointers.num_groups, BLOCK=blocks.block,
                CHUNK=blocks.chunk, **constexprs)


def gpu_options(blocks: BlockTable) -> dict[str, object]:
    """Compile options of a GPU launch (the interpreter takes none)."""
    return dict(num_warps=blocks.num_warps, enable_fp_fusion=False)


def launch(kernel: triton.JITFunction, blocks: BlockTable, pointers: PointerTable, *args: object, **constexprs: object) -> None:
    """``kernel[(num_blocks,)](blocks, runs, pointers, *args, ...)`` on the tensors' device."""
    if blocks.num_blocks == 0:
        return
    kwargs = launch_constexprs(blocks, pointers, constexprs)
    device = blocks.device
    grid = (blocks.num_blocks,)
    if device.type == "cuda":
        with torch.cuda.device(device):
            (block_tensors, (pointer_tensor,)) = table_memory.prepare((blocks.memory, pointers.memory), device)
            kernel[grid](*block_tensors, pointer_tensor, *args, **kwargs, **gpu_options(blocks))
    else:
        kernel[grid](blocks.blocks, blocks.runs, pointers.pointers, *args, **kwargs)


# --------------------------------------------------------------------------- torch fallback plans
# [Note: torch fallback]
# Without Triton (CPU without the interpreter; CUDA tensors under it) each op runs a handful of
# batched torch calls instead of its reference's loop over ranks x parameters (``*_ref``, which
# makes ``world_size * N`` small copies). A ``TorchPlan`` (host ints, built once per layout and
# rank, cached on the layout) lists the *pieces*: views made with ``as_strided`` on both sides, all
# copied by one ``torch._foreach_copy_`` (or ``_foreach_add_``). Zeroing, scaling and casts of
# whole buffers are one call each.
#
# * ``rank`` plans (copy-in of the all-gather, copy-out of the reduce-scatter): one piece per
#   parameter with a non-empty shard, the shard's shape at its slot offset — the very copy the
#   reference makes.
# * ``None`` (all ranks) plans: a parameter's rows on its *full* ranks (``d // ceil(d / w)`` of
#   them, each holding a whole chunk) are one 2-D piece ``(full, chunk)`` — rank-major rows of the
#   buffer (stride ``slot_numel``) against consecutive rows of the parameter — and the short
#   rank's rows, if any, a 1-D piece: at most two copies per parameter whatever the world size.
#   A piece that is its parameter's whole region (rows divide evenly, chunk a multiple of
#   ``ShardLayout.ALIGN``) comes from one split of the buffer, cheaper than a view each.
# * Packing (the copy-ins) needs no view at all when no region has alignment padding (every chunk a
#   multiple of ``ALIGN``, as for the usual power-of-two shapes, and every shard of the rank full
#   for a rank plan) and the tensors share one dtype: ``torch._chunk_cat`` — FSDP2's packing op —
#   lays them out rank-major, zero-padding short ranks, in one call (``TorchPlan.chunk_cat``); a
#   cast then follows on the whole buffer.
#
# Bitwise equal to the references. A copy without a cast keeps every bit whatever loop torch runs
# it in, and so does every non-NaN value through a cast or elementwise arithmetic. The bits of a
# NaN that a cast produces, though, depend on the loop — vector body or scalar tail, contiguous or
# strided iterator (float32 NaN -> bfloat16 is 0xFFFF from a contiguous copy, 0x7FC0 from a strided
# one; float16 NaN -> float32 is 0x7FC00000 or 0x7FFFFFFF by position in the copy) — and so on how
# the copies are cut. Rank plans' pieces are cut as the references' copies. Where a fallback casts
# in other pieces (2-D pieces, whole buffers) it looks for a NaN (``has_nan``: one sum over the
# buffer) and, finding one, takes the path cut like the reference (or runs the reference itself):
# slow, but only for data that already holds a NaN (a gradient with a NaN means a skipped step
# anyway). NaN bits are not part of the ops' contract (see [Note: conversions as torch does them]);
# this keeps the fallback and the reference interchangeable, bit for bit.

Piece = tuple[int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...], int]
"""``(param, size, param_stride, param_offset, buffer_stride, buffer_offset)``: a view of parameter
``param``'s tensor and one of the flat buffer (or slot), offsets relative to each one's own start."""


@dataclasses.dataclass(frozen=True)
class TorchPlan:
    pieces: tuple[Piece, ...]
    padded: bool  # the buffer (the slot, for a rank plan) holds padding, which must read as zeros
    whole: tuple[bool, ...]  # per piece: it is its parameter's whole region of the buffer
    regions: tuple[int, ...]  # the parameters' region sizes; whole pieces are views of a split by them
    world_size: int
    chunk_cat: bool  # no alignment padding: torch._chunk_cat packs the non-empty tensors (below)
    nonempty: tuple[int, ...]  # parameters with elements in the buffer (or the slot), in order


def torch_plan(layout: ShardLayout, rank: int | None) -> TorchPlan:
    """The pieces between ``rank``'s shards and its slot, or (``None``) full tensors and the buffer."""
    key = ("torch_plan", rank)
    plan = layout._device_cache.get(key)
    if plan is None:
        plan = layout._device_cache[key] = _build_torch_plan(layout, rank)
    return plan


def _build_torch_plan(layout: ShardLayout, rank: int | None) -> TorchPlan:
    pieces: list[Piece] = []
    whole: list[bool] = []
    slot, w = layout.slot_numel, layout.world_size
    if rank is not None:
        for i, offset in enumerate(layout.slot_offsets):
            if layout.shard_numel(i, rank):
                shape = tuple(layout.shard_shape(i, rank))
                stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))  # contiguous
                pieces.append((i, shape, stride, 0, stride, offset))
                whole.append(False)
        padded = sum(layout.shard_numel(i, rank) for i in range(layout.num_params)) != slot
        nonempty = tuple(piece[0] for piece in pieces)
        return TorchPlan(tuple(pieces), padded, tuple(whole), layout.padded_numels, w, not padded, nonempty)
    for i, offset in enumerate(layout.slot_offsets):
        if not layout.numels[i]:
            continue
        rows, chunk = layout.rows_per_rank[i], layout.chunk_numels[i]
        full = layout.dim0s[i] // rows
        pieces.append((i, (full, chunk), (chunk, 1), 0, (slot, 1), offset))
        whole.append(full == w and chunk == layout.padded_numels[i])
        short = layout.numels[i] - full * chunk
        if short:
            pieces.append((i, (short,), (1,), full * chunk, (1,), full * slot + offset))
            whole.append(False)
    padded = sum(layout.numels) != layout.buffer_numel
    aligned = layout.chunk_numels == layout.padded_numels  # (so no 0-dim parameter: 1 element)
    nonempty = tuple(i for i, n in enumerate(layout.numels) if n)
    return TorchPlan(tuple(pieces), padded, tuple(whole), layout.padded_numels, w, aligned, nonempty)


def buffer_views(buffer: torch.Tensor, plan: TorchPlan) -> list[torch.Tensor]:
    """The buffer side of ``plan``'s pieces in ``buffer`` (contiguous, any shape): whole regions
    from one split, the others by ``as_strided``."""
    if any(plan.whole):
        regions = buffer.view(plan.world_size, -1).split(plan.regions, dim=1)
    base = buffer.storage_offset()
    return [
        regions[i] if whole else buffer.as_strided(size, stride, base + offset)
        for (i, size, _, _, stride, offset), whole in zip(plan.pieces, plan.whole)
    ]


def param_views(tensors: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """The parameter side of ``pieces`` in ``tensors`` (contiguous)."""
    return [
        tensors[i].as_strided(size, stride, tensors[i].storage_offset() + offset)
        for i, size, stride, offset, _, _ in pieces
    ]


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (casting), in one call."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


CHUNK_CAT_CAST_MAX_NUMEL = 4096
"""Tensors of at most this many elements on average are packed through a temporary and cast on the
whole buffer, larger ones by a view each (measured on CPU: the crossover lies at 4-8K elements)."""


def chunk_cat(tensors: Sequence[torch.Tensor], plan: TorchPlan, num_chunks: int, out: torch.Tensor) -> bool:
    """Pack ``tensors`` into ``out`` (contiguous; ``num_chunks`` rows) with one ``torch._chunk_cat``
    when ``plan`` allows it and they share a dtype — ``out``'s, or another for small tensors (cast
    on the whole buffer); returns whether it did. A cast of a NaN would not be cut like the
    reference's copies: it returns False then, having written nothing."""
    if not plan.chunk_cat or not plan.nonempty:
        return False
    dtype = tensors[plan.nonempty[0]].dtype
    if any(tensors[i].dtype != dtype for i in plan.nonempty):
        return False
    rows = out.view(num_chunks, -1)
    nonempty = [tensors[i] for i in plan.nonempty]
    if dtype == out.dtype:
        torch._chunk_cat(nonempty, 0, num_chunks, out=rows)
        return True
    if out.numel() > CHUNK_CAT_CAST_MAX_NUMEL * len(nonempty):
        return False  # large tensors: a view each costs less than two more passes over the buffer
    packed = torch._chunk_cat(nonempty, 0, num_chunks)
    if has_nan(packed):
        return False
    rows.copy_(packed)
    return True


def has_nan(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor may hold a NaN: one sum (an ``inf - inf`` in it is a false
    alarm, which only costs time)."""
    return tensor.is_floating_point() and tensor.numel() > 0 and bool(tensor.sum().isnan())


def keeps_zero(scale: float) -> bool:
    """Whether ``+0.0 * scale`` is ``+0.0`` (a finite, non-negative scale): padding stays zero."""
    return math.isfinite(scale) and math.copysign(1.0, scale) > 0


# --------------------------------------------------------------------------- device-side helpers
_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def _to_bf16_rtne(x):
    """float32 -> bfloat16, round to nearest even; every NaN becomes 0x7FC0 (c10's scalar rule)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    u = tl.where(x != x, 0x7FC0, u)
    return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_to_f32(x):
    """bfloat16 -> float32, exact for every value (subnormals and NaN payloads included): a bfloat16
    is the upper half of a float32."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _from_float32(x, TO: tl.constexpr):
    if _INTERPRETED and TO == tl.bfloat16:
        y = _to_bf16_rtne(x)
    else:
        y = x.to(TO)
    return y


@triton.jit
def _to_float32(x):
    if _INTERPRETED and x.dtype == tl.bfloat16:
        y = _bf16_to_f32(x)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
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


@triton.jit
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


@triton.jit
def vector_lanes(BLOCK: tl.constexpr, VEC: tl.constexpr):
    """A block's element offsets on an aligned unmasked path: ``arange(0, BLOCK)``, ``VEC``
    consecutive elements per thread ([Note: per-thread width])."""
    return tl.max_contiguous(tl.arange(0, BLOCK), VEC)


@triton.jit
def scalar_lanes(BLOCK: tl.constexpr):
    """A block's element offsets on an unaligned or masked path, shaped ``(1, BLOCK)``.

    Triton's coalescing widens every load to the widest access *of the same shape* anywhere in the
    kernel, and to what the load itself allows (the flat side is aligned even when the parameter
    side is not); a wide load feeding a scalar store is a layout conversion through shared memory.
    Another shape keeps these paths apart from the vector path, and a contiguity of 1 keeps their
    flat side scalar: scalar on both sides, no shared memory ([Note: per-thread width]).
    """
    return tl.max_contiguous(tl.arange(0, BLOCK), 1)[None, :]


@triton.jit
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


@triton.jit
def _load(addr, start, offs, mask, other, DT: tl.constexpr, TO: tl.constexpr, ALIGNED: tl.constexpr):
    return convert(tl.load(_at(addr, start, DT, ALIGNED) + offs, mask=mask, other=other), TO)


@triton.jit
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


@triton.jit
def _store(addr, start, offs, x, mask, DT: tl.constexpr, ALIGNED: tl.constexpr):
    tl.store(_at(addr, start, DT, ALIGNED) + offs, convert(x, DT), mask=mask)


@triton.jit
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
