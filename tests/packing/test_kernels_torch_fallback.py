"""The torch fallback of the four ops (what runs without Triton) against their references, bit for bit.

Each op's ``_*_torch`` batches its reference's ``world_size * N`` small copies into one ``_foreach``
call over at most two views per parameter ([Note: torch fallback] in ``overlap_kernels._torch_fallback``). They are
called directly here, so these tests run whatever ``TRITON_INTERPRET`` says, and compared with the
``*_ref`` functions as integer bit patterns — NaN payloads included, which is stricter than the ops'
contract — over the op tests' odd shapes (0-dim, empty, primes, uneven rows) and dtype cases, world
sizes 1 to 8, every rank, every option (casts, scales, accumulation). Data comes twice: with NaNs,
where a fallback that would cast a NaN in pieces shaped unlike the reference's runs the reference
itself, and without, where the batched path must do every cast (checked: the references are then
forbidden inside the fallbacks).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_kernels import (
    ShardLayout,
    _launch,
    _torch_fallback,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    all_gather_copy_out,
    all_gather_copy_out_ref,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_ref,
    reduce_scatter_copy_out,
    reduce_scatter_copy_out_ref,
)
from overlap_kernels.all_gather_copy_in import _all_gather_copy_in_torch
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out_torch
from overlap_kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in_torch
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out_torch
from kernel_cases import (  # the op tests' shapes, dtype cases and data
    DTYPE_CASES,
    FLOAT_CASES,
    ODD_SHAPES,
    WORLD_SIZES,
    assert_bitwise,
    make_tensor,
    uninitialized_memory_is_filled,  # noqa: F401  (autouse: torch.empty returns NaN / max int here too)
)

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
CPU = torch.device("cpu")
PRE_SCALES = [None, 0.1, 1 / 3, -0.5]  # a negative scale turns padding's +0 into -0: re-zeroed
POST_MODES = [(None, False), (0.3, False), (None, True), (1 / 3, True), (-2.0, True)]
REFS = {
    "overlap_kernels.all_gather_copy_in": "all_gather_copy_in_ref",
    "overlap_kernels.all_gather_copy_out": "all_gather_copy_out_ref",
    "overlap_kernels.reduce_scatter_copy_in": "reduce_scatter_copy_in_ref",
    "overlap_kernels.reduce_scatter_copy_out": "reduce_scatter_copy_out_ref",
}


def data(shape: Sequence[int], dtype: torch.dtype, seed: int, *, nans: bool, specials: bool = True) -> torch.Tensor:
    """``make_tensor``'s values (NaNs with payloads, infinities, -0, subnormals, max); ``nans=False``:
    no NaN and no -inf (a sum of +inf and -inf is a NaN: ``has_nan`` would take it for one)."""
    x = make_tensor(shape, dtype, seed, specials=specials)
    if nans or not x.is_floating_point():
        return x
    return x.masked_fill(torch.isnan(x), 1.5).masked_fill(x == -torch.inf, -3.0)


def data_list(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], seed: int, *, nans: bool,
              specials: bool = True) -> list[torch.Tensor]:
    return [data(s, dtypes[i % len(dtypes)], seed * 1000 + i, nans=nans, specials=specials)
            for i, s in enumerate(shapes)]


@pytest.fixture
def batched_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The references may not run inside the fallbacks (they still run from the tests)."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fallback ran its reference on NaN-free data")

    for module, name in REFS.items():
        monkeypatch.setattr(importlib.import_module(module), name, forbidden)
    yield


def check_all_ops(shapes: Sequence[Sequence[int]], world_size: int, case: str, seed: int, *, nans: bool) -> None:
    """Every op, every rank, every option: fallback == reference, bitwise."""
    dtypes, buffer_dtype = DTYPE_CASES[case]
    floats = case in FLOAT_CASES
    layout = ShardLayout(shapes, world_size)
    fulls = data_list(shapes, dtypes, seed, nans=nans)
    param_dtypes = [f.dtype for f in fulls]
    # no NaN / inf where a float becomes an int (undefined behaviour, in torch as in Triton)
    specials = all(d.is_floating_point for d in param_dtypes)

    for rank in range(world_size):
        shards = layout.shards(fulls, rank)
        ag_input, ag_output = _all_gather_copy_in_torch(shards, layout, rank, buffer_dtype, CPU)
        assert ag_output.shape == (layout.buffer_numel,)
        assert ag_input.data_ptr() == ag_output.data_ptr() + rank * layout.slot_numel * ag_output.element_size()
        assert_bitwise(ag_input, all_gather_copy_in_ref(shards, layout, rank, buffer_dtype)[0])

    buffer = data((layout.buffer_numel,), buffer_dtype, seed + 1, nans=nans, specials=specials)
    outs = [torch.full(s, 5, dtype=d) for s, d in zip(shapes, param_dtypes)]
    expected = all_gather_copy_out_ref(buffer, layout, [o.clone() for o in outs])
    _all_gather_copy_out_torch(buffer, layout, outs)
    for out, exp in zip(outs, expected, strict=True):
        assert_bitwise(out, exp)

    for scale in PRE_SCALES if floats else [None]:
        rs_input = _reduce_scatter_copy_in_torch(fulls, layout, scale, buffer_dtype, CPU)
        assert_bitwise(rs_input, reduce_scatter_copy_in_ref(fulls, layout, scale, buffer_dtype))

    for rank in range(world_size):
        slot = data((layout.slot_numel,), buffer_dtype, seed + 2 + rank, nans=nans, specials=specials)
        grads = data_list(layout.shard_shapes(rank), dtypes, seed + 3 + rank, nans=nans)
        for scale, accumulate in POST_MODES if floats else [(None, False)]:
            got, expected = [g.clone() for g in grads], [g.clone() for g in grads]
            _reduce_scatter_copy_out_torch(slot, got, layout, rank, scale, accumulate)
            reduce_scatter_copy_out_ref(slot, expected, layout, rank, scale, accumulate)
            for g, exp in zip(got, expected, strict=True):
                assert_bitwise(g, exp)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fallback_equals_reference_with_nans(world_size: int, case: str) -> None:
    check_all_ops(ODD_SHAPES, world_size, case, seed=world_size, nans=True)


@pytest.mark.parametrize("case", list(DTYPE_CASES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fallback_equals_reference_batched(world_size: int, case: str, batched_only: None) -> None:
    check_all_ops(ODD_SHAPES, world_size, case, seed=world_size, nans=False)


# Chunks 16-aligned for world sizes 1, 2, 4, 8 (no alignment padding: torch._chunk_cat packs);
# EVEN_SHAPES' rows also divide evenly (whole regions, split views; full shards on every rank).
EVEN_SHAPES = [(64, 64), (16, 8), (256,), (32, 16)]
ALIGNED_SHAPES = [(20, 16), *EVEN_SHAPES, (5, 32), (3, 16)]


@pytest.mark.parametrize("nans", [False, True])
@pytest.mark.parametrize("shapes", [EVEN_SHAPES, ALIGNED_SHAPES], ids=["even", "uneven"])
@pytest.mark.parametrize("case", ["fp32", "fp32-bf16", "bf16-fp32", "mixed-fp32", "int16"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_fallback_equals_reference_aligned_layouts(
    world_size: int, case: str, shapes: list[tuple[int, ...]], nans: bool, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not nans:
        request.getfixturevalue("batched_only")
    layout = ShardLayout(shapes, world_size)
    even = shapes is EVEN_SHAPES or world_size == 1  # every shard full
    assert _torch_fallback.torch_plan(layout, None).chunk_cat
    assert all(_torch_fallback.torch_plan(layout, r).chunk_cat for r in range(world_size)) == even
    calls = []
    real_chunk_cat = torch._chunk_cat

    def chunk_cat(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[2])
        return real_chunk_cat(*args, **kwargs)

    monkeypatch.setattr(torch, "_chunk_cat", chunk_cat)
    check_all_ops(shapes, world_size, case, seed=world_size, nans=nans)
    if len(set(DTYPE_CASES[case][0])) == 1 and not nans:  # one dtype: packed by _chunk_cat
        assert world_size in calls
        assert (1 in calls) == any(_torch_fallback.torch_plan(layout, r).chunk_cat for r in range(world_size))


@pytest.mark.parametrize("case", ["fp32-bf16", "bf16-fp32"])
def test_fallback_casts_large_tensors_by_views(case: str, batched_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aligned layouts whose tensors are too large to cast through a temporary (the threshold
    lowered to 0 here) take the views, even where torch._chunk_cat could pack."""
    monkeypatch.setattr(_torch_fallback, "CHUNK_CAT_CAST_MAX_NUMEL", 0)
    for world_size in (1, 4):
        check_all_ops(ALIGNED_SHAPES, world_size, case, seed=world_size, nans=False)


