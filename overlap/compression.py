"""Compression: what the sharded runtime's collectives put on the link (opt-in, ``overlap.shard(compress=...)``).

[Note: compressed collectives]
When training is bound by the link, hiding communication stops paying: the step is the link time.
``Compression`` cuts the bytes, after DeepSpeed ZeRO++:

* ``gather="int8"`` (qwZ): the all-gather's copy-in quantizes this rank's shards in blocks of
  ``block`` elements (int8 codes plus a float32 scale per block, one launch:
  ``overlap_kernels.quantized_copy_in``); the copy-out dequantizes into the unsharded parameters in
  ``param_dtype`` (``overlap_kernels.quantized_all_gather_copy_out``). The shards (the optimizer's master
  copy) stay exact, and so do state dicts and checkpoints: only what travels is quantized. Bytes on
  the link: ``(1 + 4 / block) / itemsize`` of the uncompressed gather's (0.508x of bf16's at 256).
* ``gather="fp8"``: the same, with float8_e4m3fn codes (scale ``absmax / 448``) instead of int8
  ones: the same bytes on the link, a different error. int8 spreads ``2 * 127`` even steps over
  ``[-absmax, absmax]`` (error <= ``absmax / 254`` for every element, small elements lose their
  relative precision); e4m3 keeps 3 mantissa bits for each element (error <= ``|x| / 17``, down to
  ``absmax / 28672``): larger for the largest elements of a block, far smaller for the small ones
  ([Note: the per-block error bound] in ``overlap_kernels/block_quantization.py``). What training makes of
  it is measured in ``benchmarks/RESULTS.md`` (``bench_fp8_gather.py``). The kernels encode e4m3 in
  integer arithmetic, so it runs on any GPU (no sm89 needed) and under the interpreter.
* ``reduce="int8"`` (qgZ): the gradients are quantized per block into one quantized slot per rank
  and sent with an ``all_to_all_single`` to each slot's owner, which dequantizes the ``w`` versions
  of its slot and sums them in float32 in rank order in its copy-out
  (``overlap_kernels.quantized_reduce_scatter_copy_out``), then averages, casts and accumulates into
  ``.grad`` in the same pass. Quantization error does not compound over a ring: each gradient is
  quantized once. Bytes: ``(1 + 4 / block) / 4`` of a float32 reduce-scatter's (0.254x at 256).
  The sum is float32 whatever ``MixedPrecision.reduce_dtype`` says (it only rounds what is
  quantized: nothing, here), so fp16's overflow of [Note: fp16 gradients are averaged before they
  are summed] cannot happen.
* ``reduce="fp8"``: the same reduction with float8_e4m3fn codes (scale ``absmax / 448``), the same
  bytes as int8's, the same kernels (``QuantizedLayout(..., format="fp8")``), the same float32 sum in
  rank order by the owner, the same non-finite rule; each gradient element within ``|x| / 17 +
  scale / 1024`` of its value per quantization (int8: ``absmax / 254``), so small gradients keep
  their relative precision and the largest of a block lose more. Measured: one reduction's relative
  error 2.3-2.5% against int8's 0.8% (tests/shard/test_gradient_error.py), 2.4-2.9% per step on
  the client models against int8's 0.9-1.25%, and their held-out loss after 300 steps +2.83%
  (nanoGPT) / -0.60% (Llama) from exact against int8's +0.57% / +0.05% (``benchmarks/RESULTS.md``):
  int8 stays the default.

Per-element error of one int8 quantization: at most ``absmax / 254`` of its block (fp8: ``|x| / 17
+ scale / 1024``; plus rounding slack: [Note: the per-block error bound] in ``overlap_kernels/block_quantization.py``). Non-finite values:
a block holding a NaN or inf is sent with a NaN scale and arrives as NaN in every element, never as
a finite value; a gathered NaN block is an error (``ValueError``) on every rank at the copy-out on
CPU (every rank receives every slot, so every rank raises alike), and a NaN gradient block spreads
as NaN to its owner (as an exact reduction spreads it), which ``overlap.set_check_finite`` reports.

How far a compressed reduction moves the gradients: ``overlap.measure_gradient_error`` (an exact
reduce-scatter beside each all-to-all, compared by the owner; ``overlap/gradient_error.py``).
``overlap.fully_shard`` takes ``compress`` as ``overlap.shard`` does (``check_compression``).

HSDP (a 2-D mesh): ``reduce="int8"`` (or ``"fp8"``) compresses the inter-node tier only, the sum
over the replicas; the shard group's reduce-scatter stays exact ([Note: compressing the inter-node tier] in
``overlap/param_group.py``). ``gather="int8"`` (or ``"fp8"``) quantizes the shard group's all-gather
(inside a node; HSDP gathers nothing across the replicas) exactly as on a 1-D mesh: the replicas hold
bitwise equal shards, so they quantize them to the same bytes and unshard bitwise equal parameters. It pays where
the intra-node link is a bound too (PCIe nodes, or a comm-bound step); ``Compression(gather=None,
reduce="int8")`` leaves the fast tier exact. The gradient error measurement covers the replica sum
(an exact float32 all-reduce over the replicas beside it).

Tensor-parallel parameters (2-D parallelism: ``overlap.shard`` over the dp dim of a mesh whose
other dim carries tensor parallelism, [Note: sharding tensor-parallel parameters] in
``overlap/param_group.py``): what is compressed is what the runtime moves over dp, the all-gather and
the reduction of each parameter's TP-local tensor, on the same layouts as plain parameters (blocks
are cut per parameter, so a TP-local tensor is a parameter like any other). The TP collectives
(DTensor's, and the exact all-reduce over tp of a replicated parameter's ``Partial()`` gradient
before the dp reduction) are not touched. The tp ranks of a parameter that TP replicates quantize
bitwise equal tensors and sum in the same order, so they stay bitwise equal (tested, with HSDP + TP
too: tests/parallel/test_fsdp_tp_compression.py).

Not covered (``overlap.shard`` and ``overlap.fully_shard`` raise naming ``compress``):
non-floating-point parameters. At world size 1 nothing travels and nothing is quantized; a shard
group of one rank (HSDP on an ``(R, 1)`` mesh) gathers exactly for the same reason (its replica sum
is still compressed).

Why a separate argument and not a ``MixedPrecision`` field: mixed precision says which dtype each
stage *computes* in, and it is what the model sees; compression is a wire format, invisible to the
model (the unsharded parameters still come out in ``param_dtype``), lossy in a way a dtype is not
(per-block scales), and it has its own failure modes and limits. Keeping it apart keeps both
contracts short, and lets a compressed run change nothing else of an exact one's configuration.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from overlap_kernels.block_quantization import FORMATS
from overlap_kernels.quantized_layout import BLOCKS

__all__ = ["Compression", "check_compression"]

GATHER_FORMATS = FORMATS
"""The wire formats an all-gather may be compressed to."""

REDUCE_FORMATS = FORMATS
"""The wire formats a gradient reduction may be compressed to."""


@dataclasses.dataclass(frozen=True)
class Compression:
    """What the sharded collectives send: ``gather`` and ``reduce`` are each a format (``"int8"`` or
    ``"fp8"``) or None (exact); ``block`` is the number of elements sharing one scale (a power of two
    in 32..4096)."""

    gather: Optional[str] = "int8"
    reduce: Optional[str] = "int8"
    block: int = 256

    def __post_init__(self) -> None:
        for name, formats in (("gather", GATHER_FORMATS), ("reduce", REDUCE_FORMATS)):
            value = getattr(self, name)
            if value is not None and value not in formats:
                raise ValueError(f"Compression.{name} must be None or one of {formats}, got {value!r}")
        if isinstance(self.block, bool) or self.block not in BLOCKS:
            raise ValueError(f"Compression.block must be one of {BLOCKS}, got {self.block!r}")

    @property
    def any(self) -> bool:
        """Is any collective compressed?"""
        return self.gather is not None or self.reduce is not None


def check_compression(compress: object, caller: str) -> None:
    """``compress`` is None or a :class:`Compression`; else a TypeError naming ``caller``'s argument."""
    if compress is not None and not isinstance(compress, Compression):
        raise TypeError(f"{caller}: compress must be None or an overlap.Compression, got {type(compress).__name__}")
