"""The four packing ops against their torch references and against first-principles expectations.

Under ``TRITON_INTERPRET=1`` (set by conftest on CPU) the public functions launch the Triton kernels;
each result is compared with

* the op's ``*_ref`` (plain torch, one copy per rank and parameter; the batched torch fallback
  that the CPU runs without the interpreter equals it bitwise: ``test_kernels_torch_fallback``), and
* an expectation built here from the documented rules alone: ``torch.chunk`` for the dim-0 shards,
  regions of ``ceil(d / w)`` rows rounded up to 16 elements laid end to end, zeros in all padding,
  scales rounded to float32 and applied in float32 —
  so that a mistake shared by a kernel and its reference still fails.

Tolerances, and why:

* Copies without a cast keep every bit, NaN payloads included: compared as integer bit patterns.
* Casts are bitwise equal except for the bit pattern of a NaN, which torch itself does not fix
  (float32 NaN -> bfloat16 is 0xFFFF from torch's vectorized CPU copy, 0x7FC0 from its scalar path,
  0x7FFF on CUDA): NaN positions must match exactly, every other element bitwise.
* Scaling and accumulation are bitwise too (up to NaN patterns): kernel and reference both widen to
  float32, multiply by the float32-rounded scale and round once to the output dtype, in the same
  order (and Triton launches with ``enable_fp_fusion=False``, so no FMA). Against FSDP2's
  ``grad / world_size`` (a division, not a multiplication by ``fp32(1 / w)``) they agree bitwise
  when ``w`` is a power of two and within 1 ulp otherwise: ``fp32(1 / w)`` is within half an ulp
  of ``1 / w``, so the two float32 products are less than 1 ulp apart before rounding, and rounding
  (monotonic) keeps them within 1 ulp, in float32 and after the cast to a narrower dtype.

Uninitialized memory is filled (NaN / max int) for every test here, so padding a kernel forgets to
zero shows up. Element counts stay in the thousands: the interpreter pays per program.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from overlap_kernels import (
    ShardLayout,
    _launch,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    all_gather_copy_out,
    prepared_launch,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_ref,
    reduce_scatter_copy_out,
)

from kernel_cases import (  # the shared cases, data, expectations and checks
    kernel_device,
    requires_kernels,
    DTYPE_CASES,
    FLOAT_CASES,
    MODES,
    ODD_SHAPES,
    WORLD_SIZES,
    assert_bitwise,
    assert_matches,
    assert_same_values,
    assert_within_one_ulp,
    check_all_gather_copy_in,
    check_all_gather_copy_out,
    check_reduce_scatter_copy_in,
    check_reduce_scatter_copy_out,
    expected_fulls,
    expected_slot,
    make_tensor,
    make_tensors,
    rows_of,
    simulated_all_gather,
    uninitialized_memory_is_filled,  # noqa: F401  (autouse: torch.empty returns NaN / max int)
)

# The data holds inf, NaN and the dtypes' max on purpose (inf - inf, max * 2, bfloat16's max ->
# float16 ...); the interpreter computes with numpy, which warns about each.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
i64, i32, i16, i8, u8 = torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8

# ------------------------------------------------------------------------------- all_gather_copy_in
@pytest.mark.parametrize("case", ["fp32", "mixed-bf16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_copy_in_every_world_size_and_rank(world_size: int, case: str) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    fulls = make_tensors(ODD_SHAPES, dtypes, seed=world_size)
    check_all_gather_copy_in(fulls, world_size, None if case == "fp32" else buffer_dtype)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_all_gather_copy_in_dtypes(case: str) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    fulls = make_tensors(ODD_SHAPES, dtypes, seed=7)
    check_all_gather_copy_in(fulls, 3, buffer_dtype)


# ------------------------------------------------------------------------------ all_gather_copy_out
@pytest.mark.parametrize("case", ["fp32", "mixed-bf16"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_copy_out_every_world_size(world_size: int, case: str) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    check_all_gather_copy_out(ODD_SHAPES, world_size, dtypes, buffer_dtype, seed=world_size)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_all_gather_copy_out_dtypes(case: str) -> None:
    # the buffer has the case's buffer dtype; the outs the parameter dtypes (casting back)
    dtypes, buffer_dtype = DTYPE_CASES[case]
    check_all_gather_copy_out(ODD_SHAPES, 3, dtypes, buffer_dtype, seed=11)


def test_all_gather_copy_out_without_outs_defaults_to_the_buffer_dtype() -> None:
    layout = ShardLayout(ODD_SHAPES[:6], 2)
    buffer = make_tensor((layout.buffer_numel,), bf16, seed=3)
    outs = all_gather_copy_out(buffer, layout)
    for out, exp in zip(outs, expected_fulls(buffer, ODD_SHAPES[:6], 2, [bf16] * 6)):
        assert_bitwise(out, exp)


# --------------------------------------------------------------------------- reduce_scatter_copy_in
@pytest.mark.parametrize(("case", "divide"), [("fp32", False), ("fp32", True), ("fp32-bf16", True), ("mixed-fp32", True)])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_copy_in_every_world_size(world_size: int, case: str, divide: bool) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    grads = make_tensors(ODD_SHAPES, dtypes, seed=world_size)
    scale = 1 / world_size if divide else None
    rs_input = check_reduce_scatter_copy_in(grads, world_size, scale, buffer_dtype)
    if divide and case == "fp32-bf16":
        # FSDP2's unfused path divides: bitwise for powers of two, else within 1 ulp (module docstring)
        divided = torch.cat([expected_slot([g / world_size for g in grads], world_size, r, buffer_dtype)
                             for r in range(world_size)])
        if world_size & (world_size - 1) == 0:
            assert_same_values(rs_input, divided)
        else:
            assert_within_one_ulp(rs_input, divided)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_reduce_scatter_copy_in_dtypes(case: str) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    grads = make_tensors(ODD_SHAPES, dtypes, seed=13)
    check_reduce_scatter_copy_in(grads, 3, None, buffer_dtype)
    if case in FLOAT_CASES:
        check_reduce_scatter_copy_in(grads, 3, 0.1, buffer_dtype)


# -------------------------------------------------------------------------- reduce_scatter_copy_out
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_copy_out_every_world_size_and_rank(world_size: int, mode: str) -> None:
    grad_dtypes = (f32,) if mode == "copy" else (f32, bf16, f16)
    for rank in range(world_size):
        check_reduce_scatter_copy_out(ODD_SHAPES, world_size, rank, grad_dtypes, f32, mode, seed=world_size * 10 + rank)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_reduce_scatter_copy_out_dtypes(case: str) -> None:
    # the reduced slot has the case's buffer dtype; the sharded grads the parameter dtypes
    dtypes, slot_dtype = DTYPE_CASES[case]
    for rank, mode in [(0, "copy"), (2, "scale+accumulate" if case in FLOAT_CASES else "copy")]:
        check_reduce_scatter_copy_out(ODD_SHAPES, 3, rank, dtypes, slot_dtype, mode, seed=17 + rank)


# ------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize(("param_dtype", "comm_dtype"), [(f32, f32), (f32, bf16), (bf16, f32)])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_round_trip(world_size: int, param_dtype: torch.dtype, comm_dtype: torch.dtype) -> None:
    """copy-in on every rank, a simulated all-gather, copy-out: the full parameters come back."""
    fulls = make_tensors(ODD_SHAPES, (param_dtype,), seed=world_size)
    layout = ShardLayout(ODD_SHAPES, world_size)
    ag_inputs = [all_gather_copy_in(layout.shards(fulls, r), layout, r, comm_dtype)[0] for r in range(world_size)]
    outs = all_gather_copy_out(simulated_all_gather(ag_inputs), layout, [torch.empty_like(f) for f in fulls])
    for out, full in zip(outs, fulls):
        if comm_dtype == param_dtype or comm_dtype == f32:  # lossless
            assert_matches(out, full, exact_bits=comm_dtype == param_dtype)
        else:
            assert_same_values(out, full.to(comm_dtype).to(param_dtype))


def torch_reduce_scatter(grads_by_rank: Sequence[Sequence[torch.Tensor]], world_size: int, rank: int,
                         cast: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """What a reduce-scatter of the full grads gives ``rank``: the sum over ranks (in rank order),
    then ``rank``'s dim-0 shard."""
    out = []
    for i in range(len(grads_by_rank[0])):
        total = cast(grads_by_rank[0][i])
        for src in range(1, world_size):
            total = total + cast(grads_by_rank[src][i])
        out.append(rows_of(total, world_size, rank))
    return out


