"""Prepared launches against what can change between two calls ([Note: prepared launches] in
``overlap_kernels.prepared_launch``).

* A repeated call matches one fingerprint and reuses its prepared launch: the per-tensor checks do
  not run again, and the result is the reference's.
* A change of data pointer, stride, dtype or layout makes a new fingerprint or a new launch, and
  the result is the reference's.
* Memory freed and allocated again (at the same address or another, with the same or another
  dtype) never gets a launch made for what was there before: results are the reference's.
* Every op, public and as the runtime calls it (packed placements included), is bitwise the
  uncached path (``prepared_launch.uncached``), hits and misses alike; the caches stay bounded.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable

import pytest
import torch

from overlap_kernels import (
    ShardLayout,
    _checks,
    _launch,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    native_passes,
    prepared_launch,
)
from overlap_kernels.all_gather_copy_in import _all_gather_copy_in
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out
from overlap_kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in, _reduce_scatter_copy_in_kernel as reduce_scatter_copy_in_kernel
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out
from kernel_cases import assert_bitwise, bf16, call_public_op, f32, kernel_device, make_tensor, requires_kernels

pytestmark = requires_kernels

SHAPES, WORLD, RANK = [(1, 5), (6,), (4, 3)], 2, 0
OPS = ["all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"]
LIST_OF = {"all_gather_copy_in": "shards", "all_gather_copy_out": "outs", "reduce_scatter_copy_in": "fulls",
           "reduce_scatter_copy_out": "grads"}
"""The parameter-side list each op takes (the one its fingerprint describes)."""


def _layout() -> ShardLayout:
    return ShardLayout(SHAPES, WORLD)  # a new object: caches of its own


def _inputs(layout: ShardLayout, seed: int, dtype: torch.dtype = f32) -> dict[str, list[torch.Tensor]]:
    device = kernel_device()
    fulls = [make_tensor(s, dtype, seed * 10 + i, specials=False) for i, s in enumerate(layout.shapes)]
    return {k: [t.to(device) for t in v] for k, v in {
        "fulls": fulls,
        "shards": [s.contiguous() for s in layout.shards(fulls, RANK)],
        "outs": [torch.zeros(s, dtype=dtype) for s in layout.shapes],
        "grads": [make_tensor(s, dtype, seed * 10 + 5 + i, specials=False) for i, s in enumerate(layout.shard_shapes(RANK))],
        "ag_output": [make_tensor((layout.buffer_numel,), bf16, seed + 1, specials=False)],
        "slot": [make_tensor((layout.slot_numel,), bf16, seed + 2, specials=False)],
    }.items()}


def _public(op: str, layout: ShardLayout, t: dict[str, list[torch.Tensor]], reference: bool = False) -> list[torch.Tensor]:
    """The public op on ``t`` (or, with ``reference``, its pure-torch reference); returns what it wrote."""
    return call_public_op(op, layout, RANK, t, pre_scale=0.5, post_scale=0.25, reference=reference)


def _checked_against_reference(op: str, layout: ShardLayout, t: dict[str, list[torch.Tensor]]) -> None:
    expected = _public(op, layout, t, reference=True)
    for got, ref in zip(_public(op, layout, t), expected, strict=True):
        assert_bitwise(got.cpu(), ref)


def _fingerprints(layout: ShardLayout) -> list[prepared_launch.Fingerprint]:
    return [f for v in layout._device_cache.values() if isinstance(v, list)
            for f in v if isinstance(f, prepared_launch.Fingerprint)]


def _launches(layout: ShardLayout) -> int:
    return sum(len(f.launches) for f in _fingerprints(layout))


# ---------------------------------------------------------------------------------- repeated calls
@pytest.mark.parametrize("op", OPS)
def test_a_repeated_call_skips_the_checks_and_reuses_its_launch(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, t = _layout(), _inputs(_layout(), seed=1)
    _checked_against_reference(op, layout, t)
    assert len(_fingerprints(layout)) == 1 and _launches(layout) == 1

    def no_list_checks(*args: object, **kwargs: object) -> None:
        raise AssertionError("a repeated call read every tensor's checks again")

    monkeypatch.setattr(_checks, "check_tensors", no_list_checks)
    built: list[object] = []
    monkeypatch.setattr(_launch.PreparedLaunch, "of", staticmethod(lambda call: built.append(call)))
    for seed in (2, 3):  # new values in the same tensors, and a new list of them: hits
        for name in ("fulls", "shards", "ag_output", "slot"):
            for x in t[name]:
                x.copy_(make_tensor(x.shape, x.dtype, seed, specials=False))
        t[LIST_OF[op]] = list(t[LIST_OF[op]])
        _checked_against_reference(op, layout, t)
    assert not built and len(_fingerprints(layout)) == 1 and _launches(layout) == 1


# ------------------------------------------------------------------------------------ what changes
def _new_addresses(ts: list[torch.Tensor]) -> None:
    ts[:] = [x.clone() for x in ts]


def _other_strides(ts: list[torch.Tensor]) -> None:
    """The first tensor (shape ``(1, n)``) again, contiguous by torch's rule but with another stride
    for its size-1 dimension."""
    x = ts[0]
    assert x.shape[0] == 1
    other = torch.empty_strided(x.shape, (x.shape[1] + 3, 1), dtype=x.dtype, device=x.device)
    other.copy_(x)
    assert other.is_contiguous() and other.stride() != x.stride()
    ts[0] = other


def _other_dtype(ts: list[torch.Tensor]) -> None:
    ts[1] = ts[1].to(bf16)


CHANGES: dict[str, Callable[[list[torch.Tensor]], None]] = {
    "data pointer": _new_addresses,
    "stride": _other_strides,
    "dtype": _other_dtype,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("op", OPS)
def test_a_changed_list_rebuilds_and_is_written_right(op: str, change: str) -> None:
    layout = _layout()
    t = _inputs(layout, seed=3)
    _checked_against_reference(op, layout, t)
    before = (len(_fingerprints(layout)), _launches(layout))
    CHANGES[change](t[LIST_OF[op]])
    _checked_against_reference(op, layout, t)
    after = (len(_fingerprints(layout)), _launches(layout))
    if change == "data pointer":  # the same kind of list at new addresses: a new launch
        assert after == (before[0], before[1] + 1)
    else:  # another kind of list: a new fingerprint
        assert after[0] == before[0] + 1
    _checked_against_reference(op, layout, t)  # and the new entry hits
    assert (len(_fingerprints(layout)), _launches(layout)) == after


@pytest.mark.parametrize("op", OPS)
def test_another_layout_has_its_own_launches(op: str) -> None:
    layout, other = _layout(), ShardLayout(SHAPES, WORLD + 1)
    t = _inputs(layout, seed=4)
    _checked_against_reference(op, layout, t)
    if op in ("all_gather_copy_in", "reduce_scatter_copy_out"):  # shards of another world size
        name = LIST_OF[op]
        t[name] = [make_tensor(s, f32, 40 + i, specials=False).to(kernel_device())
                   for i, s in enumerate(other.shard_shapes(RANK))]
    t["ag_output"] = [make_tensor((other.buffer_numel,), bf16, 41, specials=False).to(kernel_device())]
    t["slot"] = [make_tensor((other.slot_numel,), bf16, 42, specials=False).to(kernel_device())]
    _checked_against_reference(op, other, t)
    assert len(_fingerprints(other)) == 1 and len(_fingerprints(layout)) == 1


# ------------------------------------------------------------------------------- memory reallocated
def _placed(storage: torch.UntypedStorage, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """The shards of ``SHAPES`` on rank 0, fresh tensor objects over ``storage`` at fixed byte offsets
    (0, 64, 128: the same addresses whatever the dtype), with new values."""
    out = []
    for i, shape in enumerate(ShardLayout(SHAPES, WORLD).shard_shapes(RANK)):
        x = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 64 * i // dtype.itemsize, shape)
        x.copy_(make_tensor(shape, dtype, seed * 10 + i, specials=False))
        out.append(x)
    return out


def test_memory_allocated_again_is_never_read_through_an_old_launch() -> None:
    """The all-gather copy-in over shards freed and allocated again: at the same addresses (new tensor
    objects over the same memory), at other addresses, and at the same addresses with another dtype."""
    layout = _layout()
    storage = torch.UntypedStorage(64 * 4, device=kernel_device())

    def check(shards: list[torch.Tensor]) -> None:
        got = all_gather_copy_in(shards, layout, RANK, bf16)[0]
        assert_bitwise(got.cpu(), all_gather_copy_in_ref([s.cpu() for s in shards], layout, RANK, bf16)[0])

    check(_placed(storage, f32, seed=1))
    check(_placed(storage, f32, seed=2))  # new tensors at the same addresses: the same launch, new values
    assert len(_fingerprints(layout)) == 1 and _launches(layout) == 1
    moved = torch.UntypedStorage(64 * 4, device=kernel_device())
    check(_placed(moved, f32, seed=3))  # other addresses: another launch
    assert _launches(layout) == 2
    del moved
    check(_placed(torch.UntypedStorage(64 * 4, device=kernel_device()), f32, seed=4))  # wherever it lands
    check(_placed(storage, bf16, seed=5))  # the old addresses, another dtype: another fingerprint
    assert len(_fingerprints(layout)) == 2


@pytest.mark.parametrize("op", OPS)
def test_tensors_freed_and_allocated_again_are_written_right(op: str) -> None:
    """Fresh inputs each round, the old ones freed first: the allocator hands out the same or other
    addresses; every result is the reference's."""
    layout = _layout()
    for seed in range(4):
        t = _inputs(layout, seed=seed)
        _checked_against_reference(op, layout, t)
        del t


