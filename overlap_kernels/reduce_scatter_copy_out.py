"""reduce_scatter_copy_out: unpack this rank's reduced slot into its N sharded gradients (one launch).

Contract: ``reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate,
post_divisor)`` reads shard ``i`` at ``slot_offsets[i]`` of ``rs_output`` (this rank's slot),
divides it by ``post_divisor`` or multiplies it by ``post_scale`` (at most one of them given), casts
it to ``shard_grads[i].dtype`` and assigns it (``accumulate=False``) or adds it (``accumulate=True``:
``g = g + x``) into ``shard_grads[i]`` in place. Both values are rounded to float32. The division
is IEEE's (correctly rounded) and its quotient is rounded to ``rs_output``'s dtype, so it is
bitwise ``rs_output / post_divisor`` as torch computes it on a CPU (float32 arithmetic for 16-bit
floats, float64 for float64): [Note: dividing as the reduction's average]. Scaling and accumulation
happen in float32 (float64 when a float64 tensor is involved). Scaling, dividing and accumulating
need floating-point tensors; plain copies work for every supported dtype. One pass replaces FSDP2's
divide + cast + ``+=``. ``rs_output`` is only read.

[Note: dividing as the reduction's average]
The reduced slot is a sum over the data-parallel ranks; the average divides it by their number (or
by the module's gradient divide factor). FSDP2 divides with torch: on a CPU (gloo's average, or its
``div_`` after a sum) that is a true division in the reduce dtype, which multiplying by ``1/w``
misses by an ulp when ``w`` is no power of two; on CUDA torch's division by a scalar is itself a
multiplication by the float32 reciprocal. ``post_divisor`` is the first, ``post_scale`` the
second, so the runtime takes its average as torch's division does on its device.

======================  =====================================  =================================
argument                shape                                  dtype
======================  =====================================  =================================
``rs_output``           ``slot_numel`` elements, contiguous    any supported
``shard_grads[i]`` (io) ``layout.shard_shape(i, rank)``        any supported, mixed allowed
======================  =====================================  =================================

This module is the op's one home: the Triton kernel, the argument checks (``_check``), the public
function, ``torch.ops.overlap.reduce_scatter_copy_out`` (custom op and fake, [Note: why custom_op
and not triton_op] in ``overlap_kernels.library``), ``_reduce_scatter_copy_out`` (the op without argument
checks, for the runtime, which builds every argument from the layout: wrong arguments there are
undefined behaviour, the kernel writes through raw addresses), the torch fallback and the
pure-torch reference.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import triton
import triton.language as tl

from overlap_kernels import _checks, _launch, _torch_fallback, library, prepared_launch
from overlap_kernels._device_function import device_function
from overlap_kernels._dtypes import TRITON_DTYPES, as_float32, compute_dtype
from overlap_kernels._jit import block_run, convert, load_as, scalar_lanes, store_as, vector_lanes
from overlap_kernels.layout import ShardLayout

OP = "reduce_scatter_copy_out"


# ------------------------------------------------------------------------------------------- kernel
@device_function
def _unpack(
    src, offs, addr, group, dst_start, mask, other, scale,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, NUM_GROUPS: tl.constexpr,
    COMPUTE: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, ALIGNED: tl.constexpr,
    DIVIDE: tl.constexpr, SLOT: tl.constexpr,
):
    x = tl.load(src + offs, mask=mask)
    if DIVIDE:  # ``scale`` is the divisor; the quotient in the slot's dtype, as torch's CPU division
        if SLOT == tl.float64:
            x = x / scale
        else:
            x = convert(tl.math.div_rn(convert(x, tl.float32), scale), SLOT)
    if HAS_SCALE or ACCUMULATE:
        x = convert(x, COMPUTE)
    if HAS_SCALE:
        x = x * scale
    if ACCUMULATE:
        x = load_as(addr, group, dst_start, offs, mask, other, DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, ALIGNED) + x
    store_as(addr, group, dst_start, offs, x, mask, DT0, DT1, DT2, DT3, NUM_GROUPS, ALIGNED)


@triton.jit
def _reduce_scatter_copy_out_kernel(
    blocks_ptr, runs_ptr, pointers_ptr, slot_ptr, scale,
    DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr,
    NUM_GROUPS: tl.constexpr, COMPUTE: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
    DIVIDE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    addr, group, dst_start, src_start, n_valid, _, aligned = block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    src = slot_ptr + src_start
    if n_valid >= BLOCK:
        if aligned:  # [Note: alignment per run], [Note: per-thread width]
            _unpack(src, vector_lanes(BLOCK, VEC), addr, group, dst_start, None, None, scale,
                    DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, ACCUMULATE, True, DIVIDE, SLOT)
        else:
            for i in range(0, BLOCK, CHUNK):
                _unpack(src + i, scalar_lanes(CHUNK), addr, group, dst_start + i, None, None, scale,
                        DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, ACCUMULATE, False, DIVIDE, SLOT)
    else:
        for i in range(0, BLOCK, CHUNK):
            offs = scalar_lanes(CHUNK)
            _unpack(src + i, offs, addr, group, dst_start + i, offs < n_valid - i, 0, scale,
                    DT0, DT1, DT2, DT3, NUM_GROUPS, COMPUTE, HAS_SCALE, ACCUMULATE, False, DIVIDE, SLOT)


# -------------------------------------------------------------------- checks, API, torch.library op
def _check(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None,
    accumulate: bool,
    post_divisor: float | None = None,
) -> tuple[torch.dtype, ...]:
    """Each of ``shard_grads``' dtypes in order (the launch's pointer-table key)."""
    device = _check_scalars(rs_output, layout, rank, post_scale, accumulate, post_divisor)
    _, ordered, dtypes = _checks.check_tensors(OP, "shard_grads", shard_grads, layout.shard_shape_tuple(rank), device,
                                               writable=True)
    if post_scale is not None or post_divisor is not None or accumulate:
        what = ("post_scale" if post_scale is not None else "post_divisor" if post_divisor is not None
                else "accumulate=True")
        _checks.check_floating(OP, what, {rs_output.dtype} | dtypes)
    return ordered


def _check_scalars(rs_output: torch.Tensor, layout: ShardLayout, rank: int, post_scale: float | None,
                   accumulate: bool, post_divisor: float | None = None) -> torch.device:
    """``_check``'s rules that read no gradient (O(1)); returns ``rs_output``'s device."""
    _checks.check_layout(OP, layout)
    _checks.check_rank(OP, rank, layout)
    device = _checks.check_flat(OP, "rs_output", rs_output, layout.slot_numel, None)
    _checks.check_scale(OP, "post_scale", post_scale)
    _checks.check_scale(OP, "post_divisor", post_divisor)
    if post_divisor is not None:
        if post_scale is not None:
            raise ValueError(f"{OP}: pass post_scale or post_divisor, not both (got {post_scale!r} and "
                             f"{post_divisor!r})")
        if not (math.isfinite(post_divisor) and as_float32(post_divisor) != 0):
            raise ValueError(f"{OP}: post_divisor must be a finite float that is not 0 in float32, got "
                             f"{post_divisor!r}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"{OP}: accumulate must be a bool, got {type(accumulate).__name__}")
    return device


def reduce_scatter_copy_out(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None = None,
    accumulate: bool = False,
    post_divisor: float | None = None,
) -> None:
    """Write (or add) this rank's reduced slot, scaled or divided and cast, into ``shard_grads`` in place."""
    fingerprint, config = None, None
    if not library.dispatch_active():
        device = _check_scalars(rs_output, layout, rank, post_scale, accumulate, post_divisor)
        config = (OP, "public", rank, _scaling_key(post_scale, post_divisor), accumulate, device, rs_output.dtype)
        # [Note: prepared launches]: a list seen before passes its guard, and the checks' result holds
        fingerprint = prepared_launch.find(layout, config, shard_grads)
    if fingerprint is None:
        ordered = _check(rs_output, shard_grads, layout, rank, post_scale, accumulate, post_divisor)
        if library.use_dispatcher([rs_output, *shard_grads]):
            library.check_compiled_views(OP, "shard_grads", shard_grads)
            torch.ops.overlap.reduce_scatter_copy_out(
                rs_output, list(shard_grads), list(layout.spec), rank, post_scale, accumulate, post_divisor
            )
            return
        fingerprint = prepared_launch.remember(layout, config, shard_grads, ordered) if config else None
        if fingerprint is None:
            _reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate, ordered,
                                     post_divisor=post_divisor)
            return
    _reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate, fingerprint=fingerprint,
                             post_divisor=post_divisor)