# 8 ranks (every rank's copy-in and copy-out, under the interpreter) runs "sum" in the default suite,
# the other variants under `slow`: they are checked at 1 to 4 ranks there.
@pytest.mark.parametrize(("world_size", "variant"), [
    pytest.param(w, v, marks=[pytest.mark.slow] if w == 8 and v != "sum" else [])
    for w in WORLD_SIZES for v in ("sum", "average", "bf16-comm")])
def test_reduce_scatter_round_trip(world_size: int, variant: str) -> None:
    """reduce_scatter_copy_in on every rank, a simulated reduce-scatter (sum over ranks, in rank
    order, float32), reduce_scatter_copy_out on every rank == sum of the full grads, sharded.

    Bitwise: the simulated reduction adds in the same order as the expectation, element by element.
    ``average`` is also compared with the mean (sum, then / w), which rounds differently: the two
    computations make ``4 w`` roundings between them (scale, products, partial sums, the division),
    each of at most half an eps of a value no bigger than ``max|g|`` (partial sums of the scaled
    grads stay below it), so they differ by less than ``atol = 2 w eps max|g|``.
    """
    shapes = ODD_SHAPES[:12] if world_size == 8 else ODD_SHAPES  # keep w * N programs per call modest
    layout = ShardLayout(shapes, world_size)
    grads_by_rank = [make_tensors(shapes, (f32,), seed=100 + src, specials=False) for src in range(world_size)]
    scale = 1 / world_size if variant == "average" else None
    comm = bf16 if variant == "bf16-comm" else f32
    rs_inputs = [reduce_scatter_copy_in(g, layout, scale, comm) for g in grads_by_rank]
    for rank in range(world_size):
        reduced = rs_inputs[0].view(world_size, -1)[rank].float()
        for src in range(1, world_size):
            reduced = reduced + rs_inputs[src].view(world_size, -1)[rank].float()
        shard_grads = [torch.empty(s) for s in layout.shard_shapes(rank)]
        reduce_scatter_copy_out(reduced, shard_grads, layout, rank)

        if variant == "average":
            s = float(np.float32(scale))
            expected = torch_reduce_scatter(grads_by_rank, world_size, rank, lambda g: g * s)
        elif variant == "bf16-comm":
            expected = torch_reduce_scatter(grads_by_rank, world_size, rank, lambda g: g.to(bf16).float())
        else:
            expected = torch_reduce_scatter(grads_by_rank, world_size, rank, lambda g: g)
        for got, exp in zip(shard_grads, expected):
            assert_bitwise(got, exp)
        if variant == "average":
            mean = torch_reduce_scatter(grads_by_rank, world_size, rank, lambda g: g)
            bound = max((g.abs().max().item() for gs in grads_by_rank for g in gs if g.numel()), default=0.0)
            for got, exp in zip(shard_grads, mean):
                torch.testing.assert_close(got, exp / world_size, rtol=0,
                                           atol=2 * world_size * torch.finfo(f32).eps * bound)


