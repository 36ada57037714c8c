"""all_gather_copy_in: pack this rank's N shards into its slot of the all-gather buffer (one launch).

Contract: ``ag_input, ag_output = all_gather_copy_in(shards, layout, rank, dtype)`` allocates
``ag_output`` (``buffer_numel`` elements of ``dtype``) and fills ``ag_input = ag_output[rank]`` (viewed
as ``(world_size, slot_numel)``): shard ``i`` cast to ``dtype`` at ``slot_offsets[i]``, zeros in every
padding element of the slot. The other slots are left uninitialized for the all-gather to fill;
``ag_input`` is a view into ``ag_output``, so the all-gather can run in place. Inputs are only read.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``shards[i]``           ``layout.shard_shape(i, rank)``        any supported, mixed allowed
``ag_input`` (out)      ``(slot_numel,)``                      ``dtype`` (default: the shards')
``ag_output`` (out)     ``(world_size * slot_numel,)``         ``dtype``
======================  =====================================  =================================

This module is the op's one home: the Triton kernel, the argument checks (``_check``), the public
function, ``torch.ops.overlap.all_gather_copy_in`` (custom op and fake, [Note: why custom_op and not
triton_op] in ``overlap_kernels.library``), ``_all_gather_copy_in`` (the op without argument checks, for the
runtime, which builds every argument from the layout: wrong arguments there are undefined
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
from overlap_kernels._jit import block_run, load_as, scalar_lanes, vector_lanes
from overlap_kernels.layout import ShardLayout

OP = "all_gather_copy_in"


# ------------------------------------------------------------------------------------------- kernel
@device_function
def _copy_in(
    addr, group, src_start, offs, dst, mask, other, store_mask,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    OUT: tl.constexpr = dst.dtype.element_ty
    x = load_as(addr, group, src_start, offs, mask, other, DT0, DT1, DT2, DT3, NUM_GROUPS, OUT, ALIGNED)
    tl.store(dst + offs, x, mask=store_mask)


@triton.jit
def _all_gather_copy_in_kernel(
    blocks_ptr, runs_ptr, pointers_ptr, slot_ptr,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr,
    NUM_GROUPS: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    addr, group, src_start, dst_start, n_valid, n_total, aligned = block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    dst = slot_ptr + dst_start
    if n_valid >= BLOCK:
        if aligned:  # [Note: alignment per run], [Note: per-thread width]
            _copy_in(addr, group, src_start, vector_lanes(BLOCK, VEC), dst, None, None, None,
                     DT0, DT1, DT2, DT3, NUM_GROUPS, True)
        else:
            for i in range(0, BLOCK, CHUNK):
                _copy_in(addr, group, src_start + i, scalar_lanes(CHUNK), dst + i, None, None, None,
                         DT0, DT1, DT2, DT3, NUM_GROUPS, False)
    else:  # the run's last block: shard tail, then zero padding
        for i in range(0, BLOCK, CHUNK):
            offs = scalar_lanes(CHUNK)
            _copy_in(addr, group, src_start + i, offs, dst + i, offs < n_valid - i, 0, offs < n_total - i,
                     DT0, DT1, DT2, DT3, NUM_GROUPS, False)


# -------------------------------------------------------------------- checks, API, torch.library op
def _check(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype, tuple[torch.dtype, ...]]:
    """(device, buffer dtype, each shard's dtype in order: the launch's pointer-table key)."""
    _check_scalars(layout, rank, dtype)
    device, ordered, dtypes = _checks.check_tensors(OP, "shards", shards, layout.shard_shape_tuple(rank))
    if dtype is None:
        dtype = _checks.common_dtype(OP, "shards", dtypes)
        _checks.check_dtype(OP, "dtype", dtype)
    return device, dtype, ordered


def _check_scalars(layout: ShardLayout, rank: int, dtype: torch.dtype | None) -> None:
    """``_check``'s rules that read no shard (O(1))."""
    _checks.check_layout(OP, layout)
    _checks.check_rank(OP, rank, layout)
    if dtype is not None:
        _checks.check_dtype(OP, "dtype", dtype)


