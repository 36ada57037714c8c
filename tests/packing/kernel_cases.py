"""What the packing-op tests share: world sizes, dtype cases, shapes, data with special values,
bitwise comparisons, first-principles expectations and the per-op checks, and the fixture that
fills uninitialized memory (NaN / max int) so unwritten padding is caught.

Used by ``test_kernels_ops.py`` (which documents the tolerances), ``test_kernels_library.py``,
``test_kernels_layout.py``, ``test_kernels_alignment.py``,
``test_kernels_torch_fallback.py`` and ``test_properties_kernels.py``; a module that uses the
fixture imports it (pytest then applies it to every test of that module).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from overlap_kernels import (
    ShardLayout,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    all_gather_copy_out,
    all_gather_copy_out_ref,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_ref,
    reduce_scatter_copy_out,
    reduce_scatter_copy_out_ref,
)

from overlap_kernels import _jit

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
i64, i32, i16, i8, u8 = torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8

def kernel_device() -> torch.device | None:
    """Where the packing ops launch their Triton kernels in this process: the CPU under
    ``TRITON_INTERPRET=1`` (conftest sets it without a GPU), else a GPU if one is visible, else
    nowhere (CPU tensors then take the torch fallback)."""
    if _jit.INTERPRET:
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else None


requires_kernels = pytest.mark.skipif(
    kernel_device() is None, reason="the Triton kernels run under TRITON_INTERPRET=1 (CPU) or on a CUDA device")
"""For tests of the kernel launch path itself (launch counts, device tables): they run on
:func:`kernel_device`."""

WORLD_SIZES = (1, 2, 3, 4, 8)
ALIGN = 16
# 0-dim, empty (both ways), 1 element, primes, rows not divisible by most world sizes, 1-D to 4-D
ODD_SHAPES: list[tuple[int, ...]] = [
    (), (0,), (1,), (2,), (7,), (13, 5), (10, 3), (0, 4), (4, 0), (5, 1), (3, 2, 5), (2, 3, 1, 5),
    (17, 1, 3), (1, 31), (41,), (37, 16),
]

# name: (dtypes of the parameter-side tensors, cycled over parameters; dtype of the flat buffer)
DTYPE_CASES: dict[str, tuple[tuple[torch.dtype, ...], torch.dtype]] = {
    "fp32": ((f32,), f32),
    "bf16": ((bf16,), bf16),
    "fp16": ((f16,), f16),
    "fp32-bf16": ((f32,), bf16),
    "bf16-fp32": ((bf16,), f32),
    "fp16-bf16": ((f16,), bf16),
    "bf16-fp16": ((bf16,), f16),
    "fp64-fp16": ((f64,), f16),
    "mixed-bf16": ((f32, bf16, f16), bf16),
    "mixed-fp32": ((f32, bf16, f16, f64), f32),
    "int64": ((i64,), i64),
    "int32": ((i32,), i32),
    "int16": ((i16,), i16),
    "int8": ((i8,), i8),
    "uint8": ((u8,), u8),
    "mixed-int-int32": ((i32, i16, i8, u8), i32),
    "int32-fp32": ((i32,), f32),
}
FLOAT_CASES = [name for name, (dts, buf) in DTYPE_CASES.items() if buf.is_floating_point and dts[0].is_floating_point]


@pytest.fixture(autouse=True)
def uninitialized_memory_is_filled() -> Iterator[None]:
    """``torch.empty`` returns NaN / the max int, so a padding element left unwritten is caught."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was_deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = was_filling


# ------------------------------------------------------------------------------------------ data
def make_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, *, specials: bool = True) -> torch.Tensor:
    """Random values; floats also hold NaNs (one with a payload), infinities, -0, subnormals, the
    dtype's max and 1/3, spread through the tensor."""
    gen = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, tuple(shape), generator=gen, dtype=dtype)
    x = torch.randn(tuple(shape), generator=gen, dtype=f64 if dtype == f64 else f32) * 8
    if specials and x.numel():
        info = torch.finfo(dtype)
        payload_nan = torch.tensor([0x7F800123], dtype=torch.int32).view(torch.float32).item()
        values = [math.nan, -math.nan, payload_nan, math.inf, -math.inf, -0.0,
                  info.smallest_normal / 4, -info.smallest_normal * 0.75, info.max, 1 / 3]
        flat = x.view(-1)
        for j, value in enumerate(values):
            flat[j :: len(values) + 5] = value
    return x.to(dtype)


