"""The host side of one launch: dispatch, tables, and the launch itself.

Contract: ``triton_enabled(device)`` says whether a call takes the Triton kernel or the torch
fallback (``overlap_kernels._torch_fallback``). An op's launcher builds a ``KernelCall`` with
``kernel_call`` / ``scaled_kernel_call`` (its block table and pointer table, its own arguments and
constexprs) and runs ``KernelCall.launch``: one launch over all of a group's tensors, on the
tensors' device, with no host sync. ``increment_version`` then tells autograd what it wrote. The
same ``KernelCall`` is what tests/packing/test_aot_compile.py compiles for GPU targets.

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
  that key — the ``POINTER_CACHE_SIZE`` newest of them: a new address set evicts the oldest, whose
  device copy ``overlap_kernels.table_memory`` releases only after the kernels that may read it. A prepared
  launch's table for a new address set is made from its old one instead (``PointerTable.moved``,
  [Note: a miss of a prepared launch] in ``overlap_kernels.prepared_launch``), outside this cache.

Device copies of the tables, their use from several streams, their release and CUDA graph capture
are ``overlap_kernels.table_memory``'s ([Note: table memory]): copies are stream-ordered (no host sync), a
table is not reused while a queued kernel may read it, and a captured launch reads tables that stay
valid for as long as the graph may replay. The device side (``block_run``, ``load_as``, ``store_as``)
is ``overlap_kernels._jit``.

Launches pass ``enable_fp_fusion=False`` so that scale-then-accumulate rounds like the torch reference.

[Note: host cost of a launch]
On a GPU the host time of an op is what the overlap must hide behind, and a group has hundreds of
small parameters. A repeated call is a *prepared launch* ([Note: prepared launches] in
``overlap_kernels.prepared_launch``): one pass checks the list against a fingerprint (type, device,
dtype, shape, strides), one pass reads the addresses that key the prepared launch, and nothing else
is per tensor; each is one C++ loop where the native passes are built ([Note: native passes] in
``overlap_kernels.native_passes``). What follows is the path of a first call (and of
``prepared_launch.uncached``). Per call, a launch reads each tensor twice, by C-level ``map`` passes with no
Python bytecode per tensor: its data address and its dtype (the pointer-table key; the public ops'
checks add one pass per rule, [Note: checks at C speed] in ``overlap_kernels._checks``, and hand the
dtypes they read to the launch, which then reads only the addresses). Everything else
is per layout or per key: the block table, the shapes the checks compare against, the pointer
table of an address set seen before (its device copy included), the dtype groups and the vector
width. A cached pointer table is a pure function of its key, so a stale entry cannot exist: a
tensor freed and another allocated at the same address with the same dtype gets the same,
correct, table, and a change of address or dtype misses the cache. The reads that remain are the
floor of a Python launcher that must not trust its caller: about 0.05 µs per tensor per pass on
the 2-core CI box, 0.002-0.008 µs as native passes (``benchmarks/bench_kernels.py``'s host table,
with the kernel launch stubbed).
On CUDA the launch itself then skips Triton's per-call JIT path ([Note: launching the compiled
kernel] in ``overlap_kernels._compiled_launch``). No cheaper fingerprint exists for a list the caller hands in: a tensor object keeps its identity
and often its address through ``set_``, ``resize_``, ``as_strided_`` and ``.data =``, none of which
need bump a counter, so a key that skipped reading a tensor could launch on memory it no longer
owns. What *can* be O(1) is a list whose placement the caller owns ([Note: packed placements]).

[Note: packed placements]
When ``N`` tensors are views of one storage at fixed byte offsets (``PackedPlacement.views``: the
runtime's unsharded parameters, as FSDP2's all-gather output holds them), their pointer table is
``storage address + offsets``: ``packed_pointer_table`` keys it on the storage's *current* address
and the placement object (immutable, hashed by identity), reads no tensor, and checks that the
storage holds the placement's bytes (a storage freed by ``resize_(0)`` is refused before any launch;
one re-allocated elsewhere is another key). As with address keys, the table is a pure function of
its key, so it cannot be stale. The caller vouches that the tensors it passes are the placement's
views (the runtime made them; the public ops never take this path).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from overlap_kernels import _compiled_launch, native_passes, table_memory
from overlap_kernels._dtypes import MAX_DTYPE_GROUPS, TRITON_DTYPES, as_float32, compute_dtype
from overlap_kernels._jit import INTERPRET
from overlap_kernels.layout import ShardLayout, next_power_of_two

POINTER_CACHE_SIZE = 64
GPU_MAX_BLOCK = 4096
INTERPRET_MAX_BLOCK = 1 << 16  # the interpreter pays per program, not per element


CPU_KERNELS_ENV = "OVERLAP_CPU_KERNELS"
"""Set to ``torch`` (read at each call), CPU tensors take the torch fallback even under
``TRITON_INTERPRET=1`` (:func:`torch_fallback_on_cpu`)."""


@contextlib.contextmanager
def torch_fallback_on_cpu() -> Iterator[None]:
    """While active, CPU tensors take the torch fallback even under ``TRITON_INTERPRET=1``, in this
    process and in the ranks it starts meanwhile (they read ``OVERLAP_CPU_KERNELS`` from the
    environment they are given). What CPU users run, and bitwise the kernels' result
    (tests/packing/test_kernels_library.py); the test suite's long training loops use it, where the
    interpreter would cost five times their compute and check nothing the kernel tests do not."""
    before = os.environ.get(CPU_KERNELS_ENV)
    os.environ[CPU_KERNELS_ENV] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CPU_KERNELS_ENV]
        else:
            os.environ[CPU_KERNELS_ENV] = before


_stubbed_launches: list[int] | None = None


@contextlib.contextmanager
def launches_stubbed() -> Iterator[list[int]]:
    """For measuring the host side of the ops without a GPU: while active (process-wide: not while
    other threads launch ops), CPU tensors take the Triton path and everything up to the kernel call runs (checks, tables,
    constexprs), but the kernel itself is not launched: the ops' outputs are left unwritten. Yields
    a one-item list counting the skipped launches. ``benchmarks/bench_kernels.py``'s host table."""
    global _stubbed_launches
    before, _stubbed_launches = _stubbed_launches, [0]
    try:
        yield _stubbed_launches
    finally:
        _stubbed_launches = before