# -------------------------------------------------------------------------------- sizes and counts
@pytest.mark.parametrize("num_params", [1, 2, 3, 17, 64])
def test_parameter_counts(num_params: int) -> None:
    shapes = [ODD_SHAPES[(5 * i + 3) % len(ODD_SHAPES)] for i in range(num_params)]
    fulls = make_tensors(shapes, (f32, bf16), seed=num_params)
    check_all_gather_copy_in(fulls[:], 4, bf16)
    check_all_gather_copy_out(shapes, 4, (f32, bf16), bf16, seed=num_params)


THREE_HUNDRED_SHAPES = [((7 * i) % 23, 1 + i % 3) if i % 4 else (1 + (11 * i) % 29,) for i in range(300)]
THREE_HUNDRED_SHAPES[5] = ()


def test_three_hundred_parameters_all_gather_round_trip() -> None:
    """300 small parameters of odd shapes and four dtypes, one launch per op: copy-in on both ranks
    (against the reference), gather, copy-out == the parameters."""
    fulls = make_tensors(THREE_HUNDRED_SHAPES, (f32, bf16, f16, i16), seed=300)
    layout = ShardLayout(THREE_HUNDRED_SHAPES, 2)
    ag_inputs = []
    for rank in range(2):
        shards = layout.shards(fulls, rank)
        ag_input, _ = all_gather_copy_in(shards, layout, rank, f32)
        assert_same_values(ag_input, all_gather_copy_in_ref(shards, layout, rank, f32)[0])
        ag_inputs.append(ag_input)
    outs = all_gather_copy_out(simulated_all_gather(ag_inputs), layout, [torch.empty_like(f) for f in fulls])
    for out, full in zip(outs, fulls):
        # every dtype here widens losslessly to float32 and back (NaN patterns aside, see the top)
        assert_matches(out, full, exact_bits=full.dtype == f32)


