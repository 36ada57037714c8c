"""``overlap_kernels._device_function.device_function``: ``triton.jit`` for kernel helpers, whose calls
from inside an interpreted launch skip the interpreter's repeat patch of ``triton.language``
([Note: the interpreter's per-call patch]). The results of every packing kernel under the
interpreter are checked against pure-torch references elsewhere (tests/packing); here: what the
decorator returns, that a launch patches the language once whatever its helper calls, and that
the results are the plain helper's."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from overlap_kernels._device_function import _language_patched, device_function
from overlap_kernels._jit import INTERPRET

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (tests/conftest.py sets it "
                                                             "where no GPU is visible)")


@device_function
def _twice(x):
    return x * 2


@triton.jit
def _twice_plain(x):
    return x * 2


@triton.jit
def _three_doublings_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, DEVICE_FUNCTION: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for _ in tl.static_range(3):
        if DEVICE_FUNCTION:
            x = _twice(x)
        else:
            x = _twice_plain(x)
    tl.store(out_ptr + offsets, x)


def test_it_is_the_jit_function_triton_makes() -> None:
    """On a GPU build exactly ``triton.jit``'s type; under the interpreter its subclass."""
    plain = type(_twice_plain)
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        assert plain is InterpretedFunction and isinstance(_twice, InterpretedFunction)
    else:
        assert type(_twice) is plain and isinstance(_twice, JITFunction)


@needs_interpreter
@pytest.mark.parametrize("device_function_helper", [True, False], ids=["device_function", "triton.jit"])
def test_a_launch_patches_the_language_once_whatever_its_helpers_call(monkeypatch: pytest.MonkeyPatch,
                                                                        device_function_helper: bool) -> None:
    """Two programs, each calling the helper three times: one patch for the launch with
    ``device_function`` helpers, 1 + 2 x 3 with ``triton.jit`` ones; the same values either way,
    and the language restored afterwards (so a call outside a launch is the interpreter's own)."""
    import triton.runtime.interpreter as interpreter

    patches = []
    original = interpreter._patch_lang

    def counting(fn):
        patches.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    assert not _language_patched()
    _three_doublings_kernel[(2,)](x, out, BLOCK=4, DEVICE_FUNCTION=device_function_helper)
    assert not _language_patched(), "the launch restores triton.language"
    assert torch.equal(out, x * 8)
    assert len(patches) == (1 if device_function_helper else 1 + 2 * 3), patches
    assert patches[0] == "_three_doublings_kernel"
