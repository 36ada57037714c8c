"""ShardLayout: where every parameter's shard lives on every rank and in the flat buffers.

[Note: sharding rule]
A parameter of full shape ``(d, *rest)`` on ``w`` ranks is split along dim 0 into chunks of
``ceil(d / w)`` rows; rank ``r`` holds rows ``[min(r * c, d), min((r + 1) * c, d))`` with
``c = ceil(d / w)``, so the last ranks hold fewer rows or none (``d = 10, w = 4``: 3, 3, 3, 1).
A 0-dim parameter is sharded as if it had shape ``(1,)``: rank 0 holds it as a 1-element 1-D shard,
the other ranks hold empty ``(0,)`` shards; its full (unsharded) tensor keeps shape ``()``.
Shards are views of the full tensor's rows (``ShardLayout.shard``), never padded: padding exists
only inside the flat communication buffers.

[Note: flat buffers]
Every rank owns one *slot* of ``slot_numel`` elements; an all-gather buffer (and a reduce-scatter
input) is ``world_size`` slots back to back, rank-major, ``buffer_numel = world_size * slot_numel``.
Inside a slot, parameter ``i`` owns ``[slot_offsets[i], slot_offsets[i] + padded_numels[i])``:
its shard's elements first (row-major), then zeros up to ``chunk_numels[i] = ceil(d / w) * row_numel``
(the padding of short ranks), then zeros up to the next multiple of ``ALIGN`` elements (so every
parameter starts 16-element aligned, which lets the kernels use vector loads and stores). The
layout is dtype-free: the same offsets serve a bf16 and an fp32 buffer.

Shapes, for ``N`` parameters, world size ``w``, rank ``r``:

=========================  ==============================================================
full parameter ``i``       ``shapes[i]``
shard ``i`` on rank ``r``  ``shard_shape(i, r) = (rows of r, *shapes[i][1:])`` (``(rows,)`` if 0-dim)
slot                       ``(slot_numel,)`` = ``sum(padded_numels)``
flat buffer                ``(buffer_numel,)`` = ``(w * slot_numel,)``, viewable as ``(w, slot_numel)``
=========================  ==============================================================

Device-side metadata derived from a layout (block tables, see ``overlap_kernels._launch``) is cached on the
layout object per device, so steady-state launches copy nothing from host to device; so are the torch
fallback's plans (host ints, ``overlap_kernels._torch_fallback.torch_plan``). When a layout goes, its device tables
are released only after the kernels that may read them ([Note: table lifetime] in
``overlap_kernels.table_memory``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ShardLayout"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): ``triton.next_power_of_2`` for
    ``n >= 1``, in plain Python. Triton's is a constexpr function whose call from Python costs
    about 2.5 µs (Triton 3.9), which a launch path cannot afford per call."""
    return 1 << max(0, n - 1).bit_length()


