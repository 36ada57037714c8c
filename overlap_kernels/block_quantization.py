"""Block quantization to int8 or fp8 (e4m3): the arithmetic, once in Triton and once in torch, bit for bit alike.

Contract: a *block* is ``Q`` consecutive float32 values ``x``. Quantizing it gives ``Q`` one-byte
codes ``q`` and one float32 ``scale``; dequantizing gives ``value(q) * scale`` in float32. Two
formats (``FORMATS``), the same bytes (one per element, four per block):

===========================  =============================================================
``absmax``                   ``max |x|`` over the block; ``inf`` if any value is NaN or inf
``scale``                    ``absmax / QMAX`` (IEEE division, round to nearest even); NaN for
                             a non-finite block. ``QMAX``: 127 (int8), 448 (fp8: e4m3's largest
                             finite value, so the block's largest magnitude maps onto it)
``q`` (``"int8"``)           ``clamp(round_half_even(x / scale), -127, 127)`` as an int8
``q`` (``"fp8"``)            ``clamp(x / scale, -448, 448)`` rounded to float8_e4m3fn (round to
                             nearest even, subnormals included), its byte as an int8
                             (``torch.float8_e4m3fn``'s encoding: sign, 4 exponent bits with bias
                             7, 3 mantissa bits)
both                         ``q`` is 0 where ``scale`` is 0 (an all-zero block) or the block is
                             non-finite
dequantized                  ``value(q) * scale`` (float32): 0 for a zero block, NaN in every
                             element of a non-finite block (never a finite value)
===========================  =============================================================

[Note: the per-block error bound]
int8: for a finite block, ``|x - q * scale| <= absmax / 254 * (1 + 2**-14) + 2**-143``. With ``u =
2**-24`` (float32's unit roundoff): ``scale = absmax / 127 * (1 + d0)``, ``|d0| <= u``, so half a
step is ``absmax / 254 * (1 + u)`` (a tie, ``x / scale = k + 1/2``, does reach it: tested); ``x /
scale`` is rounded (``|x| * u`` after multiplying back by ``scale``) and so is the product ``q *
scale`` (``<= absmax * (1 + u) * u``): in all ``absmax / 254 * (1 + u + 254 u + 254 u + ...) <
absmax / 254 * (1 + 2**-14)``. The last term covers subnormal scales (``absmax < 127 * 2**-126``):
there ``scale`` is only within ``2**-150`` of ``absmax / 127``, so ``x / scale`` can exceed 127.5
(142.5 for ``absmax = 570 * 2**-149``, scale ``4 * 2**-149``), the clamp holds the code at 127, and
the largest elements are off by up to ``127 * 2**-150 < 2**-143`` (62 * 2**-149 there, tested; a first
version's ``2**-149`` did not cover it). For a normal scale the clamp never acts.
tests/packing/test_quantized_kernels.py checks it on every block it draws (a first version claimed
``1 + 2**-20``; Hypothesis found a tie that exceeds it).

fp8 (e4m3, 3 mantissa bits): for a finite block,
``|x - value(q) * scale| <= |x| / 17 * (1 + 2**-18) + scale / 1024 * (1 + 2**-20)`` (``+ 2**-140``
when ``scale`` is subnormal, ``absmax < 2**-117``). Derivation: ``c = clamp(fl(x / scale))`` is
within ``u |x / scale|`` of ``x / scale`` (the clamp only moves ``c`` towards ``x / scale``, which is
at most ``448 (1 + u)``). Rounding ``c`` to e4m3 moves it by at most half a step: for a normal
``|c|`` in ``[2**E, 2**(E+1))`` (``E >= -6``) the step is ``2**(E-3)``, and the error, at most
``2**(E-4)``, is largest relative to ``|c|`` at the tie ``2**E (1 + 1/16)``: ``|c| / 17`` (tested);
for a subnormal ``|c| < 2**-6`` the step is ``2**-9``, the error at most ``2**-10``. The product
rounds once more (``u``). Collected: ``|x| / 17 (1 + 36 u) + scale 2**-10 (1 + u)``. So each element
keeps its own relative precision, 1/17 (5.9%), down to ``absmax / 28672`` (e4m3's smallest normal
times the scale), and below it an absolute ``scale / 1024 = absmax / 458752``; the worst element
of a block is off by ``absmax / 17`` (int8: ``absmax / 254``, but no relative bound for small
elements: one below ``absmax / 254`` may come back as 0).
No value overflows to NaN: ``|x / scale| <= 448 (1 + u)**2`` for a normal scale (a subnormal one
can leave it far above: 570 for ``absmax = 570 * 2**-149``), and it is clamped to 448 before the
rounding (e4m3fn has no inf, and its only codes above 448, 0x7F / 0xFF, are NaN: never produced).
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
fp8: the kernels never use Triton's ``float8e4nv`` type. Its interpreter casts are wrong (Triton
3.6 and 3.9 alike: a mantissa that rounds up does not carry into the exponent, 31.6 -> 16.0; probed
2026-11-26), and on a GPU it needs sm89+. Instead the e4m3 code is integer arithmetic on the
float32 bits (``_e4m3_code``): a normal ``|c|`` is rounded to 3 mantissa bits with the same
round-to-nearest-even carry trick as ``_to_bf16_rtne`` in ``overlap_kernels/_jit.py`` (``(bits + 0x7FFFF +
((bits >> 20) & 1)) >> 20``, a carry bumps the exponent), then rebiased (127 -> 7); a subnormal one
by ``(|c| + 1.5 * 2**14) - 1.5 * 2**14`` (float32's step there is ``2**-9``, e4m3's subnormal step),
times 512; the sign is the float32 sign bit. Decoding is exact integer arithmetic too
(``_e4m3_value``). The torch fallback uses torch's own ``float8_e4m3fn`` casts (c10's round to
nearest even), an independent implementation: the bitwise tests between kernels and fallback
thereby check the encoding against torch's. It runs on any GPU (integer and float32 ops only).

[Note: decoding e4m3 without sign arithmetic]
``_e4m3_value`` reads the byte unsigned and builds the float32 bits with 32-bit ops: the magnitude
``m = byte & 0x7F``; a normal one (``m >= 8``) is ``(m << 20) + (960 << 20)``, a subnormal one the
float32 ``m * 2**-9`` (exact); the sign is OR'ed in as bit 31 (``-0.0`` for 0x80, as torch decodes
it). The first version sign-extended the byte, added 128 to negative codes and selected on the sign;
LLVM narrowed that to packed 16-bit integer arithmetic (PTX ``add.s16x2``, SASS ``VIADD.16x2``), and
on an H100 (Triton 3.6, 2026-11-27) the reduce-scatter copy-out at block 256, one block per program,
came out wrong in elements of partial blocks (the masked path) while the interpreter, int8 and the
other shapes were bitwise. The PTX of that decode reads correct; the root cause is not pinned down,
and this form was chosen so that no narrow or packed integer op is left to go wrong:
tests/packing/test_aot_compile.py checks that the quantized kernels' sm_90 code has none, and the GPU
test (``test_cuda_kernels_equal_the_torch_fallback``) is what proves the result.
"""
from __future__ import annotations

