"""Repeat launches straight into the compiled kernel ([Note: launching the compiled kernel] in
``overlap_kernels._compiled_launch``).

On CPU: the cache key against Triton's own specialization function (equal keys, equal
specialization, so a direct launch always finds the binary Triton would have picked), and the
direct path's bookkeeping with a recording stand-in for a JIT function and its compiled kernel.
On a GPU (``pytest -m gpu``): the packing ops launched again and again, direct, with buffers whose
alignment changes between calls, against the references.
"""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import triton

from conftest import requires_cuda
from overlap_kernels import _compiled_launch, _jit

native_specialize_impl = pytest.importorskip(
    "triton._C.libtriton", reason="Triton's specialization function is what the key is checked against"
).native_specialize_impl
BaseBackend = pytest.importorskip("triton.backends.compiler").BaseBackend


def _arguments() -> list[object]:
    storage = torch.zeros(64, dtype=torch.float32)
    tensors = [storage[i:] for i in range(6)]  # addresses 0, 4, ... 20 bytes past an aligned one
    tensors += [t.to(dtype) for t in tensors[:2] for dtype in (torch.bfloat16, torch.float16, torch.int64)]
    ints = [v + d for v in (0, 1, 16, 1 << 31, 1 << 32, 1 << 63, -(1 << 31), -(1 << 63)) for d in (-1, 0, 1, 15)]
    ints = [v for v in ints if -(1 << 63) <= v < (1 << 64)]
    return [*tensors, *ints, 0.0, 1.0, -2.5, True, False]


def _triton_specialization(arg: object) -> tuple:
    return tuple(native_specialize_impl(BaseBackend, arg, False, True, True))


def test_equal_keys_mean_equal_triton_specialization() -> None:
    args = _arguments()
    keys = [_compiled_launch.specialization_key(a) for a in args]
    assert None not in keys
    for (a, ka), (b, kb) in itertools.combinations(zip(args, keys), 2):
        if ka == kb:
            assert _triton_specialization(a) == _triton_specialization(b), (a, b, ka)
    # and the key is not coarser than needed in the other direction either: every distinct
    # specialization Triton makes of these arguments is one key (a finer key would only cost compiles)
    by_spec: dict[tuple, set] = {}
    for a, k in zip(args, keys):
        by_spec.setdefault(_triton_specialization(a), set()).add(k)
    assert all(len(ks) == 1 for ks in by_spec.values()), by_spec


def test_other_types_are_not_keyed() -> None:
    class Sub(torch.Tensor):
        pass

    assert _compiled_launch.specialization_key(torch.zeros(2).as_subclass(Sub)) is None
    assert _compiled_launch.specialization_key(None) is None
    assert _compiled_launch.specialization_key(torch.float32) is None


# ------------------------------------------------------------------------------ the direct path
class _Param:
    def __init__(self, name: str, default: object = None, has_default: bool = False) -> None:
        self.name, self.default, self.has_default = name, default, has_default


class _Compiled:
    """A compiled kernel as ``JITFunction.run`` returns it: ``run`` is its launcher."""

    def __init__(self, log: list) -> None:
        self.function, self.packed_metadata, self.log = "CUfunction", "metadata", log

    @property
    def run(self) -> Any:
        return lambda *a: self.log.append(("direct", a))


class _Kernel:
    """A ``JITFunction`` stand-in: ``kernel[grid](...)`` logs the call and returns ``compiled``."""

    def __init__(self, names: list[str], defaults: dict[str, object] | None = None) -> None:
        defaults = defaults or {}
        self.params = [_Param(n, defaults.get(n), n in defaults) for n in names]
        self.log: list = []
        self.compiled: object = _Compiled(self.log)

    def __getitem__(self, grid: tuple) -> Any:
        def jit(*args: object, **kwargs: object) -> object:
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled
        return jit


@pytest.fixture
def on_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_compiled_launch, "current_stream_handle", lambda index: 1234)
    monkeypatch.setattr(_compiled_launch, "_LAUNCHERS", {})


OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


def test_a_repeat_launch_calls_the_compiled_launcher_with_parameters_in_order(on_fake_cuda: None) -> None:
    kernel = _Kernel(["a", "b", "scale", "BLOCK", "VEC", "FLAG"], defaults={"FLAG": 7})
    x = torch.zeros(8)
    constexprs = dict(VEC=4, BLOCK=128)  # not in parameter order; FLAG left to its default
    _compiled_launch.run(kernel, 3, (x, x, 0.5), constexprs, OPTIONS)
    _compiled_launch.run(kernel, 5, (x, x, 0.25), constexprs, OPTIONS)
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]
    assert kernel.log[0][1:] == ((3,), (x, x, 0.5), {**constexprs, **OPTIONS})
    assert kernel.log[1][1] == (5, 1, 1, 1234, "CUfunction", "metadata", None, None, None, x, x, 0.25, 128, 4, 7)
    assert _compiled_launch.cached_launches() == 1