def test_three_hundred_parameters_reduce_scatter() -> None:
    """300 small parameters of three float dtypes: scaled copy-in (against the reference), then the
    copy-out on both ranks undoes the scale: ``-0.0 + (g * 0.5) * 2 == g`` exactly for every ``g``
    (accumulating onto -0.0 keeps signed zeros)."""
    grads = make_tensors(THREE_HUNDRED_SHAPES, (f32, bf16, f16), seed=301)
    layout = ShardLayout(THREE_HUNDRED_SHAPES, 2)
    rs_input = reduce_scatter_copy_in(grads, layout, 0.5, f32)
    assert_same_values(rs_input, reduce_scatter_copy_in_ref(grads, layout, 0.5, f32))
    for rank in range(2):
        shard_grads = [torch.full(s, -0.0, dtype=g.dtype) for s, g in zip(layout.shard_shapes(rank), grads)]
        reduce_scatter_copy_out(rs_input.view(2, -1)[rank], shard_grads, layout, rank, 2.0, accumulate=True)
        for got, grad in zip(shard_grads, grads):
            assert_same_values(got, rows_of(grad, 2, rank).reshape(got.shape))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_runs_longer_than_a_block(world_size: int) -> None:
    """Runs over several blocks (the interpreter's blocks are up to 2**16 elements) and a run of
    exactly one full block take the unmasked path for all but their last block."""
    shapes = [(5000, 40), (3,), (2**16,), (129, 1)]
    fulls = make_tensors(shapes, (f32, bf16), seed=world_size, specials=False)
    layout = ShardLayout(shapes, world_size)
    assert _launch.block_table(layout, None, pad=False, device=torch.device("cpu")).num_blocks > len(shapes) * world_size
    check_all_gather_copy_in(fulls, world_size, f32)
    check_all_gather_copy_out(shapes, world_size, (f32, bf16), f32, seed=world_size)
    check_reduce_scatter_copy_in(fulls, world_size, 0.25, bf16)
    check_reduce_scatter_copy_out(shapes, world_size, world_size - 1, (f32, bf16), f32, "scale+accumulate", seed=5)


def test_all_parameters_empty() -> None:
    shapes = [(0,), (0, 3), (5, 0)]
    layout = ShardLayout(shapes, 4)
    assert layout.buffer_numel == 0
    fulls = [torch.empty(s) for s in shapes]
    ag_input, ag_output = all_gather_copy_in(layout.shards(fulls, 1), layout, 1)
    assert ag_input.shape == (0,) and ag_output.shape == (0,)
    outs = all_gather_copy_out(ag_output, layout)
    assert [o.shape for o in outs] == [torch.Size(s) for s in shapes]
    assert reduce_scatter_copy_in(fulls, layout, 0.5).shape == (0,)
    reduce_scatter_copy_out(torch.empty(0), layout.shards(fulls, 2), layout, 2, 0.5, True)


def test_non_contiguous_inputs_are_read_correctly() -> None:
    shapes = [(6, 5), (9, 4)]
    transposed = [make_tensor(s[::-1], f32, seed=i).t() for i, s in enumerate(shapes)]
    assert not any(t.is_contiguous() for t in transposed)
    contiguous = [t.contiguous() for t in transposed]
    layout = ShardLayout(shapes, 3)
    for rank in range(3):
        assert_bitwise(all_gather_copy_in(layout.shards(transposed, rank), layout, rank)[0],
                       expected_slot(contiguous, 3, rank, f32))
    assert_bitwise(reduce_scatter_copy_in(transposed, layout),
                   torch.cat([expected_slot(contiguous, 3, r, f32) for r in range(3)]))