class ShardLayout:
    """Sharding of ``N`` parameters (given by their full shapes) over ``world_size`` ranks.

    Immutable; equal (and equally hashed) when shapes and world size are equal.
    """

    ALIGN = 16
    """Every parameter's region in a slot starts at a multiple of this many elements."""

    def __init__(self, param_shapes: Sequence[Sequence[int]], world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"ShardLayout: world_size must be an int >= 1, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(f"ShardLayout: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(param_shapes, torch.Tensor) or not isinstance(param_shapes, Sequence):
            raise TypeError(
                f"ShardLayout: param_shapes must be a sequence of shapes, got {type(param_shapes).__name__}"
            )
        if len(param_shapes) == 0:
            raise ValueError("ShardLayout: param_shapes must hold at least one shape, got none")
        shapes = []
        for i, shape in enumerate(param_shapes):
            if isinstance(shape, (torch.Tensor, str)) or not isinstance(shape, Sequence) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape
            ):
                raise TypeError(
                    f"ShardLayout: param_shapes[{i}] must be a sequence of non-negative ints, got {shape!r}"
                )
            if any(d < 0 for d in shape):
                raise ValueError(
                    f"ShardLayout: param_shapes[{i}] must be a sequence of non-negative ints, got {shape!r}"
                )
            shapes.append(torch.Size(shape))
        self.world_size: int = world_size
        self.shapes: tuple[torch.Size, ...] = tuple(shapes)
        self.numels: tuple[int, ...] = tuple(s.numel() for s in shapes)
        self.dim0s: tuple[int, ...] = tuple(s[0] if len(s) else 1 for s in shapes)
        self.row_numels: tuple[int, ...] = tuple(s[1:].numel() for s in shapes)
        self.rows_per_rank: tuple[int, ...] = tuple(_ceil_div(d, world_size) for d in self.dim0s)
        self.chunk_numels: tuple[int, ...] = tuple(
            c * n for c, n in zip(self.rows_per_rank, self.row_numels)
        )
        self.padded_numels: tuple[int, ...] = tuple(
            _ceil_div(n, self.ALIGN) * self.ALIGN for n in self.chunk_numels
        )
        offsets = np.zeros(len(shapes), dtype=np.int64)
        np.cumsum(self.padded_numels[:-1], out=offsets[1:])
        self.slot_offsets: tuple[int, ...] = tuple(int(o) for o in offsets)
        self.slot_numel: int = sum(self.padded_numels)
        self.buffer_numel: int = world_size * self.slot_numel
        self.spec: tuple[int, ...] = (world_size, len(shapes)) + tuple(
            x for s in shapes for x in (len(s), *s)
        )
        """A flat tuple of ints that rebuilds this layout (``ShardLayout.from_spec``); the
        ``torch.library`` ops take it in place of the layout object."""
        self._device_cache: dict[Any, Any] = {}

    @staticmethod
    def from_spec(spec: Sequence[int]) -> ShardLayout:
        """The layout whose ``spec`` is ``spec`` (any sequence of ints; cached: equal specs give the
        same object)."""
        if isinstance(spec, (torch.Tensor, str)) or not isinstance(spec, Sequence) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in spec
        ):
            raise TypeError(f"spec must be a sequence of ints (a ShardLayout.spec), got {spec!r}")
        return _layout_from_spec(tuple(spec))

    @property
    def num_params(self) -> int:
        return len(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardLayout) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return (
            f"ShardLayout(num_params={self.num_params}, world_size={self.world_size}, "
            f"slot_numel={self.slot_numel})"
        )

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int in [0, {self.world_size}), got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int in [0, {self.num_params}), got {type(index).__name__}")
        if not 0 <= index < self.num_params:
            raise IndexError(f"index must be a parameter index in [0, {self.num_params}), got {index!r}")

    def shard_rows(self, index: int, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of parameter ``index`` held by ``rank`` (dim 0 of the full tensor)."""
        self._check_index(index)
        self._check_rank(rank)
        d, c = self.dim0s[index], self.rows_per_rank[index]
        return min(rank * c, d), min((rank + 1) * c, d)

    def shard_shape(self, index: int, rank: int) -> torch.Size:
        start, end = self.shard_rows(index, rank)
        return torch.Size((end - start, *self.shapes[index][1:]))

    def shard_numel(self, index: int, rank: int) -> int:
        start, end = self.shard_rows(index, rank)
        return (end - start) * self.row_numels[index]

    def shard_shapes(self, rank: int) -> list[torch.Size]:
        return list(self.shard_shape_tuple(rank))

    def shard_shape_tuple(self, rank: int) -> tuple[torch.Size, ...]:
        """``shard_shapes(rank)`` as a tuple, computed once per rank (the ops' checks read it at
        every call)."""
        key = ("shard_shapes", rank)
        shapes = self._device_cache.get(key)
        if shapes is None:
            shapes = self._device_cache[key] = tuple(self.shard_shape(i, rank) for i in range(self.num_params))
        return shapes

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of a full tensor, as a view (a 0-dim tensor is viewed as shape ``(1,)``)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self._check_rank(rank)
        d = tensor.shape[0] if tensor.dim() else 1
        c = _ceil_div(d, self.world_size)
        start, end = min(rank * c, d), min((rank + 1) * c, d)
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
        return rows.narrow(0, start, end - start)

    def shards(self, tensors: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """``shard`` of each full tensor; their shapes must be this layout's shapes."""
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"tensors must be a sequence of {self.num_params} tensors, got {type(tensors).__name__}")
        if len(tensors) != self.num_params:
            raise ValueError(f"tensors has {len(tensors)} entries, layout has {self.num_params} parameters")
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != shape:
                raise ValueError(f"tensors[{i}] has shape {tuple(t.shape)}, layout expects {tuple(shape)}")
        return [self.shard(t, rank) for t in tensors]

    def shard_views(self, slot: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of ``rank``'s shards inside a 1-D slot of ``slot_numel`` elements (no copy)."""
        if not isinstance(slot, torch.Tensor):
            raise TypeError(f"slot must be a 1-D torch.Tensor of {self.slot_numel} elements, got {type(slot).__name__}")
        if slot.dim() != 1 or slot.numel() != self.slot_numel:
            raise ValueError(f"slot must be 1-D with {self.slot_numel} elements, got shape {tuple(slot.shape)}")
        return [
            slot.narrow(0, off, self.shard_numel(i, rank)).view(self.shard_shape(i, rank))
            for i, off in enumerate(self.slot_offsets)
        ]

    def segments(self, rank: int | None) -> np.ndarray:
        """Contiguous copy runs between the flat buffers and the per-parameter tensors.

        One int64 row ``(param, tensor_start, flat_start, n_valid, n_total)`` per run:
        ``n_valid`` elements of parameter ``param`` starting at ``tensor_start`` (flat index into
        the full tensor, or into the shard) sit at ``flat_start``, followed by ``n_total - n_valid``
        padding elements. ``rank=None``: one run per (parameter, rank) between full tensors and the
        whole buffer; ``rank=r``: one run per parameter between ``r``'s shards and ``r``'s slot
        (``flat_start`` relative to the slot).
        """
        rows = []
        ranks = range(self.world_size) if rank is None else (rank,)
        for r in ranks:
            base = 0 if rank is not None else r * self.slot_numel
            for i in range(self.num_params):
                tensor_start = 0 if rank is not None else r * self.chunk_numels[i]
                rows.append(
                    (i, tensor_start, base + self.slot_offsets[i], self.shard_numel(i, r), self.padded_numels[i])
                )
        return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


@functools.lru_cache(maxsize=256)
def _layout_from_spec(spec: tuple[int, ...]) -> ShardLayout:
    malformed = ValueError(
        f"spec must be (world_size, N, then per parameter ndim followed by its dims), as in ShardLayout.spec; "
        f"got {spec!r}"
    )
    if len(spec) < 2 or spec[1] < 0:
        raise malformed
    world_size, n = spec[0], spec[1]
    shapes, pos = [], 2
    for _ in range(n):
        if pos >= len(spec) or spec[pos] < 0 or pos + 1 + spec[pos] > len(spec):
            raise malformed
        ndim = spec[pos]
        shapes.append(spec[pos + 1 : pos + 1 + ndim])
        pos += 1 + ndim
    if pos != len(spec):
        raise malformed
    return ShardLayout(shapes, world_size)