def count_stubbed_launch() -> bool:
    """Under ``launches_stubbed``: count one launch and return ``True`` (the caller launches nothing)."""
    if _stubbed_launches is None:
        return False
    _stubbed_launches[0] += 1
    return True


# ----------------------------------------------------------------------------------------- dispatch
def triton_enabled(device: torch.device) -> bool:
    """Triton kernel (compiled on CUDA, interpreted on CPU) or the torch fallback ([Note: torch fallback]);
    CPU tensors take the fallback without the interpreter, or with ``OVERLAP_CPU_KERNELS=torch``
    (unless ``launches_stubbed``)."""
    if device.type == "cuda":
        return not INTERPRET
    if device.type != "cpu":
        return False
    return _stubbed_launches is not None or (INTERPRET and os.environ.get(CPU_KERNELS_ENV) != "torch")


def increment_version(tensors: Sequence[torch.Tensor]) -> None:
    """Tell autograd that the kernel wrote ``tensors`` in place behind its back (one C++ loop:
    [Note: native passes] in ``overlap_kernels.native_passes``)."""
    native_passes.increment_version(tensors)


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
    torch_dtypes: tuple[torch.dtype, ...]  # the distinct dtypes of the tensors, in group order
    groups: np.ndarray  # int64 (N,), on the host: the second column (each tensor's dtype group)

    def moved(self, addresses: native_passes.Addresses, device: torch.device) -> PointerTable:
        """This table with ``addresses`` in its first column (tensors of the same dtypes, in the same
        order, at other addresses): one host array filled and uploaded, nothing read of a tensor and
        nothing cached ([Note: a miss of a prepared launch] in ``overlap_kernels.prepared_launch``)."""
        return _pointer_rows(addresses, self.groups, self.dtypes, self.num_groups, self.torch_dtypes, device)


def to_device(arrays: Sequence[np.ndarray], device: torch.device, *, cached: bool) -> table_memory.DeviceTable:
    """Host arrays -> one device table (``table_memory.upload``; ``cached``: read by later launches,
    from any stream). During CUDA graph capture the result is the graph's own (``in_graph``) and
    must not be cached."""
    return table_memory.upload(arrays, device, cached=cached)