def test_float64_to_float16_rounds_through_float32_like_torch() -> None:
    """torch converts float64 -> float16 via float32 (two roundings): 1 + 2**-11 + 2**-40 -> 1.0,
    where a single rounding would give 1 + 2**-10."""
    value = 1 + 2**-11 + 2**-40
    layout = ShardLayout([(3,)], 1)
    x = torch.full((3,), value, dtype=f64)
    assert x.to(f16)[0].item() == 1.0  # torch's own rule, which the kernels follow
    assert all_gather_copy_in([x], layout, 0, f16)[0][:3].tolist() == [1.0] * 3
    assert all_gather_copy_out(torch.full((16,), value, dtype=f64), layout, dtype=f16)[0].tolist() == [1.0] * 3


def test_bfloat16_subnormals_widen_exactly() -> None:
    # bfloat16 subnormals: 0x0001, 0x0002, 0x007F, 0x8001, 0x807F
    tiny = torch.tensor([1, 2, 0x7F, 0x8001 - 2**16, 0x807F - 2**16], dtype=torch.int16).view(bf16)
    layout = ShardLayout([(5,)], 1)
    assert_bitwise(all_gather_copy_in([tiny], layout, 0, f32)[0][:5], tiny.float())
    assert_bitwise(all_gather_copy_out(torch.cat([tiny, torch.zeros(11, dtype=bf16)]), layout, dtype=f32)[0],
                   tiny.float())


# ------------------------------------------------------------------------- device metadata caching
@requires_kernels
def test_device_tables_are_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady state (same layout, same tensors): no host -> device metadata copy, no new table."""
    copies: list[tuple[tuple[int, ...], ...]] = []
    real_to_device = _launch.to_device

    def counting_to_device(arrays: Sequence[np.ndarray], device: torch.device, *, cached: bool) -> object:
        copies.append(tuple(a.shape for a in arrays))
        return real_to_device(arrays, device, cached=cached)

    monkeypatch.setattr(_launch, "to_device", counting_to_device)
    shapes = ODD_SHAPES[:8]
    layout = ShardLayout(shapes, 3)
    fulls = [t.to(kernel_device()) for t in make_tensors(shapes, (f32,), seed=1)]
    shards = layout.shards(fulls, 1)
    shard_grads = [s.clone() for s in shards]
    outs = [torch.empty_like(f) for f in fulls]

    def step() -> None:
        _, ag_output = all_gather_copy_in(shards, layout, 1)
        all_gather_copy_out(ag_output, layout, outs)
        rs_input = reduce_scatter_copy_in(fulls, layout, 0.5)
        reduce_scatter_copy_out(rs_input.view(3, -1)[1], shard_grads, layout, 1, None, True)

    step()
    assert copies, "the first step builds the tables"
    tables = {k: v for k, v in layout._device_cache.items() if k[0] == "blocks"}
    assert len(tables) == 4  # (rank 1 | all ranks) x (padded | unpadded): one per op
    copies.clear()
    step()
    step()
    assert copies == []
    assert {k: v for k, v in layout._device_cache.items() if k[0] == "blocks"} == tables
    assert all(layout._device_cache[k] is v for k, v in tables.items())

    # new tensors (new addresses): one pointer table, no block table
    all_gather_copy_in([s.clone() for s in shards], layout, 1)
    assert copies == [((len(shapes), 2),)]


@requires_kernels
@pytest.mark.parametrize("prepared", [False, True], ids=["uncached", "prepared"])
def test_pointer_table_cache_is_bounded(monkeypatch: pytest.MonkeyPatch, prepared: bool) -> None:
    """Five address sets of one kind of list: without prepared launches each goes through the layout's
    table cache, which keeps the ``POINTER_CACHE_SIZE`` newest; with them only the first does (the
    misses after it are made from the prepared launch, outside this cache: [Note: a miss of a
    prepared launch])."""
    monkeypatch.setattr(_launch, "POINTER_CACHE_SIZE", 2)
    layout = ShardLayout([(10, 3), (7,)], 2)
    with contextlib.nullcontext() if prepared else prepared_launch.uncached():
        for seed in range(5):
            fulls = make_tensors(layout.shapes, (f32,), seed=seed)
            shards = [s.to(kernel_device()) for s in layout.shards(fulls, 0)]
            ag_input, _ = all_gather_copy_in(shards, layout, 0)
            assert_bitwise(ag_input.cpu(), expected_slot(fulls, 2, 0, f32))
    assert sum(1 for k in layout._device_cache if k[0] == "pointers") == (1 if prepared else 2)


# -------------------------------------------------------------------------------------- bad input
@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any kernel launch fails the test: errors must be raised before one."""

    def launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was launched for a bad input")

    monkeypatch.setattr(_launch, "launch", launch)


