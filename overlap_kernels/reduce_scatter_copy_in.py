"""reduce_scatter_copy_in: pack N full gradients into the reduce-scatter input, rank-major (one launch).

Contract: ``rs_input = reduce_scatter_copy_in(grads, layout, pre_scale, dtype)`` allocates
``buffer_numel`` elements of ``dtype`` (default: the grads'); viewed as ``(world_size, slot_numel)``,
row ``r`` is rank ``r``'s slot: the rows ``layout.shard_rows(i, r)`` of every ``grads[i]``, multiplied
by ``pre_scale`` (if given, in float32 — float64 when a float64 tensor is involved — with the scale
rounded to float32), cast to ``dtype``, at ``slot_offsets[i]``, zeros in all padding. One pass
replaces FSDP2's ``_chunk_cat`` + divide + cast. ``grads`` are only read.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``grads[i]``            ``layout.shapes[i]``                   any supported, mixed allowed
``rs_input`` (out)      ``(world_size * slot_numel,)``         ``dtype``
======================  =====================================  =================================

This module is the op's one home: the Triton kernel, the argument checks (``_check``), the public
function, ``torch.ops.overlap.reduce_scatter_copy_in`` (custom op and fake, [Note: why custom_op and
not triton_op] in ``overlap_kernels.library``), ``_reduce_scatter_copy_in`` (the op without argument checks,
for the runtime, which builds every argument from the layout: wrong arguments there are undefined
behaviour, the kernel reads raw addresses), the torch fallback and the pure-torch reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from overlap_kernels import _checks, _launch, _torch_fallback, library, prepared_launch
from overlap_kernels._device_function import device_function
from overlap_kernels._dtypes import as_float32, compute_dtype
from overlap_kernels._jit import block_run, convert, load_as, scalar_lanes, vector_lanes
from overlap_kernels.layout import ShardLayout

OP = "reduce_scatter_copy_in"


# ------------------------------------------------------------------------------------------- kernel
@device_function
def _pack(
    addr, group, src_start, offs, dst, mask, other, store_mask, scale,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    COMPUTE: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr,
):
    OUT: tl.constexpr = dst.dtype.element_ty
    if HAS_SCALE:
        x = load_as(addr, group, src_start, offs, mask, other, DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, ALIGNED) * scale
        if mask is not None:
            x = tl.where(mask, x, 0)  # padding stays 0 whatever the scale
        tl.store(dst + offs, convert(x, OUT), mask=store_mask)
    else:
        x = load_as(addr, group, src_start, offs, mask, other, DT0, DT1, DT2, DT3, NUM_GROUPS, OUT, ALIGNED)
        tl.store(dst + offs, x, mask=store_mask)


@triton.jit
def _reduce_scatter_copy_in_kernel(
    blocks_ptr, runs_ptr, pointers_ptr, buffer_ptr, scale,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr,
    NUM_GROUPS: tl.constexpr, COMPUTE: tl.constexpr, HAS_SCALE: tl.constexpr,
    VEC: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    addr, group, src_start, dst_start, n_valid, n_total, aligned = block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    dst = buffer_ptr + dst_start
    if n_valid >= BLOCK:
        if aligned:  # [Note: alignment per run], [Note: per-thread width]
            _pack(addr, group, src_start, vector_lanes(BLOCK, VEC), dst, None, None, None, scale,
                  DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, True)
        else:
            for i in range(0, BLOCK, CHUNK):
                _pack(addr, group, src_start + i, scalar_lanes(CHUNK), dst + i, None, None, None, scale,
                      DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, False)
    else:  # the run's last block: gradient tail, then zero padding
        for i in range(0, BLOCK, CHUNK):
            offs = scalar_lanes(CHUNK)
            _pack(addr, group, src_start + i, offs, dst + i, offs < n_valid - i, 0, offs < n_total - i, scale,
                  DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, False)


# -------------------------------------------------------------------- checks, API, torch.library op
def _check(
    grads: Sequence[torch.Tensor], layout: ShardLayout, pre_scale: float | None, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype, tuple[torch.dtype, ...]]:
    """(device, buffer dtype, each grad's dtype in order: the launch's pointer-table key)."""
    _check_scalars(layout, pre_scale, dtype)
    device, ordered, dtypes = _checks.check_tensors(OP, "grads", grads, layout.shapes)
    if dtype is None:
        dtype = _checks.common_dtype(OP, "grads", dtypes)
        _checks.check_dtype(OP, "dtype", dtype)
    if pre_scale is not None:
        _checks.check_floating(OP, "pre_scale", {dtype} | dtypes)
    return device, dtype, ordered


def _check_scalars(layout: ShardLayout, pre_scale: float | None, dtype: torch.dtype | None) -> None:
    """``_check``'s rules that read no gradient (O(1))."""
    _checks.check_layout(OP, layout)
    _checks.check_scale(OP, "pre_scale", pre_scale)
    if dtype is not None:
        _checks.check_dtype(OP, "dtype", dtype)


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    pre_scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pack full ``grads`` rank-major into a new reduce-scatter input (scaled, cast); returns it."""
    _check_scalars(layout, pre_scale, dtype)
    config = (OP, "public", prepared_launch.scale_key(pre_scale), dtype)
    # [Note: prepared launches]: a list seen before passes its guard, and the checks' result holds
    fingerprint = None if library.dispatch_active() else prepared_launch.find(layout, config, grads)
    if fingerprint is None:
        _, dtype, ordered = _check(grads, layout, pre_scale, dtype)
        if library.use_dispatcher(grads):
            return torch.ops.overlap.reduce_scatter_copy_in(list(grads), list(layout.spec), pre_scale, dtype)
        fingerprint = prepared_launch.remember(layout, config, grads, ordered, dtype)
        if fingerprint is None:
            return _reduce_scatter_copy_in(grads, layout, pre_scale, dtype, ordered)
    return _reduce_scatter_copy_in(grads, layout, pre_scale, fingerprint.checked, fingerprint=fingerprint)


@torch.library.custom_op("overlap::reduce_scatter_copy_in", mutates_args=(), tags=library.CUDAGRAPH_UNSAFE_TAGS)
def _reduce_scatter_copy_in_op(
    grads: list[torch.Tensor], layout_spec: list[int], pre_scale: Optional[float], dtype: Optional[torch.dtype]
) -> torch.Tensor:
    layout = library.layout(layout_spec)
    _, dtype, ordered = _check(grads, layout, pre_scale, dtype)
    return _reduce_scatter_copy_in(grads, layout, pre_scale, dtype, ordered)


@_reduce_scatter_copy_in_op.register_fake
def _(grads, layout_spec, pre_scale, dtype):
    layout = library.layout(layout_spec)
    device, dtype, _ = _check(grads, layout, pre_scale, dtype)
    return torch.empty(layout.buffer_numel, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------- launch
def _reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], layout: ShardLayout, pre_scale: float | None, dtype: torch.dtype,
    dtypes: tuple[torch.dtype, ...] | None = None, fingerprint: prepared_launch.Fingerprint | None = None,
    owned: prepared_launch.OwnedLists | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op on checked arguments (``dtype`` given; ``dtypes``: the grads' own, in order, when the
    checks read them; ``fingerprint``: the one the public op found them to match; ``owned``: the
    owner's launches, when the caller owns the grads and says when they change, [Note: lists the
    runtime owns]; ``out``: the buffer to fill and return, ``(layout.buffer_numel,)`` of ``dtype``,
    instead of a new one): the kernel, or the torch fallback. The launch is a prepared one ([Note:
    prepared launches] in ``overlap_kernels.prepared_launch``) unless the grads cannot be fingerprinted."""
    device = grads[0].device
    if not _launch.triton_enabled(device):
        with torch.no_grad():  # like the kernel: the buffer carries no autograd history
            packed = _reduce_scatter_copy_in_torch(grads, layout, pre_scale, dtype, device,
                                                   out if pre_scale is None else None)
            if out is None or packed is out:
                return packed
            return out.copy_(packed)  # the fallback's scaled and NaN paths make their own buffer
    rs_input = out if out is not None else torch.empty(layout.buffer_numel, dtype=dtype, device=device)
    config = (OP, "runtime", prepared_launch.scale_key(pre_scale), dtype)
    build = lambda ordered: _kernel_call(grads, layout, pre_scale, rs_input, ordered)  # noqa: E731
    if not (prepared_launch.launch_owned(owned, layout, config, grads, rs_input, build, dtypes, dtypes_read=True)
            if owned is not None
            else prepared_launch.launch_list(layout, config, grads, rs_input, build, fingerprint)):
        _kernel_call(list(map(torch.Tensor.contiguous, grads)), layout, pre_scale, rs_input, dtypes).launch()
    return rs_input


