"""ShardLayout: the sharding rule, slot offsets, copy runs and the device block tables built from them.

Everything here is checked against expectations written from the documented rules (``torch.chunk``
for the dim-0 sharding, round-up-to-16 regions laid end to end), not against the layout's own
helpers. No kernel runs here except one probe of the block table's device-side int64 arithmetic.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernel_cases import kernel_device, requires_kernels
from overlap_kernels import ShardLayout
from overlap_kernels import _jit, _launch
from overlap_kernels.layout import next_power_of_two

WORLD_SIZES = (1, 2, 3, 4, 8)
ALIGN = 16  # documented: every parameter's region in a slot starts at a multiple of 16 elements


def chunk_rows(d: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of rank ``rank`` by ``torch.chunk``: pieces of ``ceil(d / w)`` rows, the
    last pieces shorter, missing pieces empty (and placed after the last row)."""
    if d == 0:
        return 0, 0
    pieces = torch.arange(d).chunk(world_size)
    if rank >= len(pieces):
        return d, d
    piece = pieces[rank]
    return int(piece[0]), int(piece[-1]) + 1


def region_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Documented size of a parameter's region in a slot: ``ceil(d / w)`` rows, rounded up to 16."""
    d = shape[0] if shape else 1
    row = math.prod(shape[1:])
    chunk = -(-d // world_size) * row
    return -(-chunk // ALIGN) * ALIGN


SHAPES = [(), (0,), (1,), (7,), (10, 3), (0, 4), (4, 0), (5, 1), (3, 2, 5), (2, 3, 1, 5), (13,), (17, 1, 3)]


# ------------------------------------------------------------------------------------------ sharding
def test_issue_example_ten_rows_on_four_ranks() -> None:
    layout = ShardLayout([(10, 2)], world_size=4)
    assert [layout.shard_rows(0, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [layout.shard_shape(0, r) for r in range(4)] == [(3, 2), (3, 2), (3, 2), (1, 2)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_rows_follow_torch_chunk(world_size: int) -> None:
    dims = list(range(0, 20)) + [23, 29, 31, 64, 97]
    layout = ShardLayout([(d, 3) for d in dims], world_size)
    for i, d in enumerate(dims):
        rows = [layout.shard_rows(i, r) for r in range(world_size)]
        assert rows == [chunk_rows(d, world_size, r) for r in range(world_size)], d
        # the rule in words: ceil(d / w) rows per rank while rows last, then fewer, then none
        sizes = [end - start for start, end in rows]
        assert sum(sizes) == d
        assert all(s == -(-d // world_size) for s in sizes[: d // max(-(-d // world_size), 1)])
        assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shards_are_views_of_the_chunks(world_size: int) -> None:
    fulls = [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for s in SHAPES]
    layout = ShardLayout([tuple(s) for s in SHAPES], world_size)
    for rank in range(world_size):
        shards = layout.shards(fulls, rank)
        for i, (full, shard) in enumerate(zip(fulls, shards)):
            rows = full.reshape(1) if full.dim() == 0 else full
            start, end = chunk_rows(rows.shape[0], world_size, rank)
            assert torch.equal(shard, rows[start:end]), (i, rank)
            assert shard.shape == layout.shard_shape(i, rank)
            assert shard.numel() == layout.shard_numel(i, rank)
            if shard.numel():
                assert shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view


@pytest.mark.parametrize("world_size", (1, 2, 8))
def test_zero_dim_parameter_lives_on_rank_zero(world_size: int) -> None:
    layout = ShardLayout([()], world_size)
    assert layout.shard_shape(0, 0) == (1,)
    assert all(layout.shard_shape(0, r) == (0,) for r in range(1, world_size))
    value = torch.tensor(3.5)
    assert layout.shard(value, 0).tolist() == [3.5]
    assert layout.shapes[0] == ()


# ------------------------------------------------------------------------------------------- slots
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_slot_regions_are_aligned_back_to_back(world_size: int) -> None:
    layout = ShardLayout([tuple(s) for s in SHAPES], world_size)
    regions = [region_numel(tuple(s), world_size) for s in SHAPES]
    offsets = [sum(regions[:i]) for i in range(len(regions))]
    assert list(layout.slot_offsets) == offsets
    assert list(layout.padded_numels) == regions
    assert all(o % ALIGN == 0 for o in offsets)
    assert layout.slot_numel == sum(regions)
    assert layout.buffer_numel == world_size * sum(regions)
    for i in range(len(SHAPES)):  # every rank's shard fits its region
        assert all(layout.shard_numel(i, r) <= regions[i] for r in range(world_size))


def test_shard_views_are_the_regions_of_a_slot() -> None:
    layout = ShardLayout([(10, 3), (), (5,)], world_size=4)
    slot = torch.arange(layout.slot_numel, dtype=torch.float32)
    for rank in range(4):
        views = layout.shard_views(slot, rank)
        for i, view in enumerate(views):
            off = layout.slot_offsets[i]
            assert view.shape == layout.shard_shape(i, rank)
            assert torch.equal(view.reshape(-1), slot[off : off + view.numel()])
    with pytest.raises(ValueError, match="slot"):
        layout.shard_views(slot[:-1], 0)


@pytest.mark.parametrize("rank", [None, 0, 1, 2])
def test_segments_are_the_documented_runs(rank: int | None) -> None:
    shapes = [(10, 3), (), (0, 4), (5,), (2, 3, 1, 5)]
    world_size = 3
    layout = ShardLayout(shapes, world_size)
    regions = [region_numel(s, world_size) for s in shapes]
    slot = sum(regions)
    expected = []
    for r in range(world_size) if rank is None else (rank,):
        for i, shape in enumerate(shapes):
            d = shape[0] if shape else 1
            row = math.prod(shape[1:])
            start, end = chunk_rows(d, world_size, r)
            tensor_start = 0 if rank is not None else r * -(-d // world_size) * row
            flat_start = (0 if rank is not None else r * slot) + sum(regions[:i])
            expected.append((i, tensor_start, flat_start, (end - start) * row, regions[i]))
    segments = layout.segments(rank)
    assert segments.dtype == np.int64
    assert [tuple(int(v) for v in row) for row in segments] == expected


# ------------------------------------------------------------------------------- spec and identity
def test_spec_round_trip_equality_and_cache() -> None:
    layout = ShardLayout([(10, 3), (), (0,), (2, 3, 4)], world_size=3)
    rebuilt = ShardLayout.from_spec(layout.spec)
    assert rebuilt == layout and hash(rebuilt) == hash(layout)
    assert rebuilt.shapes == layout.shapes and rebuilt.world_size == 3
    assert ShardLayout.from_spec(list(layout.spec)) is rebuilt  # cached per spec
    assert layout != ShardLayout([(10, 3), (), (0,), (2, 3, 4)], world_size=4)
    assert layout != ShardLayout([(10, 3), (), (0,), (2, 3, 5)], world_size=3)


@pytest.mark.parametrize(
    ("shapes", "world_size", "exc", "match"),
    [
        ([(4,)], 0, ValueError, "world_size"),
        ([(4,)], True, TypeError, "world_size"),
        ([(4,)], 2.0, TypeError, "world_size"),
        ([], 2, ValueError, "param_shapes"),
        (torch.zeros(3), 2, TypeError, "param_shapes"),
        ([(4,), (-1, 2)], 2, ValueError, r"param_shapes\[1\]"),
        ([(4,), (2.0,)], 2, TypeError, r"param_shapes\[1\]"),
        ([(4,), 5], 2, TypeError, r"param_shapes\[1\]"),
    ],
)
def test_bad_layouts_are_rejected(shapes: object, world_size: object, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ShardLayout(shapes, world_size)  # type: ignore[arg-type]


def test_bad_rank_is_rejected() -> None:
    layout = ShardLayout([(4,)], 2)
    for rank, exc in ((-1, ValueError), (2, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(exc, match="rank"):
            layout.shard_rows(0, rank)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- int64 offsets, no memory
HUGE = 2**32  # elements: far beyond int32, never allocated


def test_huge_layout_offsets_are_exact() -> None:
    """A layout over > 2**31-element buffers costs no memory; its offsets and runs stay exact."""
    shapes = [(1, HUGE), (16, 3), (1, 3 * 2**31), (16, 5), (8, 2**30)]
    world_size = 8
    layout = ShardLayout(shapes, world_size)
    regions = [region_numel(s, world_size) for s in shapes]
    assert list(layout.slot_offsets) == [sum(regions[:i]) for i in range(len(shapes))]
    assert layout.slot_offsets[3] == HUGE + 16 + 3 * 2**31
    assert layout.buffer_numel == world_size * sum(regions) > 2**36

    whole = layout.segments(None)
    assert whole.dtype == np.int64
    last_rank = whole[(world_size - 1) * len(shapes) :]
    # rank 7's rows of the (8, 2**30) parameter start at element 7 * 2**30 of the full tensor
    assert int(last_rank[4, 1]) == 7 * 2**30
    assert int(last_rank[4, 2]) == 7 * layout.slot_numel + layout.slot_offsets[4]
    assert int(last_rank[4, 3]) == 2**30

    table = _launch.block_table(layout, None, pad=False, device=torch.device("cpu"))
    assert table.runs.dtype == torch.int64 and table.blocks.dtype == torch.int32
    runs = table.runs.numpy()
    assert np.array_equal(runs[:, :5], whole[:, :5])
    counts = -(-whole[:, 3] // table.block)
    assert table.num_blocks == int(counts.sum()) == table.blocks.numel()
    assert np.array_equal(runs[:, 5], np.concatenate([[0], np.cumsum(counts)[:-1]]))


@triton.jit
def _block_run_probe_kernel(blocks_ptr, runs_ptr, pointers_ptr, out_ptr, BLOCK: tl.constexpr):
    _, _, tensor_start, flat_start, n_valid, n_total, _ = _jit.block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    row = out_ptr + tl.program_id(0).to(tl.int64) * 4
    tl.store(row, tensor_start)
    tl.store(row + 1, flat_start)
    tl.store(row + 2, n_valid)
    tl.store(row + 3, n_total)


@requires_kernels
def test_device_side_block_offsets_beyond_int32() -> None:
    """The kernels' per-block offsets (``_jit.block_run``) for runs that start past 2**32 elements.

    On rank 1 the huge parameters hold no rows, so only the two small parameters have blocks, but
    they sit behind 2**32 and 2**32 + 3 * 2**31 elements of other parameters' regions.
    """
    device = kernel_device()
    layout = ShardLayout([(1, HUGE), (16, 3), (1, 3 * 2**31), (16, 5)], world_size=8)
    table = _launch.block_table(layout, 1, pad=False, device=device)
    assert table.num_blocks == 2
    pointers = torch.zeros(layout.num_params, 2, dtype=torch.int64, device=device)
    out = torch.full((table.num_blocks, 4), -1, dtype=torch.int64, device=device)
    _block_run_probe_kernel[(table.num_blocks,)](
        table.blocks, table.runs, pointers, out, BLOCK=table.block
    )
    expected = [
        [0, HUGE, 2 * 3, ALIGN],
        [0, HUGE + ALIGN + 3 * 2**31, 2 * 5, ALIGN],
    ]
    assert out.cpu().tolist() == expected


def test_next_power_of_two_is_tritons_and_one_at_most_one() -> None:
    """``next_power_of_two``, the launch paths' plain-Python rounding, is ``triton.next_power_of_2``
    from 1 up (every n to 4096 and around each power of two to 2**40), and 1 for 0 and below."""
    ns = list(range(1, 4097)) + [(1 << k) + d for k in range(12, 41) for d in (-1, 0, 1)]
    assert [next_power_of_two(n) for n in ns] == [triton.next_power_of_2(n) for n in ns]
    assert [next_power_of_two(n) for n in (0, -1, -7)] == [1, 1, 1]
