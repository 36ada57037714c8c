"""The launch's caches against what can change between two calls ([Note: host cost of a launch] and
[Note: packed placements] in ``overlap_kernels._launch``).

* A packed placement's pointer table is the address table of its views, keyed on the storage's
  current address: a re-allocated storage gets its own table, a freed one is refused before any
  launch, and the copy-out through it writes what the reference writes across re-allocations.
* A tensor changed in place between calls (``set_``, ``resize_``, ``as_strided_``, ``.data =``), a
  new list of the same tensors: the next call either uses a table whose rows are the tensors' own
  addresses and dtypes, or refuses them with the op's error, and never launches on the old table.
* After calls that hit the caches on good input, each public op still refuses bad input with its
  error and launches nothing.
* Results are bitwise the references' across cache hits and misses.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from overlap_kernels import (
    ShardLayout,
    _launch,
    all_gather_copy_out,
    all_gather_copy_out_ref,
)
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out
from kernel_cases import (PUBLIC_AND_REFERENCE, assert_bitwise, bf16, call_public_op, f32, kernel_device, make_tensor,
                          make_tensors, requires_kernels)

SHAPES = [(6, 4), (9,), (0, 3), (), (5, 2, 2)]
CPU = torch.device("cpu")


def _rows(table: _launch.PointerTable) -> list[list[int]]:
    return table.pointers.cpu().tolist()


def _own_rows(tensors: list[torch.Tensor]) -> list[list[int]]:
    """What a pointer table over ``tensors`` must hold: each address and its dtype's group."""
    groups: dict[torch.dtype, int] = {}
    return [[t.data_ptr(), groups.setdefault(t.dtype, len(groups))] for t in tensors]


def _tables_of(layout: ShardLayout) -> list[_launch.PointerTable]:
    return [v for k, v in layout._device_cache.items() if isinstance(k, tuple) and "pointers" in k[0]]


# ------------------------------------------------------------------------------- packed placements
def test_packed_placement_places_each_tensor_aligned_and_apart() -> None:
    placement = _launch.PackedPlacement.of(SHAPES, [f32, bf16, f32, bf16, f32])
    storage = torch.UntypedStorage(placement.nbytes)
    views = placement.views(storage)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in SHAPES]
    assert all(v.is_contiguous() and v.untyped_storage().data_ptr() == storage.data_ptr() for v in views)
    assert all(offset % 16 == 0 for offset in placement.byte_offsets)
    spans = [(o, o + v.numel() * v.element_size()) for o, v in zip(placement.byte_offsets, views) if v.numel()]
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "views overlap"
    assert spans[-1][1] <= placement.nbytes
    for i, v in enumerate(views):  # each has its own values (and version counter)
        v.fill_(i)
    assert [float(v.sum()) for v in views] == [float(i * v.numel()) for i, v in enumerate(views)]
    with pytest.raises(ValueError, match="2 shapes but 1 dtypes"):
        _launch.PackedPlacement.of([(1,), (2,)], [f32])


def test_packed_table_is_the_address_table_of_its_views() -> None:
    layout = ShardLayout(SHAPES, 2)
    placement = _launch.PackedPlacement.of(SHAPES, [f32, bf16, f32, bf16, f32])
    storage = torch.UntypedStorage(placement.nbytes)
    views = placement.views(storage)
    packed = _launch.packed_pointer_table(layout, storage, placement, CPU)
    by_address = _launch.pointer_table(layout, views, CPU)
    assert _rows(packed) == _rows(by_address) == _own_rows(views)
    assert (packed.torch_dtypes, packed.dtypes, packed.num_groups) == (
        by_address.torch_dtypes, by_address.dtypes, by_address.num_groups)
    assert _launch.packed_pointer_table(layout, storage, placement, CPU) is packed  # a hit: O(1) key