def _scaling_key(post_scale: float | None, post_divisor: float | None) -> tuple[str, bytes] | None:
    """The scaling part of a launch's configuration key."""
    if post_divisor is not None:
        return ("divide", prepared_launch.scale_key(post_divisor))
    return None if post_scale is None else ("scale", prepared_launch.scale_key(post_scale))


@torch.library.custom_op(
    "overlap::reduce_scatter_copy_out", mutates_args=("shard_grads",), tags=library.CUDAGRAPH_UNSAFE_TAGS
)
def _reduce_scatter_copy_out_op(
    rs_output: torch.Tensor,
    shard_grads: list[torch.Tensor],
    layout_spec: list[int],
    rank: int,
    post_scale: Optional[float],
    accumulate: bool,
    post_divisor: Optional[float] = None,
) -> None:
    layout = library.layout(layout_spec)
    ordered = _check(rs_output, shard_grads, layout, rank, post_scale, accumulate, post_divisor)
    _reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate, ordered,
                             post_divisor=post_divisor)


@_reduce_scatter_copy_out_op.register_fake
def _(rs_output, shard_grads, layout_spec, rank, post_scale, accumulate, post_divisor=None):
    _check(rs_output, shard_grads, library.layout(layout_spec), rank, post_scale, accumulate, post_divisor)


