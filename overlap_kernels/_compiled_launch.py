"""Repeat CUDA launches go straight to a kernel's compiled binary, past Triton's per-call JIT path.

Contract: ``run(kernel, programs, args, constexprs, options)`` does what
``kernel[(programs,)](*args, **constexprs, **options)`` does, on the current CUDA device and
stream, and costs a few microseconds of host time once the same kind of launch has been seen.

[Note: launching the compiled kernel]
``kernel[grid](...)`` runs Triton's ``JITFunction.run`` at every call. It reads the device and
stream, binds and specializes every argument, builds the cache key as a string of the
specialization and the options, looks the compiled kernel up, checks the globals the kernel read,
builds launch metadata for the launch hooks, and only then calls the compiled kernel's launcher.
On the first H100 run (Triton 3.6) a packing op cost 61-97 µs of host time per launch, of which
our own table and check work was 7-12 µs. On a GPU that host time is what the overlap must hide
behind.

For one kernel, the compiled binary depends on the constexprs, the compile options, two runtime
knobs (debug, instrumentation mode) and the *specialization* of the runtime arguments. Triton
3.6-3.9 specialize:

* a tensor on its dtype and on whether its address is 16-byte aligned;
* an int on whether it equals 1, whether it is divisible by 16, and its range (i32, i64, u64);
* a float or a bool on its type only.

``run`` keys its own cache on exactly these, read in a few C calls per argument
(``specialization_key``). tests/packing/test_compiled_launch.py checks the key against Triton's
own specialization function over drawn arguments, so a Triton that specializes on more fails
there, not silently in a launch. A key seen before calls the compiled kernel's launcher with the
arguments in the kernel's parameter order, constexprs included, as Triton itself passes them. A
new key goes through ``kernel[grid]`` once; that compiles or finds the kernel and returns it.

Launch hooks (``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, a profiler's)
take the JIT path every time, so they see every launch with its metadata. So do arguments of any
other type (a tensor subclass, a tensor descriptor): the JIT path is always correct, only slower.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

_I32 = 1 << 31
_I64 = 1 << 63

_LAUNCHERS: dict[tuple, tuple[Any, Any, Any, tuple[object, ...]]] = {}
"""key -> (launcher, CUfunction, packed metadata, constexpr tail in parameter order)."""


def specialization_key(arg: object) -> object:
    """What Triton specializes a runtime argument on ([Note: launching the compiled kernel]);
    ``None`` for a type this module does not key (the launch then takes the JIT path)."""
    cls = type(arg)
    if cls is torch.Tensor:
        return arg.dtype, not arg.data_ptr() & 15
    if cls is int:
        return arg == 1, not arg & 15, -_I32 <= arg < _I32, arg < _I64
    if cls is float or cls is bool:
        return cls
    return None


def _no_hooks() -> bool:
    """Whether no launch hook is installed (Triton 3.6+ keeps a ``HookChain`` that is never None)."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def run(kernel: triton.JITFunction, programs: int, args: Sequence[object], constexprs: dict[str, object],
        options: dict[str, object], device: int | None = None) -> None:
    """``kernel[(programs,)](*args, **constexprs, **options)`` on the current CUDA device (its index
    ``device`` when the caller knows it) and stream; ``args`` are the kernel's leading parameters,
    ``constexprs`` the rest by name."""
    specialization = tuple(map(specialization_key, args))
    if None in specialization or not _no_hooks():
        kernel[(programs,)](*args, **constexprs, **options)
        return
    if device is None:
        device = current_device_index()
    knobs = triton.knobs
    key = (kernel, device, specialization, tuple(constexprs.items()), tuple(options.items()),
           knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    cached = _LAUNCHERS.get(key)
    if cached is None:
        compiled = kernel[(programs,)](*args, **constexprs, **options)
        _remember(key, kernel, compiled, len(args), constexprs)
        return
    launcher, function, metadata, tail = cached
    launcher(programs, 1, 1, current_stream_handle(device), function, metadata, None, None, None, *args, *tail)


def _remember(key: tuple, kernel: triton.JITFunction, compiled: object, leading: int,
              constexprs: dict[str, object]) -> None:
    """Cache what a direct launch of ``compiled`` needs, if it is a loaded compiled kernel (an
    asynchronous compile returns a future: that key then keeps taking the JIT path)."""
    try:
        launcher = compiled.run  # loads the module on first access, as the JIT launch already did
        function, metadata = compiled.function, compiled.packed_metadata
    except AttributeError:
        return
    tail = []
    for param in kernel.params[leading:]:
        if param.name in constexprs:
            tail.append(constexprs[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:  # the JIT path would have refused the call already
            return
    _LAUNCHERS[key] = (launcher, function, metadata, tuple(tail))


def cached_launches() -> int:
    """How many kinds of launch go direct (for tests and benchmarks)."""
    return len(_LAUNCHERS)


def current_device_index() -> int:
    """The current CUDA device's index: one C call once CUDA is initialized (``torch.cuda.
    current_device`` adds a Python-level lazy-init check around the same call)."""
    return _GET_DEVICE() if _GET_DEVICE is not None and torch.cuda.is_initialized() else torch.cuda.current_device()


def current_stream_handle(index: int) -> int:
    """The ``cudaStream_t`` of device ``index``'s current stream, as an int: what Triton's own
    driver reads (``torch.cuda.current_stream(index).cuda_stream`` builds a ``Stream`` object
    around the same call)."""
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