def test_packed_table_follows_the_storage_and_refuses_freed_memory() -> None:
    layout = ShardLayout(SHAPES, 2)
    placement = _launch.PackedPlacement.of(SHAPES, [f32] * len(SHAPES))
    storage = torch.UntypedStorage(placement.nbytes)
    views = placement.views(storage)
    keep = []
    for _ in range(4):
        storage.resize_(0)
        with pytest.raises(ValueError, match=f"storage holds 0 bytes, the placement needs {placement.nbytes}"):
            _launch.packed_pointer_table(layout, storage, placement, CPU)
        keep.append(torch.empty(placement.nbytes // 4))  # may take the freed block: the next one moves
        storage.resize_(placement.nbytes)
        table = _launch.packed_pointer_table(layout, storage, placement, CPU)
        assert _rows(table) == _own_rows(views), "a table for an old address was used"
    storage.resize_(placement.nbytes - 16)
    with pytest.raises(ValueError, match="resize it before the launch"):
        _launch.packed_pointer_table(layout, storage, placement, CPU)
    # another placement of the same shapes is another key (identity), with the same rows
    twin = _launch.PackedPlacement.of(SHAPES, [f32] * len(SHAPES))
    storage.resize_(placement.nbytes)
    assert _rows(_launch.packed_pointer_table(layout, storage, twin, CPU)) == _own_rows(views)


def test_copy_out_on_a_freed_packed_storage_launches_nothing() -> None:
    layout = ShardLayout(SHAPES, 2)
    placement = _launch.PackedPlacement.of(SHAPES, [f32] * len(SHAPES))
    storage = torch.UntypedStorage(placement.nbytes)
    outs = placement.views(storage)
    ag_output = torch.zeros(layout.buffer_numel)
    with _launch.launches_stubbed() as launched:
        _all_gather_copy_out(ag_output, layout, outs, packed=(storage, placement))
        storage.resize_(0)
        with pytest.raises(ValueError, match="resize it before the launch"):
            _all_gather_copy_out(ag_output, layout, outs, packed=(storage, placement))
    assert launched == [1]


@requires_kernels
def test_packed_copy_out_is_bitwise_across_reallocations() -> None:
    device = kernel_device()
    layout = ShardLayout(SHAPES, 3)
    dtypes = [f32, bf16, f32, bf16, f32]
    placement = _launch.PackedPlacement.of(SHAPES, dtypes)
    storage = torch.UntypedStorage(placement.nbytes, device=device)
    outs = placement.views(storage)
    keep = []
    for call in range(4):
        storage.resize_(0)
        keep.append(torch.full((placement.nbytes // 4,), 7.0, device=device))  # may take the old address
        storage.resize_(placement.nbytes)
        ag_output = make_tensor((layout.buffer_numel,), f32, seed=call, specials=False).to(device)
        _all_gather_copy_out(ag_output, layout, outs, packed=(storage, placement))
        expected = all_gather_copy_out_ref(ag_output.cpu(), layout, [torch.empty(s, dtype=d) for s, d in zip(SHAPES, dtypes)])
        for out, ref in zip(outs, expected):
            assert_bitwise(out.cpu(), ref)
        assert all(bool((k == 7.0).all()) for k in keep), "a launch wrote into memory the views no longer own"


def test_the_oldest_pointer_table_is_dropped_and_rebuilt_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "POINTER_CACHE_SIZE", 2)
    layout = ShardLayout(SHAPES, 2)
    lists = [[torch.empty(s) for s in SHAPES] for _ in range(3)]
    first = _launch.pointer_table(layout, lists[0], CPU)
    assert _launch.pointer_table(layout, lists[1], CPU) is not first
    assert _launch.pointer_table(layout, lists[0], CPU) is first  # still cached
    _launch.pointer_table(layout, lists[2], CPU)  # evicts the oldest: lists[0]'s
    assert len(_tables_of(layout)) == 2
    again = _launch.pointer_table(layout, lists[0], CPU)
    assert again is not first and _rows(again) == _own_rows(lists[0])
    assert len(_tables_of(layout)) == 2


# ------------------------------------------------------------------------ tensors changed in place
def _set_to_other_storage(t: torch.Tensor) -> None:
    t.set_(torch.empty(t.shape, device=t.device))


def _data_as_other_dtype(t: torch.Tensor) -> None:
    t.data = torch.empty(t.shape, dtype=bf16, device=t.device)


CHANGES: dict[str, tuple[Callable[[torch.Tensor], None], str | None]] = {
    # change -> the public op's error for it (None: accepted, with a table of the new metadata)
    "set_ to another storage": (_set_to_other_storage, None),
    ".data = another dtype": (_data_as_other_dtype, None),
    "resize_ to another shape": (lambda t: t.resize_(t.shape[0] + 1, *t.shape[1:]), r"outs\[0\] has shape"),
    "transposed in place (same address)": (lambda t: t.t_(), r"outs\[0\] has shape"),
    "same shape, other strides (same address)": (
        lambda t: t.as_strided_(t.shape, (1, t.shape[0] - 1)), r"outs\[0\] must be contiguous"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_tensor_changed_in_place_gets_a_right_table_or_an_error(change: str) -> None:
    layout = ShardLayout([(4, 3), (3,)], 2)
    outs = [torch.empty(4, 3), torch.empty(3)]
    ag_output = torch.zeros(layout.buffer_numel)
    mutate, error = CHANGES[change]
    with _launch.launches_stubbed() as launched:
        all_gather_copy_out(ag_output, layout, outs)
        all_gather_copy_out(ag_output, layout, list(outs))  # a new list of the same tensors: a hit
        assert len(_tables_of(layout)) == 1 and launched == [2]
        mutate(outs[0])
        if error is not None:
            with pytest.raises((TypeError, ValueError), match=error):
                all_gather_copy_out(ag_output, layout, outs)
            assert launched == [2], "launched on a refused list"
            return
        all_gather_copy_out(ag_output, layout, outs)
    assert launched == [3]
    used = _launch.pointer_table(layout, outs, CPU)
    assert len(_tables_of(layout)) == 2, "the change did not build a new table"
    assert _rows(used) == _own_rows(outs) and used.torch_dtypes == tuple(dict.fromkeys(o.dtype for o in outs))


@requires_kernels
@pytest.mark.parametrize("change", ["set_ to another storage", ".data = another dtype"])
def test_a_tensor_changed_in_place_is_written_right(change: str) -> None:
    device = kernel_device()
    layout = ShardLayout([(4, 4), (3,)], 2)
    outs = [torch.empty(4, 4, device=device), torch.empty(3, device=device)]
    for call in range(3):
        if call == 2:
            CHANGES[change][0](outs[0])  # the same tensor object, now over new memory on its device
        ag_output = make_tensor((layout.buffer_numel,), f32, seed=call, specials=False).to(device)
        all_gather_copy_out(ag_output, layout, outs)
        expected = all_gather_copy_out_ref(ag_output.cpu(), layout, [torch.empty_like(o, device="cpu") for o in outs])
        for out, ref in zip(outs, expected):
            assert_bitwise(out.cpu(), ref)


# ----------------------------------------------------------------- errors after hits, bitwise results
CASE_SHAPES, CASE_RANK = [(7, 3), (5,), (2, 2, 2)], 1
CASE_LAYOUT = ShardLayout(CASE_SHAPES, 3)


def _inputs(device: torch.device, seed: int) -> dict[str, list[torch.Tensor]]:
    """Fresh tensors for the four ops on rank 1 of 3: fp32 / bf16 parameters, bf16 buffers."""
    layout, rank = CASE_LAYOUT, CASE_RANK
    fulls = make_tensors(CASE_SHAPES, (f32, bf16), seed, specials=False)
    grads = [make_tensor(s.shape, s.dtype, seed + 3 + i, specials=False) for i, s in enumerate(layout.shards(fulls, rank))]
    return {k: [t.to(device) for t in v] for k, v in {
        "fulls": fulls,
        "shards": [s.contiguous() for s in layout.shards(fulls, rank)],
        "ag_output": [make_tensor((layout.buffer_numel,), bf16, seed + 1, specials=False)],
        "outs": [torch.empty_like(f) for f in fulls],
        "slot": [make_tensor((layout.slot_numel,), bf16, seed + 2, specials=False)],
        "grads": grads,
    }.items()}


OPS = list(PUBLIC_AND_REFERENCE)


def _call(op: str, t: dict[str, list[torch.Tensor]], reference: bool = False) -> list[torch.Tensor]:
    """The public op on ``t`` (or, with ``reference``, its pure-torch reference on CPU copies of
    ``t``); returns what it wrote (this rank's slot for the all-gather copy-in)."""
    return call_public_op(op, CASE_LAYOUT, CASE_RANK, t, pre_scale=1 / 3, post_scale=0.5, reference=reference)


BROKEN_LIST = {"all_gather_copy_in": "shards", "all_gather_copy_out": "outs", "reduce_scatter_copy_in": "fulls",
               "reduce_scatter_copy_out": "grads"}
BAD_CHANGES: dict[str, tuple[Callable[[list[torch.Tensor]], object], str]] = {
    # in place on the list's first tensor, except the device (``.data =`` cannot change it)
    "resized in place": (lambda ts: ts[0].resize_(ts[0].numel() + 1), r"\[0\] has shape"),
    "unsupported dtype in place": (lambda ts: setattr(ts[0], "data", torch.zeros(ts[0].shape, dtype=torch.complex64)),
                                   r"\[0\]\.dtype must be one of"),
    "replaced by one on meta": (lambda ts: ts.__setitem__(0, torch.zeros(ts[0].shape, device="meta")),
                                r"\[0\] is on meta|\[1\] is on cpu, expected meta"),  # (inputs: the first names the device)
}


@pytest.mark.parametrize("bad", sorted(BAD_CHANGES))
@pytest.mark.parametrize("op", OPS)
def test_public_ops_refuse_bad_input_after_hits_on_good_input(op: str, bad: str) -> None:
    tensors = _inputs(CPU, seed=5)
    with _launch.launches_stubbed() as launched:
        _call(op, tensors)
        _call(op, tensors)
        assert launched == [2]
        mutate, error = BAD_CHANGES[bad]
        mutate(tensors[BROKEN_LIST[op]])
        with pytest.raises((TypeError, ValueError), match=error):
            _call(op, tensors)
    assert launched == [2], "launched on refused input"


@requires_kernels
@pytest.mark.parametrize("op", OPS)
def test_results_are_bitwise_across_cache_hits_and_misses(op: str) -> None:
    device = kernel_device()
    for seed in (1, 2):  # new tensors (new addresses): misses
        tensors = _inputs(device, seed)
        for again in range(3):  # the same tensors, new values written in place: hits
            if again:
                for name in ("fulls", "shards", "ag_output", "slot"):
                    for t in tensors[name]:
                        t.copy_(make_tensor(t.shape, t.dtype, seed * 10 + again, specials=False))
            expected = _call(op, tensors, reference=True)
            for result, ref in zip(_call(op, tensors), expected, strict=True):
                assert_bitwise(result.cpu(), ref)
