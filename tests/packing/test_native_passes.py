"""The native passes against their Python definitions ([Note: native passes] in
``overlap_kernels.native_passes``), and their guard against torch's ``TensorGuards``.

* ``addresses``, ``contiguous``, ``dtypes`` and ``increment_version`` give exactly what the Python
  definitions give, natively and under ``python_passes()``, on plain tensors, parameters, views,
  empty and strided tensors, and on lists the extension hands back (a tensor subclass).
* A description matches a list exactly when ``TensorGuards`` does, over every change a guard exists
  for (type, dtype, shape, strides, ``requires_grad``, dispatch keys, device, length), and ignores
  what it must not read (the addresses).
* Where the extension cannot be built, the reason is stated and the Python definitions run.
"""
from __future__ import annotations

import contextlib
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from overlap_kernels import native_passes

MODES = ["native", "python"]


class _Subclass(torch.Tensor):
    """A tensor subclass: its data may mean something else, so the extension hands it back."""


def _mode(mode: str):
    if mode == "native" and native_passes.loaded() is None:
        pytest.skip(f"the native passes are not built here: {native_passes.status()}")
    return native_passes.python_passes() if mode == "python" else contextlib.nullcontext()


def _lists() -> dict[str, list[torch.Tensor]]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "plain": [torch.randn(5), torch.randn(3, 4, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)],
        "parameters": [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 2), requires_grad=False)],
        "views at offsets": [base[1], base[2:, 1:], base.t(), base[:, 3]],
        "empty tensors": [torch.empty(0), torch.empty(3, 0), torch.randn(1)],
        "no tensors": [],
        "a subclass": [torch.randn(3), torch.randn(2).as_subclass(_Subclass)],
    }


def _compiler_and_headers() -> str | None:
    if native_passes.compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX') or ' / '.join(native_passes.COMPILERS)})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers"
    if not native_passes.enabled_by_environment():
        return "OVERLAP_NATIVE_PASSES=0"
    return None


def test_the_extension_builds_where_a_compiler_and_python_headers_exist() -> None:
    """CI's machine has both: the passes must run natively there, not silently fall back."""
    missing = _compiler_and_headers()
    if missing is not None:
        pytest.skip(f"cannot build the native passes here: {missing}")
    assert native_passes.loaded() is not None, native_passes.status()
    assert native_passes.status() == "native" and native_passes.active()