# ------------------------------------------------------------------------------------------- launch
def _reduce_scatter_copy_out(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None,
    accumulate: bool,
    dtypes: tuple[torch.dtype, ...] | None = None,
    packed: tuple[torch.UntypedStorage, _launch.PackedPlacement] | None = None,
    fingerprint: prepared_launch.Fingerprint | None = None,
    versions: Sequence[torch.Tensor] | None = None,
    post_divisor: float | None = None,
) -> None:
    """The op on checked arguments (``dtypes``: the shard grads' own, in order, when the checks read
    them; ``packed``: ``(storage, placement)`` when ``shard_grads`` are ``placement.views(storage)``
    or views of it at the same offsets, shapes and dtypes, which keys the launch on the storage,
    O(1): [Note: packed placements] in ``overlap_kernels._launch``; ``fingerprint``: the one the public op
    found ``shard_grads`` to match; ``versions``: tensors whose version counters are all of
    ``shard_grads``' (``None``: ``shard_grads``; one view for views sharing one counter,
    ``PackedPlacement.shared_views``)): the kernel, or the torch fallback. The launch is a prepared
    one ([Note: prepared launches] in ``overlap_kernels.prepared_launch``) unless the gradients cannot be
    fingerprinted."""
    device = rs_output.device
    if not _launch.triton_enabled(device):
        with torch.no_grad():  # like the kernel: writes behind autograd (the version still bumps)
            _reduce_scatter_copy_out_torch(rs_output, shard_grads, layout, rank, post_scale, accumulate, post_divisor)
        return
    config = (OP, rank, _scaling_key(post_scale, post_divisor), accumulate, rs_output.dtype)
    if packed is not None:
        prepared_launch.launch_packed(
            layout, (*config, "packed"), packed[0], packed[1], rs_output,
            lambda: _kernel_call(rs_output, shard_grads, layout, rank, post_scale, accumulate, dtypes, packed,
                                 post_divisor))
    elif not prepared_launch.launch_list(
            layout, (*config, "runtime"), shard_grads, rs_output,
            lambda ordered: _kernel_call(rs_output, shard_grads, layout, rank, post_scale, accumulate, ordered,
                                         post_divisor=post_divisor),
            fingerprint):
        _kernel_call(rs_output, shard_grads, layout, rank, post_scale, accumulate, dtypes,
                     post_divisor=post_divisor).launch()
    _launch.increment_version(shard_grads if versions is None else versions)


