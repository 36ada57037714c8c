"""``overlap_kernels.chunk_place`` and ``overlap_kernels.chunk_pack`` (the chunk buffers of tensor parallelism's
decomposed collectives) against their pure-torch references, bitwise: placing and packing are
copies, and the pack epilogue computes ``x * scale + bias`` in float32 with the same two roundings
as the reference, then one cast. Under ``TRITON_INTERPRET=1`` (this suite's CPU setting) the Triton
kernels run; compiled with ``torch.compile`` the ops trace (on CPU the trace records the fallback).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import overlap_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPE = (3, 10, 5)  # (lead, rows, features); the chunked dim is one of them
W = 3


def _pieces(n: int) -> tuple[list[int], list[int], int]:
    """Three ranks' pieces of an ``n``-row dim, uneven, the last empty when ``n`` is small."""
    per = -(-n // W)
    starts = [min(j * per, n) for j in range(W)]
    lengths = [max(0, min(per, n - s)) - 1 if j == 1 and per > 1 else max(0, min(per, n - s))
               for j, s in enumerate(starts)]  # rank 1's piece one row short: uneven widths
    return starts, lengths, max(max(lengths), 1)


def _case(dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    gen = torch.Generator().manual_seed(dim)
    full = torch.randn(SHAPE, generator=gen).to(dtype)
    starts, lengths, width = _pieces(SHAPE[dim])
    buf_shape = (W, *SHAPE[:dim], width, *SHAPE[dim + 1:])
    return full, torch.randn(buf_shape, generator=gen).to(dtype), starts, lengths


@pytest.mark.parametrize(("dim", "dtype", "skip"), list(itertools.product(range(3), DTYPES, (-1, 1))))
def test_chunk_place_matches_reference(dim: int, dtype: torch.dtype, skip: int) -> None:
    full, buf, starts, lengths = _case(dim, dtype)
    want = overlap_kernels.chunk_place_ref(full, buf, starts, lengths, dim, skip)
    overlap_kernels.chunk_place(full, buf, starts, lengths, dim, skip)
    assert torch.equal(full, want)


@pytest.mark.parametrize(("dim", "dtype", "epilogue"),
                         list(itertools.product(range(2), DTYPES, ("none", "scale", "bias", "both"))))
def test_chunk_pack_matches_reference(dim: int, dtype: torch.dtype, epilogue: str) -> None:
    src, buf, starts, lengths = _case(dim, dtype)
    buf.fill_(7)  # padding must come out zero
    bias = torch.randn(SHAPE[-1]).to(dtype) if epilogue in ("bias", "both") else None
    scale = 0.37 if epilogue in ("scale", "both") else None
    want = overlap_kernels.chunk_pack_ref(buf, src, starts, lengths, dim, bias, scale)
    overlap_kernels.chunk_pack(buf, src, starts, lengths, dim, bias, scale)
    assert torch.equal(buf, want)
    assert all(not buf[j].narrow(dim, n, buf.shape[dim + 1] - n).any() for j, n in enumerate(lengths))


def test_chunk_ops_compile_to_the_same_result() -> None:
    """Both ops are ``torch.library.triton_op``s: they trace whole (fullgraph) and give eager's bits."""
    src, buf, starts, lengths = _case(1, torch.float32)
    bias = torch.randn(SHAPE[-1])
    want = overlap_kernels.chunk_pack_ref(buf, src, starts, lengths, 1, bias, 0.5)
    full = torch.zeros(SHAPE)
    want_full = overlap_kernels.chunk_place_ref(full, want, starts, lengths, 1, 0)

    @torch.compile(fullgraph=True)
    def both(buf: torch.Tensor, src: torch.Tensor, full: torch.Tensor) -> None:
        overlap_kernels.chunk_pack(buf, src, starts, lengths, 1, bias, 0.5)
        overlap_kernels.chunk_place(full, buf, starts, lengths, 1, 0)

    both(buf, src, full)
    assert torch.equal(buf, want) and torch.equal(full, want_full)
    assert hasattr(torch.ops.overlap, "chunk_pack") and hasattr(torch.ops.overlap, "chunk_place")


def _bad(call: object, exc: type[Exception], *needles: str) -> None:
    with pytest.raises(exc) as info:
        call()  # type: ignore[operator]
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_bad_input_names_the_argument_and_writes_nothing() -> None:
    full, buf, starts, lengths = _case(1, torch.float32)
    before_full, before_buf = full.clone(), buf.clone()
    _bad(lambda: overlap_kernels.chunk_place(full, buf[:2], starts, lengths, 1), ValueError, "starts", "one per rank")
    _bad(lambda: overlap_kernels.chunk_place(full, buf.to(torch.complex64), starts, lengths, 1), TypeError, "buf.dtype")
    _bad(lambda: overlap_kernels.chunk_place(full, buf.half(), starts, lengths, 1), ValueError, "buf must have full's dtype")
    _bad(lambda: overlap_kernels.chunk_place(full, buf, starts, [9, 0, 0], 1), ValueError, "piece 0", "width")
    _bad(lambda: overlap_kernels.chunk_place(full, buf, starts[:2], lengths, 1), ValueError, "starts", "3 ints")
    _bad(lambda: overlap_kernels.chunk_place(full, buf, starts, lengths, 3), ValueError, "dim")
    _bad(lambda: overlap_kernels.chunk_place(full, buf, starts, lengths, 1, skip=3), ValueError, "skip")
    _bad(lambda: overlap_kernels.chunk_place(full, buf.transpose(2, 3), starts, lengths, 1), ValueError, "buf must be contiguous")
    src2, buf2, starts2, lengths2 = _case(2, torch.float32)  # chunked along the features
    _bad(lambda: overlap_kernels.chunk_pack(buf2, src2, starts2, lengths2, 2, bias=torch.zeros(5)), ValueError, "bias", "last")
    _bad(lambda: overlap_kernels.chunk_pack(buf, full, starts, lengths, 1, bias=torch.zeros(4)), ValueError, "bias", "(5)")
    _bad(lambda: overlap_kernels.chunk_pack(buf, full, starts, lengths, 1, scale="2"), TypeError, "scale")
    assert torch.equal(full, before_full) and torch.equal(buf, before_buf)