BAD_SHAPES = [(10, 3), (7,), (), (4, 2)]
BAD_WORLD, BAD_RANK = 3, 1
Mutation = Callable[[dict], None]
BadCase = tuple[Mutation, type[Exception], str]  # what to break, the error, the argument it names


def _bad_setup() -> tuple[ShardLayout, list[torch.Tensor]]:
    layout = ShardLayout(BAD_SHAPES, BAD_WORLD)
    return layout, make_tensors(BAD_SHAPES, (f32,), seed=0, specials=False)


def arg(name: str, make: Callable[[dict], object]) -> Mutation:
    """Replace keyword argument ``name`` by ``make(kwargs)``."""
    return lambda kw: kw.update({name: make(kw)})


def item(name: str, index: int, make: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    """Replace ``kwargs[name][index]`` (a list entry) by ``make(old entry)``."""

    def mutate(kw: dict) -> None:
        kw[name][index] = make(kw[name][index])

    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(kw: dict) -> None:
        for m in mutations:
            m(kw)

    return mutate


def on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype)


def cast_all(name: str, dtype: torch.dtype) -> Mutation:
    return arg(name, lambda kw: [t.to(dtype) for t in kw[name]])


def value(v: object) -> Callable[[object], object]:
    return lambda _: v


AG_IN_BAD: dict[str, BadCase] = {
    "too few shards": (arg("shards", lambda kw: kw["shards"][:-1]), ValueError, "shards"),
    "too many shards": (arg("shards", lambda kw: kw["shards"] + kw["shards"][:1]), ValueError, "shards"),
    "a tensor, not a list": (arg("shards", lambda kw: kw["shards"][0]), TypeError, "shards"),
    "wrong shape": (item("shards", 0, lambda t: t.reshape(-1)), ValueError, "shards[0]"),
    "other device": (item("shards", 1, on_meta), ValueError, "shards[1]"),
    "complex64": (item("shards", 0, cast(torch.complex64)), TypeError, "shards[0].dtype"),
    "bool": (item("shards", 2, cast(torch.bool)), TypeError, "shards[2].dtype"),
    "complex buffer dtype": (arg("dtype", value(torch.complex64)), TypeError, "dtype"),
    "bool buffer dtype": (arg("dtype", value(torch.bool)), TypeError, "dtype"),
    "mixed without dtype": (item("shards", 0, cast(bf16)), ValueError, "shards"),
    "rank out of range": (arg("rank", value(BAD_WORLD)), ValueError, "rank"),
    "not a layout": (arg("layout", value(BAD_SHAPES)), TypeError, "layout"),
}


@pytest.mark.parametrize("case", list(AG_IN_BAD))
def test_all_gather_copy_in_rejects_bad_input(case: str, no_launch: None) -> None:
    layout, fulls = _bad_setup()
    kwargs = dict(shards=layout.shards(fulls, BAD_RANK), layout=layout, rank=BAD_RANK, dtype=None)
    mutate, exc, name = AG_IN_BAD[case]
    mutate(kwargs)
    with pytest.raises(exc, match=re.escape(name)):
        all_gather_copy_in(**kwargs)


def test_all_gather_copy_in_rejects_five_dtypes(no_launch: None) -> None:
    shapes = BAD_SHAPES + [(5,)]
    layout = ShardLayout(shapes, BAD_WORLD)
    fulls = [t.to(d) for t, d in zip(make_tensors(shapes, (f32,), seed=0), (f32, bf16, f16, f64, i32), strict=True)]
    with pytest.raises(ValueError, match="shards mixes 5 dtypes"):
        all_gather_copy_in(layout.shards(fulls, 0), layout, 0, f32)