def _kernel_call(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None,
    accumulate: bool,
    dtypes: tuple[torch.dtype, ...] | None = None,
    packed: tuple[torch.UntypedStorage, _launch.PackedPlacement] | None = None,
    post_divisor: float | None = None,
) -> _launch.KernelCall:
    """The launch that writes (or adds) ``rs_output`` into ``shard_grads`` (contiguous)."""
    call = _launch.scaled_kernel_call(_reduce_scatter_copy_out_kernel, layout, rank, False, shard_grads, rs_output,
                                      post_scale if post_divisor is None else post_divisor, None, dtypes, packed,
                                      ACCUMULATE=accumulate, DIVIDE=post_divisor is not None,
                                      SLOT=TRITON_DTYPES[rs_output.dtype])
    if post_divisor is not None:  # the divisor rides in the scale argument; nothing multiplies
        call.constexprs["HAS_SCALE"] = False
    return call


# ------------------------------------------------------------------------------ fallback, reference
def _reduce_scatter_copy_out_torch(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None,
    accumulate: bool,
    post_divisor: float | None = None,
) -> None:
    """The op without Triton: the slot divided, widened and scaled in one call each, then one
    ``_foreach_copy_`` (or ``_foreach_add_``, which widens, adds and casts back) of its views into
    the grads; bitwise equal to ``reduce_scatter_copy_out_ref``, which it runs instead when it
    would widen a NaN ([Note: torch fallback] in ``overlap_kernels._torch_fallback``)."""
    plan = _torch_fallback.torch_plan(layout, rank)
    if not plan.pieces:
        return
    slot = rs_output if post_divisor is None else _divided(rs_output, post_divisor)
    if post_scale is not None or accumulate:
        compute = compute_dtype([rs_output.dtype, *(g.dtype for g in shard_grads)])
        if compute != rs_output.dtype and _torch_fallback.has_nan(slot):
            reduce_scatter_copy_out_ref(rs_output, shard_grads, layout, rank, post_scale, accumulate, post_divisor)
            return
        slot = slot.to(compute)
    if post_scale is not None:
        slot = slot * as_float32(post_scale)
    grads = [shard_grads[piece[0]] for piece in plan.pieces]
    views = _torch_fallback.buffer_views(slot, plan)
    if accumulate:
        torch._foreach_add_(grads, views)
    else:
        torch._foreach_copy_(grads, views)


def reduce_scatter_copy_out_ref(
    rs_output: torch.Tensor,
    shard_grads: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    post_scale: float | None = None,
    accumulate: bool = False,
    post_divisor: float | None = None,
) -> None:
    """Plain-torch reference of ``reduce_scatter_copy_out``, one copy per rank and parameter: what the kernel and
    the torch fallback (``_reduce_scatter_copy_out_torch``, bitwise) are tested against."""
    compute = compute_dtype([rs_output.dtype, *(g.dtype for g in shard_grads)])
    slot = rs_output.reshape(-1)
    if post_divisor is not None:
        slot = _divided(slot, post_divisor)
    for grad, offset in zip(shard_grads, layout.slot_offsets):
        x = slot[offset : offset + grad.numel()].view(grad.shape)
        if post_scale is not None or accumulate:
            x = x.to(compute)
        if post_scale is not None:
            x = x * as_float32(post_scale)
        if accumulate:
            x = grad.to(compute) + x
        grad.copy_(x)


def _divided(slot: torch.Tensor, post_divisor: float) -> torch.Tensor:
    """``slot`` divided by ``post_divisor`` (rounded to float32) in float32 (float64 for a float64
    slot), the quotient rounded to ``slot``'s dtype: [Note: dividing as the reduction's average].
    torch's CPU division by a number is that (16-bit floats divide in float32); elsewhere the
    divisor is a one-element tensor on the slot's device, since CUDA's division by a number
    multiplies by its reciprocal."""
    if slot.device.type == "cpu":
        return slot / as_float32(post_divisor)
    wide = torch.float64 if slot.dtype == torch.float64 else torch.float32
    divisor = torch.full((1,), as_float32(post_divisor), dtype=wide, device=slot.device)
    return (slot.to(wide) / divisor).to(slot.dtype)
