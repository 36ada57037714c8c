"""Block quantization to int8: the arithmetic, once in Triton and once in torch, bit for bit alike.

Contract: a *block* is ``Q`` consecutive float32 values ``x``. Quantizing it gives ``Q`` int8 codes
``q`` and one float32 ``scale``; dequantizing gives ``q * scale`` in float32:

===========================  =============================================================
``absmax``                   ``max |x|`` over the block; ``inf`` if any value is NaN or inf
``scale``                    ``absmax / 127`` (IEEE division, round to nearest even); NaN for a
                             non-finite block
``q``                        ``clamp(round_half_even(x / scale), -127, 127)``; 0 where
                             ``scale`` is 0 (an all-zero block) or the block is non-finite
dequantized                  ``q * scale`` (float32): 0 for a zero block, NaN in every element
                             of a non-finite block (never a finite value)
===========================  =============================================================

[Note: the per-block error bound]
For a finite block, ``|x - q * scale| <= absmax / 254 * (1 + 2**-14) + 2**-149``. With ``u =
2**-24`` (float32's unit roundoff): ``scale = absmax / 127 * (1 + d0)``, ``|d0| <= u``, so half a
step is ``absmax / 254 * (1 + u)`` (a tie, ``x / scale = k + 1/2``, does reach it: tested); ``x /
scale`` is rounded (``|x| * u`` after multiplying back by ``scale``) and so is the product ``q *
scale`` (``<= absmax * (1 + u) * u``): in all ``absmax / 254 * (1 + u + 254 u + 254 u + ...) <
absmax / 254 * (1 + 2**-14)``. The last term covers subnormal scales.
tests/packing/test_quantized_kernels.py checks it on every block it draws (a first version claimed
``1 + 2**-20``; Hypothesis found a tie that exceeds it).
Casting the dequantized value to a 16-bit ``param_dtype`` adds that cast's own rounding.

[Note: why the arithmetic is bitwise portable]
Every step is a correctly rounded IEEE float32 operation or exact: the absolute maximum and the
comparisons are exact; the two divisions are ``tl.math.div_rn`` in Triton (Triton's plain ``/``
may be an approximate division on a GPU) and torch's float32 division on CPU; the rounding to an
integer is ``(y + 1.5 * 2**23) - 1.5 * 2**23`` in Triton, exact round-half-even for ``|y| < 2**22``
(here ``|y| <= 127.5``), and ``torch.round`` (round-half-even) in torch; the product is one
multiplication (kernels are compiled with ``enable_fp_fusion=False``: no FMA contracts it into a
neighbour). Hence the kernels and the torch fallbacks agree bit for bit, on a GPU as under the
interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

QMAX = 127
"""The largest int8 code used: symmetric, so -128 never appears and negation is exact."""

_ROUNDER = 12582912.0  # 1.5 * 2**23


@triton.jit
def quantize_block(x):
    """``(q int8[Q], scale float32)`` of the float32 block ``x`` (see the module's table)."""
    finite = x == x
    finite = finite & (tl.abs(x) != float("inf"))
    absmax = tl.max(tl.where(finite, tl.abs(x), float("inf")), axis=0)
    scale = tl.math.div_rn(absmax, 127.0)
    usable = (absmax != float("inf")) & (scale > 0.0)
    y = tl.math.div_rn(x, tl.where(usable, scale, 1.0))
    y = (y + 12582912.0) - 12582912.0
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    q = tl.where(usable, y, 0.0).to(tl.int8)
    scale = tl.where(absmax != float("inf"), scale, float("nan"))
    return q, scale


@triton.jit
def dequantize_block(q, scale):
    """float32 ``q * scale`` of int8 codes ``q`` and their block's float32 ``scale``."""
    return q.to(tl.float32) * scale


def quantize_blocks_torch(x: torch.Tensor, lengths: torch.Tensor, element_block: torch.Tensor,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8, scale float32[rows, B])`` of float32 rows ``x`` cut into ``B`` consecutive blocks
    of ``lengths`` elements (``element_block[k]``: the block of element ``k``), bitwise as
    ``quantize_block`` computes them on the same blocks (no gather into padded blocks: one
    ``segment_reduce`` for the absolute maxima, then elementwise ops on ``x`` as it lies)."""
    if lengths.numel() == 0:  # no blocks (only empty parameters)
        return x.to(torch.int8), x.new_zeros(x.shape[0], 0)
    # segment_reduce's max propagates NaN: a non-finite block's absmax is NaN or inf (the kernel's inf)
    absmax = torch.segment_reduce(x.abs(), "max", lengths=lengths.expand(x.shape[0], -1), axis=1)
    finite = torch.isfinite(absmax)
    scale = absmax / QMAX
    divisor = torch.where(finite & (scale > 0), scale, 1.0).index_select(1, element_block)
    y = torch.round(x.div(divisor)).clamp_(-QMAX, QMAX)  # 0 in a zero block (or one whose scale underflows)
    if not bool(finite.all()):  # rare: zero the codes of non-finite blocks (one more pass)
        y = torch.where(finite.index_select(1, element_block), y, 0.0)
    return y.to(torch.int8), torch.where(finite, scale, torch.nan)


def dequantize_elements_torch(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` of int8 codes ``q`` and each code's block scale ``scale`` (same shape)."""
    return q.to(torch.float32) * scale
