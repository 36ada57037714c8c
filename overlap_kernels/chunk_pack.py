"""``chunk_pack``: pack every rank's rows of a tensor into a reduce-scatter chunk buffer, one launch,
with an optional ``* scale + bias`` epilogue.

``chunk_pack(buf, src, starts, lengths, dim, bias=None, scale=None)`` writes, for every rank ``j``,
``buf[j].narrow(dim, 0, lengths[j]) = src.narrow(dim, starts[j], lengths[j]) * scale + bias`` and
zeros in the rest of ``buf[j]`` (padding a reduction may sum: zeros keep it finite). The chunk
buffer is ``overlap_kernels.chunk_layout``'s. The epilogue runs in float32 and rounds once to ``buf``'s dtype:
``(src.float() * scale + bias.float()).to(dtype)``, a multiply then an add, each rounded to float32
(no fused multiply-add: compiled with ``enable_fp_fusion=False``), so it is bitwise the reference;
without an epilogue it is a pure copy. ``bias`` runs along the last dim (the features), which must
not be ``dim``.

Registered with ``torch.library.triton_op`` as ``torch.ops.overlap.chunk_pack`` (mutating ``buf``);
see ``overlap_kernels.chunk_place`` for why ``triton_op`` here. Triton on CUDA and under
``TRITON_INTERPRET=1``; otherwise the torch fallback.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from overlap_kernels import chunk_layout
from overlap_kernels._checks import check_dtype
from overlap_kernels._dtypes import TRITON_DTYPES
from overlap_kernels._jit import convert
from overlap_kernels.chunk_layout import use_triton as _use_triton

__all__ = ["chunk_pack", "chunk_pack_ref"]
OP = "chunk_pack"


@triton.jit
def _chunk_pack_kernel(buf_ptr, src_ptr, pieces_ptr, bias_ptr, scale, w, outer, n_src, width, inner, features,
                       HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr):
    offs, j, o, t, i, start, length, inside = chunk_layout.buffer_element(pieces_ptr, w, outer, width, inner, BLOCK)
    valid = inside & (t < length)
    value = tl.load(src_ptr + (o * n_src + start + t) * inner + i, mask=valid, other=0)
    if HAS_SCALE or HAS_BIAS:
        x = convert(value, tl.float32)
        if HAS_SCALE:
            x = x * scale
        if HAS_BIAS:
            x = x + convert(tl.load(bias_ptr + i % features, mask=valid, other=0), tl.float32)
        value = convert(x, DT)
    value = tl.where(valid, value, tl.zeros_like(value))
    tl.store(buf_ptr + offs, value, mask=inside)


def _pack_torch(buf: torch.Tensor, src: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                bias: Optional[torch.Tensor], scale: Optional[float]) -> None:
    width = buf.shape[dim + 1]
    for j, (s, n) in enumerate(zip(starts, lengths)):
        rows = src.narrow(dim, s, n)
        if scale is not None or bias is not None:
            x = rows.float()
            if scale is not None:
                x = x * scale
            if bias is not None:
                x = x + bias.float()
            rows = x.to(buf.dtype)
        buf[j].narrow(dim, 0, n).copy_(rows)
        if n < width:
            buf[j].narrow(dim, n, width - n).zero_()


class _KernelCall:
    """One launch: the kernel, its arguments and grid (what ``test_aot_compile`` compiles)."""

    def __init__(self, buf: torch.Tensor, src: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                 bias: Optional[torch.Tensor], scale: Optional[float], extents: tuple[int, int, int]) -> None:
        outer, width, inner = extents
        self.kernel = _chunk_pack_kernel
        total = buf.numel()
        block = chunk_layout.launch_block(total, buf.device)
        self.grid = (triton.cdiv(max(total, 1), block),)
        pieces = chunk_layout.pieces_tensor(starts, lengths, buf.device)
        features = src.shape[-1]
        self.args = (buf, src, pieces, bias if bias is not None else pieces, 1.0 if scale is None else float(scale),
                     buf.shape[0], outer, src.shape[dim], width, inner, features)
        self.kwargs = {"HAS_BIAS": bias is not None, "HAS_SCALE": scale is not None,
                       "DT": TRITON_DTYPES[buf.dtype], "BLOCK": block}

    def arguments(self) -> tuple[tuple, dict]:
        return self.args, {**self.kwargs, "enable_fp_fusion": False}


def _check(buf: object, src: object, starts: object, lengths: object, dim: object, bias: object,
           scale: object) -> tuple[int, int, int]:
    extents = chunk_layout.check(OP, "src", src, buf, starts, lengths, dim)
    assert isinstance(src, torch.Tensor)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{OP}: scale must be None or a float, got {type(scale).__name__}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{OP}: bias must be None or a torch.Tensor, got {type(bias).__name__}")
        check_dtype(OP, "bias.dtype", bias.dtype)
        if bias.dim() != 1 or bias.shape[0] != src.shape[-1] or bias.device != src.device or not bias.is_contiguous():
            raise ValueError(f"{OP}: bias must be a contiguous 1-D tensor of src's last dim ({src.shape[-1]}) on "
                             f"{src.device}, got shape {tuple(bias.shape)} on {bias.device}")
        if dim == src.dim() - 1:
            raise ValueError(f"{OP}: with a bias, dim must not be the last (feature) dim {dim}")
    return extents


@torch.library.triton_op("overlap::chunk_pack", mutates_args={"buf"})
def _chunk_pack_op(buf: torch.Tensor, src: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                   bias: Optional[torch.Tensor], scale: Optional[float]) -> None:
    extents = _check(buf, src, starts, lengths, dim, bias, scale)
    if buf.numel() == 0:
        return
    if _use_triton([buf, src]):
        call = _KernelCall(buf, src, starts, lengths, dim, bias, scale, extents)
        chunk_layout.launch(call.kernel, call.grid, *call.arguments())
    else:
        _pack_torch(buf, src, starts, lengths, dim, bias, scale)


def chunk_pack(buf: torch.Tensor, src: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
               bias: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> None:
    """Pack every rank's rows of ``src`` into the chunk buffer ``buf`` (in place), zero-padded, with
    ``* scale + bias`` applied on the way (each optional).

    ``src``: contiguous ``(*lead, N, *rest)``; ``buf``: contiguous ``(w, *lead, width, *rest)``, same
    dtype and device; ``starts``/``lengths``: ``w`` ints (piece ``j`` = rows ``[starts[j], starts[j] +
    lengths[j])`` of dim ``dim``); ``bias``: 1-D over ``src``'s last dim; ``scale``: a float.
    Raises ``TypeError`` / ``ValueError`` naming the argument before writing anything.
    """
    _check(buf, src, starts, lengths, dim, bias, scale)
    torch.ops.overlap.chunk_pack(buf, src, list(starts), list(lengths), dim, bias,
                                 None if scale is None else float(scale))


def chunk_pack_ref(buf: torch.Tensor, src: torch.Tensor, starts: list[int], lengths: list[int], dim: int,
                   bias: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """The pure-torch reference: a new buffer like ``buf``, packed."""
    out = torch.empty_like(buf)
    _pack_torch(out, src, list(starts), list(lengths), dim, bias, scale)
    return out
