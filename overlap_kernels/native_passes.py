"""Per-tensor passes over a list in one C++ loop each: the packing ops' host cost that grows with the
parameter count.

Contract: every function here gives exactly what its Python definition gives (the fallback, used
when the extension is not built or is turned off):

* ``addresses(tensors)``: the tensors' ``data_ptr()`` values, in order, as ``Addresses``: a
  hashable key (equal keys, equal addresses) that ``address_column`` turns into an int64 array.
  The extension packs them into ``bytes`` (8 native-endian bytes each), the Python definition
  makes a tuple of ints: the two never meet in one cache key, each is exact for its path;
* ``contiguous(tensors)``: ``all(t.is_contiguous() for t in tensors)``;
* ``dtypes(tensors)``: ``tuple(t.dtype for t in tensors)``;
* ``address_column(addresses)``: the addresses as an int64 array (read-only), from either form;
* ``increment_version(tensors)``: ``torch.autograd.graph.increment_version(list(tensors))``;
* ``describe(tensors)``: a ``Description`` of each tensor's exact Python type, dispatch key set,
  dtype, device, ``requires_grad``, sizes and strides, or ``None`` when an item is not exactly a
  ``torch.Tensor`` / ``nn.Parameter`` (or has symbolic sizes) or the extension is not loaded;
* ``Description.matches(tensors)``: whether every tensor still has what the description recorded
  (and the list its length).

``tensors`` is a sequence of tensors. For one that is not a list or a tuple, or that holds something
other than exact ``torch.Tensor`` / ``nn.Parameter`` objects, the extension hands over to the Python
definition, or there is no description.

[Note: native passes]
At 300 parameters each C-level pass from Python (``map(Tensor.data_ptr, ...)``, torch's
``increment_version``, a ``TensorGuards`` check) costs 14-17 µs on the 2-core CI box, about 50 ns a
tensor: the call through Python's method machinery, the argument unpacking, a Python int made per
tensor. The issue's target for a repeat launch is 15 µs + 0.05 µs per parameter, so one such pass
alone takes the whole per-parameter budget and a public op made three (benchmarks/RESULTS.md,
"Issue 28's host µs per packing call on CPU"). A loop in C++ over the same list reads each tensor's
fields directly (about 5-15 ns a tensor).

The extension is ``native_passes.cpp`` next to this file, compiled the first time a pass is needed,
against the installed torch and Python, by the C++ compiler (``$CXX``, else the first of ``c++``,
``g++``, ``clang++`` found) in one
process per machine (a file lock; the others wait and load it), and kept under
``$OVERLAP_NATIVE_CACHE`` (default ``~/.cache/triton-overlap/native``) keyed on the source, the torch
build, the Python ABI and the flags: a torch upgrade builds a new one. A build takes about 11 s on the
CI box. Where it cannot be built (no compiler, no Python headers, not Linux, a compile error) the
reason is logged once, ``status()`` says it, and the Python definitions run: slower, never different.
``OVERLAP_NATIVE_PASSES=0`` skips the build and the extension; ``python_passes()`` turns it off
for a block (tests and benchmarks compare the two paths). Only the Triton path uses these
passes (CUDA, or CPU under ``TRITON_INTERPRET=1``): the torch fallback on CPU never builds it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import operator
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_passes.cpp")
BUILD_TIMEOUT_SECONDS = 600

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_module: ModuleType | None = None
_state = "not built yet"  # what status() says
_tried = False
_lock = threading.Lock()


def enabled_by_environment() -> bool:
    """``OVERLAP_NATIVE_PASSES`` is not ``0``."""
    return os.environ.get("OVERLAP_NATIVE_PASSES", "1") != "0"


_enabled = enabled_by_environment()


def status() -> str:
    """``"native"`` when the extension is in use, else why not (``"off ..."``, ``"unavailable: ..."``,
    ``"not built yet"``)."""
    if not _enabled:
        return "off (OVERLAP_NATIVE_PASSES=0 or python_passes())"
    return _state


def active() -> bool:
    """Whether the passes run natively now (built, loaded and not turned off); builds nothing."""
    return _enabled and _module is not None


def loaded() -> ModuleType | None:
    """The extension, built and loaded on the first call (``None``: off or unavailable)."""
    if not _enabled:
        return None
    if not _tried:
        _load_once()
    return _module


@contextlib.contextmanager
def python_passes() -> Iterator[None]:
    """While active (process-wide), every pass runs its Python definition."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


Addresses = bytes | tuple[int, ...]
"""Data addresses of a list, in order: packed int64 ``bytes`` (the extension) or a tuple of ints."""


def addresses(tensors: Sequence[torch.Tensor]) -> Addresses:
    """Each tensor's ``data_ptr()``, in order (``Addresses``)."""
    return _natively_or("addresses", tensors, _python_addresses)


def contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is contiguous."""
    return _natively_or("contiguous", tensors, _python_contiguous)


def dtypes(tensors: Sequence[torch.Tensor], build: bool = True) -> tuple[torch.dtype, ...]:
    """Each tensor's dtype, in order (``build=False``: through the extension only if it is already
    loaded, for a caller on the torch fallback's path too, which must not build it)."""
    return _natively_or("dtypes", tensors, _python_dtypes, build)


def _python_addresses(tensors: Sequence[torch.Tensor]) -> Addresses:
    return tuple(map(_DATA_PTR, tensors))


def _python_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(map(_IS_CONTIGUOUS, tensors))


def _python_dtypes(tensors: Sequence[torch.Tensor]) -> tuple[torch.dtype, ...]:
    return tuple(map(_DTYPE, tensors))