AG_OUT_BAD: dict[str, BadCase] = {
    "buffer too small": (arg("ag_output", lambda kw: kw["ag_output"][:-1]), ValueError, "ag_output"),
    "buffer too large": (arg("ag_output", lambda kw: torch.zeros(kw["ag_output"].numel() + 16)), ValueError, "ag_output"),
    "buffer is one slot": (arg("ag_output", lambda kw: kw["ag_output"].view(BAD_WORLD, -1)[0]), ValueError, "ag_output"),
    "buffer not contiguous": (arg("ag_output", lambda kw: torch.zeros(2 * kw["ag_output"].numel())[::2]),
                              ValueError, "ag_output"),
    "complex buffer": (arg("ag_output", lambda kw: kw["ag_output"].to(torch.complex64)), TypeError, "ag_output.dtype"),
    "buffer on another device": (arg("ag_output", lambda kw: on_meta(kw["ag_output"])), ValueError, "outs[0]"),
    "out on another device": (item("outs", 2, on_meta), ValueError, "outs[2]"),
    "too few outs": (arg("outs", lambda kw: kw["outs"][:-1]), ValueError, "outs"),
    "out of the wrong shape": (item("outs", 1, lambda t: torch.zeros(8)), ValueError, "outs[1]"),
    "out of the wrong dtype": (both(arg("dtype", value(f32)), item("outs", 3, cast(bf16))), TypeError, "outs[3]"),
    "out of an unsupported dtype": (item("outs", 0, cast(torch.complex64)), TypeError, "outs[0].dtype"),
    "bool out": (item("outs", 1, cast(torch.bool)), TypeError, "outs[1].dtype"),
    "out not contiguous": (item("outs", 0, lambda t: torch.zeros(3, 10).t()), ValueError, "outs[0]"),
    "unsupported dtype": (both(arg("outs", value(None)), arg("dtype", value(torch.complex64))), TypeError, "dtype"),
    "not a layout": (arg("layout", value(None)), TypeError, "layout"),
}


@pytest.mark.parametrize("case", list(AG_OUT_BAD))
def test_all_gather_copy_out_rejects_bad_input(case: str, no_launch: None) -> None:
    layout, fulls = _bad_setup()
    outs = [torch.full(f.shape, 7.0) for f in fulls]
    kwargs = dict(ag_output=torch.zeros(layout.buffer_numel), layout=layout, outs=outs, dtype=None)
    mutate, exc, name = AG_OUT_BAD[case]
    mutate(kwargs)
    watched = [(o, o.clone()) for o in kwargs["outs"] or () if o.device.type == "cpu"]
    with pytest.raises(exc, match=re.escape(name)):
        all_gather_copy_out(**kwargs)
    for out, before in watched:
        assert_bitwise(out, before)  # nothing written


RS_IN_BAD: dict[str, BadCase] = {
    "too few grads": (arg("grads", lambda kw: kw["grads"][:-1]), ValueError, "grads"),
    "wrong shape": (item("grads", 1, lambda t: torch.zeros(8)), ValueError, "grads[1]"),
    "other device": (item("grads", 2, on_meta), ValueError, "grads[2]"),
    "complex64": (item("grads", 0, cast(torch.complex64)), TypeError, "grads[0].dtype"),
    "bool": (item("grads", 3, cast(torch.bool)), TypeError, "grads[3].dtype"),
    "mixed without dtype": (item("grads", 0, cast(f16)), ValueError, "grads"),
    "int grads scaled": (both(cast_all("grads", i32), arg("pre_scale", value(0.5))), TypeError, "pre_scale"),
    "int buffer scaled": (both(arg("dtype", value(i32)), arg("pre_scale", value(0.5))), TypeError, "pre_scale"),
    "scale not a number": (arg("pre_scale", value("0.5")), TypeError, "pre_scale"),
    "scale a tensor": (arg("pre_scale", value(torch.tensor(0.5))), TypeError, "pre_scale"),
    "complex buffer dtype": (arg("dtype", value(torch.complex64)), TypeError, "dtype"),
}


@pytest.mark.parametrize("case", list(RS_IN_BAD))
def test_reduce_scatter_copy_in_rejects_bad_input(case: str, no_launch: None) -> None:
    layout, fulls = _bad_setup()
    kwargs = dict(grads=list(fulls), layout=layout, pre_scale=None, dtype=None)
    mutate, exc, name = RS_IN_BAD[case]
    mutate(kwargs)
    with pytest.raises(exc, match=re.escape(name)):
        reduce_scatter_copy_in(**kwargs)


