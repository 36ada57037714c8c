"""``chunk_place``: put a landed all-gather chunk's pieces into the full operand, one launch.

``chunk_place(full, buf, starts, lengths, dim, skip=-1)`` writes, for every rank ``j != skip``,
``full.narrow(dim, starts[j], lengths[j]) = buf[j].narrow(dim, 0, lengths[j])`` (the chunk buffer of
``overlap_kernels.chunk_layout``; ``skip`` is this rank, whose piece is already in place, or -1). A pure
copy: bitwise the reference. Nothing else of ``full`` is written; padding in ``buf`` is never read.

Registered with ``torch.library.triton_op`` as ``torch.ops.overlap.chunk_place`` (mutating
``full``): unlike the N-tensor packing ops ([Note: why custom_op and not triton_op] in
``overlap_kernels.library``), its tensors are fixed arguments, so Inductor sees the Triton kernel itself and
can schedule it with the code around it. Triton runs on CUDA and under ``TRITON_INTERPRET=1`` on
CPU; otherwise the op runs the torch fallback (one ``copy_`` per piece).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from overlap_kernels import chunk_layout
from overlap_kernels.chunk_layout import use_triton as _use_triton

__all__ = ["chunk_place", "chunk_place_ref"]
OP = "chunk_place"


@triton.jit
def _chunk_place_kernel(full_ptr, buf_ptr, pieces_ptr, w, outer, n_full, width, inner, skip,
                        BLOCK: tl.constexpr):
    offs, j, o, t, i, start, length, inside = chunk_layout.buffer_element(pieces_ptr, w, outer, width, inner, BLOCK)
    valid = inside & (t < length) & (j != skip)
    value = tl.load(buf_ptr + offs, mask=valid)
    tl.store(full_ptr + (o * n_full + start + t) * inner + i, value, mask=valid)


def _place_torch(full: torch.Tensor, buf: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                 skip: int) -> None:
    for j, (s, n) in enumerate(zip(starts, lengths)):
        if j != skip and n:
            full.narrow(dim, s, n).copy_(buf[j].narrow(dim, 0, n))


class _KernelCall:
    """One launch: the kernel, its arguments and grid (what ``test_aot_compile`` compiles)."""

    def __init__(self, full: torch.Tensor, buf: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                 skip: int, extents: tuple[int, int, int]) -> None:
        outer, width, inner = extents
        self.kernel = _chunk_place_kernel
        self.total = buf.numel()
        block = chunk_layout.launch_block(self.total, buf.device)
        self.grid = (triton.cdiv(max(self.total, 1), block),)
        pieces = chunk_layout.pieces_tensor(starts, lengths, buf.device)
        self.args = (full, buf, pieces, buf.shape[0], outer, full.shape[dim], width, inner, skip)
        self.kwargs = {"BLOCK": block}

    def arguments(self) -> tuple[tuple, dict]:
        return self.args, dict(self.kwargs)


@torch.library.triton_op("overlap::chunk_place", mutates_args={"full"})
def _chunk_place_op(full: torch.Tensor, buf: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                    skip: int) -> None:
    extents = chunk_layout.check(OP, "full", full, buf, starts, lengths, dim)
    if buf.numel() == 0:
        return
    if _use_triton([full, buf]):
        call = _KernelCall(full, buf, starts, lengths, dim, skip, extents)
        chunk_layout.launch(call.kernel, call.grid, *call.arguments())
    else:
        _place_torch(full, buf, starts, lengths, dim, skip)


def chunk_place(full: torch.Tensor, buf: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                skip: int = -1) -> None:
    """Place every rank's piece of the chunk buffer ``buf`` but ``skip``'s into ``full`` (in place).

    ``full``: contiguous ``(*lead, N, *rest)``; ``buf``: contiguous ``(w, *lead, width, *rest)``, same
    dtype and device; ``starts``/``lengths``: ``w`` ints, piece ``j`` is rows ``[starts[j],
    starts[j] + lengths[j])`` of dim ``dim``; ``skip``: a rank in ``[0, w)`` or -1 (none).
    Raises ``TypeError`` / ``ValueError`` naming the argument before writing anything.
    """
    chunk_layout.check(OP, "full", full, buf, starts, lengths, dim)
    if isinstance(skip, bool) or not isinstance(skip, int) or not -1 <= skip < buf.shape[0]:
        raise ValueError(f"{OP}: skip must be -1 (none) or a rank in [0, {buf.shape[0]}), got {skip!r}")
    torch.ops.overlap.chunk_place(full, buf, list(starts), list(lengths), dim, skip)  # bumps full's version


def chunk_place_ref(full: torch.Tensor, buf: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                    skip: int = -1) -> torch.Tensor:
    """The pure-torch reference: a copy of ``full`` with the pieces placed."""
    out = full.clone()
    _place_torch(out, buf, list(starts), list(lengths), dim, skip)
    return out
