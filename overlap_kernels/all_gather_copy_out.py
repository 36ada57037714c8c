"""all_gather_copy_out: unpack the gathered buffer into the N full parameters (one launch).

Contract: ``outs = all_gather_copy_out(ag_output, layout, outs, dtype)`` writes, for every rank ``r``
and parameter ``i``, slot ``r``'s shard ``i`` into rows ``layout.shard_rows(i, r)`` of ``outs[i]``,
casting to each out's dtype and dropping the padding. ``outs=None`` allocates them (dtype ``dtype``,
default ``ag_output.dtype``); given ``outs`` are written in place (and must have ``dtype`` if it is
given; otherwise each may have its own). ``ag_output`` is only read.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``ag_output``           ``buffer_numel`` elements, contiguous  any supported
``outs[i]`` (out)       ``layout.shapes[i]``, contiguous       any supported, mixed allowed
======================  =====================================  =================================

This module is the op's one home: the Triton kernel, the argument checks (``_check``), the public
function, ``torch.ops.overlap.all_gather_copy_out`` (custom op and fake, [Note: why custom_op and not
triton_op] in ``overlap_kernels.library``), ``_all_gather_copy_out`` (the op without argument checks, for
the runtime, which builds every argument from the layout: wrong arguments there are undefined
behaviour, the kernel writes through raw addresses), the torch fallback and the pure-torch reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from overlap_kernels import _checks, _launch, _torch_fallback, library, prepared_launch
from overlap_kernels._device_function import device_function
from overlap_kernels._jit import block_run, scalar_lanes, store_as, vector_lanes
from overlap_kernels.layout import ShardLayout

OP = "all_gather_copy_out"


# ------------------------------------------------------------------------------------------- kernel
@device_function
def _copy_out(
    src, offs, addr, group, dst_start, mask,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    x = tl.load(src + offs, mask=mask)
    store_as(addr, group, dst_start, offs, x, mask, DT0, DT1, DT2, DT3, NUM_GROUPS, ALIGNED)


@triton.jit
def _all_gather_copy_out_kernel(
    blocks_ptr, runs_ptr, pointers_ptr, buffer_ptr,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr,
    NUM_GROUPS: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    addr, group, dst_start, src_start, n_valid, _, aligned = block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    src = buffer_ptr + src_start
    if n_valid >= BLOCK:
        if aligned:  # [Note: alignment per run], [Note: per-thread width]
            _copy_out(src, vector_lanes(BLOCK, VEC), addr, group, dst_start, None, DT0, DT1, DT2, DT3, NUM_GROUPS, True)
        else:
            for i in range(0, BLOCK, CHUNK):
                _copy_out(src + i, scalar_lanes(CHUNK), addr, group, dst_start + i, None,
                          DT0, DT1, DT2, DT3, NUM_GROUPS, False)
    else:
        for i in range(0, BLOCK, CHUNK):
            offs = scalar_lanes(CHUNK)
            _copy_out(src + i, offs, addr, group, dst_start + i, offs < n_valid - i,
                      DT0, DT1, DT2, DT3, NUM_GROUPS, False)


# -------------------------------------------------------------------- checks, API, torch.library op
def _check(ag_output: torch.Tensor, layout: ShardLayout, outs: Sequence[torch.Tensor] | None,
           dtype: torch.dtype | None) -> tuple[torch.dtype, ...] | None:
    """Each of ``outs``' dtypes in order (the launch's pointer-table key), None without ``outs``."""
    device = _check_scalars(ag_output, layout, dtype)
    if outs is not None:
        _, ordered, dtypes = _checks.check_tensors(OP, "outs", outs, layout.shapes, device, writable=True)
        if dtype is not None and dtypes != {dtype}:
            i = next(i for i, out in enumerate(outs) if out.dtype != dtype)
            raise TypeError(f"{OP}: outs[{i}] has dtype {outs[i].dtype}, expected dtype={dtype}")
        return ordered
    return None


def _check_scalars(ag_output: torch.Tensor, layout: ShardLayout, dtype: torch.dtype | None) -> torch.device:
    """``_check``'s rules that read no ``outs`` (O(1)); returns ``ag_output``'s device."""
    _checks.check_layout(OP, layout)
    device = _checks.check_flat(OP, "ag_output", ag_output, layout.buffer_numel, None)
    if dtype is not None:
        _checks.check_dtype(OP, "dtype", dtype)
    return device


def _allocate(ag_output: torch.Tensor, layout: ShardLayout, dtype: torch.dtype | None) -> list[torch.Tensor]:
    dtype = dtype or ag_output.dtype
    return [torch.empty(shape, dtype=dtype, device=ag_output.device) for shape in layout.shapes]


def all_gather_copy_out(
    ag_output: torch.Tensor,
    layout: ShardLayout,
    outs: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Scatter the gathered ``ag_output`` into full parameters (``outs``, or new tensors); returns them."""
    fingerprint = None
    if outs is not None and not library.dispatch_active():
        device = _check_scalars(ag_output, layout, dtype)
        # [Note: prepared launches]: a list seen before passes its guard, and the checks' result holds
        fingerprint = prepared_launch.find(layout, (OP, "public", device, dtype), outs)
    if fingerprint is None:
        ordered = _check(ag_output, layout, outs, dtype)
        outs = _allocate(ag_output, layout, dtype) if outs is None else list(outs)
        if library.use_dispatcher([ag_output, *outs]):
            library.check_compiled_views(OP, "outs", outs)
            torch.ops.overlap.all_gather_copy_out(ag_output, list(layout.spec), outs)
            return outs
        fingerprint = prepared_launch.remember(layout, (OP, "public", ag_output.device, dtype), outs, ordered)
        if fingerprint is None:
            _all_gather_copy_out(ag_output, layout, outs, ordered)
            return outs
    outs = list(outs)
    _all_gather_copy_out(ag_output, layout, outs, fingerprint=fingerprint)
    return outs