def _pick_block(max_run: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, CHUNK)`` for runs of at most ``max_run`` elements; ``CHUNK``: elements per
    step of the scalar paths (4 per thread on a GPU, the whole block under the interpreter, which
    pays per step: [Note: per-thread width] in ``overlap_kernels._jit``)."""
    cap = GPU_MAX_BLOCK if device.type == "cuda" else INTERPRET_MAX_BLOCK
    block = min(cap, max(128, next_power_of_two(max_run)))
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


def pointer_table(layout: ShardLayout, tensors: Sequence[torch.Tensor], device: torch.device,
                  dtypes: tuple[torch.dtype, ...] | None = None) -> PointerTable:
    """Addresses and dtype groups of ``tensors`` (contiguous, checked); the key is read by two
    C-level passes over the list ([Note: host cost of a launch]), one when the caller's checks
    hand over ``dtypes`` (each tensor's, in order)."""
    addresses = native_passes.addresses(tensors)
    if dtypes is None:
        dtypes = native_passes.dtypes(tensors)
    key = ("pointers", device, addresses, dtypes)
    table = layout._device_cache.get(key)
    if table is None:
        table = _new_pointer_table(layout, key, addresses, dtypes, device)
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class PackedPlacement:
    """Where ``N`` tensors sit inside one storage: each one's byte offset and dtype, fixed for as long
    as the placement lives ([Note: packed placements]). Immutable, equal and hashed by identity.

    ``packed_pointer_table`` keys on ``(the storage's address, placement)``; ``views`` makes the
    tensors. The runtime places a group's unsharded parameters this way.
    """

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    byte_offsets: tuple[int, ...]
    nbytes: int  # the storage's size: the last tensor's end, rounded up to ``ALIGN_BYTES``

    ALIGN_BYTES = 16  # every tensor starts 16-byte aligned (the kernels' vector loads and stores)

    @staticmethod
    def of(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> PackedPlacement:
        """Tensors of ``shapes`` and ``dtypes`` back to back, each ``ALIGN_BYTES``-aligned."""
        if len(shapes) != len(dtypes):
            raise ValueError(f"PackedPlacement.of: {len(shapes)} shapes but {len(dtypes)} dtypes")
        offsets, end, align = [], 0, PackedPlacement.ALIGN_BYTES
        sizes = tuple(torch.Size(s) for s in shapes)
        for shape, dtype in zip(sizes, dtypes):
            offsets.append(end)
            end += -(-shape.numel() * dtype.itemsize // align) * align
        return PackedPlacement(sizes, tuple(dtypes), tuple(offsets), max(end, align))

    def views(self, storage: torch.UntypedStorage) -> list[torch.Tensor]:
        """The placed tensors over ``storage`` (at least ``nbytes`` now, or resized to that before
        use): contiguous, sharing ``storage`` (a ``resize_`` of it frees or re-allocates them all),
        each with its own version counter."""
        out = []
        for shape, dtype, offset in zip(self.shapes, self.dtypes, self.byte_offsets):
            t = torch.empty(0, dtype=dtype, device=storage.device)
            t.set_(storage, offset // dtype.itemsize, shape)
            out.append(t)
        return out

    def shared_views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """The placed tensors as views of ``data``, a 1-D ``uint8`` tensor of exactly ``nbytes``
        bytes (``torch.empty(placement.nbytes, dtype=torch.uint8)``, whose ``untyped_storage()`` is
        then the storage to key on): contiguous, sharing ``data``'s storage *and its version
        counter*. One C-level ``as_strided`` pass over the list, about what allocating each tensor
        alone costs; ``views`` pays about twice that for a version counter of each tensor's own."""
        if data.dtype != torch.uint8 or data.shape != (self.nbytes,) or data.storage_offset() != 0:
            raise ValueError(f"PackedPlacement.shared_views: data must be a 1-D uint8 tensor of {self.nbytes} "
                             f"bytes at storage offset 0, got {data.dtype} {tuple(data.shape)} at offset "
                             f"{data.storage_offset()}")
        strided = self._strided
        bases = [data.view(dtype) for dtype in strided.dtype_set]
        return list(map(torch.Tensor.as_strided, map(bases.__getitem__, strided.dtype_index), self.shapes,
                        strided.strides, strided.element_offsets))

    @functools.cached_property
    def _strided(self) -> _StridedPlacement:
        dtype_set = tuple(dict.fromkeys(self.dtypes))
        return _StridedPlacement(
            dtype_set=dtype_set,
            dtype_index=tuple(dtype_set.index(d) for d in self.dtypes),
            strides=tuple(torch.empty(s, device="meta").stride() for s in self.shapes),
            element_offsets=tuple(o // d.itemsize for o, d in zip(self.byte_offsets, self.dtypes)),
        )


@dataclasses.dataclass(frozen=True)
class _StridedPlacement:
    """``PackedPlacement.shared_views``'s arguments, computed once per placement."""

    dtype_set: tuple[torch.dtype, ...]  # the distinct dtypes, in first-seen order
    dtype_index: tuple[int, ...]  # per tensor, its dtype's index in ``dtype_set``
    strides: tuple[tuple[int, ...], ...]  # contiguous strides of each shape
    element_offsets: tuple[int, ...]  # byte offsets in elements of each tensor's dtype


def check_packed_storage(where: str, storage: torch.UntypedStorage, placement: PackedPlacement) -> None:
    """Refuse a storage freed (resized to 0) or too small for ``placement``: never launch on it."""
    if storage.nbytes() < placement.nbytes:
        raise ValueError(f"{where}: the storage holds {storage.nbytes()} bytes, the placement "
                         f"needs {placement.nbytes}; resize it before the launch")


def packed_pointer_table(layout: ShardLayout, storage: torch.UntypedStorage, placement: PackedPlacement,
                         device: torch.device) -> PointerTable:
    """``pointer_table`` of ``placement.views(storage)`` without reading a tensor: keyed on the
    storage's current address and the placement, O(1) per call ([Note: packed placements])."""
    check_packed_storage("packed_pointer_table", storage, placement)
    address = storage.data_ptr()
    key = ("packed pointers", device, address, placement)
    table = layout._device_cache.get(key)
    if table is None:  # an empty tensor's address is 0, as ``data_ptr`` says
        addresses = tuple(address + offset if shape.numel() else 0
                          for offset, shape in zip(placement.byte_offsets, placement.shapes))
        table = _new_pointer_table(layout, key, addresses, placement.dtypes, device)
    return table


def _new_pointer_table(layout: ShardLayout, key: tuple, addresses: native_passes.Addresses, dtypes: tuple[torch.dtype, ...],
                       device: torch.device) -> PointerTable:
    """The table of ``addresses`` and ``dtypes``, cached on ``layout`` under ``key`` (whose value it
    is a function of); the layout keeps the ``POINTER_CACHE_SIZE`` newest, and drops the oldest
    (its device copy is released once the kernels that may read it have run: [Note: table
    lifetime] in ``overlap_kernels.table_memory``)."""
    table = built_pointer_table(addresses, dtypes, device)
    if not table.memory.in_graph:
        keys = layout._device_cache.setdefault("pointer table keys", collections.deque())
        if len(keys) >= POINTER_CACHE_SIZE:
            del layout._device_cache[keys.popleft()]
        layout._device_cache[key] = table
        keys.append(key)
    return table


def built_pointer_table(addresses: native_passes.Addresses, dtypes: tuple[torch.dtype, ...],
                        device: torch.device) -> PointerTable:
    """The table of ``addresses`` and ``dtypes`` (each tensor's, in order), uploaded to ``device``,
    cached nowhere: its dtype groups in first-seen order."""
    groups = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}  # first-seen order, one C pass
    column = np.zeros(len(dtypes), dtype=np.int64)
    if len(groups) > 1:
        column[:] = list(map(groups.__getitem__, dtypes))
    group_dtypes = [TRITON_DTYPES[d] for d in groups]
    return _pointer_rows(addresses, column, tuple(group_dtypes + group_dtypes[:1] * (MAX_DTYPE_GROUPS - len(group_dtypes))),
                         len(group_dtypes), tuple(groups), device)


def _pointer_rows(addresses: native_passes.Addresses, groups: np.ndarray, dtypes: tuple[tl.dtype, ...], num_groups: int,
                  torch_dtypes: tuple[torch.dtype, ...], device: torch.device) -> PointerTable:
    """The table of ``addresses`` and their dtype ``groups`` (column), uploaded to ``device`` as a
    table later launches may read (``cached``), not cached here."""
    rows = np.empty((len(groups), 2), dtype=np.int64)
    rows[:, 0] = native_passes.address_column(addresses)
    rows[:, 1] = groups
    memory = to_device([rows], device, cached=True)
    return PointerTable(pointers=memory.tensors[0], memory=memory, dtypes=dtypes, num_groups=num_groups,
                        torch_dtypes=torch_dtypes, groups=groups)


# ------------------------------------------------------------------------------------------- launch
def vector_width(dtypes: Sequence[torch.dtype]) -> int:
    """Elements per thread on both sides of a copy: 16 bytes of the widest of ``dtypes`` (the
    destination side's dtypes; [Note: per-thread width] in ``overlap_kernels._jit``)."""
    return 16 // max(d.itemsize for d in dtypes)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One launch as an op's launcher builds it: what ``launch`` runs, and what the ahead-of-time
    checks (tests/packing/test_aot_compile.py) compile for GPU targets on a CPU-only machine."""

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
    destinations: Sequence[torch.dtype] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    packed: tuple[torch.UntypedStorage, PackedPlacement] | None = None,
) -> KernelCall:
    """``kernel`` over ``layout``'s runs for ``rank`` (``None``: all ranks; ``pad``: blocks cover the
    padding too) with the parameter-side ``tensors`` (contiguous), on the device of ``args[0]`` (the
    flat buffer). ``VEC`` is set from ``destinations``, the dtypes the kernel writes (``None``: the
    ``tensors``' own). ``dtypes``: the ``tensors``' dtypes in order when the caller's checks read them
    (``None``: read here). ``packed``: ``tensors`` are ``placement.views(storage)``, so the pointer
    table is keyed on the storage without reading them (``packed_pointer_table``)."""
    device = args[0].device
    pointers = pointer_table(layout, tensors, device, dtypes) if packed is None else packed_pointer_table(
        layout, packed[0], packed[1], device)
    vec = vector_width(pointers.torch_dtypes if destinations is None else destinations)
    return KernelCall(kernel, block_table(layout, rank, pad, device), pointers, tuple(tensors), tuple(args),
                      {**constexprs, "VEC": vec})


def scaled_kernel_call(
    kernel: triton.JITFunction,
    layout: ShardLayout,
    rank: int | None,
    pad: bool,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    scale: float | None,
    destinations: Sequence[torch.dtype] | None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    packed: tuple[torch.UntypedStorage, PackedPlacement] | None = None,
    **constexprs: object,
) -> KernelCall:
    """``kernel_call`` for a kernel taking ``(flat, scale)``: the scale (``None``: none) rounded to
    float32 and applied in the compute dtype of ``flat`` and ``tensors``; ``destinations``: the
    dtypes it writes (``None``: the ``tensors``' own); ``dtypes`` and ``packed`` as for ``kernel_call``."""
    call = kernel_call(kernel, layout, rank, pad, tensors, (flat, 1.0 if scale is None else as_float32(scale)),
                       constexprs, destinations, dtypes, packed)
    compute = compute_dtype([flat.dtype, *call.pointers.torch_dtypes])
    call.constexprs.update(COMPUTE=TRITON_DTYPES[compute], HAS_SCALE=scale is not None)
    return call


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
    if count_stubbed_launch():
        return
    device = blocks.device
    if device.type == "cuda":
        cuda_launch(kernel, blocks.num_blocks, (blocks.memory, pointers.memory), args, kwargs, gpu_options(blocks),
                    device)
    else:
        kernel[(blocks.num_blocks,)](blocks.blocks, blocks.runs, pointers.pointers, *args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedLaunch:
    """A ``KernelCall`` with everything but the flat buffer settled: its tables (device copies
    included), grid, the arguments after the flat buffer and its constexprs. ``launch(flat)`` is
    the call's ``launch`` with ``flat`` as the flat buffer, through the same ``launch``
    ([Note: prepared launches] in ``overlap_kernels.prepared_launch``, which caches them)."""

    kernel: triton.JITFunction
    blocks: BlockTable
    pointers: PointerTable
    tail: tuple[object, ...]  # the op's arguments after the flat buffer (its scale)
    constexprs: dict[str, object]  # the op's own constexprs

    @staticmethod
    def of(call: KernelCall) -> PreparedLaunch:
        return PreparedLaunch(call.kernel, call.blocks, call.pointers, call.args[1:], call.constexprs)

    def moved(self, addresses: native_passes.Addresses) -> PreparedLaunch:
        """This launch over tensors of the same dtypes at ``addresses``: the same grid, constexprs and
        block table, a pointer table with ``addresses`` (``PointerTable.moved``)."""
        return PreparedLaunch(self.kernel, self.blocks, self.pointers.moved(addresses, self.blocks.device), self.tail,
                              self.constexprs)

    @property
    def in_graph(self) -> bool:
        """A table belongs to a CUDA graph being captured (its bytes arrive at replay): not cacheable."""
        return self.blocks.memory.in_graph or self.pointers.memory.in_graph

    def launch(self, flat: torch.Tensor) -> None:
        launch(self.kernel, self.blocks, self.pointers, flat, *self.tail, **self.constexprs)


def cuda_launch(kernel: triton.JITFunction, programs: int, tables: Sequence[table_memory.DeviceTable],
                args: Sequence[object], constexprs: dict[str, object], options: dict[str, object],
                device: torch.device) -> None:
    """``kernel[(programs,)](*tensors of each table, *args, **constexprs, **options)`` on ``device``
    and its current stream: the tables through ``table_memory.prepare``, a repeat launch straight
    into the compiled kernel ([Note: launching the compiled kernel] in ``overlap_kernels._compiled_launch``)."""
    index = _compiled_launch.current_device_index()
    with torch.cuda.device(device) if index != device.index else contextlib.nullcontext():
        prepared = table_memory.prepare(tables, device)
        _compiled_launch.run(kernel, programs, (*itertools.chain.from_iterable(prepared), *args), constexprs,
                             options, device.index)