def _usable(build: bool = True) -> ModuleType | None:
    """The extension if on and loaded; built now first if ``build`` and not tried yet."""
    return _module if _enabled and (_tried or not build) else loaded()


def _natively_or(name: str, tensors: Sequence[torch.Tensor], python: Callable, build: bool = True):
    """The extension's ``name`` over ``tensors`` (built now if ``build`` and not tried yet), or
    ``python(tensors)`` where it is off, unavailable or hands the list back (``None``)."""
    module = _usable(build)
    if module is not None and type(tensors) in (list, tuple):
        read = getattr(module, name)(tensors)
        if read is not None:
            return read
    return python(tensors)


def address_column(addresses: Addresses) -> np.ndarray:
    """``addresses`` (either form) as an int64 array, read-only."""
    if type(addresses) is bytes:
        return np.frombuffer(addresses, dtype=np.int64)
    return np.array(addresses, dtype=np.int64)


def increment_version(tensors: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.graph.increment_version`` over ``tensors`` (tensors made under inference
    mode have no version counter and are skipped)."""
    module = _usable()
    if module is not None and type(tensors) in (list, tuple):
        module.increment_version(tensors)
    else:
        torch.autograd.graph.increment_version(list(tensors))


class Description:
    """What ``describe`` recorded of a list, for ``matches``."""

    __slots__ = ("_words", "_matches")

    def __init__(self, words: bytes, matches: Callable[[object, bytes], bool]) -> None:
        self._words, self._matches = words, matches

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether each of ``tensors`` (a list or a tuple) has the recorded exact type, dispatch keys,
        dtype, device, ``requires_grad``, sizes and strides, and the list the recorded length
        (``False`` while ``python_passes()`` is active: the caller checks the list in Python)."""
        return _enabled and self._matches(tensors, self._words)


def describe(tensors: Sequence[torch.Tensor]) -> Description | None:
    """A ``Description`` of ``tensors`` (a list or a tuple), or ``None`` (extension off or
    unavailable, or an item not exactly a ``torch.Tensor`` / ``nn.Parameter``)."""
    module = loaded()
    if module is None or type(tensors) not in (list, tuple):
        return None
    words = module.describe(tensors)
    return None if words is None else Description(words, module.matches)


# -------------------------------------------------------------------------------------------- build
def _load_once() -> None:
    global _module, _state, _tried
    with _lock:
        if _tried:
            return
        try:
            path, reason = _built()
            if path is None:
                _state = f"unavailable: {reason}"
                _log.warning("overlap_kernels: the native passes are unavailable (%s); the Python passes run "
                             "(slower host path, same results)", reason)
            else:
                _module = _import(path)
                _state = "native"
        except Exception as e:  # noqa: BLE001 - any failure to build or load leaves the Python passes
            _state = f"unavailable: {type(e).__name__}: {e}"[:300]
            _log.warning("overlap_kernels: the native passes failed to load (%s); the Python passes run", _state)
        _tried = True


COMPILERS = ("c++", "g++", "clang++")
"""Looked for in this order when ``$CXX`` is not set."""


def compiler() -> str | None:
    """``$CXX`` if set (and found), else the first of ``COMPILERS`` on the ``PATH``; ``None``: none."""
    named = os.environ.get("CXX")
    for candidate in (named,) if named else COMPILERS:
        found = shutil.which(candidate)
        if found is not None:
            return found
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("OVERLAP_NATIVE_CACHE") or Path.home() / ".cache" / "triton-overlap" / "native")


def compile_command(output: Path, standard: str) -> list[str]:
    """The compiler's command line for ``native_passes.cpp`` against this torch and Python (the
    include and library folders ``torch.utils.cpp_extension`` names for a CPU extension; importing
    it would look for a CUDA toolkit, which this file does not need)."""
    root = Path(torch.__file__).parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include",
                sysconfig.get_paths()["include"]]
    libraries = [root / "lib"]
    return [
        compiler() or "c++", f"-std={standard}", "-O2", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *[f"-I{p}" for p in includes], str(SOURCE), "-o", str(output),
        *[f"-L{p}" for p in libraries], "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        *[f"-Wl,-rpath,{p}" for p in libraries],
    ]


def build_key() -> str:
    """What the built file depends on: the source, the torch build, the Python ABI, the compiler."""
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.git_version).encode(),
             sys.version.encode(), str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
             str(compiler()).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _built() -> tuple[Path | None, str]:
    """The built extension's path (building it now if needed), or ``None`` and why not."""
    if not sys.platform.startswith("linux"):
        return None, f"built on Linux only (this is {sys.platform})"
    if compiler() is None:
        return None, f"no C++ compiler ({os.environ.get('CXX') or ' / '.join(COMPILERS)} not found; set CXX)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return None, "no Python headers (Python.h) for this interpreter"
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"native_passes_{build_key()}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if path.exists():
        return path, ""
    with open(directory / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine; the others wait for it
        if path.exists():
            return path, ""
        # a name no other process writes, even on another host sharing this cache (where flock may not hold)
        partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        errors = []
        for standard in ("c++20", "c++17"):  # torch 2.13+ builds with C++20, older with C++17
            _log.info("overlap_kernels: building the native passes (%s, once per torch build)", standard)
            done = subprocess.run(compile_command(partial, standard), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_SECONDS)
            if done.returncode == 0:
                os.replace(partial, path)
                return path, ""
            errors.append(f"{standard}: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
        partial.unlink(missing_ok=True)
        return None, f"compile failed ({'; '.join(map(str, errors))})"


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("_native_passes", str(path))
    spec = importlib.util.spec_from_file_location("_native_passes", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