RS_OUT_BAD: dict[str, BadCase] = {
    "slot too small": (arg("rs_output", lambda kw: kw["rs_output"][:-1]), ValueError, "rs_output"),
    "whole buffer, not a slot": (arg("rs_output", lambda kw: torch.zeros(BAD_WORLD * kw["rs_output"].numel())),
                                 ValueError, "rs_output"),
    "slot not contiguous": (arg("rs_output", lambda kw: torch.zeros(2 * kw["rs_output"].numel())[::2]),
                            ValueError, "rs_output"),
    "complex slot": (arg("rs_output", lambda kw: kw["rs_output"].to(torch.complex64)), TypeError, "rs_output.dtype"),
    "slot on another device": (arg("rs_output", lambda kw: on_meta(kw["rs_output"])), ValueError, "shard_grads[0]"),
    "grad on another device": (item("shard_grads", 1, on_meta), ValueError, "shard_grads[1]"),
    "too few grads": (arg("shard_grads", lambda kw: kw["shard_grads"][:-1]), ValueError, "shard_grads"),
    "grad of the wrong shape": (item("shard_grads", 0, lambda t: torch.zeros(9)), ValueError, "shard_grads[0]"),
    "grads of another rank": (arg("rank", value(2)), ValueError, "shard_grads[0]"),
    "complex grad": (item("shard_grads", 0, cast(torch.complex64)), TypeError, "shard_grads[0].dtype"),
    "bool grad": (item("shard_grads", 1, cast(torch.bool)), TypeError, "shard_grads[1].dtype"),
    "grad not contiguous": (item("shard_grads", 0, lambda t: torch.zeros(3, 3).t()), ValueError, "shard_grads[0]"),
    "int grads scaled": (both(cast_all("shard_grads", i32), arg("post_scale", value(2.0))), TypeError, "post_scale"),
    "int grads accumulated": (both(cast_all("shard_grads", i32), arg("accumulate", value(True))),
                              TypeError, "accumulate"),
    "int slot scaled": (both(arg("rs_output", lambda kw: kw["rs_output"].to(i32)), arg("post_scale", value(2.0))),
                        TypeError, "post_scale"),
    "accumulate not a bool": (arg("accumulate", value(1)), TypeError, "accumulate"),
    "scale not a number": (arg("post_scale", value("2")), TypeError, "post_scale"),
    "rank out of range": (arg("rank", value(-1)), ValueError, "rank"),
    "divisor not a number": (arg("post_divisor", value("3")), TypeError, "post_divisor"),
    "divisor zero": (arg("post_divisor", value(0.0)), ValueError, "post_divisor"),
    "divisor zero in float32": (arg("post_divisor", value(1e-50)), ValueError, "post_divisor"),
    "divisor not finite": (arg("post_divisor", value(float("inf"))), ValueError, "post_divisor"),
    "divisor and scale": (both(arg("post_divisor", value(3.0)), arg("post_scale", value(0.5))), ValueError,
                          "post_divisor"),
    "int slot divided": (both(arg("rs_output", lambda kw: kw["rs_output"].to(i32)), arg("post_divisor", value(3.0))),
                         TypeError, "post_divisor"),
}


@pytest.mark.parametrize("case", list(RS_OUT_BAD))
def test_reduce_scatter_copy_out_rejects_bad_input(case: str, no_launch: None) -> None:
    layout, fulls = _bad_setup()
    shard_grads = [s.clone() for s in layout.shards(fulls, BAD_RANK)]
    kwargs = dict(rs_output=torch.ones(layout.slot_numel), shard_grads=shard_grads, layout=layout, rank=BAD_RANK,
                  post_scale=None, accumulate=False)
    mutate, exc, name = RS_OUT_BAD[case]
    mutate(kwargs)
    watched = [(g, g.clone()) for g in kwargs["shard_grads"] if g.device.type == "cpu"]
    with pytest.raises(exc, match=re.escape(name)):
        reduce_scatter_copy_out(**kwargs)
    for grad, before in watched:
        assert_bitwise(grad, before)  # nothing written