def all_gather_copy_in(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``shards`` (this rank's) into a new all-gather buffer; returns ``(ag_input, ag_output)``."""
    _check_scalars(layout, rank, dtype)
    config = (OP, "public", rank, dtype)
    # [Note: prepared launches]: a list seen before passes its guard, and the checks' result holds
    fingerprint = None if library.dispatch_active() else prepared_launch.find(layout, config, shards)
    if fingerprint is None:
        _, dtype, ordered = _check(shards, layout, rank, dtype)
        if library.use_dispatcher(shards):
            ag_output = torch.ops.overlap.all_gather_copy_in(list(shards), list(layout.spec), rank, dtype)
            return ag_output.view(layout.world_size, layout.slot_numel)[rank], ag_output
        fingerprint = prepared_launch.remember(layout, config, shards, ordered, dtype)
        if fingerprint is None:
            return _all_gather_copy_in(shards, layout, rank, dtype, ordered)
    return _all_gather_copy_in(shards, layout, rank, fingerprint.checked, fingerprint=fingerprint)


@torch.library.custom_op("overlap::all_gather_copy_in", mutates_args=(), tags=library.CUDAGRAPH_UNSAFE_TAGS)
def _all_gather_copy_in_op(
    shards: list[torch.Tensor], layout_spec: list[int], rank: int, dtype: Optional[torch.dtype]
) -> torch.Tensor:
    layout = library.layout(layout_spec)
    _, dtype, ordered = _check(shards, layout, rank, dtype)
    return _all_gather_copy_in(shards, layout, rank, dtype, ordered)[1]


@_all_gather_copy_in_op.register_fake
def _(shards, layout_spec, rank, dtype):
    layout = library.layout(layout_spec)
    device, dtype, _ = _check(shards, layout, rank, dtype)
    return torch.empty(layout.buffer_numel, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------- launch
def _all_gather_copy_in(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype,
    dtypes: tuple[torch.dtype, ...] | None = None, fingerprint: prepared_launch.Fingerprint | None = None,
    owned: prepared_launch.OwnedLists | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on checked arguments (``dtype`` given; ``dtypes``: the shards' own, in order, when the
    checks read them; ``fingerprint``: the one the public op found them to match; ``owned``: the
    owner's launches, when the caller owns the shards and says when they change, [Note: lists the
    runtime owns]; ``out``: the all-gather buffer to fill, ``(layout.buffer_numel,)`` of ``dtype``,
    instead of a new one): the kernel, or the torch fallback. The launch is a prepared one ([Note:
    prepared launches] in ``overlap_kernels.prepared_launch``) unless the shards cannot be fingerprinted."""
    device = shards[0].device
    if not _launch.triton_enabled(device):
        with torch.no_grad():  # like the kernel: the buffer carries no autograd history
            return _all_gather_copy_in_torch(shards, layout, rank, dtype, device, out)
    ag_output = out if out is not None else torch.empty(layout.buffer_numel, dtype=dtype, device=device)
    ag_input = ag_output.view(layout.world_size, layout.slot_numel)[rank]
    config, build = (OP, "runtime", rank, dtype), lambda ordered: _kernel_call(shards, layout, rank, ag_input, ordered)
    if not (prepared_launch.launch_owned(owned, layout, config, shards, ag_input, build, dtypes) if owned is not None
            else prepared_launch.launch_list(layout, config, shards, ag_input, build, fingerprint)):
        _kernel_call(list(map(torch.Tensor.contiguous, shards)), layout, rank, ag_input, dtypes).launch()
    return ag_input, ag_output


def _kernel_call(shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, ag_input: torch.Tensor,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> _launch.KernelCall:
    """The launch that fills ``ag_input`` (this rank's slot) from contiguous ``shards``."""
    return _launch.kernel_call(_all_gather_copy_in_kernel, layout, rank, True, shards, (ag_input,), {},
                               destinations=(ag_input.dtype,), dtypes=dtypes)


# ------------------------------------------------------------------------------ fallback, reference
def _all_gather_copy_in_torch(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype, device: torch.device,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op without Triton: the shards packed into the slot (of ``out`` if given) by one
    ``torch._chunk_cat`` or one ``_foreach_copy_`` of views cut like the reference's copies; bitwise
    equal to ``all_gather_copy_in_ref`` ([Note: torch fallback] in ``overlap_kernels._torch_fallback``)."""
    plan = _torch_fallback.torch_plan(layout, rank)
    ag_output = out if out is not None else torch.empty(layout.buffer_numel, dtype=dtype, device=device)
    ag_input = ag_output.view(layout.world_size, layout.slot_numel)[rank]
    if _torch_fallback.chunk_cat(shards, plan, 1, ag_input):
        return ag_input, ag_output
    if plan.padded:
        ag_input.zero_()
    base, dsts, srcs = ag_input.storage_offset(), [], []
    for i, shape, stride, _, _, offset in plan.pieces:
        shard = shards[i]
        if shard.is_contiguous():
            dsts.append(ag_output.as_strided(shape, stride, base + offset))
            srcs.append(shard)
        else:  # as the reference copies it: flattened (a copy, or a strided view)
            src = shard.reshape(-1)
            dsts.append(ag_output.as_strided(src.shape, (1,), base + offset))
            srcs.append(src)
    _torch_fallback.foreach_copy(dsts, srcs)
    return ag_input, ag_output


def all_gather_copy_in_ref(
    shards: Sequence[torch.Tensor], layout: ShardLayout, rank: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of ``all_gather_copy_in``, one copy per rank and parameter: what the kernel and
    the torch fallback (``_all_gather_copy_in_torch``, bitwise) are tested against."""
    dtype = dtype or shards[0].dtype
    ag_output = torch.empty(layout.buffer_numel, dtype=dtype, device=shards[0].device)
    ag_input = ag_output.view(layout.world_size, layout.slot_numel)[rank]
    ag_input.zero_()
    for shard, offset in zip(shards, layout.slot_offsets):
        ag_input[offset : offset + shard.numel()].copy_(shard.reshape(-1))
    return ag_input, ag_output