def test_the_build_native_command_builds_ahead_and_names_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m overlap build-native``: what the first launch would build, built now (or found in
    the cache), and where."""
    missing = _compiler_and_headers()
    if missing is not None:
        pytest.skip(f"cannot build the native passes here: {missing}")
    from overlap.demo.cli import main

    assert main(["build-native"]) == 0
    out = capsys.readouterr().out
    assert "native passes: native" in out, out
    built = Path(out.split("built: ", 1)[1].strip())
    assert built.is_file() and built.parent == native_passes.cache_dir(), out


# ---------------------------------------------------------------------- the passes = their definitions
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(_lists()))
def test_each_pass_gives_its_python_definition(mode: str, name: str) -> None:
    tensors = _lists()[name]
    with _mode(mode):
        for listed in (tensors, tuple(tensors)):
            assert native_passes.address_column(native_passes.addresses(listed)).tolist() == [
                t.data_ptr() for t in tensors]
            assert native_passes.contiguous(listed) is all(t.is_contiguous() for t in tensors)
            assert native_passes.dtypes(listed) == tuple(t.dtype for t in tensors)
            assert native_passes.dtypes(listed, build=False) == tuple(t.dtype for t in tensors)


@pytest.mark.parametrize("mode", MODES)
def test_the_address_key_tells_address_lists_apart(mode: str) -> None:
    """Equal keys for equal address lists, unequal for another order or another tensor; hashable."""
    a, b = torch.randn(3), torch.randn(3)
    with _mode(mode):
        key = native_passes.addresses([a, b])
        assert key == native_passes.addresses((a, b)) and hash(key) == hash(native_passes.addresses([a, b]))
        assert key != native_passes.addresses([b, a]) and key != native_passes.addresses([a, b.clone()])
        assert type(key) is (bytes if mode == "native" else tuple)


@pytest.mark.parametrize("mode", MODES)
def test_increment_version_is_torchs(mode: str) -> None:
    """Every listed tensor's counter bumped as torch's own does (a view shares its base's counter:
    listed twice, bumped twice), tensors made under inference mode skipped, a non-tensor refused
    (natively before anything is bumped)."""
    def listed() -> list[torch.Tensor]:
        base = torch.randn(4, 4)
        return [base, base[1], torch.randn(3), torch.nn.Parameter(torch.randn(2))]

    ours, torchs = listed(), listed()
    with _mode(mode):
        native_passes.increment_version(ours)
        native_passes.increment_version(tuple(ours[2:]))
    torch.autograd.graph.increment_version(torchs)
    torch.autograd.graph.increment_version(torchs[2:])
    assert [t._version for t in ours] == [t._version for t in torchs]
    with torch.inference_mode():
        made_in_inference = torch.randn(3)
    with _mode(mode):
        native_passes.increment_version([made_in_inference, ours[2]])  # as torch's: no error
        before = [t._version for t in ours]
        with pytest.raises((TypeError, RuntimeError), match=r"tensor"):  # torch's own raises RuntimeError
            native_passes.increment_version([ours[2], "not a tensor"])
    if mode == "native":  # checked before any counter moves (torch's bumps the items before the bad one)
        assert [t._version for t in ours] == before


# ------------------------------------------------------------------------------ the guard = TensorGuards
def _strided_like(x: torch.Tensor) -> torch.Tensor:
    """``x`` (shape ``(1, n)``) again, contiguous by torch's rule, another stride on its size-1 dim."""
    other = torch.empty_strided(x.shape, (x.shape[1] + 3, 1), dtype=x.dtype)
    return other.copy_(x)


