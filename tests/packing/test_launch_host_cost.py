"""The host side of a launch ([Note: host cost of a launch] in ``overlap_kernels._launch``): the pointer-table
cache and the C-speed argument checks ([Note: checks at C speed] in ``overlap_kernels._checks``).

* The pointer-table cache is keyed by (device, addresses, dtypes) and its content is a function of
  that key: a change of address or dtype builds a new table, a layout has its own cache, and a
  tensor freed then replaced at the same address gets a table that is right for the new tensor,
  checked by running the kernels on such replacements against the pure-torch references.
* The fast checks accept exactly what the per-tensor checks accept: every rule broken by one
  tensor of a long list falls through to the per-tensor loop, whose error names that tensor.
* ``launches_stubbed`` (the benchmark's host table) runs everything but the kernel.
"""
from __future__ import annotations

import re

import pytest
import torch

from overlap_kernels import ShardLayout, _checks, _launch, all_gather_copy_in, all_gather_copy_out
from overlap_kernels.all_gather_copy_out import all_gather_copy_out_ref
from kernel_cases import assert_bitwise, bf16, expected_slot, f32, kernel_device, make_tensor, make_tensors, requires_kernels

SHAPES = [(10, 3), (7,), (5, 2, 2)]


def _pointer_tables(layout: ShardLayout) -> dict:
    return {k: v for k, v in layout._device_cache.items() if isinstance(k, tuple) and k[0] == "pointers"}


def _rows(table: _launch.PointerTable) -> list[list[int]]:
    return table.pointers.cpu().tolist()


# ------------------------------------------------------------------------------ pointer-table cache
def test_pointer_table_is_reused_for_the_same_addresses_and_dtypes() -> None:
    layout = ShardLayout(SHAPES, 2)
    outs = [torch.empty(s) for s in SHAPES]
    first = _launch.pointer_table(layout, outs, torch.device("cpu"))
    assert _launch.pointer_table(layout, list(outs), torch.device("cpu")) is first
    assert _rows(first) == [[t.data_ptr(), 0] for t in outs]
    assert first.torch_dtypes == (f32,)


def test_pointer_table_is_rebuilt_when_an_address_changes() -> None:
    layout = ShardLayout(SHAPES, 2)
    outs = [torch.empty(s) for s in SHAPES]
    first = _launch.pointer_table(layout, outs, torch.device("cpu"))
    outs[1] = torch.empty(SHAPES[1])
    second = _launch.pointer_table(layout, outs, torch.device("cpu"))
    assert second is not first
    assert _rows(second) == [[t.data_ptr(), 0] for t in outs]
    assert len(_pointer_tables(layout)) == 2


def test_pointer_table_is_rebuilt_when_only_the_dtype_changes() -> None:
    # the same address seen as another dtype: views of one storage
    layout = ShardLayout([(8,), (4,)], 2)
    storage = torch.zeros(16)
    as_f32 = [storage[:8], storage[8:12]]
    as_bf16 = [storage.view(bf16)[:8], storage.view(bf16)[16:20]]
    assert as_f32[0].data_ptr() == as_bf16[0].data_ptr()
    f = _launch.pointer_table(layout, as_f32, torch.device("cpu"))
    b = _launch.pointer_table(layout, as_bf16, torch.device("cpu"))
    assert b is not f and b.torch_dtypes == (bf16,) and f.torch_dtypes == (f32,)
    mixed = _launch.pointer_table(layout, [as_f32[0], as_bf16[1]], torch.device("cpu"))
    assert mixed.torch_dtypes == (f32, bf16) and [r[1] for r in _rows(mixed)] == [0, 1]


def test_each_layout_has_its_own_pointer_tables() -> None:
    outs = [torch.empty(s) for s in SHAPES]
    a, b = ShardLayout(SHAPES, 2), ShardLayout(SHAPES, 3)
    ta = _launch.pointer_table(a, outs, torch.device("cpu"))
    tb = _launch.pointer_table(b, outs, torch.device("cpu"))
    assert ta is not tb and len(_pointer_tables(a)) == len(_pointer_tables(b)) == 1


@requires_kernels
@pytest.mark.parametrize("replacement", ["fresh tensors", "same storage, other dtype"])
def test_replaced_outputs_are_written_right(replacement: str) -> None:
    """Outputs freed and replaced (possibly at the same addresses, possibly reinterpreted as another
    dtype) between calls: every call writes what the reference writes."""
    device = kernel_device()
    layout = ShardLayout([(6, 4), (9,)], 2)
    numel = sum(layout.numels)
    storage = torch.zeros(numel, device=device)

    def outs_for(call: int) -> list[torch.Tensor]:
        if replacement == "fresh tensors":
            return [torch.empty(s, device=device) for s in layout.shapes]
        flat = storage if call % 2 == 0 else storage.view(bf16)[:numel]
        return [flat[:24].view(6, 4), flat[24:33]]

    for call in range(4):
        ag_output = make_tensor((layout.buffer_numel,), f32, seed=call, specials=False).to(device)
        outs = outs_for(call)
        all_gather_copy_out(ag_output, layout, outs)
        expected = all_gather_copy_out_ref(ag_output.cpu(), layout, [torch.empty_like(o, device="cpu") for o in outs])
        for out, ref in zip(outs, expected):
            assert_bitwise(out.cpu(), ref)
        del outs