# ---------------------------------------------------------------------------------- uncached path
def _runtime(op: str, layout: ShardLayout, t: dict[str, list[torch.Tensor]], packed: bool) -> list[torch.Tensor]:
    """The op as the runtime calls it (no checks; ``packed``: the copy-outs over one storage)."""
    if op == "all_gather_copy_in":
        return [_all_gather_copy_in(t["shards"], layout, RANK, bf16, (f32,) * len(SHAPES))[0]]
    if op == "reduce_scatter_copy_in":
        return [_reduce_scatter_copy_in(t["fulls"], layout, 0.5, bf16)]
    name = "outs" if op == "all_gather_copy_out" else "grads"
    placement = _launch.PackedPlacement.of([x.shape for x in t[name]], [x.dtype for x in t[name]])
    storage = t.setdefault("storage", [torch.UntypedStorage(placement.nbytes, device=kernel_device())])[0]
    if packed:
        views = placement.views(storage)
        for view, x in zip(views, t[name]):
            view.copy_(x)
        t[name] = views
    where = (storage, placement) if packed else None
    if op == "all_gather_copy_out":
        _all_gather_copy_out(t["ag_output"][0], layout, t["outs"], packed=where)
        return t["outs"]
    _reduce_scatter_copy_out(t["slot"][0], t["grads"], layout, RANK, 0.25, True, packed=where)
    return t["grads"]