@torch.library.custom_op("overlap::all_gather_copy_out", mutates_args=("outs",), tags=library.CUDAGRAPH_UNSAFE_TAGS)
def _all_gather_copy_out_op(ag_output: torch.Tensor, layout_spec: list[int], outs: list[torch.Tensor]) -> None:
    layout = library.layout(layout_spec)
    _all_gather_copy_out(ag_output, layout, outs, _check(ag_output, layout, outs, None))


@_all_gather_copy_out_op.register_fake
def _(ag_output, layout_spec, outs):
    _check(ag_output, library.layout(layout_spec), outs, None)


# ------------------------------------------------------------------------------------------- launch
def _all_gather_copy_out(ag_output: torch.Tensor, layout: ShardLayout, outs: Sequence[torch.Tensor],
                         dtypes: tuple[torch.dtype, ...] | None = None,
                         packed: tuple[torch.UntypedStorage, _launch.PackedPlacement] | None = None,
                         fingerprint: prepared_launch.Fingerprint | None = None,
                         versions: Sequence[torch.Tensor] | None = None) -> None:
    """The op on checked arguments (``outs`` given; ``dtypes``: their own, in order, when the checks
    read them; ``packed``: ``(storage, placement)`` when ``outs`` are ``placement.views(storage)``
    or views of it at the same offsets, shapes and dtypes, which keys the launch on the storage,
    O(1): [Note: packed placements] in ``overlap_kernels._launch``; ``fingerprint``: the one the public op
    found ``outs`` to match; ``versions``: tensors whose version counters are all of ``outs``'
    (``None``: ``outs``; one view for views sharing one counter, ``PackedPlacement.shared_views``)):
    the kernel, or the torch fallback. The launch is a prepared one ([Note: prepared launches] in
    ``overlap_kernels.prepared_launch``) unless ``outs`` cannot be fingerprinted."""
    if not _launch.triton_enabled(ag_output.device):
        with torch.no_grad():  # like the kernel: writes behind autograd (the version still bumps)
            _all_gather_copy_out_torch(ag_output, layout, outs)
        return
    if packed is not None:
        prepared_launch.launch_packed(layout, (OP, "packed"), packed[0], packed[1], ag_output,
                                      lambda: _kernel_call(ag_output, layout, outs, dtypes, packed))
    elif not prepared_launch.launch_list(layout, (OP, "runtime"), outs, ag_output,
                                         lambda ordered: _kernel_call(ag_output, layout, outs, ordered), fingerprint):
        _kernel_call(ag_output, layout, outs, dtypes).launch()
    _launch.increment_version(outs if versions is None else versions)


def _kernel_call(ag_output: torch.Tensor, layout: ShardLayout, outs: Sequence[torch.Tensor],
                 dtypes: tuple[torch.dtype, ...] | None = None,
                 packed: tuple[torch.UntypedStorage, _launch.PackedPlacement] | None = None) -> _launch.KernelCall:
    """The launch that scatters ``ag_output`` into ``outs`` (contiguous)."""
    return _launch.kernel_call(_all_gather_copy_out_kernel, layout, None, False, outs, (ag_output,), {},
                               dtypes=dtypes, packed=packed)


# ------------------------------------------------------------------------------ fallback, reference
def _all_gather_copy_out_torch(ag_output: torch.Tensor, layout: ShardLayout, outs: Sequence[torch.Tensor]) -> None:
    """The op without Triton: one ``_foreach_copy_`` of buffer views into views of ``outs``, at most
    two per parameter (full ranks, short rank); bitwise equal to ``all_gather_copy_out_ref``, which
    it runs instead when it would cast a NaN ([Note: torch fallback] in ``overlap_kernels._torch_fallback``)."""
    if any(o.dtype != ag_output.dtype for o in outs) and _torch_fallback.has_nan(ag_output):
        all_gather_copy_out_ref(ag_output, layout, outs)
        return
    plan = _torch_fallback.torch_plan(layout, None)
    _torch_fallback.foreach_copy(_torch_fallback.param_views(outs, plan.pieces),
                                 _torch_fallback.buffer_views(ag_output, plan))


def all_gather_copy_out_ref(
    ag_output: torch.Tensor,
    layout: ShardLayout,
    outs: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Plain-torch reference of ``all_gather_copy_out``, one copy per rank and parameter: what the kernel and
    the torch fallback (``_all_gather_copy_out_torch``, bitwise) are tested against."""
    outs = _allocate(ag_output, layout, dtype) if outs is None else list(outs)
    slots = ag_output.reshape(layout.world_size, layout.slot_numel)
    for r in range(layout.world_size):
        for i, (out, offset) in enumerate(zip(outs, layout.slot_offsets)):
            shard = layout.shard(out, r)
            shard.copy_(slots[r, offset : offset + shard.numel()].view(shard.shape))
    return outs