@pytest.mark.parametrize("change", ["alignment", "dtype", "int class", "constexpr", "options"])
def test_a_new_specialization_goes_through_the_jit_path(on_fake_cuda: None, change: str) -> None:
    kernel = _Kernel(["a", "n", "BLOCK"])
    x = torch.zeros(8)
    first: tuple = ((x, 32), dict(BLOCK=128), OPTIONS)
    second = {
        "alignment": ((x[1:], 32), dict(BLOCK=128), OPTIONS),
        "dtype": ((x.double(), 32), dict(BLOCK=128), OPTIONS),
        "int class": ((x, 33), dict(BLOCK=128), OPTIONS),
        "constexpr": ((x, 32), dict(BLOCK=256), OPTIONS),
        "options": ((x, 32), dict(BLOCK=128), dict(num_warps=8, enable_fp_fusion=False)),
    }[change]
    for args, constexprs, options in (first, second, first, second):
        _compiled_launch.run(kernel, 1, args, constexprs, options)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "direct", "direct"]


def test_launch_hooks_see_every_launch(on_fake_cuda: None) -> None:
    kernel = _Kernel(["a", "BLOCK"])
    x = torch.zeros(8)
    hook_chain = triton.knobs.runtime.launch_enter_hook
    seen: list = []
    if hasattr(hook_chain, "add"):
        hook_chain.add(seen.append)
        undo = lambda: hook_chain.remove(seen.append)  # noqa: E731
    else:  # a Triton whose hook is a plain attribute
        triton.knobs.runtime.launch_enter_hook = seen.append
        undo = lambda: setattr(triton.knobs.runtime, "launch_enter_hook", None)  # noqa: E731
    try:
        for _ in range(3):
            _compiled_launch.run(kernel, 1, (x,), dict(BLOCK=128), OPTIONS)
    finally:
        undo()
    _compiled_launch.run(kernel, 1, (x,), dict(BLOCK=128), OPTIONS)
    _compiled_launch.run(kernel, 1, (x,), dict(BLOCK=128), OPTIONS)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 4 + ["direct"]


def test_unkeyed_arguments_and_unloaded_kernels_take_the_jit_path(on_fake_cuda: None) -> None:
    kernel = _Kernel(["a", "BLOCK"])
    for _ in range(2):
        _compiled_launch.run(kernel, 1, (None,), dict(BLOCK=128), OPTIONS)
    kernel.compiled = object()  # e.g. the future of an asynchronous compile: nothing to call directly
    for _ in range(2):
        _compiled_launch.run(kernel, 1, (torch.zeros(2),), dict(BLOCK=128), OPTIONS)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 4
    assert _compiled_launch.cached_launches() == 0


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(_jit.INTERPRET, reason="TRITON_INTERPRET sends CUDA tensors to the torch fallback")
def test_direct_launches_match_the_references_as_buffer_alignment_changes() -> None:
    from overlap_kernels import (ShardLayout, all_gather_copy_in, all_gather_copy_in_ref, all_gather_copy_out,
                         all_gather_copy_out_ref, reduce_scatter_copy_out, reduce_scatter_copy_out_ref)

    device = torch.device("cuda", torch.cuda.current_device())
    layout = ShardLayout([(4099, 5), (33, 7), (1024,), ()], 2)
    fulls = [torch.randn(s, device=device) for s in layout.shapes]
    before = _compiled_launch.cached_launches()
    for round_, offset in enumerate([0, 0, 1, 3, 0, 1, 8]):  # elements: 16-byte aligned or not
        storage = torch.randn(layout.buffer_numel + 8, device=device, dtype=torch.bfloat16)
        ag_buffer = storage[offset:offset + layout.buffer_numel]
        outs = [torch.full(s, float("nan"), device=device) for s in layout.shapes]
        all_gather_copy_out(ag_buffer, layout, outs)
        want = all_gather_copy_out_ref(ag_buffer, layout, [torch.empty_like(o) for o in outs])
        assert all(torch.equal(a, b) for a, b in zip(outs, want)), f"round {round_}, offset {offset}"
        ag_input, _ = all_gather_copy_in(layout.shards(fulls, 1), layout, 1, torch.bfloat16)
        want_input = all_gather_copy_in_ref(layout.shards(fulls, 1), layout, 1, torch.bfloat16)[0]
        assert torch.equal(ag_input, want_input), f"round {round_}"
        slot = torch.randn(layout.slot_numel + 8, device=device)[offset:offset + layout.slot_numel]
        grads = [torch.randn(s, device=device) for s in layout.shard_shapes(0)]
        want_grads = [g.clone() for g in grads]
        reduce_scatter_copy_out(slot, grads, layout, 0, 0.5, True)
        reduce_scatter_copy_out_ref(slot, want_grads, layout, 0, 0.5, True)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads)), f"round {round_}, offset {offset}"
    assert _compiled_launch.cached_launches() > before  # repeats went direct