@pytest.mark.parametrize(("op", "path"), [(op, path) for op in OPS for path in ("public", "runtime", "runtime, packed")
                                           if path != "runtime, packed" or op.endswith("copy_out")])  # packed: copy-outs
def test_bitwise_equal_to_the_uncached_path(op: str, path: str) -> None:
    results: dict[bool, list[list[torch.Tensor]]] = {}
    for cached in (False, True):
        layout = _layout()
        t = _inputs(layout, seed=7)
        rounds = []
        with prepared_launch.uncached() if not cached else contextlib.nullcontext():
            for _ in range(3):  # a miss, then hits (the copy-outs accumulate into their outputs)
                if path == "public":
                    rounds.append([x.cpu().clone() for x in _public(op, layout, t)])
                else:
                    rounds.append([x.cpu().clone() for x in _runtime(op, layout, t, packed=path.endswith("packed"))])
        packed_launches = [k for k in layout._device_cache if isinstance(k, tuple) and "packed" in k]
        assert bool(_fingerprints(layout) or packed_launches) == cached, "the cache is used exactly when on"
        results[cached] = rounds
    for uncached_round, cached_round in zip(results[False], results[True], strict=True):
        for a, b in zip(uncached_round, cached_round, strict=True):
            assert_bitwise(b, a)