import torch
import triton.language as tl

from overlap_kernels._device_function import device_function

QMAX = 127
"""The largest int8 code used: symmetric, so -128 never appears and negation is exact."""

FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value: an fp8 block's scale is ``absmax / FP8_MAX``."""

FORMATS = ("int8", "fp8")
"""The codes a block can be quantized to (one byte per element, one float32 scale per block)."""


@device_function
def _e4m3_code(c):
    """int8 byte of float8_e4m3fn ``c`` rounded to nearest even, for float32 ``|c| <= 448`` (exact
    integer arithmetic: [Note: why the arithmetic is bitwise portable])."""
    bits = c.to(tl.int32, bitcast=True)
    a = tl.abs(c)
    abits = a.to(tl.int32, bitcast=True)
    # 960 = (127 - 7) << 3: float32's exponent bias minus e4m3's, in code units
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - 960
    # 24576 = 1.5 * 2**14, where float32's step is 2**-9, e4m3's subnormal step
    subnormal = (((a + 24576.0) - 24576.0) * 512.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, subnormal)  # 2**-6: e4m3's smallest normal
    return tl.where(bits < 0, code - 128, code).to(tl.int8)


@device_function
def _e4m3_value(q):
    """float32 value of the float8_e4m3fn byte ``q`` (int8), exactly: its float32 bits assembled
    from the byte's unsigned bits with 32-bit integer ops ([Note: decoding e4m3 without sign
    arithmetic])."""
    byte = q.to(tl.uint8, bitcast=True).to(tl.int32)  # 0..255: zero-extended, never sign-extended
    magnitude = byte & 0x7F
    # 0x3C000000 = 960 << 20: float32's exponent bias minus e4m3's, in code units, after the shift
    normal = (magnitude << 20) + 0x3C000000
    subnormal = (magnitude.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # 2**-9: e4m3's step
    bits = tl.where(magnitude >= 8, normal, subnormal) | ((byte & 0x80) << 24)  # the sign bit, -0.0 included
    return bits.to(tl.float32, bitcast=True)


@device_function
def quantize_rows(x, FP8: tl.constexpr):
    """``(q int8[R, Q], scale float32[R])`` of the float32 tile ``x`` ``[R, Q]``, each row a block
    (see the module's table; ``FP8``: e4m3 codes, else int8)."""
    finite = x == x
    finite = finite & (tl.abs(x) != float("inf"))
    absmax = tl.max(tl.where(finite, tl.abs(x), float("inf")), axis=1)
    if FP8:
        scale = tl.math.div_rn(absmax, 448.0)
    else:
        scale = tl.math.div_rn(absmax, 127.0)
    usable = (absmax != float("inf")) & (scale > 0.0)
    y = tl.math.div_rn(x, tl.where(usable, scale, 1.0)[:, None])
    if FP8:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        q = _e4m3_code(tl.where(usable[:, None], y, 0.0))
    else:
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds to an integer, half to even
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        q = tl.where(usable[:, None], y, 0.0).to(tl.int8)
    scale = tl.where(absmax != float("inf"), scale, float("nan"))
    return q, scale


@device_function
def dequantize_block(q, scale, FP8: tl.constexpr):
    """float32 ``value(q) * scale`` of one-byte codes ``q`` and their block's float32 ``scale``
    (a tile ``[R, Q]`` of blocks takes scales ``[R, 1]``)."""
    if FP8:
        value = _e4m3_value(q)
    else:
        value = q.to(tl.float32)
    return value * scale


def quantize_blocks_torch(x: torch.Tensor, lengths: torch.Tensor, element_block: torch.Tensor,
                          format: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8, scale float32[rows, B])`` of float32 rows ``x`` cut into ``B`` consecutive blocks
    of ``lengths`` elements (``element_block[k]``: the block of element ``k``), in ``format``,
    bitwise as ``quantize_rows`` computes them on the same blocks (no gather into padded blocks:
    one ``segment_reduce`` for the absolute maxima, then elementwise ops on ``x`` as it lies)."""
    if lengths.numel() == 0:  # no blocks (only empty parameters)
        return x.to(torch.int8), x.new_zeros(x.shape[0], 0)
    fp8 = format == "fp8"
    # segment_reduce's max propagates NaN: a non-finite block's absmax is NaN or inf (the kernel's inf)
    absmax = torch.segment_reduce(x.abs(), "max", lengths=lengths.expand(x.shape[0], -1), axis=1)
    finite = torch.isfinite(absmax)
    scale = absmax / (FP8_MAX if fp8 else QMAX)
    usable = finite & (scale > 0)
    divisor = torch.where(usable, scale, 1.0).index_select(1, element_block)
    if fp8:
        y = x.div(divisor).clamp_(-FP8_MAX, FP8_MAX)
        # the kernel writes +0 for every element of an unusable block (a -0.0 would encode as 0x80)
        y = torch.where(usable.index_select(1, element_block), y, 0.0)
        q = y.to(torch.float8_e4m3fn).view(torch.int8)
    else:
        y = torch.round(x.div(divisor)).clamp_(-QMAX, QMAX)  # 0 in a zero block (or one whose scale underflows)
        if not bool(finite.all()):  # rare: zero the codes of non-finite blocks (one more pass)
            y = torch.where(finite.index_select(1, element_block), y, 0.0)
        q = y.to(torch.int8)
    return q, torch.where(finite, scale, torch.nan)


def dequantize_elements_torch(q: torch.Tensor, scale: torch.Tensor, format: str = "int8") -> torch.Tensor:
    """float32 ``value(q) * scale`` of one-byte codes ``q`` in ``format`` and each code's block
    scale ``scale`` (same shape)."""
    value = q.view(torch.float8_e4m3fn).to(torch.float32) if format == "fp8" else q.to(torch.float32)
    return value * scale


def error_bound(absmax: torch.Tensor, x: torch.Tensor | None = None, format: str = "int8") -> torch.Tensor:
    """[Note: the per-block error bound] of one quantization, per element: the most ``|x -
    dequantized|`` can be for elements ``x`` of finite blocks whose absolute maxima are ``absmax``
    (broadcast alike; ``x`` is needed for fp8, whose bound is relative)."""
    if format == "int8":
        return absmax / 254 * (1 + 2**-14) + 2**-143
    if format != "fp8" or x is None:
        raise ValueError(f"error_bound: format must be 'int8', or 'fp8' with x given, got {format!r}")
    return x.abs() / 17 * (1 + 2**-18) + absmax / FP8_MAX / 1024 * (1 + 2**-20) + 2**-140
