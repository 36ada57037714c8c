"""Packing kernels: GB/s of the four fused ops vs the torch path FSDP2 uses vs a plain device copy.

For each workload and dtype pair, on rank 0 of a ``--world-size`` layout, times

* the fused op (``overlap_kernels.*``: one Triton launch over all parameters on CUDA),
* the torch path FSDP2 takes for the same step:
  all-gather copy-in  ``torch._foreach_copy_`` of the shards into views of a new flat buffer;
  all-gather copy-out ``torch.split_with_sizes_copy`` of the gathered buffer into padded
                      parameters (plus a ``_foreach_copy_`` cast when the dtypes differ);
  reduce-scatter copy-in  cast (when needed) + ``torch._chunk_cat`` into a new buffer + ``div_``;
  reduce-scatter copy-out ``div`` + per-parameter cast + ``_foreach_add_`` into the sharded grads;
* a plain device copy (``dst.copy_(src)``) of the same number of bytes: the practical limit.

GB/s = the op's useful bytes (elements read + written, padding excluded; the sharded grads are
read and written by the accumulating copy-out) / time: the same numerator in every column.
CUDA timings are ``triton.testing.do_bench`` medians (quantiles 0.5, 0.2, 0.8): wall time per call,
which is the host's when the host takes longer to issue a call than the GPU to run it. So on CUDA
the fused op and the copy are timed a second time with the host hidden (``overlap.testing.device_time``:
every call queued behind a sleep before the GPU reaches the first), and "fused/copy, device" is the
kernel's bandwidth against a copy's, what issue 30's goal and the kernels' copy-bandwidth claims
are about; the wall columns stay what a caller waits. On CPU
(``--device cpu``) the ops take their torch fallback path (no Triton), workloads are scaled down and
timed with a median of repeats: the table says so, and its figures are not GPU results.

A second table gives the *host* µs per call of each op's Triton path, full-size shapes (the host
side does not depend on the bytes), for the public op (``overlap_kernels.*``, argument checks included)
and for the launcher the runtime calls (``_all_gather_copy_in`` ..., no checks, with what the
runtime hands it: the shards' dtypes, the unsharded parameters' packed storage, and, for the
reduce-scatter copy-out, new sharded gradients as views of one storage: what ``zero_grad(set_to_none=True)``
leads to; a row times it into gradients allocated one by one, the runtime's path when they
already exist; a last row times the reduce-scatter copy-in on gradients at new addresses every
call, as autograd hands them over on CPU: every call a miss), beside the target of issue 28 (15 µs + 0.05 µs per parameter, [Note: host cost of a launch] in ``overlap_kernels._launch``).
Each is timed twice in the same interleaved rounds: as it runs (a repeated call is a prepared
launch, [Note: prepared launches] in ``overlap_kernels.prepared_launch``) and under
``prepared_launch.uncached()`` (every tensor checked and every launch built at every call, as
before prepared launches). The quantized ops of ``overlap.Compression`` (the runtime's packing path
when it compresses) get a host table of their own, as the runtime calls them, with the Python
passes and as they run.
On CUDA: wall time of back-to-back calls, nothing synchronized, and the torch path's the same way.
On CPU: the same calls with the kernel launch stubbed out (``overlap_kernels._launch.launches_stubbed``):
everything the host does up to the launch, which on a GPU is followed by Triton's own launch cost.
On CUDA a third table splits the runtime launcher's host µs into our preparation, the device tables
and device context, Triton's JIT launch path, the direct launch the runtime makes instead
([Note: launching the compiled kernel] in ``overlap_kernels._compiled_launch``) and the compiled kernel's
own launcher (``launch_breakdown``): the first H100 run (2026-11-26, JIT path) measured 61-97 µs
per launch for 9 parameters against 7-12 µs of preparation on the CPU.
A last table times the four quantized ops of ``overlap.Compression`` (int8 and fp8, as the runtime
calls them) against a plain copy of the bytes they read and write, wall and (CUDA) device time: issue
30 asks for at least 0.85x a copy on large workloads on CUDA (on CPU they take the torch fallback:
not GPU figures).

    python benchmarks/bench_kernels.py [--device cuda|cpu] [--world-size 8] [--quick]
                                       [--workload NAME ...] [--skip-gbps] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from _common import add_world_size, parse, parser  # first: sys.path
import overlap_kernels
from overlap_kernels import ShardLayout, _compiled_launch, _launch, native_passes, prepared_launch
from overlap_kernels.all_gather_copy_in import _all_gather_copy_in
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out
from overlap_kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out
from overlap_kernels.quantized_all_gather_copy_out import _quantized_all_gather_copy_out
from overlap_kernels.quantized_copy_in import _quantized_copy_in
from overlap_kernels import quantized_layout
from overlap_kernels.quantized_layout import QuantizedLayout
from overlap_kernels.quantized_reduce_scatter_copy_out import _quantized_reduce_scatter_copy_out
from overlap.testing.device_time import device_ms
from report import emit

QUANTILES = [0.5, 0.2, 0.8]
_DTYPE = operator.attrgetter("dtype")
OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out")
INTO_EXISTING = "reduce_scatter_copy_out, existing grads"
"""Host table only: the runtime's copy-out into gradients allocated one by one (its public and torch
columns are the plain op's)."""
NEW_ADDRESSES = "reduce_scatter_copy_in, gradients at new addresses"
"""Host table only: each call packs another list of gradients, none of whose address sets is among
the ``MAX_LAUNCHES`` a fingerprint keeps (as autograd's gradients come on CPU): every call misses
([Note: a miss of a prepared launch] in ``overlap_kernels.prepared_launch``). The runtime column reads the
gradients' dtypes as the group does and hands them in; the public and torch columns take the same
lists."""
NEW_ADDRESS_LISTS = prepared_launch.MAX_LAUNCHES + 16
DTYPE_PAIRS = ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32))  # (params, communication)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def workloads(scale: int) -> dict[str, Workload]:
    """The workloads, every dimension of the big ones divided by ``scale`` (1 on GPU)."""
    hidden, ffn = 4096 // scale, 11008 // scale
    big = 2**27 // scale**2  # 2**27 elements: 512 MB in float32
    return {
        "llama7b-layer": Workload(  # q, k, v, o, gate, up, down, two RMSNorm weights
            "Llama-7B decoder layer (9 params)",
            ((hidden, hidden),) * 4 + ((ffn, hidden),) * 2 + ((hidden, ffn),) + ((hidden,),) * 2,
        ),
        "small-300": Workload("300 params of 4K elements", ((64, 64),) * 300),
        "one-512mb": Workload(f"one {big * 4 / 2**20:g} MB (fp32) param", ((big // 8192, 8192),)),
    }


# ------------------------------------------------------------------------------- quantized ops
QUANTIZED_OPS = ("quantized all_gather copy-in", "quantized all_gather copy-out", "quantized reduce_scatter copy-in",
                 "quantized reduce_scatter copy-out")
QUANTIZED_BLOCK = 256


def quantized_case(workload: Workload, world_size: int, fmt: str,
                   device: torch.device) -> tuple[QuantizedLayout, dict[str, tuple[Callable[[], object], int]]]:
    """The four quantized ops as the runtime calls them (``overlap.Compression(gather=fmt, reduce=fmt)``
    under mixed precision: fp32 shards gathered into bf16 parameters, bf16 gradients reduced into fp32
    sharded gradients), each with the bytes it reads and writes (padding codes included, as the
    kernel touches them), and their quantized layout."""
    layout = ShardLayout(workload.shapes, world_size)
    qlayout = QuantizedLayout(layout, QUANTIZED_BLOCK, fmt)
    rank = 0
    fulls = [torch.randn(s, device=device) for s in workload.shapes]
    shards = [s.contiguous() for s in layout.shards(fulls, rank)]
    grads = [f.to(torch.bfloat16) for f in fulls]
    _, buffer = _quantized_copy_in(fulls, qlayout, None)  # every slot valid: finite scales
    outs = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in workload.shapes]
    shard_grads = [torch.empty(s, device=device) for s in layout.shard_shapes(rank)]
    shard_numel, full_numel = sum(s.numel() for s in shards), workload.numel
    return qlayout, {
        QUANTIZED_OPS[0]: (lambda: _quantized_copy_in(shards, qlayout, rank), 4 * shard_numel + qlayout.slot_bytes),
        QUANTIZED_OPS[1]: (lambda: _quantized_all_gather_copy_out(buffer, qlayout, outs),
                           qlayout.buffer_bytes + 2 * full_numel),
        QUANTIZED_OPS[2]: (lambda: _quantized_copy_in(grads, qlayout, None), 2 * full_numel + qlayout.buffer_bytes),
        QUANTIZED_OPS[3]: (lambda: _quantized_reduce_scatter_copy_out(buffer, shard_grads, qlayout, rank,
                                                                      1.0 / world_size, False),
                           qlayout.buffer_bytes + 4 * shard_numel),
    }


def quantized_rows(names: Sequence[str], chosen: dict[str, Workload], world_size: int, device: torch.device,
                   timer: Callable[[Callable[[], object]], tuple[float, float, float]],
                   num_warps: Sequence[int] = (0,), vector_path: Sequence[str] = ("on",),
                   blocks_per_program: Sequence[int] = (0,)) -> list[list[object]]:
    """GB/s of each quantized op against a plain device copy of the same bytes (issue 30's goal: at
    least 0.85x a copy on large workloads, on CUDA), for each of ``num_warps`` (CUDA programs' warps,
    0: the runtime's choice), ``vector_path`` ("on"/"off": [Note: the aligned full-block path]) and
    ``blocks_per_program`` (0: the runtime's choice; [Note: several blocks per program])."""
    rows: list[list[object]] = []
    settings = ("NUM_WARPS", "VECTOR_PATH", "BLOCKS_PER_PROGRAM")
    defaults = [getattr(quantized_layout, k) for k in settings]
    for name in names:
        for fmt in ("int8", "fp8"):
            qlayout, case = quantized_case(chosen[name], world_size, fmt, device)
            for op, (fn, nbytes) in case.items():
                copy_ms = timer(plain_copy(nbytes, device))[0]
                copy_device = device_time(plain_copy(nbytes, device), device)
                for warps, vector, per_program in itertools.product(num_warps, vector_path, blocks_per_program):
                    for k, v in zip(settings, (warps or None, vector == "on", per_program or None)):
                        setattr(quantized_layout, k, v)
                    try:
                        fn()  # builds this choice's segment table outside the timing
                        chosen_per_program = qlayout.blocks_per_program()
                        ms, lo, hi = timer(fn)
                        on_device = device_cells(device_time(fn, device), copy_device) if device.type == "cuda" else []
                    finally:
                        for k, v in zip(settings, defaults):
                            setattr(quantized_layout, k, v)
                    rows.append([chosen[name].name, fmt, op, warps or "auto", vector,
                                 per_program or f"auto ({chosen_per_program})", round(nbytes / 1e6, 1),
                                 f"{ms:.3f} ({lo:.3f}-{hi:.3f})", nbytes / (ms * 1e6), nbytes / (copy_ms * 1e6),
                                 copy_ms / ms, *on_device])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ timers
DeviceTime = tuple[float, float, float] | str | None
"""``(median, p20, p80)`` ms; ``None``: no device time (CPU, or the op waits for the GPU); a string:
the timer's error, kept in the table."""


def device_time(fn: Callable[[], object], device: torch.device) -> DeviceTime:
    """``fn``'s time on the GPU with its host time hidden ([Note: device time vs wall time] in
    ``overlap.testing.device_time``)."""
    if device.type != "cuda":
        return None
    try:
        return device_ms(fn, device)
    except Exception as e:  # noqa: BLE001 -- a timer first run on a GPU machine: say so, keep the other tables
        return f"{type(e).__name__}: {e}"[:60]


def device_cells(timed: DeviceTime, *references: DeviceTime) -> list[object]:
    """A CUDA row's device cells: the op's device ms (p20-p80), then each reference's median over the
    op's (``"-"`` where one has no device time)."""
    if not isinstance(timed, tuple):
        return [f"- ({timed or 'waits for the GPU'})", *["-"] * len(references)]
    ms, lo, hi = timed
    return [f"{ms:.4f} ({lo:.4f}-{hi:.4f})", *(r[0] / ms if isinstance(r, tuple) else "-" for r in references)]


def time_cuda(fn: Callable[[], object]) -> tuple[float, float, float]:
    import triton.testing

    median, p20, p80 = triton.testing.do_bench(fn, quantiles=QUANTILES)
    return median, p20, p80


def time_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Median, 20th and 80th percentile of ``repeats`` timed calls, in ms (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    cuts = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return statistics.median(samples), cuts[1], cuts[7]


# ---------------------------------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    """Tensors for the four ops on rank ``rank``, and their fused, torch and plain-copy callables."""

    layout: ShardLayout
    rank: int
    param_dtype: torch.dtype
    comm_dtype: torch.dtype
    fused: dict[str, Callable[[], object]]
    runtime: dict[str, Callable[[], object]]  # the launchers the runtime calls (no argument checks)
    runtime_before: dict[str, Callable[[], object]]  # the same before the runtime owned its lists
    torch_path: dict[str, Callable[[], object]]
    nbytes: dict[str, int]


def build_case(workload: Workload, world_size: int, rank: int, param_dtype: torch.dtype,
               comm_dtype: torch.dtype, device: torch.device) -> Case:
    layout = ShardLayout(workload.shapes, world_size)
    w, p_size, c_size = world_size, param_dtype.itemsize, comm_dtype.itemsize
    scale = 1.0 / world_size

    fulls = [torch.randn(s, device=device, dtype=param_dtype) for s in workload.shapes]
    shards = [s.contiguous() for s in layout.shards(fulls, rank)]
    flat_shards = [s.view(-1) for s in shards]
    shard_numels = [s.numel() for s in shards]
    ag_output = torch.randn(layout.buffer_numel, device=device).to(comm_dtype)
    # the unsharded parameters as the runtime holds them: views of one storage ([Note: packed placements])
    placement = _launch.PackedPlacement.of(workload.shapes, [param_dtype] * len(workload.shapes))
    out_data = torch.empty(placement.nbytes, dtype=torch.uint8, device=device)
    out_storage = out_data.untyped_storage()
    outs = placement.views(out_storage)  # each with a version counter of its own (as before)
    out_fill = placement.shared_views(out_data)  # one counter for all: what the runtime writes through
    owned_shards, owned_grads = prepared_launch.OwnedLists(), prepared_launch.OwnedLists()
    shard_dtypes = (param_dtype,) * len(shards)
    slot = torch.randn(layout.slot_numel, device=device).to(comm_dtype)
    shard_grads = [torch.zeros(s, device=device, dtype=param_dtype) for s in layout.shard_shapes(rank)]
    # new sharded gradients as the runtime makes them: views of one storage
    grad_placement = _launch.PackedPlacement.of(layout.shard_shapes(rank), [param_dtype] * len(shards))
    grad_data = torch.zeros(grad_placement.nbytes, dtype=torch.uint8, device=device)
    packed_grads = grad_placement.shared_views(grad_data)
    grad_storage = (grad_data.untyped_storage(), grad_placement)
    torch_shard_grads = [g.clone() for g in shard_grads]
    # lists of gradients at new addresses: views of one buffer, list k shifted by 16 k bytes
    fresh = _lists_at_new_addresses(layout, param_dtype, device)
    next_fresh = itertools.cycle(fresh).__next__

    fused = {
        NEW_ADDRESSES: lambda: overlap_kernels.reduce_scatter_copy_in(next_fresh(), layout, scale, comm_dtype),
        "all_gather_copy_in": lambda: overlap_kernels.all_gather_copy_in(shards, layout, rank, comm_dtype),
        "all_gather_copy_out": lambda: overlap_kernels.all_gather_copy_out(ag_output, layout, outs),
        "reduce_scatter_copy_in": lambda: overlap_kernels.reduce_scatter_copy_in(fulls, layout, scale, comm_dtype),
        "reduce_scatter_copy_out": lambda: overlap_kernels.reduce_scatter_copy_out(slot, shard_grads, layout, rank, scale, True),
    }
    runtime = {  # as overlap/param_group.py calls them: lists it owns ([Note: lists the runtime owns])
        "all_gather_copy_in": lambda: _all_gather_copy_in(shards, layout, rank, comm_dtype, shard_dtypes,
                                                          owned=owned_shards),
        "all_gather_copy_out": lambda: _all_gather_copy_out(ag_output, layout, out_fill,
                                                            packed=(out_storage, placement), versions=out_fill[:1]),
        "reduce_scatter_copy_in": lambda: _reduce_scatter_copy_in(fulls, layout, scale, comm_dtype,
                                                                  owned=owned_grads),
        "reduce_scatter_copy_out": lambda: _reduce_scatter_copy_out(slot, packed_grads, layout, rank, scale, False,
                                                                    packed=grad_storage, versions=packed_grads[:1]),
        INTO_EXISTING: lambda: _reduce_scatter_copy_out(slot, shard_grads, layout, rank, scale, True),
        NEW_ADDRESSES: lambda: _runtime_copy_in_read(next_fresh(), layout, scale, comm_dtype, owned_grads),
    }
    runtime_before = {  # the same before (b8a9964): each list guarded, each tensor's version bumped
        **runtime,
        "all_gather_copy_in": lambda: _all_gather_copy_in(shards, layout, rank, comm_dtype, shard_dtypes),
        "all_gather_copy_out": lambda: _all_gather_copy_out(ag_output, layout, outs, packed=(out_storage, placement)),
        "reduce_scatter_copy_in": lambda: _reduce_scatter_copy_in(fulls, layout, scale, comm_dtype),
        "reduce_scatter_copy_out": lambda: _reduce_scatter_copy_out(slot, packed_grads, layout, rank, scale, False,
                                                                    packed=grad_storage),
        NEW_ADDRESSES: lambda: _reduce_scatter_copy_in(next_fresh(), layout, scale, comm_dtype),
    }

    # FSDP2's unsharded parameters live in padded (world_size, padded shard) storages; with a cast, the
    # torch path then copies numel elements of each into the parameter (the bytes matter here, not
    # which elements)
    padded_outs = [torch.empty(w, n, device=device, dtype=comm_dtype) for n in layout.padded_numels]
    padded_views = [o.view(-1)[: math.prod(s)].view(s) for o, s in zip(padded_outs, workload.shapes)]
    on_meta = [torch.empty(s, device="meta", dtype=comm_dtype) for s in workload.shapes]
    chunk_cat_shape = torch._chunk_cat(on_meta, 0, w).shape
    div_out = torch.empty_like(slot)

    def torch_all_gather_copy_in() -> torch.Tensor:
        buffer = torch.empty(layout.buffer_numel, device=device, dtype=comm_dtype)
        regions = torch.split(buffer.view(w, -1)[rank], list(layout.padded_numels))
        torch._foreach_copy_([r[:n] for r, n in zip(regions, shard_numels)], flat_shards)
        return buffer

    def torch_all_gather_copy_out() -> None:
        torch.split_with_sizes_copy(ag_output.view(w, -1), list(layout.padded_numels), dim=1, out=padded_outs)
        if param_dtype != comm_dtype:
            torch._foreach_copy_(outs, padded_views)

    def torch_reduce_scatter_copy_in() -> torch.Tensor:
        grads = fulls if param_dtype == comm_dtype else [g.to(comm_dtype) for g in fulls]
        buffer = torch.empty(chunk_cat_shape, device=device, dtype=comm_dtype)
        torch._chunk_cat(grads, 0, w, out=buffer)
        return buffer.div_(w)

    def torch_reduce_scatter_copy_out() -> None:
        torch.div(slot, w, out=div_out)
        views = [div_out[o : o + g.numel()].view(g.shape) for o, g in zip(layout.slot_offsets, torch_shard_grads)]
        torch._foreach_add_(torch_shard_grads, [v.to(param_dtype) for v in views])

    def torch_new_addresses() -> torch.Tensor:
        grads = next_fresh()
        if param_dtype != comm_dtype:
            grads = [g.to(comm_dtype) for g in grads]
        buffer = torch.empty(chunk_cat_shape, device=device, dtype=comm_dtype)
        torch._chunk_cat(grads, 0, w, out=buffer)
        return buffer.div_(w)

    torch_path = {
        NEW_ADDRESSES: torch_new_addresses,
        "all_gather_copy_in": torch_all_gather_copy_in,
        "all_gather_copy_out": torch_all_gather_copy_out,
        "reduce_scatter_copy_in": torch_reduce_scatter_copy_in,
        "reduce_scatter_copy_out": torch_reduce_scatter_copy_out,
    }
    shard_numel, full_numel = sum(shard_numels), workload.numel
    nbytes = {
        "all_gather_copy_in": shard_numel * (p_size + c_size),
        "all_gather_copy_out": full_numel * (c_size + p_size),
        "reduce_scatter_copy_in": full_numel * (p_size + c_size),
        "reduce_scatter_copy_out": shard_numel * (c_size + 2 * p_size),
    }
    return Case(layout, rank, param_dtype, comm_dtype, fused, runtime, runtime_before, torch_path, nbytes)


def _lists_at_new_addresses(layout: ShardLayout, dtype: torch.dtype, device: torch.device) -> list[list[torch.Tensor]]:
    """``NEW_ADDRESS_LISTS`` lists of contiguous tensors of ``layout.shapes``, each tensor 16-byte
    aligned, every list at addresses of its own: views of one buffer of zeros (overlapping: only
    read; one workload's bytes on the device, not one per list), list ``k`` shifted by ``16 k``
    bytes."""
    placement = _launch.PackedPlacement.of(layout.shapes, [dtype] * len(layout.shapes))
    base = torch.zeros(placement.nbytes // dtype.itemsize + NEW_ADDRESS_LISTS * 16, dtype=dtype, device=device)
    strided = placement._strided
    return [[base.as_strided(shape, stride, (16 * k + offset) // dtype.itemsize)
             for shape, stride, offset in zip(placement.shapes, strided.strides, placement.byte_offsets)]
            for k in range(NEW_ADDRESS_LISTS)]


def _runtime_copy_in_read(grads: list[torch.Tensor], layout: ShardLayout, scale: float, dtype: torch.dtype,
                          owned: prepared_launch.OwnedLists) -> torch.Tensor:
    """The reduce-scatter copy-in as ``ParamGroup.issue_reduce`` calls it: the gradients' dtypes read
    (one pass, which also picks the reduce dtype there) and handed in."""
    return _reduce_scatter_copy_in(grads, layout, scale, dtype, native_passes.dtypes(grads, build=False), owned=owned)


def plain_copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A device copy that reads ``nbytes / 2`` bytes and writes as many."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def path_label(device: torch.device) -> str:
    if device.type == "cuda":
        return "CUDA, Triton kernels" if _launch.triton_enabled(device) else "CUDA, torch path (TRITON_INTERPRET set)"
    if _launch.triton_enabled(device):
        return "CPU, Triton interpreter (debug only: not performance figures)"
    return "CPU, torch fallback path (no Triton; not GPU results)"


# ------------------------------------------------------------------------------------- host table
HOST_CALLS = 100  # back-to-back calls per sample
HOST_SAMPLES = 7
HOST_ROUNDS = 15  # interleaved rounds of the side-by-side host table


def host_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median over ``HOST_SAMPLES`` of the host µs per call of ``HOST_CALLS`` back-to-back calls
    (after a warm-up call; on CUDA the device is synchronized between samples, never inside one)."""
    fn()
    samples = []
    for _ in range(HOST_SAMPLES):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        samples.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
    return statistics.median(samples)


def host_us_side_by_side(fns: dict[str, Callable[[], object]], device: torch.device,
                         rounds: int = HOST_ROUNDS) -> dict[str, float]:
    """Host µs per call of each of ``fns``, timed in interleaved rounds (the order rotated each round)
    of ``HOST_CALLS`` back-to-back calls after a warm-up call each. On CPU: the fastest round's
    thread CPU time (a loaded box slows some rounds, never speeds one up); on CUDA: the median
    round's wall time, the device synchronized between rounds, never inside one. A name ending in
    ``UNCACHED`` runs under ``prepared_launch.uncached()`` (the path before prepared launches), one
    ending in ``PYTHON_PASSES`` under ``native_passes.python_passes()`` ([Note: native passes])."""
    def run(name: str) -> None:
        with _mode(name):
            for _ in range(HOST_CALLS):
                fns[name]()

    names = list(fns)
    for name in names:
        with _mode(name):
            fns[name]()
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            run(name)
            samples[name].append((clock() - start) / HOST_CALLS * 1e6)
    pick = statistics.median if device.type == "cuda" else min
    return {name: pick(v) for name, v in samples.items()}


UNCACHED = " (uncached)"
PYTHON_PASSES = " (Python passes)"


def _mode(name: str) -> contextlib.AbstractContextManager:
    if name.endswith(UNCACHED):
        return prepared_launch.uncached()
    return native_passes.python_passes() if name.endswith(PYTHON_PASSES) else contextlib.nullcontext()


def host_target_us(num_params: int) -> float:
    """Issue 28's target for the host side of one op over ``num_params`` parameters."""
    return 15 + 0.05 * num_params


HOST_HEADER = ["workload", "params", "op", "public µs, uncached", "public µs, Python passes", "public µs",
               "runtime launcher µs, uncached", "runtime launcher µs, before (b8a9964)",
               "runtime launcher µs, Python passes", "runtime launcher µs", "torch path µs",
               "target µs (15 + 0.05/param)", "public / target", "runtime / target"]


def host_rows(names: Sequence[str], world_size: int, device: torch.device) -> list[list[object]]:
    """Host µs per call of each op (public, runtime launcher, each with and without prepared launches:
    ``host_us_side_by_side``; torch path on CUDA), full-size shapes on the first dtype pair; on CPU
    the kernel launch is stubbed out."""
    rows: list[list[object]] = []
    param_dtype, comm_dtype = DTYPE_PAIRS[0]
    for name in names:
        # on CPU the kernel never runs, so the shapes only need to exist: scaled down for memory
        workload = workloads(1 if device.type == "cuda" else 64)[name]
        case = build_case(workload, world_size, 0, param_dtype, comm_dtype, device)
        target = host_target_us(case.layout.num_params)
        for op in (*OPS, INTO_EXISTING, NEW_ADDRESSES):
            plain_op = "reduce_scatter_copy_out" if op == INTO_EXISTING else op
            fns = {"public" + UNCACHED: case.fused[plain_op], "public" + PYTHON_PASSES: case.fused[plain_op],
                   "public": case.fused[plain_op], "runtime" + UNCACHED: case.runtime[op],
                   "runtime before": case.runtime_before[op], "runtime" + PYTHON_PASSES: case.runtime[op],
                   "runtime": case.runtime[op]}
            if device.type == "cuda":
                us = host_us_side_by_side({**fns, "torch": case.torch_path[plain_op]}, device)
            else:
                with _launch.launches_stubbed() as launched:
                    us = host_us_side_by_side(fns, device)
                assert launched[0] > 0, "the Triton path was not taken"
            rows.append([workload.name, case.layout.num_params, op, us["public" + UNCACHED],
                         us["public" + PYTHON_PASSES], us["public"], us["runtime" + UNCACHED], us["runtime before"],
                         us["runtime" + PYTHON_PASSES], us["runtime"], us.get("torch", "-"), target,
                         us["public"] / target, us["runtime"] / target])
        del case
    return rows


QUANTIZED_NEW_ADDRESSES = "quantized reduce_scatter copy-in, gradients at new addresses"
"""Quantized host table only: every call packs another list of gradients at addresses of its own, as
the runtime's gradients come on CPU at every step (``NEW_ADDRESS_LISTS`` lists, more than a role keeps:
``overlap_kernels.quantized_layout.pointer_table``)."""
QUANTIZED_HOST_HEADER = ["workload", "params", "format", "op", "µs, Python passes", "µs",
                         "target µs (15 + 0.05/param)", "µs / target"]


def quantized_host_rows(names: Sequence[str], world_size: int, device: torch.device,
                        cuda_scale: int = 1) -> list[list[object]]:
    """Host µs per call of the four quantized ops as the runtime calls them (``quantized_case``),
    int8 and fp8, with the Python passes and as they run, beside issue 28's target (they are the
    runtime's packing path under ``overlap.Compression``); on CPU the kernel launch is stubbed out.
    Workloads divided by ``cuda_scale`` on CUDA (the GB/s tables' scale: the host side does not
    depend on the bytes), by 64 on CPU (only the shapes need to exist)."""
    rows: list[list[object]] = []
    for name in names:
        workload = workloads(cuda_scale if device.type == "cuda" else 64)[name]
        target = host_target_us(len(workload.shapes))
        for fmt in ("int8", "fp8"):
            qlayout, case = quantized_case(workload, world_size, fmt, device)  # built on the path it will run
            fns = {op: fn for op, (fn, _) in case.items()}
            # the reduction's copy-in as on CPU at every step: gradients at new addresses (a table moved)
            next_fresh = itertools.cycle(_lists_at_new_addresses(qlayout.layout, torch.bfloat16, device)).__next__
            fns[QUANTIZED_NEW_ADDRESSES] = lambda: _quantized_copy_in(next_fresh(), qlayout, None)
            fns.update({op + PYTHON_PASSES: fn for op, fn in fns.items()})
            if device.type == "cuda":
                us = host_us_side_by_side(fns, device)
            else:
                with _launch.launches_stubbed() as launched:
                    us = host_us_side_by_side(fns, device)
                assert launched[0] > 0, "the Triton path was not taken"
            rows += [[workload.name, len(workload.shapes), fmt, op, us[op + PYTHON_PASSES], us[op], target,
                      us[op] / target] for op in (*case, QUANTIZED_NEW_ADDRESSES)]
            del case
    return rows


# --------------------------------------------------------------------------- launch breakdown (CUDA)
BREAKDOWN = ["our preparation µs", "device tables + device context µs", "Triton JIT launch µs",
             "direct launch µs (runtime)", "compiled-kernel launcher alone µs"]


def launch_breakdown(fn: Callable[[], object], device: torch.device) -> list[object]:
    """Where a runtime launcher's host µs go on CUDA, each part timed alone as ``host_us`` does:

    * our preparation: the launcher with the launch stubbed out (the fingerprint checked, the
      prepared launch looked up: what the CPU table measures);
    * device tables + device context: the device index read, ``torch.cuda.device`` only when the
      device is not current (as the launch does), and ``table_memory.prepare`` of the
      captured call (stream-ordered table uses);
    * Triton JIT launch: ``kernel[grid](...)`` with the prepared arguments (Triton's ``JITFunction.run``:
      argument binding, specialization key, cache lookup, then the launch);
    * direct launch: what the runtime now calls instead, ``_compiled_launch.run`` (its cache key
      read from the arguments, then the compiled kernel's launcher: [Note: launching the compiled
      kernel]);
    * compiled-kernel launcher alone: the launcher called with the arguments Triton bound (the floor
      of any launch from Python).
    A part that cannot be timed with this Triton's internals is "-"."""
    with _launch.launches_stubbed():
        ours = host_us(fn, device)
    captured: list[_launch.KernelCall] = []
    original = _launch.KernelCall.launch

    def capture(call: _launch.KernelCall) -> None:
        captured.append(call)
        original(call)

    _launch.KernelCall.launch = capture  # type: ignore[method-assign]
    try:
        with prepared_launch.uncached():  # a prepared launch builds no KernelCall on a repeat
            fn()
    finally:
        _launch.KernelCall.launch = original  # type: ignore[method-assign]
    call = captured[0]
    blocks, pointers = call.blocks, call.pointers
    constexprs, options = _launch.launch_constexprs(blocks, pointers, call.constexprs), _launch.gpu_options(blocks)
    kwargs = {**constexprs, **options}
    grid = (blocks.num_blocks,)

    def tables() -> tuple[torch.Tensor, ...]:  # as ``_launch.cuda_launch``: the device context only when not current
        current = _compiled_launch.current_device_index() == device.index
        with contextlib.nullcontext() if current else torch.cuda.device(device):
            block_tensors, (pointer_tensor,) = _launch.table_memory.prepare((blocks.memory, pointers.memory), device)
        return (*block_tensors, pointer_tensor)

    arguments = (*tables(), *call.args)
    tables_us = host_us(tables, device)
    jit_us = host_us(lambda: call.kernel[grid](*arguments, **kwargs), device)
    direct_us = host_us(lambda: _compiled_launch.run(call.kernel, grid[0], arguments, constexprs, options), device)
    compiled_us: object = "-"
    compiled = call.kernel[grid](*arguments, **kwargs)  # JITFunction.run returns the compiled kernel
    if compiled is not None and hasattr(compiled, "_run"):
        run = compiled.run
        recorded: list[tuple[object, ...]] = []
        compiled._run = lambda *a: (recorded.append(a), run(*a))
        try:
            call.kernel[grid](*arguments, **kwargs)
        finally:
            compiled._run = run
        if recorded:
            compiled_us = host_us(lambda: run(*recorded[0]), device)
    return [ours, tables_us, jit_us, direct_us, compiled_us]


def profile_launch(fn: Callable[[], object], calls: int = 300, top: int = 12) -> str:
    """The ``top`` functions by own time over ``calls`` back-to-back calls of ``fn`` under cProfile,
    µs per call each (the profiler adds its own cost per function call: read the ranking, not the
    sum; the breakdown table has the unprofiled times)."""
    import cProfile
    import pstats

    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, recursive calls, own s, cumulative s, callers)
    rows = sorted(((own, n, key) for key, (n, _, own, _, _) in stats.items()), reverse=True)[:top]
    return "\n".join(f"  {own / calls * 1e6:8.2f} µs  {n / calls:5.1f}x  {Path(key[0]).name}:{key[1]} {key[2]}"
                     for own, n, key in rows)


def breakdown_rows(names: Sequence[str], world_size: int, device: torch.device) -> list[list[object]]:
    """``launch_breakdown`` of each op's runtime launcher, shapes and dtypes as in ``host_rows``."""
    rows: list[list[object]] = []
    param_dtype, comm_dtype = DTYPE_PAIRS[0]
    for name in names:
        workload = workloads(1)[name]
        case = build_case(workload, world_size, 0, param_dtype, comm_dtype, device)
        for op in OPS:
            try:
                parts = launch_breakdown(case.runtime[op], device)
            except Exception as e:  # noqa: BLE001 -- Triton internals differ by version: say so, keep the rest
                parts = [f"{type(e).__name__}: {e}"[:60], *["-"] * (len(BREAKDOWN) - 1)]
            rows.append([workload.name, case.layout.num_params, op, *parts])
        del case
    return rows


# --------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> list[list[object]]:
    p = parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to run (default: cuda if available, else cpu)")
    add_world_size(p, default=8, help="world size of the layout; rank 0 is timed")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads (dimensions / 4 on CUDA, / 16 on CPU) and fewer CPU repeats")
    p.add_argument("--workload", action="append", choices=sorted(workloads(1)),
                   help="run only this workload (repeatable; default: all)")
    p.add_argument("--repeats", type=int, default=None, help="CPU timing repeats (default 30, 10 with --quick)")
    p.add_argument("--skip-gbps", action="store_true", help="only the host tables")
    p.add_argument("--quantized-num-warps", type=int, nargs="+", default=[0],
                   help="warps per program of the quantized kernels to time, each a row (CUDA; 0, the default: "
                        "the runtime's choice, overlap_kernels.quantized_layout.warps_per_block)")
    p.add_argument("--quantized-vector-path", choices=("on", "off"), nargs="+", default=["on"],
                   help="time the quantized kernels with their aligned full-block path on and/or off (default on)")
    p.add_argument("--quantized-blocks-per-program", type=int, nargs="+", default=[0],
                   help="quantization blocks per program of the quantized kernels to time, each a row (powers of "
                        "two; 0, the default: the runtime's choice, overlap_kernels.quantized_layout.blocks_per_program; "
                        "1: one block per program)")
    p.add_argument("--quantized-scale", type=int, default=None,
                   help="divide the quantized GB/s table's workload dimensions by this (default: the other "
                        "tables' scale; 1: full size, where a kernel outlasts its launch: issue 30's large workloads)")
    p.add_argument("--only-quantized", action="store_true", help="only the quantized table")
    p.add_argument("--profile-launch", action="store_true",
                   help="also print each runtime launcher's top functions by own time under cProfile (stdout only)")
    args = parse(p, argv)
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    if args.quantized_scale is not None and args.quantized_scale < 1:
        p.error(f"--quantized-scale must be >= 1, got {args.quantized_scale}")
    if any(n < 0 or n & (n - 1) for n in args.quantized_blocks_per_program):
        p.error(f"--quantized-blocks-per-program must be 0 or powers of two, got {args.quantized_blocks_per_program}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu)")

    scale = (4 if args.quick else 1) if device.type == "cuda" else (16 if args.quick else 4)
    repeats = args.repeats or (10 if args.quick else 30)

    def timer(fn: Callable[[], object]) -> tuple[float, float, float]:
        return time_cuda(fn) if device.type == "cuda" else time_cpu(fn, repeats)

    chosen = workloads(scale)
    names = args.workload or list(chosen)
    scaled = f"dimensions / {scale}" if scale > 1 else "full size"

    def quantized_table() -> list[list[object]]:
        q_scale = args.quantized_scale or scale
        rows = quantized_rows(names, workloads(q_scale), args.world_size, device, timer, args.quantized_num_warps,
                              args.quantized_vector_path, args.quantized_blocks_per_program)
        emit(f"Quantized packing ops (overlap.Compression, block {QUANTIZED_BLOCK}; fp32 shards -> bf16 parameters, "
             f"bf16 gradients -> fp32 sharded gradients) vs plain copy — {path_label(device)}; world size "
             f"{args.world_size}, rank 0; workloads {f'dimensions / {q_scale}' if q_scale > 1 else 'full size'}",
             ["workload", "format", "op", "warps", "vector path", "blocks/program", "MB", "ms (p20-p80)", "GB/s",
              "copy GB/s", "vs copy", *(["device ms (p20-p80)", "vs copy, device"] if device.type == "cuda" else [])], rows,
             args.markdown)
        return rows

    if args.only_quantized:
        return quantized_table()
    host = host_rows(names, args.world_size, device)
    host_where = ("CUDA, back-to-back calls, no sync; median round's wall time" if device.type == "cuda"
                  else "CPU, Triton path with the kernel launch stubbed out (host preparation only); fastest "
                       "round's thread CPU time")
    emit(f"Packing ops, host µs per call, uncached (before prepared launches), with the Python passes and as they run "
         f"(native passes: {native_passes.status()}) side by side — {host_where}; "
         f"{HOST_ROUNDS} interleaved rounds of {HOST_CALLS} calls; world size {args.world_size}, rank 0, "
         f"{short(DTYPE_PAIRS[0][0])} params / {short(DTYPE_PAIRS[0][1])} comm",
         HOST_HEADER, host, args.markdown)
    emit(f"Quantized packing ops (overlap.Compression, block {QUANTIZED_BLOCK}), host µs per call as the runtime "
         f"calls them, with the Python passes and as they run (native passes: {native_passes.status()}) — "
         f"{host_where}; {HOST_ROUNDS} interleaved rounds of {HOST_CALLS} calls; world size {args.world_size}, rank 0",
         QUANTIZED_HOST_HEADER, quantized_host_rows(names, args.world_size, device, scale), args.markdown)
    if device.type == "cuda" and _launch.triton_enabled(device):
        emit(f"Packing ops, where the runtime launcher's host µs go — CUDA, each part timed alone, back-to-back "
             f"calls; world size {args.world_size}, rank 0; median of {HOST_SAMPLES} x {HOST_CALLS} calls",
             ["workload", "params", "op", *BREAKDOWN], breakdown_rows(names, args.world_size, device), args.markdown)
    if args.profile_launch:
        for name in names:
            case = build_case(workloads(1 if device.type == "cuda" else 64)[name], args.world_size, 0,
                              *DTYPE_PAIRS[0], device)
            for op in OPS:
                with _launch.launches_stubbed() if device.type == "cpu" else contextlib.nullcontext():
                    print(f"{name} {op}, runtime launcher, own time per call:\n{profile_launch(case.runtime[op])}")
            del case
    if args.skip_gbps:
        return host
    header = ["workload", "params/comm", "op", "MB", "fused ms (p20-p80)", "fused GB/s", "torch GB/s",
              "copy GB/s", "fused/copy", "fused speed-up vs torch"]
    if device.type == "cuda":
        header += ["fused device ms (p20-p80)", "fused/copy, device"]
    rows: list[list[object]] = []
    for name in names:
        workload = chosen[name]
        for param_dtype, comm_dtype in DTYPE_PAIRS:
            case = build_case(workload, args.world_size, 0, param_dtype, comm_dtype, device)
            for op in OPS:
                nbytes = case.nbytes[op]
                fused_ms, fused_lo, fused_hi = timer(case.fused[op])
                torch_ms = timer(case.torch_path[op])[0]
                copy_ms = timer(plain_copy(nbytes, device))[0]
                gbps = [nbytes / (ms * 1e6) for ms in (fused_ms, torch_ms, copy_ms)]
                rows.append([
                    workload.name, f"{short(param_dtype)}/{short(comm_dtype)}", op, round(nbytes / 1e6, 1),
                    f"{fused_ms:.3f} ({fused_lo:.3f}-{fused_hi:.3f})", *gbps, copy_ms / fused_ms, torch_ms / fused_ms,
                    *(device_cells(device_time(case.fused[op], device), device_time(plain_copy(nbytes, device), device))
                      if device.type == "cuda" else []),
                ])
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()

    title = (f"Packing kernels: fused vs FSDP2's torch path vs plain copy — {path_label(device)}; "
             f"world size {args.world_size}, rank 0; workloads {scaled}")
    emit(title, header, rows, args.markdown)
    quantized_table()
    return rows


if __name__ == "__main__":
    main()