def test_without_tensor_guards_or_native_passes_every_call_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without a usable ``TensorGuards``, where the native passes are unavailable, takes the
    full checks every time, with the same results."""
    monkeypatch.setattr(prepared_launch, "_TensorGuards", None)
    layout = _layout()
    t = _inputs(layout, seed=8)
    with native_passes.python_passes():
        for op in OPS:
            _checked_against_reference(op, layout, t)
            _checked_against_reference(op, layout, t)
    assert not _fingerprints(layout)


@pytest.mark.parametrize("guards", ["native", "TensorGuards"])
def test_either_guard_keeps_the_cache_exact(guards: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native guard where it is built, torch's ``TensorGuards`` otherwise: each is the only one
    asked on a repeated call, and every change of ``CHANGES`` misses it (results the reference's)."""
    if guards == "native" and native_passes.loaded() is None:
        pytest.skip(f"the native passes are not built here: {native_passes.status()}")

    def not_asked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the other guard was asked")

    scope = contextlib.nullcontext() if guards == "native" else native_passes.python_passes()
    if guards == "native":
        monkeypatch.setattr(prepared_launch, "_TensorGuards", not_asked)
    with scope:
        for op in OPS:
            for change in sorted(CHANGES):
                layout, t = _layout(), _inputs(_layout(), seed=12)
                _checked_against_reference(op, layout, t)
                _checked_against_reference(op, layout, t)
                CHANGES[change](t[LIST_OF[op]])
                _checked_against_reference(op, layout, t)
                assert len(_fingerprints(layout)) == (1 if change == "data pointer" else 2), (op, change)


def test_a_list_that_cannot_be_fingerprinted_takes_the_uncached_path() -> None:
    """Shards that are not contiguous (the copy-in packs their values) and a tensor subclass are never
    remembered; results are the reference's."""
    layout = _layout()
    t = _inputs(layout, seed=9)
    wide = torch.zeros(4, 6, device=kernel_device())
    t["shards"][2] = wide[:2, :3].copy_(t["shards"][2])  # (2, 3) with row stride 6
    assert not t["shards"][2].is_contiguous()
    _checked_against_reference("all_gather_copy_in", layout, t)
    assert not _fingerprints(layout)


def test_the_caches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepared_launch, "MAX_LAUNCHES", 2)
    monkeypatch.setattr(prepared_launch, "MAX_FINGERPRINTS", 2)
    layout, alive = _layout(), []
    for seed in range(4):  # four address sets of one kind (kept: CUDA's allocator would hand one back)
        alive.append(_inputs(layout, seed=seed))
        _checked_against_reference("reduce_scatter_copy_in", layout, alive[-1])
    assert _launches(layout) == 2
    for dtype in (f32, bf16, torch.float16):  # three kinds of list
        _checked_against_reference("reduce_scatter_copy_in", layout, _inputs(layout, seed=5, dtype=dtype))
    assert len(_fingerprints(layout)) == 2


# --------------------------------------------------------------------------- lists the runtime owns
OWNED_OPS = {"all_gather_copy_in": "shards", "reduce_scatter_copy_in": "fulls"}
"""The copy-ins the runtime calls over lists it owns ([Note: lists the runtime owns]), and their list."""