def test_fallback_three_hundred_parameters(batched_only: None) -> None:
    shapes = [((7 * i) % 23, 1 + i % 3) if i % 4 else (1 + (11 * i) % 29,) for i in range(300)]
    shapes[5] = ()
    check_all_ops(shapes, 3, "mixed-fp32", seed=300, nans=False)


def test_fallback_runs_spanning_many_vectors(batched_only: None) -> None:
    check_all_ops([(500, 40), (3,), (2**12,), (129, 1)], 3, "mixed-bf16", seed=5, nans=False)


@pytest.mark.parametrize("nans", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
def test_non_contiguous_inputs(nans: bool, aligned: bool) -> None:
    """Transposed and strided shards and grads (read as the references read them), with casts and
    scales; ``aligned``: a layout that ``torch._chunk_cat`` packs."""
    if aligned:
        base = data_list([(16, 32), (512,), (8, 32)], (f32, bf16), seed=9, nans=nans)
        fulls, world_sizes = [base[0].t(), base[1][::2], base[2][:, :16]], (1, 2, 4)
    else:
        base = data_list([(5, 6), (4, 9), (22,), (7, 2)], (f32, bf16), seed=9, nans=nans)
        fulls, world_sizes = [base[0].t(), base[1].t(), base[2][::2], base[3][:, :1]], (1, 3, 4)
    assert not any(f.is_contiguous() for f in fulls[:3])
    shapes = [tuple(f.shape) for f in fulls]
    for world_size in world_sizes:
        layout = ShardLayout(shapes, world_size)
        assert _torch_fallback.torch_plan(layout, None).chunk_cat == aligned
        for rank in range(world_size):
            shards = layout.shards(fulls, rank)
            for dtype in (f32, bf16, f16):
                assert_bitwise(_all_gather_copy_in_torch(shards, layout, rank, dtype, CPU)[0],
                               all_gather_copy_in_ref(shards, layout, rank, dtype)[0])
        for grads in (fulls, [f.to(f32) for f in fulls]):  # mixed dtypes, then one (chunk_cat)
            for scale in (None, 0.25, -1.0):
                for dtype in (f32, bf16, f64):
                    assert_bitwise(_reduce_scatter_copy_in_torch(grads, layout, scale, dtype, CPU),
                                   reduce_scatter_copy_in_ref(grads, layout, scale, dtype))


def test_all_parameters_empty() -> None:
    shapes = [(0,), (0, 3), (5, 0)]
    layout = ShardLayout(shapes, 4)
    fulls = [torch.empty(s) for s in shapes]
    ag_input, ag_output = _all_gather_copy_in_torch(layout.shards(fulls, 1), layout, 1, f32, CPU)
    assert ag_input.shape == (0,) and ag_output.shape == (0,)
    _all_gather_copy_out_torch(ag_output, layout, fulls)
    assert _reduce_scatter_copy_in_torch(fulls, layout, 0.5, bf16, CPU).shape == (0,)
    _reduce_scatter_copy_out_torch(torch.empty(0), layout.shards(fulls, 2), layout, 2, 0.5, True)


# ------------------------------------------------------------------------------------------ plans
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_at_most_two_copies_per_parameter(world_size: int) -> None:
    """All-ranks plans: one 2-D piece for the full ranks, one more only for a short rank's rows —
    whatever the world size; rank plans: one piece per non-empty shard."""
    layout = ShardLayout(ODD_SHAPES + EVEN_SHAPES, world_size)
    plan = _torch_fallback.torch_plan(layout, None)
    for i in range(layout.num_params):
        d, rows = layout.dim0s[i], layout.rows_per_rank[i]
        expected = 0 if layout.numels[i] == 0 else 1 + (d % rows != 0)
        assert sum(1 for p in plan.pieces if p[0] == i) == expected, layout.shapes[i]
    even = {i for i in range(layout.num_params)
            if layout.numels[i] and layout.dim0s[i] % world_size == 0 and layout.chunk_numels[i] % 16 == 0}
    assert {p[0] for p, whole in zip(plan.pieces, plan.whole) if whole} == even
    assert plan.padded == (sum(layout.numels) != layout.buffer_numel)
    assert _torch_fallback.torch_plan(layout, None) is plan  # cached on the layout
    for rank in range(world_size):
        pieces = _torch_fallback.torch_plan(layout, rank).pieces
        assert [p[0] for p in pieces] == [i for i in range(layout.num_params) if layout.shard_numel(i, rank)]


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


VIEW_OPS = {"as_strided", "split", "split_with_sizes", "view", "select"}


def count_ops(num_params: int, world_size: int) -> dict[str, tuple[int, int]]:
    """(views, other ops) issued by each fallback, for ``num_params`` uneven parameters of mixed dtypes."""
    shapes = [(3 + i % 7, 5) for i in range(num_params)]
    layout = ShardLayout(shapes, world_size)
    dtypes = (f32, bf16)
    fulls = data_list(shapes, dtypes, 1, nans=False, specials=False)
    shards = layout.shards(fulls, 0)
    grads = [s.clone() for s in shards]
    buffer = torch.randn(layout.buffer_numel)
    slot = buffer[: layout.slot_numel]
    calls = {
        "all_gather_copy_in": lambda: _all_gather_copy_in_torch(shards, layout, 0, bf16, CPU),
        "all_gather_copy_out": lambda: _all_gather_copy_out_torch(buffer, layout, fulls),
        "reduce_scatter_copy_in": lambda: _reduce_scatter_copy_in_torch(fulls, layout, 0.5, bf16, CPU),
        "reduce_scatter_copy_out": lambda: _reduce_scatter_copy_out_torch(slot, grads, layout, 0, 0.5, True),
    }
    counts = {}
    for name, call in calls.items():
        call()  # builds the plan (once per layout)
        with CountOps() as mode:
            call()
        views = sum(op in VIEW_OPS for op in mode.ops)
        counts[name] = (views, len(mode.ops) - views)
    return counts


def test_op_count_does_not_grow_with_the_world_size() -> None:
    """The references issue ``world_size * N`` copies; the fallbacks a fixed number of ops besides
    the views (at most two pieces per parameter, a view of each on either side)."""
    counts = {(n, w): count_ops(n, w) for n, w in [(10, 2), (10, 8), (40, 8)]}
    for name, (_, others) in counts[10, 2].items():
        assert others <= 8, (name, others)
        for (n, w), ops in counts.items():
            views = ops[name][0]
            assert ops[name][1] == others, (name, n, w)
            assert views <= 4 * n + 2, (name, n, w, views)


# ---------------------------------------------------------------------------------- the launchers
@pytest.fixture
def without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers see no Triton (as on CPU without the interpreter), and a launch fails."""

    def launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Triton kernel was launched")

    monkeypatch.setattr(_launch, "triton_enabled", lambda device: False)
    monkeypatch.setattr(_launch, "launch", launch)


def test_launchers_take_the_fallback_outside_autograd(without_triton: None) -> None:
    """Through the public functions: results equal the references; outputs carry no autograd
    history even from inputs that require grad; in-place writes bump the version counters."""
    shapes = [(10, 3), (7,), (), (0, 4), (5, 2, 3)]
    world_size, rank = 4, 1
    layout = ShardLayout(shapes, world_size)
    params = [torch.nn.Parameter(t) for t in data_list(shapes, (f32,), 3, nans=False)]
    shards = layout.shards(params, rank)
    assert all(s.requires_grad for s in shards)

    ag_input, ag_output = all_gather_copy_in(shards, layout, rank, bf16)
    assert not ag_output.requires_grad and ag_output.grad_fn is None and ag_input.grad_fn is None
    with torch.no_grad():
        assert_bitwise(ag_input, all_gather_copy_in_ref(shards, layout, rank, bf16)[0])

    rs_input = reduce_scatter_copy_in(params, layout, 0.25, bf16)
    assert not rs_input.requires_grad and rs_input.grad_fn is None
    with torch.no_grad():
        assert_bitwise(rs_input, reduce_scatter_copy_in_ref(params, layout, 0.25, bf16))

    versions = [p._version for p in params]
    outs = all_gather_copy_out(ag_output, layout, params)
    assert all(o is p for o, p in zip(outs, params))
    assert all(p._version > v for p, v in zip(params, versions) if p.numel())
    assert all(p.grad_fn is None and p.requires_grad for p in params)
    expected = all_gather_copy_out_ref(ag_output, layout, dtype=f32)
    for p, exp in zip(params, expected):
        assert_bitwise(p.detach(), exp)

    slot = rs_input.view(world_size, -1)[rank]
    grads = [torch.zeros(s, requires_grad=True) for s in layout.shard_shapes(rank)]
    versions = [g._version for g in grads]
    reduce_scatter_copy_out(slot, grads, layout, rank, 2.0, True)
    assert all(g._version > v for g, v in zip(grads, versions) if g.numel())
    assert all(g.grad_fn is None for g in grads)
    expected = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    reduce_scatter_copy_out_ref(slot, expected, layout, rank, 2.0, True)
    for g, exp in zip(grads, expected):
        assert_bitwise(g.detach(), exp)