def make_tensors(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], seed: int,
                 **kw: bool) -> list[torch.Tensor]:
    """One ``make_tensor`` per shape, dtypes cycled over the parameters."""
    return [make_tensor(s, dtypes[i % len(dtypes)], seed * 1000 + i, **kw) for i, s in enumerate(shapes)]


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Every bit equal (NaN payloads included)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    assert torch.equal(int_view(actual), int_view(expected)), (actual, expected)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal except the bit pattern of NaNs (positions must match): the contract of a cast."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    if actual.is_floating_point():
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), (actual, expected)
        actual, expected = actual.masked_fill(nan, 0), expected.masked_fill(nan, 0)
    assert torch.equal(int_view(actual), int_view(expected)), (actual, expected)


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """NaN/inf positions equal; finite values at most one representable step apart."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert torch.equal(actual[~finite & ~torch.isnan(actual)], expected[~finite & ~torch.isnan(expected)])
    a, e = int_view(actual[finite]).long(), int_view(expected[finite]).long()
    # same sign here (both are x / w rounded two ways); integer distance of the bit patterns = ulps
    steps = (a - e).abs()
    assert steps.numel() == 0 or int(steps.max()) <= 1, int(steps.max())


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, *, exact_bits: bool) -> None:
    (assert_bitwise if exact_bits else assert_same_values)(actual, expected)


# ----------------------------------------------------------------- first-principles expectations
def rows_of(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard by ``torch.chunk`` (0-dim tensors as shape ``(1,)``)."""
    rows = full.reshape(1) if full.dim() == 0 else full
    pieces = rows.chunk(world_size) if rows.shape[0] else ()
    return pieces[rank] if rank < len(pieces) else rows[rows.shape[0] :]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def region_numel(shape: Sequence[int], world_size: int) -> int:
    """A parameter's region in a slot: ``ceil(d / w)`` rows, rounded up to 16 elements."""
    rows = ceil_div(shape[0] if len(shape) else 1, world_size)
    return ceil_div(rows * math.prod(shape[1:]), ALIGN) * ALIGN


