"""The torch fallback of the four packing ops: batched torch calls, bitwise equal to the references.

Contract: each op's ``_<op>_torch`` (in its own module) is the op without Triton, built from the
helpers here: ``torch_plan`` (the views between a layout's tensors and its flat buffer, cached on
the layout), ``buffer_views`` / ``param_views`` (those views on given tensors), ``chunk_cat`` (one
``torch._chunk_cat`` where the plan allows it), ``foreach_copy``, ``has_nan`` and ``keeps_zero``.
Host ints only; nothing here launches a kernel.

[Note: torch fallback]
Without Triton (CPU without the interpreter; CUDA tensors under it) each op runs a handful of
batched torch calls instead of its reference's loop over ranks x parameters (``*_ref``, which
makes ``world_size * N`` small copies). A ``TorchPlan`` (host ints, built once per layout and
rank, cached on the layout) lists the *pieces*: views made with ``as_strided`` on both sides, all
copied by one ``torch._foreach_copy_`` (or ``_foreach_add_``). Zeroing, scaling and casts of
whole buffers are one call each.

* ``rank`` plans (copy-in of the all-gather, copy-out of the reduce-scatter): one piece per
  parameter with a non-empty shard, the shard's shape at its slot offset — the very copy the
  reference makes.
* ``None`` (all ranks) plans: a parameter's rows on its *full* ranks (``d // ceil(d / w)`` of
  them, each holding a whole chunk) are one 2-D piece ``(full, chunk)`` — rank-major rows of the
  buffer (stride ``slot_numel``) against consecutive rows of the parameter — and the short
  rank's rows, if any, a 1-D piece: at most two copies per parameter whatever the world size.
  A piece that is its parameter's whole region (rows divide evenly, chunk a multiple of
  ``ShardLayout.ALIGN``) comes from one split of the buffer, cheaper than a view each.
* Packing (the copy-ins) needs no view at all when no region has alignment padding (every chunk a
  multiple of ``ALIGN``, as for the usual power-of-two shapes, and every shard of the rank full
  for a rank plan) and the tensors share one dtype: ``torch._chunk_cat`` — FSDP2's packing op —
  lays them out rank-major, zero-padding short ranks, in one call (``TorchPlan.chunk_cat``); a
  cast then follows on the whole buffer.

Bitwise equal to the references. A copy without a cast keeps every bit whatever loop torch runs
it in, and so does every non-NaN value through a cast or elementwise arithmetic. The bits of a
NaN that a cast produces, though, depend on the loop — vector body or scalar tail, contiguous or
strided iterator (float32 NaN -> bfloat16 is 0xFFFF from a contiguous copy, 0x7FC0 from a strided
one; float16 NaN -> float32 is 0x7FC00000 or 0x7FFFFFFF by position in the copy) — and so on how
the copies are cut. Rank plans' pieces are cut as the references' copies. Where a fallback casts
in other pieces (2-D pieces, whole buffers) it looks for a NaN (``has_nan``: one sum over the
buffer) and, finding one, takes the path cut like the reference (or runs the reference itself):
slow, but only for data that already holds a NaN (a gradient with a NaN means a skipped step
anyway). NaN bits are not part of the ops' contract (see [Note: conversions as torch does them] in
``overlap_kernels._jit``); this keeps the fallback and the reference interchangeable, bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from overlap_kernels.layout import ShardLayout


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
whole buffer (two more passes over it), larger ones by a view each (a copy call per view)."""


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