@requires_kernels
def test_a_shard_that_is_not_contiguous_is_packed_from_its_values() -> None:
    """Same address, other strides: the launcher packs a contiguous copy, never the raw memory."""
    device = kernel_device()
    layout = ShardLayout([(4, 4)], 1)
    full = make_tensors([(4, 4)], (f32,), seed=3)[0]
    on_device = full.to(device)
    ag_input, _ = all_gather_copy_in([on_device], layout, 0)
    assert_bitwise(ag_input.cpu(), expected_slot([full], 1, 0, f32))
    ag_input, _ = all_gather_copy_in([on_device.t()], layout, 0)  # same storage, same first address
    assert_bitwise(ag_input.cpu(), expected_slot([full.t().contiguous()], 1, 0, f32))


# ----------------------------------------------------------------------------------- fast checks
def _good(n: int = 40) -> tuple[list[torch.Tensor], tuple[torch.Size, ...]]:
    shapes = tuple(torch.Size((i % 5 + 2, 3)) for i in range(n))
    return [torch.zeros(s) for s in shapes], shapes


BAD_ITEMS = {
    "not a tensor": (lambda t: [1.0] * t.shape[0], r"\[(\d+)\] must be a tensor"),
    "wrong shape": (lambda t: torch.zeros(t.shape[0] + 1, 3), r"\[(\d+)\] has shape"),
    "other device": (lambda t: torch.zeros(t.shape, device="meta"), r"\[(\d+)\] is on meta"),
    "unsupported dtype": (lambda t: torch.zeros(t.shape, dtype=torch.complex64), r"\[(\d+)\]\.dtype must be one of"),
    "not contiguous": (lambda t: torch.zeros(3, t.shape[0]).t(), r"\[(\d+)\] must be contiguous"),
}


@pytest.mark.parametrize("rule", sorted(BAD_ITEMS))
@pytest.mark.parametrize("where", [0, 17, 39])
def test_fast_checks_refuse_what_the_per_tensor_checks_refuse(rule: str, where: int) -> None:
    tensors, shapes = _good()
    make, pattern = BAD_ITEMS[rule]
    tensors[where] = make(tensors[where])
    assert _checks._all_fine(tensors, shapes, None, True) is None
    with pytest.raises((TypeError, ValueError)) as raised:
        _checks.check_tensors("op", "outs", tensors, shapes, writable=True)
    # a device is "other" than the first tensor's: a bad first tensor is named by the second's error
    named = 1 if (rule, where) == ("other device", 0) else where
    pattern = r"\[(\d+)\] is on cpu, expected meta" if named != where else pattern
    found = re.search(pattern, str(raised.value))
    assert found is not None and int(found.group(1)) == named, str(raised.value)


def test_fast_checks_accept_good_lists_and_name_their_device() -> None:
    tensors, shapes = _good()
    assert _checks._all_fine(tensors, shapes, None, True) == (torch.device("cpu"), (f32,) * len(tensors))
    checked = _checks.check_tensors("op", "outs", tensors, shapes, torch.device("cpu"), writable=True)
    assert checked == (torch.device("cpu"), (f32,) * len(tensors), {f32})
    with pytest.raises(ValueError, match=r"outs\[0\] is on cpu, expected meta"):
        _checks.check_tensors("op", "outs", tensors, shapes, torch.device("meta"))
    # parameters are plain tensors too; a read-only list may be strided
    params = [torch.nn.Parameter(t) for t in tensors]
    assert _checks._all_fine(params, shapes, None, False) == (torch.device("cpu"), (f32,) * len(tensors))
    strided = [torch.zeros(3, s[0]).t() for s in shapes]
    assert _checks._all_fine(strided, tuple(torch.Size((s[0], 3)) for s in shapes), None, False) is not None


def test_tensor_subclasses_take_the_per_tensor_checks() -> None:
    class Marked(torch.Tensor):
        pass

    tensors, shapes = _good(3)
    tensors[1] = tensors[1].as_subclass(Marked)
    assert _checks._all_fine(tensors, shapes, None, False) is None
    assert _checks.check_tensors("op", "outs", tensors, shapes).device == torch.device("cpu")


# ----------------------------------------------------------------------------------- stubbed launch
def test_launches_stubbed_runs_everything_but_the_kernel() -> None:
    layout = ShardLayout(SHAPES, 2)
    outs = [torch.full(s, 7.0) for s in SHAPES]
    ag_output = torch.zeros(layout.buffer_numel)
    with _launch.launches_stubbed() as launched:
        all_gather_copy_out(ag_output, layout, outs)
        with pytest.raises(ValueError, match="outs has 2 tensors"):
            all_gather_copy_out(ag_output, layout, outs[:2])
    assert launched == [1]
    assert all(bool((o == 7.0).all()) for o in outs), "a stubbed launch writes nothing"
    assert _pointer_tables(layout), "the tables were built"
    assert _launch._stubbed_launches is None
    if not _launch.triton_enabled(torch.device("cpu")):
        all_gather_copy_out(ag_output, layout, outs)  # the torch fallback, outside the stub
        assert all(bool((o == 0).all()) for o in outs)