def region_offsets(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    regions = [region_numel(s, world_size) for s in shapes]
    return [sum(regions[:i]) for i in range(len(shapes))]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return f64 if f64 in dtypes else f32


def expected_slot(
    fulls: Sequence[torch.Tensor], world_size: int, rank: int, dtype: torch.dtype, scale: float | None = None
) -> torch.Tensor:
    """Rank ``rank``'s slot: each parameter's rows (scaled in float32 by the float32-rounded scale),
    cast, then zeros to the end of its region."""
    compute = compute_dtype(dtype, *(f.dtype for f in fulls))
    parts = []
    for full in fulls:
        x = rows_of(full, world_size, rank).reshape(-1)
        if scale is not None:
            x = x.to(compute) * float(np.float32(scale))
        parts += [x.to(dtype), torch.zeros(region_numel(full.shape, world_size) - x.numel(), dtype=dtype)]
    return torch.cat(parts)


def expected_fulls(buffer: torch.Tensor, shapes: Sequence[Sequence[int]], world_size: int,
                   dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Full parameters read back from a gathered buffer: every rank's rows, in rank order, cast."""
    slots = buffer.view(world_size, -1)
    fulls = []
    for i, (shape, offset) in enumerate(zip(shapes, region_offsets(shapes, world_size))):
        meta = torch.empty(shape, device="meta")
        counts = [rows_of(meta, world_size, r).numel() for r in range(world_size)]
        flat = torch.cat([slots[r, offset : offset + n] for r, n in enumerate(counts)])
        fulls.append(flat.view(shape).to(dtypes[i]))
    return fulls


def expected_shard_grads(slot: torch.Tensor, shard_grads: Sequence[torch.Tensor], world_size: int,
                         shapes: Sequence[Sequence[int]], scale: float | None, accumulate: bool) -> list[torch.Tensor]:
    out = []
    for grad, offset in zip(shard_grads, region_offsets(shapes, world_size)):
        x = slot[offset : offset + grad.numel()].view(grad.shape)
        if scale is not None or accumulate:
            compute = compute_dtype(slot.dtype, *(g.dtype for g in shard_grads))
            x = x.to(compute)
            if scale is not None:
                x = x * float(np.float32(scale))
            if accumulate:
                x = grad.to(compute) + x
        out.append(x.to(grad.dtype))
    return out


def simulated_all_gather(ag_inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([a.reshape(-1) for a in ag_inputs])


def is_plain_copy(dtypes: Sequence[torch.dtype], buffer_dtype: torch.dtype) -> bool:
    return all(d == buffer_dtype for d in dtypes)


def check_all_gather_copy_in(fulls: list[torch.Tensor], world_size: int, dtype: torch.dtype | None) -> None:
    layout = ShardLayout([tuple(f.shape) for f in fulls], world_size)
    buffer_dtype = dtype or fulls[0].dtype
    exact = is_plain_copy([f.dtype for f in fulls], buffer_dtype)
    for rank in range(world_size):
        shards = layout.shards(fulls, rank)
        ag_input, ag_output = all_gather_copy_in(shards, layout, rank, dtype)
        assert ag_output.shape == (layout.buffer_numel,) and ag_output.dtype == buffer_dtype
        assert ag_input.shape == (layout.slot_numel,)
        assert ag_input.data_ptr() == ag_output.data_ptr() + rank * layout.slot_numel * ag_output.element_size()
        assert_matches(ag_input, all_gather_copy_in_ref(shards, layout, rank, dtype)[0], exact_bits=exact)
        assert_matches(ag_input, expected_slot(fulls, world_size, rank, buffer_dtype), exact_bits=exact)


def check_all_gather_copy_out(shapes: list[tuple[int, ...]], world_size: int, out_dtypes: Sequence[torch.dtype],
                              buffer_dtype: torch.dtype, seed: int) -> None:
    layout = ShardLayout(shapes, world_size)
    dtypes = [out_dtypes[i % len(out_dtypes)] for i in range(len(shapes))]
    # random values everywhere, padding included: the copy-out must drop the padding. No NaN/inf
    # when casting to ints (float -> int of those is undefined behaviour, in torch and in Triton).
    buffer = make_tensor((layout.buffer_numel,), buffer_dtype, seed,
                         specials=all(d.is_floating_point for d in dtypes))
    exact = is_plain_copy(dtypes, buffer_dtype)
    expected = expected_fulls(buffer, shapes, world_size, dtypes)

    outs = [torch.full(s, 5, dtype=d) for s, d in zip(shapes, dtypes)]
    versions = [o._version for o in outs]
    returned = all_gather_copy_out(buffer, layout, outs)
    assert all(r is o for r, o in zip(returned, outs))  # written in place, the same objects returned
    assert all(o._version > v for o, v in zip(outs, versions) if o.numel())
    reference = all_gather_copy_out_ref(buffer, layout, [torch.empty_like(o) for o in outs])
    for out, ref, exp in zip(outs, reference, expected):
        assert_matches(out, ref, exact_bits=exact)
        assert_matches(out, exp, exact_bits=exact)

    if len(set(dtypes)) == 1:  # outs=None allocates them with dtype
        allocated = all_gather_copy_out(buffer, layout, dtype=dtypes[0])
        for out, exp in zip(allocated, expected):
            assert_matches(out, exp, exact_bits=exact)


def check_reduce_scatter_copy_in(grads: list[torch.Tensor], world_size: int, scale: float | None,
                                 dtype: torch.dtype | None) -> torch.Tensor:
    layout = ShardLayout([tuple(g.shape) for g in grads], world_size)
    buffer_dtype = dtype or grads[0].dtype
    exact = scale is None and is_plain_copy([g.dtype for g in grads], buffer_dtype)
    rs_input = reduce_scatter_copy_in(grads, layout, scale, dtype)
    assert rs_input.shape == (layout.buffer_numel,) and rs_input.dtype == buffer_dtype
    assert_matches(rs_input, reduce_scatter_copy_in_ref(grads, layout, scale, dtype), exact_bits=exact)
    expected = torch.cat([expected_slot(grads, world_size, r, buffer_dtype, scale) for r in range(world_size)])
    assert_matches(rs_input, expected, exact_bits=exact)
    return rs_input


MODES = {"copy": (None, False), "scale": (0.3, False), "accumulate": (None, True), "scale+accumulate": (1 / 3, True)}


def check_reduce_scatter_copy_out(shapes: list[tuple[int, ...]], world_size: int, rank: int,
                                  grad_dtypes: Sequence[torch.dtype], slot_dtype: torch.dtype, mode: str,
                                  seed: int) -> None:
    layout = ShardLayout(shapes, world_size)
    scale, accumulate = MODES[mode]
    rs_output = make_tensor((layout.slot_numel,), slot_dtype, seed,
                            specials=all(d.is_floating_point for d in grad_dtypes))  # no float -> int UB
    shard_shapes = layout.shard_shapes(rank)
    shard_grads = make_tensors(shard_shapes, grad_dtypes, seed + 1)
    before = [g.clone() for g in shard_grads]
    versions = [g._version for g in shard_grads]
    exact = mode == "copy" and is_plain_copy([g.dtype for g in shard_grads], slot_dtype)

    assert reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, scale, accumulate) is None
    assert all(g._version > v for g, v in zip(shard_grads, versions) if g.numel())
    reference = [g.clone() for g in before]
    reduce_scatter_copy_out_ref(rs_output, reference, layout, rank, scale, accumulate)
    expected = expected_shard_grads(rs_output, before, world_size, shapes, scale, accumulate)
    for grad, ref, exp in zip(shard_grads, reference, expected):
        assert_matches(grad, ref, exact_bits=exact)
        assert_matches(grad, exp, exact_bits=exact)


# Each op's public function and its pure-torch reference (the same signature).
PUBLIC_AND_REFERENCE = {
    "all_gather_copy_in": (all_gather_copy_in, all_gather_copy_in_ref),
    "all_gather_copy_out": (all_gather_copy_out, all_gather_copy_out_ref),
    "reduce_scatter_copy_in": (reduce_scatter_copy_in, reduce_scatter_copy_in_ref),
    "reduce_scatter_copy_out": (reduce_scatter_copy_out, reduce_scatter_copy_out_ref),
}


def call_public_op(op: str, layout: ShardLayout, rank: int, t: dict[str, list[torch.Tensor]], *, pre_scale: float,
                   post_scale: float, reference: bool = False) -> list[torch.Tensor]:
    """The public op on ``t`` (``shards``, ``ag_output``, ``outs``, ``fulls``, ``slot``, ``grads``;
    bf16 buffers, the copy-out accumulating), or with ``reference`` its pure-torch reference on CPU
    copies of ``t``; returns what it wrote (this rank's slot for the all-gather copy-in)."""
    fn = PUBLIC_AND_REFERENCE[op][reference]
    if reference:
        t = {k: [x.cpu().clone() for x in v] for k, v in t.items()}
    if op == "all_gather_copy_in":
        return [fn(t["shards"], layout, rank, torch.bfloat16)[0]]
    if op == "all_gather_copy_out":
        return fn(t["ag_output"][0], layout, t["outs"])
    if op == "reduce_scatter_copy_in":
        return [fn(t["fulls"], layout, pre_scale, torch.bfloat16)]
    fn(t["slot"][0], t["grads"], layout, rank, post_scale, True)
    return t["grads"]