def _changes() -> dict[str, tuple[Callable[[list[torch.Tensor]], list[torch.Tensor]], bool]]:
    """Each change of a list, and whether a guard of the original still matches it."""
    def replace(i: int, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        return lambda ts: [make(t) if j == i else t for j, t in enumerate(ts)]

    def made_in_inference(t: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return t.clone()

    return {
        "the same list": (lambda ts: ts, True),
        "a new list of the same tensors": (lambda ts: list(ts), True),
        "other tensors at other addresses, same metadata": (lambda ts: [t.detach().clone() for t in ts], True),
        "a dtype": (replace(1, lambda t: t.to(torch.bfloat16)), False),
        "a shape": (replace(1, lambda t: torch.randn(t.numel() + 1)), False),
        "a stride": (replace(0, _strided_like), False),
        "requires_grad": (replace(1, lambda t: t.detach().requires_grad_(True)), False),
        "Tensor to Parameter": (replace(1, lambda t: torch.nn.Parameter(t.detach().clone(), requires_grad=False)), False),
        "a negative view (dispatch keys)": (replace(1, torch._neg_view), False),
        "made under inference mode (dispatch keys)": (replace(1, made_in_inference), False),
        "a device": (replace(1, lambda t: torch.empty_like(t, device="meta")), False),
        "one tensor fewer": (lambda ts: ts[:-1], False),
        "one tensor more": (lambda ts: [*ts, torch.randn(2)], False),
        "a subclass": (replace(1, lambda t: t.as_subclass(_Subclass)), False),
    }


@pytest.mark.parametrize("change", sorted(_changes()))
def test_a_description_matches_exactly_when_tensor_guards_does(change: str) -> None:
    if native_passes.loaded() is None:
        pytest.skip(f"the native passes are not built here: {native_passes.status()}")
    guards = getattr(torch._C._dynamo.guards, "TensorGuards", None)
    original = [torch.randn(1, 6), torch.randn(5), torch.randn(2, 3, dtype=torch.float16)]
    description = native_passes.describe(original)
    assert description is not None
    make, expected = _changes()[change]
    changed = make(original)
    assert description.matches(changed) is expected
    assert description.matches(tuple(changed)) is expected
    if guards is not None:
        reference = guards(*original, dynamic_dims_sizes=[list(t.shape) for t in original],
                           dynamic_dims_strides=[list(t.stride()) for t in original])
        verdict = len(changed) == len(original) and reference.check(*changed)
        assert verdict is expected, "TensorGuards, the reference, disagrees with the expected verdict"


def test_no_description_of_a_list_the_extension_hands_back() -> None:
    if native_passes.loaded() is None:
        pytest.skip(f"the native passes are not built here: {native_passes.status()}")
    assert native_passes.describe([torch.randn(2), torch.randn(2).as_subclass(_Subclass)]) is None
    description = native_passes.describe([torch.randn(2)])
    with native_passes.python_passes():
        assert native_passes.describe([torch.randn(2)]) is None
        assert description is not None and not description.matches([torch.randn(2)])
        assert native_passes.status().startswith("off")


# ------------------------------------------------------------------------------------ where it cannot build
@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The module as in a new process (nothing tried yet), building into an empty cache."""
    monkeypatch.setattr(native_passes, "_tried", False)
    monkeypatch.setattr(native_passes, "_module", None)
    monkeypatch.setattr(native_passes, "_state", "not built yet")
    monkeypatch.setattr(native_passes, "_enabled", True)
    monkeypatch.setenv("OVERLAP_NATIVE_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("compiler", "reason"), [("/nonexistent/c++", "no C++ compiler"), ("false", "compile failed")])
def test_a_machine_that_cannot_build_it_says_why_and_runs_the_python_passes(
        fresh_state: Path, monkeypatch: pytest.MonkeyPatch, compiler: str, reason: str) -> None:
    monkeypatch.setenv("CXX", compiler)
    tensors = [torch.randn(3), torch.randn(2, 2).t()]
    assert native_passes.loaded() is None
    assert native_passes.status().startswith(f"unavailable: {reason}"), native_passes.status()
    assert native_passes.addresses(tensors) == tuple(t.data_ptr() for t in tensors)
    assert native_passes.contiguous(tensors) is False and native_passes.describe(tensors) is None
    assert not list(fresh_state.glob("*.so")), "a failed build left a file behind"


def test_the_build_native_command_says_why_not_and_exits_1(fresh_state: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from overlap.demo.cli import main

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert main(["build-native"]) == 1
    out = capsys.readouterr().out
    assert "native passes: unavailable: no C++ compiler (/nonexistent/c++ not found; set CXX)" in out, out
    assert "built:" not in out and not list(fresh_state.iterdir())


def test_the_torch_fallbacks_caller_never_builds_it(fresh_state: Path) -> None:
    """``dtypes(..., build=False)`` (the runtime's reduce, which runs on the torch fallback's path
    too) reads through the extension only once something else has loaded it."""
    assert native_passes.dtypes([torch.randn(2)], build=False) == (torch.float32,)
    assert native_passes.status() == "not built yet" and not list(fresh_state.iterdir())


def test_the_build_key_follows_the_compiler_and_the_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = native_passes.build_key()
    monkeypatch.setenv("CXX", "some-other-c++")
    assert native_passes.build_key() != key
    monkeypatch.delenv("CXX", raising=False)
    source = tmp_path / "native_passes.cpp"
    source.write_bytes(native_passes.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native_passes, "SOURCE", source)
    assert native_passes.build_key() != key
    command = native_passes.compile_command(tmp_path / "out.so", "c++20")
    assert f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in command and str(source) in command


def test_a_cache_folder_that_cannot_be_made_leaves_the_python_passes(fresh_state: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache path under a file (as an unwritable home would): the reason is stated, nothing raises."""
    blocker = fresh_state / "a file"
    blocker.write_text("")
    monkeypatch.setenv("OVERLAP_NATIVE_CACHE", str(blocker / "native"))
    tensors = [torch.randn(2)]
    assert native_passes.addresses(tensors) == (tensors[0].data_ptr(),)
    assert native_passes.status().startswith("unavailable: ") and "Error" in native_passes.status()
