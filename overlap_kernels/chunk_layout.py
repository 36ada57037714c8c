"""The chunk buffer of a decomposed tensor-parallel collective, shared by ``overlap_kernels.chunk_place``
and ``overlap_kernels.chunk_pack``.

A decomposed all-gather or reduce-scatter along a tensor's dim ``d`` moves, per chunk, one piece of
every rank's slice: rank ``j``'s piece is rows ``[starts[j], starts[j] + lengths[j])`` of dim ``d``
of the *full* tensor (shape ``(*lead, N, *rest)``), and it travels in row ``j`` of the *chunk
buffer* (shape ``(w, *lead, width, *rest)``), in its first ``lengths[j]`` rows along ``d``; the rest
of a buffer row is padding (``width`` is the longest piece). Both kernels see the full tensor as
``(outer, N, inner)`` and the buffer as ``(w, outer, width, inner)``, with ``outer`` the product of
the dims before ``d`` and ``inner`` of those after, and walk the buffer's elements.

Contract: :func:`check` validates the arguments of either op (``TypeError`` / ``ValueError`` naming
the op and the argument, before anything is written) and returns the three extents;
:func:`pieces_tensor` is the ``(2, w)`` int64 table ``[starts; lengths]`` the kernels read, built
once per (device, pieces) and cached (its contents are a function of the key); :func:`launch`
launches either op's kernel so that tracing sees it, on every supported torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from overlap_kernels._checks import check_dtype
from overlap_kernels._device_function import device_function
from overlap_kernels._jit import INTERPRET
from overlap_kernels._launch import triton_enabled
from overlap_kernels.layout import next_power_of_two
from overlap_kernels.library import use_dispatcher

_PIECES_CACHE: dict[tuple, torch.Tensor] = {}
_PIECES_CACHE_SIZE = 256


def _ints(op: str, name: str, values: object, w: int) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in values):
        raise TypeError(f"{op}: {name} must be a list of {w} ints (one per rank), got {values!r}")
    if len(values) != w or any(v < 0 for v in values):
        raise ValueError(f"{op}: {name} must hold {w} ints >= 0 (one per rank: the chunk buffer's dim 0 is {w}), "
                         f"got {list(values)}")
    return tuple(values)


def check(op: str, full_name: str, full: object, buf: object, starts: object, lengths: object,
          dim: object) -> tuple[int, int, int]:
    """Check a full tensor, a chunk buffer, the pieces and the dim; return ``(outer, width, inner)``."""
    for name, t in ((full_name, full), ("buf", buf)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        check_dtype(op, f"{name}.dtype", t.dtype)
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    assert isinstance(full, torch.Tensor) and isinstance(buf, torch.Tensor)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int in [0, {full.dim()}), got {type(dim).__name__}")
    if not 0 <= dim < full.dim():
        raise ValueError(f"{op}: dim must be an int in [0, {full.dim()}) ({full_name} has {full.dim()} dims), got {dim}")
    if full.dtype != buf.dtype or full.device != buf.device:
        raise ValueError(f"{op}: buf must have {full_name}'s dtype and device ({full.dtype}, {full.device}), got "
                         f"{buf.dtype}, {buf.device}")
    if buf.dim() != full.dim() + 1 or buf.shape[0] < 1:
        raise ValueError(f"{op}: buf must have shape (w, *{full_name}.shape with width at dim {dim}), got "
                         f"{tuple(buf.shape)} for {full_name} {tuple(full.shape)}")
    w, width = buf.shape[0], buf.shape[dim + 1]
    want = (*full.shape[:dim], width, *full.shape[dim + 1:])
    if tuple(buf.shape[1:]) != tuple(want):
        raise ValueError(f"{op}: buf must have shape (w, *{full_name}.shape with width at dim {dim}) = "
                         f"{(w, *want)}, got {tuple(buf.shape)}")
    starts_ = _ints(op, "starts", starts, w)
    lengths_ = _ints(op, "lengths", lengths, w)
    n = full.shape[dim]
    for j, (s, length) in enumerate(zip(starts_, lengths_)):
        if length > width or s + length > n:
            raise ValueError(f"{op}: piece {j} (starts[{j}]={s}, lengths[{j}]={length}) must fit in buf's width "
                             f"{width} and in {full_name}'s dim {dim} of size {n}")
    return math.prod(full.shape[:dim]), width, math.prod(full.shape[dim + 1:])


def pieces_tensor(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[starts; lengths]`` as a ``(2, w)`` int64 tensor on ``device`` (cached per key)."""
    key = (device, tuple(starts), tuple(lengths))
    table = _PIECES_CACHE.get(key)
    if table is None:
        if len(_PIECES_CACHE) >= _PIECES_CACHE_SIZE:
            _PIECES_CACHE.clear()
        table = torch.tensor([list(starts), list(lengths)], dtype=torch.int64).to(device)
        _PIECES_CACHE[key] = table
    return table


def launch_block(total: int, device: torch.device) -> int:
    """Elements per program: 1024 on a GPU; under the interpreter up to 64K (it pays per program)."""
    if device.type == "cuda":
        return 1024
    return max(16, min(1 << 16, next_power_of_two(total)))


def use_triton(tensors: Sequence[torch.Tensor]) -> bool:
    """Launch the Triton kernel (else the torch fallback): on CUDA unless interpreted, on CPU under
    ``TRITON_INTERPRET=1``, but not while the op is traced under the interpreter (an interpreted
    kernel cannot run on fake tensors; the trace records the fallback's torch ops instead)."""
    if not triton_enabled(tensors[0].device):
        return False
    return not (INTERPRET and use_dispatcher(tensors))


def launch(kernel: Any, grid: tuple[int, ...], args: Sequence[object], kwargs: dict[str, object]) -> None:
    """Launch ``kernel[grid](*args, **kwargs)`` from inside a ``triton_op``, through
    ``torch.library.wrap_triton`` so that tracing records the kernel itself.

    Under ``TRITON_INTERPRET=1``, ``triton.jit`` makes an ``InterpretedFunction``, not a
    ``JITFunction``: torch 2.13+ hands it back unwrapped, torch 2.11 refuses it ("wrap_triton only
    works on functions annotated with triton.jit"). It is launched as it is on every version (an
    interpreted kernel is never traced: see :func:`use_triton`).
    """
    if isinstance(kernel, JITFunction):
        kernel = torch.library.wrap_triton(kernel)
    kernel[grid](*args, **kwargs)


@device_function
def buffer_element(pieces_ptr, w, outer, width, inner, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` elements of a ``(w, outer, width, inner)`` chunk buffer: their flat
    offsets, and per element ``(o, t, i)`` (outer index, row within the piece, inner index), its
    piece's ``start`` in the full dim and ``length``, and whether it lies inside the buffer."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = offs % inner
    rest = offs // inner
    t = rest % width
    rest = rest // width
    o = rest % outer
    j = rest // outer
    inside = j < w
    start = tl.load(pieces_ptr + j, mask=inside, other=0)
    length = tl.load(pieces_ptr + w + j, mask=inside, other=0)
    return offs, j, o, t, i, start, length, inside
