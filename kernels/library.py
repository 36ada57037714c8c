"""``torch.library`` registrations: the four packing ops as ``torch.ops.overlap.*``.

[Note: why custom_op and not triton_op]
The kernels take a *pointer table* (data addresses of the N parameter-side tensors, see
``kernels._launch``) so that one launch covers N tensors of any shapes. ``torch.library.triton_op``
traces its body with fake tensors under ``torch.compile``, where data addresses do not exist, and
Inductor would need every tensor as a separate kernel argument. So the ops are opaque
``torch.library.custom_op``s with fake implementations: they trace in ``make_fx`` and
``torch.compile`` (Inductor calls them as extern kernels), and at run time dispatch on device
(Triton on CUDA or under the interpreter, the torch reference otherwise).

The public functions (``kernels.all_gather_copy_in`` ...) call the launchers directly in eager mode —
a custom-op call with hundreds of tensors costs ~1 ms of dispatcher overhead — and go through these
ops while Dynamo traces or a dispatch mode is active (``_launch.use_dispatcher``). Ops take the
layout as its ``spec`` (a flat int list); ``ShardLayout.from_spec`` rebuilds and caches it.

=================================  ======================================================
op                                 schema (informal)
=================================  ======================================================
``overlap::all_gather_copy_in``    (Tensor[] shards, int[] spec, int rank, ScalarType? dtype) -> Tensor ag_output
``overlap::all_gather_copy_out``   (Tensor ag_output, int[] spec, Tensor(a!)[] outs) -> ()
``overlap::reduce_scatter_copy_in``  (Tensor[] grads, int[] spec, float? pre_scale, ScalarType? dtype) -> Tensor
``overlap::reduce_scatter_copy_out`` (Tensor rs_output, Tensor(a!)[] shard_grads, int[] spec, int rank,
                                   float? post_scale, bool accumulate) -> ()
=================================  ======================================================

[Note: ops in CUDA graphs]
On CUDA with Triton the four ops are capture-safe: their launch path allocates nothing pinned,
waits on nothing and syncs nothing during capture, and the tables their kernels read stay valid
for as long as a graph may replay (``kernels.table_memory``). CUDA tensors under
``TRITON_INTERPRET`` take the torch fallback instead, whose NaN check (``_launch.has_nan``) reads a
value back to the host: in that configuration the ops are registered with
``torch.Tag.cudagraph_unsafe``, so that Inductor's CUDA graphs leave them out
(``CUDAGRAPH_UNSAFE_TAGS``).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels import _launch
from kernels.all_gather_copy_in import _all_gather_copy_in
from kernels.all_gather_copy_in import _check as _check_all_gather_copy_in
from kernels.all_gather_copy_out import _all_gather_copy_out
from kernels.all_gather_copy_out import _check as _check_all_gather_copy_out
from kernels.layout import ShardLayout
from kernels.reduce_scatter_copy_in import _check as _check_reduce_scatter_copy_in
from kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in
from kernels.reduce_scatter_copy_out import _check as _check_reduce_scatter_copy_out
from kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out


def _cudagraph_tags(interpret: bool) -> tuple[torch.Tag, ...]:
    """The tags of the ops: ``cudagraph_unsafe`` when CUDA tensors would take the torch fallback
    ([Note: ops in CUDA graphs]); none on a torch without that tag."""
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (unsafe,) if interpret and unsafe is not None else ()


CUDAGRAPH_UNSAFE_TAGS = _cudagraph_tags(_launch.INTERPRET)


def _layout(spec: list[int]) -> ShardLayout:
    return ShardLayout.from_spec(tuple(spec))


@torch.library.custom_op("overlap::all_gather_copy_in", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def all_gather_copy_in(
    shards: list[torch.Tensor], layout_spec: list[int], rank: int, dtype: Optional[torch.dtype]
) -> torch.Tensor:
    layout = _layout(layout_spec)
    device, dtype = _check_all_gather_copy_in(shards, layout, rank, dtype)
    return _all_gather_copy_in(shards, layout, rank, dtype, device)[1]


@all_gather_copy_in.register_fake
def _(shards, layout_spec, rank, dtype):
    layout = _layout(layout_spec)
    device, dtype = _check_all_gather_copy_in(shards, layout, rank, dtype)
    return torch.empty(layout.buffer_numel, dtype=dtype, device=device)


@torch.library.custom_op("overlap::all_gather_copy_out", mutates_args=("outs",), tags=CUDAGRAPH_UNSAFE_TAGS)
def all_gather_copy_out(ag_output: torch.Tensor, layout_spec: list[int], outs: list[torch.Tensor]) -> None:
    layout = _layout(layout_spec)
    _check_all_gather_copy_out(ag_output, layout, outs, None)
    _all_gather_copy_out(ag_output, layout, outs)


@all_gather_copy_out.register_fake
def _(ag_output, layout_spec, outs):
    _check_all_gather_copy_out(ag_output, _layout(layout_spec), outs, None)


@torch.library.custom_op("overlap::reduce_scatter_copy_in", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def reduce_scatter_copy_in(
    grads: list[torch.Tensor], layout_spec: list[int], pre_scale: Optional[float], dtype: Optional[torch.dtype]
) -> torch.Tensor:
    layout = _layout(layout_spec)
    device, dtype = _check_reduce_scatter_copy_in(grads, layout, pre_scale, dtype)
    return _reduce_scatter_copy_in(grads, layout, pre_scale, dtype, device)


@reduce_scatter_copy_in.register_fake
def _(grads, layout_spec, pre_scale, dtype):
    layout = _layout(layout_spec)
    device, dtype = _check_reduce_scatter_copy_in(grads, layout, pre_scale, dtype)
    return torch.empty(layout.buffer_numel, dtype=dtype, device=device)


@torch.library.custom_op("overlap::reduce_scatter_copy_out", mutates_args=("shard_grads",), tags=CUDAGRAPH_UNSAFE_TAGS)
def reduce_scatter_copy_out(
    rs_output: torch.Tensor,
    shard_grads: list[torch.Tensor],
    layout_spec: list[int],
    rank: int,
    post_scale: Optional[float],
    accumulate: bool,
) -> None:
    layout = _layout(layout_spec)
    _check_reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate)
    _reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, post_scale, accumulate)


@reduce_scatter_copy_out.register_fake
def _(rs_output, shard_grads, layout_spec, rank, post_scale, accumulate):
    _check_reduce_scatter_copy_out(rs_output, shard_grads, _layout(layout_spec), rank, post_scale, accumulate)