def _kernel_call(
    grads: Sequence[torch.Tensor], layout: ShardLayout, pre_scale: float | None, rs_input: torch.Tensor,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> _launch.KernelCall:
    """The launch that packs contiguous ``grads`` into ``rs_input``."""
    return _launch.scaled_kernel_call(_reduce_scatter_copy_in_kernel, layout, None, True, grads, rs_input, pre_scale,
                                      (rs_input.dtype,), dtypes)


# ------------------------------------------------------------------------------ fallback, reference
def _reduce_scatter_copy_in_torch(
    grads: Sequence[torch.Tensor], layout: ShardLayout, pre_scale: float | None, dtype: torch.dtype, device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op without Triton: the grads packed by one ``torch._chunk_cat`` or one ``_foreach_copy_``
    (at most two views per parameter) — with a scale, packed in the compute dtype, then scaled and
    cast in one call each; bitwise equal to ``reduce_scatter_copy_in_ref``, which it runs instead
    when it has cast a NaN ([Note: torch fallback] in ``overlap_kernels._torch_fallback``)."""
    plan = _torch_fallback.torch_plan(layout, None)
    compute = compute_dtype([dtype, *(g.dtype for g in grads)])
    work = (out if out is not None and pre_scale is None
            else torch.empty(layout.buffer_numel, dtype=dtype if pre_scale is None else compute, device=device))
    if _torch_fallback.chunk_cat(grads, plan, layout.world_size, work):
        casts = False  # (it looked for a NaN before casting)
    else:
        casts = _pack_torch(grads, layout, plan, work)  # in pieces unlike the reference's
    if pre_scale is None:
        if casts and _torch_fallback.has_nan(work):
            return reduce_scatter_copy_in_ref(grads, layout, pre_scale, dtype)
        return work
    scale = as_float32(pre_scale)
    work.mul_(scale)
    if (casts or dtype != compute) and _torch_fallback.has_nan(work):
        return reduce_scatter_copy_in_ref(grads, layout, pre_scale, dtype)
    if not plan.padded or _torch_fallback.keeps_zero(scale):  # the padding is still +0
        return work if dtype == compute else work.to(dtype)
    rs_input = torch.zeros(layout.buffer_numel, dtype=dtype, device=device)
    _torch_fallback.foreach_copy(_torch_fallback.buffer_views(rs_input, plan),
                                 _torch_fallback.buffer_views(work, plan))
    return rs_input


def _pack_torch(
    grads: Sequence[torch.Tensor], layout: ShardLayout, plan: _torch_fallback.TorchPlan, buffer: torch.Tensor
) -> bool:
    """Fill ``buffer`` with ``grads`` rank-major, cast, zeros in the padding, by one
    ``_foreach_copy_``; returns whether it cast."""
    if plan.padded:
        buffer.zero_()
    dsts = _torch_fallback.buffer_views(buffer, plan)
    strided = {i for i, g in enumerate(grads) if not g.is_contiguous()}
    if not strided:
        srcs = _torch_fallback.param_views(grads, plan.pieces)
    else:
        kept = [k for k, piece in enumerate(plan.pieces) if piece[0] not in strided]
        dsts = [dsts[k] for k in kept]
        srcs = _torch_fallback.param_views(grads, [plan.pieces[k] for k in kept])
    for i in sorted(strided):  # as the reference reads them: each rank's rows flattened
        for r in range(layout.world_size):
            src = layout.shard(grads[i], r).reshape(-1)
            if src.numel():
                dsts.append(buffer.narrow(0, r * layout.slot_numel + layout.slot_offsets[i], src.numel()))
                srcs.append(src)
    _torch_fallback.foreach_copy(dsts, srcs)
    return any(g.dtype != buffer.dtype for g in grads)


def reduce_scatter_copy_in_ref(
    grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    pre_scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch reference of ``reduce_scatter_copy_in``, one copy per rank and parameter: what the kernel and
    the torch fallback (``_reduce_scatter_copy_in_torch``, bitwise) are tested against."""
    dtype = dtype or grads[0].dtype
    compute = compute_dtype([dtype, *(g.dtype for g in grads)])
    rs_input = torch.zeros(layout.buffer_numel, dtype=dtype, device=grads[0].device)
    slots = rs_input.view(layout.world_size, layout.slot_numel)
    for r in range(layout.world_size):
        for grad, offset in zip(grads, layout.slot_offsets):
            shard = layout.shard(grad, r).reshape(-1)
            if pre_scale is not None:
                shard = shard.to(compute) * as_float32(pre_scale)
            slots[r, offset : offset + shard.numel()].copy_(shard)
    return rs_input
