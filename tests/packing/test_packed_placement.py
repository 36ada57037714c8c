"""``PackedPlacement.shared_views`` (the runtime's new sharded gradients: [Note: new sharded
gradients share one storage] in ``overlap/param_group.py``) and the reduce-scatter copy-out's launch
keyed on their storage (``packed=``, [Note: packed placements] in ``overlap_kernels._launch``), bitwise
against the reference across re-allocations."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_bitwise, bf16, f32, kernel_device, make_tensor, requires_kernels
from overlap_kernels import ShardLayout, _launch
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out, reduce_scatter_copy_out_ref

SHAPES = [(6, 4), (9,), (0, 3), (), (5, 2, 2)]


def test_shared_views_sit_where_the_placement_says() -> None:
    dtypes = [f32, bf16, f32, torch.float16, bf16]
    placement = _launch.PackedPlacement.of(SHAPES, dtypes)
    data = torch.empty(placement.nbytes, dtype=torch.uint8)
    views = placement.shared_views(data)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in SHAPES]
    assert [v.dtype for v in views] == dtypes and all(v.is_contiguous() for v in views)
    for view, offset, shape in zip(views, placement.byte_offsets, SHAPES):
        assert view.untyped_storage().data_ptr() == data.data_ptr()
        assert view.storage_offset() * view.dtype.itemsize == offset and offset % 16 == 0
    for view, value in zip(views, range(1, 6)):  # no two views overlap
        view.fill_(value)
    assert [bool((v == value).all()) for v, value in zip(views, range(1, 6))] == [True] * 5


@pytest.mark.parametrize("data", [torch.empty(7, dtype=torch.uint8), torch.empty(2, dtype=torch.float32),
                                  torch.empty(200, dtype=torch.uint8)[16:]], ids=["short", "float", "offset"])
def test_shared_views_refuse_other_data(data: torch.Tensor) -> None:
    placement = _launch.PackedPlacement.of([(1,)], [f32])
    with pytest.raises(ValueError, match="PackedPlacement.shared_views: data must be a 1-D uint8 tensor of 16"):
        placement.shared_views(data)


@requires_kernels
@pytest.mark.parametrize("accumulate", [False, True])
def test_packed_reduce_scatter_copy_out_is_bitwise(accumulate: bool) -> None:
    device = kernel_device()
    layout = ShardLayout(SHAPES, 2)
    rank = 0
    shapes = layout.shard_shapes(rank)
    dtypes = [f32, bf16, f32, bf16, f32]
    placement = _launch.PackedPlacement.of(shapes, dtypes)
    for call in range(3):  # a new allocation each time, as each step's gradients are
        data = torch.empty(placement.nbytes, dtype=torch.uint8, device=device)
        grads = placement.shared_views(data)
        for g in grads:
            g.copy_(torch.randn(g.shape))
        expected = [g.cpu().clone() for g in grads]
        rs_output = make_tensor((layout.slot_numel,), f32, seed=call, specials=False).to(device)
        _reduce_scatter_copy_out(rs_output, grads, layout, rank, 0.5, accumulate,
                                 packed=(data.untyped_storage(), placement))
        assert ("packed pointers", data.device, data.data_ptr(), placement) in layout._device_cache, "not keyed on it"
        reduce_scatter_copy_out_ref(rs_output.cpu(), expected, layout, rank, 0.5, accumulate)
        for got, want in zip(grads, expected):
            assert_bitwise(got.cpu(), want)