def _owned_call(op: str, layout: ShardLayout, t: dict[str, list[torch.Tensor]], owned: prepared_launch.OwnedLists,
                dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """The op as the runtime calls it over a list it owns (``owned``; ignored under ``uncached()``)."""
    if op == "all_gather_copy_in":
        return _all_gather_copy_in(t["shards"], layout, RANK, bf16, dtypes, owned=owned)[0]
    return _reduce_scatter_copy_in(t["fulls"], layout, 0.5, bf16, dtypes, owned=owned)


def _owned_checked(op: str, layout: ShardLayout, t: dict[str, list[torch.Tensor]], owned: prepared_launch.OwnedLists,
                   dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """The owned call is bitwise the uncached path's on the same list."""
    with prepared_launch.uncached():
        expected = _owned_call(op, layout, t, owned, dtypes).cpu().clone()
    assert_bitwise(_owned_call(op, layout, t, owned, dtypes).cpu(), expected)


def _owned_launches(owned: prepared_launch.OwnedLists) -> int:
    return sum(len(fingerprint.launches) for _, fingerprint in owned._fingerprints.values())


@pytest.mark.parametrize("op", sorted(OWNED_OPS))
def test_an_owned_list_reads_only_addresses_on_a_repeated_call(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layout, owned = _layout(), prepared_launch.OwnedLists()
    t = _inputs(layout, seed=1)
    _owned_checked(op, layout, t, owned)
    assert len(owned) == 1 and _owned_launches(owned) == 1 and not _fingerprints(layout)

    def no_reads(*args: object) -> bool:
        raise AssertionError("a repeated call of an owned list read more than the addresses")

    built: list[object] = []
    for seed in (2, 3):  # new values in the same tensors, and a new list of them: hits
        for x in t[OWNED_OPS[op]]:
            x.copy_(make_tensor(x.shape, x.dtype, seed, specials=False))
        t[OWNED_OPS[op]] = list(t[OWNED_OPS[op]])
        with prepared_launch.uncached():
            expected = _owned_call(op, layout, t, owned).cpu().clone()
        with monkeypatch.context() as patched:  # the owned call reads nothing but the addresses
            patched.setattr(prepared_launch, "_TensorGuards", no_reads)
            for read in ("describe", "contiguous", "dtypes"):
                patched.setattr(native_passes, read, no_reads)
            patched.setattr(_launch.PreparedLaunch, "of", staticmethod(lambda call: built.append(call)))
            got = _owned_call(op, layout, t, owned)
        assert_bitwise(got.cpu(), expected)
    assert not built and _owned_launches(owned) == 1


def _data_assigned(ts: list[torch.Tensor]) -> None:
    ts[1].data = ts[1].clone() * -0.5  # the same object over other memory


def _set_to_other_memory(ts: list[torch.Tensor]) -> None:
    ts[2].set_(ts[2].clone() + 1.0)


def _not_contiguous(ts: list[torch.Tensor]) -> None:
    x = ts[2]
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device=x.device)
    ts[2] = wide[:, : x.shape[1]].copy_(x)
    assert not ts[2].is_contiguous()


OWNED_CHANGES: dict[str, Callable[[list[torch.Tensor]], None]] = {
    "new list at new addresses": _new_addresses,
    "data assigned": _data_assigned,
    "set_ to other memory": _set_to_other_memory,
    "dtype at new addresses": _other_dtype,
    "not contiguous": _not_contiguous,
}


@pytest.mark.parametrize("change", sorted(OWNED_CHANGES))
@pytest.mark.parametrize("op", sorted(OWNED_OPS))
def test_a_changed_owned_list_launches_what_the_uncached_path_does(op: str, change: str) -> None:
    """Without the owner saying so (no ``changed()``): memory that moved is read at its new address,
    a new address set with other dtypes or strides is checked before any launch is made for it."""
    layout, owned = _layout(), prepared_launch.OwnedLists()
    t = _inputs(layout, seed=3)
    _owned_checked(op, layout, t, owned)
    OWNED_CHANGES[change](t[OWNED_OPS[op]])
    _owned_checked(op, layout, t, owned)
    _owned_checked(op, layout, t, owned)  # and again (a hit where a launch could be made)
    if change == "not contiguous":
        assert _owned_launches(owned) == 1, "a launch was made for a list that is not contiguous"


def test_dtypes_the_caller_hands_in_key_the_owned_launch() -> None:
    """The runtime hands its shards' dtypes in; the uncached path reads the memory as those. A hit
    needs the same dtypes: other ones (the group re-read its shards) take another launch, and dtypes
    that are not the tensors' go the uncached path."""
    layout, owned = _layout(), prepared_launch.OwnedLists()
    t = _inputs(layout, seed=4)
    _owned_checked("all_gather_copy_in", layout, t, owned, (f32,) * 3)
    t["shards"] = [x.view(torch.int32) for x in t["shards"]]  # the same addresses, read as int32 now
    _owned_checked("all_gather_copy_in", layout, t, owned, (torch.int32,) * 3)
    _owned_checked("all_gather_copy_in", layout, t, owned, (f32,) * 3)  # not the tensors' dtypes


def test_an_owner_that_re_reads_its_list_forgets_its_launches() -> None:
    """Tensors freed and allocated again at the same addresses: with the same dtype they hit the
    same, correct launch; with another dtype (as after ``module.to``) the owner says ``changed()``
    and the next call checks the list again. That call is the one ``changed`` exists for: the
    addresses alone match the old launch."""
    layout, owned = _layout(), prepared_launch.OwnedLists()
    storage = torch.UntypedStorage(64 * 4, device=kernel_device())
    for seed, dtype in ((1, f32), (2, f32)):
        _owned_checked("all_gather_copy_in", layout, {"shards": _placed(storage, dtype, seed)}, owned)
    assert _owned_launches(owned) == 1
    owned.changed()
    assert len(owned) == 0
    _owned_checked("all_gather_copy_in", layout, {"shards": _placed(storage, torch.float16, 3)}, owned)
    (fingerprint,) = [f for _, f in owned._fingerprints.values()]
    assert fingerprint.dtypes == (torch.float16,) * 3


# ------------------------------------------------------------------------- a miss of a prepared launch
def _mixed(layout: ShardLayout, seed: int) -> list[torch.Tensor]:
    """Full tensors of ``layout`` in three dtypes (three dtype groups in the pointer table)."""
    dtypes = (f32, bf16, torch.float16)
    return [make_tensor(s, dtypes[i % 3], seed * 10 + i, specials=False).to(kernel_device())
            for i, s in enumerate(layout.shapes)]


def test_a_launch_made_from_another_is_the_one_built_from_scratch() -> None:
    """``PreparedLaunch.moved``: a new address set of a fingerprint gets the launch ``build`` would
    make for it (the same pointer table, grid and constexprs), though only the addresses are new."""
    layout, owned = _layout(), prepared_launch.OwnedLists()
    first, second = _mixed(layout, 1), _mixed(layout, 2)
    for t in (first, second):
        _owned_checked("reduce_scatter_copy_in", layout, {"fulls": t}, owned)
    (fingerprint,) = [f for _, f in owned._fingerprints.values()]
    moved = fingerprint.launches[native_passes.addresses(second)]
    rs_input = torch.empty(layout.buffer_numel, dtype=bf16, device=kernel_device())
    built = _launch.PreparedLaunch.of(_launch.scaled_kernel_call(
        reduce_scatter_copy_in_kernel, layout, None, True, second, rs_input, 0.5, (bf16,)))
    assert torch.equal(moved.pointers.pointers.cpu(), built.pointers.pointers.cpu())
    assert moved.pointers.pointers[:, 1].unique().numel() == 3
    for field in ("dtypes", "num_groups", "torch_dtypes"):
        assert getattr(moved.pointers, field) == getattr(built.pointers, field), field
    assert (moved.blocks, moved.tail, moved.constexprs) == (built.blocks, built.tail, built.constexprs)


def test_a_list_at_new_addresses_every_call_keeps_the_caches_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients at new addresses every step (autograd's on CPU): each call misses, its launch is
    kept among the ``MAX_LAUNCHES`` newest of the fingerprint, the oldest (and its tables) freed; the
    layout's own caches do not grow with the misses. Every call is bitwise the uncached path."""
    monkeypatch.setattr(prepared_launch, "MAX_LAUNCHES", 3)
    layout, reference_layout, owned = _layout(), _layout(), prepared_launch.OwnedLists()
    alive, tables = [], []

    def checked(fulls: list[torch.Tensor]) -> None:  # the reference on a layout of its own
        with prepared_launch.uncached():
            expected = _owned_call("reduce_scatter_copy_in", reference_layout, {"fulls": fulls}, owned).cpu().clone()
        assert_bitwise(_owned_call("reduce_scatter_copy_in", layout, {"fulls": fulls}, owned).cpu(), expected)

    alive.append(_mixed(layout, 0))  # kept like the rest: CUDA's allocator would hand its addresses back
    checked(alive[-1])
    cached_keys = set(layout._device_cache)
    for seed in range(1, 10):
        alive.append(_mixed(layout, seed))  # all kept: no address set comes back
        checked(alive[-1])
        (fingerprint,) = [f for _, f in owned._fingerprints.values()]
        assert len(fingerprint.launches) == min(seed + 1, 3)
        tables.append(weakref.ref(fingerprint.launches[native_passes.addresses(alive[-1])].pointers))
        assert set(layout._device_cache) == cached_keys
    gc.collect()
    assert [table() is not None for table in tables] == [False] * 6 + [True] * 3
